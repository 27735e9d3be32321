"""Tests for scorer.py against references written here: the ragged KV cache against each row in a
plain forward pass, and score_groups against a plain scorer (one row per forward pass, every
position's logits, an explicit log-softmax and argmax), on both architectures, with fewer key/value
heads than query heads, on transformers' GPT2LMHeadModel and under bf16 autocast."""

import random

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import scorer
import settings
from helpers import GPU_ARCHS, TINY, hf_gpt2, tiny_model
from scorer import Row
from train_gpt2 import GPT, GPTConfig, KVCache

VOCAB = 256  # a small vocabulary: the scored positions' projections stay cheap
BLOCK = TINY["block_size"]
# (architecture, n_kv_head) of a model with 4 heads of 16: GPT-2's and the modern parts (their
# output projections and head random: zero ones would make every logit 0), each with every head
# its own keys and values and with fewer (grouped-query attention)
CASES = [("gpt2", 4), ("gpt2", 2), ("modern", 4), ("modern", 1)]
# CASES, the quick subset's one of them where each case builds and scores two models
ONE_QUICK = [case if case == ("gpt2", 2) else pytest.param(*case, marks=pytest.mark.slow)
             for case in CASES]
REL = 1e-4  # batched passes add in another order than one row's: fp32 rounding, not more
# bf16 keeps 8 significant bits: one bf16 epsilon of relative error on a row's loss is its rounding
# with room to spare (these groups, seeds 5 to 7: at most 2.8e-4; torch 2.13 CPU, both archs)
BF16_REL = 2 ** -8
MARGIN = 1e-4  # greedy is compared where the top two logits of every scored position differ more


def make_model(arch="gpt2", n_kv_head=4, seed=0, vocab=VOCAB):
    model = tiny_model(seed=seed, n_head=4, n_kv_head=n_kv_head, vocab_size=vocab,
                       real_vocab_size=vocab, **GPU_ARCHS[arch])
    return model.eval()


def logits_of(model, tokens):
    """Every position's logits (T, V) of one sequence, fp32, in a plain forward pass."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    return scorer._model_logits(out)[0].float()


def reference(model, groups):
    """The plain scorer: per row, (summed loss, mean loss, greedy, margin) of its scored tokens,
    token t by the logits at position t - 1; margin: the smallest gap between the top two logits
    over its scored positions (a near-tie may go either way in another order of adds)."""
    out = []
    for rows in groups:
        res = []
        for row in rows:
            pred = logits_of(model, row.tokens)[row.start - 1: row.end - 1]  # (S, V)
            target = torch.tensor(row.tokens[row.start: row.end])  # (S,)
            losses = -torch.log_softmax(pred, dim=-1).gather(1, target[:, None])[:, 0]
            top2 = pred.topk(2, dim=-1).values
            res.append((losses.sum().item(), losses.mean().item(),
                        bool((pred.argmax(dim=-1) == target).all()),
                        (top2[:, 0] - top2[:, 1]).min().item()))
        out.append(res)
    return out


def assert_matches(got, ref, rel=REL):
    """score_groups' results equal the reference's: losses within rel, greedy exactly where no
    near-tie makes it ambiguous. Returns the greedy values compared."""
    compared = []
    assert [len(rows) for rows in got] == [len(rows) for rows in ref]
    for g, (rows, ref_rows) in enumerate(zip(got, ref)):
        for j, (s, (sum_loss, mean_loss, greedy, margin)) in enumerate(zip(rows, ref_rows)):
            assert s.sum_loss == pytest.approx(sum_loss, rel=rel), (g, j)
            assert s.mean_loss == pytest.approx(mean_loss, rel=rel), (g, j)
            assert isinstance(s.greedy, bool)
            if margin > MARGIN:
                assert s.greedy == greedy, (g, j)
                compared.append(greedy)
    return compared


def greedy_tokens(model, context, n):
    """n tokens after context, each the argmax of the model's logits (a plain forward each)."""
    tokens = list(context)
    for _ in range(n):
        tokens.append(int(logits_of(model, tokens)[-1].argmax()))
    return tokens[len(context):]


def crop(tokens, start, end):
    """A row cropped from the left to the model's context, as the tasks crop: its span along."""
    cut = max(len(tokens) - BLOCK, 0)
    return Row(tokens[cut:], start - cut, end - cut)


