"""
Measure the hot paths of this repository for one setting, and print one table (or --json).

    python bench.py                                             # CPU: the default rows, ~1 minute
    python bench.py --long                                      # and the loop at parity (minutes)
    python bench.py --preset gpt2 -B 64 -T 1024 --device cuda   # GPT-2 124M, a GPU (bf16, compiled)
    python bench.py --suite gpu --out results/  # CUDA tests + GPU benchmark, one JSON + one table
    python bench.py --suite gpu-estimate        # no GPU: GPT-2's memory, FLOPs, roofline on an H100

Default rows: training (tokens/s, ms/step, MFU, peak memory; median of timed steps after warm-up,
GPU synchronized), one optimizer step (AdamW vs Muon), HellaSwag scoring (batched vs one example
per forward), generation (KV cache vs recompute), DataLoaderLite (µs/batch and resident memory over
memory-mapped shards), a checkpoint save, fineweb tokenization (tokens/s) and start-up (opening 2 vs
100 shards of the same size). Long rows, by name with --only: parity (train_gpt2.train() against a
build-nanogpt-style loop, alternated), train_loop, fineweb_naive, optimizers_compare; --long adds
the first two. All inputs are synthetic, so nothing needs to be downloaded (`--fineweb_input` takes
a real corpus instead).
"""

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import torch

import common
import fineweb
import metrics
import rundir
import settings
import train_gpt2 as tg


def sync(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device_type, warmup, iters):
    """Median seconds of fn() over iters calls after warmup calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device_type)
        t0 = time.perf_counter()
        fn()
        sync(device_type)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_backward(model, loader, micro_steps, autocast_ctx):
    """The micro-step loop of train_gpt2.train(): gradients of one optimizer step, accumulated."""
    for _ in range(micro_steps):
        x, y = loader.next_batch()
        with autocast_ctx:
            _, loss = model(x, y)
        (loss / micro_steps).backward()


class RandomLoader:
    """Stands in for DataLoaderLite: random token batches already on the device."""

    def __init__(self, B, T, vocab, device):
        self.B, self.T, self.vocab, self.device = B, T, vocab, device

    def next_batch(self):
        buf = torch.randint(0, self.vocab, (self.B * self.T + 1,), device=self.device)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


def rss_bytes():
    """Resident memory of this process now (Linux), else its peak so far (macOS), else None
    (Windows has neither /proc nor the resource module)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


