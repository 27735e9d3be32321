"""Seeing a run: log.txt, the step line, its ETA and the CPU warning, the summary at the end, the
run config block, --profile traces, --wandb_project metrics."""
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import types

import pytest

import metrics
import rundir
import settings
import train_gpt2 as tg
from helpers import assert_one_line_error, run_args, run_cli, series


def test_log_roundtrip_and_truncate(tmp_path):
    path = str(tmp_path / "log.txt")
    rundir.append_log(path, 0, "val", 10.98765)
    rundir.append_log(path, 0, "train", 10.1234567)
    rundir.append_log(path, 0, "lr", 6e-4 / 7)
    rundir.append_log(path, 0, "norm", 12.345678)
    rundir.append_log(path, 0, "dt", 1234.5678)
    rundir.append_log(path, 0, "tok_s", 424.7)
    rundir.append_log(path, 1, "train", 9.5)
    rundir.append_log(path, 1, "norm", float("inf"))  # a step the fp16 scaler skipped
    rundir.append_log(path, 1, "skipped", 1)
    rundir.append_log(path, 1, "hella", 0.25)
    rundir.append_log(path, 2, "norm", float("nan"))
    assert open(path).read() == ("0 val 10.9877\n0 train 10.123457\n0 lr 8.5714e-05\n"
                                 "0 norm 12.3457\n0 dt 1234.57\n0 tok_s 425\n1 train 9.500000\n"
                                 "1 norm inf\n1 skipped 1\n1 hella 0.2500\n2 norm nan\n")
    log = rundir.read_log(path)
    nan_norm = log["norm"][1].pop()
    assert math.isnan(nan_norm) and log["norm"][0].pop() == 2
    assert log == {"val": ([0], [10.9877]), "train": ([0, 1], [10.123457, 9.5]),
                   "lr": ([0], [8.5714e-05]), "norm": ([0, 1], [12.3457, math.inf]),
                   "dt": ([0], [1234.57]), "tok_s": ([0], [425.0]), "skipped": ([1], [1.0]),
                   "hella": ([1], [0.25])}
    with open(path, "ab") as f:  # what a crash can leave: NUL bytes, half a line
        f.write(b"\0\0\0\n2 tr")
    assert len(rundir.read_log(path)["norm"][0]) == 3
    assert rundir.truncate_log(path, 0) == 2  # the damaged lines, dropped
    assert rundir.read_log(path) == {"val": ([0], [10.9877]), "train": ([0], [10.123457]),
                                     "lr": ([0], [8.5714e-05]), "norm": ([0], [12.3457]),
                                     "dt": ([0], [1234.57]), "tok_s": ([0], [425.0])}


def tiny_metrics(tmp_path, device="cpu", preset="tiny", first_step=0, end=6, wandb_project=None):
    """Metrics as train_gpt2 makes it, for a 2-layer model of width 64 writing to tmp_path: the
    Run settled from the flags on the CPU, then moved to `device` (this machine may lack it)."""
    flags = ["--preset", preset, "--n_layer", "2", "--n_head", "2", "--n_embd", "64",
             "--block_size", "32", "-B", "1", "-T", "32", "--total_batch_size", "32",
             "--max_steps", str(end), "--warmup_steps", "1", "--sample_every", "0",
             "--log_dir", str(tmp_path), "--device", "cpu", "--data_root", str(tmp_path / "none"),
             "--overwrite"]  # a log.txt written there first would be an earlier run's
    if wandb_project:
        flags += ["--wandb_project", wandb_project]
    run, proc, _ = tg.settle(flags)
    assert run.batch_ramp_tokens == 0 and run.peak_flops is None and run.end_step == end
    run = dataclasses.replace(run, device=device, device_type=device)
    return metrics.Metrics(run, proc, first_step, 100_000)