def random_groups(model, n_groups, seed, vocab=VOCAB):
    """Groups of 1 to 5 rows as the tasks make them: options after one context, contexts before
    one continuation, rows with a span anywhere, twins, scored tokens that are the model's greedy
    choices; shared prefixes of none to the whole context; rows beyond the context cropped."""
    rng = random.Random(seed)

    def rand(n):
        return [rng.randrange(vocab) for _ in range(n)]

    groups = []
    for g in range(n_groups):
        shared = rand(rng.choice([0, 1, rng.randint(2, 30), rng.randint(30, 50), BLOCK - 1,
                                  BLOCK + 9]))
        first = shared or rand(1)  # a scored token needs one before it
        kind = ("options", "contexts", "spans")[g % 3]
        cont = rand(rng.randint(1, 8))  # the continuation that the contexts share
        n_own = rng.randint(1, 10)
        same_length = rng.random() < 0.5  # options all as long: cropped alike, still shared
        rows = []
        for j in range(rng.randint(1, 5)):
            ctx, own = first, rand(n_own if same_length else rng.randint(1, 10))
            if kind == "contexts":
                ctx, own = shared + rand(rng.randint(1, 6)), cont
            elif j % 2 == 1:  # the model's own choices after the context the row keeps
                own = greedy_tokens(model, ctx[max(len(ctx) + len(own) - BLOCK, 0):], len(own))
            row = crop(ctx + own, len(ctx), len(ctx + own))
            if kind == "spans":  # scored from anywhere, also inside the shared tokens
                start = rng.randint(1, len(row.tokens) - 1)
                row = Row(row.tokens, start, rng.randint(start + 1, len(row.tokens)))
            rows.append(row)
            if rng.random() < 0.2:
                rows.append(row)  # twins: the whole row is shared
        groups.append(rows[:5])
    return groups


# ---------------------------------------------------------------------------
# the ragged KV cache

def ragged_logits(model, prefixes, rows, pad_token, prefix_pad):
    """The prefixes (right-padded with prefix_pad) in one forward pass filling a cache, then rows
    (cache row, its tokens continued, own tokens) (right-padded with pad_token) in one forward
    through continue_rows: the logits (R, W, V) of every new position."""
    P, W = max(len(p) for p in prefixes), max(len(own) for *_, own in rows)
    pre = torch.full((len(prefixes), P), prefix_pad)
    for k, p in enumerate(prefixes):
        pre[k, : len(p)] = torch.tensor(p)
    new = torch.full((len(rows), W), pad_token)
    for i, (*_, own) in enumerate(rows):
        new[i, : len(own)] = torch.tensor(own)
    with torch.no_grad():
        cache = model.make_kv_cache(len(prefixes), P, "cpu", torch.float32)
        model(pre, kv_cache=cache)
        kv = cache.continue_rows([r for r, _, _ in rows], [n for _, n, _ in rows], W)
        return model(new, kv_cache=kv)[0]


@pytest.mark.parametrize("arch,n_kv_head", CASES)
def test_ragged_rows_equal_whole_rows(arch, n_kv_head):
    """Rows continuing cached prefixes of different lengths (all of one, part of one, none) give
    at every real position the logits of the whole row in a plain forward pass: their own
    positions (wpe or rotary), their own cached keys only. Other padding tokens, and other cached
    tokens past a row's length, change nothing."""
    model = make_model(arch, n_kv_head)
    rng = random.Random(1)

    def rand(n):
        return [rng.randrange(VOCAB) for _ in range(n)]

    prefixes = [rand(12), rand(5), rand(9)]
    rows = [(0, 12, rand(7)), (0, 12, rand(3)), (1, 5, rand(10)), (2, 4, rand(6)), (1, 0, rand(8)),
            (2, 9, rand(1))]
    got = ragged_logits(model, prefixes, rows, 0, 0)
    for i, (r, n, own) in enumerate(rows):
        whole = logits_of(model, prefixes[r][:n] + own)
        assert torch.allclose(got[i, : len(own)], whole[n:], atol=1e-5), i
    # cache row 2's tokens past the 4 that row 3 continues are padding to it, but row 5's own
    changed = [prefixes[0], prefixes[1], prefixes[2][:4] + rand(5)]
    other = ragged_logits(model, changed, rows[:5], VOCAB - 1, 7)
    for i, (_, _, own) in enumerate(rows[:5]):
        assert torch.allclose(other[i, : len(own)], got[i, : len(own)], atol=1e-6), i