def bench_training(args, config, device, device_type, autocast_ctx):
    model = tg.GPT(config).to(device)
    optimizer = model.configure_optimizers(0.1, 6e-4, device_type, verbose=False)
    if args.foreach_adamw:
        for g in optimizer.param_groups:
            g["fused"], g["foreach"] = False, True
    train_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
    loader = RandomLoader(args.micro_batch_size, args.sequence_length, config.real_vocab_size,
                          device)
    accum = args.grad_accum

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward(train_model, loader, accum, autocast_ctx)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dt = timed(step, device_type, args.warmup, args.steps)
    tokens = args.micro_batch_size * args.sequence_length * accum
    flops = metrics.flops_per_token(config, model.get_num_params(non_embedding=True),
                               args.sequence_length)
    peak = args.peak_flops or (metrics.peak_flops(torch.cuda.get_device_name(device))
                               if device_type == "cuda" else None)
    row = {"tokens_per_sec": tokens / dt, "ms_per_step": dt * 1000, "tokens_per_step": tokens,
           "mfu": flops * tokens / dt / peak if peak else None,
           "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                            if device_type == "cuda" else None)}
    return row


def bench_generation(args, config, device, device_type, autocast_ctx):
    torch.manual_seed(0)
    model = tg.GPT(config).to(device).eval()
    prompt = torch.randint(0, config.real_vocab_size, (1, 16), device=device)
    new = min(args.gen_tokens, config.block_size - 16)
    rows = {}
    for use_cache in (True, False):
        def run():
            with autocast_ctx:
                model.generate(prompt, new, top_k=1, use_cache=use_cache)
        dt = timed(run, device_type, 1, 3)
        rows["kv_cache" if use_cache else "no_cache"] = new / dt
    rows["speedup"] = rows["kv_cache"] / rows["no_cache"]
    rows["new_tokens"] = new
    return rows


def synthetic_hellaswag(n, seed=0):
    """n made-up examples in HellaSwag's record schema, with realistic lengths (context ~40,
    endings ~20 tokens)."""
    import random

    rng = random.Random(seed)
    words = ("the a man woman dog ball runs jumps into water slowly then picks up throws it over "
             "fence and").split()

    def sentence(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    return [{"ctx": sentence(25, 55).capitalize() + ".",
             "endings": [sentence(10, 30) + "." for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(n)]


def time_scoring(model, examples, device, modes, autocast_dtype=None, warmup=1, repeats=3):
    """Median seconds per pass over examples and the predictions of each mode ({name:
    score_examples kwargs}).

    A fresh process is much slower at first (above all in a VM): warmup untimed passes come first,
    then repeats timed ones with the modes interleaved pass by pass, so load changes on the machine
    hit them alike. Rendering is included in every pass.
    """
    import hellaswag

    device_type = device.split(":")[0]
    times, preds = {name: [] for name in modes}, {}
    with torch.no_grad():
        for it in range(warmup + repeats):
            for name, kwargs in modes.items():
                sync(device_type)
                t0 = time.perf_counter()
                res = hellaswag.score_examples(model, examples, device,
                                               autocast_dtype=autocast_dtype, **kwargs)
                sync(device_type)
                if it >= warmup:
                    times[name].append(time.perf_counter() - t0)
                preds[name] = [(r["pred"], r["pred_norm"]) for r in res]
    return {name: statistics.median(ts) for name, ts in times.items()}, preds


def bench_hellaswag(args, config, device, autocast_ctx):
    """Examples/s of the classic loop (one example per forward, logits at every position) vs
    batched scoring (batch_tokens per forward, vocab projection only at the scored positions), same
    model."""
    torch.manual_seed(0)
    model = tg.GPT(config).to(device).eval()
    dtype = common.torch_dtype(args.dtype_name)
    examples = synthetic_hellaswag(args.hellaswag_examples)
    modes = {"one_per_forward": dict(batch_tokens=0, full_logits=True),
             "batched": dict(batch_tokens=args.hellaswag_batch_tokens)}
    secs, preds = time_scoring(model, examples, device, modes, dtype)
    row = {name: len(examples) / secs[name] for name in modes}
    return {**row, "speedup": row["batched"] / row["one_per_forward"], "examples": len(examples),
            "batch_tokens": args.hellaswag_batch_tokens,
            "same_predictions": preds["batched"] == preds["one_per_forward"]}


def bench_loader(args, tmp):
    """DataLoaderLite over two 10M-token shards: µs per next_batch and the resident memory it
    adds."""
    rng = np.random.default_rng(0)
    for i, split in enumerate(("val", "train", "train")):
        np.save(os.path.join(tmp, fineweb.shard_name(i, split, prefix="bench")),
                rng.integers(0, fineweb.GPT2_VOCAB_SIZE, 10_000_000, dtype=np.uint16))
    before = rss_bytes()
    loader = tg.DataLoaderLite(args.micro_batch_size, args.sequence_length, split="train",
                               data_root=tmp)
    # about one pass
    n = max(1, min(2000, 20_000_000 // (args.micro_batch_size * args.sequence_length)))
    t0 = time.perf_counter()
    for _ in range(n):
        loader.next_batch()
    dt = time.perf_counter() - t0
    after = rss_bytes()
    added = None
    if before is not None and after is not None:
        added = (after - before) / 2**20
    return {"us_per_batch": dt / n * 1e6, "batches": n, "rss_added_mib": added,
            "shard_tokens": 10_000_000}


def bench_save(args, device, tmp):
    """train_gpt2.Checkpointer.write of the model with its optimizer state (one step taken), the
    way a run saves (rank 0, fsync'ed, renamed into place), for the Run of bench's training flags
    (train_flags) logging to tmp: the median seconds and the file's size. The time a preempted
    run needs inside its scheduler's kill window."""
    with contextlib.redirect_stdout(sys.stderr):  # a warning of settle's: not in --json's output
        run, proc, _ = tg.settle(train_flags(args, device, tmp, tmp, max_steps=2))  # none run
    torch.manual_seed(run.seed)
    model = tg.GPT(run.model).to(run.device)
    optimizer = tg.make_optimizer(model, run)
    x = torch.randint(0, fineweb.GPT2_VOCAB_SIZE, (1, 16), device=run.device)
    model(x, x)[1].backward()
    optimizer.step()
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision.scaler)  # as train()'s
    loader = types.SimpleNamespace(state_dict=lambda: {"position": 0})
    checkpointer = tg.Checkpointer(run, proc, model, optimizer, scaler, loader)
    seconds = []
    for step in range(min(3, args.steps)):  # a few: each writes the whole file
        t0 = time.perf_counter()
        checkpointer.write(step)
        seconds.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds),
            "gib": os.path.getsize(checkpointer.newest()) / 2**30}


def write_token_shards(folder, tokens, seed=0):
    """A val shard and a train shard of random ids, each holding `tokens` (at least 100,000)."""
    rng = np.random.default_rng(seed)
    for i, split in enumerate(("val", "train")):
        ids = rng.integers(0, fineweb.GPT2_VOCAB_SIZE, max(tokens, 100_000))
        np.save(os.path.join(folder, fineweb.shard_name(i, split, prefix="bench")),
                ids.astype(np.uint16))


def train_flags(args, device, data_root, log_dir, max_steps):
    """train_gpt2.py's flags for a run of max_steps steps of bench's shape, with nothing but
    training steps in it (val, samples, HellaSwag and periodic saves off)."""
    tokens = args.micro_batch_size * args.sequence_length * args.grad_accum
    return ["--preset", args.preset, "--device", device, "--dtype", args.dtype,
            "--data_root", data_root, "--log_dir", log_dir,
            "-B", str(args.micro_batch_size), "-T", str(args.sequence_length),
            "--total_batch_size", str(tokens), "--max_steps", str(max_steps),
            "--warmup_steps", "1", "--eval_every", "0", "--sample_every", "0",
            "--hellaswag_every", "0", "--save_every", "0",
            "--compile" if args.compile else "--no-compile"]


def bench_train_loop(args, device):
    """train_gpt2.py's own loop (loader, micro-steps, clipping, LR, update, the step line), run
    through its main() on synthetic shards: the median `dt` of its step lines after the warm-up
    steps."""
    import io
    import re

    tokens = args.micro_batch_size * args.sequence_length * args.grad_accum
    with tempfile.TemporaryDirectory() as tmp:
        write_token_shards(tmp, 10 * tokens)
        flags = train_flags(args, device, tmp, os.path.join(tmp, "log"), args.warmup + args.steps)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if tg.main(flags) != 0:
                raise RuntimeError("train_gpt2.main failed: " + out.getvalue()[-500:])
    dts = [float(ms) for ms in re.findall(r"\| dt ([\d.]+)ms", out.getvalue())][args.warmup:]
    ms = statistics.median(dts)
    return {"ms_per_step": ms, "tokens_per_sec": tokens / (ms / 1000), "tokens_per_step": tokens}


class StepClock:
    """Stands in for stdout: keeps the text, and the wall and CPU time at which each step line is
    printed (the CPU time of this process: less disturbed by other work on a shared machine)."""

    def __init__(self):
        self.parts, self.times, self.cpu_times = [], [], []

    def write(self, text):
        if text.startswith("step "):
            self.times.append(time.perf_counter())
            self.cpu_times.append(time.process_time())
        self.parts.append(text)
        return len(text)

    def flush(self):
        pass

    def step_seconds(self, warmup, cpu=False):
        """Wall (or CPU) seconds from one step line to the next, the first `warmup` steps left
        out: all that a loop does per step (loader, forward, backward, update, read-back, print,
        log)."""
        times = self.cpu_times if cpu else self.times
        return [b - a for a, b in zip(times, times[1:])][warmup:]

    def losses(self):
        import re
        return [float(v) for v in re.findall(r"^step +\d+ \| loss:? ([\d.]+)",
                                             "".join(self.parts), re.M)]


def reference_loop(args, device, data_root, log_dir, max_steps):
    """A training loop written as build-nanogpt writes its own, for the parity row: the same GPT
    class, seed, init, AdamW groups, data order, gradient accumulation, clipping and LR schedule as
    train_gpt2.train() with train_flags() (its settings from the same settled Run), and per step
    the loss read with .item(), a printed line and a line appended to log.txt."""
    run, _, _ = tg.settle(train_flags(args, device, data_root, log_dir, max_steps))
    max_lr, B, T = run.max_lr, run.micro_batch_size, run.sequence_length
    min_lr, accum = max_lr * run.min_lr_ratio, run.grad_accum_steps
    device_type, autocast_ctx = run.device_type, run.precision.autocast

    # one train shard, read whole into an int64 tensor; batches in order from its start
    shard = fineweb.list_shards(data_root, "train")[0]
    tokens = torch.tensor(np.load(shard).astype(np.int64))
    position = 0

    torch.manual_seed(run.seed)
    model = tg.GPT(run.model).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2],
               "weight_decay": run.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=max_lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=device_type == "cuda")
    os.makedirs(log_dir)
    log_file = os.path.join(log_dir, "log.txt")

    for step in range(max_steps):
        t0 = time.time()
        optimizer.zero_grad()
        loss_accum = 0.0
        for _ in range(accum):
            buf = tokens[position: position + B * T + 1]
            position += B * T
            x, y = buf[:-1].view(B, T).to(device), buf[1:].view(B, T).to(device)
            with autocast_ctx:
                _, loss = model(x, y)
            loss = loss / accum
            loss_accum += loss.detach()
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip)
        lr = tg.get_lr(step, max_lr, min_lr, run.warmup_steps, run.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        print(f"step {step:5d} | loss: {loss_accum.item():.6f} | lr {lr:.4e} | norm: {norm:.4f} "
              f"| dt: {dt * 1000:.2f}ms | tok/sec: {B * T * accum / dt:.2f}")
        with open(log_file, "a") as f:
            f.write(f"{step} train {loss_accum.item():.6f}\n")


def bench_parity(args, device):
    """train_gpt2.train() (through its main()) and reference_loop() from the same init on the same
    shards, alternating for --rounds rounds (the first of a round swaps each round): per loop the
    median over rounds of each run's median step (wall time between step lines after --warmup
    steps; and CPU time), and the median over rounds of the ratio train_gpt2 / reference."""
    tokens = args.micro_batch_size * args.sequence_length * args.grad_accum
    max_steps = args.warmup + args.steps + 1  # the first step line starts the clock
    runs = {"train_gpt2": [], "reference": []}
    cpu_runs = {"train_gpt2": [], "reference": []}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_token_shards(tmp, max_steps * tokens + 1)
        for r in range(args.rounds):
            order = ("train_gpt2", "reference") if r % 2 == 0 else ("reference", "train_gpt2")
            for name in order:
                log_dir = os.path.join(tmp, f"{name}_{r}")
                clock = StepClock()
                with contextlib.redirect_stdout(clock):
                    if name == "reference":
                        reference_loop(args, device, tmp, log_dir, max_steps)
                    elif tg.main(train_flags(args, device, tmp, log_dir, max_steps)) != 0:
                        raise RuntimeError("train_gpt2.main failed: " + "".join(clock.parts)[-500:])
                runs[name].append(statistics.median(clock.step_seconds(args.warmup)))
                cpu_runs[name].append(statistics.median(clock.step_seconds(args.warmup, cpu=True)))
                losses.setdefault(name, clock.losses())
                release(device.split(":")[0])
    ms = {name: statistics.median(v) * 1000 for name, v in runs.items()}
    cpu_ms = {name: statistics.median(v) * 1000 for name, v in cpu_runs.items()}

    # the two runs of a round are next to each other in time: their ratio is the least disturbed
    # by a load that changes between rounds
    def ratio(times):
        return statistics.median(a / b for a, b in zip(times["train_gpt2"], times["reference"]))
    return {"train_gpt2_ms": ms["train_gpt2"], "reference_ms": ms["reference"],
            "ratio": ratio(runs),
            "rounds_ms": {name: [t * 1000 for t in v] for name, v in runs.items()},
            "train_gpt2_cpu_ms": cpu_ms["train_gpt2"], "reference_cpu_ms": cpu_ms["reference"],
            "cpu_ratio": ratio(cpu_runs),
            "rounds_cpu_ms": {name: [t * 1000 for t in v] for name, v in cpu_runs.items()},
            "tokens_per_step": tokens, "steps_timed": args.steps, "rounds": args.rounds,
            "max_loss_diff": max(abs(a - b) for a, b in zip(*losses.values())),
            "steps_compared": min(len(v) for v in losses.values())}


def write_sparse_shard(path, n_tokens):
    """A .npy shard of n_tokens uint16 that takes no disk space: a header, then a hole that reads as
    zeros (a valid token id)."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<u2", "fortran_order": False,
                                                 "shape": (n_tokens,)})
        f.truncate(f.tell() + 2 * n_tokens)


def bench_startup(args, tmp):
    """Start-up on folders of 2 and of 100 shards (--startup_shards) of the same size: seconds to
    open the data as train() does (ensure_prepared, the train and val DataLoaderLite, the first
    batch), and to open the train split headers-only (fineweb.open_split with vocab_size None).
    Shard 0 is val, the others train; the folders alternate for --rounds rounds, medians."""
    counts = [int(c) for c in args.startup_shards.split(",")]
    n = args.startup_shard_tokens
    for count in counts:
        os.makedirs(os.path.join(tmp, str(count)))
        for i in range(count):
            write_sparse_shard(os.path.join(tmp, str(count), fineweb.shard_name(i)), n)

    def open_like_train(root):
        fineweb.ensure_prepared(root, train_tokens=n, val_tokens=n, print0=lambda *a: None)
        for split in ("train", "val"):
            tg.DataLoaderLite(args.micro_batch_size, args.sequence_length, split=split,
                              data_root=root).next_batch()

    times = {(kind, c): [] for kind in ("loader", "headers") for c in counts}
    for r in range(args.rounds):
        for count in counts if r % 2 == 0 else counts[::-1]:
            root = os.path.join(tmp, str(count))
            t0 = time.perf_counter()
            open_like_train(root)
            t1 = time.perf_counter()
            fineweb.open_split(root, "train", None)
            times["loader", count].append(t1 - t0)
            times["headers", count].append(time.perf_counter() - t1)
    med = {key: statistics.median(v) for key, v in times.items()}
    return {"shard_tokens": n, "shards": counts, "rounds": args.rounds,
            "loader_s": {c: med["loader", c] for c in counts},
            "headers_only_s": {c: med["headers", c] for c in counts},
            "loader_ratio": med["loader", counts[-1]] / med["loader", counts[0]],
            "headers_only_ratio": med["headers", counts[-1]] / med["headers", counts[0]]}


REPO = os.path.dirname(os.path.abspath(__file__))


def release(device_type):
    """Free what the last row left behind, so the next row's peak memory is its own."""
    import gc

    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


def junit_summary(path):
    """Counts, per-test outcomes (with skip/failure messages) and recorded properties from pytest's
    JUnit XML."""
    import xml.etree.ElementTree as ET

    cases, properties = [], {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                outcome, message = kind, el.get("message")
                break
        case = {"name": tc.get("name"), "outcome": outcome, "seconds": float(tc.get("time") or 0)}
        if message:
            case["message"] = message
        cases.append(case)
        for prop in tc.iter("property"):
            value = prop.get("value")
            try:
                value = float(value)
            except (TypeError, ValueError):
                pass
            properties.setdefault(tc.get("name"), {})[prop.get("name")] = value
    counts = {k: sum(c["outcome"] == k for c in cases)
              for k in ("passed", "failure", "error", "skipped")}
    return {"counts": counts, "cases": cases, "properties": properties}


def run_cuda_tests(out, timeout):
    """pytest tests/test_cuda.py in a subprocess (a fresh CUDA context): its output, summary line
    and outcomes."""
    xml, log = os.path.join(out, "test_cuda.xml"), os.path.join(out, "test_cuda.txt")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           os.path.join("tests", "test_cuda.py"), f"--junitxml={xml}"]
    if os.path.exists(xml):
        os.remove(xml)  # never report an earlier run's outcomes as this one's
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        output, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:  # its captured output comes back as bytes
        output, code = b"".join(x for x in (e.stdout, e.stderr) if x).decode(errors="replace"), None
        output += f"\nstopped after {timeout} s (--tests_timeout)\n"
    with open(log, "w") as f:
        f.write(output)
    lines = [line for line in output.splitlines() if line.strip()]
    res = {"command": " ".join(cmd[1:]), "returncode": code, "ok": code == 0,
           "seconds": time.perf_counter() - t0, "summary": lines[-1].strip("= ") if lines else "",
           "output": log}
    if code is not None and os.path.exists(xml):
        res.update(junit_summary(xml))
    return res


def suite_training(args, config, device, device_type, autocast_ctx):
    """The training row for ours (compiled on CUDA, fused AdamW) and build-nanogpt's configuration
    (eager, fused AdamW, the same SDPA flash attention and model), one after the other."""
    rows = {}
    for name, compiled in (("ours", args.compile), ("build_nanogpt", False)):
        run = argparse.Namespace(**{**vars(args), "compile": compiled, "foreach_adamw": False})
        rows[name] = {**bench_training(run, config, device, device_type, autocast_ctx),
                      "compile": compiled,
                      "fused_adamw": device_type == "cuda"}  # configure_optimizers' rule
        release(device_type)
    rows["speedup"] = rows["ours"]["tokens_per_sec"] / rows["build_nanogpt"]["tokens_per_sec"]
    return rows


def suite_markdown(r):
    """The suite's results as one Markdown page."""
    s, t, h, g = r["setting"], r["train"], r["hellaswag"], r["generate"]
    tests = r.get("tests")
    tested = "CUDA tests: not run (--skip_tests)"
    if tests:
        tested = f"CUDA tests (`{tests['command']}`): {tests['summary']}"

    lines = [f"# GPU suite: {s['gpu'] or s['device']}", "",
             f"torch {s['torch']} (CUDA {s['cuda']}), {s['date']}; model {s['preset']}, "
             f"B={s['B']}, T={s['T']}, {s['grad_accum']} micro-steps "
             f"({t['ours']['tokens_per_step']:,} tokens per step), {s['dtype']}", "",
             tested, "",
             "| training | tokens/s | ms/step | MFU | peak memory |", "|---|---:|---:|---:|---:|"]
    for key, label in (("ours", "ours"), ("build_nanogpt", "build-nanogpt")):
        row = t[key]
        compiled = "compiled" if row["compile"] else "eager"
        adamw = "fused" if row["fused_adamw"] else "foreach"
        mfu = fmt(row["mfu"] * 100 if row["mfu"] else None, "%")
        lines.append(f"| {label}: {compiled}, {adamw} AdamW | {fmt(row['tokens_per_sec'])} | "
                     f"{fmt(row['ms_per_step'])} | {mfu} | {fmt(row['peak_mem_gib'], ' GiB')} |")

    new = g["new_tokens"]
    lines += ["", f"ours / build-nanogpt tokens/s: {fmt(t['speedup'], 'x')}", "",
              "| scoring and generation | value |", "|---|---:|",
              f"| HellaSwag ex/s, one example per forward ({h['examples']} examples) | "
              f"{fmt(h['one_per_forward'])} |",
              f"| HellaSwag ex/s, batched ({h['batch_tokens']} tokens per forward) | "
              f"{fmt(h['batched'])} |",
              f"| HellaSwag batched speedup | {fmt(h['speedup'], 'x')} |",
              f"| HellaSwag same predictions | {'yes' if h['same_predictions'] else 'NO'} |",
              f"| generate tok/s, KV cache ({new} new tokens) | {fmt(g['kv_cache'])} |",
              f"| generate tok/s, recompute ({new} new tokens) | {fmt(g['no_cache'])} |",
              f"| generate KV-cache speedup | {fmt(g['speedup'], 'x')} |"]
    return "\n".join(lines) + "\n"


def run_gpu_suite(args, device, config, autocast_ctx, setting):
    """--suite gpu: the CUDA tests, then every GPU benchmark row; writes gpu_suite.json and
    gpu_suite.md."""
    import datetime

    device_type = device.split(":")[0]
    if device_type != "cuda" and args.device == "auto":
        print("error: --suite gpu needs CUDA and there is none here (to smoke-test the suite on "
              "CPU: --device cpu --preset tiny --skip_tests)", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    setting = {**setting, "cuda": torch.version.cuda, "date": now, "warmup": args.warmup,
               "timed_steps": args.steps}
    results = {"setting": setting}
    if not args.skip_tests:
        results["tests"] = run_cuda_tests(args.out, args.tests_timeout)
        print(f"CUDA tests: {results['tests']['summary']}", flush=True)
    results["train"] = suite_training(args, config, device, device_type, autocast_ctx)
    results["hellaswag"] = bench_hellaswag(args, config, device, autocast_ctx)
    release(device_type)
    results["generate"] = bench_generation(args, config, device, device_type, autocast_ctx)
    with open(os.path.join(args.out, "gpu_suite.json"), "w") as f:
        json.dump(results, f, indent=2)
    page = suite_markdown(results)
    with open(os.path.join(args.out, "gpu_suite.md"), "w") as f:
        f.write(page)
    print(page + f"\nwrote {os.path.join(args.out, 'gpu_suite.json')} and gpu_suite.md")
    if "tests" in results and not results["tests"]["ok"]:
        print(f"error: the CUDA tests did not pass: {results['tests']['summary']} "
              f"(see {results['tests']['output']})", file=sys.stderr)
        return 1
    return 0


ESTIMATE_METHOD = [
    "peak memory: torch's MemTracker over one steady-state step (AdamW state already made) on "
    "FakeTensors: tensor bytes only; the CUDA context, cuBLAS workspaces and the caching "
    "allocator's slack come on top (not estimated)",
    "attention: the flash kernel, as CUDA's SDPA takes it on an H100 (a CPU build of torch would "
    "decompose it into the math path, which stores (B, H, T, T) attention matrices)",
    "FLOPs: torch's FlopCounterMode over forward + backward, against 6N (N: non-embedding "
    "parameters) and metrics.flops_per_token (6N + 12*L*H*Q*T, the MFU column's formula)",
    "roofline: each aten op of the step takes at least max(FLOPs / 989 TFLOP/s, bytes read and "
    "written / 3.35 TB/s) on an H100 SXM; summed with no overlap and no fusion: a lower bound on "
    "eager's step time. MFU ceiling = flops_per_token x tokens / (that time x 989 TFLOP/s): "
    "eager's; torch.compile (the default on CUDA) fuses memory-bound ops and is not bound by it",
    "compiled peak memory: not estimated: MemTracker does not see the tensors inside a compiled "
    "graph (it reports almost no activations); the compiled step's time: --compile (needs "
    "Triton)",
]

COMPILED_METHOD = [
    "compiled: torch.compile(model) as the project calls it (inductor, default mode, static "
    "shapes, one graph) on simulated CUDA: inductor generates the kernels and Triton builds each "
    "for sm_90 (tests/simcuda/inductor.py: a stand-in Triton driver, so no kernel runs, and "
    "autotuning takes each kernel's first configuration, as none can be timed)",
    "kernels: what the compiled forward and backward launch in one micro-step after compiling: "
    "Triton kernels with the buffers passed to them, and extern calls (cuBLAS mm/addmm, flash "
    "attention, fills) with FLOPs from torch's formulas for their shapes",
    "bytes: a Triton kernel reads each input buffer once and writes each output buffer once, "
    "whole; a buffer it reaches only through a loaded index (the embedding lookup, the loss's "
    "pick of the target logit, the embedding gradient's scatter-add) at most one element per "
    "element of its iteration space. Not modelled: a row read twice by a two-pass reduction, L2 "
    "cache hits, a part of a buffer read through plain indexing (counted whole). Inductor's own "
    "estimate_kernel_num_bytes is printed beside it: it counts slices but leaves out some "
    "outputs",
    "compiled roofline: per kernel max(FLOPs / 989 TFLOP/s, bytes / 3.35 TB/s), summed with no "
    "overlap and no launch cost: a lower bound; the Triton kernels' own arithmetic is not "
    "counted (they are memory-bound). Clipping and fused AdamW run outside the compiled model "
    "in the project: counted op by op as in eager. MFU ceiling = flops_per_token x tokens / "
    "(that time x 989 TFLOP/s)",
]


def kernel_seconds(k, est):
    """A kernel of the compiled step on the roofline (tests/simcuda/inductor.py's KernelLog
    entry)."""
    return max(k["flops"] / est["peak_flops"], (k["read"] + k["written"]) / est["bytes_per_s"])


def one_block(kernels, attention):
    """The kernels from the first call of attention to the second: one block's worth (the rest of
    block 0, then block 1 up to its attention)."""
    at = [i for i, k in enumerate(kernels) if k["name"] == attention]
    return kernels[at[0]:at[1]] if len(at) > 1 else []


def compiled_rows(est):
    """Per micro-batch size: the compiled step's figures, from the result of the compiled check
    (tests/simcuda/checks.py)."""
    rows = {}
    for B, r in est["rows"].items():
        phase_ms = {"forward": 0.0, "backward": 0.0}
        by_kind = {"triton": [0, 0, 0.0], "extern": [0, 0, 0.0]}  # launches, bytes, seconds
        memory_bound, inductor_bytes, flops = 0.0, 0, 0
        for phase in phase_ms:
            for k in r[phase]:
                t = kernel_seconds(k, est)
                phase_ms[phase] += t * 1e3
                kind = by_kind[k["kind"]]
                kind[0] += 1
                kind[1] += k["read"] + k["written"]
                kind[2] += t
                flops += k["flops"]
                if (k["read"] + k["written"]) / est["bytes_per_s"] > k["flops"] / est["peak_flops"]:
                    memory_bound += t
                inductor_bytes += k["inductor_bytes"] or 0
        optimizer_ms = sum(op["seconds"] for op in r["optimizer"].values()) * 1e3
        seconds = (phase_ms["forward"] + phase_ms["backward"] + optimizer_ms) / 1e3

        def listed(ks):
            return [{"name": k["name"], "kind": k["kind"], "read": k["read"],
                     "written": k["written"], "flops": k["flops"],
                     "ms": kernel_seconds(k, est) * 1e3} for k in ks]

        rows[int(B)] = {
            "tokens": r["tokens"], "roofline_ms": seconds * 1e3,
            "forward_ms": phase_ms["forward"], "backward_ms": phase_ms["backward"],
            "optimizer_ms": optimizer_ms, "memory_bound_ms": memory_bound * 1e3,
            "triton_launches": by_kind["triton"][0], "triton_gb": by_kind["triton"][1] / 1e9,
            "triton_ms": by_kind["triton"][2] * 1e3,
            "triton_gb_inductor_estimate": inductor_bytes / 1e9,
            "extern_launches": by_kind["extern"][0], "extern_gb": by_kind["extern"][1] / 1e9,
            "extern_ms": by_kind["extern"][2] * 1e3,
            "flops": flops, "flops_over_formula": flops / r["formula"],
            "mfu_ceiling": r["formula"] / (seconds * est["peak_flops"]),
            "tokens_per_sec_ceiling": r["tokens"] / seconds,
            "compile_seconds_here": r["compile_seconds"],
            "kernels": {"forward": listed(r["forward"]), "backward": listed(r["backward"])},
            "one_block": {"forward": listed(one_block(r["forward"],
                                                      "_scaled_dot_product_flash_attention")),
                          "backward": listed(one_block(
                              r["backward"], "_scaled_dot_product_flash_attention_backward"))}}
    return rows


def estimate_rows(est):
    """Per micro-batch size: the figures gpu-estimate prints, from the result of the estimate check
    (tests/simcuda/checks.py)."""
    rows = {}
    for B, r in est["rows"].items():
        roof = r["roofline"]
        seconds = sum(op["seconds"] for op in roof.values())
        bound_by_memory = {name: op["seconds"] for name, op in roof.items()
                           if op["bytes"] / est["bytes_per_s"] > op["flops"] / est["peak_flops"]}
        slowest = sorted(bound_by_memory.items(), key=lambda kv: -kv[1])[:4]
        rows[int(B)] = {
            "tokens": r["tokens"], "peak_mem_gib": r["peak_bytes"] / 2**30,
            "peak_by_kind_gib": {k: v / 2**30 for k, v in r["peak_by_kind"].items() if v},
            "flops": r["flops"], "flops_over_formula": r["flops"] / r["formula"],
            "matmul_flops_over_6n": r["matmul_flops"] / r["six_n"],
            "roofline_ms": seconds * 1e3, "all_at_peak_ms": r["flops"] / est["peak_flops"] * 1e3,
            "memory_bound_ms": sum(bound_by_memory.values()) * 1e3,
            "top_memory_bound_ms": {k: v * 1e3 for k, v in slowest},
            "mfu_ceiling": r["formula"] / (seconds * est["peak_flops"]),
            "tokens_per_sec_ceiling": r["tokens"] / seconds}
    return rows


def run_gpu_estimate(args):
    """--suite gpu-estimate: GPT-2's training step on one simulated H100 (tests/simcuda/), in a
    child process (the simulation's library must load before torch); figures from the code, not a
    measurement."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import simcuda

    from simcuda import inductor

    problem = simcuda.unsupported()
    if problem:
        print(f"error: --suite gpu-estimate runs on simulated CUDA, and {problem}", file=sys.stderr)
        return 1
    problem = inductor.unsupported() if args.compile else None
    if problem:
        print(f"error: --suite gpu-estimate --compile builds inductor's kernels, and {problem}",
              file=sys.stderr)
        return 1
    config = tg.GPTConfig(**settings.MODEL_PRESETS[args.preset])
    T = args.sequence_length or config.block_size
    if T > config.block_size:
        print(f"error: -T {T} exceeds the {args.preset} block size {config.block_size}",
              file=sys.stderr)
        return 1
    try:
        sizes = [int(b) for b in args.estimate_batch_sizes.split(",")]
        if args.micro_batch_size:
            sizes = [args.micro_batch_size]
        if min(sizes) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --estimate_batch_sizes {args.estimate_batch_sizes!r}: expected positive "
              f"integers, e.g. 16,32,64", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        try:
            lib = args.sim_lib or simcuda.build(tmp)
        except simcuda.SimCUDAError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        shape = f"{args.preset}:{','.join(map(str, sizes))}:{T}"
        specs = [f"estimate:{shape}"] + ([f"compiled:{shape}"] if args.compile else [])
        cmd = [sys.executable, os.path.join(REPO, "tests", "simcuda", "checks.py"), lib, *specs]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    found = {}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            entry = json.loads(line[len("RESULT "):])
            found[entry["spec"].split(":")[0]] = entry
    failed = [e for e in found.values() if not e["ok"]]
    if r.returncode != 0 or len(found) < len(specs) or failed:
        why = (failed[0]["error"] if failed else r.stderr).strip().splitlines() or ["no output"]
        print(f"error: the estimate failed: {why[-1]}", file=sys.stderr)
        return 1
    est = found["estimate"]["result"]
    setting = {"preset": args.preset, "T": T, "dtype": est["dtype"],
               "compile": bool(args.compile), "gpu": simcuda.H100,
               "peak_flops": est["peak_flops"], "bytes_per_s": est["bytes_per_s"],
               "non_embedding_params": est["non_embedding_params"], "torch": torch.__version__,
               "command": "python bench.py " + " ".join(shlex.quote(a) for a in args.argv)}
    results = {"setting": setting, "estimate": estimate_rows(est), "method": ESTIMATE_METHOD}
    if args.compile:
        setting["triton"] = inductor.TRITON
        results["compiled"] = compiled_rows(found["compiled"]["result"])
        results["method"] = ESTIMATE_METHOD + COMPILED_METHOD
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_estimate(results)
    return 0


def print_estimate(results):
    s = results["setting"]
    print(f"GPU estimate (from the code, not measured): {s['preset']} "
          f"({s['non_embedding_params']:,} non-embedding parameters), T={s['T']}, {s['dtype']} "
          f"autocast, eager, fused AdamW, one {s['gpu']} "
          f"({s['peak_flops'] / 1e12:.0f} TFLOP/s bf16 dense, {s['bytes_per_s'] / 1e12:.2f} TB/s); "
          f"torch {s['torch']}")
    print(f"command: {s['command']}")
    print("| B | tokens/step | peak tensor memory | FLOPs fwd+bwd | / flops_per_token "
          "| matmuls / 6N | roofline step | of which memory-bound ops | MFU ceiling "
          "| tokens/s ceiling |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for B, r in sorted(results["estimate"].items()):
        print(f"| {B} | {r['tokens']:,} | {r['peak_mem_gib']:.1f} GiB | "
              f"{r['flops'] / 1e12:.2f} T | {r['flops_over_formula']:.3f} | "
              f"{r['matmul_flops_over_6n']:.4f} | {r['roofline_ms']:.1f} ms | "
              f"{r['memory_bound_ms']:.1f} ms | "
              f"{100 * r['mfu_ceiling']:.0f}% | {r['tokens_per_sec_ceiling']:,.0f} |")
    for B, r in sorted(results["estimate"].items()):
        kinds = ", ".join(f"{k.lower()} {v:.1f}" for k, v in r["peak_by_kind_gib"].items())
        ops = ", ".join(f"{k.replace('aten.', '')} {v:.1f}"
                        for k, v in r["top_memory_bound_ms"].items())
        print(f"B={B}: peak GiB by kind: {kinds}; slowest memory-bound ops (ms): {ops}")
    if "compiled" in results:
        print_compiled(results)
    print("method:")
    for line in results["method"]:
        print(f"- {line}")


def print_compiled(results):
    """The compiled step beside eager, and one block's kernels at the largest B."""
    s, eager, compiled = results["setting"], results["estimate"], results["compiled"]
    print(f"\ncompiled (torch.compile, inductor, Triton {s['triton']} kernels for sm_90): "
          f"one micro-step's kernels + clipping and fused AdamW")
    print("| B | roofline step eager | compiled | compiled fwd / bwd / clip+AdamW "
          "| Triton kernels (GB moved; inductor's estimate) | extern calls (GB) "
          "| MFU ceiling eager | compiled | tokens/s ceiling compiled |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for B, c in sorted(compiled.items()):
        e = eager[B]
        print(f"| {B} | {e['roofline_ms']:.1f} ms | {c['roofline_ms']:.1f} ms | "
              f"{c['forward_ms']:.1f} / {c['backward_ms']:.1f} / {c['optimizer_ms']:.1f} ms | "
              f"{c['triton_launches']} ({c['triton_gb']:.1f}; "
              f"{c['triton_gb_inductor_estimate']:.1f}) | "
              f"{c['extern_launches']} ({c['extern_gb']:.1f}) | "
              f"{100 * e['mfu_ceiling']:.0f}% | {100 * c['mfu_ceiling']:.0f}% | "
              f"{c['tokens_per_sec_ceiling']:,.0f} |")
    B = max(compiled)
    block = compiled[B]["one_block"]
    print(f"\none block's kernels, B={B} (from one attention call to the next: the rest of a "
          f"block, then the next up to its attention; --json lists every kernel):")
    print("| pass | kernel | kind | read | written | GFLOP | roofline |")
    print("|---|---|---|---:|---:|---:|---:|")
    for phase in ("forward", "backward"):
        for k in block[phase]:
            print(f"| {phase} | {k['name']} | {k['kind']} | {k['read'] / 2**20:,.1f} MiB | "
                  f"{k['written'] / 2**20:,.1f} MiB | {k['flops'] / 1e9:,.1f} | "
                  f"{k['ms'] * 1e3:,.0f} µs |")
        total = sum(k["ms"] for k in block[phase])
        print(f"| {phase} | **{len(block[phase])} kernels** | | | | | **{total * 1e3:,.0f} µs** |")


def bench_optimizers(args, config, device, device_type, autocast_ctx):
    """ms per optimizer.step() alone, --optimizer adamw vs muon, on the same model and the same
    gradients."""
    torch.manual_seed(0)
    model = tg.GPT(config).to(device)
    loader = RandomLoader(args.micro_batch_size, args.sequence_length, config.real_vocab_size,
                          device)
    forward_backward(model, loader, 1, autocast_ctx)  # gradients that every timed step reuses
    row = {}
    for kind, muon in (("adamw", None), ("muon", {})):
        opt = model.configure_optimizers(0.1, 6e-4, device_type, verbose=False, muon=muon)
        # at least one untimed step: the first one allocates the optimizer state
        row[f"{kind}_ms"] = timed(opt.step, device_type, max(1, args.warmup), args.steps) * 1000
    row["muon_vs_adamw"] = row["muon_ms"] / row["adamw_ms"]
    return row


def stdlib_docstrings(path):
    """Every docstring of this Python's standard library (tests and site-packages left out), in
    path order, as one text file: a few MB of English prose that any machine with Python has."""
    import ast
    import sysconfig

    root, docs = sysconfig.get_paths()["stdlib"], []
    for folder, subdirs, files in os.walk(root):
        skipped = ("test", "tests", "site-packages", "__pycache__")
        subdirs[:] = sorted(d for d in subdirs if d not in skipped)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            docs += [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
    with open(path, "w") as f:
        f.write("\n\n".join(d for d in docs if d))
    return path


def steps_to_reach(steps, values, target):
    """The first evaluated step whose val loss is <= target, or None."""
    return next((s for s, v in zip(steps, values) if v <= target), None)


def compare_optimizers(args, device):
    """Train the tiny preset with AdamW and then with Muon on the same local text; their val loss
    curves.

    The run's step lines go to stderr, so that the table (or --json) is all that stdout holds."""
    tiny = settings.RUN_PRESETS["tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        inputs = args.compare_input
        if not inputs:
            inputs = [stdlib_docstrings(os.path.join(tmp, "stdlib_docstrings.txt"))]
        data = os.path.join(tmp, "data")
        # the val shard holds just what the tiny preset evaluates on; every other token trains
        fineweb.prepare(data, inputs=inputs, shard_size=10_000_000, val_tokens=tiny["val_tokens"],
                        progress=False)

        runs = {}
        for kind in ("adamw", "muon"):
            log_dir = os.path.join(tmp, kind)
            flags = ["--preset", "tiny", "--optimizer", kind, "--data_root", data,
                     "--log_dir", log_dir, "--max_steps", str(args.compare_steps),
                     "--eval_every", str(args.compare_eval_every), "--sample_every", "0",
                     "--device", device, *shlex.split(args.compare_flags)]
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):
                if tg.main(flags) != 0:
                    raise RuntimeError(f"train_gpt2.py {' '.join(flags)} failed")
            steps, values = rundir.read_log(os.path.join(log_dir, "log.txt"))["val"]
            runs[kind] = {"steps": steps, "val": values, "seconds": time.perf_counter() - t0}

    target = runs["adamw"]["val"][-1]
    return {"inputs": args.compare_input or ["stdlib docstrings"], "max_steps": args.compare_steps,
            "flags": args.compare_flags, **runs, "adamw_final_val": target,
            "muon_steps_to_adamw_final": steps_to_reach(runs["muon"]["steps"],
                                                        runs["muon"]["val"], target)}


def print_compare(c):
    print(f"tiny preset {c['flags']}, {c['max_steps']} steps on {' '.join(c['inputs'])}: val loss")
    print(f"{'step':>6} {'AdamW':>8} {'Muon':>8}")
    for step, a, m in zip(c["adamw"]["steps"], c["adamw"]["val"], c["muon"]["val"]):
        print(f"{step:>6} {a:>8.4f} {m:>8.4f}")
    reach = c["muon_steps_to_adamw_final"]
    print(f"Muon reaches AdamW's final val loss {c['adamw_final_val']:.4f} at step "
          f"{reach if reach is not None else 'n/a (never)'} of {c['max_steps']}; "
          f"wall time AdamW {c['adamw']['seconds']:.0f} s, Muon {c['muon']['seconds']:.0f} s")


def fmt(v, unit=""):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.3g}{unit}" if abs(v) < 100 else f"{v:,.0f}{unit}"
    return f"{v}{unit}"


def synthetic_corpus(path, n_docs=3000, seed=0):
    """A ~6 MB English-like .jsonl corpus (a `text` field per line) for the fineweb rows."""
    import random

    rng = random.Random(seed)
    words = ("the of and to in is was for on that with as by at from his her an were are which "
             "this be or river mountain city school teacher student science history water light "
             "energy plant animal learned built grew studied measured found wrote taught because "
             "however during between").split()

    def sentence():
        return " ".join(rng.choice(words) for _ in range(rng.randint(8, 20))).capitalize() + "."
    with open(path, "w") as f:
        for _ in range(n_docs):
            doc = " ".join(sentence() for _ in range(rng.randint(10, 30)))
            f.write(json.dumps({"text": doc}) + "\n")
    return [path]


def bench_fineweb(tmp, num_proc, inputs):
    """fineweb.prepare on the corpus: tokens/s, files to shards."""
    t0 = time.perf_counter()
    fineweb.prepare(os.path.join(tmp, "shards"), inputs=inputs, shard_size=1_000_000,
                    num_proc=num_proc, progress=False)
    dt = time.perf_counter() - t0
    tokens = fineweb.prep_status(os.path.join(tmp, "shards")).tokens
    return {"tokens_per_sec": tokens / dt, "tokens": tokens, "num_proc": num_proc}


def _naive_tokenize(text):
    # build-nanogpt's worker: one document per task, a Python list, then a NumPy array
    tokens = [fineweb.EOT]
    tokens.extend(fineweb.get_encoding().encode_ordinary(text))
    tokens_np = np.array(tokens)
    assert (0 <= tokens_np).all() and (tokens_np < 2**16).all(), \
        "token dictionary too large for uint16"
    return tokens_np.astype(np.uint16)


def _naive_shards(docs, folder, shard_size):
    """build-nanogpt's loop: a Pool of half the cores, imap one document at a time (chunksize 16),
    filling shard_size buffers; returns seconds."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    with mp.get_context().Pool(max(1, (os.cpu_count() or 1) // 2)) as pool:
        buf, count, index = np.empty(shard_size, dtype=np.uint16), 0, 0
        for tokens in pool.imap(_naive_tokenize, docs, chunksize=16):
            if count + len(tokens) < shard_size:
                buf[count:count + len(tokens)] = tokens
                count += len(tokens)
            else:
                room = shard_size - count
                buf[count:count + room] = tokens[:room]
                np.save(os.path.join(folder, fineweb.shard_name(index, "train", "naive")), buf)
                index += 1
                buf[:len(tokens) - room] = tokens[room:]
                count = len(tokens) - room
        if count:
            np.save(os.path.join(folder, fineweb.shard_name(index, "train", "naive")), buf[:count])
    return time.perf_counter() - t0


def bench_fineweb_naive(tmp, num_proc, inputs, shard_size=10_000_000):
    """Tokens/s of fineweb.py vs. the naive build-nanogpt loop on the same corpus, both writing
    shards. The documents are read into memory first (not timed) for both; "end to end" is
    fineweb.prepare on the files, reading included; "limit" is single-thread encode_ordinary x the
    cores."""
    # fineweb's own reader, so the documents are exactly the ones prepare() tokenizes
    docs = [t for t in fineweb.read_documents(inputs) if t]
    enc = fineweb.get_encoding()
    enc.encode_ordinary("warm up")
    t0 = time.perf_counter()
    n_tokens = sum(len(enc.encode_ordinary(t)) + 1 for t in docs)
    single = n_tokens / (time.perf_counter() - t0)

    naive, ours, end_to_end = (os.path.join(tmp, name) for name in ("naive", "ours", "end_to_end"))
    os.makedirs(naive)
    naive_s = _naive_shards(docs, naive, shard_size)
    os.makedirs(ours)
    t0 = time.perf_counter()
    fineweb.write_shards(ours, iter(docs), shard_size=shard_size, val_tokens=shard_size,
                         num_proc=num_proc)
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fineweb.prepare(end_to_end, inputs=inputs, shard_size=shard_size, num_proc=num_proc,
                    progress=False)
    end_to_end_s = time.perf_counter() - t0

    # the three wrote the same token stream (checked after the timing)
    def stream(folder):
        return np.concatenate([np.load(p) for split in ("val", "train")
                               for p in fineweb.list_shards(folder, split)])
    same = np.array_equal(stream(naive), stream(ours))
    same = same and np.array_equal(stream(end_to_end), stream(ours))
    return {"documents": len(docs), "tokens": n_tokens, "cores": os.cpu_count(),
            "num_proc": num_proc, "naive_processes": max(1, (os.cpu_count() or 1) // 2),
            "single_thread_tok_s": single,
            "limit_tok_s": single * (os.cpu_count() or 1), "naive_tok_s": n_tokens / naive_s,
            "ours_tok_s": n_tokens / ours_s, "ours_end_to_end_tok_s": n_tokens / end_to_end_s,
            "speedup": naive_s / ours_s, "same_tokens": same}


def fineweb_results(args, only):
    """The fineweb rows asked for in `only`, on --fineweb_input or a synthetic corpus."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        inputs = args.fineweb_input or synthetic_corpus(os.path.join(tmp, "corpus.jsonl"))
        for row, bench in (("fineweb", bench_fineweb), ("fineweb_naive", bench_fineweb_naive)):
            if row in only:
                os.makedirs(os.path.join(tmp, row))
                results[row] = bench(os.path.join(tmp, row), os.cpu_count() or 1, inputs)
    return results


def fineweb_rows(results):
    rows = []
    if "fineweb" in results:
        w = results["fineweb"]
        rows += [(f"fineweb tokens/s ({w['num_proc']} processes)", fmt(w["tokens_per_sec"]))]
    if "fineweb_naive" in results:
        n = results["fineweb_naive"]
        rows += [("encode_ordinary tok/s, 1 thread", fmt(n["single_thread_tok_s"])),
                 (f"naive tok/s (Pool({n['naive_processes']}), per doc)", fmt(n["naive_tok_s"])),
                 (f"fineweb tok/s from memory ({n['num_proc']} proc)", fmt(n["ours_tok_s"])),
                 ("fineweb tok/s end to end", fmt(n["ours_end_to_end_tok_s"])),
                 ("fineweb vs naive speedup", fmt(n["speedup"], "x"))]
    return rows


# the rows `python bench.py` measures: about half a minute on an idle 2-core CPU
DEFAULT_ROWS = ("train", "optimizers", "hellaswag", "generate", "loader", "save", "fineweb",
                "startup")
LONG_ROWS = {"parity": "train_gpt2.train() vs a build-nanogpt-style loop, alternated",
             "train_loop": "train_gpt2.main's own dt",
             "fineweb_naive": "fineweb.py vs the build-nanogpt tokenizer loop",
             "optimizers_compare": "the tiny preset trained with AdamW and with Muon, minutes"}
LONG_BY_FLAG = ("parity", "train_loop")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(settings.MODEL_PRESETS),
                   help="model shape")
    p.add_argument("-B", "--micro_batch_size", type=int, default=None,
                   help="sequences per forward (default: 64 on CUDA, 8 elsewhere)")
    p.add_argument("-T", "--sequence_length", type=int, default=None,
                   help="tokens per sequence (default: the preset's block size)")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=common.DTYPES,
                   help="autocast dtype; auto: as training's --dtype auto")
    p.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                   help="torch.compile (default: on for CUDA)")
    p.add_argument("--compile_mode", default=None,
                   choices=[None, "default", "reduce-overhead", "max-autotune",
                            "max-autotune-no-cudagraphs"],
                   help="torch.compile mode")
    p.add_argument("--foreach_adamw", action="store_true",
                   help="multi-tensor AdamW instead of the fused one on CUDA")
    p.add_argument("--peak_flops", type=float, default=None,
                   help="peak FLOP/s for MFU (default: known GPUs)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed training steps first (default: 10 with compile, 3 on CUDA, 1 "
                        "elsewhere)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed training steps (the median is reported; default: 5 on CUDA, 3 "
                        "elsewhere)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternated rounds of the parity and startup rows (their medians)")

    p.add_argument("--only", default=None, metavar="ROW,ROW,...",
                   help=f"rows to measure (default: {','.join(DEFAULT_ROWS)}; long ones: "
                        f"{', '.join(f'{k} ({v})' for k, v in LONG_ROWS.items())})")
    p.add_argument("--long", action="store_true",
                   help=f"the default rows and {' and '.join(LONG_BY_FLAG)} too")
    p.add_argument("--fineweb_input", nargs="+", metavar="PATH", default=None,
                   help="corpus (.txt/.jsonl/.parquet) for the fineweb rows (default: a synthetic "
                        "~6 MB one)")
    p.add_argument("--gen_tokens", type=int, default=None,
                   help="new tokens per generation after a 16-token prompt (default: 128 on "
                        "CUDA, 32 elsewhere)")
    p.add_argument("--hellaswag_examples", type=int, default=None,
                   help="synthetic HellaSwag examples to score (default: 40 on CUDA, 20 "
                        "elsewhere)")
    p.add_argument("--startup_shards", default="2,100", metavar="N,N",
                   help="shards in the folders the startup row opens")
    p.add_argument("--startup_shard_tokens", type=int, default=10_000_000,
                   help="tokens per shard in the startup row (sparse files: no disk used)")
    p.add_argument("--hellaswag_batch_tokens", type=int, default=None,
                   help="tokens per batched HellaSwag forward (default: 8192 on CUDA, 512 "
                        "elsewhere)")

    p.add_argument("--compare_input", nargs="+", metavar="PATH", default=None,
                   help="text (.txt/.jsonl/.parquet) for --only optimizers_compare (default: this "
                        "Python's standard-library docstrings)")
    p.add_argument("--compare_steps", type=int, default=150,
                   help="optimizer steps per run for optimizers_compare")
    p.add_argument("--compare_eval_every", type=int, default=10,
                   help="val loss every N steps for optimizers_compare")
    p.add_argument("--compare_flags", default="", metavar="'FLAGS'",
                   help="more train_gpt2.py flags for both optimizers_compare runs, e.g. "
                        "'--total_batch_size 512 -B 2'")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON instead of a table")

    p.add_argument("--suite", default=None, choices=["gpu", "gpu-estimate"],
                   help="gpu-estimate: no GPU needed: GPT-2 124M's training step (T=1024, bf16, "
                        "eager, flash attention) on a simulated H100, for each of "
                        "--estimate_batch_sizes (or -B): peak tensor memory, FLOPs against the MFU "
                        "formula, a roofline lower bound on the step time and the MFU ceiling, "
                        "with the method (needs g++ and the torch that tests/simcuda/ is "
                        "written for); with --compile also the step compiled by inductor, from "
                        "the kernels it builds for an H100 (needs Triton: "
                        "tests/simcuda/inductor.py names the version). gpu: pytest "
                        "tests/test_cuda.py, then GPT-2 124M at T=1024, "
                        "B=64, bf16 with 8 micro-steps (524,288 tokens) for ours (compiled) and "
                        "build-nanogpt's configuration (eager), HellaSwag batched vs one example "
                        "per forward, KV cache vs recompute; writes --out/gpu_suite.json and "
                        "gpu_suite.md. Synthetic tokens, no network")
    p.add_argument("--estimate_batch_sizes", default="16,32,64", metavar="B,B,...",
                   help="with --suite gpu-estimate: micro-batch sizes to estimate (-B N: that one "
                        "only)")
    p.add_argument("--sim_lib", default=None, metavar="PATH",
                   help="with --suite gpu-estimate: a simulated-CUDA library already built by "
                        "tests/simcuda/harness.py (default: build one with g++ into a temp dir)")
    p.add_argument("--out", default="results",
                   help="with --suite: folder for its JSON, Markdown and test output")
    p.add_argument("--skip_tests", action="store_true",
                   help="with --suite: leave out the CUDA tests (to smoke-test the suite itself, "
                        "e.g. on CPU)")
    p.add_argument("--tests_timeout", type=int, default=420,
                   help="with --suite: seconds before the CUDA tests are stopped (the benchmark "
                        "still runs)")
    return p


