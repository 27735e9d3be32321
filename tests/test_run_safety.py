"""What keeps a run safe, tested as a hostile user and a hostile machine would: two runs into one
log dir, kill -9 mid-run and mid-save, signals, divergence, a full disk, a rollback, damaged
checkpoints, logs and shards, and failures in the every-N blocks after training started. Each
interrupted run, resumed, must give the uninterrupted reference run's log.txt to the last digit.

Runs are the tiny run, in this process, except where a real second process is the point (the
concurrent start, the kill -9s, the signals): those run tests/hooks.py, which holds or pauses the
run at a chosen point so that no timing is involved."""
import errno
import json
import os
import re
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
import rundir
import settings
import train_gpt2 as tg
from helpers import (HANG_LIMIT_S, HOOKS, SAVES, assert_one_line_error, dir_bytes, log_of,
                     newest_step, output, read_text, resume_args, run_args, run_cli, series,
                     start_hooked, torchrun, wait_until, write_corpus_jsonl, write_shards)


def steps_saved(log):
    return [rundir.checkpoint_step(p) for p in rundir.find_checkpoints(log)]


def no_temp_files(log):
    return not [name for name in os.listdir(log) if name.endswith(".tmp")]


# ---------------------------------------------------------------------------------- the test hooks

def test_the_hooks_find_what_they_replace(monkeypatch, capsys):
    """tests/hooks.py (what start_hooked runs) checks every function it replaces before the run
    starts: on this tree all are there; one renamed, or a mode misspelt, stops the hooked run with
    one line naming it instead of running it unhooked."""
    import hooks

    real = hooks.check_targets()
    assert real["append_log"] is rundir.append_log and real["sample_texts"] is tg.sample_texts
    assert real["next_batch"] is tg.DataLoaderLite.next_batch
    assert set(hooks.HOOKS) == {"hold_after_log", "pause_after_log", "pause_mid_save", "hold_lock",
                                "slow_samples", "fail_batch", "hold_batch", "rank0_last",
                                "refuse_alone"}
    assert real["outlived_the_launcher"] is common.outlived_the_launcher
    assert real["handle"] is rundir.StopSignals.handle
    monkeypatch.setenv("HOOK_MODE", "hold_afterlog")
    assert hooks.main() == 2
    assert capsys.readouterr().err == ("error: tests/hooks.py: no hook 'hold_afterlog'; there are "
                                       f"{sorted(hooks.HOOKS)}\n")
    monkeypatch.setenv("HOOK_MODE", "slow_samples")  # any mode: every target is checked
    monkeypatch.delattr(rundir, "append_log")
    assert hooks.main() == 2
    assert capsys.readouterr().err == ("error: tests/hooks.py: rundir.append_log is gone "
                                       "(renamed?); update the hook\n")
    monkeypatch.undo()
    monkeypatch.setattr(rundir, "atomic_write", lambda path, f, size=None: None)
    with pytest.raises(hooks.HookTargetMissing, match=r"rundir.atomic_write takes \('path', 'f', "
                       r"'size'\), the hook passes \('path', 'write', 'size'\)"):
        hooks.check_targets()


# ------------------------------------------------------------------------------- the log dir's lock

@pytest.mark.slow
def test_two_runs_started_at_once_into_one_empty_dir(data, tmp_path):
    log, gate, release = str(tmp_path / "log"), tmp_path / "gate", tmp_path / "release"
    args = run_args(data, log, "--sample_every", "0", "--max_steps", "3")
    procs = [start_hooked(tmp_path, f"run{i}", args, gate=gate, mode="hold_lock", arg=release)
             for i in range(2)]
    gate.touch()  # both go for the lock at the same moment
    # the run that claimed the dir waits (hold_lock) until the other has given up: no timing
    wait_until(lambda: any(p.poll() is not None for p in procs), [], "one run gave up")
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    release.touch()
    assert winner.wait(timeout=HANG_LIMIT_S) == 0, output(winner)[1]
    out, err = output(loser)
    r = subprocess.CompletedProcess([], loser.returncode, out, err)
    line = assert_one_line_error(r, "in use by a live run", f"pid {winner.pid} ")
    # refused at the claim (its error says so), before the run config is printed: nothing done
    assert "run config" not in out, out
    assert series(log)["train"][0] == list(range(3)), line  # one run's lines, once


def test_the_run_that_lost_the_race_for_a_new_log_dir_leaves_the_winners_files(tmp_path,
                                                                              monkeypatch):
    # the slow test above, made certain: the run refused the lock had found the dir missing and
    # made it, a moment before the other run took the lock
    log = tmp_path / "log"
    run = types.SimpleNamespace(log_dir=str(log), overwrite=False, as_dict=dict)  # what it reads
    one = common.Proc(environ={})  # a run of one process: the master
    winner = rundir.claim_log_dir(run, None, one)
    before = {name: (log / name).read_bytes() for name in os.listdir(log)}
    assert set(before) == {".lock", ".lock.holder", "log.txt", "run_config.json"}
    exists, makedirs = os.path.exists, os.makedirs
    monkeypatch.setattr(rundir.os.path, "exists", lambda p: p != str(log) and exists(p))
    monkeypatch.setattr(rundir.os, "makedirs",
                        lambda p, *a, **k: None if p == str(log) else makedirs(p, *a, **k))
    with pytest.raises(common.UsageError, match="is in use by a live run"):
        rundir.claim_log_dir(run, None, one)
    monkeypatch.undo()
    assert {name: (log / name).read_bytes() for name in os.listdir(log)} == before

    winner.abandon()  # ending before its first step, the winner takes away all it made
    assert not log.exists()


