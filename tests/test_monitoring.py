"""Seeing a run: log.txt, the step line's ETA, --profile traces, --wandb_project metrics."""
import importlib.util
import json
import os
import sys
import types

import pytest

import rundir
from helpers import assert_one_line_error, run_args, run_cli, series


def test_log_roundtrip_and_truncate(tmp_path):
    path = str(tmp_path / "log.txt")
    rundir.append_log(path, 0, "val", 10.98765)
    rundir.append_log(path, 0, "train", 10.1234567)
    rundir.append_log(path, 1, "train", 9.5)
    rundir.append_log(path, 1, "hella", 0.25)
    assert open(path).read() == ("0 val 10.9877\n0 train 10.123457\n1 train 9.500000\n"
                                 "1 hella 0.2500\n")
    log = rundir.read_log(path)
    assert log == {"val": ([0], [10.9877]), "train": ([0, 1], [10.123457, 9.5]),
                   "hella": ([1], [0.25])}
    with open(path, "ab") as f:  # what a crash can leave: NUL bytes, half a line
        f.write(b"\0\0\0\n2 tr")
    assert rundir.read_log(path) == log
    assert rundir.truncate_log(path, 0) == 2  # the damaged lines, dropped
    assert rundir.read_log(path) == {"val": ([0], [10.9877]), "train": ([0], [10.123457])}


def test_eta_format():
    assert rundir.format_eta(3725.9) == "1:02:05" and rundir.format_eta(59) == "0:00:59"


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
