"""HellaSwag evaluation, completion style.

Each example has a context and four candidate endings.  Every ending is
appended to the context (as ``" " + ending``) and scored by the
cross-entropy of its tokens given everything before them:

* ``acc``      picks the ending with the lowest *summed* loss,
* ``acc_norm`` picks the ending with the lowest *mean* (per-token) loss.

This file is both a library (``train_gpt2.py`` imports :func:`evaluate`,
which uses :func:`completion_losses`, the one scoring function) and a CLI::

    python hellaswag.py -m gpt2 -d cuda                  # HF GPT-2 (hub name or local dir)
    python hellaswag.py --checkpoint log/model_19072.pt  # one of our checkpoints
    python hellaswag.py -m gpt2 --limit 500              # quick subset
    python hellaswag.py -m gpt2 --benchmark --limit 200  # one-per-forward vs batched

Data: ``hellaswag_{train,val,test}.jsonl`` are downloaded into a cache folder
next to this file (``--data_dir`` / ``$HELLASWAG_DIR`` override it), first from
the HellaSwag authors' repository, then from the ``Rowan/hellaswag`` dataset
through HF ``datasets`` (converted to the same record schema).  Nothing is
downloaded, spawned or opened at import time.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

# ---------------------------------------------------------------------------
# data

DEFAULT_DATA_DIR = os.environ.get("HELLASWAG_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "hellaswag"
)

SPLITS = ("train", "val", "test")
URL_TEMPLATE = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
HF_DATASET = "Rowan/hellaswag"
HF_SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}
# number of examples per split (HellaSwag paper / HF dataset card); a freshly
# downloaded file with a different count is rejected
EXPECTED_COUNTS = {"train": 39905, "val": 10042, "test": 10003}
# key order of the original jsonl records
RECORD_KEYS = ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split",
               "split_type", "label", "endings", "source_id")


class HellaSwagUnavailable(Exception):
    """The HellaSwag data can't be had (offline and no local copy, bad HTTP
    status, wrong example count).  The message is a single line."""


class _SourceFailed(Exception):
    """One download source failed; the next one is tried."""


def _one_line(text, limit=160):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _resolve_data_dir(data_dir=None):
    # the env var is read at call time (not only at import) so it can be set late
    return data_dir or os.environ.get("HELLASWAG_DIR") or DEFAULT_DATA_DIR


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"unknown HellaSwag split {split!r}; expected one of {', '.join(SPLITS)}")


def _progress_bar(**kwargs):
    """tqdm bar that is disabled when stderr is not a terminal (``disable=None``)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a requirement
        return None
    return tqdm(disable=None, **kwargs)


def _http_get(url, timeout=30):
    """GET ``url`` as a streamed response (patched by the tests)."""
    import requests

    return requests.get(url, stream=True, timeout=timeout)


def _fetch_url(url, out_file):
    """Stream ``url`` into the open binary file ``out_file``; raise _SourceFailed on failure."""
    try:
        resp = _http_get(url)
    except Exception as e:  # connection refused, DNS, timeout, ...
        raise _SourceFailed(f"GitHub: {type(e).__name__}") from None
    try:
        if resp.status_code != 200:
            raise _SourceFailed(f"GitHub: HTTP {resp.status_code}")
        total = int(resp.headers.get("content-length", 0) or 0) or None
        bar = _progress_bar(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=os.path.basename(url))
        try:
            for chunk in resp.iter_content(chunk_size=1 << 20):
                if chunk:
                    out_file.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
        except _SourceFailed:
            raise
        except Exception as e:
            raise _SourceFailed(f"GitHub: {type(e).__name__} while reading") from None
        finally:
            if bar is not None:
                bar.close()
    finally:
        close = getattr(resp, "close", None)
        if close is not None:
            close()