@pytest.mark.slow
def test_kill_9_mid_save_and_mid_run_then_resume_is_bit_exact(data, reference, tmp_path):
    # two victims side by side (each pays for its own torch import): one paused inside a
    # checkpoint save, its temp file written but not renamed; one paused mid-run, its log ahead of
    # its newest checkpoint
    save_log, run_log = str(tmp_path / "mid_save"), str(tmp_path / "mid_run")
    mid_save = start_hooked(tmp_path, "mid_save", run_args(data, save_log, *SAVES),
                            mode="pause_mid_save", arg="model_00004.pt",
                            marker=tmp_path / "paused_mid_save")
    mid_run = start_hooked(tmp_path, "mid_run", run_args(data, run_log, *SAVES),
                           mode="pause_after_log", arg="5 train",
                           marker=tmp_path / "paused_mid_run")
    try:
        wait_until(lambda: (tmp_path / "paused_mid_save").exists()
                   and (tmp_path / "paused_mid_run").exists(), [mid_save, mid_run], "both pauses")
        before = dir_bytes(save_log)
        assert not no_temp_files(save_log)  # the half-saved checkpoint, under its temp name
        # a second run into the live dir, as a user retrying too early would: refused, naming the
        # live pid
        for extra in (resume_args(save_log), run_args(data, save_log, *SAVES, "--overwrite")):
            assert_one_line_error(run_cli(*extra), "in use by a live run", f"pid {mid_save.pid} ")
        assert dir_bytes(save_log) == before  # byte for byte: not even the stale temp file
    finally:
        for proc in (mid_save, mid_run):
            proc.kill()  # SIGKILL: no handler, no clean-up, as the OOM killer or a node failure
            proc.wait()
    assert mid_save.returncode == mid_run.returncode == -signal.SIGKILL
    # the log ran ahead of the newest checkpoint: the resume must cut it
    assert series(run_log)["train"][0][-1] > newest_step(run_log)

    # the OS released the locks with the processes: resuming needs no manual clean-up
    for log in (save_log, run_log):
        r = run_cli(*resume_args(log))
        assert r.returncode == 0, r.stderr
        assert "resumed from" in r.stdout
        assert no_temp_files(log)  # the crash's temp file is gone
        assert log_of(log) == log_of(reference)
        assert sorted(os.listdir(log)) == sorted(os.listdir(reference))


@pytest.mark.parametrize("left_in_file", ["missing", "garbled", "killed"])
def test_lock_message_names_the_live_holder_not_a_stale_or_missing_record(tmp_path, monkeypatch,
                                                                          left_in_file):
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
    # the instant after a new holder took the lock and before it wrote its record over a killed
    # run's one
    holder = filelock.FileLock(str(log / ".lock"), thread_local=False, is_singleton=False)
    holder.acquire(timeout=0)
    if left_in_file == "killed":
        write_record(dead)
    elif left_in_file == "garbled":
        record.write_text('{"pid": ')  # half a record, as an editor or a copy would leave it
    before = sorted(os.listdir(log))

    # common.dir_lock itself: no live record within the wait, so none is named (the dead pid
    # least of all)
    with pytest.raises(common.UsageError) as e:
        with common.dir_lock(str(log), ".lock", "is busy ({holder}): try later",
                             wait_for_holder=0.1):
            pytest.fail("the lock is held")
    assert str(e.value) == f"{log} is busy (pid not recorded): try later"
    assert sorted(os.listdir(log)) == before  # a refused lock writes nothing

    waits = []

    def holder_writes_its_record(seconds):  # while the second run waits, the holder catches up
        waits.append(seconds)
        write_record(os.getpid())
    monkeypatch.setattr(common.time, "sleep", holder_writes_its_record)
    # a run's claim on its log dir: the log dir's wording, naming the live holder once its record
    # is there
    run = types.SimpleNamespace(log_dir=str(log), overwrite=False, as_dict=dict)  # what it reads
    one = common.Proc(environ={})  # a run of one process: the master
    with pytest.raises(common.UsageError) as e:
        rundir.claim_log_dir(run, None, one)
    live = (f"pid {os.getpid()} on {host}, since 2024-05-01 12:00:00: python train_gpt2.py "
            f"--log_dir log")
    assert str(e.value) == (f"{log} is in use by a live run ({live}): wait for it to end, or "
                            f"choose another --log_dir")
    assert len(waits) == 1  # it waited for the record rather than naming what was there
    holder.release()

    # once free: the holder's record names this process while held, and goes with the lock
    with rundir.claim_log_dir(run, None, one):
        assert json.loads(record.read_text())["pid"] == os.getpid()
    assert not record.exists()
    free = filelock.FileLock(str(log / ".lock"), thread_local=False, is_singleton=False)
    free.acquire(timeout=0)
    free.release()


# ------------------------------------------------------------------------------------------ signals