class Storages(TorchDispatchMode):
    """The bytes of each new storage that the ops run inside it allocate."""

    def __init__(self):
        super().__init__()
        self.new = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in given:
                self.new[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return out


def test_a_ragged_forward_builds_one_mask_and_continue_rows_copies_once(monkeypatch):
    """continue_rows allocates its keys and values once (no indexed copy padded into a second
    one); every layer of a forward through the ragged cache is given the one attention mask, and
    the next forward a new one. The logits are the ones test_ragged_rows_equal_whole_rows checks."""
    model = tiny_model(n_layer=3, n_head=4, vocab_size=VOCAB, real_vocab_size=VOCAB).eval()
    masks, real_sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return real_sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    with torch.no_grad():
        cache = model.make_kv_cache(2, 20, "cpu", torch.float32)
        model(torch.randint(VOCAB, (2, 20)), kv_cache=cache)
        with Storages() as storages:
            kv = cache.continue_rows([1, 0, 1, 1], [20, 7, 3, 12], 6)
        big = sorted(n for n in storages.new.values() if n > 1000)
        assert big == [kv.k.untyped_storage().nbytes()] * 2 and kv.k.shape[-2] == 26
        masks.clear()
        model(torch.randint(VOCAB, (4, 5)), kv_cache=kv)
        assert len(masks) == 3 and all(m is masks[0] for m in masks)
        assert masks[0].shape == (4, 1, 5, 25)
        model(torch.randint(VOCAB, (4, 1)), kv_cache=kv)
        assert len(masks) == 6 and masks[3] is not masks[0] and masks[4] is masks[3]
        assert masks[3].shape == (4, 1, 1, 26)


# ---------------------------------------------------------------------------
# score_groups against the plain scorer

class Packed(torch.nn.Module):
    """Our GPT without its KV cache: whole rows packed into passes, as other models get them."""

    masked_logits_to_keep = True

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, idx, logits_to_keep=0):
        return self.inner(idx, logits_to_keep=logits_to_keep)


@pytest.mark.parametrize("arch,n_kv_head", ONE_QUICK)
def test_score_groups_equals_one_row_per_forward(arch, n_kv_head):
    """Random groups scored in passes of every size (a budget below one group: each group alone;
    0: the plain way), with shared prefixes and as whole rows, give the plain scorer's losses and
    greedy values, in input order."""
    model = make_model(arch, n_kv_head)
    groups = random_groups(model, 16, seed=3)
    assert any(len(r.tokens) == BLOCK for rows in groups for r in rows)  # cropped or filled
    shared = {scorer._shared_prefix(rows) for rows in groups}
    assert len(shared) > 8 and max(shared) > 50  # ragged chunks of short and long prefixes
    ref = reference(model, groups)
    runs = [(model, bt) for bt in (0, 1, 60, 200, 8192)] + [(Packed(model), 60),
                                                            (Packed(model), 8192)]
    for scored, batch_tokens in runs:
        got = scorer.score_groups(scored, groups, "cpu", batch_tokens=batch_tokens, greedy=True)
        compared = assert_matches(got, ref)
        assert True in compared and False in compared, batch_tokens


def test_greedy_ties_go_to_the_lowest_id():
    """The modern model with a zero head (its bias at 0, as initialized) gives every id the same
    logit: argmax's choice is id 0, so a row is greedy exactly where every scored token is 0."""
    model = tiny_model(n_head=4, vocab_size=VOCAB, real_vocab_size=VOCAB,
                       **{**settings.ARCHITECTURES["modern"], "zero_head": True}).eval()
    groups = [[Row([5, 0, 0], 1, 3), Row([5, 0, 7], 1, 3), Row([5, 7, 0], 1, 3)],
              [Row([3, 4, 0, 0], 2, 4)], [Row([9, 0], 1, 2), Row([9, 1], 1, 2)]]
    for scored in (model, Packed(model)):
        for batch_tokens in (0, 8192):
            got = scorer.score_groups(scored, groups, "cpu", batch_tokens=batch_tokens,
                                      greedy=True)
            assert [[r.greedy for r in rows] for rows in got] == [[True, False, False], [True],
                                                                  [True, False]]


