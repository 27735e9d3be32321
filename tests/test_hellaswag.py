"""Tests for hellaswag.py; no network: every data file is a fixture written here."""

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import common
import hellaswag
import scorer
from helpers import (HANG_LIMIT_S, REPO, SHORT, assert_one_line_error, classic_scores, hf_gpt2,
                     make_records, preds, tiny_hf_model, write_jsonl)

# --------------------------------------------------------------------------
# fixtures


def to_hf_row(rec):
    """The same record as the HF ``Rowan/hellaswag`` dataset serves it (string label)."""
    row = {k: rec[k] for k in ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings",
                               "source_id", "split", "split_type")}
    row["label"] = str(rec["label"]) if "label" in rec else ""
    return row


N_FIX = 16


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "hs"
    write_jsonl(str(d / "hellaswag_val.jsonl"), make_records(N_FIX, seed=1, **SHORT))
    return str(d)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to reach the network (a socket connection, a requests call) fails the test
    loudly."""
    import socket

    import requests

    def boom(*a, **k):
        raise AssertionError("network access attempted in a test")

    monkeypatch.setattr(socket.socket, "connect", boom)
    monkeypatch.setattr(socket, "create_connection", boom)
    monkeypatch.setattr(requests.Session, "request", boom)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


@pytest.fixture(scope="module")
def our_model(hf_model, tmp_path_factory):
    """Our GPT with the same weights as hf_model (through a save_pretrained directory)."""
    from train_gpt2 import GPT

    d = str(tmp_path_factory.mktemp("tiny_hf"))
    hf_model.save_pretrained(d)
    model = GPT.from_pretrained(d)
    model.eval()
    return model


def rank_of(rank, world_size):
    """The Proc of process ``rank`` of ``world_size`` under torchrun (no process group)."""
    return common.Proc(environ={"RANK": str(rank), "WORLD_SIZE": str(world_size)})


# --------------------------------------------------------------------------
# rendering


def test_render_exact_tokens_and_mask():
    import fineweb

    enc = fineweb.get_encoding()  # the same ids as tiktoken's gpt2: test_tokenizer.py
    ex = {
        "ind": 24, "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
        "ctx": "A man is sitting on a roof. he",
        "split": "val", "split_type": "indomain", "label": 3,
        "endings": ["is using wrap to wrap a pair of skis.",
                    "is ripping level tiles off.",
                    "is holding a rubik's cube.",
                    "starts pulling up roofing on a roof."],
        "source_id": "activitynet~v_-JhWjGDPHMY",
    }
    data, tokens, mask, label = hellaswag.render_example(ex)
    ctx = enc.encode(ex["ctx"])
    ends = [enc.encode(" " + e) for e in ex["endings"]]
    n = max(len(ctx) + len(e) for e in ends)
    assert label == 3 and data["label"] == 3
    assert tokens.dtype == torch.long and mask.shape == tokens.shape == (4, n)
    for i, e in enumerate(ends):
        row = ctx + e
        assert tokens[i, : len(row)].tolist() == row
        assert tokens[i, len(row):].tolist() == [0] * (n - len(row))  # right padding
        assert mask[i].tolist() == [0] * len(ctx) + [1] * len(e) + [0] * (n - len(row))
    assert data["ctx_tokens"] == ctx and data["ending_tokens"] == ends


def test_iterate_examples_reads_fixture(data_dir):
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))
    assert len(recs) == N_FIX
    assert recs == make_records(N_FIX, seed=1, **SHORT)
    for r in recs:
        assert set(hellaswag.RECORD_KEYS) <= set(r) and len(r["endings"]) == 4
        assert isinstance(r["label"], int)


def test_env_var_resolved_at_call_time(data_dir, monkeypatch):
    monkeypatch.setenv("HELLASWAG_DIR", data_dir)
    assert hellaswag.download("val") == os.path.join(data_dir, "hellaswag_val.jsonl")
    assert sum(1 for _ in hellaswag.iterate_examples("val")) == N_FIX


# --------------------------------------------------------------------------
# scoring


def test_completion_losses_matches_manual():
    torch.manual_seed(0)
    R, N, V = 4, 9, 50
    logits = torch.randn(R, N, V)
    logits[..., 45:] = float("-inf")  # padded vocab, as our GPT returns it
    tokens = torch.randint(0, 45, (R, N))
    mask = torch.zeros(R, N, dtype=torch.long)
    starts, ends = [3, 3, 3, 3], [9, 7, 5, 8]
    for r in range(R):
        mask[r, starts[r]: ends[r]] = 1
    s, a, greedy = scorer.completion_losses(logits, tokens, mask)
    for r in range(R):
        losses = [-torch.log_softmax(logits[r, t - 1], -1)[tokens[r, t]]
                  for t in range(starts[r], ends[r])]
        assert s[r].item() == pytest.approx(sum(losses).item(), rel=1e-5)
        assert a[r].item() == pytest.approx(sum(losses).item() / len(losses), rel=1e-5)
        picks = [int(logits[r, t - 1].argmax()) == int(tokens[r, t])
                 for t in range(starts[r], ends[r])]
        assert bool(greedy[r]) is all(picks)
    # greedy: a row whose scored tokens are the argmax at every scored position
    hits = tokens.clone()
    hits[:, 1:] = logits[:, :-1].argmax(-1)
    assert scorer.completion_losses(logits, hits, mask)[2].all()
    hits[1, 5] = (hits[1, 5] + 1) % 45  # one scored token of row 1 off: that row only
    assert scorer.completion_losses(logits, hits, mask)[2].tolist() == [True, False, True, True]
    # logits at a subset of positions (what logits_to_keep returns) give the same losses
    positions = torch.arange(2, 8)
    s2, a2, g2 = scorer.completion_losses(logits[:, positions], tokens, mask, positions)
    assert torch.equal(s2, s) and torch.equal(a2, a) and torch.equal(g2, greedy)
    with pytest.raises(ValueError, match="missing"):  # position 2 predicts a scored token
        scorer.completion_losses(logits[:, 3:8], tokens, mask, torch.arange(3, 8))
    # (K, V) logits at a bool mask of exactly the scored positions (our GPT's logits_to_keep)
    keep = torch.zeros(R, N, dtype=torch.bool)
    keep[:, :-1] = mask[:, 1:].bool()
    s3, a3, g3 = scorer.completion_losses(logits[keep], tokens, mask, keep)
    assert torch.equal(s3, s) and torch.equal(a3, a) and torch.equal(g3, greedy)
    with pytest.raises(ValueError, match="missing or extra"):  # a position off
        scorer.completion_losses(logits[keep], tokens, mask, keep.roll(1, dims=1))
    # many scored positions (the CPU path works in pieces)
    big_logits, big_tokens = torch.randn(8, 60, V), torch.randint(0, V, (8, 60))
    big_mask = torch.zeros(8, 60, dtype=torch.long)
    big_mask[:, 19:] = 1
    logp = torch.log_softmax(big_logits[:, :-1], -1)
    ref = -logp.gather(2, big_tokens[:, 1:, None])[..., 0][:, 18:]
    bs, ba, _ = scorer.completion_losses(big_logits, big_tokens, big_mask)
    assert torch.allclose(bs, ref.sum(1), rtol=1e-5) and torch.allclose(ba, ref.mean(1), rtol=1e-5)
    # bf16 logits are scored in fp32
    s16, a16, _ = scorer.completion_losses(logits.bfloat16(), tokens, mask)
    assert s16.dtype == torch.float32 and a16.dtype == torch.float32
    assert torch.allclose(s16, s, rtol=2e-2)


@pytest.mark.parametrize("which", [pytest.param("hf", marks=pytest.mark.slow), "ours"])
def test_logits_to_keep_is_the_full_logits_slice(which, hf_model, our_model, data_dir):
    """The positions asked for come back, equal to the same positions of the full logits."""
    model = hf_model if which == "hf" else our_model
    rec = next(hellaswag.iterate_examples("val", data_dir=data_dir))
    _, tokens, _, _ = hellaswag.render_example(rec)
    positions = torch.tensor([0, 3, 4, 5, tokens.shape[1] - 2])
    with torch.no_grad():
        full = scorer.model_logits(model, tokens)
        kept = scorer.model_logits(model, tokens, positions)
    assert full.shape[:2] == tokens.shape and kept.shape[:2] == (4, 5)
    assert torch.allclose(kept, full[:, positions], atol=1e-5)
    assert scorer.takes_logits_mask(model) is (which == "ours")
    if which == "ours":  # a (R, N) bool mask: (K, V), the K kept positions row by row
        keep = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(0)) < 0.5
        with torch.no_grad():
            masked = scorer.model_logits(model, tokens, keep)
        assert masked.shape == (int(keep.sum()), full.shape[-1])
        assert torch.allclose(masked, full[keep], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["hf", "ours"])
def test_batched_equals_one_at_a_time(which, hf_model, our_model, data_dir):
    model = hf_model if which == "hf" else our_model
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))
    ref = classic_scores(model, recs)
    with torch.no_grad():
        runs = {bt: hellaswag.score_examples(model, recs, "cpu", batch_tokens=bt)
                for bt in (0, 400, 8192)}
    counted = Recorder(model, masks=which == "ours")  # our GPT takes no 1-D positions
    with torch.no_grad():
        hellaswag.score_examples(counted, recs, "cpu", batch_tokens=400)
        passes_400 = len(counted.projected)
        counted.projected.clear()
        hellaswag.score_examples(counted, recs, "cpu", batch_tokens=8192)
    assert passes_400 > 1 and len(counted.projected) < 4 * len(recs)  # rows share forward passes
    if which == "ours":  # masks project exactly the scored (row, position) pairs
        exact = Recorder(model, masks=True)
        with torch.no_grad():
            got = hellaswag.score_examples(exact, recs, "cpu", batch_tokens=8192)
        scored = sum(int(hellaswag.render_example(rec)[2].sum()) for rec in recs)
        assert sum(exact.projected) == scored and len(exact.projected) < 4 * len(recs)
        assert preds(got) == [(p, pn) for p, pn, _ in ref]
    for res in runs.values():
        assert preds(res) == [(p, pn) for p, pn, _ in ref]
        for r, rec, (_, _, s) in zip(res, recs, ref):
            assert r["label"] == rec["label"] and r["sum_loss"] == pytest.approx(s, rel=1e-4)
    fast = hellaswag.evaluate(model, "cpu", data_dir=data_dir, batch_tokens=8192)
    assert fast["n"] == N_FIX
    assert fast["correct"] == sum(p == rec["label"] for (p, _, _), rec in zip(ref, recs))
    assert fast["correct_norm"] == sum(pn == rec["label"] for (_, pn, _), rec in zip(ref, recs))
    assert fast["acc"] == fast["correct"] / N_FIX
    assert fast["acc_norm"] == fast["correct_norm"] / N_FIX


def test_our_gpt_and_hf_agree(hf_model, our_model, data_dir):
    assert our_model.config.vocab_size > 50257  # padded vocab, -inf logits there
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))
    with torch.no_grad():
        a = hellaswag.score_examples(hf_model, recs, "cpu")
        b = hellaswag.score_examples(our_model, recs, "cpu")
    assert preds(a) == preds(b)
    for x, y in zip(a, b):
        assert x["sum_loss"] == pytest.approx(y["sum_loss"], rel=1e-4)


class Recorder(torch.nn.Module):
    """Passes logits_to_keep through and records how many (row, position) pairs were projected;
    masks=True: says it takes a bool mask and continues a KV cache (the inner model must, as our
    GPT does; our GPT takes an int or a mask only, so a Recorder around it says so)."""

    def __init__(self, inner, masks=False):
        super().__init__()
        self.inner, self.config, self.projected = inner, inner.config, []
        self.masked_logits_to_keep = masks
        if masks:
            self.make_kv_cache = inner.make_kv_cache

    def forward(self, idx, logits_to_keep=0, **cache):
        if torch.is_tensor(logits_to_keep) and logits_to_keep.dim() == 2:
            self.projected.append(int(logits_to_keep.sum()))
            return self.inner(idx, logits_to_keep=logits_to_keep, **cache)
        if torch.is_tensor(logits_to_keep):
            kept = logits_to_keep.numel()
        else:
            kept = logits_to_keep or idx.shape[1]
        self.projected.append(idx.shape[0] * kept)
        return self.inner(idx, logits_to_keep=logits_to_keep)


@pytest.mark.slow
def test_few_unneeded_positions_projected(hf_model):
    recs = make_records(16, seed=7)  # realistic lengths: contexts 20-60 words, endings 10-30
    model = Recorder(hf_model)
    with torch.no_grad():
        batched = hellaswag.score_examples(model, recs, "cpu", batch_tokens=8192)
        n_batched, batched_cost = len(model.projected), sum(model.projected)
        model.projected.clear()
        single = hellaswag.score_examples(model, recs, "cpu", batch_tokens=0)
        full_cost = sum(model.projected)
    classic = [(p, pn) for p, pn, _ in classic_scores(hf_model, recs)]
    assert preds(batched) == preds(single) == classic
    assert n_batched < 2 * len(recs)  # rows share forward passes: over two rows each on average
    # rows (not whole examples) are packed; a pass projects its rows' scored spans and few more
    scored = sum(int(hellaswag.render_example(rec)[2][:, 1:].sum()) for rec in recs)
    assert scored <= batched_cost < full_cost / 2


class NoKwarg(torch.nn.Module):
    """A model whose forward has no logits_to_keep: every position comes back."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, idx):
        return self.inner(idx)


