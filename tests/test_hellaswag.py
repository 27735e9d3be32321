"""Tests for hellaswag.py; no network: every data file is a fixture written here."""

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CACHE = os.path.join(REPO, "..", "shared", "tiktoken_cache")
if not os.environ.get("TIKTOKEN_CACHE_DIR") and os.path.isdir(_CACHE):
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.abspath(_CACHE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

import hellaswag  # noqa: E402

# --------------------------------------------------------------------------
# fixtures

WORDS = (
    "the a man woman person he she they is are was then and while with on in at of to into "
    "his her their camera kitchen bowl water ball field bike road wall paint brush table chair "
    "knife onion pan oven dog rope shoe hair mirror car tire tool box paper glue guitar piano "
    "stands walks runs jumps picks puts holds throws cuts mixes pours shows talks smiles turns "
    "continues begins finishes starts uses grabs lifts moves slowly quickly carefully again "
    "several small large red blue green white black front back top side next over under around"
).split()
ACTIVITIES = ["Making a sandwich", "Painting fence", "Playing guitarra", "Washing dishes",
              "Bathing dog", "Changing car wheel", "Personal Care and Style", "Home and Garden"]


def _phrase(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_records(n, seed=0, ctx_words=(20, 60), ending_words=(10, 30), split="val"):
    """``n`` records in the original HellaSwag jsonl schema, with realistic
    lengths (context ~20-60 tokens, endings ~10-30 tokens)."""
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        n_ctx = rng.randint(*ctx_words)
        cut = rng.randint(1, max(n_ctx - 1, 1))
        ctx_a = _phrase(rng, cut, cut).capitalize() + "."
        ctx_b = _phrase(rng, max(n_ctx - cut, 1), max(n_ctx - cut, 1))
        endings = [_phrase(rng, *ending_words) + "." for _ in range(4)]
        rec = {
            "ind": 10 * i + 4,
            "activity_label": rng.choice(ACTIVITIES),
            "ctx_a": ctx_a,
            "ctx_b": ctx_b,
            "ctx": ctx_a + " " + ctx_b,
            "split": split,
            "split_type": rng.choice(["indomain", "zeroshot"]),
            "label": rng.randrange(4),
            "endings": endings,
            "source_id": f"activitynet~v_{i:06d}",
        }
        if split == "test":
            del rec["label"]
        recs.append(rec)
    return recs


def write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def to_hf_row(rec):
    """The same record as the HF ``Rowan/hellaswag`` dataset serves it (string label)."""
    row = {k: rec[k] for k in ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings",
                               "source_id", "split", "split_type")}
    row["label"] = str(rec["label"]) if "label" in rec else ""
    return row


N_FIX = 16
SHORT = dict(ctx_words=(6, 16), ending_words=(3, 8))  # keeps the CPU tests fast


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "hs"
    write_jsonl(str(d / "hellaswag_val.jsonl"), make_records(N_FIX, seed=1, **SHORT))
    return str(d)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test loudly."""
    def boom(*a, **k):
        raise AssertionError("network access attempted in a test")

    monkeypatch.setattr(hellaswag, "_http_get", boom)
    monkeypatch.setattr(hellaswag, "_load_hf_rows", boom)


def tiny_hf_model(seed=0, n_positions=256):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                     initializer_range=0.2)  # large init: losses far from ties
    model = GPT2LMHeadModel(cfg)
    model.eval()
    return model


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def _enc():
    return hellaswag.get_encoding()


# --------------------------------------------------------------------------
# rendering


def test_render_exact_tokens_and_mask():
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
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
        assert set(hellaswag.RECORD_KEYS) <= set(r) and len(r["endings"]) == 4 and isinstance(r["label"], int)


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
    s, a = hellaswag.completion_losses(logits, tokens, mask)
    for r in range(R):
        losses = [-torch.log_softmax(logits[r, t - 1], -1)[tokens[r, t]] for t in range(starts[r], ends[r])]
        assert s[r].item() == pytest.approx(sum(losses).item(), rel=1e-5)
        assert a[r].item() == pytest.approx(sum(losses).item() / len(losses), rel=1e-5)
    # logits already gathered at the scored positions give the same losses
    picked = logits[:, :-1][mask[:, 1:].bool()]
    s2, a2 = hellaswag.completion_losses(picked, tokens, mask)
    assert torch.equal(s2, s) and torch.equal(a2, a)
    with pytest.raises(ValueError):
        hellaswag.completion_losses(picked[1:], tokens, mask)
    # many scored positions (the CPU path works in pieces)
    big_logits, big_tokens = torch.randn(8, 60, V), torch.randint(0, V, (8, 60))
    big_mask = torch.zeros(8, 60, dtype=torch.long)
    big_mask[:, 19:] = 1
    ref = -torch.log_softmax(big_logits[:, :-1], -1).gather(2, big_tokens[:, 1:, None])[..., 0][:, 18:]
    bs, ba = hellaswag.completion_losses(big_logits, big_tokens, big_mask)
    assert torch.allclose(bs, ref.sum(1), rtol=1e-5) and torch.allclose(ba, ref.mean(1), rtol=1e-5)
    # bf16 logits are scored in fp32
    s16, a16 = hellaswag.completion_losses(logits.bfloat16(), tokens, mask)
    assert s16.dtype == torch.float32 and a16.dtype == torch.float32
    assert torch.allclose(s16, s, rtol=2e-2)


def test_batched_equals_one_at_a_time(hf_model, data_dir):
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))
    with torch.no_grad():
        # the classic loop: one example per forward, logits at every position
        single = hellaswag.score_examples(hf_model, recs, "cpu", batch_tokens=0, restrict_head=False)
        batched = hellaswag.score_examples(hf_model, recs, "cpu", batch_tokens=400)  # several batches
    assert len(hellaswag._pack([30] * N_FIX, 400)) > 1
    assert [(r["pred"], r["pred_norm"]) for r in single] == [(r["pred"], r["pred_norm"]) for r in batched]
    for a, b in zip(single, batched):
        assert a["label"] == b["label"]
        assert a["sum_loss"] == pytest.approx(b["sum_loss"], rel=1e-4)
    # against the plain per-example render_example + completion_losses path
    for rec, r in zip(recs, single):
        _, tokens, mask, label = hellaswag.render_example(rec)
        with torch.no_grad():
            s, a = hellaswag.completion_losses(hf_model(tokens).logits, tokens, mask)
        assert int(s.argmin()) == r["pred"] and int(a.argmin()) == r["pred_norm"] and label == r["label"]
    # and through evaluate()
    fast = hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, batch_tokens=8192)
    assert fast["n"] == N_FIX
    assert fast["correct"] == sum(r["pred"] == r["label"] for r in single)
    assert fast["correct_norm"] == sum(r["pred_norm"] == r["label"] for r in single)
    assert fast["acc"] == fast["correct"] / N_FIX and fast["acc_norm"] == fast["correct_norm"] / N_FIX


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
        hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, rank=2, world_size=2)


def test_autocast_bf16_cpu_runs(hf_model, data_dir):
    res = hellaswag.evaluate(hf_model, torch.device("cpu"), data_dir=data_dir, limit=2,
                             autocast_dtype=torch.bfloat16)
    assert res["n"] == 2


def test_our_gpt_matches_hf(hf_model, data_dir, tmp_path):
    from train_gpt2 import GPT

    hf_model.save_pretrained(str(tmp_path / "tiny"))
    ours = GPT.from_pretrained(str(tmp_path / "tiny"))
    ours.eval()
    assert ours.config.vocab_size > 50257  # padded vocab, -inf logits there
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))
    with torch.no_grad():
        a = hellaswag.score_examples(hf_model, recs, "cpu")
        b = hellaswag.score_examples(ours, recs, "cpu")
        c = hellaswag.score_examples(ours, recs, "cpu", batch_tokens=0, restrict_head=False)  # full logits
    assert [(r["pred"], r["pred_norm"]) for r in a] == [(r["pred"], r["pred_norm"]) for r in b]
    assert [(r["pred"], r["pred_norm"]) for r in c] == [(r["pred"], r["pred_norm"]) for r in b]
    for x, y in zip(a, b):
        assert x["sum_loss"] == pytest.approx(y["sum_loss"], rel=1e-4)
    # the vocab projection is restricted to the scored positions on our GPT too
    _, tokens, mask, _ = hellaswag.render_example(recs[0])
    with torch.no_grad(), hellaswag._HeadRestriction(ours) as head:
        picked = head.logits(ours, tokens, mask)
    assert head.applied and picked.shape == (int(mask[:, 1:].sum()), ours.config.vocab_size)
    assert not ours.lm_head._forward_pre_hooks
    res = hellaswag.evaluate(ours, "cpu", data_dir=data_dir)  # the (logits, loss) tuple path
    assert res["correct_norm"] == sum(r["pred_norm"] == r["label"] for r in a) and res["n"] == N_FIX


class ReshapingHead(torch.nn.Module):
    """A model whose forward needs the full (B, T, V) head output: the lm_head
    restriction must notice and fall back to full logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.lm_head = inner.lm_head

    def forward(self, idx):
        B, T = idx.shape
        logits = self.inner(idx).logits
        return (logits.view(B, T, -1),)


def test_head_restriction_falls_back(hf_model, data_dir):
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))[:6]
    with torch.no_grad():
        ref = hellaswag.score_examples(hf_model, recs, "cpu", restrict_head=False)
        got = hellaswag.score_examples(ReshapingHead(hf_model), recs, "cpu")
    assert [(r["pred"], r["pred_norm"]) for r in ref] == [(r["pred"], r["pred_norm"]) for r in got]
    assert not hf_model.lm_head._forward_pre_hooks  # no hook left behind