def _load_hf_rows(split):
    """Rows of ``Rowan/hellaswag`` for ``split`` through HF ``datasets`` (patched by the tests)."""
    import logging

    import requests

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:  # fail fast: offline, `datasets` would retry for the best part of a minute
        requests.head(endpoint, timeout=10)
    except requests.RequestException as e:
        raise ConnectionError(f"cannot reach {endpoint} ({type(e).__name__})") from None

    import datasets

    hf_split = HF_SPLIT_NAMES[split]
    # keep the hub client's retry warnings out of the one-line error / training log
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        try:
            return datasets.load_dataset(HF_DATASET, split=hf_split)
        except Exception:
            # the repository's loading script is not supported by recent `datasets`;
            # the hub's automatic parquet conversion is
            return datasets.load_dataset(HF_DATASET, split=hf_split, revision="refs/convert/parquet")
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def hf_to_record(row, split=None):
    """Convert a ``Rowan/hellaswag`` row to the original jsonl record schema.

    HF stores ``label`` as a string ("" for the unlabelled test split); the
    original files store an int and have no ``label`` key for test.
    """
    rec = {}
    for key in RECORD_KEYS:
        if key not in row:
            continue
        val = row[key]
        if key == "label":
            if val is None or (isinstance(val, str) and val.strip() == ""):
                continue
            val = int(val)
        elif key == "ind":
            val = int(val)
        elif key == "endings":
            val = [str(e) for e in val]
        rec[key] = val
    if "ctx" not in rec and "ctx_a" in rec:
        rec["ctx"] = (rec["ctx_a"] + " " + rec.get("ctx_b", "")).strip()
    if "split" not in rec and split is not None:
        rec["split"] = split
    return rec


def _fetch_hf(split, out_file):
    try:
        rows = _load_hf_rows(split)
    except Exception as e:
        raise _SourceFailed(f"HF {HF_DATASET}: {_one_line(e, 80) or type(e).__name__}") from None
    try:
        for row in rows:
            line = json.dumps(hf_to_record(row, split)) + "\n"
            out_file.write(line.encode("utf-8"))
    except Exception as e:
        raise _SourceFailed(f"HF {HF_DATASET}: bad row ({type(e).__name__}: {_one_line(e, 60)})") from None


def _count_examples(path):
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _unavailable_message(split, path, reasons):
    url = URL_TEMPLATE.format(split=split)
    why = "; ".join(reasons) if reasons else "no source succeeded"
    return _one_line(
        f"HellaSwag data unavailable: {path} is missing and the download failed ({why}); "
        f"download {url} and save it as {path} (or point --data_dir / HELLASWAG_DIR at a folder "
        f"holding hellaswag_{split}.jsonl)",
        limit=10_000,
    )


