"""One scorer for the evaluations that compare continuations by their loss: HellaSwag and CORE.

A task renders each question as a group of rows (:class:`Row`): token ids, and the span of them
that is scored, token ``t`` by the logits at position ``t - 1``. :func:`score_groups` returns, for
each row, the summed and mean cross-entropy of its scored tokens and, where asked, whether greedy
decoding reproduces every one of them (:class:`Scored`). How it runs the model changes no result:

- rows share forward passes (right-padded) up to a token budget, and only the scored positions are
  projected onto the vocabulary: the vocab matmul and its fp32 log-softmax are most of a small
  model's cost;
- with our GPT (a model with ``make_kv_cache``), the prefix that a question's rows share (the
  few-shot examples and the question) is computed once per question; each row's own tokens then
  continue it through a ragged KV cache, at their own positions;
- other models (transformers' GPT2LMHeadModel) get whole rows, asked for the scored positions'
  logits with ``logits_to_keep`` where they take it;
- ``batch_tokens=0``: one question per forward pass with every position's logits, the plain way
  (the reference that the tests and bench.py compare with).

Importing this imports neither torch nor anything else heavy.
"""

import inspect
from typing import NamedTuple

from common import UsageError, autocast, device_type_of


class Row(NamedTuple):
    """One option of a question: ``tokens[start:end]`` are scored (1 <= start < end <=
    len(tokens) <= the model's context)."""
    tokens: list
    start: int
    end: int


class Scored(NamedTuple):
    """A row's summed and mean cross-entropy (fp32) over its scored tokens, and whether the argmax
    of the logits at every scored position is the scored token (None where not asked for)."""
    sum_loss: float
    mean_loss: float
    greedy: bool


def progress_bar(**kwargs):
    """tqdm bar that is disabled when stderr is not a terminal (``disable=None``)."""
    from tqdm import tqdm

    return tqdm(disable=None, **kwargs)


# ---------------------------------------------------------------------------
# losses of the scored tokens

def _token_losses(picked, targets):
    """fp32 cross-entropy of each row of ``picked`` (K, V) against ``targets`` (K,); 0 at -100."""
    import torch
    import torch.nn.functional as F

    if picked.device.type == "cpu" and picked.shape[0] > 256:
        # in pieces that stay in cache: the fp32 log-softmax over the vocab is most of the CPU cost
        return torch.cat([F.cross_entropy(p.float(), t, reduction="none")
                          for p, t in zip(picked.split(256), targets.split(256))])
    return F.cross_entropy(picked.float(), targets, reduction="none")


def _greedy_hits(logits, targets, index=None):
    """Whether the argmax of row ``index[k]`` of ``logits`` (N, V) is ``targets[k]`` (index None:
    row k). On the CPU the maximum first, a third of argmax's cost over the vocab, then argmax
    only where the target's logit reaches it (a tie goes to the lowest id, as argmax's)."""
    import torch

    if index is None:
        index = torch.arange(logits.shape[0], device=logits.device)
    if logits.device.type != "cpu":  # no read-back in the middle of the passes
        return logits[index].argmax(dim=-1) == targets
    hit = logits[index, targets] == logits.amax(dim=-1)[index]
    reach = hit.nonzero()[:, 0]
    if reach.numel():
        hit[reach] = logits[index[reach]].argmax(dim=-1) == targets[reach]
    return hit


