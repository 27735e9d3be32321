"""What the test files share: data fixtures written on the spot, the tiny model and the tiny run,
running train_gpt2.py (in this process, as a subprocess, with test hooks, under torchrun), the
checks of a one-line error, and the GPU-path and HellaSwag checks that more than one file runs.

pytest's fixtures are in conftest.py; this module holds none, so a child process (the
older-transformers HellaSwag check, the simulated-CUDA harness) can import it too.
"""
import contextlib
import copy
import hashlib
import http.server
import io
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

import core_eval  # noqa: E402
import settings  # noqa: E402
import train_gpt2 as tg  # noqa: E402


# A limit on a subprocess or a wait is there to catch a hang, never to judge speed: far beyond
# the slowest honest run (the longest, a torchrun launch or bench.py's long rows, takes well under
# a minute on an idle 2-core machine, a few minutes with the cores oversubscribed several times).
HANG_LIMIT_S = 1200


# ===== Data written on the spot ==================================================================
def write_shards(root, split, sizes, seed=0, vocab=50257, prefix="test"):
    """uint16 shards `{prefix}_{split}_NNNNNN.npy` of random tokens, one per size; returns them."""
    import fineweb

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    first = 0 if split == "val" else 1
    arrays = []
    for i, n in enumerate(sizes):
        arr = rng.integers(0, vocab, size=n, dtype=np.int64).astype(np.uint16)
        np.save(os.path.join(root, fineweb.shard_name(first + i, split, prefix=prefix)), arr)
        arrays.append(arr)
    return arrays


def write_jsonl(path, rows):
    """One JSON object per line; the folder is made if needed. Returns the path as a string."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_hellaswag(folder, n, seed=0):
    """A hellaswag_val.jsonl of n short made-up examples in the original schema."""
    rng = random.Random(seed)
    words = ("the a man woman dog ball runs jumps into water slowly then picks up throws it over "
             "fence").split()

    def phrase(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    rows = []
    for i in range(n):
        ctx_a = phrase(5, 12).capitalize() + "."
        ctx_b = phrase(2, 5)
        endings = [phrase(3, 9) + "." for _ in range(4)]
        rows.append({"ind": i, "activity_label": "Fixture", "ctx_a": ctx_a, "ctx_b": ctx_b,
                     "ctx": f"{ctx_a} {ctx_b}", "split": "val", "split_type": "indomain",
                     "endings": endings, "label": rng.randrange(4), "source_id": f"fixture~{i}"})
    return write_jsonl(os.path.join(folder, "hellaswag_val.jsonl"), rows)


# The fixture eval bundle: every task type, 0 and several shots, a delimiter other than a space,
# questions with 2 to 5 options, and 4-shot LM prompts longer than a 64-position model's context
CORE_TASKS = [  # (label, type, shots, delimiter or None for core.yaml's default, random baseline)
    ("mc_zero", "multiple_choice", 0, None, 25.0),
    ("mc_shots", "multiple_choice", 3, "\nAnswer: ", 30.0),
    ("schema_zero", "schema", 0, None, 50.0),
    ("schema_shots", "schema", 2, None, 50.0),
    ("lm_zero", "language_modeling", 0, None, 0.0),
    ("lm_shots", "language_modeling", 4, " => ", 0.0),
]
CORE_WORDS = ("the a river mountain city school teacher student water light plant animal red blue "
              "green small large old new runs grows shines falls learned built").split()


def core_records(kind, n, seed, lm_answers=()):
    """n made-up records of a task type in llm-foundry's ICL format. lm_answers: (context,
    continuation) pairs used first for a language-modeling task."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(CORE_WORDS) for _ in range(rng.randint(lo, hi)))

    recs = []
    for i in range(n):
        if kind == "multiple_choice":
            choices = [words(1, 4) for _ in range(2 + i % 4)]
            if i == 1:  # a choice whose tokens are the start of another's: an empty scored span
                choices = ["blue", "blue river", "old city"]
            recs.append({"query": words(4, 9).capitalize() + "?", "choices": choices,
                         "gold": rng.randrange(len(choices))})
        elif kind == "schema":
            options = [words(3, 7).capitalize() for _ in range(2 + i % 2)]
            recs.append({"context_options": options, "continuation": words(2, 5) + ".",
                         "gold": rng.randrange(len(options))})
        elif i < len(lm_answers):
            recs.append({"context": lm_answers[i][0], "continuation": lm_answers[i][1]})
        else:  # a context with trailing whitespace, which the rules strip
            recs.append({"context": words(20, 40).capitalize() + " ",
                         "continuation": words(1, 2)})
    return recs