def download(split, data_dir=None):
    """Return the path of ``hellaswag_{split}.jsonl``, downloading it if needed.

    An existing file is used as is.  Otherwise the sources are tried in order
    (the authors' GitHub jsonl, then HF ``Rowan/hellaswag``); each is written
    to a temporary file in the data folder, its example count checked, and only
    then renamed into place, so a partial file is never left behind (several
    DDP ranks may download at once).  Raises :class:`HellaSwagUnavailable`.
    """
    _check_split(split)
    data_dir = _resolve_data_dir(data_dir)
    path = os.path.join(data_dir, f"hellaswag_{split}.jsonl")
    if os.path.isfile(path):
        return path
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
        raise HellaSwagUnavailable(_unavailable_message(
            split, path, [f"cannot create {data_dir}: {_one_line(e, 100)}"])) from None

    sources = [
        ("GitHub", lambda f: _fetch_url(URL_TEMPLATE.format(split=split), f)),
        (f"HF {HF_DATASET}", lambda f: _fetch_hf(split, f)),
    ]
    reasons = []
    if os.environ.get("HELLASWAG_OFFLINE", "") not in ("", "0"):
        sources, reasons = [], ["HELLASWAG_OFFLINE is set"]
    for _name, fetch in sources:
        fd, tmp = tempfile.mkstemp(prefix=f".hellaswag_{split}.", suffix=".tmp", dir=data_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                fetch(f)
            n = _count_examples(tmp)
            expected = EXPECTED_COUNTS.get(split)
            if expected is not None and n != expected:
                raise _SourceFailed(f"{_name}: {n} examples, expected {expected}")
            os.replace(tmp, path)
            return path
        except _SourceFailed as e:
            reasons.append(str(e))
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    raise HellaSwagUnavailable(_unavailable_message(split, path, reasons))


def iterate_examples(split, data_dir=None):
    """Yield the records of ``hellaswag_{split}.jsonl`` (downloading it if needed)."""
    path = download(split, data_dir)
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if isinstance(rec.get("label"), str):  # tolerate HF-style string labels
                    rec = hf_to_record(rec, split)
                yield rec


# ---------------------------------------------------------------------------
# rendering

_ENC = None


def get_encoding():
    """The GPT-2 BPE (tiktoken), loaded once."""
    global _ENC
    if _ENC is None:
        import tiktoken

        _ENC = tiktoken.get_encoding("gpt2")
    return _ENC


def _render_lists(example, enc):
    """(context token list, list of 4 ending token lists, label or None)."""
    ctx_tokens = enc.encode(example["ctx"])
    ending_tokens = [enc.encode(" " + e) for e in example["endings"]]
    label = example.get("label")
    return ctx_tokens, ending_tokens, (None if label is None else int(label))


def render_example(example, enc=None):
    """Render one example into ``(data, tokens, mask, label)``.

    ``tokens`` is a ``(4, N)`` long tensor whose row ``i`` is the context tokens
    followed by the tokens of ``" " + endings[i]``, right-padded with 0;
    ``mask`` is 1 exactly on the ending tokens; ``label`` is the correct index
    (None for the unlabelled test split).
    """
    import torch

    enc = enc or get_encoding()
    ctx_tokens, ending_tokens, label = _render_lists(example, enc)
    rows = [ctx_tokens + end for end in ending_tokens]
    n = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), n), dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (row, end) in enumerate(zip(rows, ending_tokens)):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, len(ctx_tokens): len(row)] = 1
    data = {"label": label, "ctx_tokens": ctx_tokens, "ending_tokens": ending_tokens}
    return data, tokens, mask, label


# ---------------------------------------------------------------------------
# scoring


def completion_losses(logits, tokens, mask):
    """Per-row summed and mean cross-entropy of the masked (ending) tokens.

    ``logits`` ``(R, N, V)`` are the model outputs for ``tokens`` ``(R, N)``;
    position ``t`` predicts token ``t + 1`` (the shift is done here).  Only the
    positions whose *target* is masked are turned into log-probabilities, in
    fp32 (the logits may be bf16).  ``logits`` may also be ``(K, V)``: the
    rows for exactly those positions, already gathered in row-major order
    (what :func:`score_examples` gets when it restricts the model's
    ``lm_head`` to them).  Returns ``(sum_loss, avg_loss)``, each ``(R,)`` fp32.
    """
    import torch
    import torch.nn.functional as F

    R, N = tokens.shape
    sel = mask[:, 1:].to(device=logits.device).bool()      # (R, N-1): targets that are ending tokens
    targets = tokens[:, 1:].to(device=logits.device)[sel]  # (K,)
    if logits.dim() == 3 and logits.shape[:2] == (R, N):
        picked = logits[:, :-1, :][sel]                    # (K, V), only the needed positions
    elif logits.dim() == 2 and logits.shape[0] == targets.numel():
        picked = logits
    else:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match tokens shape {tuple(tokens.shape)} "
                         f"with {targets.numel()} masked targets")
    if picked.device.type == "cpu" and picked.shape[0] > 256:
        # in pieces that stay in cache: the fp32 log-softmax over the vocab is most of the CPU cost
        token_loss = torch.cat([F.cross_entropy(p.float(), t, reduction="none")
                                for p, t in zip(picked.split(256), targets.split(256))])
    else:
        token_loss = F.cross_entropy(picked.float(), targets, reduction="none")  # (K,)
    rows = sel.nonzero()[:, 0]
    sum_loss = torch.zeros(R, dtype=torch.float32, device=logits.device).index_add_(0, rows, token_loss)
    count = sel.sum(dim=1).clamp(min=1).to(torch.float32)
    return sum_loss, sum_loss / count