def completion_losses(logits, tokens, mask, positions=None, check_positions=True, greedy=True):
    """Per-row summed and mean cross-entropy of the masked (scored) tokens of ``tokens`` ``(R, N)``
    and whether greedy decoding picks every one of them (``greedy=False``: None, not computed: an
    argmax over the vocabulary at every scored position); position ``t`` predicts token ``t + 1``
    (the shift is done here). ``logits``: ``(R, N, V)``, or what ``model(idx,
    logits_to_keep=positions)`` returns: ``(R, len(positions), V)`` for 1-D positions, every scored
    one among them; ``(K, V)`` for an ``(R, N)`` bool mask of exactly the K scored positions, row by
    row. Checked unless ``check_positions=False``. Losses in fp32 (the logits may be bf16).
    Returns ``(sum_loss, avg_loss, greedy)``: ``(R,)`` fp32, fp32 and bool (or None)."""
    import torch

    dev = logits.device
    tgt_mask, tgt = mask[:, 1:].to(dev).bool(), tokens[:, 1:].to(dev)  # (R, N-1): the targets
    missed, exact = 0, positions is not None and positions.dim() == 2
    if positions is None:
        logits = logits[:, :-1]
    elif exact:  # position t's target is token t + 1: the last position is never kept
        keep = positions.to(dev)
        if check_positions:  # kept positions that are not scored, scored ones not kept
            missed = int((keep[:, :-1] != tgt_mask).sum() + keep[:, -1].sum())
        tgt_mask, tgt = keep, tokens.to(dev).roll(-1, dims=1)
    else:
        pos = positions.to(dev)
        if check_positions:  # scored positions the logits lack
            missed = int(tgt_mask.sum() - tgt_mask[:, pos].sum())
        tgt_mask, tgt = tgt_mask[:, pos], tgt[:, pos]
    bad = logits.dim() != 2 if exact else logits.dim() != 3 or logits.shape[:2] != tgt.shape
    if bad or missed:
        where = ""
        if positions is not None:
            where = f" at {positions.numel()} positions ({missed} scored ones missing or extra)"
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match tokens shape "
                         f"{tuple(tokens.shape)}{where}")
    targets = tgt[tgt_mask]  # (K,)
    if positions is None or exact:
        picked = logits if exact else logits[tgt_mask]
        token_loss = _token_losses(picked, targets)  # (K,)
        hit = _greedy_hits(picked, targets) if greedy else None
    else:
        # nearly every kept position is scored: cross-entropy over all of them in place (-100: not
        # scored) beats copying the scored rows out of the logits first
        flat = logits.reshape(-1, logits.shape[-1])
        ignored = torch.where(tgt_mask, tgt, torch.full_like(tgt, -100))
        token_loss = _token_losses(flat, ignored.reshape(-1))[tgt_mask.reshape(-1)]
        hit = None
        if greedy:
            hit = _greedy_hits(flat, targets, tgt_mask.reshape(-1).nonzero()[:, 0])
    rows = tgt_mask.nonzero()[:, 0]
    sum_loss = torch.zeros(tokens.shape[0], dtype=torch.float32, device=dev)
    sum_loss.index_add_(0, rows, token_loss)
    count = tgt_mask.sum(dim=1).clamp(min=1).to(torch.float32)
    if hit is None:
        return sum_loss, sum_loss / count, None
    misses = torch.zeros(tokens.shape[0], dtype=torch.long, device=dev)
    misses.index_add_(0, rows, (~hit).long())
    return sum_loss, sum_loss / count, misses == 0


# ---------------------------------------------------------------------------
# asking a model for logits

def _model_logits(out):
    """Logits from our GPT's ``(logits, loss)`` tuple or an HF output's ``.logits``."""
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "logits", out)


