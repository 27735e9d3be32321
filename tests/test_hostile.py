"""Issue 14, tested as a hostile user would: two runs into one log dir, kill -9 mid-run and mid-save, bad
flags, damaged data, checkpoints and logs, and errors in the every-N actions after training started.

Every fixture is written here (token shards, corpora, damage). Runs are tiny (one layer, width 32, 64 tokens a
step) and in-process, except where a real second process is the point: the concurrent start and the kill -9s.
Those go through HOOK below, which is `python train_gpt2.py` (tg.main()) plus test hooks that make the race and
the kill points deterministic: a start gate, and pauses at a chosen point that the test then kill -9s.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import common
import fineweb
import train_gpt2 as tg
from conftest import REPO, write_corpus_jsonl, write_shards
from test_train_gpt2 import run_cli


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # the development VM has 2 cores shared with other jobs: a second intra-op thread makes these tiny
    # models several times slower there, not faster
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- a tiny run and its flags

# 8 steps of 64 tokens: checkpoints at 2, 4, 6 and the last step 7; val and samples at 0/3, 3, 6 and the final
# model (logged at step 8). Run settings only, no defaults that depend on the machine (--device cpu).
RUN_FLAGS = {
    "--preset": "tiny", "--n_layer": "1", "--n_head": "2", "--n_embd": "32", "--block_size": "32",
    "-B": "2", "-T": "32", "--total_batch_size": "64", "--max_steps": "8", "--warmup_steps": "2",
    "--eval_every": "3", "--val_tokens": "64", "--sample_every": "3", "--sample_tokens": "4", "--num_samples": "1",
    "--save_every": "2", "--hellaswag_every": "0", "--device": "cpu",
}


def run_args(data, log, **overrides):
    """The tiny run's command line; overrides={"--flag": value} replaces a flag (None drops it)."""
    flags = {**RUN_FLAGS, **overrides}
    args = [w for k, v in flags.items() if v is not None for w in (k, v)]
    return args + ["--data_root", data, "--log_dir", log]


def resume_args(log):
    # a resumed run needs nothing but the log dir: the shape, data and schedule come from the checkpoint
    return ["--resume", "latest", "--log_dir", log, "--device", "cpu"]


def error_lines(r):
    return [line for line in r.stderr.splitlines() if line.strip()]


def assert_one_line_error(r, *parts):
    """Exit 1 and exactly one stderr line, an 'error:' naming each of parts."""
    lines = error_lines(r)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def dir_bytes(folder):
    """{file name: bytes} of a folder, to show a refused run touched nothing."""
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def read_text(path):
    with open(path, errors="replace") as f:
        return f.read()