def _device_type(device, device_type=None):
    import torch

    if device_type:
        return str(device_type).split(":")[0]
    return torch.device(device).type


class _HeadRestriction:
    """While active, the model's ``lm_head`` (an ``nn.Linear``, as in our GPT and
    HF GPT2LMHeadModel) is applied only to the hidden states whose next token
    is an ending token, through a forward pre-hook; the model code is not
    touched.  The vocab projection of context and padding positions is the
    bulk of the work for a small model and is never used by the scoring.  If
    the model has no such head (or is torch.compile'd, or its forward does not
    tolerate the 2-D head output), every position is computed as usual."""

    def __init__(self, model, enabled=True):
        import torch

        head = getattr(model, "lm_head", None)
        ok = enabled and isinstance(head, torch.nn.Linear) and not hasattr(model, "_orig_mod")
        self.head = head if ok else None
        self.sel = None
        self.applied = False
        self._handle = None

    def __enter__(self):
        if self.head is not None:
            self._handle = self.head.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        return False

    def _hook(self, module, args):
        sel = self.sel
        if sel is None or not args or args[0].dim() != 3 or args[0].shape[:2] != sel.shape:
            return None
        self.applied = True
        return (args[0][sel],) + tuple(args[1:])

    def logits(self, model, idx, mask):
        """Logits for ``idx``: ``(K, V)`` at the needed positions when the head
        restriction applies, else ``(R, N, V)``."""
        import torch

        if self.head is not None:
            sel = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
            sel[:, :-1] = mask[:, 1:].bool()
            self.sel, self.applied = sel, False
            try:
                logits = _model_logits(model(idx))
            except Exception:
                logits = None  # e.g. the forward reshapes the head output: retried below without the hook
            finally:
                self.sel = None
            if logits is not None and self.applied:
                if logits.dim() == 2 and logits.shape[0] == int(sel.sum()):
                    return logits
                logits = None
            # the model did not go along (or never called its lm_head): full logits from now on
            self.__exit__()
            self.head = None
        else:
            logits = None
        if logits is None:
            logits = _model_logits(model(idx))
        if logits.dim() != 3 or logits.shape[:2] != idx.shape:
            raise RuntimeError(
                f"model returned logits of shape {tuple(logits.shape)} for input {tuple(idx.shape)}; "
                "HellaSwag scoring needs logits for every position"
            )
        return logits


def _model_logits(out):
    """Logits from our GPT's ``(logits, loss)`` tuple or an HF output's ``.logits``."""
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "logits", out)


def _max_positions(model):
    """The model's context length (our GPTConfig.block_size, HF n_positions), if known."""
    config = getattr(model, "config", None)
    for key in ("block_size", "n_positions", "max_position_embeddings"):
        val = getattr(config, key, None)
        if isinstance(val, int) and val > 0:
            return val
    return None


def _fit(rendered, max_len):
    """Drop the oldest context tokens of an example whose rows exceed the model's
    context (never happens for GPT-2's 1024 positions; guards small models)."""
    ctx, ends, label = rendered
    longest = max(len(e) for e in ends)
    if len(ctx) + longest <= max_len:
        return rendered
    keep = max(max_len - longest, 1)
    if longest + keep > max_len:
        raise ValueError(f"a HellaSwag ending of {longest} tokens does not fit the model's {max_len} positions")
    return ctx[-keep:], ends, label