def write_core_bundle(folder, n=8, seed=0, tasks=CORE_TASKS, lm_answers=(), records=None):
    """An eval bundle in nanochat's layout under folder/eval_bundle (core.yaml, eval_meta_data.csv,
    eval_data/<category>/<label>.jsonl): n records a task. records: {label: records} instead of
    made-up ones. Returns the bundle folder."""
    root = os.path.join(folder, "eval_bundle")
    os.makedirs(root, exist_ok=True)
    specs = []
    for k, (label, kind, shots, delimiter, baseline) in enumerate(tasks):
        recs = (records or {}).get(label)
        if recs is None:
            recs = core_records(kind, n, seed + k, lm_answers if shots == 0 else ())
        specs.append({"label": label, "kind": kind, "shots": shots, "delimiter": delimiter,
                      "baseline": baseline, "records": recs, "category": "fixture"})
    return core_eval.write_bundle(root, specs)


def edit_line(path, line, change):
    """The 0-based line of a text file replaced by change(line)."""
    with open(path) as f:
        lines = f.read().splitlines()
    lines[line] = change(lines[line])
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def zip_folder(folder, path):
    """folder zipped into path with folder's name as the top entry, as eval_bundle.zip is."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for top, _, names in os.walk(folder):
            for name in sorted(names):
                full = os.path.join(top, name)
                z.write(full, os.path.relpath(full, os.path.dirname(folder)))
    return str(path)


def write_corpus_jsonl(path, n_docs=200, seed=0):
    """A small .jsonl corpus of made-up English-like documents (a `text` field each)."""
    rng = random.Random(seed)
    words = ("the of and to in is was for on that with as by at from his her an were are which "
             "this be or river mountain city school teacher student science history water light "
             "energy plant animal learned built grew studied measured found wrote taught").split()
    docs = []
    for _ in range(n_docs):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize()
                     + "." for _ in range(rng.randint(3, 8))]
        docs.append({"text": " ".join(sentences)})
    return write_jsonl(path, docs)


def dir_bytes(folder):
    """{file name: bytes} of a folder, to show that something touched nothing."""
    return {name: open(os.path.join(folder, name), "rb").read()
            for name in sorted(os.listdir(folder))}


def read_text(path):
    with open(path, errors="replace") as f:
        return f.read()


# ===== The tiny model ============================================================================
TINY = dict(block_size=64, n_layer=2, n_head=2, n_embd=64)


def tiny_model(seed=0, device="cpu", **kw):
    """A seeded GPT of TINY's shape, changed by kw."""
    torch.manual_seed(seed)
    return tg.GPT(tg.GPTConfig(**{**TINY, **kw})).to(device)


def chat_model(block_size=128, **arch):
    """A tiny chat model (its padding mask lets the chat tokens be predicted), in eval mode."""
    import chat

    return tiny_model(real_vocab_size=chat.CHAT_VOCAB_SIZE, block_size=block_size, **arch).eval()


def save_checkpoint(model, path):
    """model as a checkpoint file of ours (its weights and config): what --checkpoint reads."""
    from dataclasses import asdict

    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, path)
    return str(path)