def test_metrics_log_txt_step_lines_wandb_and_summary(tmp_path, capsys, monkeypatch):
    """report_step writes the step's loss, LR, norm, time and tokens/s to log.txt and the same to
    W&B; a skipped step (fp16 overflow, norm inf or nan) says so and counts; the summary has this
    session's time from the Metrics' making, its steps and tokens, the final and best val loss, the
    last HellaSwag accuracy, the last checkpoint and the skipped steps."""
    clock = [1000.0]
    monkeypatch.setattr(rundir.time, "time", lambda: clock[0])
    logged = []
    fake = types.SimpleNamespace(init=lambda **kw: types.SimpleNamespace(
        log=lambda data, step: logged.append((step, data))))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    meter = tiny_metrics(tmp_path, wandb_project="p")
    meter.log(0, "val", 10.5)
    meter.report_step(0, 10.25, 1e-4, 2.5, 0.5, 1024)
    meter.report_step(1, 9.75, 2e-4, math.inf, 0.25, 1024, skipped=True)
    meter.report_step(2, 9.5, 3e-4, math.nan, 0.2, 2048, skipped=True)
    meter.report_step(3, 9.25, 4e-4, 1.75, 0.2, 1024)
    meter.log(4, "val", 11.0)
    meter.log(4, "val_bpb", 4.5)
    meter.log(4, "hella", 0.3)

    lines = capsys.readouterr().out.splitlines()
    # no ETA from the first step (it compiles, warms up)
    assert lines[0] == ("step     0 | loss 10.250000 | lr 1.0000e-04 | norm 2.5000 | "
                        "dt 500.00ms | tok/sec 2048")
    assert lines[1].startswith("step     1 | loss 9.750000 | lr 2.0000e-04 | norm inf | "
                               "skipped (fp16 overflow) | dt 250.00ms | tok/sec 4096 | eta ")
    assert "| norm nan | skipped (fp16 overflow) |" in lines[2]
    assert "skipped" not in lines[3] and len(lines) == 4  # the CPU warning: not with tiny
    log = rundir.read_log(str(tmp_path / "log.txt"))
    assert log["train"] == ([0, 1, 2, 3], [10.25, 9.75, 9.5, 9.25])
    assert log["lr"] == ([0, 1, 2, 3], [1e-4, 2e-4, 3e-4, 4e-4])
    assert log["norm"][1][0] == 2.5 and log["norm"][1][1] == math.inf
    assert math.isnan(log["norm"][1][2]) and log["norm"][1][3] == 1.75
    assert log["dt"] == ([0, 1, 2, 3], [500.0, 250.0, 200.0, 200.0])
    assert log["tok_s"] == ([0, 1, 2, 3], [2048.0, 4096.0, 10240.0, 5120.0])
    assert log["skipped"] == ([1, 2], [1.0, 2.0])  # the count so far, on the steps that skip
    assert log["val"] == ([0, 4], [10.5, 11.0]) and log["hella"] == ([4], [0.3])

    train = {step: data for step, data in logged if "train" in data}
    assert train[0] == {"train": 10.25, "train/lr": 1e-4, "train/norm": 2.5, "train/dt": 500.0,
                        "train/tok_s": 2048.0}
    assert train[2]["train/skipped"] == 2 and "train/skipped" not in train[3]
    assert (4, {"hella": 0.3}) in logged

    clock[0] += 3661.5
    assert meter.summary(None) == (
        "run summary: steps 0-3 (4 steps, 5,120 tokens) in 1:01:01\n"
        "  val loss: 11.0000 at step 4, best 10.5000 at step 0\n"
        "  val bits per byte: 4.5000 at step 4, best 4.5000 at step 4\n"
        "  HellaSwag acc_norm: 0.3000 at step 4\n"
        "  last checkpoint: none\n"
        "  skipped steps (fp16 overflow): 2")