class IgnoresKwarg(NoKwarg):
    """GPT2LMHeadModel before transformers 4.53: **kwargs swallow logits_to_keep."""

    def forward(self, idx, **kwargs):
        return self.inner(idx)


@pytest.mark.parametrize("wrapper", [NoKwarg, IgnoresKwarg])
def test_models_returning_every_position(wrapper, hf_model, data_dir):
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))[:6]
    model = wrapper(hf_model)
    assert scorer.takes_logits_to_keep(model) is (wrapper is IgnoresKwarg)
    with torch.no_grad():
        got = hellaswag.score_examples(model, recs, "cpu", batch_tokens=4096)
    assert preds(got) == [(p, pn) for p, pn, _ in classic_scores(hf_model, recs)]


def test_wrong_logits_shape_is_an_error(data_dir):
    class Broken(torch.nn.Module):
        def forward(self, idx, logits_to_keep=0):
            return torch.zeros(idx.shape[0], 1, 50257), None

    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))[:2]
    with pytest.raises(common.UsageError, match="logits of shape"):
        hellaswag.score_examples(Broken(), recs, "cpu")


def test_evaluate_restores_train_mode_and_limit(hf_model, data_dir):
    hf_model.train()
    try:
        res = hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, limit=5)
        assert hf_model.training
    finally:
        hf_model.eval()
    assert res["n"] == 5
    assert set(res) >= {"n", "acc", "acc_norm", "correct", "correct_norm"}
    # rendered examples are cached between calls, but a replaced file is re-read
    write_jsonl(os.path.join(data_dir, "hellaswag_val.jsonl"), make_records(3, seed=9, **SHORT))
    assert hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir)["n"] == 3
    with pytest.raises(ValueError):
        hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, proc=rank_of(2, 2))