# SIGTERM: in test_a_stop_signal_in_a_sample_block_stops_at_once and the torchrun tests below;
# SIGINT: in test_a_second_ctrl_c_leaves_at_once
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1])
def test_a_signal_saves_the_step_and_the_resume_is_exact(data, reference, tmp_path, sig):
    # held while logging step 4 (its update done, its checkpoint next), the run is signalled: one
    # process stops before step 5 does anything, step 4 saved
    log = str(tmp_path / "log")
    proc = start_hooked(tmp_path, "run", run_args(data, log), mode="hold_after_log", arg="4 train",
                        marker=tmp_path / "held", release=tmp_path / "release")
    wait_until(lambda: (tmp_path / "held").exists(), [proc], "the hold at step 4")
    proc.send_signal(sig)  # as Slurm, a scheduler or Ctrl-C would: mid-step
    (tmp_path / "release").touch()
    assert proc.wait(timeout=HANG_LIMIT_S) == 128 + sig
    out, err = output(proc)
    assert "Traceback" not in err
    name = signal.Signals(sig).name
    assert (f"stopped by {name} at step 5; {rundir.checkpoint_path(log, 4)} holds step 4: "
            f"continue with python train_gpt2.py --resume latest --log_dir {log}") in out
    assert newest_step(log) == 4 and no_temp_files(log)
    r = run_cli(*resume_args(log))  # the lock went with the process
    assert r.returncode == 0, r.stderr
    assert log_of(log) == log_of(reference)


# the tiny run's steps in micro-steps of 16 tokens, a checkpoint every 2 steps
ACCUMULATING = ("-B", "1", "-T", "16", *SAVES)


def final_weights(log):
    return torch.load(rundir.find_checkpoints(log)[-1], weights_only=True)["model"]


def assert_same_weights(a, b):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def signal_when_held(proc, held, release, sig, pid=None):
    """Once the hook holds (writing `held`), send sig (to the held process, or pid), wait for
    rank 0's handler to say it will stop at the next micro-step, then let the run go on."""
    wait_until(held.exists, [proc], "the hold mid-step")
    os.kill(pid or int(held.read_text()), sig)
    wait_until(lambda: "stopping at the next micro-step" in output(proc)[1], [proc],
               "the handler's line")
    release.touch()


@pytest.mark.slow
def test_a_signal_mid_accumulation_drops_the_step_and_the_resume_is_exact(data, tmp_path):
    """Four micro-steps a step; held inside step 4's second one (its batch read) the run gets
    SIGTERM: it stops at the next micro-step, step 4 dropped (no update, no log line), and saves
    step 3, which was not due a checkpoint, with the loader and random generators as step 3 left
    them. Resumed, it gives the uninterrupted run's log.txt and final weights to the last bit."""
    reference = str(tmp_path / "reference")
    r = run_cli(*run_args(data, reference, *ACCUMULATING))
    assert r.returncode == 0, r.stderr
    log, held, release = str(tmp_path / "log"), tmp_path / "held", tmp_path / "release"
    proc = start_hooked(tmp_path, "run", run_args(data, log, *ACCUMULATING), mode="hold_batch",
                        arg="0 18", marker=held, release=release)  # step 4 (calls 17-20), 2nd
    try:
        signal_when_held(proc, held, release, signal.SIGTERM)
        assert proc.wait(timeout=300) == 128 + signal.SIGTERM
    finally:
        proc.kill()  # a test that failed leaves no process behind
    out, err = output(proc)
    assert "Traceback" not in err, err
    assert (f"stopped by SIGTERM at step 4; {rundir.checkpoint_path(log, 3)} holds step 3: "
            f"continue with python train_gpt2.py --resume latest --log_dir {log}") in out
    assert steps_saved(log) == [2, 3] and no_temp_files(log)
    assert max(series(log)["train"][0]) == 3  # nothing of step 4 logged
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert log_of(log) == log_of(reference)
    assert_same_weights(log, reference)


@pytest.mark.slow
def test_a_second_ctrl_c_leaves_at_once(data, tmp_path):
    log = str(tmp_path / "log")
    proc = start_hooked(tmp_path, "run", run_args(data, log, *SAVES), mode="hold_after_log",
                        arg="4 train", marker=tmp_path / "held", release=tmp_path / "never")
    try:
        wait_until(lambda: (tmp_path / "held").exists(), [proc], "the hold at step 4")
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "SIGINT: stopping at the next micro-step" in output(proc)[1], [proc],
                   "the first Ctrl-C's line")
        proc.send_signal(signal.SIGINT)  # the hold never ends: only the second Ctrl-C can end it
        assert proc.wait(timeout=HANG_LIMIT_S) == 130
    finally:
        proc.kill()  # a test that failed leaves no process behind
    out, err = output(proc)
    assert "Traceback" not in err and "SIGINT again: leaving now" in err
    # what was saved before stays (step 4 was not saved yet); nothing half-written
    assert newest_step(log) == 2 and no_temp_files(log)


TWO_RANKS = (*ACCUMULATING, "--sample_every", "0")  # two micro-steps a step on each rank


@pytest.fixture(scope="module")
def two_rank_reference(data, tmp_path_factory):
    """The tiny run in two ranks of two micro-steps each, without samples, uninterrupted: the log
    dir two-rank runs that are stopped and resumed must reproduce."""
    log = str(tmp_path_factory.mktemp("two_ranks") / "log")
    r = torchrun(*run_args(data, log, *TWO_RANKS))
    assert r.returncode == 0, r.stderr
    return log


