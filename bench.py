"""
Measure the hot paths of this repository for one setting, and print one table (or --json).

    python bench.py                                             # the default rows (a CPU: ~1 min)
    python bench.py --long                                      # and the loop at parity (minutes)
    python bench.py --preset gpt2 -B 64 -T 1024 --device cuda   # GPT-2 124M, a GPU (bf16, compiled)
    python bench.py --suite gpu-estimate        # no GPU: GPT-2's memory, FLOPs, roofline on an H100

All inputs are synthetic, so nothing needs to be downloaded (--fineweb_input takes a real corpus,
--packing_input real conversations).
What each row measures, how, and the figures measured so far: docs/performance.md.
"""
import argparse
import contextlib
import http.client
import json
import os
import queue
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types

import numpy as np
import torch

import chat
import common
import fineweb
import metrics
import rundir
import serve
import settings
import tokenizer
import train_gpt2 as tg
from tools import gpu_estimate

# What a flag left out means on each device type: compiled or eager, sequences per forward,
# untimed and timed steps, new tokens per generation, HellaSwag examples and tokens per batched
# forward. Compiled, the untimed steps are COMPILED_WARMUP (the first ones compile).
DEVICE_DEFAULTS = {
    "cuda": dict(compile=True, micro_batch_size=64, warmup=3, steps=5, gen_tokens=128,
                 hellaswag_examples=40, hellaswag_batch_tokens=8192),
    "mps": dict(compile=False, micro_batch_size=8, warmup=1, steps=3, gen_tokens=32,
                hellaswag_examples=20, hellaswag_batch_tokens=512),
    "cpu": dict(compile=False, micro_batch_size=8, warmup=1, steps=3, gen_tokens=32,
                hellaswag_examples=20, hellaswag_batch_tokens=512),
}
COMPILED_WARMUP = 10


class Target:
    """What the rows run on: the model's config, the device (and its type) and the autocast."""

    def __init__(self, config, device, autocast):
        self.config, self.device, self.autocast = config, device, autocast
        self.device_type = common.device_type_of(device)