# bf16 keeps 8 significant bits: a logit is rounded by at most 2^-9 of itself, its matmuls' inputs
# likewise. One bf16 epsilon (2^-8 = 3.9e-3) of relative error on an ending's loss is that rounding
# with room to spare: on the fixture's first 4 examples the worst is 6.1e-4 (all 16: 8.2e-4; torch
# 2.13 CPU, hellaswag.score_examples in fp32 and under bf16 autocast).
BF16_REL = 2 ** -8


def clear_cut(losses, rel):
    """The lowest of losses beats the next by more than both may move (rel of each)."""
    best, second = sorted(losses)[:2]
    return second * (1 - rel) > best * (1 + rel)


def test_autocast_bf16_cpu_matches_fp32(hf_model, data_dir):
    """Scored under bf16 autocast on the CPU, every ending's loss is within BF16_REL of fp32's
    (and not equal: the matmuls did run in bf16), and every clear-cut choice is fp32's."""
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))[:4]
    with torch.no_grad():
        fp32 = hellaswag.score_examples(hf_model, recs, "cpu")
        bf16 = hellaswag.score_examples(hf_model, recs, torch.device("cpu"),
                                        autocast_dtype=torch.bfloat16)
    assert [r["sum_loss"] for r in bf16] != [r["sum_loss"] for r in fp32]  # bf16 ran
    clear = 0
    for a, b in zip(fp32, bf16):
        for key, pred in (("sum_loss", "pred"), ("avg_loss", "pred_norm")):
            assert b[key] == pytest.approx(a[key], rel=BF16_REL), key
            if clear_cut(a[key], BF16_REL):
                clear += 1
                assert b[pred] == a[pred], (key, a[key], b[key])
    assert clear >= len(recs)  # half the choices or more were clear-cut, and compared


