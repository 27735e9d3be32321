"""Training: the LR schedule, the batch ramp, gradient accumulation, DataLoaderLite, the loop end to
end (what a run prints and writes, its run config), exact resume, data prepared on first use,
HellaSwag and torch.compile in the loop, --init_from. On the CPU in fp32."""
import functools
import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch

import common
import fineweb
import rundir
import settings
import train_gpt2 as tg
from helpers import (RUN_FLAGS, SAVES, SHAPE_FLAGS, assert_one_line_error, hf_gpt2, log_of,
                     resume_args, run_args, run_cli, series, step_lines, write_corpus_jsonl,
                     write_hellaswag)

QUIET = ["--eval_every", "0", "--sample_every", "0"]


# ---------------------------------------------------------------------------------------- schedules

def test_lr_schedule():
    kw = dict(max_lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=110)
    assert tg.get_lr(0, **kw) == pytest.approx(6e-4 / 10)
    assert tg.get_lr(9, **kw) == pytest.approx(6e-4)  # warmup end
    assert tg.get_lr(10, **kw) == pytest.approx(6e-4)  # cosine start
    assert tg.get_lr(60, **kw) == pytest.approx((6e-4 + 6e-5) / 2)  # midpoint
    cosine = 0.5 * (1 + math.cos(math.pi * 99 / 100))
    assert tg.get_lr(109, **kw) == pytest.approx(6e-5 + cosine * 5.4e-4)
    assert tg.get_lr(110, **kw) == pytest.approx(6e-5) == tg.get_lr(500, **kw)
    steps = [tg.get_lr(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(steps, steps[1:]))


@pytest.mark.slow
def test_warmup_stable_decay_schedule(data, tmp_path):
    """--wsd_decay 0.4 of 110 steps: warmup to step 9, max_lr to step 65, then a straight line to
    min_lr at step 110 (44 steps); a run logs these LRs."""
    kw = dict(max_lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=110, wsd_decay=0.4)
    assert tg.get_lr(0, **kw) == pytest.approx(6e-4 / 10) and tg.get_lr(9, **kw) == 6e-4
    assert tg.get_lr(10, **kw) == tg.get_lr(65, **kw) == 6e-4  # stable
    for step in (66, 88, 109):  # decay: linear from step 66 (6e-4) to 110 (6e-5)
        assert tg.get_lr(step, **kw) == pytest.approx(6e-4 - 5.4e-4 * (step - 66) / 44)
    assert tg.get_lr(110, **kw) == pytest.approx(6e-5) == tg.get_lr(500, **kw)
    # the decay never starts inside the warmup
    assert tg.get_lr(3, **{**kw, "wsd_decay": 1.0}) == pytest.approx(6e-4 * 4 / 10)
    assert tg.get_lr(10, **{**kw, "wsd_decay": 1.0}) == 6e-4
    log = str(tmp_path / "log")  # 8 steps, warmup 2, decay over the last 4
    r = run_cli(*run_args(data, log, "--wsd_decay", "0.5", "--max_lr", "1e-3", *QUIET))
    assert r.returncode == 0, r.stderr
    lrs = [float(line.split("lr ")[1].split()[0]) for line in r.stdout.splitlines()
           if line.startswith("step ")]
    want = [tg.get_lr(s, 1e-3, 1e-4, 2, 8, 0.5) for s in range(8)]
    assert lrs == pytest.approx(want, rel=1e-4)  # the step line prints 5 digits
    assert want[1:4] == [1e-3] * 3 and want[4] == 1e-3 and want[5] < 1e-3


def test_batch_size_ramp_schedule():
    unit = 64
    sizes = [tg.batch_size_at(t, 2048, 512, unit, start=128)
             for t in (0, 512, 1024, 2047, 2048, 10 ** 6)]
    assert sizes == [128, 192, 320, 448, 512, 512]  # 128 + 384*t/2048, down to a multiple of 64
    assert tg.batch_size_at(0, 0, 512, unit) == 512  # off
    assert tg.batch_size_at(0, 10 ** 9, 524288, 8 * 65536) == 8 * 65536  # never below a micro-step


def test_accumulation_steps():
    args, _, _ = settings.read_flags(["-B", "4", "-T", "32", "--total_batch_size", "1024"])
    assert settings.accumulation_steps(args, 2, 64) == 4
    with pytest.raises(common.UsageError, match="not divisible"):
        settings.accumulation_steps(args, 3, 64)
    with pytest.raises(common.UsageError, match="block_size"):
        settings.accumulation_steps(args, 1, 16)


def test_grad_accumulation_equals_big_batch(data, tmp_path):
    # train()'s micro-step loop: 4 micro-batches of 2 sequences give the loss and gradient norm of
    # one batch of 8 (the loader hands out the same windows for any B); the norm would show a
    # missing 1/4
    runs = []
    for B in ("2", "8"):
        log = str(tmp_path / f"B{B}")
        r = run_cli(*run_args(data, log, "-B", B, "--total_batch_size", "256", "--max_steps", "2",
                              *QUIET))
        assert r.returncode == 0, r.stderr
        runs.append(step_lines(r.stdout))
    assert sorted(runs[0]) == sorted(runs[1]) == [0, 1]
    for step in (0, 1):  # step 1's loss is taken after the first update
        assert runs[0][step] == pytest.approx(runs[1][step], rel=1e-4)


# ---------------------------------------------------------------------------------- the data loader

def stream(root, split):
    paths = fineweb.list_shards(root, split)
    return np.concatenate([np.load(p) for p in paths]).astype(np.int64)


def test_loader_reads_consecutive_windows_across_shards(data):
    B, T = 4, 64
    loader = tg.DataLoaderLite(B, T, split="train", data_root=data)
    assert all(isinstance(t, np.memmap) for t in loader.tokens)  # shards are never read whole
    ref = stream(data, "train")
    assert loader.epoch_tokens == len(ref)
    for i in range(len(ref) * 3 // 2 // (B * T)):  # across every shard end, into epoch 1
        x, y = loader.next_batch()
        assert x.dtype == torch.long and x.shape == (B, T)
        start = i * B * T
        if start + B * T + 1 <= len(ref):
            assert np.array_equal(x.flatten().numpy(), ref[start:start + B * T])
            assert np.array_equal(y.flatten().numpy(), ref[start + 1:start + B * T + 1])


def test_loader_ranks_interleave_like_one_process(data):
    single = tg.DataLoaderLite(2, 32, 0, 1, "train", data)
    ranks = [tg.DataLoaderLite(2, 32, r, 2, "train", data) for r in range(2)]
    for _ in range(single.epoch_tokens * 3 // 2 // (2 * 2 * 32)):  # 1.5 epochs
        for r in ranks:
            x, y = r.next_batch()
            xs, ys = single.next_batch()
            assert torch.equal(x, xs) and torch.equal(y, ys)


def test_loader_epochs_shuffle_train_shards_seeded(data):
    def epoch_orders(seed, split):
        loader = tg.DataLoaderLite(2, 32, split=split, data_root=data, seed=seed)
        orders = []
        for epoch in range(6):
            loader._use_epoch(epoch)
            orders.append(loader.order.tolist())
        return orders

    orders = epoch_orders(1337, "train")
    assert orders[0] == [0, 1, 2]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert any(o != [0, 1, 2] for o in orders[1:])
    assert orders == epoch_orders(1337, "train") and orders != epoch_orders(7, "train")
    assert epoch_orders(1337, "val") == [[0]] * 6
    # the stream really follows the order: epoch 1 begins with its first shard
    loader = tg.DataLoaderLite(1, 100, split="train", data_root=data)
    loader.position = loader.epoch_tokens
    loader._use_epoch(1)
    first = loader.order[0]
    assert np.array_equal(loader.next_batch()[0].flatten().numpy(),
                          np.load(loader.shards[first])[:100])


def test_loader_state_dict_resumes_exactly(data):
    a = tg.DataLoaderLite(4, 32, split="train", data_root=data)
    for _ in range(170):
        a.next_batch()
    state = a.state_dict()
    b = tg.DataLoaderLite(4, 32, split="train", data_root=data)
    b.load_state_dict(state)
    for _ in range(50):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    a.reset()
    fresh = tg.DataLoaderLite(4, 32, split="train", data_root=data)
    assert torch.equal(a.next_batch()[0], fresh.next_batch()[0])


def test_loader_errors(tmp_path, data):
    with pytest.raises(common.UsageError, match="fineweb.py"):
        tg.DataLoaderLite(2, 32, split="train", data_root=str(tmp_path))
    with pytest.raises(common.UsageError, match="fewer than one batch"):
        tg.DataLoaderLite(64, 1024, split="val", data_root=data)
    # shards open by their headers alone; a token id past the vocabulary is found where it is read
    tokens = np.arange(200, dtype=np.uint16)
    tokens[150] = 50300
    np.save(tmp_path / "x_train_000001.npy", tokens)
    loader = tg.DataLoaderLite(2, 32, split="train", data_root=str(tmp_path))
    loader.next_batch(), loader.next_batch()  # tokens 0-128: fine
    with pytest.raises(common.UsageError) as e:
        loader.next_batch()
    assert str(e.value) == (f"{tmp_path / 'x_train_000001.npy'}: token id 50300 at offset 150 is "
                            f">= the vocabulary size 50257")


# ----------------------------------------------------------------------------------------- the loop

def test_the_tiny_run_end_to_end(data, reference_run, tmp_path):
    """The tiny run: what it prints and writes (a real process writes the same: below)."""
    ref, r = reference_run
    assert "run config:\n" in r.stdout and " grad_accum_steps=1" in r.stdout
    saved = json.load(open(os.path.join(ref, "run_config.json")))  # as the run resolved it
    assert saved["grad_accum_steps"] == 1 and saved["model"]["n_layer"] == 1
    assert saved["max_steps"] == 8 and saved["device"] == "cpu"
    assert r.stdout.count("rank 0 sample 0:") == 3  # steps 3, 6 and the final model
    assert "Hello, I'm a language model," in r.stdout
    logged = series(ref)
    assert logged["train"][0] == list(range(8))
    assert logged["val"][0] == [0, 3, 6, 8]  # the final model's, after its checkpoint
    assert sorted(os.listdir(ref)) == [".lock", "log.txt", "model_00002.pt", "model_00004.pt",
                                       "model_00006.pt", "model_00007.pt", "run_config.json"]
    assert [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("saved ")] == \
        rundir.find_checkpoints(ref)
    ckpt = torch.load(os.path.join(ref, "model_00007.pt"), weights_only=False)
    assert set(ckpt) == {"model", "config", "optimizer", "step", "loader", "rng", "val_loss",
                         "args", "tokens_seen", "provenance", "scaler", "tokenizer"}
    assert ckpt["step"] == 7 and ckpt["tokens_seen"] == 8 * 64
    assert set(ckpt["tokenizer"]) == {"name", "fingerprint"}  # GPT-2's BPE: no files kept
    assert ckpt["val_loss"] == pytest.approx(logged["val"][1][2], abs=1e-4)  # step 6's
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    assert ckpt["config"]["n_layer"] == 1 and ckpt["args"]["max_steps"] == 8
    path = os.path.join(ref, "model_00007.pt")
    width = int(RUN_FLAGS["--n_embd"])
    assert tg.model_from_checkpoint(rundir.read_checkpoint(path), path).config.n_embd == width

    # a second run into the same log_dir is refused; --overwrite replaces it
    log = str(tmp_path / "log")
    shutil.copytree(ref, log)
    r = run_cli(*run_args(data, log))
    assert_one_line_error(r, "holds an earlier run", "--resume latest", "--overwrite")
    assert log_of(log) == log_of(ref)
    r = run_cli(*run_args(data, log, "--max_steps", "3", *QUIET, "--overwrite"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(log)) == [".lock", "log.txt", "model_00002.pt", "run_config.json"]
    assert set(series(log)) == {"train", "lr", "norm", "dt", "tok_s"}  # no evaluation


@pytest.mark.slow
def test_a_real_process_writes_what_main_in_this_process_does(data, reference_run, tmp_path):
    """`python train_gpt2.py` as a process of its own (one thread, as this process): the reference
    run's log, checkpoints and printed lines, the same to the last digit written."""
    ref, in_process = reference_run
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, *SAVES), subprocess_run=True)
    assert r.returncode == 0, r.stderr
    assert log_of(log) == log_of(ref)
    assert sorted(os.listdir(log)) == sorted(os.listdir(ref))

    def text(stdout, folder):  # the timings and the log dir (and so the wrapping) differ
        kept = re.sub(r"\| dt .*|in \d+:\d\d:\d\d", "", stdout)
        return "".join(kept.split()).replace(folder, "LOG")
    assert text(r.stdout, log) == text(in_process.stdout, ref)


def test_the_run_config_is_grouped_as_the_flag_table(reference_run):
    """The run config a run prints: the set values of each group of RUN_SETTINGS, then what the
    run worked out, then the model's GPTConfig, wrapped at 100 columns."""
    _, r = reference_run
    lines = r.stdout.split("run config:\n", 1)[1].splitlines()
    block = []
    for line in lines:
        if not line.startswith("  "):
            break
        block.append(line)
    assert all(len(line) <= 100 for line in block), block
    groups, title = {}, None
    for line in block:
        if not line.startswith("    "):  # a group's first line
            title, line = line.strip().split(": ", 1)
            groups[title] = ""
        groups[title] += " " + line.strip()
    titles = [t.split(" (")[0] for t in settings.RUN_SETTINGS]
    assert list(groups) == titles + ["this run", "GPTConfig", "tokenizer", "provenance"]
    assert groups["tokenizer"].startswith(" name=gpt2 fingerprint=")
    for title, entries in zip(titles, settings.RUN_SETTINGS.values()):
        names = {common.flag_dest(e[0]) for e in entries}
        keys = re.findall(r" (\w+)=", groups[title])
        assert set(keys) <= names and len(keys) == len(set(keys)), title
    assert " n_layer=1 " in groups["model"] and " max_steps=8 " in groups["optimisation"]
    assert " sample_prompt=Hello, I'm a language model, " in groups[titles[2]]
    assert " seed=1337 " in groups["data"] and " device=cpu " in groups["this invocation"]
    # what settle() derived (the precision by its name); none False, no dict (those follow)
    assert groups["this run"] == (" device_type=cpu world_size=1 local_world_size=1 precision=fp32"
                                  " grad_accum_steps=1 end_step=8")
    assert f" n_embd={RUN_FLAGS['--n_embd']} " in groups["GPTConfig"]
    assert " vocab_size=50304 " in groups["GPTConfig"]


# The runs that resume exactly: GPT-2's, and the modern architecture's with AdamW and with Muon
RESUMED = {"gpt2": [], "modern-adamw": ["--arch", "modern"],
           "modern-muon": ["--arch", "modern", "--optimizer", "muon"]}


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) if RESUMED[name] else name
                        for name in RESUMED])  # the quick subset: GPT-2's