def test_long_examples_are_fitted_to_model_context(data_dir):
    model = tiny_hf_model(n_positions=16)  # shorter than the fixture rows
    res = hellaswag.evaluate(model, "cpu", data_dir=data_dir, limit=4)
    assert res["n"] == 4


# --------------------------------------------------------------------------
# ranks


def test_rank_split_sums_to_full_count(hf_model, data_dir):
    limit = N_FIX - 5  # the limit applies to the full list, before the split
    full = hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, limit=limit)
    for world in (2, 3):
        parts = [hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, limit=limit, rank=r,
                                    world_size=world) for r in range(world)]
        assert [p["n"] for p in parts] == [len(range(r, limit, world)) for r in range(world)]
        for key in ("n", "correct", "correct_norm"):
            assert sum(p[key] for p in parts) == full[key]


_DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    sys.path.insert(0, {repo!r})
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
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
        model = Bigram()
        res = hellaswag.evaluate(model, "cpu", data_dir=data_dir, rank=rank, world_size=world, limit=LIMIT,
                                 batch_tokens=0)
        res["forwards"] = model.calls
        with open(os.path.join(out_dir, f"rank{{rank}}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        data_dir, init_file, out_dir = sys.argv[1:4]
        # fork: the workers reuse the imported torch instead of importing it again
        mp.start_processes(worker, args=(2, data_dir, init_file, out_dir), nprocs=2, start_method="fork")
        single = hellaswag.evaluate(Bigram(), "cpu", data_dir=data_dir, limit=LIMIT)
        with open(os.path.join(out_dir, "single.json"), "w") as f:
            json.dump(single, f)
""")


def test_ddp_all_reduce_gloo(data_dir, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(_DDP_SCRIPT.format(repo=REPO))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(script), data_dir, str(tmp_path / "init"), str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = json.loads((out / "single.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r.pop("forwards") for r in ranks] == [8, 8]  # 8 + 7 examples, one dummy forward on rank 1
    for r in ranks:
        assert r == single  # every rank gets the global numbers
    assert single["n"] == 15


# --------------------------------------------------------------------------
# download


class FakeResponse:
    def __init__(self, status, body=b""):
        self.status_code = status
        self.headers = {"content-length": str(len(body))}
        self._body = body
        self.closed = False

    def iter_content(self, chunk_size=1):
        for i in range(0, len(self._body), 1000):
            yield self._body[i: i + 1000]

    def close(self):
        self.closed = True


def _jsonl_bytes(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _no_tmp_left(d):
    return not [f for f in os.listdir(d) if f.endswith(".tmp")]


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


def test_download_from_github(tmp_path, monkeypatch):
    recs = make_records(7, seed=2)
    calls = []

    def get(url, timeout=30):
        calls.append(url)
        return FakeResponse(200, _jsonl_bytes(recs))

    monkeypatch.setattr(hellaswag, "_http_get", get)
    monkeypatch.setattr(hellaswag, "EXPECTED_COUNTS", {"val": 7})
    d = str(tmp_path / "dl")
    path = hellaswag.download("val", data_dir=d)
    assert calls == ["https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"]
    assert path == os.path.join(d, "hellaswag_val.jsonl")
    assert list(hellaswag.iterate_examples("val", data_dir=d)) == recs
    assert _no_tmp_left(d)
    hellaswag.download("val", data_dir=d)  # cached: no second request
    assert len(calls) == 1


def test_download_bad_status_falls_back_to_hf(tmp_path, monkeypatch):
    recs = make_records(6, seed=3)
    monkeypatch.setattr(hellaswag, "_http_get", lambda url, timeout=30: FakeResponse(404))
    asked = []

    def hf_rows(split):
        asked.append(split)
        return [to_hf_row(r) for r in recs]

    monkeypatch.setattr(hellaswag, "_load_hf_rows", hf_rows)
    monkeypatch.setattr(hellaswag, "EXPECTED_COUNTS", {"val": 6})
    d = str(tmp_path / "dl")
    hellaswag.download("val", data_dir=d)
    assert asked == ["val"]
    assert list(hellaswag.iterate_examples("val", data_dir=d)) == recs  # converted to the jsonl schema
    assert _no_tmp_left(d)
    # both sources fail: one line naming both reasons
    def hf_down(split):
        raise ConnectionError("cannot reach https://huggingface.co")

    monkeypatch.setattr(hellaswag, "_load_hf_rows", hf_down)
    with pytest.raises(hellaswag.HellaSwagUnavailable, match="GitHub: HTTP 404.*huggingface.co"):
        hellaswag.download("val", data_dir=str(tmp_path / "dl2"))


def test_download_count_check(tmp_path, monkeypatch):
    monkeypatch.setattr(hellaswag, "_http_get",
                        lambda url, timeout=30: FakeResponse(200, _jsonl_bytes(make_records(5))))
    good = make_records(10042 // 1000, seed=4)
    monkeypatch.setattr(hellaswag, "_load_hf_rows", lambda split: [to_hf_row(r) for r in good])
    monkeypatch.setattr(hellaswag, "EXPECTED_COUNTS", {"val": len(good)})
    d = str(tmp_path / "dl")
    hellaswag.download("val", data_dir=d)  # github had the wrong count -> HF copy used
    assert list(hellaswag.iterate_examples("val", data_dir=d)) == good
    # both wrong: nothing is written
    monkeypatch.setattr(hellaswag, "EXPECTED_COUNTS", {"val": 10042})
    d2 = str(tmp_path / "dl2")
    with pytest.raises(hellaswag.HellaSwagUnavailable) as ei:
        hellaswag.download("val", data_dir=d2)
    assert "expected 10042" in str(ei.value)
    assert not os.path.exists(os.path.join(d2, "hellaswag_val.jsonl")) and _no_tmp_left(d2)
    assert hellaswag.EXPECTED_COUNTS["val"] == 10042


def test_missing_data_one_clear_line(tmp_path, monkeypatch, hf_model):
    def refuse(*a, **k):
        raise ConnectionError("Failed to resolve 'raw.githubusercontent.com'\n(more detail)")

    monkeypatch.setattr(hellaswag, "_http_get", refuse)
    monkeypatch.setattr(hellaswag, "_load_hf_rows", refuse)
    d = str(tmp_path / "empty")
    with pytest.raises(hellaswag.HellaSwagUnavailable) as ei:
        hellaswag.download("val", data_dir=d)
    msg = str(ei.value)
    assert "\n" not in msg
    assert os.path.join(d, "hellaswag_val.jsonl") in msg and "save it as" in msg
    assert _no_tmp_left(d)
    with pytest.raises(hellaswag.HellaSwagUnavailable):
        hellaswag.evaluate(hf_model, "cpu", data_dir=d)
    assert not hf_model.training


def test_offline_env_skips_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HELLASWAG_OFFLINE", "1")  # the autouse fixture would fail on any request
    with pytest.raises(hellaswag.HellaSwagUnavailable, match="HELLASWAG_OFFLINE"):
        hellaswag.download("val", data_dir=str(tmp_path / "x"))


def test_no_work_at_import():
    code = ("import sys, threading; sys.path.insert(0, %r); import hellaswag; "
            "assert 'torch' not in sys.modules and 'requests' not in sys.modules; "
            "assert threading.active_count() == 1" % REPO)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------
# CLI


def _cli(args, **kw):
    env = dict(os.environ, HELLASWAG_OFFLINE="1")
    return subprocess.run([sys.executable, os.path.join(REPO, "hellaswag.py"), *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=kw.get("cwd", REPO))


@pytest.mark.parametrize("args, needle", [
    ([], "-m/--model"),
    (["--checkpoint", "/nonexistent/model_00010.pt", "--data_dir", "{data}"], "checkpoint not found"),
    (["-m", "gpt2", "--data_dir", "{empty}"], "hellaswag_val.jsonl"),
])
def test_cli_errors_subprocess(args, needle, data_dir, tmp_path):
    args = [a.format(data=data_dir, empty=str(tmp_path / "empty")) for a in args]
    proc = _cli(args)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["-m", "gpt2", "--checkpoint", "x.pt"], "not allowed"),
    (["-m", "gpt2", "--limit", "0", "--data_dir", "{data}"], "--limit"),
    (["-m", "gpt2", "--device", "nosuchdevice", "--data_dir", "{data}"], "nosuchdevice"),
    (["-m", "gpt2", "--split", "test", "--data_dir", "{data}"], "invalid choice"),
])
def test_cli_errors_in_process(args, needle, data_dir, capsys):
    rc = hellaswag.main([a.format(data=data_dir) for a in args])
    err = capsys.readouterr().err
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_cli_evaluates_hf_dir_and_checkpoint(hf_model, data_dir, tmp_path, capsys):
    from dataclasses import asdict

    from train_gpt2 import GPT

    model_dir = str(tmp_path / "tiny")
    hf_model.save_pretrained(model_dir)
    expected = hellaswag.evaluate(hf_model, "cpu", data_dir=data_dir, limit=10)
    rc = hellaswag.main(["-m", model_dir, "-d", "cpu", "--data_dir", data_dir, "--limit", "10"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"acc {expected['acc']:.4f} ({expected['correct']}/10)" in out
    assert f"acc_norm {expected['acc_norm']:.4f} ({expected['correct_norm']}/10)" in out
    # our checkpoint format: {"config": ..., "model": state_dict}
    ours = GPT.from_pretrained(model_dir)
    ckpt = str(tmp_path / "model_00010.pt")
    torch.save({"config": asdict(ours.config), "model": ours.state_dict()}, ckpt)
    rc = hellaswag.main(["--checkpoint", ckpt, "-d", "cpu", "--data_dir", data_dir, "--limit", "10",
                         "--batch_tokens", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and f"acc_norm {expected['acc_norm']:.4f} ({expected['correct_norm']}/10)" in out


def test_benchmark_function(hf_model, data_dir):
    recs = list(hellaswag.iterate_examples("val", data_dir=data_dir))[:8]
    b = hellaswag.benchmark(hf_model, "cpu", recs, batch_tokens=4096, warmup=0, repeats=1)
    assert b["n"] == 8 and b["same_predictions"]
    assert b["naive_forwards"] == b["single_forwards"] == 8 and b["batched_forwards"] == 1
    assert b["speedup"] == b["batched_ex_per_s"] / b["naive_ex_per_s"]
    assert "examples/s" in hellaswag.format_benchmark(b)
    assert b["single_ex_per_s"] > 0 and b["batched_ex_per_s"] > 0


def test_eval_does_not_recompile_the_training_model(data_dir):
    """Training evaluates the raw model while a torch.compile'd wrapper of the same
    modules keeps training: the temporary lm_head hook must not force a recompile."""
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
        # a compiled model handed to evaluate() is scored with full logits (no hook)
        assert hellaswag.evaluate(compiled, "cpu", data_dir=data_dir, limit=4) == res
    finally:
        torch._dynamo.reset()