def newest_step(log):
    return torch.load(tg.find_checkpoints(log)[-1], weights_only=False)["step"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile") / "data")
    write_shards(root, "val", [3000], seed=1)
    write_shards(root, "train", [2000, 1500, 2500], seed=2)
    return root


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce: its log dir."""
    log = str(tmp_path_factory.mktemp("reference") / "log")
    r = run_cli(*run_args(data, log))
    assert r.returncode == 0, r.stderr
    return log


def reference_log(reference):
    return read_text(os.path.join(reference, "log.txt"))


# ----------------------------------------------------------------------------- real processes

HOOK = r'''
import os, sys, time
sys.path.insert(0, os.environ["HOOK_REPO"])
import train_gpt2 as tg

def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.01)

def pause():  # tell the test where we are, then wait for its kill -9
    open(os.environ["HOOK_MARKER"], "w").close()
    while True:
        time.sleep(1)

mode, arg = os.environ.get("HOOK_MODE", ""), os.environ.get("HOOK_ARG", "")
if mode == "hold_after_log":  # arg "5 train": hold once this log line is written, until HOOK_RELEASE exists
    real_append = tg.append_log
    def append_log(path, step, kind, value):
        real_append(path, step, kind, value)
        if f"{step} {kind}" == arg:
            open(os.environ["HOOK_MARKER"], "w").write(str(os.getpid()))
            wait_for(os.environ["HOOK_RELEASE"])
    tg.append_log = append_log
elif mode == "pause_after_log":  # arg "5 train": pause once this log line is written
    real_append = tg.append_log
    def append_log(path, step, kind, value):
        real_append(path, step, kind, value)
        if f"{step} {kind}" == arg:
            pause()
    tg.append_log = append_log
elif mode == "pause_mid_save":  # arg: a checkpoint file name, paused when written under its temp name
    real_write = tg.atomic_write
    def atomic_write(path, write):
        def write_then_pause(f):
            write(f)
            f.flush()
            if os.path.basename(path) == arg:
                pause()
        real_write(path, write_then_pause)
    tg.atomic_write = atomic_write
elif mode == "hold_lock":  # arg: a file; the run waits for it after claiming the log dir
    real_save_config = tg.save_run_config
    def save_run_config(*a):
        wait_for(arg)
        return real_save_config(*a)
    tg.save_run_config = save_run_config
if os.environ.get("HOOK_GATE"):  # start line: both racers are past their imports
    wait_for(os.environ["HOOK_GATE"])
tg.exit_process(tg.main())  # as train_gpt2.py's own __main__: under torchrun, no interpreter shutdown
'''


def start_hooked(tmp_path, name, args, **hook):
    """Popen of `python train_gpt2.py args` with HOOK's hooks (env HOOK_*)."""
    script = tmp_path / "hook.py"
    if not script.exists():
        script.write_text(HOOK)
    env = {**os.environ, "HOOK_REPO": REPO, "OMP_NUM_THREADS": "1",
           **{f"HOOK_{k.upper()}": str(v) for k, v in hook.items()}}
    out = open(tmp_path / f"{name}.out", "w+")
    err = open(tmp_path / f"{name}.err", "w+")
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=out, stderr=err, env=env, cwd=REPO)
    proc.out, proc.err = out, err
    return proc


def wait_until(condition, procs, what):
    """Poll until condition(); fail (not hang) if a process that should be paused exits instead."""
    deadline = time.time() + 300  # a safety net for a hung test only, never an assertion about speed
    while not condition():
        for p in procs:
            if p.poll() is not None:
                p.err.seek(0)
                pytest.fail(f"process exited ({p.returncode}) before {what}: {p.err.read()[-2000:]}")
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def output(proc):
    proc.out.seek(0)
    proc.err.seek(0)
    return proc.out.read(), proc.err.read()


def test_two_runs_started_at_once_into_one_empty_dir(data, tmp_path):
    log, gate, release = str(tmp_path / "log"), tmp_path / "gate", tmp_path / "release"
    args = run_args(data, log, **{"--sample_every": "0", "--max_steps": "3"})
    procs = [start_hooked(tmp_path, f"run{i}", args, gate=gate, mode="hold_lock", arg=release) for i in range(2)]
    gate.touch()  # both go for the lock at the same moment
    # the run that claimed the dir waits (hold_lock) until the other has given up: no timing involved
    wait_until(lambda: any(p.poll() is not None for p in procs), [], "one run gave up")
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    release.touch()
    assert winner.wait(timeout=300) == 0, output(winner)[1]
    out, err = output(loser)
    r = subprocess.CompletedProcess([], loser.returncode, out, err)
    line = assert_one_line_error(r, "in use by a live run", f"pid {winner.pid} ")
    assert "run config" in out  # it got as far as the claim, then touched nothing
    series = tg.read_log(os.path.join(log, "log.txt"))
    assert series["train"][0] == list(range(3)), line  # one run's lines, once