def takes_logits_to_keep(model):
    """Whether ``model(idx, logits_to_keep=...)`` is a valid call: our GPT, HF GPT2LMHeadModel
    (which honours it from transformers 4.53 on; before, its ``**kwargs`` swallow it and every
    position comes back) or any forward with ``**kwargs``."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return False
    return any(p.name == "logits_to_keep" or p.kind is p.VAR_KEYWORD for p in params)


def takes_logits_mask(model):
    """Whether ``model(idx, logits_to_keep=)`` takes an ``(R, N)`` bool mask (our GPT; not HF)."""
    return getattr(model, "masked_logits_to_keep", False) is True


def shares_prefixes(model):
    """Whether the model continues ragged rows from a KV cache (our GPT's ``make_kv_cache``)."""
    return takes_logits_mask(model) and callable(getattr(model, "make_kv_cache", None))


def model_logits(model, idx, positions=None, use_kwarg=True):
    """Logits of ``model`` for ``idx`` at ``positions``: ``(R, N, V)`` for None, ``(R, len, V)``
    for 1-D positions, ``(K, V)`` for a bool mask (:func:`takes_logits_mask`), asked for by
    ``logits_to_keep`` (transformers' GPT2LMHeadModel.forward and our GPT.forward); a model that
    can't be asked (``use_kwarg=False``) or returns every position anyway (transformers < 4.53)
    is sliced here: same values, only slower."""
    import torch

    R, N = idx.shape
    if positions is None:
        logits = _model_logits(model(idx))
    elif use_kwarg and takes_logits_mask(model) and positions.dim() == 1:
        kept, order = torch.unique(positions.to(idx.device), sorted=True, return_inverse=True)
        keep = torch.zeros(R, N, dtype=torch.bool, device=idx.device)  # the same positions of
        keep[:, kept] = True  # every row, as a mask; their logits put back in the order asked
        return _model_logits(model(idx, logits_to_keep=keep)).view(R, kept.numel(), -1)[:, order]
    else:
        logits = _model_logits(model(idx, logits_to_keep=positions) if use_kwarg else model(idx))
        if positions.dim() == 2 and logits.dim() == 2:  # (K, V): the mask's kept positions
            return logits
        if logits.dim() == 3 and logits.shape[:2] == (R, N) and positions.numel() != N:
            logits = logits[:, positions.to(logits.device)]
    want = N if positions is None else positions.numel()
    if logits.dim() != 3 or logits.shape[:2] != (R, want):
        raise UsageError(f"model returned logits of shape {tuple(logits.shape)} for input "
                         f"{tuple(idx.shape)}; scoring needs ({R}, {want}, vocab)")
    return logits


def max_positions(model):
    """The model's context length (our GPTConfig.block_size, HF n_positions), if known."""
    config = getattr(model, "config", None)
    for key in ("block_size", "n_positions", "max_position_embeddings"):
        val = getattr(config, key, None)
        if isinstance(val, int) and val > 0:
            return val
    return None


# ---------------------------------------------------------------------------
# whole rows, packed into passes (models without a ragged KV cache, and the plain way)

# A forward pass projects the same positions of every row (the union of its rows' scored spans): it
# grows while the projections past the rows' own spans cost at most this fraction of its larger cost
SPAN_SLACK = 0.25


def _body_cost(model):
    """A token's cost in the blocks (12 n_layer n_embd^2) in vocab projections (n_embd vocab)."""
    try:
        return 12 * model.config.n_layer * model.config.n_embd / model.config.vocab_size
    except (AttributeError, TypeError, ZeroDivisionError):
        return 0.0


def _flat_rows(groups):
    """Every row as (group, row, first scored position, one past the last, width): scored token t
    is predicted at position t - 1, so a row scoring tokens start .. end-1 is scored at positions
    start-1 .. end-2."""
    return [(g, j, row.start - 1, row.end - 1, len(row.tokens))
            for g, rows in enumerate(groups) for j, row in enumerate(rows)]


def _pack(rows, batch_tokens, slack=SPAN_SLACK, body=0.0):
    """Group rows into forward passes. ``batch_tokens`` <= 0: one group (a question's rows) per
    pass, in order. Otherwise rows sorted by their scored span share a pass while rows x width
    stays within ``batch_tokens`` and rows x (union of the spans) exceeds the rows' own spans by at
    most ``slack`` x the larger of those spans and ``body`` x rows x width (``_body_cost``: a big
    model's passes project more to run fewer, fuller passes): rows are the unit, not questions."""
    if not batch_tokens or batch_tokens <= 0:
        by_group = {}
        for r in rows:
            by_group.setdefault(r[0], []).append(r)
        return list(by_group.values())
    batches, cur = [], None
    for row in sorted(rows, key=lambda r: (r[2], r[3], r[0], r[1])):
        _, _, lo, hi, width = row
        if cur is not None:
            union = cur["union"] + max(0, hi - max(lo, cur["hi"]))  # spans come sorted by start
            n, need, w = len(cur["batch"]) + 1, cur["need"] + hi - lo, max(cur["width"], width)
            if n * w <= batch_tokens and n * union <= need + slack * max(need, body * n * w):
                cur.update(union=union, need=need, hi=max(hi, cur["hi"]), width=w)
                cur["batch"].append(row)
                continue
        cur = {"batch": [row], "union": hi - lo, "need": hi - lo, "hi": hi, "width": width}
        batches.append(cur["batch"])
    return batches


def _padded(seqs, spans, device):
    """(tokens, mask) (R, N): the token lists right-padded with 0, mask 1 on each one's span."""
    import numpy as np
    import torch

    tok = np.zeros((len(seqs), max(len(s) for s in seqs)), dtype=np.int64)
    msk = np.zeros_like(tok)
    for k, (seq, (lo, hi)) in enumerate(zip(seqs, spans)):
        tok[k, : len(seq)] = seq
        msk[k, lo:hi] = 1
    return torch.from_numpy(tok).to(device), torch.from_numpy(msk).to(device)


def _whole_rows_pass(model, groups, batch, device, full_logits, use_kwarg, greedy):
    """One forward pass over whole rows: the (sum, mean, greedy) tensors of its rows (greedy None
    where not asked for)."""
    import numpy as np
    import torch

    rows = [groups[g][j] for g, j, *_ in batch]
    tokens, mask = _padded([r.tokens for r in rows], [(r.start, r.end) for r in rows], device)
    positions = None
    if not full_logits:  # the union of the rows' scored spans
        pos = np.unique(np.concatenate([np.arange(lo, hi) for _, _, lo, hi, _ in batch]))
        positions = torch.from_numpy(pos).to(device)
    logits = model_logits(model, tokens, positions, use_kwarg)
    return completion_losses(logits, tokens, mask, positions, check_positions=False,
                             greedy=greedy)


# ---------------------------------------------------------------------------
# shared prefixes once, then each row's own tokens (our GPT)

def _shared_prefix(rows):
    """How many leading tokens a group's rows share that no row scores the logits of: 0 for one
    row (nothing to share); else the common prefix, at most up to each row's first scored
    position (start - 1), whose logits its own pass must produce."""
    if len(rows) < 2:
        return 0
    limit = min(min(len(r.tokens) for r in rows), min(r.start for r in rows) - 1)
    first = rows[0].tokens
    for i in range(limit):
        if any(r.tokens[i] != first[i] for r in rows[1:]):
            return i
    return max(limit, 0)


# A chunk's rows read a ragged copy of its prefixes' keys and values: rows x (the longest prefix +
# the widest suffix) tokens of every layer, at most this many times batch_tokens (a question's
# options each copy its prefix: the cache holds a few times the tokens that the passes run), and
# at most CACHE_BYTES. The bytes bind for a large model only: GPT-2 XL's keys and values in bf16
# take 300 KiB a token, and 4 x 8192 tokens of them 9.4 GiB, beside the 23 GiB that training
# holds (docs/performance.md, "CORE's memory during training"); GPT-2 124M's and medium's chunks
# stay as the token bound makes them (1.1 and 3 GiB).
CACHE_TOKENS = 4
CACHE_BYTES = 4 * 2**30


def cache_tokens(model, batch_tokens, dtype=None):
    """The tokens a chunk's ragged KV cache may hold: CACHE_TOKENS x batch_tokens, and no more
    than CACHE_BYTES of the model's keys and values (every layer's, in dtype: autocast's, or the
    parameters' for None)."""
    bound = CACHE_TOKENS * batch_tokens
    config = model.config
    try:
        head = config.n_embd // config.n_head
        kv_heads = getattr(config, "n_kv_head", None) or config.n_head
        dtype = dtype or next(model.parameters()).dtype
        per_token = 2 * config.n_layer * kv_heads * head * dtype.itemsize
    except (AttributeError, TypeError, StopIteration):
        return bound
    return max(min(bound, CACHE_BYTES // per_token), 1)


def _chunks(groups, shared, batch_tokens, block_size, cached=None):
    """Groups into chunks of two passes each (their shared prefixes, then their rows' own tokens),
    sorted by prefix length: each pass runs at most ``batch_tokens`` tokens (the prefixes x the
    longest; the rows x the widest suffix), the cache that the rows read (rows x (the longest
    prefix + the widest suffix)) stays within ``cached`` tokens (None: ``CACHE_TOKENS`` x
    ``batch_tokens``; see cache_tokens), and the longest prefix + the widest suffix within the
    model's context. A group always fits alone."""
    if cached is None:
        cached = CACHE_TOKENS * batch_tokens
    order = sorted(range(len(groups)),
                   key=lambda g: (shared[g], max(len(r.tokens) for r in groups[g]) - shared[g]))
    chunks, cur = [], None
    for g in order:
        width = max(len(r.tokens) for r in groups[g]) - shared[g]
        if cur is not None:
            n_pre = cur["n_pre"] + int(shared[g] > 0)
            rows, pre = cur["rows"] + len(groups[g]), max(cur["pre"], shared[g])
            w = max(cur["width"], width)
            fits = (n_pre * pre <= batch_tokens and rows * w <= batch_tokens
                    and rows * (pre + w) <= cached)
            if fits and (block_size is None or pre + w <= block_size):
                cur.update(n_pre=n_pre, rows=rows, pre=pre, width=w)
                cur["groups"].append(g)
                continue
        cur = {"groups": [g], "n_pre": int(shared[g] > 0), "rows": len(groups[g]),
               "pre": shared[g], "width": width}
        chunks.append(cur["groups"])
    return chunks


def _prefix_pass(model, groups, chunk, shared, device, dtype):
    """The chunk's shared prefixes in one forward pass (right-padded, no logits): a KV cache whose
    row k holds the k-th prefix, and each group's row in it. dtype: autocast's (None: fp32)."""
    import torch

    with_prefix = [g for g in chunk if shared[g] > 0]
    if not with_prefix:
        return None, {}
    dtype = dtype or next(model.parameters()).dtype  # the keys' and values' dtype
    seqs = [groups[g][0].tokens[: shared[g]] for g in with_prefix]
    tokens, _ = _padded(seqs, [(0, 0)] * len(seqs), device)
    cache = model.make_kv_cache(len(seqs), tokens.shape[1], device, dtype)
    no_logits = torch.zeros(tokens.shape, dtype=torch.bool, device=device)
    model(tokens, kv_cache=cache, logits_to_keep=no_logits)
    return cache, {g: k for k, g in enumerate(with_prefix)}


def _suffix_pass(model, groups, chunk, shared, cache, cache_row, device, greedy):
    """Every row of the chunk past its group's shared prefix, continuing the prefix's cache at its
    own positions; logits only at the scored positions. The (sum, mean, greedy) tensors."""
    rows, seqs, spans, starts, lengths = [], [], [], [], []
    for g in chunk:
        s = shared[g]
        for row in groups[g]:
            rows.append(row)
            seqs.append(row.tokens[s:])
            spans.append((row.start - s, row.end - s))
            starts.append(cache_row.get(g, 0))
            lengths.append(s)
    tokens, mask = _padded(seqs, spans, device)
    keep = mask.roll(-1, dims=1).bool()  # position t is scored where token t + 1 is
    kv = None
    if cache is not None:
        kv = cache.continue_rows(starts, lengths, tokens.shape[1])
    logits = _model_logits(model(tokens, kv_cache=kv, logits_to_keep=keep))
    return completion_losses(logits, tokens, mask, keep, check_positions=False, greedy=greedy)


# ---------------------------------------------------------------------------
# the scorer

def _check_rows(groups, max_len):
    for g, rows in enumerate(groups):
        for j, row in enumerate(rows):
            if not 1 <= row.start < row.end <= len(row.tokens):
                raise ValueError(f"group {g} row {j}: scored span {row.start}:{row.end} of "
                                 f"{len(row.tokens)} tokens (needs 1 <= start < end <= length)")
            if max_len is not None and len(row.tokens) > max_len:
                raise ValueError(f"group {g} row {j}: {len(row.tokens)} tokens exceed the "
                                 f"model's {max_len} positions (the task crops its rows)")


def _passes(model, groups, batch_tokens, dtype=None):
    """The forward passes that score ``groups``: ("rows", batch of flat rows, full logits) or
    ("prefix", chunk of groups). dtype: the KV caches' (autocast's; None: the parameters')."""
    if batch_tokens > 0 and shares_prefixes(model):
        shared = [_shared_prefix(rows) for rows in groups]
        chunks = _chunks(groups, shared, batch_tokens, max_positions(model),
                         cache_tokens(model, batch_tokens, dtype))
        return shared, [("prefix", c) for c in chunks]
    body = _body_cost(model)
    return None, [("rows", b) for b in _pack(_flat_rows(groups), batch_tokens, body=body)]


def _agreed_passes(n_local, device, proc):
    """The largest number of forward passes over the ranks (FSDP: every rank runs as many)."""
    import torch
    import torch.distributed as dist

    if proc is None or proc.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return n_local
    t = torch.tensor([n_local], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def score_groups(model, groups, device, *, batch_tokens=8192, autocast_dtype=None,
                 device_type=None, desc=None, proc=None, greedy=False):
    """A list of :class:`Scored` per group of :class:`Row` (a question's options), in input
    order. Rows share forward passes up to ``batch_tokens`` tokens; ``batch_tokens=0``: one group
    per pass with every position's logits (the plain way). Sets ``eval()`` and ``no_grad`` and
    restores the mode. ``desc``: a tqdm label (None: no bar). ``proc`` (common.Proc): under an
    initialized process group, the caller gives each rank its own groups, and every rank runs as
    many forward passes (dummy ones), as FSDP needs. ``greedy``: whether each row's ``greedy`` is
    worked out (an argmax over the vocabulary at every scored position, which only a
    language-modeling task reads); else it is None."""
    import torch

    _check_rows(groups, max_positions(model))
    use_kwarg = takes_logits_to_keep(model)
    shared, passes = _passes(model, groups, batch_tokens, autocast_dtype)
    # sharded models (FSDP) gather parameters in every forward, a collective: every rank runs as
    # many, agreed before the first (a rank with fewer passes runs dummy ones after its own)
    planned = 0
    for kind, batch in passes:
        planned += 1
        if kind == "prefix" and any(shared[g] > 0 for g in batch):
            planned += 1  # its prefix pass
    agreed = _agreed_passes(planned, device, proc)
    dtype_ctx = autocast(device_type_of(device_type or device), autocast_dtype)
    order, results, n_forward = [], [], 0  # (group, row) of each result row, its tensors
    bar = None
    if desc is not None:
        bar = progress_bar(total=sum(len(rows) for rows in groups), unit="row", desc=desc)
    modes = [(m, m.training) for m in model.modules()]  # restored module by module
    model.eval()
    try:
        with torch.no_grad(), dtype_ctx:
            for kind, batch in passes:
                if kind == "rows":
                    results.append(_whole_rows_pass(model, groups, batch, device,
                                                    batch_tokens <= 0, use_kwarg, greedy))
                    order += [(g, j) for g, j, *_ in batch]
                    n_forward += 1
                else:
                    cache, cache_row = _prefix_pass(model, groups, batch, shared, device,
                                                    autocast_dtype)
                    results.append(_suffix_pass(model, groups, batch, shared, cache, cache_row,
                                                device, greedy))
                    order += [(g, j) for g in batch for j in range(len(groups[g]))]
                    n_forward += 1 + int(cache is not None)
                if bar is not None:
                    bar.update(results[-1][0].numel())
            if n_forward != planned:
                raise RuntimeError(f"scorer: {n_forward} forward passes run, {planned} planned")
            dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
            for _ in range(agreed - n_forward):
                model(dummy)
        # read back once for all the passes
        values = []
        if results:
            columns = [torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])]
            if greedy:
                columns.append(torch.cat([r[2] for r in results]).float())
            # one read-back (a GPU syncs once): the columns as rows of one fp32 tensor
            values = zip(*torch.stack(columns).tolist())
    finally:
        for m, training in modes:
            m.training = training
        if bar is not None:
            bar.close()
    out = [[None] * len(rows) for rows in groups]
    for (g, j), (s, m, *ok) in zip(order, values):
        out[g][j] = Scored(s, m, bool(ok[0]) if ok else None)
    return out


def gather(examples, proc):
    """Every rank's example results (a list each) on every rank, rank 0's first
    (all_gather_object): an evaluation that split its examples over the ranks sorts them back."""
    if proc is not None and proc.world_size > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            parts = [None] * proc.world_size
            dist.all_gather_object(parts, examples)
            examples = [e for part in parts for e in part]
    return examples