class NoContext(torch.nn.Module):
    """The model without its config: no context length known, so nothing is fitted to one."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx, logits_to_keep=0):
        return self.inner(idx, logits_to_keep=logits_to_keep)


def test_long_examples_are_fitted_to_model_context(data_dir):
    """A model of 20 positions scores an example wider than that on its last 20 columns: the
    context's oldest tokens dropped from every row alike, the endings whole, as those columns
    score when given as they are; a narrower example untouched."""
    model = tiny_hf_model(n_positions=20)
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))[:4]
    enc = hellaswag.get_encoding()
    last_columns, cuts = [], []
    for rec in recs:
        ctx, ends, label = hellaswag._render_lists(rec, enc)
        cuts.append(max(len(ctx) + max(len(e) for e in ends) - 20, 0))
        assert cuts[-1] < len(ctx)  # the fixture's endings fit with a context token to spare
        last_columns.append((ctx[cuts[-1]:], ends, label))
    assert cuts == [0, 6, 6, 2]  # both kinds: widths 18, 26, 26, 22
    with torch.no_grad():
        ref = hellaswag.score_examples(NoContext(model), None, "cpu", rendered=last_columns)
        got = hellaswag.score_examples(model, recs, "cpu")
    assert preds(got) == preds(ref)
    for r, s in zip(got, ref):
        assert r["sum_loss"] == pytest.approx(s["sum_loss"], rel=1e-5)


def test_no_hooks_and_imports_one_way():
    """hellaswag.py sits below train_gpt2.py: it never imports it (nor bench.py), and
    never patches a model (no hooks)."""
    import ast

    with open(os.path.join(REPO, "hellaswag.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert not imported & {"train_gpt2", "bench"}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {a for a in attrs if a.startswith("register_") and "hook" in a}


# --------------------------------------------------------------------------
# ranks


@pytest.mark.slow
def test_rank_split_sums_to_full_count(hf_model, data_dir):
    limit = N_FIX - 5  # the limit applies to the full list, before the split
    full = hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, limit=limit)
    for world in (2, 3):
        parts = [hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, limit=limit,
                                    proc=rank_of(r, world)) for r in range(world)]
        assert [p["n"] for p in parts] == [len(range(r, limit, world)) for r in range(world)]
        for key in ("n", "correct", "correct_norm"):
            assert sum(p[key] for p in parts) == full[key]


_DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    sys.path.insert(0, {repo!r})
    import common
    import hellaswag

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.emb = torch.nn.Parameter(torch.randn(50257, 8, generator=g))
            self.out = torch.nn.Parameter(torch.randn(8, 50257, generator=g))
            self.calls = 0
        def forward(self, idx, targets=None):
            self.calls += 1
            return self.emb[idx] @ self.out, None  # a (logits, loss) tuple like our GPT

    LIMIT = 15  # rank 0 gets 8 examples, rank 1 gets 7

    def worker(rank, world, data_dir, init_file, out_dir):
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                world_size=world)
        model = Bigram()
        proc = common.Proc(environ={{"RANK": str(rank), "WORLD_SIZE": str(world)}})
        res = hellaswag.evaluate(model, "cpu", data_dir=data_dir, proc=proc, limit=LIMIT,
                                 batch_tokens=0)
        res["forwards"] = model.calls
        with open(os.path.join(out_dir, f"rank{{rank}}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        data_dir, init_file, out_dir = sys.argv[1:4]
        # fork: the workers reuse the imported torch instead of importing it again
        mp.start_processes(worker, args=(2, data_dir, init_file, out_dir), nprocs=2,
                           start_method="fork")
        single = hellaswag.evaluate(Bigram(), "cpu", data_dir=data_dir, limit=LIMIT)
        with open(os.path.join(out_dir, "single.json"), "w") as f:
            json.dump(single, f)
""")