def test_kill_9_mid_save_and_mid_run_then_resume_is_bit_exact(data, reference, tmp_path):
    # two victims side by side (each pays for its own torch import): one paused inside a checkpoint save, its
    # temp file written but not renamed; one paused mid-run, its log ahead of its newest checkpoint
    save_log, run_log = str(tmp_path / "mid_save"), str(tmp_path / "mid_run")
    mid_save = start_hooked(tmp_path, "mid_save", run_args(data, save_log), mode="pause_mid_save",
                            arg="model_00004.pt", marker=tmp_path / "paused_mid_save")
    mid_run = start_hooked(tmp_path, "mid_run", run_args(data, run_log), mode="pause_after_log", arg="5 train",
                           marker=tmp_path / "paused_mid_run")
    try:
        wait_until(lambda: (tmp_path / "paused_mid_save").exists() and (tmp_path / "paused_mid_run").exists(),
                   [mid_save, mid_run], "both pauses")
        before = dir_bytes(save_log)
        assert any(name.endswith(".tmp") for name in before)  # the half-saved checkpoint, under its temp name
        # a second run into the live dir, as a user retrying too early would: refused, naming the live pid
        for extra in (resume_args(save_log), run_args(data, save_log) + ["--overwrite"]):
            assert_one_line_error(run_cli(*extra), "in use by a live run", f"pid {mid_save.pid} ")
        assert dir_bytes(save_log) == before  # byte for byte: not even the stale temp file was touched
    finally:
        for proc in (mid_save, mid_run):
            proc.kill()  # SIGKILL: no handler, no cleanup, as the OOM killer or a node failure would
            proc.wait()
    assert mid_save.returncode == mid_run.returncode == -signal.SIGKILL
    logged = tg.read_log(os.path.join(run_log, "log.txt"))["train"][0]
    assert logged[-1] > newest_step(run_log)  # the log ran ahead of the newest checkpoint: the resume must cut it

    # the OS released the locks with the processes: resuming needs no manual cleanup
    for log in (save_log, run_log):
        r = run_cli(*resume_args(log))
        assert r.returncode == 0, r.stderr
        assert "resumed from" in r.stdout
        assert not [n for n in os.listdir(log) if n.endswith(".tmp")]  # the crash's temp file is gone
        assert read_text(os.path.join(log, "log.txt")) == reference_log(reference)
        assert sorted(os.listdir(log)) == sorted(os.listdir(reference))


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("overrides, extra, names", [
    ({"--total_batch_size": "0"}, [], ["--total_batch_size"]),
    ({"--total_batch_size": "-1"}, [], ["--total_batch_size"]),
    ({"--max_steps": "0"}, [], ["--max_steps"]),
    ({"--max_lr": "-1"}, [], ["--max_lr"]),
    ({"--max_lr": "nan"}, [], ["--max_lr"]),
    ({"--weight_decay": "inf"}, [], ["--weight_decay"]),  # trained into NaNs, it failed only at the first sample
    ({"--val_tokens": "0"}, [], ["--val_tokens"]),  # val is on (--eval_every 3)
    ({"--val_tokens": None}, ["--val_steps", "0"], ["--val_steps"]),
    ({"--device": "cdua"}, [], ["--device", "cdua"]),
    ({"--sample_tokens": "40"}, [], ["--sample_tokens", "block_size"]),  # prompt + 40 > block_size 32
    ({}, ["--val_steps", "2"], ["--val_steps", "--val_tokens"]),
    ({}, ["--resume", "latest", "--overwrite"], ["--resume", "--overwrite"]),
    ({}, ["--resume", "latest", "--init_from", "gpt2"], ["--resume", "--init_from"]),
    ({}, ["--init_from", "gpt2"], ["--init_from", "--n_layer"]),  # run_args gives shape flags
])
def test_bad_flags_are_one_line_before_any_work(data, tmp_path, overrides, extra, names):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, **overrides), *extra)
    assert_one_line_error(r, *names)
    assert not os.path.exists(log)  # refused before the log dir was made, let alone locked or written


