"""A run that diverges, is preempted or meets a full disk loses nothing and says one line; a resumed run
says what changes; sampling and export refuse what they cannot do (issue 20)."""
import errno
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import common
import fineweb
import train_gpt2 as tg
from conftest import REPO
from test_hostile import (HOOK, assert_one_line_error, data, dir_bytes, newest_step, one_thread, output,  # noqa: F401
                          read_text, reference, reference_log, resume_args, run_args, start_hooked, wait_until)
from test_train_gpt2 import run_cli


def checkpoints_are_finite(log):
    for path in tg.find_checkpoints(log):
        assert tg.non_finite(torch.load(path, weights_only=False)["model"]) is None, path


# ----------------------------------------------------------------------------- divergence

def test_divergence_stops_before_the_update_and_keeps_the_good_checkpoints(data, tmp_path):
    log = str(tmp_path / "log")
    args = run_args(data, log, **{"--max_lr": "1e4", "--warmup_steps": "0", "--save_every": "1",
                                  "--max_steps": "40", "--eval_every": "0", "--sample_every": "0"})
    r = run_cli(*args, "--keep_last", "2")
    line = assert_one_line_error(r, "the run diverged and stopped before this update")
    assert "the loss is nan" in line or "the gradient norm is" in line, line
    step = int(line.split("step ")[1].split(":")[0])
    assert 0 < step < 39  # a huge LR: diverged within a few steps, not trained on to the end
    found = tg.find_checkpoints(log)
    assert [tg.checkpoint_step(p) for p in found] == list(range(1, step))[-2:]  # --keep_last 2: the good ones
    checkpoints_are_finite(log)
    assert f"the newest checkpoint is {found[-1]}" in line
    assert tg.read_log(os.path.join(log, "log.txt"))["train"][0][-1] == step - 1  # nothing logged of the NaN step


def test_a_finite_spike_trains_on_and_an_infinite_loss_stops(data, tmp_path, monkeypatch):
    real_forward = tg.GPT.forward
    scale = {"value": 1.0}

    def forward(self, idx, targets=None, **kw):
        logits, loss = real_forward(self, idx, targets, **kw)
        return logits, (loss * scale["value"] if loss is not None else None)
    monkeypatch.setattr(tg.GPT, "forward", forward)
    scale["value"] = 1e10  # a spike of ten orders of magnitude, still finite: not an error
    r = run_cli(*run_args(data, str(tmp_path / "spike"), **{"--max_steps": "3", "--sample_every": "0"}))
    assert r.returncode == 0, r.stderr
    scale["value"] = float("inf")
    r = run_cli(*run_args(data, str(tmp_path / "inf"), **{"--max_steps": "3", "--sample_every": "0"}))
    assert_one_line_error(r, "step 0: the loss is inf", "no checkpoint was written")
    assert tg.find_checkpoints(str(tmp_path / "inf")) == []