def test_greedy_is_worked_out_only_for_a_language_modeling_task(monkeypatch, enc):
    """score_groups works out greedy only when asked (else None, the losses the same to the bit);
    CORE asks for its language-modeling tasks alone, HellaSwag never: no argmax over the
    vocabulary at their scored positions."""
    import core_eval
    import hellaswag

    model = make_model(vocab=enc.n_vocab)
    calls, real = [], scorer._greedy_hits
    monkeypatch.setattr(scorer, "_greedy_hits", lambda *a, **k: calls.append(1) or real(*a, **k))
    groups = random_groups(model, 6, seed=8)
    for batch_tokens in (0, 8192):
        asked = scorer.score_groups(model, groups, "cpu", batch_tokens=batch_tokens, greedy=True)
        assert calls
        calls.clear()
        plain = scorer.score_groups(model, groups, "cpu", batch_tokens=batch_tokens)
        assert calls == [] and {r.greedy for rows in plain for r in rows} == {None}
        assert [[r[:2] for r in rows] for rows in plain] == [[r[:2] for r in rows]
                                                            for rows in asked]
    ex = {"ctx": "A man sits down.", "endings": [" He reads.", " It rains.", " A dog.", " No."],
          "label": 1}
    hellaswag.score_examples(model, [ex], "cpu", enc=enc)
    assert calls == []
    for kind, rec, greedy in [("multiple_choice", {"query": "Two and two", "gold": 0,
                                                   "choices": ["four", "five"]}, False),
                              ("language_modeling", {"context": "Two and two are",
                                                     "continuation": "four"}, True)]:
        task = core_eval.Task(kind, kind, 0, " ", "x.jsonl", 0.0)
        task.examples = [(0, rec)]
        [res] = core_eval.score_task(model, task, "cpu", [0], enc)
        assert bool(calls) is greedy and isinstance(res["correct"], bool), kind
        calls.clear()


class Counting(torch.nn.Module):
    """Our GPT as the scorer sees it (a bool logits mask, a KV cache), counting the tokens each
    forward pass is given and keeping the caches made."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.masked_logits_to_keep = inner.masked_logits_to_keep
        self.fed, self.caches = [], []

    def make_kv_cache(self, *args):
        self.caches.append(self.inner.make_kv_cache(*args))
        return self.caches[-1]

    def forward(self, idx, **kwargs):
        self.fed.append(idx.numel())
        return self.inner(idx, **kwargs)


def test_shared_prefix_is_computed_once():
    """Three questions of four options after a 40-token context cost 40 - 1 tokens each (the
    last context token's logits predict each option's first token: it runs with the option) and
    4 x (6 + 1), in two passes, not 4 x 46 each; the same results as the plain way."""
    model = Counting(make_model())
    rng = random.Random(3)
    P, S, k = 40, 6, 4
    groups = []
    for _ in range(3):
        ctx = [rng.randrange(VOCAB) for _ in range(P)]
        groups.append([Row(ctx + [rng.randrange(VOCAB) for _ in range(S)], P, P + S)
                       for _ in range(k)])
    shared = scorer.score_groups(model, groups, "cpu", batch_tokens=8192, greedy=True)
    assert sum(model.fed) == 3 * ((P - 1) + k * (S + 1)) and len(model.fed) == 2
    model.fed.clear()
    plain = scorer.score_groups(model, groups, "cpu", batch_tokens=0, greedy=True)
    assert sum(model.fed) == 3 * k * (P + S)
    assert_matches(shared, reference(model.inner, groups))
    assert_matches(plain, reference(model.inner, groups))


def test_the_ragged_cache_is_bounded_in_bytes(monkeypatch):
    """A chunk's ragged cache holds at most CACHE_BYTES of keys and values (a group alone may hold
    more): GPT-2 XL's in bf16 about 14k tokens, not 4 x batch_tokens; GPT-2 124M's as before. The
    results are the plain scorer's whatever the chunks."""
    with torch.device("meta"):
        xl, small = (GPT(GPTConfig(**settings.MODEL_PRESETS[p])) for p in ("gpt2-xl", "gpt2"))
    per_token = 2 * 48 * 1600 * 2  # keys and values, every layer, bf16
    assert scorer.cache_tokens(xl, 8192, torch.bfloat16) == scorer.CACHE_BYTES // per_token
    assert scorer.cache_tokens(small, 8192, torch.bfloat16) == 4 * 8192
    model = make_model()
    groups = random_groups(model, 16, seed=3)
    per_token = 2 * model.config.n_layer * model.config.n_embd * 4  # fp32
    monkeypatch.setattr(scorer, "CACHE_BYTES", 150 * per_token)
    made, continue_rows = [], KVCache.continue_rows

    def recorded(cache, rows, lengths, max_new):
        out = continue_rows(cache, rows, lengths, max_new)
        made.append((out.k.nbytes + out.v.nbytes, len(rows)))
        return out
    monkeypatch.setattr(KVCache, "continue_rows", recorded)
    got = scorer.score_groups(model, groups, "cpu", batch_tokens=8192, greedy=True)
    assert_matches(got, reference(model, groups))
    assert len(made) > 3 and max(size for size, _ in made) > 100 * per_token
    for size, rows in made:  # random_groups' groups have at most 5 rows
        assert size <= scorer.CACHE_BYTES or rows <= 5, (size, rows)