@pytest.mark.parametrize("flags, unused", [
    (["--eval_every", "0", "--val_tokens", "100"], "--val_tokens"),
    (["--eval_every", "0", "--val_steps", "3"], "--val_steps"),
    (["--sample_every", "0", "--sample_tokens", "9"], "--sample_tokens"),
    (["--hellaswag_every", "0", "--hellaswag_limit", "9"], "--hellaswag_limit"),
    (["--batch_ramp_start", "4096"], "--batch_ramp_start"),
    (["--profile_schedule", "0,0,1"], "--profile_schedule"),
    (["--wandb_run_name", "x"], "--wandb_run_name"),
])
def test_flags_for_a_part_that_is_off_are_stated(flags, unused):
    warnings = tg.check_flags(tg.parse_args(flags))
    assert [w for w in warnings if unused in w and "no effect" in w], warnings


@pytest.mark.parametrize("flag", ["--log_dir", "--data_root"])
def test_a_file_where_a_folder_goes_is_one_line(data, tmp_path, flag):
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    args = run_args(data, str(tmp_path / "log")) + [flag, str(path)]  # the later flag wins
    assert_one_line_error(run_cli(*args), flag, str(path))
    assert path.read_text() == "my notes\n" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


@pytest.mark.parametrize("prompt", ["", "<|endoftext|>Once upon a time"])
def test_sample_prompts_the_flag_check_accepts_also_sample(data, tmp_path, prompt):
    # the check encodes the prompt before any work; the sampler must encode it the same way, not fail at step N
    r = run_cli(*run_args(data, str(tmp_path / "log"), **{"--max_steps": "4", "--eval_every": "0"}),
                "--sample_prompt", prompt)
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("rank 0 sample 0:")]


def test_device_strings(monkeypatch):
    assert tg.resolve_device("cpu") == "cpu"
    for bad in ("cdua", "cuda:x", "gpu", ""):
        with pytest.raises(tg.UsageError, match="--device"):
            tg.resolve_device(bad)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(tg.UsageError, match="mps"):
        tg.resolve_device("mps")


def warnings_naming(r, flag):
    return [line for line in r.stdout.splitlines() if line.startswith("warning:") and flag in line]


def test_warmup_past_max_steps_warns_and_keep_last_prunes(data, reference, tmp_path):
    log, corpus = str(tmp_path / "log"), str(tmp_path / "corpus.jsonl")
    write_corpus_jsonl(corpus, n_docs=5)
    # --input only prepares an empty data_root: with shards there it is stated, not ignored in silence
    r = run_cli(*run_args(data, log, **{"--warmup_steps": "8"}), "--keep_last", "2", "--input", corpus)
    assert r.returncode == 0, r.stderr
    assert warnings_naming(r, "--warmup_steps") and warnings_naming(r, "--input"), r.stdout
    # the two newest of the checkpoints an unpruned run writes
    names = [os.path.basename(p) for p in tg.find_checkpoints(reference)]
    assert [os.path.basename(p) for p in tg.find_checkpoints(log)] == names[-2:]


# ----------------------------------------------------------------------------- errors after training started

def failing_generate(monkeypatch, fail_on_call):
    """GPT.generate raising on its fail_on_call-th call (samples run at steps 3, 6 and the final model)."""
    calls = []
    real = tg.GPT.generate

    def generate(self, *a, **k):
        calls.append(1)
        if len(calls) == fail_on_call:
            raise RuntimeError("sampler exploded")
        return real(self, *a, **k)
    monkeypatch.setattr(tg.GPT, "generate", generate)
    return []


def failing_wandb(monkeypatch, fail_at_step):
    """A W&B run whose log() fails at one step, or (None) whose finish() fails: its server went away, say."""
    class Run:
        def log(self, values, step):
            if step == fail_at_step:
                raise ConnectionError("W&B server exploded")

        def finish(self):
            if fail_at_step is None:
                raise ConnectionError("W&B server exploded")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run()))
    return ["--wandb_project", "hostile"]