def _pack(lengths, batch_tokens):
    """Group example indices into batches of at most ``batch_tokens`` (4 rows x
    padded length) tokens; longest first so similar lengths share a batch.
    ``batch_tokens`` <= 0 means one example per batch, in order."""
    if not batch_tokens or batch_tokens <= 0:
        return [[i] for i in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur, cur_len = [], [], 0
    for i in order:
        width = max(cur_len, lengths[i])
        if cur and 4 * (len(cur) + 1) * width > batch_tokens:
            batches.append(cur)
            cur, width = [], lengths[i]
        cur.append(i)
        cur_len = width
    if cur:
        batches.append(cur)
    return batches


def score_examples(model, examples, device, *, batch_tokens=8192, autocast_dtype=None,
                   device_type=None, progress=False, enc=None, rendered=None, restrict_head=True,
                   agree_forwards=None):
    """Score ``examples``; returns a list of dicts (one per example, in input
    order) with ``pred``, ``pred_norm``, ``label``, ``sum_loss``, ``avg_loss``
    (lists of 4 floats).  Several examples share a forward pass, up to
    ``batch_tokens`` tokens (rows are right-padded to the batch's longest row);
    ``batch_tokens=0`` scores one example per forward pass.  With
    ``restrict_head`` the model's ``lm_head`` only projects the positions that
    are scored (see :class:`_HeadRestriction`); the losses are the same.  The
    caller is responsible for ``no_grad`` / ``eval`` (see :func:`evaluate`).
    ``agree_forwards(n_local) -> n`` (see :func:`evaluate`) may ask for extra
    dummy forward passes so that every rank runs the same number of them."""
    import numpy as np
    import torch

    if rendered is None:
        enc = enc or get_encoding()
        rendered = [_render_lists(ex, enc) for ex in examples]
    max_len = _max_positions(model)
    if max_len:
        rendered = [_fit(r, max_len) for r in rendered]
    lengths = [len(ctx) + max(len(e) for e in ends) for ctx, ends, _ in rendered]
    dtype_ctx = contextlib.nullcontext()
    if autocast_dtype is not None:
        dtype_ctx = torch.autocast(device_type=_device_type(device, device_type), dtype=autocast_dtype)
    results = [None] * len(rendered)
    batches = _pack(lengths, batch_tokens)
    bar = _progress_bar(total=len(rendered), unit="ex", desc="hellaswag") if progress else None
    head = _HeadRestriction(model, enabled=restrict_head)
    try:
        head.__enter__()
        for batch in batches:
            width = max(lengths[i] for i in batch)
            nrows = sum(len(rendered[i][1]) for i in batch)
            tok = np.zeros((nrows, width), dtype=np.int64)
            msk = np.zeros((nrows, width), dtype=np.int64)
            r = 0
            for i in batch:
                ctx, ends, _ = rendered[i]
                for end in ends:
                    tok[r, : len(ctx)] = ctx
                    tok[r, len(ctx): len(ctx) + len(end)] = end
                    msk[r, len(ctx): len(ctx) + len(end)] = 1
                    r += 1
            tokens = torch.from_numpy(tok).to(device)
            mask = torch.from_numpy(msk).to(device)
            with dtype_ctx:
                logits = head.logits(model, tokens, mask)
            sum_loss, avg_loss = completion_losses(logits, tokens, mask)
            sum_loss, avg_loss = sum_loss.tolist(), avg_loss.tolist()
            r = 0
            for i in batch:
                k = len(rendered[i][1])
                s, a = sum_loss[r: r + k], avg_loss[r: r + k]
                r += k
                results[i] = {
                    "pred": min(range(k), key=s.__getitem__),
                    "pred_norm": min(range(k), key=a.__getitem__),
                    "label": rendered[i][2],
                    "sum_loss": s,
                    "avg_loss": a,
                }
            if bar is not None:
                bar.update(len(batch))
        extra = (agree_forwards(len(batches)) if agree_forwards is not None else len(batches)) - len(batches)
        if extra > 0:
            # sharded models (FSDP) gather parameters in every forward: all ranks must run as many
            dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
            for _ in range(extra):
                with dtype_ctx:
                    model(dummy)
    finally:
        head.__exit__()
        if bar is not None:
            bar.close()
    return results


_RENDER_CACHE = {}


def _rendered_subset(split, limit, rank, world_size, data_dir):
    """Rendered token lists of this rank's examples, cached across calls (training
    evaluates the same examples every few hundred steps); keyed by the file's
    path, size and mtime so a replaced file is re-read."""
    path = download(split, data_dir)
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, limit, rank, world_size)
    rendered = _RENDER_CACHE.get(key)
    if rendered is None:
        enc = get_encoding()
        examples = _load_split_subset(split, limit, rank, world_size, data_dir)
        rendered = [_render_lists(ex, enc) for ex in examples]
        if any(label is None for _, _, label in rendered):
            raise ValueError(f"the HellaSwag {split} split has examples without a label")
        _RENDER_CACHE.clear()  # one entry is enough
        _RENDER_CACHE[key] = rendered
    return rendered


