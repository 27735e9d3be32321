"""The run settled before it starts: one frozen Run from the command line (the preset and a
resumed checkpoint as overlays), printed once as the run config, saved as run_config.json, and
the same block from `plan`; nothing changes it afterwards."""
import dataclasses
import json
import os

import pytest
import torch

import metrics
import settings
import train_gpt2 as tg
from helpers import resume_args, run_args, run_cli


def config_block(stdout):
    """The printed run config: its "run config:" line and the indented lines after it."""
    lines = stdout.splitlines()
    start = lines.index("run config:")
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return block


def test_plan_prints_the_block_a_run_with_the_same_flags_prints(data, tmp_path):
    flags = run_args(data, str(tmp_path / "log"), "--max_steps", "2", "--sample_every", "0",
                     "-B", "auto")
    planned = run_cli("plan", *flags)
    assert planned.returncode == 0, planned.stderr
    assert not os.path.exists(tmp_path / "log")  # plan writes nothing
    trained = run_cli(*flags)
    assert trained.returncode == 0, trained.stderr
    block = config_block(trained.stdout)
    assert config_block(planned.stdout) == block
    assert any(" micro_batch_estimate_gib=" in line for line in block)  # -B auto, resolved once
    assert "micro_batch_size=auto" not in "\n".join(block)


def test_the_run_is_frozen_and_run_config_json_is_it(data, tmp_path):
    log = str(tmp_path / "log")
    flags = run_args(data, log, "--max_steps", "3", "--val_steps", "2", drop=["--val_tokens"])
    run, proc, ckpt = tg.settle(flags)
    assert ckpt is None and proc.world_size == 1 and proc.master
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.max_lr = 1.0
    # everything derived is there before any work: device, precision, counts, schedule, model
    assert run.device == "cpu" and run.device_type == "cpu" and run.precision.name == "fp32"
    assert run.precision.scaler is False and run.precision.dtype is None
    B, T = run.micro_batch_size, run.sequence_length
    assert run.grad_accum_steps == run.total_batch_size // (B * T)
    assert run.val_tokens == 2 * B * T  # --val_steps, as tokens
    assert run.end_step == 3 and run.schedule.unit == B * T
    assert run.schedule.lr(0) == tg.get_lr(0, run.max_lr, run.max_lr * run.min_lr_ratio,
                                           run.warmup_steps, run.max_steps)
    assert isinstance(run.model, tg.GPTConfig) and run.model.block_size >= T
    assert set(settings.flags_of(run)) == set(settings.DEFAULTS)

    r = run_cli(*flags)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(log, "run_config.json")) as f:
        saved = json.load(f)
    expected = json.loads(json.dumps(run.as_dict(), default=str))
    assert saved == expected
    assert "\n".join(config_block(r.stdout)) == run.describe()


def test_a_resumed_run_settles_from_its_checkpoint(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--max_steps", "4", "--stop_step", "2", "-B", "auto"))
    assert r.returncode == 0, r.stderr
    first = json.load(open(os.path.join(log, "run_config.json")))
    run, _, ckpt = tg.settle(resume_args(log))
    assert ckpt["step"] == 1 and run.resume.endswith("model_00001.pt")
    # the checkpoint's flags come back, -B as the first run resolved it (no new fit)
    assert run.micro_batch_size == first["micro_batch_size"] and run.micro_batch_fit is None
    assert run.max_steps == 4 and run.stop_step is None and run.end_step == 4
    assert dataclasses.asdict(run.model) == first["model"]


def clock_seconds(text):
    """Seconds of an H:MM:SS figure."""
    h, m, s = (int(v) for v in text.split(":"))
    return 3600 * h + 60 * m + s


@pytest.mark.slow
def test_plans_time_counts_the_runs_own_micro_steps_and_val_passes(data, tmp_path, monkeypatch):
    """plan times the run's own micro-step (not one sequence scaled up) and counts the val passes:
    at a micro-step of a known length (the timing replaced, so that no figure depends on this
    machine's speed), its estimate is what the run does, counted: a second a micro-step and a
    third of one a val forward."""
    flags = run_args(data, str(tmp_path / "log"), "--n_layer", "2", "--n_embd", "64",
                     "--block_size", "64", "-B", "4", "-T", "64", "--total_batch_size", "512",
                     "--max_steps", "4", "--eval_every", "2", "--val_tokens", "512",
                     "--sample_every", "0")
    timed = []

    def micro_step_of_a_second(model, optimizer, B, run, repeats=3):
        timed.append((model.config.n_layer, model.config.n_embd, B, run.sequence_length))
        return 1.0, 1.0, 1.0
    monkeypatch.setattr(settings, "measure_micro_step", micro_step_of_a_second)
    planned = run_cli("plan", *flags)
    assert planned.returncode == 0, planned.stderr
    assert timed == [(2, 64, 4, 64)]  # the run's model and micro-batch
    line = [x for x in planned.stdout.splitlines() if x.startswith("  time: about ")][0]
    assert "timed on cpu" in line, line
    monkeypatch.undo()

    # in train(): training's micro-steps, val's forwards (no gradient); not settle's memory
    # estimate, which runs the model on fake tensors
    forwards, real_forward, real_train = {True: 0, False: 0}, tg.GPT.forward, tg.train

    def counted(self, *args, **kwargs):
        forwards[torch.is_grad_enabled()] += 1
        return real_forward(self, *args, **kwargs)

    def train(*args, **kwargs):
        monkeypatch.setattr(tg.GPT, "forward", counted)
        return real_train(*args, **kwargs)
    monkeypatch.setattr(tg, "train", train)
    trained = run_cli(*flags)
    assert trained.returncode == 0, trained.stderr
    assert forwards == {True: 4 * 2, False: 3 * 2}  # 2 micro-steps a step; val at 0, 2, 4
    assert clock_seconds(line.split()[2]) == round(forwards[True] + forwards[False] / 3)


@pytest.mark.slow
def test_plan_of_a_full_size_run_on_a_cpu_times_no_step_and_says_days(data, tmp_path):
    r = run_cli("plan", "--data_root", data, "--log_dir", str(tmp_path / "log"), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("  time: ")][0]
    assert line.startswith("  time: at least ") and " days, " in line and "timed" not in line
    assert "19,073 steps x 524,288" in r.stdout  # GPT-2's recipe


def test_long_times_read_as_days_and_hours():
    assert metrics.format_eta(3725.9) == "1:02:05"
    assert metrics.format_eta(86399) == "23:59:59"
    assert metrics.format_eta(86400 * 1234 + 7 * 3600 + 59) == "1,234 days, 7 hours"


def test_plan_of_a_resumed_run_counts_the_steps_left(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--max_steps", "6", "--stop_step", "2"))
    assert r.returncode == 0, r.stderr
    planned = run_cli("plan", *resume_args(log))
    assert planned.returncode == 0, planned.stderr
    assert "  tokens: 4 steps x 64 = 256" in planned.stdout, planned.stdout