@pytest.mark.parametrize("break_it, where", [
    (lambda m: failing_generate(m, 2), "evaluation at step 6"),
    (lambda m: failing_generate(m, 3), "final evaluation at step 8"),
    (lambda m: failing_wandb(m, 5), "logging at step 5"),
    (lambda m: failing_wandb(m, None), "finishing W&B"),
], ids=["samples", "final-samples", "wandb", "wandb-finish"])
def test_error_in_an_every_n_action_keeps_the_last_step_and_resumes(data, reference, tmp_path, monkeypatch,
                                                                     break_it, where):
    log = str(tmp_path / "log")
    with monkeypatch.context() as m:
        r = run_cli(*run_args(data, log), *break_it(m))
    line = assert_one_line_error(r, where, "exploded", "--resume latest")
    last_trained = tg.read_log(os.path.join(log, "log.txt"))["train"][0][-1]
    assert newest_step(log) == last_trained  # nothing trained was lost
    assert os.path.basename(tg.find_checkpoints(log)[-1]) in line
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    # the resumed run does what the failed one did not: for the final evaluation, that is all that is left
    assert read_text(os.path.join(log, "log.txt")) == reference_log(reference)


# ----------------------------------------------------------------------------- damaged data

def damage_truncated(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)


def damage_not_npy(path):
    with open(path, "wb") as f:
        f.write(b"<html>404 Not Found</html>\n" * 20)


def damage_token_id(path):
    tokens = np.load(path)
    tokens[17] = tg.GPT2_VOCAB_SIZE  # one past the last real GPT-2 token
    np.save(path, tokens)


def damage_dtype(path):
    np.save(path, np.load(path).astype(np.int32))  # token ids all below the vocab, but 4 bytes each


@pytest.mark.parametrize("damage, split", [(damage_truncated, "train"), (damage_not_npy, "train"),
                                           (damage_token_id, "train"), (damage_dtype, "train"),
                                           (damage_truncated, "val")])
def test_damaged_shard_is_one_line_naming_the_file(tmp_path, damage, split):
    root = str(tmp_path / "data")
    write_shards(root, "val", [3000], seed=1)
    write_shards(root, "train", [2000, 1500], seed=2)
    bad = tg.list_shards(root, split)[-1]
    damage(bad)
    r = run_cli(*run_args(root, str(tmp_path / "log")))
    assert_one_line_error(r, bad)


def interrupted_prep(tmp_path, monkeypatch):
    """A data dir whose prep died (as from kill -9) after 3 shards, from a local corpus: (dir, corpus, kwargs)."""
    corpus, root = str(tmp_path / "corpus.jsonl"), str(tmp_path / "data")
    write_corpus_jsonl(corpus, n_docs=60)
    kwargs = dict(inputs=[corpus], shard_size=600, val_tokens=300, num_proc=1, progress=False)
    real_write = fineweb.atomic_write

    def crash_on_shard_3(path, write):
        if path.endswith("_000003.npy"):
            raise KeyboardInterrupt
        real_write(path, write)
    with monkeypatch.context() as m:
        m.setattr(fineweb, "atomic_write", crash_on_shard_3)
        with pytest.raises(KeyboardInterrupt):
            fineweb.prepare(root, **kwargs)
    assert not fineweb.prep_status(root).complete
    return root, corpus, kwargs


def test_unfinished_prep_is_finished_from_its_source(tmp_path, monkeypatch):
    root, corpus, kwargs = interrupted_prep(tmp_path, monkeypatch)
    # no --input now: the manifest names the source
    r = run_cli(*run_args(root, str(tmp_path / "log"), **{"--max_steps": "1", "--eval_every": "0", "--sample_every": "0"}))
    assert r.returncode == 0, r.stderr
    assert fineweb.prep_status(root).complete
    whole = str(tmp_path / "whole")  # the same prep, never interrupted
    fineweb.prepare(whole, **kwargs)
    assert dir_bytes(root).keys() - {fineweb.MANIFEST} == dir_bytes(whole).keys() - {fineweb.MANIFEST}
    for name, content in dir_bytes(whole).items():
        if name.endswith(".npy"):
            assert dir_bytes(root)[name] == content, name