@pytest.mark.slow
def test_torchrun_stops_on_a_signal_to_one_rank_or_to_the_launcher(data, two_rank_reference,
                                                                    tmp_path):
    """Two ranks, stopped twice, then resumed: SIGTERM to rank 0 alone, held before step 4's last
    micro-step: both ranks finish step 4 (the step's read-back is where they learn of it), save it
    once, exit 143, no hang. Resumed, the sample block of step 6 would run for minutes on both
    ranks: SIGTERM to the launcher, which forwards it to the workers, ends the run in seconds with
    step 5 saved. The last resume gives the uninterrupted two-rank run's log."""
    log = str(tmp_path / "log")

    def hooked_torchrun(hook_env, *extra):
        return torchrun(*run_args(data, log, *TWO_RANKS, *extra), script=HOOKS, env=hook_env,
                        wait=False)

    hold = {"HOOK_MODE": "hold_batch", "HOOK_ARG": "0 10",  # rank 0's step 4 (calls 9-10)
            "HOOK_MARKER": str(tmp_path / "held"), "HOOK_RELEASE": str(tmp_path / "release")}
    run = hooked_torchrun(hold)
    wait_until(lambda: (tmp_path / "held").exists(), [], "rank 0's hold in step 4")
    assert run.poll() is None
    os.kill(int((tmp_path / "held").read_text()), signal.SIGTERM)  # rank 0 alone gets the signal
    (tmp_path / "release").touch()
    out, err = run.communicate(timeout=HANG_LIMIT_S)
    assert run.returncode != 0 and 'train_gpt2.py", line' not in err, err  # torchrun's report only
    assert "stopped by SIGTERM after step 4" in out  # seen at the next step's read-back, by all
    assert "exitcode  : 143" in err or "143" in err
    assert newest_step(log) == 4 and steps_saved(log).count(4) == 1

    slow = {"HOOK_MODE": "slow_samples", "HOOK_MARKER": str(tmp_path / "sampling")}
    run = hooked_torchrun(slow, "--resume", "latest", "--sample_every", "6")
    try:
        wait_until(lambda: (tmp_path / "sampling").exists(), [], "the sample block of step 6")
        run.send_signal(signal.SIGTERM)  # the blocks sleep 300 s: only an interrupt ends them
        out, err = run.communicate(timeout=HANG_LIMIT_S)
    finally:
        run.kill()
    assert "stopped by SIGTERM at step 6" in out, out + err
    assert run.returncode == 1  # torchrun's own status after a SIGTERM, as the README says
    assert steps_saved(log)[-1] == 5

    resumed = hooked_torchrun({}, "--resume", "latest")
    out, err = resumed.communicate(timeout=HANG_LIMIT_S)
    assert resumed.returncode == 0, err
    assert log_of(log) == log_of(two_rank_reference)


@pytest.mark.slow
def test_torchrun_drops_the_step_a_signal_to_one_rank_comes_in(data, two_rank_reference,
                                                                tmp_path):
    """Two ranks of two micro-steps a step: rank 0 alone gets SIGTERM while held in step 4's
    first micro-step; rank 1 waits at the vote before its second. Both stop there, step 4
    dropped, step 3 saved once, exit 143, no hang; resumed, the run gives the uninterrupted
    two-rank run's log.txt and final weights to the last bit."""
    log, held, release = str(tmp_path / "log"), tmp_path / "held", tmp_path / "release"
    hold = {"HOOK_MODE": "hold_batch", "HOOK_ARG": "0 9", "HOOK_MARKER": str(held),
            "HOOK_RELEASE": str(release)}  # rank 0's step 4 (calls 9-10), its first micro-step
    run = torchrun(*run_args(data, log, *TWO_RANKS), script=HOOKS, env=hold,
                   files=(tmp_path, "run"))
    try:
        signal_when_held(run, held, release, signal.SIGTERM)
        assert run.wait(timeout=300) != 0
    finally:
        run.kill()
    out, err = output(run)
    assert 'train_gpt2.py", line' not in err, err  # torchrun's report only
    assert "exitcode  : 143" in err or "143" in err
    assert f"stopped by SIGTERM at step 4; {rundir.checkpoint_path(log, 3)} holds step 3" in out
    assert steps_saved(log) == [2, 3]
    resumed = torchrun(*run_args(data, log, *TWO_RANKS, "--resume", "latest"))
    assert resumed.returncode == 0, resumed.stderr
    assert log_of(log) == log_of(two_rank_reference)
    assert_same_weights(log, two_rank_reference)


# --------------------------------------------------------------------------------------- divergence

def checkpoints_are_finite(log):
    for path in rundir.find_checkpoints(log):
        assert rundir.non_finite(torch.load(path, weights_only=False)["model"]) is None, path


def test_divergence_keeps_the_last_finite_step_and_stops_before_the_update(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--max_lr", "1e4", "--warmup_steps", "0",
                          "--max_steps", "40", "--eval_every", "0", "--sample_every", "0"))
    line = assert_one_line_error(r, "the run diverged and stopped before this update",
                                 "lower --max_lr or raise --warmup_steps")
    m = re.match(r"error: step (\d+) failed \(the loss is (\S+) and the gradient norm (\S+):", line)
    assert m, line
    step = int(m.group(1))
    assert "nan" in (m.group(2), m.group(3)) or "inf" in (m.group(2), m.group(3)), line
    assert 0 < step < 39  # a huge LR: diverged within a few steps, not trained on to the end
    # --save_every 0: the one checkpoint is the last finished step's, saved when the run stopped
    assert steps_saved(log) == [step - 1]
    checkpoints_are_finite(log)
    path = rundir.checkpoint_path(log, step - 1)
    assert line.endswith(f"; {path} holds step {step - 1}: continue with --resume latest")
    assert series(log)["train"][0][-1] == step - 1  # nothing logged of the step that diverged