@pytest.mark.slow
def test_ddp_all_reduce_gloo(data_dir, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(_DDP_SCRIPT.format(repo=REPO))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(script), data_dir, str(tmp_path / "init"), str(out)],
                          capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = json.loads((out / "single.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # 8 + 7 examples, and one dummy forward on rank 1
    assert [r.pop("forwards") for r in ranks] == [8, 8]
    for r in ranks:
        assert r == single  # every rank gets the global numbers
    assert single["n"] == 15


# --------------------------------------------------------------------------
# bad data is refused, one line naming the file and line


def _write_lines(folder, lines):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "hellaswag_val.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    return path


def _edited(recs, line, **change):
    """JSON lines of recs with record ``line`` (1-based) changed; a None value removes the key."""
    out = []
    for i, rec in enumerate(recs, start=1):
        rec = dict(rec)
        if i == line:
            for k, v in change.items():
                if v is None:
                    rec.pop(k, None)
                else:
                    rec[k] = v
        out.append(json.dumps(rec))
    return out


def _bad_files():
    recs = make_records(4, seed=3, **SHORT)
    return {
        "empty": ([], "is empty", None),
        "blank lines only": (["", "  "], "is empty", None),
        "missing ctx": (_edited(recs, 2, ctx=None), "missing field 'ctx'", 2),
        "missing endings": (_edited(recs, 3, endings=None), "missing field 'endings'", 3),
        "missing label": (_edited(recs, 1, label=None), "missing field 'label'", 1),
        "label 4": (_edited(recs, 4, label=4), "label 4 is not one of", 4),
        "label -1": (_edited(recs, 2, label=-1), "label -1 is not one of", 2),
        "label '7'": (_edited(recs, 2, label="7"), "label '7' is not one of", 2),
        "label true": (_edited(recs, 2, label=True), "label True is not one of", 2),
        "three endings": (_edited(recs, 3, endings=recs[0]["endings"][:3]), "exactly 4", 3),
        "five endings": (_edited(recs, 1, endings=recs[0]["endings"] + ["x"]), "got 5 items", 1),
        "bad json on line 3": (_edited(recs, 0)[:1] + [""] + ['{"ctx": "a", ']
                               + _edited(recs, 0)[1:],
                               "not valid JSON", 3),
        "not an object": (_edited(recs, 0)[:1] + ["[1, 2]"], "expected a JSON object", 2),
    }


@pytest.mark.parametrize("case", list(_bad_files()))
def test_bad_data_is_refused(case, tmp_path, hf_model):
    lines, needle, lineno = _bad_files()[case]
    path = _write_lines(str(tmp_path / "bad"), lines)
    with pytest.raises(hellaswag.HellaSwagBadData) as ei:
        list(hellaswag.iterate_examples("val", data_dir=str(tmp_path / "bad")))
    msg = str(ei.value)
    assert "\n" not in msg and needle in msg
    assert msg.startswith(f"{path}:{lineno}:" if lineno else f"{path}:")
    # evaluate never scores it either (and training sees it as unavailable data)
    with pytest.raises(hellaswag.HellaSwagUnavailable, match="hellaswag_val.jsonl"):
        hellaswag.evaluate(hf_model, "cpu", data_dir=str(tmp_path / "bad"))


def test_bad_data_cli_one_line(tmp_path):
    path = _write_lines(str(tmp_path / "bad"), _edited(make_records(3, **SHORT), 2, label=5))
    proc = _cli(["-m", "gpt2", "--hellaswag_dir", str(tmp_path / "bad")])
    line = assert_one_line_error(proc)
    assert line == f"error: {path}:2: label 5 is not one of 0, 1, 2, 3"


def test_string_labels_read_as_numbers(tmp_path, hf_model):
    recs = make_records(N_FIX, seed=1, **SHORT)
    as_int = write_jsonl(str(tmp_path / "int" / "hellaswag_val.jsonl"), recs)
    as_str = write_jsonl(str(tmp_path / "str" / "hellaswag_val.jsonl"),
                         [dict(r, label=str(r["label"])) for r in recs])
    read = hellaswag.iterate_examples("val", data_dir=os.path.dirname(as_str))
    assert [r["label"] for r in read] == [r["label"] for r in recs]
    a = hellaswag.evaluate(hf_model, "cpu", data_dir=os.path.dirname(as_int))
    b = hellaswag.evaluate(hf_model, "cpu", data_dir=os.path.dirname(as_str))
    # so equal counts mean the labels were compared as numbers
    assert a["correct"] > 0 and a["correct_norm"] > 0
    assert a == b


def test_test_split_without_labels(tmp_path):
    recs = make_records(3, seed=2, split="test", **SHORT)
    # HF's "" and the original's missing key
    rows = [dict(r, label="") for r in recs[:2]] + recs[2:]
    write_jsonl(str(tmp_path / "t" / "hellaswag_test.jsonl"), rows)
    assert list(hellaswag.iterate_examples("test", data_dir=str(tmp_path / "t"))) == recs


# --------------------------------------------------------------------------
# download: HF Rowan/hellaswag, parquet conversion


def _no_tmp_left(d):
    return not [f for f in os.listdir(d) if f.endswith(".tmp")]


@pytest.fixture
def fake_load_dataset(monkeypatch):
    """datasets.load_dataset replaced by one that records its arguments and serves ``rows``."""
    import datasets

    state = {"calls": [], "rows": []}

    def load_dataset(path, **kwargs):
        state["calls"].append((path, kwargs))
        if isinstance(state["rows"], Exception):
            raise state["rows"]
        return state["rows"]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return state


def test_hf_to_record_conversion():
    recs = make_records(3, seed=5) + make_records(2, seed=6, split="test")
    for rec in recs:
        row = to_hf_row(rec)
        assert isinstance(row["label"], str)
        out = hellaswag.hf_to_record(row)
        assert out == rec  # same keys and values as the original jsonl, int label, none for test
        if "label" in out:
            assert isinstance(out["label"], int)
    assert list(hellaswag.hf_to_record(to_hf_row(recs[0]))) == list(hellaswag.RECORD_KEYS)


@pytest.mark.slow
def test_download_from_hf_parquet_offline_first(tmp_path, monkeypatch, fake_load_dataset):
    """With HF_HUB_OFFLINE=1 the only call is datasets' own (no reachability check before it);
    the autouse fixture fails any socket or requests call."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recs = make_records(7, seed=2)
    fake_load_dataset["rows"] = [to_hf_row(r) for r in recs]
    monkeypatch.setattr(hellaswag, "EXPECTED_COUNTS", {"val": 7})
    d = str(tmp_path / "dl")
    path = hellaswag.download("val", data_dir=d)
    assert fake_load_dataset["calls"] == [("Rowan/hellaswag", {"split": "validation",
                                                               "revision": "refs/convert/parquet"})]
    assert path == os.path.join(d, "hellaswag_val.jsonl")
    # converted to the jsonl schema
    assert list(hellaswag.iterate_examples("val", data_dir=d)) == recs
    assert _no_tmp_left(d)
    hellaswag.download("val", data_dir=d)  # cached: no second load
    assert len(fake_load_dataset["calls"]) == 1


def test_download_count_check(tmp_path, fake_load_dataset):
    fake_load_dataset["rows"] = [to_hf_row(r) for r in make_records(5)]
    d = str(tmp_path / "dl")
    with pytest.raises(hellaswag.HellaSwagUnavailable) as ei:
        hellaswag.download("val", data_dir=d)
    assert "5 examples, expected 10042" in str(ei.value) and "\n" not in str(ei.value)
    assert not os.path.exists(os.path.join(d, "hellaswag_val.jsonl")) and _no_tmp_left(d)


def test_download_onto_a_full_disk_is_one_line(tmp_path, monkeypatch, fake_load_dataset):
    fake_load_dataset["rows"] = [to_hf_row(r) for r in make_records(5)]
    monkeypatch.setattr(hellaswag, "EXPECTED_COUNTS", {"val": 5})

    def write_rows_until_full(rows, split, path, f):
        f.write(b'{"ind": 0, "ctx": "half a record')
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(hellaswag, "_write_rows", write_rows_until_full)
    d = str(tmp_path / "dl")
    path = os.path.join(d, "hellaswag_val.jsonl")
    with pytest.raises(hellaswag.HellaSwagUnavailable) as ei:
        hellaswag.download("val", data_dir=d)
    msg = str(ei.value)
    assert "\n" not in msg and f"failed (no space left on device writing {path} (" in msg
    assert "32 B written" in msg
    assert os.listdir(d) == []


def test_missing_data_one_clear_line(tmp_path, hf_model, fake_load_dataset):
    fake_load_dataset["rows"] = ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub\n"
                                                "(more detail)")
    d = str(tmp_path / "empty")
    path = os.path.join(d, "hellaswag_val.jsonl")
    with pytest.raises(hellaswag.HellaSwagUnavailable) as ei:
        hellaswag.download("val", data_dir=d)
    msg = str(ei.value)
    assert "\n" not in msg and "Couldn't reach" in msg
    assert "Rowan/hellaswag" in msg and "refs/convert/parquet" in msg and "HELLASWAG_DIR" in msg
    assert hellaswag.manual_step("val", path) in msg and f".to_json('{path}')" in msg
    assert _no_tmp_left(d)
    with pytest.raises(hellaswag.HellaSwagUnavailable):
        hellaswag.evaluate(hf_model, "cpu", data_dir=d)
    assert not hf_model.training


@pytest.mark.slow
def test_real_datasets_offline_is_one_line(tmp_path):
    """The real datasets library, offline with an empty cache: one line, no socket opened."""
    code = textwrap.dedent(f"""
        import socket, sys
        sys.path.insert(0, {REPO!r})
        def boom(*a, **k):
            raise AssertionError("network access attempted")
        socket.socket.connect = boom
        socket.create_connection = boom
        import hellaswag
        try:
            hellaswag.download("val", data_dir={str(tmp_path / "dl")!r})
        except hellaswag.HellaSwagUnavailable as e:
            print(e)
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf_home"))
    env.pop("HF_DATASETS_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=HANG_LIMIT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("HellaSwag data unavailable")
    assert "Rowan/hellaswag" in lines[0]


@pytest.mark.slow
def test_eval_with_the_hub_unreachable_is_one_line_at_once(tmp_path):
    """`eval` of a local model without HellaSwag data, offline but not told so (the hub's address a
    closed local port): one line saying where a local copy goes, without datasets' retries (a
    hang-limit only: no time is asserted)."""
    _, model_dir = hf_gpt2(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy",
                        "ALL_PROXY", "all_proxy", "HELLASWAG_OFFLINE", "HELLASWAG_DIR")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf_home"))
    empty = str(tmp_path / "hs")
    r = subprocess.run([sys.executable, os.path.join(REPO, "train_gpt2.py"), "eval", "--init_from",
                        model_dir, "--hellaswag_dir", empty, "--device", "cpu"],
                       capture_output=True, text=True, timeout=HANG_LIMIT_S, env=env, cwd=REPO)
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]  # transformers' bar
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr
    for part in ("the hub is unreachable", "hellaswag_val.jsonl", "--hellaswag_dir",
                 "HF_HUB_OFFLINE=1"):
        assert part in errors[0], errors[0]
    assert "hellaswag: fetching" not in r.stderr, r.stderr  # no attempt made
    assert not os.path.exists(empty)  # nothing left behind


def test_offline_env_skips_network(tmp_path, monkeypatch, fake_load_dataset):
    monkeypatch.setenv("HELLASWAG_OFFLINE", "1")
    with pytest.raises(hellaswag.HellaSwagUnavailable, match="HELLASWAG_OFFLINE"):
        hellaswag.download("val", data_dir=str(tmp_path / "x"))
    assert fake_load_dataset["calls"] == []


def test_no_work_at_import():
    code = ("import sys, threading; sys.path.insert(0, %r); import hellaswag; "
            "assert not {'torch', 'requests', 'datasets', 'transformers'} & set(sys.modules); "
            "assert threading.active_count() == 1" % REPO)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=HANG_LIMIT_S)


# --------------------------------------------------------------------------
# CLI


def _cli(args, **kw):
    env = dict(os.environ, HELLASWAG_OFFLINE="1")
    return subprocess.run([sys.executable, os.path.join(REPO, "hellaswag.py"), *args],
                          capture_output=True, text=True, timeout=HANG_LIMIT_S, env=env,
                          cwd=kw.get("cwd", REPO))


@pytest.mark.parametrize("args, needle", [
    ([], "-m/--model"),
    (["--checkpoint", "log/model_00010.pt"], "python train_gpt2.py eval --checkpoint"),
    (["-m", "gpt2", "--hellaswag_dir", "{empty}"], "hellaswag_val.jsonl"),
])
def test_cli_errors_subprocess(args, needle, data_dir, tmp_path):
    args = [a.format(data=data_dir, empty=str(tmp_path / "empty")) for a in args]
    assert_one_line_error(_cli(args), needle)


@pytest.mark.parametrize("args, needle", [
    (["-m", "gpt2", "--limit", "0", "--hellaswag_dir", "{data}"], "--limit"),
    (["-m", "gpt2", "--device", "nosuchdevice", "--hellaswag_dir", "{data}"], "nosuchdevice"),
    (["-m", "gpt2", "--split", "test", "--hellaswag_dir", "{data}"], "invalid choice"),
    (["-m", "gpt2", "--dtype", "fp64", "--hellaswag_dir", "{data}"], "invalid choice"),
    (["-m", "no-such-org/no-such-model", "-d", "cpu", "--hellaswag_dir", "{data}"],
     "could not load GPT-2 model"),
    # not a model folder
    (["-m", "{data}", "-d", "cpu", "--hellaswag_dir", "{data}"], "could not load GPT-2 model"),
])
def test_cli_errors_in_process(args, needle, data_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = hellaswag.main([a.format(data=data_dir) for a in args])
    err = capsys.readouterr().err
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_cli_old_flag_name_and_the_dtype_default():
    parser = hellaswag.build_parser()
    old, new = (parser.parse_args(["-m", "gpt2", flag, "d"])
                for flag in ("--data_dir", "--hellaswag_dir"))
    assert old == new and new.dtype == "auto" and "--data_dir" not in parser.format_help()


def test_cli_help_points_at_train_gpt2_eval(capsys):
    assert hellaswag.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "python train_gpt2.py eval --checkpoint" in out and "gpt2-xl" in out


@pytest.mark.slow
def test_cli_evaluates_hf_dir(hf_model, data_dir, tmp_path, capsys):
    model_dir = str(tmp_path / "tiny")
    hf_model.save_pretrained(model_dir)
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))[:10]
    ref = classic_scores(hf_model, recs)
    correct = sum(p == r["label"] for (p, _, _), r in zip(ref, recs))
    correct_norm = sum(pn == r["label"] for (_, pn, _), r in zip(ref, recs))
    rc = hellaswag.main(["-m", model_dir, "-d", "cpu", "--hellaswag_dir", data_dir,
                         "--limit", "10"])
    out = capsys.readouterr().out
    assert rc == 0 and "(fp32)" in out
    assert f"acc {correct / 10:.4f} ({correct}/10)" in out
    assert f"acc_norm {correct_norm / 10:.4f} ({correct_norm}/10)" in out