def sync(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()


def release(device_type):
    """Free what the last row left behind, so the next row's peak memory is its own."""
    import gc

    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


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


# ===== The rows: each measure(args, target) returns its figures ==================================
def training_step(args, t, config):
    """A fresh model of config and one training step's function for it (micro-steps, clipping,
    AdamW) on random batches."""
    model = tg.GPT(config).to(t.device)
    optimizer = model.configure_optimizers(0.1, 6e-4, t.device_type, verbose=False)
    if args.foreach_adamw:
        for g in optimizer.param_groups:
            g["fused"], g["foreach"] = False, True
    train_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
    loader = RandomLoader(args.micro_batch_size, args.sequence_length, config.real_vocab_size,
                          t.device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward(train_model, loader, args.grad_accum, t.autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return model, step


def bench_training(args, t):
    """One training step (micro-steps, clipping, AdamW) on random batches: tokens/s, ms/step, MFU
    and peak memory."""
    model, step = training_step(args, t, t.config)
    on_cuda = t.device_type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(t.device)
    dt = timed(step, t.device_type, args.warmup, args.steps)
    tokens = args.micro_batch_size * args.sequence_length * args.grad_accum
    flops = metrics.flops_per_token(t.config, model.get_num_params(non_embedding=True),
                                    args.sequence_length)
    peak = args.peak_flops or (metrics.peak_flops(torch.cuda.get_device_name(t.device))
                               if on_cuda else None)
    return {"tokens_per_sec": tokens / dt, "ms_per_step": dt * 1000, "tokens_per_step": tokens,
            "mfu": flops * tokens / dt / peak if peak else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated(t.device) / 2**30 if on_cuda else None}


def bench_train_arch(args, t):
    """The training row's step with GPT-2's architecture and with --arch modern's parts (this
    preset's shape), alternated over --rounds: each one's median ms, and modern / gpt2."""
    steps = {}
    for arch in ("gpt2", "modern"):
        config = tg.GPTConfig(**{**vars(t.config), **settings.ARCHITECTURES[arch]})
        steps[arch] = training_step(args, t, config)[1]
    times = {arch: [] for arch in steps}
    for _ in range(args.rounds):
        for arch, step in steps.items():
            times[arch].append(timed(step, t.device_type, args.warmup, args.steps) * 1000)
    ms = {arch: statistics.median(v) for arch, v in times.items()}
    return {"gpt2_ms": ms["gpt2"], "modern_ms": ms["modern"], "rounds_ms": times,
            "ratio": ms["modern"] / ms["gpt2"]}


def bench_optimizers(args, t):
    """ms per optimizer.step() alone, --optimizer adamw vs muon, on the same model and the same
    gradients."""
    torch.manual_seed(0)
    model = tg.GPT(t.config).to(t.device)
    loader = RandomLoader(args.micro_batch_size, args.sequence_length, t.config.real_vocab_size,
                          t.device)
    forward_backward(model, loader, 1, t.autocast)  # gradients that every timed step reuses
    row = {}
    for kind, muon in (("adamw", None), ("muon", {})):
        opt = model.configure_optimizers(0.1, 6e-4, t.device_type, verbose=False, muon=muon)
        # at least one untimed step: the first one allocates the optimizer state
        row[f"{kind}_ms"] = timed(opt.step, t.device_type, max(1, args.warmup), args.steps) * 1000
    row["muon_vs_adamw"] = row["muon_ms"] / row["adamw_ms"]
    return row


def bench_generation(args, t):
    """New tokens/s after a 16-token prompt, with the KV cache and recomputing every position."""
    torch.manual_seed(0)
    model = tg.GPT(t.config).to(t.device).eval()
    prompt = torch.randint(0, t.config.real_vocab_size, (1, 16), device=t.device)
    new = min(args.gen_tokens, t.config.block_size - 16)
    rows = {}
    for use_cache in (True, False):
        def run():
            with t.autocast:
                model.generate(prompt, new, top_k=1, use_cache=use_cache)
        rows["kv_cache" if use_cache else "no_cache"] = new / timed(run, t.device_type, 1, 3)
    return {**rows, "speedup": rows["kv_cache"] / rows["no_cache"], "new_tokens": new}


WORDS = ("the a man woman dog ball runs jumps into water slowly then picks up throws it over "
         "fence and").split()  # the synthetic examples' words: one token each


def synthetic_hellaswag(n, seed=0):
    """n made-up examples in HellaSwag's record schema, with realistic lengths (context ~40,
    endings ~20 tokens)."""
    import random

    rng = random.Random(seed)

    def sentence(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    return [{"ctx": sentence(25, 55).capitalize() + ".",
             "endings": [sentence(10, 30) + "." for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(n)]


def time_scoring(model, examples, device, modes, autocast_dtype=None, warmup=1, repeats=3):
    """Median seconds per pass over examples and the predictions of each mode ({name:
    score_examples kwargs}): warmup untimed passes, then repeats timed ones, the modes
    interleaved pass by pass; rendering included."""
    import hellaswag

    device_type = common.device_type_of(device)
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


def bench_hellaswag(args, t):
    """Examples/s of the classic loop (one example per forward, logits at every position) vs
    batched scoring (--hellaswag_batch_tokens per forward, logits of the scored positions only),
    same model."""
    torch.manual_seed(0)
    model = tg.GPT(t.config).to(t.device).eval()
    examples = synthetic_hellaswag(args.hellaswag_examples)
    modes = {"one_per_forward": dict(batch_tokens=0),
             "batched": dict(batch_tokens=args.hellaswag_batch_tokens)}
    secs, preds = time_scoring(model, examples, t.device, modes,
                               common.torch_dtype(args.dtype_name))
    row = {name: len(examples) / secs[name] for name in modes}
    return {**row, "speedup": row["batched"] / row["one_per_forward"], "examples": len(examples),
            "batch_tokens": args.hellaswag_batch_tokens,
            "same_predictions": preds["batched"] == preds["one_per_forward"]}


# CORE's 22 tasks as docs/evaluation.md lists them (type, shots, delimiter), each with made-up
# text of a length in words guessed for its real examples (question or context, each choice or
# continuation) and its options' count: the real bundle is not on this machine to measure
ANSWER = "\nAnswer: "
CORE_SHAPES = [  # (label, type, shots, delimiter, words of the question, of each option, options)
    ("hellaswag_zeroshot", "MC", 0, " ", 45, 20, 4), ("jeopardy", "LM", 10, ANSWER, 25, 3, 1),
    ("bigbench_qa_wikidata", "LM", 10, " ", 10, 2, 1), ("arc_easy", "MC", 10, ANSWER, 25, 5, 4),
    ("arc_challenge", "MC", 10, ANSWER, 30, 6, 4), ("copa", "MC", 0, " ", 10, 8, 2),
    ("commonsense_qa", "MC", 10, " ", 15, 2, 5), ("piqa", "MC", 10, ANSWER, 10, 20, 2),
    ("openbook_qa", "MC", 0, " ", 12, 4, 4), ("lambada_openai", "LM", 0, " ", 70, 1, 1),
    ("hellaswag", "MC", 10, " ", 45, 20, 4), ("winograd", "schema", 0, " ", 15, 6, 2),
    ("winogrande", "schema", 0, " ", 18, 8, 2),
    ("bigbench_dyck_languages", "LM", 10, " ", 30, 4, 1),
    ("agi_eval_lsat_ar", "MC", 3, " ", 200, 15, 5),
    ("bigbench_cs_algorithms", "LM", 10, " ", 30, 2, 1),
    ("bigbench_operators", "LM", 10, " ", 15, 2, 1),
    ("bigbench_repeat_copy_logic", "LM", 10, " ", 20, 15, 1), ("squad", "LM", 10, " ", 120, 3, 1),
    ("coqa", "LM", 0, " ", 250, 4, 1), ("boolq", "MC", 10, ANSWER, 100, 1, 2),
    ("bigbench_language_identification", "MC", 10, " ", 20, 1, 11),
]
CORE_KINDS = {"MC": "multiple_choice", "schema": "schema", "LM": "language_modeling"}


def synthetic_core_bundle(folder, n, seed=0):
    """An eval bundle in nanochat's layout (core.yaml, eval_meta_data.csv, eval_data/) of
    CORE_SHAPES' tasks, n made-up examples each."""
    import core_eval

    rng = np.random.default_rng(seed)

    def text(k):
        return " ".join(rng.choice(WORDS, size=k))

    tasks = []
    for label, kind, shots, delimiter, q, a, options in CORE_SHAPES:
        recs = []
        for _ in range(n):
            if kind == "MC":
                rec = {"query": text(q), "choices": [text(a) for _ in range(options)]}
                rec["gold"] = int(rng.integers(options))
            elif kind == "schema":
                rec = {"context_options": [text(q) for _ in range(options)],
                       "continuation": text(a), "gold": int(rng.integers(options))}
            else:
                rec = {"context": text(q), "continuation": text(a)}
            recs.append(rec)
        tasks.append({"label": label, "kind": CORE_KINDS[kind], "shots": shots,
                      "delimiter": delimiter, "baseline": 100 / options if kind != "LM" else 0,
                      "records": recs, "category": "synthetic"})
    core_eval.write_bundle(folder, tasks)


def core_scoring(model, device, dtype, per_task, rounds):
    """Seconds of each way of scoring per_task examples of each synthetic CORE task (rendering
    included; the median of rounds, the ways alternated), and whether every example's result is
    the same both ways: the shared scorer (batch_tokens 8192: packed passes, scored positions
    only, a question's shared prefix once) and one example per forward with every position's
    logits (nanochat's way: batch_tokens 0)."""
    import core_eval

    with tempfile.TemporaryDirectory() as tmp:
        synthetic_core_bundle(tmp, max(per_task, 11))  # 10 shots drawn from the others
        tasks = core_eval.read_bundle(tmp)
    enc = fineweb.get_encoding()
    ways = {"one_per_forward": 0, "shared": 8192}
    times, results = {way: [] for way in ways}, {}
    for _ in range(rounds):
        for way, batch_tokens in ways.items():
            sync(common.device_type_of(device))
            t0 = time.perf_counter()
            results[way] = [core_eval.score_task(model, task, device, range(per_task), enc,
                                                 batch_tokens=batch_tokens, autocast_dtype=dtype)
                            for task in tasks]
            sync(common.device_type_of(device))
            times[way].append(time.perf_counter() - t0)
    seconds = {way: statistics.median(ts) for way, ts in times.items()}
    return {**seconds, "speedup": seconds["one_per_forward"] / seconds["shared"],
            "examples": per_task * len(tasks), "tasks": len(tasks),
            "same_results": results["shared"] == results["one_per_forward"]}


def bench_core(args, t):
    """CORE's tasks (synthetic) scored both ways, on the preset's model."""
    torch.manual_seed(0)
    model = tg.GPT(t.config).to(t.device).eval()
    return core_scoring(model, t.device, common.torch_dtype(args.dtype_name), args.core_examples,
                        args.rounds)


def bench_core_gpt2(args, t):
    """The same on GPT-2 124M's shape (--core_long_preset; random weights), fewer examples, one
    round."""
    torch.manual_seed(0)
    config = tg.GPTConfig(**settings.MODEL_PRESETS[args.core_long_preset],
                          **settings.ARCHITECTURES[args.arch])
    model = tg.GPT(config).to(t.device).eval()
    return core_scoring(model, t.device, common.torch_dtype(args.dtype_name),
                        args.core_long_examples, 1)


def bench_loader(args, t):
    """DataLoaderLite over two 10M-token train shards: µs per next_batch and the resident memory
    it adds."""
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        for i, split in enumerate(("val", "train", "train")):
            np.save(os.path.join(tmp, fineweb.shard_name(i, split, prefix="bench")),
                    rng.integers(0, fineweb.GPT2_VOCAB_SIZE, 10_000_000, dtype=np.uint16))
        before = rss_bytes()
        loader = tg.DataLoaderLite(args.micro_batch_size, args.sequence_length, split="train",
                                   data_root=tmp)
        n = max(1, min(2000, 20_000_000 // (args.micro_batch_size * args.sequence_length)))
        t0 = time.perf_counter()
        for _ in range(n):  # about one pass
            loader.next_batch()
        dt = time.perf_counter() - t0
        after = rss_bytes()
    added = (after - before) / 2**20 if before is not None and after is not None else None
    return {"us_per_batch": dt / n * 1e6, "batches": n, "rss_added_mib": added,
            "shard_tokens": 10_000_000}


def bench_save(args, t):
    """train_gpt2.Checkpointer.write of the model with its optimizer state (one step taken), as a
    run saves (fsync'ed, renamed into place), for the Run of bench's training flags: the median
    seconds and the file's size. The time a preempted run needs inside its kill window."""
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:  # where log/ would be
        with contextlib.redirect_stdout(sys.stderr):  # a warning of settle's: not in --json's
            run, proc, _ = tg.settle(train_flags(args, t.device, tmp, tmp, max_steps=2))
        torch.manual_seed(run.seed)
        model = tg.GPT(run.model).to(run.device)
        optimizer = tg.make_optimizer(model, run)
        x = torch.randint(0, fineweb.GPT2_VOCAB_SIZE, (1, 16), device=run.device)
        model(x, x)[1].backward()
        optimizer.step()
        scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision.scaler)
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
    return ["--preset", args.preset, "--arch", args.arch, "--device", device,
            "--dtype", args.dtype, "--data_root", data_root, "--log_dir", log_dir,
            "-B", str(args.micro_batch_size), "-T", str(args.sequence_length),
            "--total_batch_size", str(tokens), "--max_steps", str(max_steps),
            "--warmup_steps", "1", "--eval_every", "0", "--sample_every", "0",
            "--hellaswag_every", "0", "--save_every", "0",
            "--compile" if args.compile else "--no-compile"]


def bench_train_loop(args, t):
    """train_gpt2.py's own loop (loader, micro-steps, clipping, LR, update, the step line), run
    through its main() on synthetic shards: the median `dt` of its step lines after the warm-up
    steps."""
    import io
    import re

    tokens = args.micro_batch_size * args.sequence_length * args.grad_accum
    with tempfile.TemporaryDirectory() as tmp:
        write_token_shards(tmp, 10 * tokens)
        flags = train_flags(args, t.device, tmp, os.path.join(tmp, "log"),
                            args.warmup + args.steps)
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


def bench_parity(args, t):
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
                        reference_loop(args, t.device, tmp, log_dir, max_steps)
                    elif tg.main(train_flags(args, t.device, tmp, log_dir, max_steps)) != 0:
                        raise RuntimeError("train_gpt2.main failed: " + "".join(clock.parts)[-500:])
                runs[name].append(statistics.median(clock.step_seconds(args.warmup)))
                cpu_runs[name].append(statistics.median(clock.step_seconds(args.warmup, cpu=True)))
                losses.setdefault(name, clock.losses())
                release(t.device_type)
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


def bench_startup(args, t):
    """Start-up on folders of 2 and of 100 shards (--startup_shards) of the same size: seconds to
    open the data as train() does (ensure_prepared, the train and val DataLoaderLite, the first
    batch), and to open the train split headers-only (fineweb.open_split with vocab_size None).
    Shard 0 is val, the others train; the folders alternate for --rounds rounds, medians."""
    with tempfile.TemporaryDirectory() as tmp:
        return startup_times(args, tmp, args.startup_shards)


def startup_times(args, tmp, counts):
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


def synthetic_corpus(path, n_docs=3000, seed=0):
    """A ~6 MB English-like .jsonl corpus (a `text` field per line) for the fineweb row."""
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


def bench_fineweb(args, t):
    """fineweb.prepare on --fineweb_input (or a synthetic corpus), files to shards, in as many
    processes as cores: tokens/s."""
    num_proc = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        inputs = args.fineweb_input or synthetic_corpus(os.path.join(tmp, "corpus.jsonl"))
        t0 = time.perf_counter()
        fineweb.prepare(os.path.join(tmp, "shards"), inputs=inputs, shard_size=1_000_000,
                        num_proc=num_proc, progress=False)
        dt = time.perf_counter() - t0
        tokens = fineweb.prep_status(os.path.join(tmp, "shards")).tokens
    return {"tokens_per_sec": tokens / dt, "tokens": tokens, "num_proc": num_proc}


# ===== Fine-tuning and chat: the sft, packing and chat_ttft rows =================================
# A SmolTalk-like mix of conversation lengths, in tokens. smol-smoltalk (460,341 train
# conversations) cannot be read here; what is published of its lengths was counted with
# nanochat's tokenizer (65,536 tokens, not GPT-2's), each conversation rendered to at most 2,048
# tokens: a median of 858 tokens, 60.0% longer than 513 (karpathy/nanochat issue #590); and at
# rows of 513 tokens, 8.2% of the supervised tokens in conversations that fit and 39.9% in the
# first 513 tokens of those that do not (nanochat PR #486). Two kinds of conversation, every
# message's length log-normal with one sigma: the medians below were fitted to those four figures
# (200,000 conversations of it: 854 tokens, 60.2%, 8.2% and 39.9%; tests/test_bench.py checks
# them).
SMOLTALK_LIKE = {
    "single_share": 0.4,  # one exchange: a user's message, then the reply
    "single": (103, 109),  # median tokens of its (user, assistant) messages
    "multi_exchanges": 3,  # the others: three exchanges
    "multi": (56, 268),
    "sigma": 0.46,  # of each message's log-length
}


def smoltalk_like(n, seed=0, mix=SMOLTALK_LIKE):
    """n conversations of the SmolTalk-like mix as (ids, mask, starts), the arrays
    ChatLoader takes, laid out as chat.render lays them out (<|endoftext|>, then per exchange
    <|user_start|> U <|user_end|> <|assistant_start|> A <|assistant_end|>, A and its end token
    trained); each content random GPT-2 token ids."""
    rng = np.random.default_rng(seed)
    single = rng.random(n) < mix["single_share"]
    k_max = max(1, mix["multi_exchanges"])
    exchanges = np.where(single, 1, mix["multi_exchanges"])
    present = np.arange(k_max) < exchanges[:, None]  # (n, k_max)

    def lengths(role):  # (n, k_max): each message's tokens (role 0: user, 1: reply), 0: none
        median = np.where(single, mix["single"][role], mix["multi"][role])[:, None]
        z = rng.standard_normal((n, k_max))
        return np.maximum(1, np.rint(median * np.exp(mix["sigma"] * z))).astype(np.int64) * present

    user, reply = lengths(0), lengths(1)
    # each conversation: <|endoftext|>, then six segments per exchange (a token, or a content)
    start, end = chat.START, chat.END
    tokens = [start["user"], -1, end["user"], start["assistant"], -1, end["assistant"]]
    trained = [0, 0, 0, 0, 1, 1]
    one = present.astype(np.int64)
    seg_len = np.stack([one, user, one, one, reply, one], axis=-1).reshape(n, -1)
    seg_len = np.concatenate([np.ones((n, 1), dtype=np.int64), seg_len], axis=1).reshape(-1)
    seg_tok = np.tile(np.array([chat.EOT] + tokens * k_max, dtype=np.int32), n)
    seg_mask = np.tile([0] + trained * k_max, n)
    ids = np.repeat(seg_tok, seg_len)
    content = ids < 0
    ids[content] = rng.integers(0, chat.EOT, int(content.sum()))
    conv_len = seg_len.reshape(n, -1).sum(1)
    starts = np.concatenate([[0], np.cumsum(conv_len)]).astype(np.int64)
    return ids.astype(np.uint16), np.repeat(seg_mask, seg_len).astype(np.uint8), starts


def render_files(paths):
    """The conversations of .jsonl/.parquet files (HF's messages layout) as (ids, mask, starts),
    rendered with GPT-2's tokenizer as the sft command prepares them; bad rows skipped, as there
    (a note on stderr)."""
    enc = fineweb.get_encoding()
    ids, mask, lengths = [], [], []
    for path in paths:
        good, note = chat.read_conversations(path)
        if note:
            print(note, file=sys.stderr)
        # chat's own batches: render()'s ids, the contents encoded in tiktoken's threads; each
        # batch an array at once (a list of a dataset's ids would take GBs)
        for k in range(0, len(good), chat.DATA_BATCH):
            batch = chat._render_batch(good[k: k + chat.DATA_BATCH], enc)
            ids.append(np.array([t for i, _ in batch for t in i], dtype=np.uint16))
            mask.append(np.array([t for _, m in batch for t in m], dtype=np.uint8))
            lengths += [len(i) for i, _ in batch]
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    return np.concatenate(ids), np.concatenate(mask), starts


def packing_stats(data, T, B=1, window=100, batches=0):
    """ChatLoader's packing of the conversations data (ids, mask, starts) into rows of T + 1 tokens
    (its train order, best fit over `window` waiting): the share of the rows' input positions
    (T a row) that are padding, the share of the supervised tokens lost to cropping (each
    conversation cut after its last whole reply that fits, or dropped), and the counts. With
    batches, also the median µs of that many next_batch calls of B rows (None when the epoch
    holds fewer rows: a new epoch's packing would be timed)."""
    ids, mask, starts = data
    loader = tg.ChatLoader(B, T, (ids, mask, starts), window=window)
    rows = loader.epoch_rows(0)
    next_batch_us = None
    if batches and len(rows) >= (batches + 1) * B:  # one untimed, then the timed ones
        next_batch_us = timed(loader.next_batch, "cpu", 1, batches) * 1e6
    spans = loader.spans
    used = np.array([int(spans[row, 1].sum()) for row in rows])  # each row's ids: at most T + 1
    padding = int((T - np.minimum(used, T)).sum())
    supervised = int(np.asarray(mask, dtype=np.int64).sum())
    kept = int(spans[:, 2].sum())
    original = np.diff(starts)[np.searchsorted(starts, spans[:, 0])]
    return {"T": T, "window": window, "conversations": len(starts) - 1, "rows": len(rows),
            "padding_share": padding / (len(rows) * T),
            "trained_share": kept / (len(rows) * T),  # of the input positions: targets trained
            "supervised": supervised, "lost_supervised_share": (supervised - kept) / supervised,
            "cut": int((spans[:, 1] < original).sum()), "dropped": len(starts) - 1 - len(spans),
            "conversations_per_row": len(spans) / len(rows), "B": B,
            "next_batch_us": next_batch_us}


DEMO_CHAT = os.path.join(fineweb.REPO_DIR, "docs", "demo_chat.jsonl")


def length_summary(starts):
    lengths = np.diff(starts)
    return {"median_tokens": float(np.median(lengths)), "mean_tokens": float(lengths.mean()),
            "share_over_513": float((lengths > 513).mean())}


def bench_packing(args, t):
    """The padding share and the supervised tokens cropped away when ChatLoader packs the
    SmolTalk-like mix (--packing_conversations of it), docs/demo_chat.jsonl and --packing_input
    into rows of each of --packing_lengths; each mix's lengths; and, on the SmolTalk-like mix, the
    µs of a next_batch of -B rows (the loader's Python, without a model)."""
    mixes = {"smoltalk_like": smoltalk_like(args.packing_conversations),
             "demo_chat": render_files([DEMO_CHAT])}
    if args.packing_input:
        mixes["input"] = render_files(args.packing_input)
    row = {"lengths": {}, "mixes": {}}
    for name, data in mixes.items():
        row["lengths"][name] = length_summary(data[2])
        row["mixes"][name] = {}
        for T in args.packing_lengths:
            try:
                row["mixes"][name][str(T)] = packing_stats(
                    data, T, args.micro_batch_size, batches=20 if name == "smoltalk_like" else 0)
            except common.UsageError as e:  # not one conversation's first reply fits
                row["mixes"][name][str(T)] = {"T": T, "error": str(e)}
    if args.packing_input:
        row["input"] = args.packing_input
    return row


def sft_data(args, rows):
    """The SmolTalk-like mix, at least --packing_conversations conversations and enough to fill
    `rows` rows of -T in one epoch (so no step of the sft row packs a new one), its ChatLoader
    and the seconds that loader took to crop and pack them."""
    n = args.packing_conversations
    for _ in range(12):
        data = smoltalk_like(n)
        t0 = time.perf_counter()
        try:
            loader = tg.ChatLoader(args.micro_batch_size, args.sequence_length, data)
        except common.UsageError:  # not one fits: more conversations, some short enough
            loader = None
        seconds = time.perf_counter() - t0
        if loader is not None and len(loader.epoch_rows(0)) >= rows:
            return data, loader, seconds
        n *= 2
    raise common.UsageError(f"-T {args.sequence_length}: too few conversations of the "
                            f"SmolTalk-like mix fit rows of it: a larger -T")


def loop_step(args, t, config, loader):
    """A fresh model (the same seed each time) and one optimizer step's function as train() runs
    it: per micro-step the loader's next_batch and divisor, the batch moved to the device, the
    loss divided, backward; then clipping and AdamW. Also the list the step appends its loader
    seconds to (next_batch and divisor, every micro-step) and the supervised tokens of each step
    (a ChatLoader's; DataLoaderLite's: every target)."""
    torch.manual_seed(1337)
    model = tg.GPT(config).to(t.device)
    optimizer = model.configure_optimizers(0.1, 6e-4, t.device_type, verbose=False)
    train_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
    loader_s, supervised = [], []
    micro_steps = args.grad_accum

    def step():
        optimizer.zero_grad(set_to_none=True)
        spent = 0.0
        for micro_step in range(micro_steps):
            t0 = time.perf_counter()
            x, y = loader.next_batch()
            divisor = loader.divisor(micro_step, micro_steps)
            spent += time.perf_counter() - t0
            x, y = x.to(t.device), y.to(t.device)
            with t.autocast:
                _, loss = train_model(x, y)
            (loss / divisor).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loader_s.append(spent)
        supervised.append(getattr(loader, "step_supervised", None) or x.numel() * micro_steps)

    return step, loader_s, supervised


def bench_sft(args, t):
    """A fine-tuning step (a chat model's, ChatLoader's rows of the SmolTalk-like mix, y -100
    where not trained) against a pretraining step (DataLoaderLite over random-token shards) of the
    same shape, alternated over --rounds (the first of a round swaps each round): each one's
    median ms, tokens (positions) a second, the loaders' ms a step, and SFT / pretraining
    throughput (the median of the rounds' ratios)."""
    B, T, accum = args.micro_batch_size, args.sequence_length, args.grad_accum
    per_round = args.warmup + args.steps
    data, chat_loader, pack_s = sft_data(args, B * accum * per_round * args.rounds)
    chat_config = tg.GPTConfig(**{**vars(t.config), "real_vocab_size": chat.CHAT_VOCAB_SIZE})
    with tempfile.TemporaryDirectory() as tmp:
        write_token_shards(tmp, B * T * accum * per_round * args.rounds + 1)
        text_loader = tg.DataLoaderLite(B, T, split="train", data_root=tmp)
        arms = {"sft": loop_step(args, t, chat_config, chat_loader),
                "pretrain": loop_step(args, t, t.config, text_loader)}
        times = {arm: [] for arm in arms}
        loader_ms = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in (("sft", "pretrain") if r % 2 == 0 else ("pretrain", "sft")):
                step, loader_s, _ = arms[arm]
                times[arm].append(timed(step, t.device_type, args.warmup, args.steps) * 1000)
                loader_ms[arm] += [s * 1000 for s in loader_s[-args.steps:]]
                release(t.device_type)
    tokens = B * T * accum
    ms = {arm: statistics.median(v) for arm, v in times.items()}
    supervised = arms["sft"][2]
    return {"sft_ms": ms["sft"], "pretrain_ms": ms["pretrain"],
            "sft_tokens_per_sec": tokens / ms["sft"] * 1000,
            "pretrain_tokens_per_sec": tokens / ms["pretrain"] * 1000,
            # the two arms of a round are next to each other in time: their ratio is the least
            # disturbed by a load that changes between rounds
            "ratio": statistics.median(p / s for s, p in zip(times["sft"], times["pretrain"])),
            "rounds_ms": times, "tokens_per_step": tokens,
            "sft_loader_ms": statistics.median(loader_ms["sft"]),
            "pretrain_loader_ms": statistics.median(loader_ms["pretrain"]),
            "supervised_per_step": statistics.mean(supervised),
            "conversations": len(data[2]) - 1, "rows_per_epoch": len(chat_loader.epoch_rows(0)),
            "pack_s": pack_s}


def chat_turn_sizes(args, block_size):
    """(tokens of each user message, of each reply) for --chat_turns turns in block_size: the
    context shared evenly (each turn's four chat tokens besides), or --chat_turn_tokens."""
    turns = args.chat_turns
    if args.chat_turn_tokens:
        user, reply = args.chat_turn_tokens
    else:
        each = (block_size - 1) // turns - 4
        user, reply = each // 2, each - each // 2
    if min(user, reply) < 1 or 1 + turns * (user + reply + 4) > block_size:
        raise common.UsageError(f"{turns} turns of {max(user, 1)}-token messages and "
                                f"{max(reply, 1)}-token replies do not fit the context of "
                                f"{block_size} tokens: fewer --chat_turns")
    return user, reply


def user_message(enc, n, turn):
    """A message of exactly n tokens (WORDS, one token each), different at each turn."""
    text = "".join(" " + WORDS[(turn + i) % len(WORDS)] for i in range(n))
    if len(enc.encode_ordinary(text)) != n:
        raise RuntimeError(f"{text!r} is not {n} tokens")
    return text


def chat_conversation(model, enc, texts, reply_tokens, t, dtype, turn_order):
    """One conversation of len(texts) turns through chat.Talk, each reply reply_tokens long
    (greedy over text tokens: <|assistant_end|> never comes first). Per turn: the seconds to the
    first token with the conversation's KV cache (ask() and the first forward) and by one forward
    over every id so far, no cache (the recomputed turn); whether the two first tokens agree; the
    ids the first token follows. turn_order(turn): True when the cached arm goes first."""
    stamps = []

    def sample(logits):  # the time a token is known: the first one's is the cached arm's end
        token = logits[:, :chat.EOT].argmax(-1, keepdim=True)
        sync(t.device_type)
        stamps.append(time.perf_counter())
        return token

    talk = chat.Talk(model, enc, sample, max_new_tokens=reply_tokens, device=t.device,
                     dtype=dtype, autocast=t.autocast)
    out = {"cached": [], "recompute": [], "same": [], "context": []}
    for turn, text in enumerate(texts):
        ids = talk.ids + [chat.START["user"], *enc.encode_ordinary(text), chat.END["user"],
                          chat.START["assistant"]]

        def recompute():
            t0 = time.perf_counter()
            x = torch.tensor([ids], dtype=torch.long, device=t.device)
            with torch.inference_mode(), t.autocast:
                logits, _ = model(x, logits_to_keep=1)
            token = int(logits[0, -1, :chat.EOT].argmax())  # .item(): synchronized
            return time.perf_counter() - t0, token

        def with_cache():
            stamps.clear()
            t0 = time.perf_counter()
            talk.ask(text)
            for _ in talk.answer():  # the whole reply: the next turn continues after it
                pass
            return stamps[0] - t0, talk.last_reply()[0]

        arms = (with_cache, recompute) if turn_order(turn) else (recompute, with_cache)
        results = {arm: arm() for arm in arms}
        (cached_s, cached), (full_s, full) = results[with_cache], results[recompute]
        out["cached"].append(cached_s)
        out["recompute"].append(full_s)
        out["same"].append(cached == full)
        out["context"].append(len(ids))
    return out


def bench_chat_ttft(args, t):
    """The chat command's time to first token at each of --chat_turns turns of one conversation
    (a chat model of the preset's shape, random weights; every user message and reply of a fixed
    length, chat_turn_sizes): chat.Talk with its KV cache against one forward over the whole
    conversation so far, alternated turn by turn, over --rounds conversations (after one untimed
    of two turns). Medians per turn; the speed-up at the last turn."""
    user, reply = chat_turn_sizes(args, t.config.block_size)  # refused before any work
    config = tg.GPTConfig(**{**vars(t.config), "real_vocab_size": chat.CHAT_VOCAB_SIZE})
    torch.manual_seed(0)
    model = tg.GPT(config).to(t.device).eval()
    enc = fineweb.get_encoding()
    texts = [user_message(enc, user, turn) for turn in range(args.chat_turns)]
    dtype = common.torch_dtype(args.dtype_name) or model.lm_head.weight.dtype
    chat_conversation(model, enc, texts[:2], reply, t, dtype, lambda turn: True)  # warm-up
    rounds = [chat_conversation(model, enc, texts, reply, t, dtype,
                                lambda turn, r=r: (turn + r) % 2 == 0)
              for r in range(args.rounds)]
    ms = {arm: [statistics.median(c[arm][turn] for c in rounds) * 1000
                for turn in range(args.chat_turns)] for arm in ("cached", "recompute")}
    # what every first token pays however short its forward: the final norm and the vocabulary's
    # projection of one position (the whole lm_head read)
    h = torch.zeros(1, 1, config.n_embd, device=t.device)
    with torch.inference_mode(), t.autocast:
        head_ms = timed(lambda: model.head(model.transformer.ln_f(h)), t.device_type, 3, 20) * 1000
    return {"turns": args.chat_turns, "user_tokens": user, "reply_tokens": reply,
            "new_tokens": user + 5,  # a later turn's, cached: the last reply's end, the message
            "head_ms": head_ms,
            "rounds": args.rounds, "context_tokens": rounds[0]["context"],
            "cached_ms": ms["cached"], "recompute_ms": ms["recompute"],
            "last_rounds_ms": {arm: [c[arm][-1] * 1000 for c in rounds]
                               for arm in ("cached", "recompute")},
            "speedup_first": ms["recompute"][0] / ms["cached"][0],
            "speedup": ms["recompute"][-1] / ms["cached"][-1],
            "same_first_tokens": all(all(c["same"]) for c in rounds)}


# ===== The serve row: tokens/s streamed through the serve command ================================
def serve_stream(url, body):
    """(reply tokens, seconds, text) of one streamed chat request to url, timed from its sending
    to its `data: [DONE]`."""
    host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)  # a hang, not a speed
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    tokens, texts = None, []
    for line in conn.getresponse():
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        elif event["choices"]:
            texts.append(event["choices"][0]["delta"].get("content") or "")
    seconds = time.perf_counter() - t0
    conn.close()
    return tokens, seconds, "".join(texts)


@contextlib.contextmanager
def serve_command(args, t, ckpt, folder):
    """`train_gpt2.py serve` of ckpt on a free port, on this run's device and dtype and torch's
    threads: its URL while the with block runs."""
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, os.path.join(fineweb.REPO_DIR, "train_gpt2.py"), "serve",
           "--checkpoint", ckpt, "--port", "0", "--device", t.device, "--dtype", args.dtype]
    with open(os.path.join(folder, "serve.log"), "w+") as log:  # a request's line each
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            for line in proc.stdout:
                if line.startswith("serving "):
                    yield line.split(" at ", 1)[1].split()[0]
                    break
            else:
                log.seek(0)
                raise RuntimeError(f"the serve command exited: {log.read()[-2000:]}")
        finally:
            proc.terminate()
            proc.wait()


def bench_serve(args, t):
    """The serve command's tokens/s (a chat model of the preset's shape, random weights, greedy:
    one 16-token message, --serve_tokens replied): one client streaming through the server
    against the engine's own steps in this process (serve.Engine's worker thread, no HTTP), and 4
    clients streaming at once against one. --rounds rounds of the three, alternated; medians.
    Each client's text is the engine's."""
    config = tg.GPTConfig(**{**vars(t.config), "real_vocab_size": chat.CHAT_VOCAB_SIZE})
    torch.manual_seed(0)
    model = tg.GPT(config).to(t.device).eval()
    enc = fineweb.get_encoding()
    messages = [{"role": "user", "content": user_message(enc, 16, 0)}]
    room = config.block_size - len(chat.render_prompt(messages, enc))
    n = min(args.serve_tokens or room, room)
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    dtype = common.torch_dtype(args.dtype_name) or model.lm_head.weight.dtype
    engine = serve.Engine(model, enc, t.device, dtype, t.autocast)
    engine.start()

    def alone():  # the engine's worker thread, as the server runs it
        events = queue.SimpleQueue()
        job = serve.Job(serve.read_request(body, enc, "bench", config.block_size,
                                           serve.Defaults()), enc, events.put)
        t0 = time.perf_counter()
        engine.submit(job)
        texts = []
        while True:
            kind, value = events.get()
            if kind != "text":  # the end
                break
            texts.append(value)
        return job.tokens, time.perf_counter() - t0, "".join(texts)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model.pt")
        torch.save({"model": model.state_dict(), "config": vars(config)}, ckpt)
        with serve_command(args, t, ckpt, tmp) as url:
            def clients(k):
                out = [None] * k
                threads = [threading.Thread(target=lambda i=i: out.__setitem__(
                    i, serve_stream(url, body))) for i in range(k)]
                t0 = time.perf_counter()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                return out, time.perf_counter() - t0

            want = alone()  # untimed, both ways
            clients(1)
            runs = {"engine": [], "one": [], "four": []}
            same = True
            for r in range(args.rounds):
                arms = ["engine", "one", "four"]
                for arm in arms[r % 3:] + arms[: r % 3]:
                    if arm == "engine":
                        tokens, seconds, text = alone()
                        runs[arm].append(tokens / seconds)
                        same = same and text == want[2]
                        continue
                    out, wall = clients(1 if arm == "one" else 4)
                    runs[arm].append(sum(o[0] for o in out) / wall)
                    same = same and all(o[2] == want[2] and o[0] == want[0] for o in out)
    engine.stop()
    rate = {arm: statistics.median(v) for arm, v in runs.items()}
    return {"reply_tokens": want[0], "rounds": args.rounds, "rounds_tokens_per_sec": runs,
            "engine_tokens_per_sec": rate["engine"], "one_client_tokens_per_sec": rate["one"],
            "four_clients_tokens_per_sec": rate["four"],
            "streamed_vs_engine": rate["one"] / rate["engine"],
            "four_vs_one": rate["four"] / rate["one"], "same_text": same}


# ===== The arch row: --arch modern against GPT-2, in tokens to the GPT-2 recipe's val loss =======
# Each arm: train_gpt2.py's flags beyond `--preset tiny` (the learning rates tuned for each arm on
# this row's corpus: docs/lab_record.md, "The modern architecture"). The GPT-2 recipe (AdamW) at
# the two best LRs found: the target is the lower of their mean final val losses.
ARCH_ARMS = {
    "gpt2_adamw_2e-3": ["--arch", "gpt2", "--optimizer", "adamw", "--max_lr", "2e-3"],
    "gpt2_adamw_4e-3": ["--arch", "gpt2", "--optimizer", "adamw", "--max_lr", "4e-3"],
    "gpt2_muon": ["--arch", "gpt2", "--optimizer", "muon", "--max_lr", "4e-3",
                  "--muon_lr", "4e-3"],
    # on --arch modern's WSD schedule, at the LRs tuned on a schedule of 12 steps, no warmup
    "modern_muon": ["--arch", "modern", "--optimizer", "muon", "--max_lr", "1.6e-2",
                    "--muon_lr", "1e-2", "--embed_lr", "3e-2"],
}
# --arch_arms: the modern arm with one change each (its LRs, not tuned for the change); GPT-2 with
# Muon on the modern arm's warmup-stable-decay schedule, at the LRs tuned for it there
ARCH_ABLATIONS = {
    "modern_ve": [*ARCH_ARMS["modern_muon"], "--value_embeds"],
    "modern_x0": [*ARCH_ARMS["modern_muon"], "--x0_skip"],
    "modern_no_x0": [*ARCH_ARMS["modern_muon"], "--no-x0_skip"],
    "modern_unet": [*ARCH_ARMS["modern_muon"], "--unet_skip"],
    "modern_cosine": [*ARCH_ARMS["modern_muon"], "--wsd_decay", "0"],
    "modern_embed_norm": [*ARCH_ARMS["modern_muon"], "--embed_norm"],
    "modern_zero_head": [*ARCH_ARMS["modern_muon"], "--zero_head"],
    "modern_no_head_bias": [*ARCH_ARMS["modern_muon"], "--no-head_bias"],
    "gpt2_muon_wsd": ["--arch", "gpt2", "--optimizer", "muon", "--max_lr", "2e-3", "--muon_lr",
                      "1e-2", "--embed_lr", "1.5e-2", "--wsd_decay", "0.4"],
}


def stdlib_docstring_texts():
    """Every docstring of this Python's standard library (tests and site-packages left out), in
    path order, one at a time: ~1.8 MB of English prose that any machine with Python has."""
    import ast
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs
                            if d not in ("test", "tests", "site-packages", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds))
            yield from filter(None, docs)


def stdlib_docstrings(path):
    """stdlib_docstring_texts() as one text file, a blank line between docstrings: path."""
    with open(path, "w") as f:
        f.write("\n\n".join(stdlib_docstring_texts()))
    return path


def tokens_to_reach(steps, values, target, tokens_per_step):
    """The train tokens after which the val loss first reaches target, interpolated linearly
    between the two evaluations around it; None if it never does."""
    for i, (step, value) in enumerate(zip(steps, values)):
        if value <= target:
            if i == 0:
                return step * tokens_per_step
            s0, v0 = steps[i - 1], values[i - 1]
            return (s0 + (step - s0) * (v0 - target) / (v0 - value)) * tokens_per_step
    return None


# The count models: what a model that reads only the previous token (and, with a cache, the
# tokens of its window) can reach from the same train tokens, the arch row's reference
COUNT_DISCOUNTS = (0.5, 0.75, 0.9, 0.95)  # Kneser-Ney's discount of each counted pair
COUNT_ADD_K = (0.01, 0.03, 0.1, 0.3, 1.0)  # added to each token's count of preceding tokens
CACHE_WEIGHTS = (0.1, 0.2, 0.3, 0.4)  # the cache's share of the mixture


def bigram_counts(train, a, b, vocab):
    """What a Kneser-Ney bigram counted from the token stream train needs for the pairs of the
    arrays a, b: each pair's count, its context's count and number of different followers, its
    target's number of different preceding tokens, and the number of different pairs."""
    seen, counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)
    query = a * vocab + b
    i = np.minimum(np.searchsorted(seen, query), max(len(seen) - 1, 0))
    pair = np.zeros(len(query), dtype=np.int64)
    if len(seen):
        pair = np.where(seen[i] == query, counts[i], 0)
    context = np.bincount(train[:-1], minlength=vocab)[a]  # c(a, any)
    followers = np.bincount(seen // vocab, minlength=vocab)[a]  # different tokens after a
    preceders = np.bincount(seen % vocab, minlength=vocab)[b]  # different tokens before b
    return pair, context, followers, preceders, len(seen)


def kn_bigram_from(counts, vocab, discount, k):
    """p(b | a) from bigram_counts: the pair's count less the discount, plus the discounted mass
    spread over the vocab by how many different tokens each follows (add-k: no token gets 0).
    Without a pair counted: every token alike."""
    pair, context, followers, preceders, n_seen = counts
    lower = (preceders + k) / (n_seen + k * vocab)
    c = np.maximum(context, 1)
    p = np.maximum(pair - discount, 0) / c + discount * followers / c * lower
    return np.where(context > 0, p, lower)


def kn_bigram_probs(train, a, b, vocab, discount, k):
    """p(b | a) for each pair of the arrays a, b under an interpolated Kneser-Ney bigram counted
    from the token stream train."""
    return kn_bigram_from(bigram_counts(train, a, b, vocab), vocab, discount, k)


def window_cache_probs(stream, T):
    """For each target stream[j + 1], the share of its window's inputs so far (its row of T, up to
    and with stream[j]) that are that token: a cache of the context, as a model reads it."""
    n = len(stream) - 1
    padded = np.full(-(-n // T) * T + 1, -1, dtype=np.int64)  # the last row filled with no token
    padded[: n + 1] = stream
    x, y = padded[:-1].reshape(-1, T), padded[1:].reshape(-1, T)
    earlier = np.tril(np.ones((T, T), dtype=bool))  # [i, j]: input j is in target i's context
    hits = np.stack([((row_y[:, None] == row_x) & earlier).sum(-1)  # a row at a time: (T, T)
                     for row_x, row_y in zip(x, y)])  # (rows, T)
    return (hits / np.arange(1, T + 1)).reshape(-1)[:n]


def count_model_curves(train, val, steps, tokens_per_step, T, vocab):
    """The val loss after each of steps (0: none) of tokens_per_step train tokens of a Kneser-Ney
    bigram alone ("bigram") and mixed with the window's cache ("bigram_cache"), each point's
    constants the best on val itself: a bound in the count models' favour. val: the evaluated val
    tokens and the one after, as the run's evaluation reads them."""
    a, b = val[:-1], val[1:]
    cache = window_cache_probs(val, T)
    curves = {"bigram": [], "bigram_cache": []}
    for step in steps:
        counts = bigram_counts(train[: step * tokens_per_step + 1], a, b, vocab)  # once a step
        best = {name: float("inf") for name in curves}
        for discount in COUNT_DISCOUNTS:
            for k in COUNT_ADD_K:
                p = kn_bigram_from(counts, vocab, discount, k)
                best["bigram"] = min(best["bigram"], -np.log(p).mean())
                for w in CACHE_WEIGHTS:
                    mixed = -np.log((1 - w) * p + w * cache).mean()
                    best["bigram_cache"] = min(best["bigram_cache"], mixed)
        for name in curves:
            curves[name].append(float(best[name]))
    return curves


def count_models_on(data_root, steps, tokens_per_step, T, val_tokens):
    """count_model_curves on the tokens the arch row's runs read from data_root: the train stream
    from its start (the first epoch's shards in order), and the val's first val_tokens targets."""
    def first(split, n):  # the split's first n tokens (fewer if it holds fewer), as int64
        pieces = []
        for shard in fineweb.open_split(data_root, split, None)[1]:
            pieces.append(shard[:n].astype(np.int64))  # memory-mapped: only these are read
            n -= len(pieces[-1])
            if n == 0:
                break
        return np.concatenate(pieces)

    train = first("train", max(steps) * tokens_per_step + 1)
    return count_model_curves(train, first("val", val_tokens + 1), steps, tokens_per_step, T,
                              fineweb.GPT2_VOCAB_SIZE)


def arch_run(flags, log_dir):
    """One arm's run through train_gpt2.main, its step lines on stderr: (val steps, val losses,
    median seconds per step)."""
    with contextlib.redirect_stdout(sys.stderr):
        if tg.main(flags) != 0:
            raise RuntimeError(f"train_gpt2.py {shlex.join(flags)} failed")
    log = rundir.read_log(os.path.join(log_dir, "log.txt"))
    return log["val"][0], log["val"][1], statistics.median(log["dt"][1]) / 1000


def bench_arch(args, t):
    """The tiny preset trained by each of ARCH_ARMS for each of --arch_seeds, the arms alternated
    (seed by seed), on the same local text: each run's val curve, and the tokens each arm needs to
    reach the GPT-2 recipe's final val loss (the better of its arms' seed means); and the same for
    two count models on the same tokens, the reference of what the previous token, and then the
    window, tell (count_model_curves)."""
    tiny = settings.RUN_PRESETS["tiny"]
    tokens_per_step, T = tiny["total_batch_size"], tiny["sequence_length"]
    shape = []
    if args.arch_shape:
        B, T = args.arch_shape
        tokens_per_step = B * T
        shape = ["-B", str(B), "-T", str(T), "--total_batch_size", str(tokens_per_step)]
    val_tokens = args.arch_val_tokens or tiny["val_tokens"]
    arms = {arm: {**ARCH_ARMS, **ARCH_ABLATIONS}[arm] for arm in args.arch_arms}
    recipes = [arm for arm in arms if arm.startswith("gpt2_adamw")]
    if not recipes and args.arch_target is None:
        raise common.UsageError("--arch_arms without a gpt2_adamw arm needs --arch_target: the "
                                "GPT-2 recipe's val loss to reach")
    runs = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        inputs = args.arch_input or [stdlib_docstrings(os.path.join(tmp, "docstrings.txt"))]
        data = os.path.join(tmp, "data")  # the val shard holds what the preset evaluates on
        fineweb.prepare(data, inputs=inputs, shard_size=10_000_000, val_tokens=tiny["val_tokens"],
                        progress=False)
        for seed in args.arch_seeds:
            for arm, arm_flags in arms.items():
                log_dir = os.path.join(tmp, f"{arm}_{seed}")
                flags = ["--preset", "tiny", *arm_flags, *shape, "--seed", str(seed),
                         "--data_root", data,
                         "--log_dir", log_dir, "--eval_every", str(args.arch_eval_every),
                         "--max_steps", str(args.arch_max_steps),
                         "--warmup_steps", str(args.arch_warmup_steps), "--sample_every", "0",
                         "--val_tokens", str(val_tokens),
                         "--device", t.device]
                if args.arch_lrs:
                    for flag, lr in zip(("--max_lr", "--muon_lr", "--embed_lr"), args.arch_lrs):
                        flags += [flag, str(lr)]
                if args.arch_stop_step:  # the schedule stays --arch_max_steps'
                    flags += ["--stop_step", str(args.arch_stop_step)]
                steps, values, seconds = arch_run(flags, log_dir)
                runs[arm].append({"seed": seed, "steps": steps, "val": values,
                                  "s_per_step": seconds})

        count_steps = range(args.arch_max_steps + 1)  # the runs' evaluations, every step
        counts = count_models_on(data, count_steps, tokens_per_step, T, val_tokens)

    target = args.arch_target
    if target is None:
        target = min(statistics.mean(r["val"][-1] for r in runs[arm]) for arm in recipes)
    row = {"target_val": target, "recipe_tokens": args.arch_max_steps * tokens_per_step,
           "arms": arms, "lrs": args.arch_lrs, "warmup_steps": args.arch_warmup_steps,
           "inputs": args.arch_input or ["stdlib docstrings"], "runs": runs,
           "count_models": counts}
    for name, values in counts.items():
        row[f"{name}_tokens"] = tokens_to_reach(list(count_steps), values, target,
                                                tokens_per_step)
    for arm, arm_runs in runs.items():
        for r in arm_runs:
            r["tokens_to_target"] = tokens_to_reach(r["steps"], r["val"], target,
                                                    tokens_per_step)
        reached = [r["tokens_to_target"] for r in arm_runs]
        row[f"{arm}_tokens"] = None if None in reached else statistics.mean(reached)
        row[f"{arm}_s_per_step"] = statistics.median(r["s_per_step"] for r in arm_runs)
    return row


# ===== The tokenizer rows: a BPE trained on local text against GPT-2's ==========================
# Three kinds of text that a machine with this Python (and, for German, a Linux system's
# translations) has, each read in path order: the same text on one machine each time, other text
# wherever other packages are installed.
LOCALE_DIR = "/usr/share/locale"


def site_packages_code():
    """This Python's site-packages .py files (the UTF-8 ones), in path order, one text each."""
    import sysconfig

    for folder, subdirs, files in os.walk(sysconfig.get_paths()["purelib"]):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            yield text


def mo_translations(path):
    """The translations (msgstr) of a gettext .mo file, in its order, each plural form one text,
    decoded by the charset its header names (UTF-8 if none); [] for a file that is not one."""
    import codecs
    import re
    import struct

    with open(path, "rb") as f:
        data = f.read()
    order = {b"\xde\x12\x04\x95": "<", b"\x95\x04\x12\xde": ">"}.get(data[:4])
    if order is None or len(data) < 20:
        return []
    count, originals, translations = struct.unpack_from(order + "3I", data, 8)

    def entry(table, i):
        length, offset = struct.unpack_from(order + "2I", data, table + 8 * i)
        return data[offset:offset + length]
    charset, texts = "utf-8", []
    for i in range(count):
        if entry(originals, i):
            texts += entry(translations, i).split(b"\0")
            continue
        # the header (the empty msgid's translation): its Content-Type names the charset
        named = re.search(rb"charset=([-\w]+)", entry(translations, i))
        if named:
            charset = named.group(1).decode()
    try:
        codecs.lookup(charset)
    except LookupError:
        charset = "utf-8"
    return [text.decode(charset, "replace") for text in texts]


def locale_texts(lang):
    """The translations into lang of every .mo file in LOCALE_DIR/lang/LC_MESSAGES, in path
    order (none where the system keeps none)."""
    folder = os.path.join(LOCALE_DIR, lang, "LC_MESSAGES")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names:
        if name.endswith(".mo"):
            yield from mo_translations(os.path.join(folder, name))


# each kind of text: (its source in words, its texts)
TEXT_KINDS = {"english": ("the standard library's docstrings", stdlib_docstring_texts),
              "code": ("site-packages' .py files", site_packages_code),
              "german": (f"{LOCALE_DIR}/de's .mo translations", lambda: locale_texts("de"))}


def first_chars(texts, n):
    """The texts (empty ones skipped), in order, up to n characters in all: the last one cut."""
    out, got = [], 0
    for text in texts:
        if text:
            out.append(text[:n - got])
            got += len(out[-1])
        if got >= n:
            break
    return out


def each_once(texts):
    """The texts in order, each only where it first comes."""
    seen = set()
    for text in texts:
        if text not in seen:
            seen.add(text)
            yield text


_kind_tokenizers = {}  # (kind, characters, vocabulary): what kind_tokenizer returned


def kind_tokenizer(kind, n_chars, vocab_size):
    """(texts, held out, tokenizer) of a kind of text: its first n_chars characters, each text
    once (a translation, a vendored file, is often there twice), every tenth held out (the first
    included) and a BPE trained on the others; kept for the next row."""
    key = (kind, n_chars, vocab_size)
    if key not in _kind_tokenizers:
        texts = first_chars(each_once(TEXT_KINDS[kind][1]()), n_chars)
        train = [text for i, text in enumerate(texts) if i % 10]
        tok = tokenizer.train_bpe(train, vocab_size) if train else None
        _kind_tokenizers[key] = texts, texts[::10], tok
    return _kind_tokenizers[key]


def bench_tokenizer_train(args, t):
    """tokenizer.train_bpe (rustbpe, GPT-4's split pattern) on --tokenizer_chars characters of
    code (site-packages' .py files in path order): the seconds and characters per second."""
    from importlib.metadata import version

    t0 = time.perf_counter()
    texts = first_chars(site_packages_code(), args.tokenizer_chars)
    read_s = time.perf_counter() - t0
    chars = sum(map(len, texts))
    t0 = time.perf_counter()
    tok = tokenizer.train_bpe(texts, args.tokenizer_vocab)
    seconds = time.perf_counter() - t0
    return {"corpus": TEXT_KINDS["code"][0], "files": len(texts), "chars": chars,
            "read_seconds": read_s, "seconds": seconds, "chars_per_sec": chars / seconds,
            "vocab_size": tok.n_vocab, "trainer": f"rustbpe {version('rustbpe')}",
            "cpus": os.cpu_count()}


def bench_tokenizer_encode(args, t):
    """fineweb.py's tokenizing (tokenize_batch: one process, ~1 MB batches) of each kind of text
    (--tokenizer_kind_chars of it) with a BPE trained on it, against GPT-2's BPE on the same
    text: tokens/s (the documents' ids, no <|endoftext|>) and MB/s of UTF-8, in this process's
    CPU time (less disturbed by a shared machine's other work than the wall clock), --rounds
    rounds of the two alternated, medians."""
    row = {"vocab_size": args.tokenizer_vocab, "rounds": args.rounds, "kinds": {}}
    for kind in TEXT_KINDS:
        texts, _, tok = kind_tokenizer(kind, args.tokenizer_kind_chars, args.tokenizer_vocab)
        if tok is None:
            row["kinds"][kind] = None
            continue
        batches = list(fineweb._batched(texts))
        arms = {"own": lambda batch: fineweb.tokenize_batch(batch, tok),
                "gpt2": fineweb.tokenize_batch}
        tokens, runs = {}, {"own": [], "gpt2": []}
        for r in range(args.rounds + 1):  # the first round untimed: each encoding built
            for arm in (("own", "gpt2") if r % 2 else ("gpt2", "own")):
                t0 = time.process_time()
                lengths = [arms[arm](batch)[1] for batch in batches]
                seconds = time.process_time() - t0
                tokens[arm] = sum(int(n.sum() - np.count_nonzero(n)) for n in lengths)
                if r:
                    runs[arm].append(seconds)
        n_bytes = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        rate = {arm: tokens[arm] / statistics.median(runs[arm]) for arm in runs}
        mb = {arm: n_bytes / statistics.median(runs[arm]) / 1e6 for arm in runs}
        row["kinds"][kind] = {
            "source": TEXT_KINDS[kind][0], "bytes": n_bytes, "tokens": tokens,
            "rounds_s": runs, "own_tokens_per_sec": rate["own"],
            "gpt2_tokens_per_sec": rate["gpt2"], "tokens_per_sec_ratio": rate["own"] / rate["gpt2"],
            "own_mb_per_sec": mb["own"], "gpt2_mb_per_sec": mb["gpt2"],
            "mb_per_sec_ratio": mb["own"] / mb["gpt2"]}
    return row


def bench_tokenizer_compression(args, t):
    """Bytes per token of a BPE trained on each kind of text (--tokenizer_kind_chars of it, every
    tenth text held out) on its held-out text, against GPT-2's BPE there. A BPE has fewer tokens
    than --tokenizer_vocab where its text runs out of pairs to merge (every chunk one token)."""
    gpt2 = fineweb.gpt2_tokenizer()
    row = {"vocab_size": args.tokenizer_vocab, "kinds": {}}
    for kind in TEXT_KINDS:
        texts, held, tok = kind_tokenizer(kind, args.tokenizer_kind_chars, args.tokenizer_vocab)
        if tok is None:
            row["kinds"][kind] = None
            continue
        n_bytes, own = tokenizer.bytes_per_token(tok, held)
        _, base = tokenizer.bytes_per_token(gpt2, held)
        row["kinds"][kind] = {
            "source": TEXT_KINDS[kind][0],
            "train_chars": sum(map(len, texts)) - sum(map(len, held)),
            "vocab_size": tok.n_vocab, "held_out_bytes": n_bytes,
            "own_bytes_per_token": n_bytes / own,
            "gpt2_bytes_per_token": n_bytes / base, "gpt2_tokens_over_own": base / own}
    return row


def bench_tokenizer_bpb(args, t):
    """The tiny preset trained twice from one seed on English prose (the standard library's
    docstrings, --tokenizer_kind_chars of them): with GPT-2's BPE for --tokenizer_bpb_steps steps,
    and with a BPE trained on the same text (fineweb.py --train_tokenizer: its first tenth held
    out) for the steps that read the same bytes; each evaluated at its end on all of that held-out
    tenth: val loss and bits per byte. A step: -B x -T x --grad_accum tokens (bench's defaults:
    the tiny preset's 8 x 256)."""
    tokens_per_step = args.micro_batch_size * args.sequence_length * args.grad_accum
    quiet = contextlib.redirect_stdout(sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "docstrings.txt")
        text = "\n\n".join(first_chars(stdlib_docstring_texts(), args.tokenizer_kind_chars))
        with open(corpus, "w") as f:
            f.write(text)
        own_dir = os.path.join(tmp, "tokenizer")
        with quiet:
            own = fineweb.train_tokenizer(own_dir, inputs=[corpus],
                                          vocab_size=args.tokenizer_vocab)
        held = first_chars(fineweb.read_documents([corpus]), own.info["held_out"]["chars"])
        gpt2 = fineweb.gpt2_tokenizer()
        runs = {"gpt2": {"val_tokens": fineweb._held_out_token_count(gpt2, held)},
                "own": {"val_tokens": own.info["held_out"]["val_tokens"]}}
        for arm, tok in (("gpt2", None), ("own", own)):
            data = os.path.join(tmp, f"data_{arm}")
            fineweb.prepare(data, inputs=[corpus], tok=tok, shard_size=10_000_000,
                            val_tokens=runs[arm]["val_tokens"], progress=False)
            runs[arm]["train_tokens"] = fineweb.split_sizes(data)["train"]
        ratio = runs["own"]["train_tokens"] / runs["gpt2"]["train_tokens"]
        runs["gpt2"]["steps"] = args.tokenizer_bpb_steps
        runs["own"]["steps"] = max(1, round(args.tokenizer_bpb_steps * ratio))
        for arm, run in runs.items():
            log_dir = os.path.join(tmp, f"log_{arm}")
            flags = ["--preset", "tiny", "--data_root", os.path.join(tmp, f"data_{arm}"),
                     "-B", str(args.micro_batch_size), "-T", str(args.sequence_length),
                     "--total_batch_size", str(tokens_per_step),
                     "--log_dir", log_dir, "--max_steps", str(run["steps"]),
                     "--eval_every", str(run["steps"]), "--sample_every", "0",
                     "--val_tokens", str(run["val_tokens"]), "--device", t.device]
            if arm == "own":
                flags += ["--tokenizer", own_dir]
            with quiet:
                if tg.main(flags) != 0:
                    raise RuntimeError(f"train_gpt2.py {shlex.join(flags)} failed")
            log = rundir.read_log(os.path.join(log_dir, "log.txt"))
            run.update(val=log["val"][1][-1], val_bpb=log["val_bpb"][1][-1],
                       s_per_step=statistics.median(log["dt"][1]) / 1000)
    return {"corpus_chars": len(text), "held_out_chars": sum(map(len, held)),
            "tokens_per_step": tokens_per_step,
            "vocab_size": own.n_vocab, "runs": runs,
            "bpb_ratio": runs["own"]["val_bpb"] / runs["gpt2"]["val_bpb"]}


def tokenizer_table_rows(r):
    """The table's lines of the tokenizer rows in r."""
    rows = []
    if "tokenizer_train" in r:
        a = r["tokenizer_train"]
        rows += [(f"BPE training s, {a['chars'] / 1e6:.1f}M chars", fmt(a["seconds"])),
                 ("BPE training chars/s", fmt(a["chars_per_sec"]))]
    for kind, e in r.get("tokenizer_encode", {}).get("kinds", {}).items():
        if e is None:
            rows += [(f"encode tok/s, {kind}", "no text here")]
            continue
        rows += [(f"encode tok/s, {kind}, own BPE", fmt(e["own_tokens_per_sec"])),
                 (f"encode tok/s, {kind}, GPT-2's", fmt(e["gpt2_tokens_per_sec"])),
                 (f"encode own / GPT-2, {kind}",
                  f"{e['tokens_per_sec_ratio']:.2f}x tok, {e['mb_per_sec_ratio']:.2f}x MB")]
    for kind, c in r.get("tokenizer_compression", {}).get("kinds", {}).items():
        value = "no text here"
        if c is not None:
            value = f"{c['own_bytes_per_token']:.2f} / {c['gpt2_bytes_per_token']:.2f}"
        rows += [(f"bytes/token, {kind}, own / GPT-2", value)]
    if "tokenizer_bpb" in r:
        b = r["tokenizer_bpb"]["runs"]
        rows += [("val bpb, tiny, own BPE / GPT-2's",
                  f"{b['own']['val_bpb']:.4f} / {b['gpt2']['val_bpb']:.4f}")]
    return rows


# every row in the order measured; the long ones only by name (--only) or with --long
ROWS = {"train": bench_training, "train_arch": bench_train_arch, "train_loop": bench_train_loop,
        "parity": bench_parity,
        "optimizers": bench_optimizers, "hellaswag": bench_hellaswag, "core": bench_core,
        "core_gpt2": bench_core_gpt2,
        "generate": bench_generation, "loader": bench_loader, "save": bench_save,
        "startup": bench_startup, "fineweb": bench_fineweb, "sft": bench_sft,
        "packing": bench_packing, "chat_ttft": bench_chat_ttft, "serve": bench_serve,
        "arch": bench_arch,
        "tokenizer_train": bench_tokenizer_train, "tokenizer_encode": bench_tokenizer_encode,
        "tokenizer_compression": bench_tokenizer_compression,
        "tokenizer_bpb": bench_tokenizer_bpb}
LONG_ROWS = {"train_arch": "the training step of gpt2 and modern, alternated",
             "parity": "train_gpt2.train() vs a build-nanogpt-style loop, alternated",
             "train_loop": "train_gpt2.main's own dt",
             "arch": "--arch modern vs gpt2 in tokens to a val loss (CPU: hours)",
             "core_gpt2": "CORE's scorers at GPT-2 124M's size (CPU: minutes)",
             "sft": "a fine-tuning step vs a pretraining step, alternated",
             "tokenizer_train": "a BPE trained on 100M characters of code (100 MB read)",
             "tokenizer_bpb": "the tiny preset's val bpb with GPT-2's BPE and with its own "
                              "(CPU: minutes)"}
DEFAULT_ROWS = tuple(name for name in ROWS if name not in LONG_ROWS)


# ===== Flags =====================================================================================
def row_names(text):
    """--only's rows, each one of ROWS."""
    names = text.split(",")
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]}: no such row (rows: {','.join(ROWS)})")
    return names


def learning_rates(text):
    """--arch_lrs' MAX_LR,MUON_LR[,EMBED_LR]: two or three positive numbers."""
    values = text.split(",")
    if len(values) not in (2, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: give MAX_LR,MUON_LR or MAX_LR,MUON_LR,"
                                          f"EMBED_LR, e.g. 8e-3,4e-3")
    return tuple(common.LEARNING_RATE(v) for v in values)


def positive_ints(text):
    """--packing_lengths: one or more comma-separated positive integers."""
    parts = text.split(",")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text}: give positive integers, e.g. 1024,256")
    return [int(p) for p in parts]


def integer_pair(low, what):
    """An argparse type: two comma-separated integers, each at least low; what says which."""
    def parse(text):
        parts = text.split(",")
        if len(parts) == 2 and all(p.isdigit() and int(p) >= low for p in parts):
            return [int(p) for p in parts]
        raise argparse.ArgumentTypeError(f"{text}: give {what}")
    return parse


def per_device(name):
    """--help's words for a default taken from DEVICE_DEFAULTS."""
    return "default per device: " + ", ".join(f"{kind} {d[name]}"
                                              for kind, d in DEVICE_DEFAULTS.items())


STORE_TRUE = {"action": "store_true"}
# (flags, default, type, meaning) as common.add_flags takes them
FLAGS = [
    ("--preset", "tiny", sorted(settings.MODEL_PRESETS), "model shape"),
    ("--arch", "gpt2", list(settings.ARCHITECTURES), "the architecture (train_gpt2.py's --arch)"),
    ("-B --micro_batch_size", None, common.POSITIVE_INT,
     f"sequences per forward ({per_device('micro_batch_size')})"),
    ("-T --sequence_length", None, common.POSITIVE_INT,
     "tokens per sequence (default: the preset's block size)"),
    ("--grad_accum", 1, common.POSITIVE_INT, "micro-steps per optimizer step"),
    ("--device", "auto", str, "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps"),
    ("--dtype", "auto", list(common.DTYPES), "autocast dtype; auto: as training's --dtype auto"),
    ("--compile", None, bool, f"torch.compile ({per_device('compile')})"),
    ("--compile_mode", None,
     ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
     "torch.compile mode"),
    ("--foreach_adamw", False, STORE_TRUE, "multi-tensor AdamW instead of the fused one on CUDA"),
    ("--peak_flops", None, common.POSITIVE,
     "peak FLOP/s for MFU (default: metrics.PEAK_BF16_FLOPS by the GPU's name)"),
    ("--warmup", None, common.NONNEG_INT,
     f"untimed training steps first ({COMPILED_WARMUP} compiled, else {per_device('warmup')})"),
    ("--steps", None, common.POSITIVE_INT,
     f"timed training steps, their median reported ({per_device('steps')})"),
    ("--rounds", 3, common.POSITIVE_INT,
     "alternated rounds of the train_arch, parity and startup rows (their medians)"),
    ("--only", None, {"type": row_names, "metavar": "ROW,ROW,..."},
     f"rows to measure (default: {','.join(DEFAULT_ROWS)}; long ones: "
     f"{'; '.join(f'{k} ({v})' for k, v in LONG_ROWS.items())})"),
    ("--long", False, STORE_TRUE, "the default rows and the long ones too"),
    ("--fineweb_input", None, {"nargs": "+", "metavar": "PATH"},
     "corpus (.txt/.jsonl/.parquet) for the fineweb row (default: a synthetic ~6 MB one)"),
    ("--gen_tokens", None, common.POSITIVE_INT,
     f"new tokens per generation after a 16-token prompt ({per_device('gen_tokens')})"),
    ("--hellaswag_examples", None, common.POSITIVE_INT,
     f"synthetic HellaSwag examples to score ({per_device('hellaswag_examples')})"),
    ("--hellaswag_batch_tokens", None, common.POSITIVE_INT,
     f"tokens per batched HellaSwag forward ({per_device('hellaswag_batch_tokens')})"),
    ("--core_examples", 4, common.POSITIVE_INT,
     "examples of each synthetic CORE task the core row scores"),
    ("--core_long_examples", 2, common.POSITIVE_INT, "the same for the core_gpt2 row"),
    ("--core_long_preset", "gpt2", sorted(settings.MODEL_PRESETS),
     "the core_gpt2 row's model shape (GPT-2 124M's; the tests' check: tiny)"),
    ("--startup_shards", "2,100",
     {"type": integer_pair(2, "N,N (two shard counts, each at least 2: val and train)"),
      "metavar": "N,N"},
     "shards in the folders the startup row opens"),
    ("--startup_shard_tokens", 10_000_000, common.POSITIVE_INT,
     "tokens per shard in the startup row (sparse files: no disk used)"),
    ("--arch_seeds", [1337, 42], {"type": int, "nargs": "+", "metavar": "SEED"},
     "the arch row's seeds, each a run of every arm"),
    ("--arch_eval_every", 10, common.POSITIVE_INT, "the arch row's val loss every N steps"),
    ("--arch_max_steps", settings.RUN_PRESETS["tiny"]["max_steps"], common.POSITIVE_INT,
     "the arch row's steps a run (the tiny preset's schedule)"),
    ("--arch_warmup_steps", settings.RUN_PRESETS["tiny"]["warmup_steps"], common.NONNEG_INT,
     "the arch row's warmup steps (the tiny preset's; a shorter schedule wants fewer)"),
    ("--arch_shape", None, {"type": integer_pair(1, "B,T (two positive integers)"),
                            "metavar": "B,T"},
     "the arch row's micro-batch and sequence length, a step one micro-batch of B x T tokens "
     "(default: the tiny preset's, 8 x 256 a micro-batch, 2048 tokens a step; the tests': 2,64)"),
    ("--arch_val_tokens", None, common.POSITIVE_INT,
     "the arch row's val tokens an evaluation (default: the tiny preset's)"),
    ("--arch_arms", list(ARCH_ARMS),
     {"nargs": "+", "choices": [*ARCH_ARMS, *ARCH_ABLATIONS], "metavar": "ARM"},
     "the arch row's arms (the modern_* beyond modern_muon: one change each)"),
    ("--arch_lrs", None, {"type": learning_rates, "metavar": "MAX_LR,MUON_LR[,EMBED_LR]"},
     "the arch row's arms at these LRs (--max_lr, --muon_lr, --embed_lr) instead of their own: "
     "a tuning run"),
    ("--arch_stop_step", None, common.POSITIVE_INT,
     "the arch row's runs stop there (their schedule --arch_max_steps'): enough to reach it"),
    ("--arch_target", None, float,
     "the arch row's val loss to reach (default: the GPT-2 recipe arms' final val here)"),
    ("--arch_input", None, {"nargs": "+", "metavar": "PATH"},
     "the arch row's corpus (default: this Python's standard-library docstrings)"),
    ("--packing_conversations", 20_000, common.POSITIVE_INT,
     "conversations of the SmolTalk-like mix the packing row packs (the sft row's: at least "
     "these)"),
    ("--packing_lengths", "1024,256", {"type": positive_ints, "metavar": "T,T,..."},
     "the packing row's row lengths (-T)"),
    ("--packing_input", None, {"nargs": "+", "metavar": "PATH"},
     "conversation files (.jsonl/.parquet, HF's messages layout, e.g. smol-smoltalk's parquet "
     "files) the packing row packs too"),
    ("--chat_turns", 20, common.POSITIVE_INT,
     "the chat_ttft row's turns, its time to first token at the first and the last"),
    ("--chat_turn_tokens", None, {"type": integer_pair(1, "U,R (two positive integers)"),
                                  "metavar": "U,R"},
     "the chat_ttft row's tokens of each user message and each reply (default: the context "
     "shared evenly by the turns; tiny: 4,4)"),
    ("--serve_tokens", None, common.POSITIVE_INT,
     "the serve row's reply in tokens (default: the rest of the context after its message)"),
    ("--tokenizer_chars", 100_000_000, common.POSITIVE_INT,
     "the tokenizer_train row's characters of code (site-packages' .py files, in path order)"),
    ("--tokenizer_kind_chars", 2_000_000, common.POSITIVE_INT,
     "the other tokenizer rows' characters of each kind of text (English prose: the standard "
     "library's docstrings; code; German: /usr/share/locale/de's translations), a tenth of it "
     "held out"),
    ("--tokenizer_vocab", tokenizer.DEFAULT_VOCAB_SIZE,
     common.count(256 + len(tokenizer.SPECIAL_NAMES), 1 << 32),
     "the tokenizer rows' vocabulary (the special tokens included)"),
    ("--tokenizer_bpb_steps", settings.RUN_PRESETS["tiny"]["max_steps"], common.POSITIVE_INT,
     "the tokenizer_bpb row's steps with GPT-2's BPE (the tiny preset's); its own tokenizer's "
     "run takes the steps that read the same bytes"),
    ("--json", False, STORE_TRUE, "print the results as JSON instead of a table"),
    ("--suite", None, ["gpu-estimate"],
     "gpu-estimate: no GPU needed: GPT-2 124M's training step (T=1024, bf16, eager, flash "
     "attention) on a simulated H100 (tools/gpu_estimate.py), for each of --estimate_batch_sizes "
     "(or -B): peak tensor memory, FLOPs, a roofline step time and MFU ceiling; with --compile "
     "also the step compiled by inductor (needs Triton: tools/simcuda/inductor.py names the "
     "version)"),
    ("--estimate_batch_sizes", "16,32,64", {"metavar": "B,B,..."},
     "with --suite gpu-estimate: micro-batch sizes to estimate (-B N: that one only)"),
    ("--sim_lib", None, {"metavar": "PATH"},
     "with --suite gpu-estimate: a simulated-CUDA library already built by "
     "tools/simcuda/harness.py (default: built with g++ in a temp dir)"),
]


def build_parser():
    parser = common.OneLineParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_flags(parser, FLAGS)
    return parser


def parse_args(argv=None):
    """Flags; under --suite gpu-estimate the preset's default is gpt2 (a flag given still wins)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.suite:
        parser.set_defaults(preset="gpt2")
        args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


# ===== Running the rows ==========================================================================
def sequence_length(args, config):
    """-T, or the preset's block size; a UsageError beyond it."""
    T = args.sequence_length or config.block_size
    if T > config.block_size:
        raise common.UsageError(f"-T {T} exceeds the {args.preset} block size "
                                f"{config.block_size}")
    return T


def resolve(args):
    """The Target of this run, and the per-device defaults of the flags left out (args)."""
    device = common.resolve_device(args.device)
    device_type = common.device_type_of(device)
    autocast_ctx, args.dtype_name = common.autocast_for(args.dtype, device_type)
    config = tg.GPTConfig(**settings.MODEL_PRESETS[args.preset],
                          **settings.ARCHITECTURES[args.arch])
    args.sequence_length = sequence_length(args, config)
    for name, value in DEVICE_DEFAULTS.get(device_type, DEVICE_DEFAULTS["cpu"]).items():
        if getattr(args, name) is None:  # compile comes first: warmup depends on it
            setattr(args, name, COMPILED_WARMUP if name == "warmup" and args.compile else value)
    common.tune_for_device(device_type)
    return Target(config, device, autocast_ctx)


def setting_of(args, t):
    gpu = torch.cuda.get_device_name(t.device) if t.device_type == "cuda" else None
    return {"preset": args.preset, "arch": args.arch, "B": args.micro_batch_size,
            "T": args.sequence_length, "grad_accum": args.grad_accum, "device": t.device,
            "dtype": args.dtype_name, "compile": args.compile, "compile_mode": args.compile_mode,
            "torch": torch.__version__, "gpu": gpu, "threads": torch.get_num_threads()}


def run_estimate(args):
    """--suite gpu-estimate: tools/gpu_estimate.py for this setting; its tables or --json."""
    T = sequence_length(args, tg.GPTConfig(**settings.MODEL_PRESETS[args.preset]))
    problem = gpu_estimate.unsupported(args.compile)
    if problem:
        raise common.UsageError(f"--suite gpu-estimate{' --compile' if args.compile else ''} "
                                f"{problem}")
    sizes = ([args.micro_batch_size] if args.micro_batch_size
             else gpu_estimate.batch_sizes(args.estimate_batch_sizes))
    results = gpu_estimate.estimate(args.preset, T, sizes, bool(args.compile), args.sim_lib,
                                    arch=args.arch)
    results["setting"]["command"] = "python bench.py " + shlex.join(args.argv)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        gpu_estimate.print_estimate(results)
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.suite == "gpu-estimate":
            return run_estimate(args)
        target = resolve(args)
        only = set(args.only or DEFAULT_ROWS) | (set(LONG_ROWS) if args.long else set())
        results = {"setting": setting_of(args, target)}
        for name, measure in ROWS.items():
            if name in only:
                results[name] = measure(args, target)
                release(target.device_type)
    except (common.UsageError, gpu_estimate.EstimateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print_table(results)
    left = [f"{k} ({v})" for k, v in LONG_ROWS.items() if k not in only]
    if left:
        print(f"not measured (--only ROW,... picks rows; --long adds "
              f"{' and '.join(LONG_ROWS)}): {'; '.join(left)}")
    return 0


# ===== The table =================================================================================
def fmt(v, unit=""):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.3g}{unit}" if abs(v) < 100 else f"{v:,.0f}{unit}"
    return f"{v}{unit}"


def table_rows(r):
    """(what, value) for each figure in the results r, in ROWS' order."""
    rows = []
    if "train" in r:
        t = r["train"]
        rows += [("train tokens/s", fmt(t["tokens_per_sec"])),
                 ("train ms/step", fmt(t["ms_per_step"])),
                 ("train MFU", fmt(t["mfu"] * 100 if t["mfu"] else None, "%")),
                 ("train peak GPU memory", fmt(t["peak_mem_gib"], " GiB"))]
    if "train_arch" in r:
        a = r["train_arch"]
        rows += [("train ms/step, --arch gpt2 (median of rounds)", fmt(a["gpt2_ms"])),
                 ("train ms/step, --arch modern", fmt(a["modern_ms"])),
                 ("modern / gpt2", fmt(a["ratio"], "x"))]
    if "train_loop" in r:
        rows += [("train_gpt2.main tokens/s", fmt(r["train_loop"]["tokens_per_sec"])),
                 ("train_gpt2.main ms/step", fmt(r["train_loop"]["ms_per_step"]))]
    if "parity" in r:
        p = r["parity"]
        rows += [(f"train() ms/step (median, {p['rounds']} rounds)", fmt(p["train_gpt2_ms"])),
                 ("reference loop ms/step", fmt(p["reference_ms"])),
                 ("train() / reference (median of rounds)", fmt(p["ratio"], "x")),
                 ("the same in CPU time", fmt(p["cpu_ratio"], "x")),
                 ("train() vs reference max loss diff", f"{p['max_loss_diff']:.2g}")]
    if "optimizers" in r:
        rows += [("optimizer step ms, AdamW", fmt(r["optimizers"]["adamw_ms"])),
                 ("optimizer step ms, Muon + AdamW", fmt(r["optimizers"]["muon_ms"]))]
    if "hellaswag" in r:
        h = r["hellaswag"]
        rows += [("HellaSwag ex/s, one per forward", fmt(h["one_per_forward"])),
                 (f"HellaSwag ex/s, batched ({h['batch_tokens']} tok)", fmt(h["batched"])),
                 ("HellaSwag batched speedup", fmt(h["speedup"], "x"))]
    for name, size in (("core", "preset"), ("core_gpt2", "GPT-2 124M")):
        if name in r:
            c = r[name]
            rows += [(f"CORE s, one per forward ({c['examples']} ex, {size})",
                      fmt(c["one_per_forward"])),
                     (f"CORE s, shared scorer ({size})", fmt(c["shared"])),
                     (f"CORE shared-scorer speedup ({size})", fmt(c["speedup"], "x")),
                     (f"CORE results the same both ways ({size})", str(c["same_results"]))]
    if "generate" in r:
        g = r["generate"]
        rows += [(f"generate tok/s, KV cache ({g['new_tokens']} new)", fmt(g["kv_cache"])),
                 (f"generate tok/s, recompute ({g['new_tokens']} new)", fmt(g["no_cache"])),
                 ("generate KV-cache speedup", fmt(g["speedup"], "x"))]
    if "loader" in r:
        rows += [("DataLoaderLite µs/batch", fmt(r["loader"]["us_per_batch"])),
                 ("DataLoaderLite RSS added", fmt(r["loader"]["rss_added_mib"], " MiB"))]
    if "save" in r:
        rows += [("checkpoint save s", fmt(r["save"]["seconds"])),
                 ("checkpoint size", fmt(r["save"]["gib"], " GiB"))]
    if "startup" in r:
        d = r["startup"]
        few, many = d["shards"][0], d["shards"][-1]
        for key, what in (("loader_s", "data start-up s"), ("headers_only_s", "headers only s")):
            rows += [(f"{what}, {few} / {many} shards", f"{d[key][few]:.3f} / {d[key][many]:.3f}")]
    if "fineweb" in r:
        w = r["fineweb"]
        rows += [(f"fineweb tokens/s ({w['num_proc']} processes)", fmt(w["tokens_per_sec"]))]
    if "sft" in r:
        f = r["sft"]
        rows += [("SFT step tokens/s (ChatLoader)", fmt(f["sft_tokens_per_sec"])),
                 ("pretraining step tokens/s", fmt(f["pretrain_tokens_per_sec"])),
                 ("SFT / pretraining throughput", fmt(f["ratio"], "x")),
                 ("SFT loader ms/step", fmt(f["sft_loader_ms"])),
                 ("pretraining loader ms/step", fmt(f["pretrain_loader_ms"])),
                 ("SFT supervised tokens/step", fmt(f["supervised_per_step"]))]
    if "packing" in r:
        for mix, by_T in r["packing"]["mixes"].items():
            for T, p in by_T.items():
                if "error" in p:
                    rows += [(f"packing {mix}, T {T}", "none fits")]
                    continue
                rows += [(f"padding share, {mix}, T {T}", fmt(p["padding_share"] * 100, "%")),
                         (f"supervised cropped, {mix}, T {T}",
                          fmt(p["lost_supervised_share"] * 100, "%"))]
    if "chat_ttft" in r:
        c = r["chat_ttft"]
        last = c["turns"]
        rows += [("chat TTFT ms, turn 1, KV cache", fmt(c["cached_ms"][0])),
                 ("chat TTFT ms, turn 1, recompute", fmt(c["recompute_ms"][0])),
                 (f"chat TTFT ms, turn {last}, KV cache", fmt(c["cached_ms"][-1])),
                 (f"chat TTFT ms, turn {last}, recompute", fmt(c["recompute_ms"][-1])),
                 (f"chat TTFT speedup, turn {last}", fmt(c["speedup"], "x")),
                 ("chat: the head's ms, one position", fmt(c["head_ms"]))]
    if "serve" in r:
        s = r["serve"]
        rows += [(f"serve tok/s, engine alone ({s['reply_tokens']} tok)",
                  fmt(s["engine_tokens_per_sec"])),
                 ("serve tok/s, streamed, 1 client", fmt(s["one_client_tokens_per_sec"])),
                 ("serve streamed / engine", fmt(s["streamed_vs_engine"], "x")),
                 ("serve tok/s, 4 clients (all)", fmt(s["four_clients_tokens_per_sec"])),
                 ("serve 4 clients / 1 client", fmt(s["four_vs_one"], "x")),
                 ("serve text the engine's", str(s["same_text"]))]
    if "arch" in r:
        a = r["arch"]
        rows += [("arch: GPT-2 recipe's val loss", f"{a['target_val']:.4f}"),
                 ("arch: recipe's tokens", fmt(a["recipe_tokens"])),
                 ("arch: a counted bigram's tokens", fmt(a["bigram_tokens"])),
                 ("arch: the same, with a cache", fmt(a["bigram_cache_tokens"]))]
        for arm in a["arms"]:
            rows += [(f"arch: {arm} tokens to it", fmt(a[f"{arm}_tokens"])),
                     (f"arch: {arm} s/step", fmt(a[f"{arm}_s_per_step"]))]
    rows += tokenizer_table_rows(r)
    return rows


def print_table(results):
    print("setting: " + ", ".join(f"{k}={v}" for k, v in results["setting"].items()))
    print(f"{'what':<34} {'value':>16}")
    for name, value in table_rows(results):
        print(f"{name:<34} {value:>16}")


if __name__ == "__main__":
    sys.exit(main())
