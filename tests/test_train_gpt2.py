"""train_gpt2.py: model, optimizer, schedule, loader, loop, checkpoints and CLI, on CPU in fp32."""
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_gpt2 as tg
from conftest import REPO

TINY = dict(block_size=64, n_layer=2, n_head=2, n_embd=64)


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    return tg.GPT(tg.GPTConfig(**{**TINY, **kw}))


class CliResult:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_cli(*args, subprocess_run=False):
    """`python train_gpt2.py ARGS`: in this process by default (the same main(), without paying for a new
    interpreter and torch import each time), or as a real subprocess."""
    if subprocess_run:
        return subprocess.run([sys.executable, os.path.join(REPO, "train_gpt2.py"), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tg.main(list(args))
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


# a tiny training run on the shards in `data`, writing to `log`; extra flags override these. On the CPU in
# fp32 on any machine (`auto` would pick CUDA, bf16 and compile on a GPU box): tests/test_cuda.py covers CUDA
def tiny_run_args(data, log, *extra):
    return ["--preset", "tiny", "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "64", "--device", "cpu",
            "-B", "2", "-T", "32", "--total_batch_size", "128", "--max_steps", "10", "--warmup_steps", "3",
            "--eval_every", "4", "--val_tokens", "256", "--sample_every", "5", "--sample_tokens", "6",
            "--num_samples", "2", "--save_every", "4", "--hellaswag_every", "0",
            "--data_root", data, "--log_dir", log, *extra]


def without_shape_flags(args):
    """tiny_run_args without the shape flags (e.g. for --init_from, which takes the shape from the weights)."""
    shape = {"--n_layer", "--n_head", "--n_embd", "--block_size"}
    return [a for i, a in enumerate(args) if a not in shape and (i == 0 or args[i - 1] not in shape)]


# ----------------------------------------------------------------------------- model

def hf_param_count(n_layer, n_head, n_embd, n_positions=1024, vocab=50257):
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab))
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"])
def test_presets_match_hf_parameter_counts(name):
    config = tg.GPTConfig(**tg.MODEL_PRESETS[name])
    with torch.device("meta"):
        model = tg.GPT(config)
    padding = (config.vocab_size - config.real_vocab_size) * config.n_embd
    expected = hf_param_count(config.n_layer, config.n_head, config.n_embd, config.block_size)
    assert model.get_num_params() - padding == expected
    if name == "gpt2":
        assert expected == 124_439_808
    if name == "tiny":
        assert 1e6 < model.get_num_params() < 1e7


def test_config_defaults_and_validation():
    c = tg.GPTConfig()
    assert (c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd) == (1024, 50304, 12, 12, 768)
    with pytest.raises(ValueError, match="divisible"):
        tg.GPTConfig(n_embd=100, n_head=3)