def test_cli_short_names_map_to_openai_community(hf_model, data_dir, monkeypatch, capsys):
    import transformers

    asked = []

    def from_pretrained(name, *a, **k):
        asked.append(name)
        return hf_model

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", from_pretrained)
    for name in ("gpt2", "gpt2-xl", "someone/custom-gpt2"):
        args = ["-m", name, "-d", "cpu", "--hellaswag_dir", data_dir, "--limit", "2"]
        assert hellaswag.main(args) == 0
    assert asked == ["openai-community/gpt2", "openai-community/gpt2-xl", "someone/custom-gpt2"]
    assert "gpt2-xl on cpu (fp32), hellaswag val: 2 examples" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_does_not_recompile_the_training_model(data_dir):
    """Training evaluates the raw model while a torch.compile'd wrapper of the same
    modules keeps training: scoring changes nothing on the modules, so no recompile."""
    import torch._dynamo

    from train_gpt2 import GPT, GPTConfig

    torch.manual_seed(0)
    raw = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=1, n_head=2, n_embd=32))
    compiled = torch.compile(raw, backend="eager")  # same guards as inductor, no C++ build
    x = torch.randint(0, 50257, (2, 16))
    torch._dynamo.reset()
    try:
        compiled(x, x)[1].backward()
        res = hellaswag.evaluate(raw, "cpu", data_dir=data_dir, limit=4)
        assert res["n"] == 4 and raw.training
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(x, x)[1].backward()
        # a compiled model handed to evaluate() scores the same
        assert hellaswag.evaluate(compiled, "cpu", data_dir=data_dir, limit=4) == res
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------
# an older transformers (the oldest requirements.txt allows), in a subprocess