# --suite gpu measures GPT-2 124M with the real 524,288-token batch: B=64 x T=1024 x 8 micro-steps
SUITE_DEFAULTS = {"gpu": dict(preset="gpt2", micro_batch_size=64, sequence_length=1024,
                              grad_accum=8, warmup=5, steps=10),
                  "gpu-estimate": dict(preset="gpt2", sequence_length=1024)}


def parse_args(argv=None):
    """Flags, with the suite's settings as defaults under --suite (explicit flags still win)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.suite:
        parser.set_defaults(**SUITE_DEFAULTS[args.suite])
        args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.suite == "gpu-estimate":
        return run_gpu_estimate(args)
    try:
        device = common.resolve_device(args.device)
        autocast_ctx, args.dtype_name = common.autocast_for(args.dtype, device.split(":")[0])
    except common.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    device_type = device.split(":")[0]
    config = tg.GPTConfig(**settings.MODEL_PRESETS[args.preset])
    args.micro_batch_size = args.micro_batch_size or (64 if device_type == "cuda" else 8)
    args.sequence_length = args.sequence_length or config.block_size
    if args.sequence_length > config.block_size:
        print(f"error: -T {args.sequence_length} exceeds the {args.preset} block size "
              f"{config.block_size}", file=sys.stderr)
        return 1
    args.compile = args.compile if args.compile is not None else device_type == "cuda"
    if not args.hellaswag_batch_tokens:
        args.hellaswag_batch_tokens = 8192 if device_type == "cuda" else 512
    on_cuda = device_type == "cuda"
    if args.warmup is None:
        args.warmup = 10 if args.compile else (3 if on_cuda else 1)
    if args.steps is None:
        args.steps = 5 if on_cuda else 3
    if args.gen_tokens is None:
        args.gen_tokens = 128 if on_cuda else 32
    if args.hellaswag_examples is None:
        args.hellaswag_examples = 40 if on_cuda else 20
    common.enable_tf32(device_type)
    only = set(args.only.split(",")) if args.only else set(DEFAULT_ROWS)
    if args.long:
        only |= set(LONG_BY_FLAG)
    unknown = sorted(only - set(DEFAULT_ROWS) - set(LONG_ROWS))
    if unknown:
        print(f"error: --only {unknown[0]}: no such row (rows: "
              f"{','.join(DEFAULT_ROWS + tuple(LONG_ROWS))})", file=sys.stderr)
        return 1

    gpu = torch.cuda.get_device_name(device) if device_type == "cuda" else None
    results = {"setting": {"preset": args.preset, "B": args.micro_batch_size,
                           "T": args.sequence_length, "grad_accum": args.grad_accum,
                           "device": device, "dtype": args.dtype_name,
                           "compile": args.compile, "compile_mode": args.compile_mode,
                           "torch": torch.__version__, "gpu": gpu,
                           "threads": torch.get_num_threads()}}
    if args.suite:
        return run_gpu_suite(args, device, config, autocast_ctx, results["setting"])
    if "train" in only:
        results["train"] = bench_training(args, config, device, device_type, autocast_ctx)
    if "train_loop" in only:
        results["train_loop"] = bench_train_loop(args, device)
    if "parity" in only:
        results["parity"] = bench_parity(args, device)
    if "optimizers" in only:
        results["optimizers"] = bench_optimizers(args, config, device, device_type, autocast_ctx)
    if "optimizers_compare" in only:
        results["optimizers_compare"] = compare_optimizers(args, device)
    if "hellaswag" in only:
        results["hellaswag"] = bench_hellaswag(args, config, device, autocast_ctx)
    if "generate" in only:
        results["generate"] = bench_generation(args, config, device, device_type, autocast_ctx)
    if "loader" in only:
        with tempfile.TemporaryDirectory() as tmp:
            results["loader"] = bench_loader(args, tmp)
    if "save" in only:
        with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:  # where log/ would be
            results["save"] = bench_save(args, device, tmp)
    if "startup" in only:
        with tempfile.TemporaryDirectory() as tmp:
            results["startup"] = bench_startup(args, tmp)
    try:
        results.update(fineweb_results(args, only))
    except fineweb.DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)
        left = [f"{k} ({v})" for k, v in LONG_ROWS.items() if k not in only]
        if left:
            print(f"not measured (--only ROW,... picks rows; --long adds "
                  f"{' and '.join(LONG_BY_FLAG)}): {'; '.join(left)}")
    return 0


def print_table(results):
    print("setting: " + ", ".join(f"{k}={v}" for k, v in results["setting"].items()))
    print(f"{'what':<34} {'value':>16}")

    rows = []
    if "train" in results:
        t = results["train"]
        rows += [("train tokens/s", fmt(t["tokens_per_sec"])),
                 ("train ms/step", fmt(t["ms_per_step"])),
                 ("train MFU", fmt(t["mfu"] * 100 if t["mfu"] else None, "%")),
                 ("train peak GPU memory", fmt(t["peak_mem_gib"], " GiB"))]
    if "train_loop" in results:
        t = results["train_loop"]
        rows += [("train_gpt2.main tokens/s", fmt(t["tokens_per_sec"])),
                 ("train_gpt2.main ms/step", fmt(t["ms_per_step"]))]
    if "parity" in results:
        t = results["parity"]
        rows += [(f"train() ms/step (median, {t['rounds']} rounds)", fmt(t["train_gpt2_ms"])),
                 ("reference loop ms/step", fmt(t["reference_ms"])),
                 ("train() / reference (median of rounds)", fmt(t["ratio"], "x")),
                 ("the same in CPU time", fmt(t["cpu_ratio"], "x")),
                 ("train() vs reference max loss diff", f"{t['max_loss_diff']:.2g}")]
    if "optimizers" in results:
        o = results["optimizers"]
        rows += [("optimizer step ms, AdamW", fmt(o["adamw_ms"])),
                 ("optimizer step ms, Muon + AdamW", fmt(o["muon_ms"]))]
    if "hellaswag" in results:
        h = results["hellaswag"]
        rows += [("HellaSwag ex/s, one per forward", fmt(h["one_per_forward"])),
                 (f"HellaSwag ex/s, batched ({h['batch_tokens']} tok)", fmt(h["batched"])),
                 ("HellaSwag batched speedup", fmt(h["speedup"], "x"))]
    if "generate" in results:
        g = results["generate"]
        rows += [(f"generate tok/s, KV cache ({g['new_tokens']} new)", fmt(g["kv_cache"])),
                 (f"generate tok/s, recompute ({g['new_tokens']} new)", fmt(g["no_cache"])),
                 ("generate KV-cache speedup", fmt(g["speedup"], "x"))]
    if "save" in results:
        rows += [("checkpoint save s", fmt(results["save"]["seconds"])),
                 ("checkpoint size", fmt(results["save"]["gib"], " GiB"))]
    if "loader" in results:
        d = results["loader"]
        rows += [("DataLoaderLite µs/batch", fmt(d["us_per_batch"])),
                 ("DataLoaderLite RSS added", fmt(d["rss_added_mib"], " MiB"))]
    if "startup" in results:
        d = results["startup"]
        few, many = d["shards"][0], d["shards"][-1]
        for key, what in (("loader_s", "data start-up s"), ("headers_only_s", "headers only s")):
            rows += [(f"{what}, {few} / {many} shards", f"{d[key][few]:.3f} / {d[key][many]:.3f}")]
    rows += fineweb_rows(results)

    for name, value in rows:
        print(f"{name:<34} {value:>16}")
    if "optimizers_compare" in results:
        print_compare(results["optimizers_compare"])


if __name__ == "__main__":
    sys.exit(main())
