"""fp16 with a loss scaler (GPUs without bf16: T4, V100), on the CPU with real fp16 autocast and
torch.amp.GradScaler: the run tracks fp32's, resumes exactly, and a step the scaler skips is shown,
counted and not a divergence. The GPU side (--dtype auto picking fp16, the scaler's calls in
order) is in test_cuda_simulated.py."""
import functools
import math
import os

import pytest
import torch

import rundir
from helpers import resume_args, run_args, run_cli, series

# 30 steps of 8 tokens: fp16 matmuls are slow on a CPU, and the vocabulary's is the big one
FP16_RUN = ["-B", "1", "-T", "8", "--total_batch_size", "8", "--max_steps", "30",
            "--warmup_steps", "5", "--max_lr", "3e-3", "--eval_every", "0", "--sample_every", "0"]


@pytest.mark.slow
def test_fp16_tracks_fp32_and_resumes_exactly(data, tmp_path):
    logs = {name: str(tmp_path / name) for name in ("fp32", "fp16", "resumed")}
    for name, dtype in (("fp32", "fp32"), ("fp16", "fp16")):
        r = run_cli(*run_args(data, logs[name], *FP16_RUN, "--dtype", dtype))
        assert r.returncode == 0, r.stderr
    assert " precision=fp16 " in r.stdout.replace("\n", " ")
    r = run_cli(*run_args(data, logs["resumed"], *FP16_RUN, "--dtype", "fp16", "--stop_step", "20"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*resume_args(logs["resumed"], "--dtype", "fp16"))  # --dtype: not inherited
    assert r.returncode == 0, r.stderr

    fp32, fp16 = series(logs["fp32"])["train"], series(logs["fp16"])["train"]
    assert fp16[0] == fp32[0] == list(range(30))
    assert fp16[1] != fp32[1]  # fp16 arithmetic did run ...
    assert fp16[1] == pytest.approx(fp32[1], abs=0.02)  # ... and the losses track fp32's
    assert series(logs["resumed"])["train"] == fp16  # the scaler's state came back too
    ckpt = torch.load(rundir.find_checkpoints(logs["resumed"])[-1], weights_only=True)
    assert ckpt["scaler"]["scale"] > 0 and set(ckpt["scaler"]) >= {"scale", "_growth_tracker"}


def test_an_fp16_overflow_skips_the_step_and_is_not_a_divergence(data, tmp_path, monkeypatch):
    """A loss scale far too high overflows the fp16 gradients: those steps are skipped (the weights
    and AdamW untouched), shown in the step line, counted in log.txt, and the scale backs off."""
    scaler = functools.partial(torch.amp.GradScaler, init_scale=2.0**40, backoff_factor=2.0**-8)
    monkeypatch.setattr(torch.amp, "GradScaler", scaler)
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, *FP16_RUN, "--dtype", "fp16", "--max_steps", "6"))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    skipped = [i for i, line in enumerate(lines) if "skipped" in line]
    assert len(lines) == 6 and skipped and skipped == list(range(len(skipped))), r.stdout
    counted = series(log).get("skipped")
    assert counted == (skipped, [float(n) for n in range(1, len(skipped) + 1)])
    ckpt = torch.load(rundir.find_checkpoints(log)[-1], weights_only=True)
    assert ckpt["scaler"]["scale"] == 2.0**40 * (2.0**-8) ** len(skipped)
    applied = {float(s["step"]) for s in ckpt["optimizer"]["state"].values()}
    assert applied == {6 - len(skipped)}  # AdamW stepped only where the scaler let it
    assert all(math.isfinite(loss) for loss in series(log)["train"][1])
    assert not os.path.exists(os.path.join(log, "failure.txt"))