def test_summary_of_a_resumed_run_and_of_a_plain_one(tmp_path):
    """A resumed run's summary counts the evaluations its log.txt holds from before, and the
    skipped steps of this session only (log.txt's count goes on from the earlier ones); without
    evaluations or skipped steps, those lines are left out."""
    path = str(tmp_path / "log.txt")
    for step, kind, value in [(0, "val", 10.0), (2, "skipped", 1), (3, "val", 8.0),
                              (3, "val_bpb", 3.25),
                              (3, "hella", 0.25), (5, "val", float("nan")), (6, "skipped", 2)]:
        rundir.append_log(path, step, kind, value)
    meter = tiny_metrics(tmp_path, first_step=7, end=9)
    meter.report_step(7, 7.5, 1e-4, math.inf, 0.5, 64, skipped=True)
    meter.log(8, "val", 9.0)
    meter.log(8, "val_bpb", 3.5)
    assert rundir.read_log(path)["skipped"] == ([2, 6, 7], [1.0, 2.0, 3.0])  # the count goes on
    summary = meter.summary(str(tmp_path / "model_00007.pt"))
    assert summary.splitlines()[1:] == [
        "  val loss: 9.0000 at step 8, best 8.0000 at step 3",  # nan is never the best
        "  val bits per byte: 3.5000 at step 8, best 3.2500 at step 3",  # the earlier one's too
        "  HellaSwag acc_norm: 0.2500 at step 3",
        f"  last checkpoint: {tmp_path / 'model_00007.pt'}",
        "  skipped steps (fp16 overflow): 1"]  # this session's: not the earlier two
    assert re.fullmatch(r"run summary: steps 7-7 \(1 steps, 64 tokens\) in \d+:\d\d:\d\d",
                        summary.splitlines()[0]), summary

    plain = tiny_metrics(tmp_path / "new")
    os.makedirs(tmp_path / "new")
    plain.report_step(0, 10.0, 1e-4, 1.0, 0.5, 64)
    assert plain.summary(None).splitlines()[1:] == ["  last checkpoint: none"]


@pytest.mark.parametrize("device, preset, end, warned", [
    ("cpu", "gpt2", 10_000, True),  # the full recipe on a CPU
    ("cpu", "tiny", 10_000, False),  # --preset tiny is the advice
    ("cpu", "gpt2", 2_000, False),  # under an hour
    ("mps", "gpt2", 10_000, False),  # not a CPU
])
def test_a_long_run_on_the_cpu_warns_once(tmp_path, capsys, device, preset, end, warned):
    meter = tiny_metrics(tmp_path, device=device, preset=preset, end=end)
    for step in range(4):
        meter.report_step(step, 10.0, 1e-4, 1.0, 1.25, 64)
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    eta = metrics.format_eta((end - 2) * 1.25)  # from step 1, the first timed one
    expected = [f"warning: on the CPU this run takes about {eta} (from the first steps); for a "
                f"run of minutes use --preset tiny"]
    assert warnings == (expected if warned else []), out
    if warned:  # right after the first step line with an ETA
        assert out.splitlines()[2] == expected[0]


def run_config(**changes):
    """A run config as train_gpt2 makes it: the flags' defaults, what the run worked out."""
    config = {**settings.DEFAULTS, "device": "cpu", "world_size": 1, "grad_accum_steps": 8,
              "precision": "fp32", "compile": False, **changes}
    config["model"] = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
    config["provenance"] = {"code": f"git {'0123abcd' * 5} (dirty)", "torch": "2.13.0+cpu",
                            "device": "cuda:0 (NVIDIA H100 80GB HBM3)"}
    return config


def test_run_config_shows_only_the_parts_in_use(tmp_path):
    """Muon's settings only with --optimizer muon, the batch ramp's only when it is on, profiling's
    only with --profile, W&B's only with a project, the evaluation's and sampling's only when on;
    run_config.json keeps every setting."""
    default = settings.format_run_config(run_config(), settings.RUN_SETTINGS)
    on = run_config(optimizer="muon", batch_ramp_tokens=10_000, profile="exit",
                    wandb_project="proj", wandb_run_name="first", eval_every=0, sample_every=0)
    changed = settings.format_run_config(on, settings.RUN_SETTINGS)
    for setting in ("muon_momentum=0.95", "muon_ns_steps=5", "batch_ramp_start=32768",
                    "profile_schedule=1,1,3", "wandb_project=proj", "wandb_run_name=first"):
        assert f" {setting}" not in default and f" {setting}" in changed, setting
    for setting in ("val_tokens=10485760", "sample_tokens=32", "num_samples=4"):
        assert f" {setting}" in default and f" {setting}" not in changed, setting
    assert " eval_every=0 " in changed and " optimizer=adamw " in default  # the switches stay

    rundir.save_run_config(str(tmp_path), on)
    with open(tmp_path / "run_config.json") as f:
        assert json.load(f) == on