def _load_split_subset(split, limit, rank, world_size, data_dir):
    examples = []
    for i, ex in enumerate(iterate_examples(split, data_dir)):
        if limit is not None and i >= limit:
            break
        if i % world_size == rank:
            examples.append(ex)
    return examples


def evaluate(model, device, *, split="val", limit=None, batch_tokens=8192, rank=0, world_size=1,
             autocast_dtype=None, data_dir=None, progress=False, device_type=None):
    """HellaSwag accuracy of ``model`` on ``split`` (completion style).

    Example ``i`` (counted after ``limit`` is applied to the full list) is
    scored on rank ``i % world_size``; with ``world_size > 1`` and an
    initialized process group the counts are summed over ranks (all_reduce),
    so every rank returns the global figures, and every rank runs the same
    number of forward passes (padding with tiny dummy ones), as a sharded
    (FSDP) model needs.  ``model(idx)`` may return a
    tuple ``(logits, ...)`` or an object with ``.logits``.  The model's
    train/eval mode is restored afterwards.  Raises HellaSwagUnavailable when
    the data can't be had.

    Returns ``{"n", "correct", "correct_norm", "acc", "acc_norm"}``.
    """
    import torch

    if split == "test":
        raise ValueError("the HellaSwag test split has no public labels; use split='val'")
    world_size = max(int(world_size), 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    rendered = _rendered_subset(split, limit, rank, world_size, data_dir)
    distributed = world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    def agree_forwards(n_local):  # the largest number of forward passes over the ranks
        t = torch.tensor([n_local], dtype=torch.long, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            results = score_examples(model, None, device, batch_tokens=batch_tokens,
                                     autocast_dtype=autocast_dtype, device_type=device_type,
                                     progress=progress, rendered=rendered,
                                     agree_forwards=agree_forwards if distributed else None)
    finally:
        model.train(was_training)
    n = len(results)
    correct = sum(int(r["pred"] == r["label"]) for r in results)
    correct_norm = sum(int(r["pred_norm"] == r["label"]) for r in results)
    if distributed:
        counts = torch.tensor([n, correct, correct_norm], dtype=torch.long, device=device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
        n, correct, correct_norm = (int(v) for v in counts.tolist())
    return {
        "n": n,
        "correct": correct,
        "correct_norm": correct_norm,
        "acc": correct / n if n else 0.0,
        "acc_norm": correct_norm / n if n else 0.0,
    }


BENCH_MODES = (
    # name, batch_tokens (None: the caller's), restrict_head
    ("naive", 0, False),   # one example per forward, logits for every position (the classic loop)
    ("single", 0, True),   # one example per forward, vocab projection only where scored
    ("batched", None, True),
)


def benchmark(model, device, examples, *, batch_tokens=8192, autocast_dtype=None, device_type=None,
              repeats=3, warmup=1, modes=("naive", "single", "batched")):
    """Examples/s of one-example-per-forward vs batched scoring on the same
    model, device and examples (rendering included in every mode).

    Modes: ``naive`` (one example per forward pass, full logits), ``single``
    (one example per forward pass, head restricted to the scored positions)
    and ``batched`` (``batch_tokens`` per forward pass, head restricted).
    ``warmup`` untimed passes over all the examples in every mode come first
    (a fresh process is much slower at first, above all in a VM); then
    ``repeats`` timed passes, the modes interleaved pass by pass so that load
    changes on the machine hit them alike; the best pass counts (the median
    is reported too).  Returns a dict with ``{mode}_ex_per_s``, ``{mode}_s``,
    ``{mode}_median_s``, ``{mode}_forwards``, ``speedup`` (batched over naive),
    ``speedup_vs_single`` and ``same_predictions`` (all modes agree on every
    prediction)."""
    import torch

    def sync():
        if _device_type(device, device_type) == "cuda":
            torch.cuda.synchronize()

    table = {name: (batch_tokens if bt is None else bt, rh) for name, bt, rh in BENCH_MODES if name in modes}
    enc = get_encoding()
    lengths = [len(c) + max(len(e) for e in ends) for c, ends, _ in (_render_lists(ex, enc) for ex in examples)]
    out = {"n": len(examples), "batch_tokens": batch_tokens, "device": str(device),
           "autocast_dtype": str(autocast_dtype).replace("torch.", "") if autocast_dtype else "fp32"}
    times = {name: [] for name in table}
    preds = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for it in range(max(warmup, 0) + max(repeats, 1)):
                for name, (bt, rh) in table.items():
                    sync()
                    t0 = time.perf_counter()
                    res = score_examples(model, examples, device, batch_tokens=bt, autocast_dtype=autocast_dtype,
                                         device_type=device_type, restrict_head=rh)
                    sync()
                    if it >= warmup:
                        times[name].append(time.perf_counter() - t0)
                    preds[name] = [(r["pred"], r["pred_norm"]) for r in res]
    finally:
        model.train(was_training)
    for name, (bt, _) in table.items():
        ts = sorted(times[name])
        out[f"{name}_s"] = ts[0]
        out[f"{name}_median_s"] = ts[len(ts) // 2]
        out[f"{name}_ex_per_s"] = len(examples) / ts[0]
        out[f"{name}_forwards"] = len(_pack(lengths, bt))
    if "batched" in table and "naive" in table:
        out["speedup"] = out["batched_ex_per_s"] / out["naive_ex_per_s"]
    if "batched" in table and "single" in table:
        out["speedup_vs_single"] = out["batched_ex_per_s"] / out["single_ex_per_s"]
    first = next(iter(preds.values()), None)
    out["same_predictions"] = all(p == first for p in preds.values())
    return out


def format_benchmark(b, name="model"):
    """Human-readable lines for a :func:`benchmark` result."""
    labels = {"naive": "one example per forward, full logits",
              "single": "one example per forward, scored positions only",
              "batched": f"batched, batch_tokens={b['batch_tokens']}"}
    lines = [f"{name} on {b['device']} ({b['autocast_dtype']}), {b['n']} examples"]
    for mode in ("naive", "single", "batched"):
        if f"{mode}_ex_per_s" in b:
            lines.append(f"{labels[mode]:<48} {b[f'{mode}_ex_per_s']:8.1f} examples/s "
                         f"({b[f'{mode}_forwards']} forwards, best {b[f'{mode}_s']:.2f} s, "
                         f"median {b[f'{mode}_median_s']:.2f} s)")
    if "speedup" in b:
        lines.append(f"batched vs one-example-per-forward: {b['speedup']:.2f}x")
    if "speedup_vs_single" in b:
        lines.append(f"batched vs one-example-per-forward with scored positions only: {b['speedup_vs_single']:.2f}x")
    lines.append(f"same predictions in every mode: {b['same_predictions']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(1, f"error: {_one_line(message, 10_000)} (see --help)\n")


def _pick_device(name):
    import torch

    if name in (None, "", "auto"):
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return "mps"
        return "cpu"
    dev = torch.device(name)  # raises RuntimeError on junk
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise RuntimeError(f"device {name!r} requested but MPS is not available")
    return name


def _pick_dtype(name, device, is_checkpoint):
    import torch

    if name == "fp32":
        return None
    if name == "bf16":
        return torch.bfloat16
    # auto: HF models in fp32 (that is how the reference values were measured);
    # our checkpoints in bf16 on a GPU that supports it (as evaluated during training)
    if is_checkpoint and torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def _load_model(args):
    if args.checkpoint:
        if not os.path.isfile(args.checkpoint):
            raise FileNotFoundError(f"checkpoint not found: {args.checkpoint}")
        import train_gpt2

        return train_gpt2.load_checkpoint_model(args.checkpoint, map_location="cpu")
    from train_gpt2 import GPT

    return GPT.from_pretrained(args.model)


def build_parser():
    p = _ArgumentParser(description="HellaSwag evaluation (completion style: acc = lowest summed loss, "
                                    "acc_norm = lowest mean loss of the ending tokens)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-m", "--model", help="HF GPT-2 hub name (gpt2, gpt2-medium, ...) or a local "
                                           "save_pretrained directory")
    src.add_argument("--checkpoint", help="one of our checkpoints, e.g. log/model_19072.pt")
    p.add_argument("-d", "--device", default="auto", help="cuda, cuda:1, mps, cpu or auto (cuda > mps > cpu)")
    p.add_argument("--split", default="val", choices=["train", "val"], help="split to evaluate (default val)")
    p.add_argument("--limit", type=int, default=None, help="only the first N examples")
    p.add_argument("--batch_tokens", type=int, default=8192,
                   help="token budget of one forward pass (0 = one example per forward)")
    p.add_argument("--data_dir", default=None, help="folder of hellaswag_*.jsonl (default $HELLASWAG_DIR "
                                                     "or ./hellaswag next to this script)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="autocast dtype (auto: fp32 for -m, bf16 for --checkpoint on a bf16 GPU)")
    p.add_argument("--benchmark", action="store_true",
                   help="time one-example-per-forward vs batched scoring instead of a plain evaluation")
    return p


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (1, already printed)
        return e.code if isinstance(e.code, int) else 1
    try:
        if args.limit is not None and args.limit <= 0:
            raise ValueError("--limit must be a positive integer")
        if args.checkpoint and not os.path.isfile(args.checkpoint):
            raise FileNotFoundError(f"checkpoint not found: {args.checkpoint}")
        download(args.split, args.data_dir)  # fail early, before importing torch or loading a model
        import torch

        device = _pick_device(args.device)
        autocast_dtype = _pick_dtype(args.dtype, device, bool(args.checkpoint))
        if torch.device(device).type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        model = _load_model(args).to(device)
        dtype_name = "bf16" if autocast_dtype is torch.bfloat16 else "fp32"
        name = args.checkpoint or args.model
        if args.benchmark:
            examples = _load_split_subset(args.split, args.limit or 500, 0, 1, args.data_dir)
            b = benchmark(model, device, examples, batch_tokens=args.batch_tokens or 8192,
                          autocast_dtype=autocast_dtype)
            print(format_benchmark(b, name))
            return 0
        t0 = time.perf_counter()
        res = evaluate(model, device, split=args.split, limit=args.limit, batch_tokens=args.batch_tokens,
                       autocast_dtype=autocast_dtype, data_dir=args.data_dir, progress=True)
        dt = time.perf_counter() - t0
        print(f"{name} on {device} ({dtype_name}), hellaswag {args.split}: {res['n']} examples, "
              f"acc {res['acc']:.4f} ({res['correct']}/{res['n']}), "
              f"acc_norm {res['acc_norm']:.4f} ({res['correct_norm']}/{res['n']}) "
              f"[{dt:.1f} s]")
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, no traceback
        known = (HellaSwagUnavailable, ValueError, FileNotFoundError, RuntimeError)
        plain = (isinstance(e, known) or type(e).__name__ == "UsageError") and str(e)
        msg = str(e) if plain else f"{type(e).__name__}: {e}"
        print(f"error: {_one_line(msg, 10_000)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