def plain_reply(model, ids, max_new):
    """The greedy reply to ids, each token from the model run on the whole sequence so far (no
    KV cache): the reference for the chat engines."""
    import chat

    ids, reply = list(ids), []
    for _ in range(max_new):
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]))
        token = int(logits[0, -1, : chat.CHAT_VOCAB_SIZE].argmax())
        if token == chat.END["assistant"]:
            break
        ids.append(token)
        reply.append(token)
    return reply


def hf_gpt2(tmp_path, vocab=50257, seed=0, n_head=2, n_positions=64):
    """A random transformers GPT2LMHeadModel (eval mode) and its save_pretrained folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=n_head, n_embd=64, n_positions=n_positions,
                                    vocab_size=vocab))
    path = str(tmp_path / "hf")
    hf.save_pretrained(path)
    return hf.eval(), path


# ===== Running train_gpt2.py =====================================================================
class CliResult:
    """What a run of main() in this process gave: the exit status and its output. An exception
    that left main() (a bug, which keeps its traceback) is in `exception`, its traceback at the end
    of stderr and the status 1, as a subprocess would show it."""

    def __init__(self, returncode, stdout, stderr, exception=None):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.exception = exception


def run_cli(*args, subprocess_run=False):
    """`python train_gpt2.py ARGS`: in this process by default (the same main(), without a new
    interpreter and torch import each time), or as a real subprocess."""
    if subprocess_run:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the numbers of this process's one thread
        return subprocess.run([sys.executable, os.path.join(REPO, "train_gpt2.py"), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=HANG_LIMIT_S,
                              env=env)
    out, err, exception = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tg.main(list(args))
        except SystemExit as e:  # argparse: --help, or a bad flag
            code = e.code if isinstance(e.code, int) else 1
        except Exception as e:
            traceback.print_exc()
            code, exception = 1, e
    return CliResult(code, out.getvalue(), err.getvalue(), exception)


# The tiny run: 8 steps of 64 tokens on a one-layer model of width 16 (two heads of 8), on the CPU
# in fp32 on any machine (`auto` would pick CUDA, bf16 and compile on a GPU box; tests/test_cuda.py
# covers CUDA). Most of its time and bytes are the 50,304-entry vocabulary's table and head, which
# the width multiplies. A checkpoint of the last step, 7, only (and of the step a stop ends on):
# each is 10 MB, the table and AdamW's two moments of it, and writing four would take a third of
# the run's time; SAVES adds steps 2, 4 and 6 for a test that resumes from one of them. Val loss
# at 0, 3, 6 and of the final model (logged at step 8); samples at 3, 6 and of the final model.
RUN_FLAGS = {
    "--preset": "tiny", "--n_layer": "1", "--n_head": "2", "--n_embd": "16", "--block_size": "32",
    "-B": "2", "-T": "32", "--total_batch_size": "64", "--max_steps": "8", "--warmup_steps": "2",
    "--eval_every": "3", "--val_tokens": "64", "--sample_every": "3", "--sample_tokens": "4",
    "--num_samples": "1", "--save_every": "0", "--hellaswag_every": "0", "--device": "cpu",
}
SAVES = ("--save_every", "2")
SHAPE_FLAGS = ("--n_layer", "--n_head", "--n_embd", "--block_size")


def run_args(data, log, *extra, drop=()):
    """The tiny run's command line on the shards in `data`, writing to `log`. Flags in extra come
    last and win; those in drop are left out."""
    args = [w for flag, value in RUN_FLAGS.items() if flag not in drop for w in (flag, value)]
    return args + ["--data_root", data, "--log_dir", log, *extra]


def resume_args(log, *extra):
    """A resumed run needs nothing but the log dir: the shape, data and schedule come from the
    checkpoint (--device is this invocation's)."""
    return ["--resume", "latest", "--log_dir", log, "--device", "cpu", *extra]


# Eight steps of 256 tokens, val loss at 0, 4 and the end, nothing else: the run a distributed one
# (2 ranks, 2 micro-steps each) is compared with
DIST_FLAGS = ["--max_steps", "8", "--eval_every", "4", "--sample_every", "0",
              "--total_batch_size", "256", "--val_tokens", "1000"]


def dist_reference(data, log, *flags):
    """One process, DIST_FLAGS' eight steps straight: the run a distributed one is compared with."""
    r = run_cli(*run_args(data, log, *DIST_FLAGS, *flags))
    assert r.returncode == 0, r.stderr
    return log


def stop_then_resume(data, log, first, second, *first_flags):
    """Steps 0-3 with `first` (a runner: run_cli, torchrun, ...), stopping with a checkpoint, then
    the rest with `second` from that checkpoint. Returns the first run's result."""
    r = first(*run_args(data, log, *DIST_FLAGS, "--stop_step", "4", *first_flags))
    assert r.returncode == 0, r.stderr
    resumed = second(*run_args(data, log, *DIST_FLAGS, "--resume", "latest"))
    assert resumed.returncode == 0, resumed.stderr
    return r


def assert_same_log(a, b, tol):
    """The log.txt of two runs: the same steps of each kind, the losses and evaluations within tol
    (of the step's LR, norm and timings, the steps only)."""
    la, lb = series(a), series(b)
    assert set(la) == set(lb)
    for kind in la:
        assert la[kind][0] == lb[kind][0], kind
        if kind in ("train", "val", "hella"):
            assert la[kind][1] == pytest.approx(lb[kind][1], abs=tol), kind


def torchrun(*args, nproc=2, script=os.path.join(REPO, "train_gpt2.py"), env=None, wait=True,
             files=None):
    """`torchrun --standalone --nproc_per_node=nproc script args`, env added to this process's:
    its CompletedProcess, or (wait=False) the Popen, stdout and stderr piped as text, or written
    to files=(tmp_path, name) as start_hooked's are (output() reads them while it runs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", script, *args]
    if files is not None:
        return popen_to_files(cmd, env, *files)
    if not wait:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=HANG_LIMIT_S,
                              env=env)


def log_of(log_dir):
    """log.txt as two runs of the same steps must both write it: the timing lines left out."""
    import rundir

    kept = []
    for line in read_text(os.path.join(log_dir, "log.txt")).splitlines(keepends=True):
        parsed = rundir.parse_log_line(line)
        if parsed is None or parsed[1] not in rundir.TIMING_KINDS:
            kept.append(line)
    return "".join(kept)


def series(log_dir):
    """log.txt read back: {kind: (steps, values)}."""
    import rundir

    return rundir.read_log(os.path.join(log_dir, "log.txt"))


def newest_step(log):
    import rundir

    return torch.load(rundir.find_checkpoints(log)[-1], weights_only=False)["step"]


def step_lines(stdout):
    """{step: (loss, norm)} from the step lines a run printed."""
    found = re.findall(r"^step +(\d+) \| loss ([\d.]+) \| lr \S+ \| norm ([\d.]+)", stdout, re.M)
    return {int(s): (float(loss), float(norm)) for s, loss, norm in found}


def assert_one_line_error(r, *parts):
    """Exit 1 and exactly one stderr line, an 'error:' naming each of parts; returns the line."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


# ===== train_gpt2.py in a process of its own, with test hooks ====================================
# `python tests/hooks.py ARGS` is `python train_gpt2.py ARGS` plus hooks that make races and kill
# points deterministic (a start gate, holds or pauses at a chosen point; env HOOK_*, see hooks.py).
HOOKS = os.path.join(REPO, "tests", "hooks.py")


def start_hooked(tmp_path, name, args, **hook):
    """Popen of `python tests/hooks.py args` (hook={"mode": ...}: env HOOK_MODE, ...), its stdout
    and stderr in tmp_path/name.out and .err."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           **{f"HOOK_{k.upper()}": str(v) for k, v in hook.items()}}
    return popen_to_files([sys.executable, HOOKS, *args], env, tmp_path, name)


def popen_to_files(cmd, env, tmp_path, name):
    """Popen of cmd, its stdout and stderr in tmp_path/name.out and .err (see output())."""
    out = open(tmp_path / f"{name}.out", "w+")
    err = open(tmp_path / f"{name}.err", "w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=REPO)
    proc.out, proc.err = out, err
    return proc


def wait_until(condition, procs, what):
    """Poll until condition(); fail (not hang) if a process that should be held exits instead."""
    deadline = time.monotonic() + HANG_LIMIT_S  # a hang only, never a claim about speed
    while not condition():
        for p in procs:
            if p.poll() is not None:
                p.err.seek(0)
                pytest.fail(f"process exited ({p.returncode}) before {what}: "
                            f"{p.err.read()[-2000:]}")
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def output(proc):
    proc.out.seek(0)
    proc.err.seek(0)
    return proc.out.read(), proc.err.read()


# ===== The GPU paths' checks: on the CPU in test_gpu_paths_cpu.py, on CUDA in test_cuda.py =======
GPU_SHAPE = dict(block_size=128, n_head=4)  # heads of 16, room for the HellaSwag rows
# The architectures of the kernel checks: GPT-2's, and --arch modern's parts with random output
# projections and head (the forward is the same; zero ones would give every logit 0 and the loss
# ln(vocab) on any path: nothing to compare)
GPU_ARCHS = {"gpt2": {}, "modern": {**settings.ARCHITECTURES["modern"], "zero_init": False}}
BF16_LOSS_TOL = 0.05  # bf16 keeps 8 mantissa bits (~0.4%): a loss near 10.8 moves by a few 1e-3


def random_batch(device, B=2, T=64, vocab=50257, seed=1):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, vocab, (B, T + 1), generator=g)
    return buf[:, :-1].to(device), buf[:, 1:].to(device)


def bf16_train_step(model, x, y):
    """Forward and backward under bf16 autocast; checks the dtypes a mixed-precision step has."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        _, loss = model(x, y)
        logits, _ = model(x)
    loss.backward()
    assert logits.dtype == torch.bfloat16  # the matmuls ran in bf16 ...
    assert loss.dtype == torch.float32 and torch.isfinite(loss)  # ... the softmax and loss in fp32
    for name, p in model.named_parameters():  # fp32 master weights get fp32 gradients
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    return loss.item()


def fused_vs_plain_adamw(device, steps):
    """Two copies of one model stepped with the same gradients: configure_optimizers' fused AdamW
    (what CUDA gets) and its non-fused one (what other devices get). Returns ((model, opt),
    (model, opt))."""
    model = tiny_model(device=device, **GPU_SHAPE)
    ref = copy.deepcopy(model)
    fused = model.configure_optimizers(0.1, 1e-3, "cuda", verbose=False)  # fused on any device
    plain = ref.configure_optimizers(0.1, 1e-3, "cpu", verbose=False)
    for step in range(steps):
        x, y = random_batch(device, seed=step)
        model(x, y)[1].backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
        fused.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    return (model, fused), (ref, plain)


def memorize(model, rows, starts=None, lr=1e-2, max_steps=300, until=0.1):
    """Train on these token rows until the model knows them by heart: row i's tokens from index
    starts[i] on (default 1: all of them) are the targets. Random weights give near-ties that bf16
    rounding may break either way; a memorized model's choices win by wide margins, so two bf16
    code paths must agree exactly."""
    device = next(model.parameters()).device
    starts = starts or [1] * len(rows)
    T = max(len(r) for r in rows) - 1
    x = torch.zeros(len(rows), T, dtype=torch.long)
    y = torch.full((len(rows), T), -100, dtype=torch.long)  # padding and context: no target
    for i, (r, s) in enumerate(zip(rows, starts)):
        x[i, : len(r) - 1], y[i, s - 1: len(r) - 1] = torch.tensor(r[:-1]), torch.tensor(r[s:])
    x, y = x.to(device), y.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(max_steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if loss.item() < until:
            break
    return loss.item()


def kv_cache_vs_recompute_bf16(device):
    """Greedy continuations of a memorized prompt under bf16, with and without the KV cache."""
    # a small vocab keeps the training quick
    model = tiny_model(device=device, vocab_size=512, real_vocab_size=500, **GPU_SHAPE)
    g = torch.Generator().manual_seed(2)
    # no token twice in a row: each token's successor is unique, a bigram table learnt quickly
    seqs = torch.stack([torch.randperm(500, generator=g)[:48] for _ in range(2)])
    memorize(model, seqs.tolist())
    prompt = seqs[:, :8].to(device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        cached = model.generate(prompt, 40, top_k=1, use_cache=True)
        recomputed = model.generate(prompt, 40, top_k=1, use_cache=False)
    return cached.cpu(), recomputed.cpu(), seqs


def hellaswag_batched_vs_one_per_forward_bf16(device, folder, n=6):
    """HellaSwag results under bf16 of a model that memorized the fixture's right endings, batched
    and one example per forward (batch_tokens=0)."""
    import fineweb
    import hellaswag

    write_hellaswag(folder, n)
    enc = fineweb.get_encoding()
    with open(os.path.join(folder, "hellaswag_val.jsonl")) as f:
        examples = [json.loads(line) for line in f]
    ctxs = [enc.encode(ex["ctx"]) for ex in examples]
    rights = [enc.encode(" " + ex["endings"][ex["label"]]) for ex in examples]
    model = tiny_model(device=device, **GPU_SHAPE)
    # only the right endings are targets: the made-up contexts are random words, slow to learn
    memorize(model, [c + e for c, e in zip(ctxs, rights)], starts=[len(c) for c in ctxs],
             until=0.5)
    return [hellaswag.evaluate(model, device, data_dir=folder, batch_tokens=bt,
                               autocast_dtype=torch.bfloat16) for bt in (8192, 0)]


# ===== HellaSwag examples and the classic scoring loop (test_hellaswag.py and its child) ==========
HS_WORDS = (
    "the a man woman person he she they is are was then and while with on in at of to into "
    "his her their camera kitchen bowl water ball field bike road wall paint brush table chair "
    "knife onion pan oven dog rope shoe hair mirror car tire tool box paper glue guitar piano "
    "stands walks runs jumps picks puts holds throws cuts mixes pours shows talks smiles turns "
    "continues begins finishes starts uses grabs lifts moves slowly quickly carefully again "
    "several small large red blue green white black front back top side next over under around"
).split()
HS_ACTIVITIES = ["Making a sandwich", "Painting fence", "Playing guitarra", "Washing dishes",
                 "Bathing dog", "Changing car wheel", "Personal Care and Style", "Home and Garden"]
SHORT = dict(ctx_words=(6, 16), ending_words=(3, 8))  # keeps the CPU tests fast


def make_records(n, seed=0, ctx_words=(20, 60), ending_words=(10, 30), split="val"):
    """n records in the original HellaSwag jsonl schema, with realistic lengths (context ~20-60
    tokens, endings ~10-30 tokens)."""
    rng = random.Random(seed)

    def phrase(lo, hi):
        return " ".join(rng.choice(HS_WORDS) for _ in range(rng.randint(lo, hi)))

    recs = []
    for i in range(n):
        n_ctx = rng.randint(*ctx_words)
        cut = rng.randint(1, max(n_ctx - 1, 1))
        ctx_a = phrase(cut, cut).capitalize() + "."
        ctx_b = phrase(max(n_ctx - cut, 1), max(n_ctx - cut, 1))
        endings = [phrase(*ending_words) + "." for _ in range(4)]
        rec = {
            "ind": 10 * i + 4,
            "activity_label": rng.choice(HS_ACTIVITIES),
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


def tiny_hf_model(seed=0, n_positions=256):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                     initializer_range=0.2)  # large init: losses far from ties
    model = GPT2LMHeadModel(cfg)
    model.eval()
    return model


def classic_scores(model, recs):
    """The classic loop, written here independently of hellaswag's scoring: one example per
    forward, logits at every position, an explicit log-softmax. Returns (pred, pred_norm, summed
    losses) per example."""
    import hellaswag

    out = []
    for rec in recs:
        _, tokens, mask, _ = hellaswag.render_example(rec)
        with torch.no_grad():
            o = model(tokens)
        logits = o[0] if isinstance(o, tuple) else o.logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, tokens[:, 1:, None])[..., 0]
        m = mask[:, 1:].float()
        s = -(logp * m).sum(1)
        out.append((int(s.argmin()), int((s / m.sum(1)).argmin()), s.tolist()))
    return out


def preds(results):
    return [(r["pred"], r["pred_norm"]) for r in results]


# ===== A server on 127.0.0.1 ====================================================================
class Server:
    """A thread serving every GET with body(handler) (a BaseHTTPRequestHandler) on 127.0.0.1,
    while the with block runs; `asked` is set at the first request. A client that leaves ends its
    answer. Each test's body stops by itself."""

    def __init__(self, body):
        self.asked = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.asked.set()
                try:
                    body(self)
                except OSError:  # the client left: what these tests want
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/eval_bundle.zip"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


# ===== The chat tasks' data (chat_eval.py), in the HF datasets' own fields =====================
CHAT_EVAL_SOURCES = {"arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
                     "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
                     "mmlu": ("cais/mmlu", "all", "test")}
CHAT_EVAL_WORDS = ("the a river mountain city school teacher student water light plant animal red "
                   "blue green small large old new runs grows shines falls learned built").split()


def _words(rng, lo, hi):
    return " ".join(rng.choice(CHAT_EVAL_WORDS) for _ in range(rng.randint(lo, hi)))


def arc_rows(n, seed):
    """ARC's rows: 3 to 5 choices, labelled A... or (as some of ARC's are) 1, 2, ..."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        k = 3 + i % 3
        labels = list("ABCDE"[:k]) if i % 4 else [str(j + 1) for j in range(k)]
        rows.append({"id": f"Fixture_{i}", "question": _words(rng, 5, 12).capitalize() + "?",
                     "choices": {"text": [_words(rng, 1, 4) for _ in range(k)], "label": labels},
                     "answerKey": rng.choice(labels)})
    return rows


def mmlu_rows(n, seed):
    rng = random.Random(seed)
    return [{"question": _words(rng, 5, 12).capitalize() + "?", "subject": "fixture",
             "choices": [_words(rng, 1, 4) for _ in range(4)], "answer": rng.randrange(4)}
            for _ in range(n)]


def write_chat_eval_data(folder, rows_by_label=None):
    """The chat tasks' data folder as chat_eval's download leaves it: LABEL.jsonl (one HF row a
    line) and manifest.json with each file's SHA-256, row count and source."""
    if rows_by_label is None:
        rows_by_label = {"arc_easy": arc_rows(23, 1), "arc_challenge": arc_rows(17, 2),
                         "mmlu": mmlu_rows(19, 3)}
    os.makedirs(folder, exist_ok=True)
    manifest = {}
    for label, rows in rows_by_label.items():
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        with open(os.path.join(folder, f"{label}.jsonl"), "wb") as f:
            f.write(data)
        dataset, config, split = CHAT_EVAL_SOURCES[label]
        manifest[label] = {"file": f"{label}.jsonl", "sha256": hashlib.sha256(data).hexdigest(),
                           "rows": len(rows), "dataset": dataset, "config": config,
                           "split": split}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return str(folder)