def test_unfinished_prep_without_its_source_is_refused_with_the_command(tmp_path, monkeypatch):
    root, corpus, _ = interrupted_prep(tmp_path, monkeypatch)
    os.remove(corpus)
    before = dir_bytes(root)
    r = run_cli(*run_args(root, str(tmp_path / "log")))
    assert_one_line_error(r, fineweb.prep_status(root).resume_command)
    assert dir_bytes(root) == before


# ----------------------------------------------------------------------------- damaged checkpoints and logs

def test_resume_skips_a_truncated_checkpoint_and_a_damaged_log_line(data, reference, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log), "--stop_step", "6")  # checkpoints 2, 4 and 5 (the stop)
    assert r.returncode == 0, r.stderr
    newest = tg.find_checkpoints(log)[-1]
    with open(newest, "r+b") as f:  # a copy cut short, a full disk: not something atomic_write can prevent
        f.truncate(os.path.getsize(newest) // 2)
    with open(os.path.join(log, "log.txt"), "ab") as f:  # what a crash on some filesystems leaves
        f.write(b"\0" * 300 + b"5 val 4.2\n" + b"2 tr\0\0\0\n")
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert any(newest in line for line in warnings), r.stdout
    assert any("damaged line" in line for line in warnings), r.stdout
    assert read_text(os.path.join(log, "log.txt")) == reference_log(reference)


def test_resume_latest_takes_a_non_default_shape_from_the_checkpoint(data, tmp_path):
    log = str(tmp_path / "log")
    shape = {"--n_layer": "2", "--n_head": "4", "--n_embd": "16", "--block_size": "48"}
    r = run_cli(*run_args(data, log, **shape, **{"--sample_every": "0", "--eval_every": "0"}), "--stop_step", "2")
    assert r.returncode == 0, r.stderr
    first = torch.load(tg.find_checkpoints(log)[-1], weights_only=False)["config"]
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert torch.load(tg.find_checkpoints(log)[-1], weights_only=False)["config"] == first


# ----------------------------------------------------------------------------- the lock's holder record

@pytest.mark.parametrize("left_in_file", ["missing", "garbled", "killed"])
def test_lock_message_names_the_live_holder_not_a_stale_or_missing_record(tmp_path, monkeypatch, left_in_file):
    import socket

    import filelock
    log, host = tmp_path / "log", socket.gethostname()
    log.mkdir()
    record = log / ".lock.holder"
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # no process can have it

    def write_record(pid):
        record.write_text(json.dumps({"pid": pid, "host": host, "started": "2024-05-01 12:00:00",
                                      "command": "python train_gpt2.py --log_dir log"}))
    # the instant after a new holder took the lock and before it wrote its record over a killed run's one
    holder = filelock.FileLock(str(log / ".lock"), thread_local=False, is_singleton=False)
    holder.acquire(timeout=0)
    if left_in_file == "killed":
        write_record(dead)
    elif left_in_file == "garbled":
        record.write_text('{"pid": ')  # half a record, as an editor or a copy would leave it
    before = sorted(os.listdir(log))

    # common.dir_lock itself: no live record within the wait, so none is named (the dead pid least of all)
    with pytest.raises(common.UsageError) as e:
        with common.dir_lock(str(log), ".lock", "is busy ({holder}): try later", wait_for_holder=0.1):
            pytest.fail("the lock is held")
    assert str(e.value) == f"{log} is busy (pid not recorded): try later"
    assert sorted(os.listdir(log)) == before  # a refused lock writes nothing

    waits = []

    def holder_writes_its_record(seconds):  # while the second run waits, the holder catches up
        waits.append(seconds)
        write_record(os.getpid())
    monkeypatch.setattr(common.time, "sleep", holder_writes_its_record)
    # through train_gpt2: the log dir's wording, naming the live holder once its record is there
    with pytest.raises(common.UsageError) as e:
        with tg.lock_log_dir(str(log)):
            pytest.fail("the lock is held")
    live = f"pid {os.getpid()} on {host}, since 2024-05-01 12:00:00: python train_gpt2.py --log_dir log"
    assert str(e.value) == f"{log} is in use by a live run ({live}): wait for it to end, or choose another --log_dir"
    assert len(waits) == 1  # it waited for the record rather than naming what was there
    holder.release()

    # once free: the holder's record names this process while held, and goes with the lock
    with tg.lock_log_dir(str(log)):
        assert json.loads(record.read_text())["pid"] == os.getpid()
    assert not record.exists()
    free = filelock.FileLock(str(log / ".lock"), thread_local=False, is_singleton=False)
    free.acquire(timeout=0)
    free.release()


def test_keep_last_never_deletes_the_checkpoint_it_just_saved(reference, tmp_path):
    # roll back to an earlier checkpoint (say, before a loss spike) in a dir that has later ones
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    back = tg.find_checkpoints(log)[0]
    r = run_cli("--resume", back, "--log_dir", log, "--device", "cpu", "--keep_last", "1", "--stop_step",
                str(torch.load(back, weights_only=False)["step"] + 2))
    assert r.returncode == 0, r.stderr
    saved = [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("saved ")]
    assert saved and os.path.exists(saved[-1])
    assert tg.read_checkpoint(saved[-1])  # and readable


def test_rollback_sets_later_checkpoints_aside(reference, tmp_path):
    # the steps after a rolled-back-to checkpoint are kept, byte for byte, out of the way of the new run
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    found, old_log = tg.find_checkpoints(log), read_text(os.path.join(log, "log.txt"))
    later = {os.path.basename(p): open(p, "rb").read() for p in found[1:]}
    back, step = found[0], torch.load(found[0], weights_only=False)["step"]
    r = run_cli("--resume", back, "--log_dir", log, "--device", "cpu", "--stop_step", str(step + 2))
    assert r.returncode == 0, r.stderr
    aside = os.path.join(log, f"after_step_{step:05d}")
    assert f"{len(later)} later checkpoint(s) and a copy of log.txt moved to {aside}" in r.stdout
    assert {name: open(os.path.join(aside, name), "rb").read() for name in later} == later
    assert read_text(os.path.join(aside, "log.txt")) == old_log
    assert [tg.checkpoint_step(p) for p in tg.find_checkpoints(log)] == [step, step + 1]
    # --resume latest continues the new line of steps; a second rollback gets a folder of its own
    assert tg.find_resume_checkpoint("latest", log, print)[1]["step"] == step + 1
    r = run_cli("--resume", back, "--log_dir", log, "--device", "cpu", "--stop_step", str(step + 2))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(aside + "_2")) == ["log.txt", os.path.basename(tg.checkpoint_path(log, step + 1))]


def test_resume_flags_checked_against_the_checkpoint(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, **{"--val_tokens": None, "--sample_every": "0", "--max_steps": "4"}),
                "--val_steps", "1", "--stop_step", "2")
    assert r.returncode == 0, r.stderr
    at = newest_step(log)
    before = dir_bytes(log)
    # a resume that would train nothing (a stop or an end at or before the checkpoint) is a mistake, not a no-op
    for flags in (["--stop_step", str(at + 1)], ["--max_steps", str(at)]):
        assert_one_line_error(run_cli(*resume_args(log), *flags), "nothing to train")
        assert dir_bytes(log) == before
    # the warmup warning is about the run as it goes on: the checkpoint's --max_steps, not the default's
    # --val_tokens given now replaces the checkpoint's --val_steps (they set one number), not dropped in silence
    r = run_cli(*resume_args(log), "--warmup_steps", "6", "--val_tokens", "128")
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("warning:") and "--warmup_steps" in line for line in r.stdout.splitlines()), r.stdout
    saved = json.load(open(os.path.join(log, "run_config.json")))
    assert saved["val_tokens"] == 128 and saved["val_steps"] is None