OLD_TRANSFORMERS = os.environ.get("HELLASWAG_OLD_TRANSFORMERS", "")
_OLD_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{old!r}, {repo!r}, {tests!r}]
    # today's transformers brings `kernels`, built for today's huggingface_hub: the older
    # transformers would import it (an optional integration) and fail on the older hub
    sys.modules["kernels"] = None
    import torch, transformers
    import hellaswag
    from helpers import SHORT, classic_scores, make_records, preds, tiny_hf_model

    model = tiny_hf_model()
    recs = make_records(12, seed=4, **SHORT)
    _, tokens, _, _ = hellaswag.render_example(recs[0])
    positions = torch.tensor([1, 2, tokens.shape[1] - 2])
    with torch.no_grad():
        kept = model(tokens, logits_to_keep=positions).logits  # raw: does this version honour it?
        full = model(tokens).logits
        batched = hellaswag.score_examples(model, recs, "cpu", batch_tokens=4096)
    honoured = kept.shape[1] == 3
    same = bool(torch.allclose(kept, full[:, positions], atol=1e-5)) if honoured else None
    classic = [(p, pn) for p, pn, _ in classic_scores(model, recs)]
    print(json.dumps({{"version": transformers.__version__, "honoured": honoured,
                      "same_values": same, "same_predictions": preds(batched) == classic}}))
""")


@pytest.mark.skipif(not os.path.isdir(OLD_TRANSFORMERS),
                    reason="HELLASWAG_OLD_TRANSFORMERS is not set to a folder holding an older "
                           "transformers: pip install --target DIR --no-deps transformers==4.53.3 "
                           "'huggingface-hub<1' 'tokenizers<0.22'")
def test_older_transformers(tmp_path):
    script = tmp_path / "old.py"
    script.write_text(_OLD_SCRIPT.format(old=OLD_TRANSFORMERS, repo=REPO,
                                         tests=os.path.join(REPO, "tests")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=HANG_LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert int(out["version"].split(".")[0]) < 5, out  # really the older one, not today's
    assert out["honoured"] and out["same_values"] and out["same_predictions"], out