def test_a_nan_checkpoint_is_skipped_on_resume_and_refused_by_the_commands(data, reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    newest = tg.find_checkpoints(log)[-1]
    ckpt = torch.load(newest, weights_only=False)
    ckpt["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    ckpt["step"] += 1  # as if a diverged run had written it (ours never does)
    torch.save(ckpt, tg.checkpoint_path(log, ckpt["step"]))
    bad = str(tmp_path / "nan.pt")
    torch.save(ckpt, bad)
    r = run_cli(*resume_args(log), "--max_steps", "10")
    assert r.returncode == 0, r.stderr
    assert "warning: skipping" in r.stdout and "NaN or inf" in r.stdout
    assert f"resumed from {newest}" in r.stdout
    for command in (["sample", "--checkpoint", bad, "--device", "cpu"],
                    ["export", "--checkpoint", bad, "--out", str(tmp_path / "hf")],
                    ["eval", "--checkpoint", bad, "--device", "cpu", "--data_dir", str(tmp_path)]):
        assert_one_line_error(run_cli(*command), bad, "NaN or inf")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- preemption and Ctrl-C

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_saves_the_step_and_the_resume_is_exact(data, reference, tmp_path, sig):
    # held while logging step 4 (its update done), the run is signalled: every rank sees it at the next
    # step's read-back, so the run stops after step 5 with a checkpoint of it
    log = str(tmp_path / "log")
    proc = start_hooked(tmp_path, "run", run_args(data, log), mode="hold_after_log", arg="4 train",
                        marker=tmp_path / "held", release=tmp_path / "release")
    wait_until(lambda: (tmp_path / "held").exists(), [proc], "the hold at step 4")
    proc.send_signal(sig)  # as Slurm, a scheduler or Ctrl-C would: mid-step
    (tmp_path / "release").touch()
    assert proc.wait(timeout=300) == 128 + sig
    out, err = output(proc)
    assert "Traceback" not in err
    name = signal.Signals(sig).name
    assert f"stopped by {name} after step 5: continue with python train_gpt2.py --resume latest" in out
    assert newest_step(log) == 5 and not [n for n in os.listdir(log) if n.endswith(".tmp")]
    r = run_cli(*resume_args(log))  # the lock went with the process
    assert r.returncode == 0, r.stderr
    assert read_text(os.path.join(log, "log.txt")) == reference_log(reference)


def test_a_second_ctrl_c_leaves_at_once(data, tmp_path):
    log = str(tmp_path / "log")
    proc = start_hooked(tmp_path, "run", run_args(data, log), mode="hold_after_log", arg="4 train",
                        marker=tmp_path / "held", release=tmp_path / "never")
    try:
        wait_until(lambda: (tmp_path / "held").exists(), [proc], "the hold at step 4")
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "SIGINT: finishing this step" in output(proc)[1], [proc], "the first Ctrl-C's line")
        proc.send_signal(signal.SIGINT)  # the hold never ends: only the second Ctrl-C can end the run
        assert proc.wait(timeout=300) == 130
    finally:
        proc.kill()  # a test that failed leaves no process behind
    out, err = output(proc)
    assert "Traceback" not in err and "SIGINT again: leaving now" in err
    assert newest_step(log) == 2  # what was saved before stays (step 4 was not saved yet); nothing half-written
    assert not [n for n in os.listdir(log) if n.endswith(".tmp")]


def test_torchrun_ranks_agree_on_the_step_to_stop(data, tmp_path):
    """SIGTERM to rank 0 only, mid-step: both ranks stop after the same step, save once, exit 143, no hang;
    resuming in two processes gives the uninterrupted two-process run's log."""
    hook = tmp_path / "hook.py"
    hook.write_text(HOOK)

    def torchrun(log, extra_env=None, *extra):
        env = {**os.environ, "HOOK_REPO": REPO, "OMP_NUM_THREADS": "1", **(extra_env or {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(hook),
               *run_args(data, log, **{"-B": "1", "--sample_every": "0"}), *extra]
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    ref = torchrun(str(tmp_path / "ref"))
    assert ref.wait(timeout=300) == 0, ref.stderr.read()
    log = str(tmp_path / "log")
    hold = {"HOOK_MODE": "hold_after_log", "HOOK_ARG": "3 train", "HOOK_MARKER": str(tmp_path / "held"),
            "HOOK_RELEASE": str(tmp_path / "release")}
    run = torchrun(log, hold)
    wait_until(lambda: (tmp_path / "held").exists(), [], "rank 0's hold at step 3")
    assert run.poll() is None
    os.kill(int((tmp_path / "held").read_text()), signal.SIGTERM)  # rank 0 alone gets the signal
    (tmp_path / "release").touch()
    out, err = run.communicate(timeout=300)
    assert run.returncode != 0 and 'train_gpt2.py", line' not in err, err  # torchrun's own report only
    assert "stopped by SIGTERM after step 4" in out  # seen at the next step's read-back, by every rank
    assert "exitcode  : 143" in err or "143" in err
    assert newest_step(log) == 4 and len([p for p in tg.find_checkpoints(log) if tg.checkpoint_step(p) == 4]) == 1
    resumed = torchrun(log, None, "--resume", "latest")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert read_text(os.path.join(log, "log.txt")) == read_text(str(tmp_path / "ref" / "log.txt"))


# ----------------------------------------------------------------------------- a full disk

def no_space(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_a_full_disk_at_a_checkpoint_keeps_the_earlier_ones_and_resumes(data, reference, tmp_path, monkeypatch):
    log = str(tmp_path / "log")
    real_write = tg.atomic_write

    def atomic_write(path, write):
        if os.path.basename(path) == "model_00004.pt":
            raise no_space(path)
        real_write(path, write)
    monkeypatch.setattr(tg, "atomic_write", atomic_write)
    r = run_cli(*run_args(data, log))
    line = assert_one_line_error(r, "model_00004.pt", "no space left")
    assert [tg.checkpoint_step(p) for p in tg.find_checkpoints(log)] == [2]
    monkeypatch.setattr(tg, "atomic_write", real_write)  # space freed
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr + line
    assert read_text(os.path.join(log, "log.txt")) == reference_log(reference)


def test_a_full_disk_under_log_txt_and_the_lock_is_one_line(data, tmp_path, monkeypatch):
    real_append = tg.append_log

    def append_log(path, step, kind, value):
        if step == 3:
            raise no_space(path)
        real_append(path, step, kind, value)
    monkeypatch.setattr(tg, "append_log", append_log)
    log = str(tmp_path / "log")
    line = assert_one_line_error(run_cli(*run_args(data, log)), "log.txt", "no space left")
    assert newest_step(log) <= 3  # the last step taken is kept
    monkeypatch.undo()

    def lock_write(path, write):  # the lock's holder record, the first file a run writes
        raise no_space(path)
    monkeypatch.setattr(common, "atomic_write", lock_write)
    log2 = str(tmp_path / "log2")
    assert_one_line_error(run_cli(*run_args(data, log2)), f"--log_dir {log2}: cannot write there", "no space")
    assert os.listdir(log2) == [".lock"]  # no record of a holder that never held it
    assert line


def test_a_failed_export_leaves_nothing_and_a_retry_works(reference, tmp_path, monkeypatch):
    ckpt = tg.find_checkpoints(reference)[-1]
    out = tmp_path / "hf"
    real_export = tg.export_hf

    def export_hf(model, out_dir):
        open(os.path.join(out_dir, "config.json"), "w").write("{")
        raise no_space(os.path.join(out_dir, "model.safetensors"))
    monkeypatch.setattr(tg, "export_hf", export_hf)
    assert_one_line_error(run_cli("export", "--checkpoint", ckpt, "--out", str(out)), "no space left")
    assert sorted(os.listdir(tmp_path)) == []  # no half-written folder, under its final name or a temp one
    monkeypatch.setattr(tg, "export_hf", real_export)
    r = run_cli("export", "--checkpoint", ckpt, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~common.umask())


# ----------------------------------------------------------------------------- resume, sample, export edges

def test_resume_states_a_new_schedule_and_refuses_new_shapes(data, tmp_path):
    log = str(tmp_path / "log")
    assert run_cli(*run_args(data, log, **{"--sample_every": "0"}), "--stop_step", "4", "--keep_last", "1").returncode == 0
    r = run_cli(*resume_args(log), "--max_steps", "12", "--stop_step", "6")
    assert r.returncode == 0, r.stderr
    warning = [line for line in r.stdout.splitlines() if "gets LR" in line]
    old = tg.get_lr(4, 2e-3, 2e-4, 2, 8)
    new = tg.get_lr(4, 2e-3, 2e-4, 2, 12)
    assert warning and f"step 4 gets LR {new:.4e}" in warning[0] and f"{old:.4e}" in warning[0]
    assert [tg.checkpoint_step(p) for p in tg.find_checkpoints(log)] == [5]  # --keep_last 1 came along
    before = dir_bytes(log)
    for flags, names in ((["-T", "16"], ["sequence_length=32", "sequence_length=16"]),
                         (["--preset", "gpt2"], ["preset=tiny", "preset=gpt2"])):
        assert_one_line_error(run_cli(*resume_args(log), *flags), *names)
    assert dir_bytes(log) == before


def test_old_and_foreign_checkpoints(data, reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    newest = tg.find_checkpoints(log)[-1]
    ckpt = torch.load(newest, weights_only=False)
    del ckpt["tokens_seen"]  # written before the batch ramp: every step a full batch
    torch.save(ckpt, newest)
    r = run_cli(*resume_args(log), "--max_steps", "10")
    assert r.returncode == 0, r.stderr
    del ckpt["args"]
    torch.save(ckpt, newest)
    assert_one_line_error(run_cli("--resume", newest, "--log_dir", log, "--device", "cpu"), newest, "no args")


def test_values_from_the_checkpoint_are_checked_when_their_block_comes_on(data, reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    newest = tg.find_checkpoints(log)[-1]
    ckpt = torch.load(newest, weights_only=False)
    ckpt["args"].update(eval_every=0, val_tokens=0)  # a run with val off, written before 0 was refused
    torch.save(ckpt, newest)
    before = dir_bytes(log)
    assert_one_line_error(run_cli(*resume_args(log), "--max_steps", "10", "--eval_every", "2"), "--val_tokens 0")
    assert dir_bytes(log) == before


@pytest.mark.parametrize("flags, name", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--top_k", "0"], "--top_k"),
    (["--num_samples", "0"], "--num_samples"), (["--max_new_tokens", "-3"], "--max_new_tokens"),
])
def test_sample_flags_are_checked(reference, flags, name):
    r = run_cli("sample", "--checkpoint", tg.find_checkpoints(reference)[-1], *flags)
    assert_one_line_error(r, name)


def test_sample_greedy_and_clean(reference):
    r = run_cli("sample", "--checkpoint", tg.find_checkpoints(reference)[-1], "--device", "cpu",
                "--temperature", "0", "--num_samples", "2", "--max_new_tokens", "8", "--prompt", "The")
    assert r.returncode == 0, r.stderr
    samples = r.stdout.split("--- sample ")[1:]
    assert len(samples) == 2 and samples[0].split("\n", 1)[1] == samples[1].split("\n", 1)[1]  # greedy: equal
    assert "<|endoftext|>" not in r.stdout and "\n\n" not in r.stdout


def test_decode_sample_stops_at_end_of_text():
    enc = fineweb.get_encoding()
    prompt = enc.encode("Hello")
    tokens = prompt + enc.encode(" world.\n\n\nBye") + [fineweb.EOT] + enc.encode(" unrelated")
    assert tg.decode_sample(enc, tokens, len(prompt)) == "Hello world.\nBye"


@pytest.mark.parametrize("where", ["under_a_file", "missing_parent", "unwritable"])
def test_export_to_a_bad_place_is_one_line(reference, tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = {"under_a_file": tmp_path / "file" / "hf", "missing_parent": tmp_path / "no" / "such" / "hf",
           "unwritable": "/proc/hf_export"}[where]
    r = run_cli("export", "--checkpoint", tg.find_checkpoints(reference)[-1], "--out", str(out))
    assert_one_line_error(r, "--out")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_val_tokens_past_the_val_shards_warn_once(data, tmp_path):
    r = run_cli(*run_args(data, str(tmp_path / "log"), **{"--val_tokens": "100000", "--max_steps": "2",
                                                          "--sample_every": "0"}))
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines() if "the val shards hold 2,999 targets" in line]
    assert len(warnings) == 1


def test_files_follow_the_umask(data, tmp_path):
    old = os.umask(0o002)
    try:
        log = str(tmp_path / "log")
        assert run_cli(*run_args(data, log, **{"--max_steps": "2", "--sample_every": "0"})).returncode == 0
    finally:
        os.umask(old)
    for name in ("log.txt", "model_00001.pt", "run_config.json"):
        assert os.stat(os.path.join(log, name)).st_mode & 0o777 == 0o664, name