@pytest.mark.slow  # transformers' import: many seconds on a busy machine
def test_transformers_model_packed_rows(tmp_path):
    """transformers' GPT2LMHeadModel (whole rows packed into passes) and our GPT with its
    weights (shared prefixes, a padded vocabulary) both give the plain scorer's results."""
    hf, path = hf_gpt2(tmp_path, vocab=250, n_head=2, n_positions=BLOCK)
    ours = GPT.from_pretrained(path).eval()
    assert not scorer.shares_prefixes(hf) and scorer.shares_prefixes(ours)
    assert ours.config.vocab_size > 250  # padded: -inf logits there
    groups = random_groups(ours, 10, seed=4, vocab=250)
    ref = reference(hf, groups)
    for model in (hf, ours):
        for batch_tokens in (0, 100, 8192):
            got = scorer.score_groups(model, groups, "cpu", batch_tokens=batch_tokens,
                                      greedy=True)
            assert True in assert_matches(got, ref)


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_bf16_autocast_on_cpu(arch):
    """Under bf16 autocast the prefixes' cache is bf16 and every row's losses are within bf16's
    rounding of fp32's (and not equal: the matmuls did run in bf16)."""
    model = Counting(make_model(arch))
    groups = random_groups(model.inner, 8, seed=5)
    fp32 = scorer.score_groups(model, groups, "cpu", batch_tokens=8192)
    assert {c.k.dtype for c in model.caches} == {torch.float32}
    model.caches.clear()
    bf16 = scorer.score_groups(model, groups, torch.device("cpu"), batch_tokens=8192,
                               autocast_dtype=torch.bfloat16)
    assert model.caches and {c.k.dtype for c in model.caches} == {torch.bfloat16}
    pairs = [(a, b) for rows_a, rows_b in zip(fp32, bf16) for a, b in zip(rows_a, rows_b)]
    assert any(a.sum_loss != b.sum_loss for a, b in pairs)
    for a, b in pairs:
        assert b.sum_loss == pytest.approx(a.sum_loss, rel=BF16_REL)
        assert b.mean_loss == pytest.approx(a.mean_loss, rel=BF16_REL)


# ---------------------------------------------------------------------------
# errors

@pytest.mark.parametrize("row,words", [
    (Row([5, 6, 7], 0, 2), "scored span 0:2 of 3 tokens"),
    (Row([5, 6, 7], 2, 2), "scored span 2:2 of 3 tokens"),
    (Row([5, 6, 7], 2, 1), "scored span 2:1 of 3 tokens"),
    (Row([5, 6, 7], 1, 4), "scored span 1:4 of 3 tokens"),
    (Row(list(range(BLOCK + 1)), 1, BLOCK + 1), f"{BLOCK + 1} tokens exceed the model's {BLOCK}"),
])
def test_bad_rows_are_refused_before_any_pass(row, words):
    model = Counting(make_model())
    good = Row([5, 6, 7], 1, 3)
    with pytest.raises(ValueError, match=f"group 1 row 2: {words}"):
        scorer.score_groups(model, [[good], [good, good, row]], "cpu")
    assert model.fed == []