def test_off_parts_name_flags_and_every_muon_flag():
    flags = set(settings.DEFAULTS)
    for _, _, keys in settings.OFF_PARTS:
        assert set(keys) <= flags, keys
    muon = [keys for why, _, keys in settings.OFF_PARTS if "muon" in why]
    assert muon == [tuple(k for k in settings.DEFAULTS if k.startswith("muon_"))]


def test_run_config_lines_fit_100_columns():
    """Long values (a deep path, a long prompt, the provenance) wrap within 100 columns: a path is
    broken after a '/', the rest after a space; nothing is lost."""
    deep = "/scratch/" + "a_rather_long_folder_name/" * 6 + "shards"
    prompt = "Once upon a time " * 8
    config = run_config(data_root=deep, sample_prompt=prompt)
    text = settings.format_run_config(config, settings.RUN_SETTINGS)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), text
    assert lines[0] == "run config:" and all(line.startswith("  ") for line in lines[1:])
    assert f"data_root={deep}" in text.replace("\n" + settings.CONFIG_INDENT, "")
    assert [line for line in lines if line.endswith("/")], text  # broken at a '/'
    assert f"sample_prompt={prompt.strip()}" in " ".join(line.strip() for line in lines)
    assert "  provenance: code=git 0123abcd" in text


def test_eta_format():
    assert metrics.format_eta(3725.9) == "1:02:05" and metrics.format_eta(59) == "0:00:59"


def test_profile_writes_a_trace_and_exits(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--profile", "exit", "--profile_schedule", "0,1,2",
                          "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    traces = os.listdir(os.path.join(log, "profile"))
    assert len(traces) == 1 and traces[0].startswith("rank0.")
    assert traces[0].endswith(".pt.trace.json")
    with open(os.path.join(log, "profile", traces[0])) as f:
        trace = json.load(f)
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])  # the matmuls recorded
    assert "Self CPU time total" in r.stdout
    assert series(log)["train"][0] == [0, 1, 2]  # exited after 0+1+2 steps
    assert "eta 0:00:" in r.stdout


def test_profile_continue_and_bad_schedule(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--profile", "continue", "--profile_schedule", "1,0,1",
                          "--max_steps", "4", "--sample_every", "0", "--eval_every", "0"))
    assert r.returncode == 0, r.stderr
    assert series(log)["train"][0] == [0, 1, 2, 3]
    r = run_cli(*run_args(data, str(tmp_path / "b"), "--profile", "exit",
                          "--profile_schedule", "1,2"))
    assert_one_line_error(r, "--profile_schedule")


def test_wandb_missing_is_a_clear_error(data, tmp_path):
    if "wandb" in sys.modules or importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    r = run_cli(*run_args(data, str(tmp_path / "log"), "--wandb_project", "x"))
    assert_one_line_error(r, "pip install wandb")


def test_wandb_gets_the_same_metrics_as_log_txt(data, tmp_path, monkeypatch):
    logged, inits = [], []

    class FakeRun:
        def log(self, data, step):
            logged.append((step, data))

        def finish(self):
            logged.append("finished")

    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--wandb_project", "proj", "--max_steps", "3",
                          "--sample_every", "0", "--eval_every", "2"))
    assert r.returncode == 0, r.stderr
    assert inits[0]["project"] == "proj" and inits[0]["config"]["max_steps"] == 3
    logged_txt = series(log)
    train = [(s, d["train"]) for s, d in logged[:-1] if "train" in d]
    val = [(s, d["val"]) for s, d in logged[:-1] if "val" in d]
    assert [s for s, _ in train] == logged_txt["train"][0]
    assert [s for s, _ in val] == logged_txt["val"][0] == [0, 2, 3]
    assert [round(v, 6) for _, v in train] == logged_txt["train"][1]
    assert all("train/lr" in d for s, d in logged[:-1] if "train" in d)
    assert logged[-1] == "finished"