def test_forward_shapes_tying_and_init():
    model = tiny_model(n_layer=4)
    idx = torch.randint(0, 50257, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 50304) and loss is None
    _, loss = model(idx, idx)
    assert loss.ndim == 0
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h[0].mlp.gelu, torch.nn.GELU) and model.transformer.h[0].mlp.gelu.approximate == "tanh"
    # residual projections at 0.02 / sqrt(2 * n_layer), other matmuls at 0.02, biases zero
    proj = torch.cat([torch.cat([b.attn.c_proj.weight.flatten(), b.mlp.c_proj.weight.flatten()]) for b in model.transformer.h])
    fc = torch.cat([torch.cat([b.attn.c_attn.weight.flatten(), b.mlp.c_fc.weight.flatten()]) for b in model.transformer.h])
    assert abs(proj.std().item() - 0.02 / math.sqrt(8)) < 0.0015
    assert abs(fc.std().item() - 0.02) < 0.0015
    assert all((m.bias == 0).all() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_attention_is_causal_and_matches_explicit_softmax():
    model = tiny_model()
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 10, 64)
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(C // 2)
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    ref = attn.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(attn(x), ref, atol=1e-5, rtol=1e-5)
    # the future never leaks: changing the last token leaves earlier outputs unchanged
    idx = torch.randint(0, 50257, (1, 12))
    idx2 = idx.clone()
    idx2[0, -1] = (idx[0, -1] + 1) % 50257
    torch.testing.assert_close(model(idx)[0][:, :-1], model(idx2)[0][:, :-1])


def test_loss_at_init_is_uniform():
    model = tiny_model()
    idx = torch.randint(0, 50257, (4, 64))
    _, loss = model(idx, torch.randint(0, 50257, (4, 64)))
    assert abs(loss.item() - math.log(50257)) < 0.3


def test_padding_tokens_never_produced():
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[50257:] = 50.0  # would dominate every softmax if it were not masked
    idx = torch.randint(0, 50257, (2, 8))
    logits, loss = model(idx, idx)
    assert torch.isinf(logits[..., 50257:]).all() and (logits[..., 50257:] < 0).all()
    assert torch.isfinite(logits[..., :50257]).all() and torch.isfinite(loss)
    assert logits.argmax(-1).max() < 50257
    out = model.generate(idx, 20, top_k=None, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 28) and out.max() < 50257
    assert torch.equal(out[:, :8], idx)


def test_generate_top_k_1_is_greedy():
    model = tiny_model()
    model.eval()
    idx = torch.randint(0, 50257, (2, 5))
    out = model.generate(idx, 6, top_k=1)
    ref = idx
    for _ in range(6):
        ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("vocab", [50257, 100])
def test_from_pretrained_matches_hf(tmp_path, vocab):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=48, vocab_size=vocab))
    # random biases and LayerNorm affines, so a missed or swapped tensor cannot hide
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hf.save_pretrained(tmp_path)
    ours = tg.GPT.from_pretrained(str(tmp_path))
    assert ours.config.vocab_size % 64 == 0 and ours.config.real_vocab_size == vocab
    assert ours.config.block_size == 48
    hf.eval(), ours.eval()
    idx = torch.randint(0, vocab, (3, 48))
    with torch.no_grad():
        ref = hf(idx).logits
        got, _ = ours(idx)
    torch.testing.assert_close(got[..., :vocab], ref, atol=1e-5, rtol=1e-5)
    assert torch.isinf(got[..., vocab:]).all()


# ----------------------------------------------------------------------------- optimisation

def test_configure_optimizers_groups_and_decay(capsys):
    model = tiny_model()
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, device_type="cpu")
    out = capsys.readouterr().out
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert f"with {sum(p.numel() for p in decay['params']):,} parameters" in out
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8 and not opt.defaults["fused"]
    # behaviour: with zero gradients AdamW only decays: matmul weights shrink by lr*wd, biases and LN stay
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if p.dim() >= 2:
            torch.testing.assert_close(p, before[n] * (1 - 1e-2 * 0.1))
        else:
            assert torch.equal(p, before[n]), n


def test_lr_schedule():
    kw = dict(max_lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=110)
    assert tg.get_lr(0, **kw) == pytest.approx(6e-4 / 10)
    assert tg.get_lr(9, **kw) == pytest.approx(6e-4)  # warmup end
    assert tg.get_lr(10, **kw) == pytest.approx(6e-4)  # cosine start
    assert tg.get_lr(60, **kw) == pytest.approx((6e-4 + 6e-5) / 2)  # midpoint
    assert tg.get_lr(109, **kw) == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi * 99 / 100)) * 5.4e-4)
    assert tg.get_lr(110, **kw) == pytest.approx(6e-5) and tg.get_lr(500, **kw) == pytest.approx(6e-5)
    steps = [tg.get_lr(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(steps, steps[1:]))


def step_lines(stdout):
    """{step: (loss, norm)} from the step lines a run printed."""
    found = re.findall(r"^step +(\d+) \| loss ([\d.]+) \| lr \S+ \| norm ([\d.]+)", stdout, re.M)
    return {int(s): (float(loss), float(norm)) for s, loss, norm in found}


def test_grad_accumulation_equals_big_batch(shard_dir, tmp_path):
    # train()'s micro-step loop: 4 micro-batches of 2 sequences give the loss and gradient norm of one batch
    # of 8 (the loader hands out the same windows for any B); the norm would show a missing 1/4
    runs = []
    for B in ("2", "8"):
        log = str(tmp_path / f"B{B}")
        r = run_cli(*tiny_run_args(shard_dir, log, "-B", B, "--total_batch_size", "256", "--max_steps", "2",
                                   "--eval_every", "0", "--sample_every", "0", "--save_every", "0"))
        assert r.returncode == 0, r.stderr
        runs.append(step_lines(r.stdout))
    assert sorted(runs[0]) == sorted(runs[1]) == [0, 1]
    for step in (0, 1):  # step 1's loss is taken after the first update
        assert runs[0][step] == pytest.approx(runs[1][step], rel=1e-4)


def test_check_batch():
    args = tg.parse_args(["-B", "4", "-T", "32", "--total_batch_size", "1024"])
    assert tg.check_batch(args, 2, 64) == 4
    with pytest.raises(tg.UsageError, match="not divisible"):
        tg.check_batch(args, 3, 64)
    with pytest.raises(tg.UsageError, match="block_size"):
        tg.check_batch(args, 1, 16)


def test_tiny_model_overfits_one_batch():
    model = tiny_model(vocab_size=512, real_vocab_size=500)  # a small vocab keeps the 300 steps fast
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1)
    buf = torch.randint(0, 500, (4, 33))
    x, y = buf[:, :-1], buf[:, 1:]
    for step in range(300):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if loss.item() < 0.5:
            break
    assert loss.item() < 0.5, f"loss {loss.item():.3f} after {step + 1} steps"