def straight(request, data, tmp_path):
    """(the flags, the log dir of the tiny run with them, uninterrupted)"""
    flags = RESUMED[request.param]
    if not flags:  # GPT-2's: the session's reference run
        return flags, request.getfixturevalue("reference")
    log = str(tmp_path / "straight")
    r = run_cli(*run_args(data, log, *flags))
    assert r.returncode == 0, r.stderr
    return flags, log


def test_resume_gives_identical_losses(data, straight, tmp_path):
    flags, reference = straight
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, *flags, *SAVES, "--stop_step", "5"))
    assert r.returncode == 0, r.stderr
    assert [rundir.checkpoint_step(p) for p in rundir.find_checkpoints(log)] == [2, 4]
    with open(os.path.join(log, "log.txt"), "a") as f:
        f.write("5 train 1.0\n")  # as if the job died after logging a step it never saved
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert f"resumed from {rundir.checkpoint_path(log, 4)} at step 5" in r.stdout
    assert log_of(log) == log_of(reference)
    # and the weights, bit for bit: on random tokens the losses start near ln(vocab_size), where a
    # few steps hardly move them
    final, ref = (torch.load(rundir.checkpoint_path(d, 7), weights_only=False)["model"]
                  for d in (log, reference))
    assert ref.keys() == final.keys() and all(torch.equal(final[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_batch_ramp_resumes_exactly(data, tmp_path):
    ramp = ["--max_steps", "8", "--total_batch_size", "512", "--batch_ramp_tokens", "2048",
            "--batch_ramp_start", "128", *QUIET]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    r = run_cli(*run_args(data, a, *ramp))
    assert r.returncode == 0, r.stderr
    # the batch grows with the tokens seen
    assert re.search(r"\| batch 128\b", r.stdout) and re.search(r"\| batch 320\b", r.stdout)
    r = run_cli(*run_args(data, b, *ramp, "--stop_step", "3"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*resume_args(b))
    assert r.returncode == 0, r.stderr
    assert log_of(a) == log_of(b)


def test_train_prepares_missing_data_from_input(tmp_path):
    corpus = write_corpus_jsonl(tmp_path / "corpus.jsonl")
    root, log = str(tmp_path / "data"), str(tmp_path / "log")
    r = run_cli(*run_args(root, log, "--input", corpus, "--max_steps", "2", *QUIET))
    assert r.returncode == 0, r.stderr
    assert f"no shards in {root}: preparing them from {corpus}" in r.stdout
    assert fineweb.list_shards(root, "val") and fineweb.list_shards(root, "train")
    assert series(log)["train"][0] == [0, 1]


def test_hellaswag_missing_data_warns_and_trains_on(data, tmp_path, monkeypatch):
    monkeypatch.setenv("HELLASWAG_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("HELLASWAG_OFFLINE", "1")
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--hellaswag_every", "2", "--max_steps", "3",
                          "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("warning: HellaSwag evaluation turned off") == 1
    assert "hella" not in series(log)


@pytest.mark.slow
def test_compile_on_with_val_hellaswag_and_samples(data, tmp_path, monkeypatch):
    """--compile: the loop with val, HellaSwag and samples around a compiled model gives eager's
    numbers. Compiled with aot_eager (dynamo's graphs, AOTAutograd's forward and backward, as
    inductor gets them): inductor's own C++ build takes ~35 s on 2 cores with a cold cache, and
    the GPU's kernels are not CPU ones (bench.py --suite gpu-estimate --compile builds those)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    write_hellaswag(str(tmp_path / "hs"), 8)
    monkeypatch.setenv("HELLASWAG_DIR", str(tmp_path / "hs"))
    flags = ["--max_steps", "4", "--eval_every", "2", "--hellaswag_every", "2",
             "--sample_every", "2"]
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    assert run_cli(*run_args(data, eager, *flags, "--no-compile")).returncode == 0
    r = run_cli(*run_args(data, compiled, *flags, "--compile"))
    assert r.returncode == 0, r.stderr
    assert " compile=True" in r.stdout and r.stdout.count("sample 0:") == 2
    a, b = series(eager), series(compiled)
    assert set(a) == set(b) == {"train", "val", "val_bpb", "hella", "lr", "norm", "dt", "tok_s"}
    for kind in ("train", "val", "hella", "lr"):
        assert a[kind][0] == b[kind][0] and a[kind][1] == pytest.approx(b[kind][1], abs=1e-4)


def test_init_from_a_checkpoint_of_ours(data, reference, tmp_path):
    """--init_from log/model_NNNNN.pt: the checkpoint's weights and shape (the new run's step-0
    val loss is the reference run's after that checkpoint's step), a fresh optimizer and schedule
    from step 0 on the flags given; a shape flag that disagrees with it, refused in one line."""
    newest = rundir.find_checkpoints(reference)[-1]
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--init_from", newest, "--max_steps", "2", "--max_lr", "1e-3",
                          "--warmup_steps", "2", "--eval_every", "1", "--sample_every", "0",
                          drop=SHAPE_FLAGS))
    assert r.returncode == 0, r.stderr
    ours, theirs = series(log), series(reference)
    assert ours["val"][1][0] == pytest.approx(theirs["val"][1][-1], abs=1e-6)
    assert ours["lr"] == ([0, 1], [pytest.approx(tg.get_lr(s, 1e-3, 1e-4, 2, 2)) for s in (0, 1)])
    saved, source = (torch.load(p, weights_only=False)
                     for p in (rundir.find_checkpoints(log)[-1], newest))
    assert saved["config"] == source["config"] and saved["step"] == 1
    r = run_cli(*run_args(data, str(tmp_path / "again"), "--init_from", newest, "--n_layer", "3",
                          drop=SHAPE_FLAGS))
    assert_one_line_error(r, "--init_from loads a model with its shape", "--n_layer")


@pytest.mark.slow
def test_init_from_pretrained_trains(data, tmp_path):
    hf, path = hf_gpt2(tmp_path)
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--init_from", path, "--max_steps", "2", "--eval_every", "1",
                          "--sample_every", "0", "--val_tokens", "256", drop=SHAPE_FLAGS))
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(os.path.join(log, "model_00001.pt"), weights_only=False)
    assert ckpt["config"]["vocab_size"] == 50304 and ckpt["config"]["real_vocab_size"] == 50257
    assert ckpt["config"]["n_layer"] == 2 and ckpt["config"]["n_embd"] == 64  # the weights' shape
    # the step-0 val loss is the OpenAI-format weights' loss on the first 256 val targets, by HF
    val = np.load(fineweb.list_shards(data, "val")[0]).astype(np.int64)
    x = torch.from_numpy(val[:256]).view(8, 32)
    y = torch.from_numpy(val[1:257]).view(8, 32)
    with torch.no_grad():
        logits = hf(x).logits
    want = torch.nn.functional.cross_entropy(logits.view(-1, 50257), y.reshape(-1)).item()
    assert series(log)["val"][1][0] == pytest.approx(want, abs=1e-4)