def test_a_finite_spike_trains_on_and_an_infinite_loss_stops(data, tmp_path, monkeypatch):
    real_forward = tg.GPT.forward
    scale = {"value": 1.0}

    def forward(self, idx, targets=None, **kw):
        logits, loss = real_forward(self, idx, targets, **kw)
        return logits, (loss * scale["value"] if loss is not None else None)
    monkeypatch.setattr(tg.GPT, "forward", forward)
    scale["value"] = 1e10  # a spike of ten orders of magnitude, still finite: not an error
    r = run_cli(*run_args(data, str(tmp_path / "spike"), "--max_steps", "3", "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    scale["value"] = float("inf")
    r = run_cli(*run_args(data, str(tmp_path / "inf"), "--max_steps", "3", "--sample_every", "0"))
    line = assert_one_line_error(r, "error: step 0 failed (the loss is inf")
    assert "holds step" not in line  # no step finished: nothing to continue from
    assert rundir.find_checkpoints(str(tmp_path / "inf")) == []


def test_a_nan_checkpoint_is_skipped_on_resume(reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    newest = rundir.find_checkpoints(log)[-1]
    ckpt = torch.load(newest, weights_only=False)
    ckpt["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    ckpt["step"] += 1  # as if a diverged run had written it (ours never does)
    bad = rundir.checkpoint_path(log, ckpt["step"])
    torch.save(ckpt, bad)
    r = run_cli(*resume_args(log, "--max_steps", "10"))
    assert r.returncode == 0, r.stderr
    skipped = [line for line in r.stdout.splitlines() if line.startswith("warning: skipping")]
    assert len(skipped) == 1 and bad in skipped[0] and "NaN or inf" in skipped[0]
    assert f"resumed from {newest}" in r.stdout
    # the step it was resumed from is the newest again: the NaN file was set aside
    assert os.path.exists(os.path.join(log, "after_step_00007", os.path.basename(bad)))
    checkpoints_are_finite(log)


# -------------------------------------------------------------------- failures after the first step

def failing(monkeypatch, owner, name, error, fail_on_call):
    """owner.name raising error on its fail_on_call-th call."""
    calls = []
    real = getattr(owner, name)

    def fake(*a, **k):
        calls.append(1)
        if len(calls) == fail_on_call:
            raise error
        return real(*a, **k)
    monkeypatch.setattr(owner, name, fake)
    return []


def failing_wandb(monkeypatch, fail_at_step):
    """A W&B run whose log() fails at one step, or (None) whose finish() fails: its server went
    away, say (ConnectionError is an OSError)."""
    class Run:
        def log(self, values, step):
            if step == fail_at_step:
                raise ConnectionError("W&B server exploded")

        def finish(self):
            if fail_at_step is None:
                raise ConnectionError("W&B server exploded")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run()))
    return ["--wandb_project", "hostile"]


def failing_hellaswag(monkeypatch, fail_on_call):
    """HellaSwag every 3 steps, with data said to be there and an evaluate() that has a bug."""
    import hellaswag
    monkeypatch.setattr(hellaswag, "ready_on_every_rank", lambda *a, **k: True)
    monkeypatch.setattr(hellaswag, "evaluate",
                        lambda *a, **k: {"n": 4, "correct_norm": 1, "acc_norm": 0.25})
    failing(monkeypatch, hellaswag, "evaluate", TypeError("hellaswag exploded"), fail_on_call)
    return ["--hellaswag_every", "3"]


# (what breaks, the step that fails, the last finished step, its exception or None for one line).
# Samples run at steps 3 and 6 and on the final model (step 8); checkpoints are written at 2, 4, 6
# and 7: a failure at step 6 must first save step 5.
BREAKS = {
    "samples-bug": (lambda m: failing(m, tg, "sample_texts", RuntimeError("sampler exploded"), 2),
                    6, 5, RuntimeError),
    "final-samples-bug": (lambda m: failing(m, tg.GPT, "generate",
                                            RuntimeError("sampler exploded"), 3), 8, 7,
                          RuntimeError),
    "hellaswag-bug": (lambda m: failing_hellaswag(m, 3), 6, 5, TypeError),
    "samples-oserror": (lambda m: failing(m, tg, "sample_texts",
                                          OSError(errno.EIO, "sampler exploded"), 2), 6, 5, None),
    "wandb-log": (lambda m: failing_wandb(m, 5), 5, 5, None),
    "wandb-finish": (lambda m: failing_wandb(m, None), 8, 7, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BREAKS))
def test_a_failure_after_training_started_keeps_the_last_step(data, reference, tmp_path,
                                                               monkeypatch, case):
    """A failure in an every-N block, in logging or in W&B: the last finished step is saved
    first. An error of the environment (an OSError) is one line naming that checkpoint; a bug
    keeps its traceback after a line naming it. Resumed, the run gives the reference's log."""
    break_it, step, kept, bug = BREAKS[case]
    log = str(tmp_path / "log")
    with monkeypatch.context() as m:
        r = run_cli(*run_args(data, log, *break_it(m)))
    path = rundir.checkpoint_path(log, kept)
    saved = f"{path} holds step {kept}: continue with --resume latest"
    if bug is None:
        line = assert_one_line_error(r, f"error: step {step} failed (", "exploded")
        assert line.endswith(f"); {saved}"), line
    else:
        assert r.returncode == 1 and isinstance(r.exception, bug), r.stderr
        assert "exploded" in str(r.exception)
        assert f"\nerror at step {step}; {saved}\nTraceback" in "\n" + r.stderr, r.stderr
    assert newest_step(log) == kept == series(log)["train"][0][-1]  # nothing trained was lost
    checkpoints_are_finite(log)
    if case.startswith("hellaswag"):
        return  # its log has HellaSwag lines the reference has not
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    # the resumed run does what the failed one did not: for the final evaluation, all that is left
    assert log_of(log) == log_of(reference)


# -------------------------------------------------------------------------------------- a full disk

def no_space(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_keeps_the_earlier_ones_and_resumes(data, reference, tmp_path,
                                                                        monkeypatch):
    log = str(tmp_path / "log")
    real_write = rundir.atomic_write

    def atomic_write(path, write, size=None):
        if os.path.basename(path) == "model_00004.pt":
            raise no_space(path)
        real_write(path, write, size)
    monkeypatch.setattr(rundir, "atomic_write", atomic_write)
    r = run_cli(*run_args(data, log, *SAVES))
    line = assert_one_line_error(r, "model_00004.pt", "no space left")
    # the failed save is not retried into a second error: the line names what to continue from
    assert line.startswith("error: step 4 failed (")
    assert line.endswith(f"{rundir.checkpoint_path(log, 2)} holds step 2: continue with --resume "
                         f"latest")
    assert steps_saved(log) == [2]
    monkeypatch.setattr(rundir, "atomic_write", real_write)  # space freed
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr + line
    assert log_of(log) == log_of(reference)


@pytest.mark.slow
def test_a_full_disk_under_log_txt_and_the_lock_is_one_line(data, tmp_path, monkeypatch):
    real_append = rundir.append_log

    def append_log(path, step, kind, value):
        if step == 3:
            raise no_space(path)
        real_append(path, step, kind, value)
    monkeypatch.setattr(rundir, "append_log", append_log)
    log = str(tmp_path / "log")
    line = assert_one_line_error(run_cli(*run_args(data, log)), "error: step 3 failed (",
                                 "log.txt", "no space left")
    # the last step taken (2) was saved already, by --save_every 2
    assert line.endswith(f"{rundir.checkpoint_path(log, 2)} holds step 2: continue with "
                         f"--resume latest")
    assert steps_saved(log) == [2]
    monkeypatch.undo()

    def lock_write(path, write, size=None):  # the lock's holder record, the first file a run writes
        raise no_space(path)
    monkeypatch.setattr(common, "atomic_write", lock_write)
    log2 = str(tmp_path / "log2")
    assert_one_line_error(run_cli(*run_args(data, log2)), f"--log_dir {log2}: cannot write there",
                          "no space")
    assert not os.path.exists(log2)  # the log dir it made goes: nothing of a run that never ran


def test_files_follow_the_umask(data, tmp_path):
    old = os.umask(0o002)
    try:
        log = str(tmp_path / "log")
        r = run_cli(*run_args(data, log, "--max_steps", "2", "--sample_every", "0"))
        assert r.returncode == 0, r.stderr
    finally:
        os.umask(old)
    for name in ("log.txt", "model_00001.pt", "run_config.json"):
        assert os.stat(os.path.join(log, name)).st_mode & 0o777 == 0o664, name


# ------------------------------------------------------------------------------ rollback, keep_last

def test_keep_last_never_deletes_the_checkpoint_it_just_saved(reference, tmp_path):
    # roll back to an earlier checkpoint (say, before a loss spike) in a dir that has later ones
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    back = rundir.find_checkpoints(log)[0]
    step = rundir.checkpoint_step(back)
    r = run_cli("--resume", back, "--log_dir", log, "--device", "cpu", "--keep_last", "1",
                "--stop_step", str(step + 2))
    assert r.returncode == 0, r.stderr
    saved = [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("saved ")]
    assert saved and os.path.exists(saved[-1])
    assert rundir.read_checkpoint(saved[-1])  # and readable


@pytest.mark.slow
def test_rollback_sets_later_checkpoints_aside(reference, tmp_path):
    # the steps after a rolled-back-to checkpoint are kept, byte for byte, out of the new run's way
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    found, old_log = rundir.find_checkpoints(log), read_text(os.path.join(log, "log.txt"))
    later = {os.path.basename(p): open(p, "rb").read() for p in found[1:]}
    back, step = found[0], rundir.checkpoint_step(found[0])
    r = run_cli("--resume", back, "--log_dir", log, "--device", "cpu", "--stop_step", str(step + 2))
    assert r.returncode == 0, r.stderr
    aside = os.path.join(log, f"after_step_{step:05d}")
    assert f"{len(later)} later checkpoint(s) and a copy of log.txt moved to {aside}" in r.stdout
    # the warning and the resume line name the same step: the first one this run takes
    assert f"resuming at step {step + 1}: " in r.stdout
    assert f"resumed from {back} at step {step + 1}" in r.stdout
    assert {name: open(os.path.join(aside, name), "rb").read() for name in later} == later
    assert read_text(os.path.join(aside, "log.txt")) == old_log
    assert steps_saved(log) == [step, step + 1]
    # --resume latest continues the new line of steps; a second rollback gets a folder of its own
    assert settings.resume_checkpoint("latest", log)[1]["step"] == step + 1
    r = run_cli("--resume", back, "--log_dir", log, "--device", "cpu", "--stop_step", str(step + 2))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(aside + "_2")) == \
        ["log.txt", os.path.basename(rundir.checkpoint_path(log, step + 1))]


# --------------------------------------------------------------------- damaged checkpoints and logs

def test_resume_from_a_broken_checkpoint_is_one_line(data, tmp_path):
    bad = tmp_path / "model_00003.pt"
    bad.write_bytes(b"not a checkpoint")
    r = run_cli(*run_args(data, str(tmp_path), "--resume", str(bad)))
    assert_one_line_error(r, str(bad), "not a readable checkpoint")


@pytest.mark.slow
def test_resume_skips_a_truncated_checkpoint_and_a_damaged_log_line(data, reference, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, *SAVES, "--stop_step", "6"))  # checkpoints 2, 4, 5 (the stop)
    assert r.returncode == 0, r.stderr
    newest = rundir.find_checkpoints(log)[-1]
    with open(newest, "r+b") as f:  # a copy cut short: not something atomic_write can prevent
        f.truncate(os.path.getsize(newest) // 2)
    with open(os.path.join(log, "log.txt"), "ab") as f:  # what a crash on some filesystems leaves
        f.write(b"\0" * 300 + b"5 val 4.2\n" + b"2 tr\0\0\0\n")
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert any(newest in line for line in warnings), r.stdout
    assert any("damaged line" in line for line in warnings), r.stdout
    assert log_of(log) == log_of(reference)


def test_old_and_foreign_checkpoints(reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    newest = rundir.find_checkpoints(log)[-1]
    ckpt = torch.load(newest, weights_only=False)
    del ckpt["tokens_seen"]  # written before the batch ramp: every step a full batch
    del ckpt["args"]["core_every"]  # and before CORE: a run without it (not --core_every 2000)
    torch.save(ckpt, newest)
    assert rundir.read_checkpoint(newest)["tokens_seen"] == 8 * 64
    r = run_cli(*resume_args(log, "--max_steps", "10"))
    assert r.returncode == 0, r.stderr
    with open(os.path.join(log, "run_config.json")) as f:
        assert json.load(f)["core_every"] == 0
    del ckpt["args"]
    torch.save(ckpt, newest)
    assert_one_line_error(run_cli("--resume", newest, "--log_dir", log, "--device", "cpu"),
                          newest, "no args")


# ------------------------------------------------------------------------------------- damaged data

def damage_truncated(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)


def damage_not_npy(path):
    with open(path, "wb") as f:
        f.write(b"<html>404 Not Found</html>\n" * 20)


def damage_token_id(path):
    tokens = np.load(path)
    tokens[17] = fineweb.GPT2_VOCAB_SIZE  # one past the last real GPT-2 token
    np.save(path, tokens)


def damage_dtype(path):
    np.save(path, np.load(path).astype(np.int32))  # ids all below the vocab, but 4 bytes each


@pytest.mark.parametrize("damage, split", [(damage_truncated, "train"), (damage_not_npy, "train"),
                                           (damage_token_id, "train"), (damage_dtype, "train"),
                                           (damage_truncated, "val")])
def test_damaged_shard_is_one_line_naming_the_file(tmp_path, damage, split):
    root = str(tmp_path / "data")
    write_shards(root, "val", [3000], seed=1)
    write_shards(root, "train", [2000, 1500], seed=2)
    bad = fineweb.list_shards(root, split)[-1]
    if damage is damage_token_id:  # ids are checked as windows are read: one the run reads
        bad = fineweb.list_shards(root, split)[0]
    damage(bad)
    r = run_cli(*run_args(root, str(tmp_path / "log")))
    assert_one_line_error(r, bad)


def interrupted_prep(tmp_path, monkeypatch):
    """A data dir whose prep died (as from kill -9) after 3 shards, from a local corpus: (dir,
    corpus, kwargs)."""
    corpus, root = str(tmp_path / "corpus.jsonl"), str(tmp_path / "data")
    write_corpus_jsonl(corpus, n_docs=60)
    kwargs = dict(inputs=[corpus], shard_size=600, val_tokens=300, num_proc=1, progress=False)
    real_write = fineweb.atomic_write

    def crash_on_shard_3(path, write, size=None):
        if path.endswith("_000003.npy"):
            raise KeyboardInterrupt
        real_write(path, write, size)
    with monkeypatch.context() as m:
        m.setattr(fineweb, "atomic_write", crash_on_shard_3)
        with pytest.raises(KeyboardInterrupt):
            fineweb.prepare(root, **kwargs)
    assert not fineweb.prep_status(root).complete
    return root, corpus, kwargs


@pytest.mark.slow
def test_unfinished_prep_is_finished_from_its_source(tmp_path, monkeypatch):
    root, corpus, kwargs = interrupted_prep(tmp_path, monkeypatch)
    # no --input now: the manifest names the source
    r = run_cli(*run_args(root, str(tmp_path / "log"), "--max_steps", "1", "--eval_every", "0",
                          "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    assert fineweb.prep_status(root).complete
    whole = str(tmp_path / "whole")  # the same prep, never interrupted
    fineweb.prepare(whole, **kwargs)
    shards = {name for name in dir_bytes(whole) if name != fineweb.MANIFEST}
    assert {name for name in dir_bytes(root) if name != fineweb.MANIFEST} == shards
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


# ---------------------------------------------------- checkpoints hold data: no code runs from one

def with_code_inside(src, dest, marker):
    """A copy of checkpoint src whose pickle, loaded trustingly, would create `marker`."""

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = torch.load(src, weights_only=True)
    ckpt["val_loss"] = Planted()
    torch.save(ckpt, dest)
    return dest


def test_a_checkpoint_that_would_run_code_is_refused_by_every_command(reference, tmp_path):
    marker = tmp_path / "ran"
    planted = with_code_inside(rundir.checkpoint_path(reference, 7), tmp_path / "model_00007.pt",
                               marker)
    commands = [["sample", "--checkpoint", str(planted), "--device", "cpu"],
                ["export", "--checkpoint", str(planted), "--out", str(tmp_path / "out")],
                ["eval", "--checkpoint", str(planted), "--device", "cpu"],
                ["--resume", str(planted), "--log_dir", str(tmp_path), "--device", "cpu"]]
    for args in commands:
        assert_one_line_error(run_cli(*args), str(planted), "not a safe checkpoint",
                              "posix.system", "nothing from it ran")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_resume_latest_skips_a_checkpoint_that_would_run_code(data, reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    for step in (6, 7):  # the newest two: --resume latest must fall back to step 4
        os.remove(rundir.checkpoint_path(log, step))
    with_code_inside(rundir.checkpoint_path(log, 4), rundir.checkpoint_path(log, 5),
                     tmp_path / "ran")
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert "warning: skipping" in r.stdout and "model_00005.pt is not a safe checkpoint" in r.stdout
    assert not (tmp_path / "ran").exists()
    assert log_of(log) == log_of(reference)


def test_a_checkpoint_with_numpy_arrays_inside_still_resumes(reference, tmp_path):
    # the layout before every value was a tensor, list or number: numpy's RNG state as an array
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    path = rundir.checkpoint_path(log, 4)
    ckpt = torch.load(path, weights_only=True)
    name, keys, pos, has_gauss, cached = ckpt["rng"]["numpy"]
    ckpt["rng"]["numpy"] = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    torch.save(ckpt, path)
    r = run_cli("--resume", path, "--log_dir", log, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert log_of(log) == log_of(reference)


# --------------------------------------------------- a stop signal outside a step: at once, saved

@pytest.mark.slow
def test_a_stop_signal_in_a_sample_block_stops_at_once(data, reference, tmp_path, monkeypatch):
    # the samples of step 6 would take 5 minutes: the signal ends them, step 5 is saved
    log = str(tmp_path / "log")

    def slow_samples(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption would, mid-block
        for _ in range(3000):
            time.sleep(0.1)
        raise AssertionError("the sample block was not interrupted")
    monkeypatch.setattr(tg, "sample_texts", slow_samples)
    r = run_cli(*run_args(data, log, *SAVES, "--sample_every", "6"))
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert (f"stopped by SIGTERM at step 6; {rundir.checkpoint_path(log, 5)} holds step 5: "
            f"continue with python train_gpt2.py --resume latest --log_dir {log}") in r.stdout
    assert steps_saved(log) == [2, 4, 5] and no_temp_files(log)
    monkeypatch.undo()
    assert run_cli(*resume_args(log)).returncode == 0
    assert log_of(log) == log_of(reference)


def child_pids(pid):
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")


@pytest.mark.skipif(sys.platform != "linux", reason="a worker learns of its launcher's death "
                                                     "from Linux's parent-death signal")
@pytest.mark.slow
def test_a_launcher_killed_by_sigusr1_leaves_no_worker_behind(data, tmp_path):
    """torchrun does not handle SIGUSR1 by default and dies of it: its workers stop after their
    step, save it together and exit, instead of training on as orphans."""
    log = str(tmp_path / "log")
    run = torchrun(*run_args(data, log, "-B", "1", "--max_steps", "400", "--eval_every", "0",
                             "--sample_every", "0"), wait=False)
    try:
        wait_until(lambda: os.path.exists(os.path.join(log, "log.txt"))
                   and "4 train" in log_of(log), [], "step 4")
        workers = child_pids(run.pid)
        assert len(workers) == 2
        run.send_signal(signal.SIGUSR1)
        run.wait(timeout=HANG_LIMIT_S)
        deadline = time.monotonic() + HANG_LIMIT_S
        while any(alive(p) for p in workers):
            assert time.monotonic() < deadline, "workers left running without their launcher"
            time.sleep(0.1)
    finally:
        run.kill()
        for p in child_pids(run.pid):
            os.kill(p, signal.SIGKILL)
    saved = steps_saved(log)
    assert saved and 4 <= saved[-1] < 399 and no_temp_files(log)
    assert f"{saved[-1]} train" in log_of(log)


@pytest.mark.slow
def test_a_rank_local_failure_is_named_by_every_rank(data, tmp_path):
    """Rank 1's fourth train batch (step 3) cannot be read: rank 1 says why, rank 0 names rank 1
    instead of a broken connection, the last finished step is kept, and torchrun's failure
    summary shows the cause. Rank 0 says it only after torchrun's SIGTERM (sent once rank 1 has
    left) has come, as a slow rank on a busy machine may: the signal does not cut it off."""
    log = str(tmp_path / "log")
    run = torchrun(*run_args(data, log, "-B", "1", "--sample_every", "0"), script=HOOKS,
                   env={"HOOK_MODE": "fail_batch", "HOOK_ARG": "1 4",
                        "HOOK_MARKER": str(tmp_path / "signalled")})
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    own = "error: step 3 failed (OSError: [Errno 5] Input/output error (a test's): "
    assert any(line.startswith(own) for line in errors), run.stderr
    assert any(line.startswith("error: rank 1: step 3 failed (OSError") and
               line.endswith("(rank 0 stopped with it)") for line in errors), run.stderr
    assert "Traceback" not in "\n".join(errors)
    assert "traceback : error: step 3 failed (OSError" in run.stderr  # torchrun's summary
    assert (tmp_path / "signalled").exists()  # rank 0's line came after the SIGTERM
    assert steps_saved(log) == [2]


# ------------------------------------------------------- nothing written through a symbolic link

@pytest.mark.parametrize("name", ["log.txt", ".lock", ".lock.holder"])
def test_nothing_is_written_through_a_symlink_in_the_log_dir(data, tmp_path, name):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    log = tmp_path / "log"
    log.mkdir()
    os.symlink(outside, log / name)
    for extra in ([], ["--overwrite"]):
        r = run_cli(*run_args(data, str(log), *extra))
        assert_one_line_error(r, str(log / name), "symbolic link")
    assert outside.read_text() == "keep me\n"