def test_flops_per_token_124m():
    config = tg.GPTConfig()
    with torch.device("meta"):
        n = tg.GPT(config).get_num_params(non_embedding=True)
    # by hand: wte 50304*768 + 12 blocks * (12*768^2 + 13*768) + final LN 2*768
    assert n == 50304 * 768 + 12 * (12 * 768 ** 2 + 13 * 768) + 2 * 768 == 123_689_472
    assert tg.flops_per_token(config, n, 1024) == 6 * 123_689_472 + 12 * 12 * 12 * 64 * 1024
    assert tg.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and tg.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert tg.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and tg.peak_flops("NVIDIA H200") == 989e12
    assert tg.peak_flops("Tesla T4") is None


# ----------------------------------------------------------------------------- data

def stream(shard_dir, split):
    return np.concatenate([np.load(p) for p in tg.list_shards(shard_dir, split)]).astype(np.int64)


def test_loader_reads_consecutive_windows_across_shards(shard_dir):
    B, T = 4, 64
    loader = tg.DataLoaderLite(B, T, split="train", data_root=shard_dir)
    assert all(isinstance(t, np.memmap) for t in loader.tokens)  # shards are never read whole
    ref = stream(shard_dir, "train")
    for i in range(19500 // (B * T) + 1):  # runs past the first two shard boundaries and into epoch 1
        x, y = loader.next_batch()
        assert x.dtype == torch.long and x.shape == (B, T)
        start = i * B * T
        if start + B * T + 1 <= len(ref):
            assert np.array_equal(x.flatten().numpy(), ref[start:start + B * T])
            assert np.array_equal(y.flatten().numpy(), ref[start + 1:start + B * T + 1])


def test_loader_ranks_interleave_like_one_process(shard_dir):
    single = tg.DataLoaderLite(2, 32, 0, 1, "train", shard_dir)
    ranks = [tg.DataLoaderLite(2, 32, r, 2, "train", shard_dir) for r in range(2)]
    for _ in range(400):  # about 1.3 epochs
        for r in ranks:
            x, y = r.next_batch()
            xs, ys = single.next_batch()
            assert torch.equal(x, xs) and torch.equal(y, ys)


def test_loader_epochs_shuffle_train_shards_seeded(shard_dir):
    def epoch_order(seed, split):
        loader = tg.DataLoaderLite(2, 32, split=split, data_root=shard_dir, seed=seed)
        return [loader._order(e)[0].tolist() for e in range(6)]

    orders = epoch_order(1337, "train")
    assert orders[0] == [0, 1, 2]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert any(o != [0, 1, 2] for o in orders[1:])
    assert orders == epoch_order(1337, "train") and orders != epoch_order(7, "train")
    assert epoch_order(1337, "val") == [[0]] * 6
    # the stream really follows the order: epoch 1 begins with its first shard
    loader = tg.DataLoaderLite(1, 100, split="train", data_root=shard_dir)
    loader.position = loader.epoch_tokens
    first = loader._order(1)[0][0]
    assert np.array_equal(loader.next_batch()[0].flatten().numpy(), np.load(loader.shards[first])[:100])


def test_loader_state_dict_resumes_exactly(shard_dir):
    a = tg.DataLoaderLite(4, 32, split="train", data_root=shard_dir)
    for _ in range(170):
        a.next_batch()
    state = a.state_dict()
    b = tg.DataLoaderLite(4, 32, split="train", data_root=shard_dir)
    b.load_state_dict(state)
    for _ in range(50):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    a.reset()
    assert torch.equal(a.next_batch()[0], tg.DataLoaderLite(4, 32, split="train", data_root=shard_dir).next_batch()[0])


def test_loader_errors(tmp_path, shard_dir):
    with pytest.raises(tg.UsageError, match="fineweb.py"):
        tg.DataLoaderLite(2, 32, split="train", data_root=str(tmp_path))
    with pytest.raises(tg.UsageError, match="fewer than one batch"):
        tg.DataLoaderLite(64, 1024, split="val", data_root=shard_dir)


# ----------------------------------------------------------------------------- log

def test_log_roundtrip_and_truncate(tmp_path):
    path = str(tmp_path / "log.txt")
    tg.append_log(path, 0, "val", 10.98765)
    tg.append_log(path, 0, "train", 10.1234567)
    tg.append_log(path, 1, "train", 9.5)
    tg.append_log(path, 1, "hella", 0.25)
    assert open(path).read() == "0 val 10.9877\n0 train 10.123457\n1 train 9.500000\n1 hella 0.2500\n"
    log = tg.read_log(path)
    assert log["train"] == ([0, 1], [10.123457, 9.5]) and log["val"] == ([0], [10.9877]) and log["hella"] == ([1], [0.25])
    tg.truncate_log(path, 0)
    assert set(tg.read_log(path)) == {"train", "val"}


# ----------------------------------------------------------------------------- end to end

def test_cli_end_to_end_tiny(shard_dir, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*tiny_run_args(shard_dir, log), subprocess_run=True)  # the real `python train_gpt2.py`
    assert r.returncode == 0, r.stderr
    assert "run config:\n" in r.stdout and " grad_accum_steps=2 " in r.stdout
    saved = json.load(open(os.path.join(log, "run_config.json")))  # the whole config, as the run resolved it
    assert saved["grad_accum_steps"] == 2 and saved["model"]["n_layer"] == 2 and saved["max_steps"] == 10
    assert r.stdout.count("sample 0:") == 2  # step 5 and the final model
    assert "Hello, I'm a language model," in r.stdout
    series = tg.read_log(os.path.join(log, "log.txt"))
    assert series["train"][0] == list(range(10))
    assert series["val"][0] == [0, 4, 8, 10]  # the final model's, after its checkpoint, logged at max_steps
    assert sorted(os.listdir(log)) == [".lock", "log.txt", "model_00004.pt", "model_00008.pt",
                                     "model_00009.pt", "run_config.json"]
    ckpt = torch.load(os.path.join(log, "model_00009.pt"), weights_only=False)
    assert set(ckpt) == {"model", "config", "optimizer", "step", "loader", "rng", "val_loss", "args", "tokens_seen"}
    assert ckpt["step"] == 9 and ckpt["val_loss"] == pytest.approx(series["val"][1][2], abs=1e-4)
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    assert ckpt["config"]["n_layer"] == 2 and ckpt["args"]["max_steps"] == 10
    model = tg.model_from_checkpoint(os.path.join(log, "model_00009.pt"))
    assert model.config.n_embd == 64

    # a second run into the same log_dir is refused; --overwrite replaces it
    r = run_cli(*tiny_run_args(shard_dir, log))
    assert r.returncode != 0 and "--resume latest" in r.stderr and "Traceback" not in r.stderr
    assert len(open(os.path.join(log, "log.txt")).readlines()) == 14
    r = run_cli(*tiny_run_args(shard_dir, log, "--max_steps", "3", "--save_every", "0", "--eval_every", "0", "--sample_every", "0", "--overwrite"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(log)) == [".lock", "log.txt", "model_00002.pt", "run_config.json"]
    assert set(tg.read_log(os.path.join(log, "log.txt"))) == {"train"}


def test_resume_gives_identical_losses(shard_dir, tmp_path):
    straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
    r = run_cli(*tiny_run_args(shard_dir, straight, "--save_every", "0"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*tiny_run_args(shard_dir, resumed, "--save_every", "0", "--stop_step", "5"))
    assert r.returncode == 0, r.stderr
    assert os.listdir(resumed) and tg.find_checkpoints(resumed)[-1].endswith("model_00004.pt")
    with open(os.path.join(resumed, "log.txt"), "a") as f:
        f.write("5 train 1.0\n")  # as if the job died after logging a step it never saved
    r = run_cli(*tiny_run_args(shard_dir, resumed, "--save_every", "0", "--resume", "latest"))
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    a = open(os.path.join(straight, "log.txt")).read()
    b = open(os.path.join(resumed, "log.txt")).read()
    assert a == b


@pytest.mark.parametrize("extra, message", [
    (["-T", "128"], "block_size"),
    (["--total_batch_size", "100"], "not divisible"),
    (["--data_root", "/nonexistent/data"], "--input"),  # tries to prepare it; offline: explains --input
    (["--resume", "latest"], "no model_*.pt"),
    (["--n_head", "3"], "divisible"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["-B", "0"], "" if torch.cuda.is_available() else "CUDA"),
])
def test_cli_bad_input_is_one_clear_line(shard_dir, tmp_path, extra, message):
    r = run_cli(*tiny_run_args(shard_dir, str(tmp_path / "log"), *extra))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr


def test_resume_from_a_broken_checkpoint_is_one_line(shard_dir, tmp_path):
    bad = tmp_path / "model_00003.pt"
    bad.write_bytes(b"not a checkpoint")
    r = run_cli(*tiny_run_args(shard_dir, str(tmp_path), "--resume", str(bad)))
    assert r.returncode == 1 and "not a readable checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_bad_flag_value_exits_nonzero_without_traceback():
    r = run_cli("--max_steps", "many", subprocess_run=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: argument --max_steps: expected an integer, not 'many' (see --help)"


def test_preset_defaults_and_overrides():
    args = tg.parse_args([])
    assert (args.max_lr, args.warmup_steps, args.max_steps, args.weight_decay, args.total_batch_size) == (6e-4, 715, 19073, 0.1, 524288)
    assert (args.micro_batch_size, args.sequence_length, args.eval_every, args.sample_every, args.save_every, args.seed) == (64, 1024, 250, 250, 5000, 1337)
    assert args.data_root == os.path.join(REPO, "edu_fineweb10B") and args.log_dir == "log"
    tiny = tg.parse_args(["--preset", "tiny", "--max_steps", "7"])
    assert tiny.sequence_length == 256 and tiny.max_steps == 7
    assert tg.model_config_from_args(tiny).n_layer == 4
    assert tg.model_config_from_args(tg.parse_args(["--preset", "tiny", "--n_layer", "2"])).n_layer == 2
    assert tg.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu") or torch.backends.mps.is_available()


def test_hellaswag_missing_data_warns_and_trains_on(shard_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HELLASWAG_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("HELLASWAG_OFFLINE", "1")
    log = str(tmp_path / "log")
    r = run_cli(*tiny_run_args(shard_dir, log, "--hellaswag_every", "2", "--max_steps", "3", "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("warning: HellaSwag evaluation turned off") == 1
    assert "hella" not in tg.read_log(os.path.join(log, "log.txt"))


def test_train_prepares_missing_data_from_input(tmp_path):
    from conftest import write_corpus_jsonl
    corpus = str(tmp_path / "corpus.jsonl")
    write_corpus_jsonl(corpus)
    data, log = str(tmp_path / "data"), str(tmp_path / "log")
    r = run_cli(*tiny_run_args(data, log, "--input", corpus, "--max_steps", "2", "--sample_every", "0", "--save_every", "0"))
    assert r.returncode == 0, r.stderr
    assert "preparing them from" in r.stdout
    assert tg.list_shards(data, "val") and tg.list_shards(data, "train")
    assert tg.read_log(os.path.join(log, "log.txt"))["train"][0] == [0, 1]


def test_compile_on_with_val_hellaswag_and_samples(shard_dir, tmp_path, monkeypatch):
    from conftest import write_hellaswag
    write_hellaswag(str(tmp_path / "hs"), 8)
    monkeypatch.setenv("HELLASWAG_DIR", str(tmp_path / "hs"))
    flags = ["--max_steps", "4", "--eval_every", "2", "--hellaswag_every", "2", "--sample_every", "2"]
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    assert run_cli(*tiny_run_args(shard_dir, eager, *flags, "--no-compile")).returncode == 0
    r = run_cli(*tiny_run_args(shard_dir, compiled, *flags, "--compile"))
    assert r.returncode == 0, r.stderr
    assert " compile=True" in r.stdout and r.stdout.count("sample 0:") == 2
    a, b = tg.read_log(os.path.join(eager, "log.txt")), tg.read_log(os.path.join(compiled, "log.txt"))
    assert set(a) == set(b) == {"train", "val", "hella"}
    for kind in a:
        assert a[kind][0] == b[kind][0] and a[kind][1] == pytest.approx(b[kind][1], abs=1e-4)
