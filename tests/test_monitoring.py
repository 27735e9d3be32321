"""Seeing a run: the step line (ETA), --profile traces, --wandb_project metrics."""
import json
import os
import sys
import types

import pytest

import train_gpt2 as tg
from test_train_gpt2 import run_cli, tiny_run_args


def test_profile_writes_a_trace_and_exits(shard_dir, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*tiny_run_args(shard_dir, log, "--profile", "exit", "--profile_schedule", "0,1,2", "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    traces = os.listdir(os.path.join(log, "profile"))
    assert len(traces) == 1 and traces[0].startswith("rank0.") and traces[0].endswith(".pt.trace.json")
    with open(os.path.join(log, "profile", traces[0])) as f:
        trace = json.load(f)
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])  # the matmuls were recorded
    assert "Self CPU time total" in r.stdout
    assert tg.read_log(os.path.join(log, "log.txt"))["train"][0] == [0, 1, 2]  # exited after 0+1+2 steps
    assert "eta 0:00:" in r.stdout


def test_profile_continue_and_bad_schedule(shard_dir, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*tiny_run_args(shard_dir, log, "--profile", "continue", "--profile_schedule", "1,0,1",
                               "--max_steps", "4", "--sample_every", "0", "--eval_every", "0"))
    assert r.returncode == 0, r.stderr
    assert tg.read_log(os.path.join(log, "log.txt"))["train"][0] == [0, 1, 2, 3]
    r = run_cli(*tiny_run_args(shard_dir, str(tmp_path / "b"), "--profile", "exit", "--profile_schedule", "1,2"))
    assert r.returncode == 1 and "--profile_schedule" in r.stderr and "Traceback" not in r.stderr


def test_wandb_missing_is_a_clear_error(shard_dir, tmp_path, monkeypatch):
    if "wandb" in sys.modules or __import__("importlib").util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    r = run_cli(*tiny_run_args(shard_dir, str(tmp_path / "log"), "--wandb_project", "x"))
    assert r.returncode == 1 and "pip install wandb" in r.stderr and "Traceback" not in r.stderr


def test_wandb_gets_the_same_metrics_as_log_txt(shard_dir, tmp_path, monkeypatch):
    logged, inits = [], []

    class FakeRun:
        def log(self, data, step):
            logged.append((step, data))

        def finish(self):
            logged.append("finished")

    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = str(tmp_path / "log")
    assert tg.main(tiny_run_args(shard_dir, log, "--wandb_project", "proj", "--max_steps", "3",
                                 "--sample_every", "0", "--eval_every", "2")) == 0
    assert inits[0]["project"] == "proj" and inits[0]["config"]["max_steps"] == 3
    series = tg.read_log(os.path.join(log, "log.txt"))
    train = [(s, d["train"]) for s, d in logged[:-1] if "train" in d]
    val = [(s, d["val"]) for s, d in logged[:-1] if "val" in d]
    assert [s for s, _ in train] == series["train"][0] and [s for s, _ in val] == series["val"][0] == [0, 2, 3]
    assert [round(v, 6) for _, v in train] == series["train"][1]
    assert all("train/lr" in d for s, d in logged[:-1] if "train" in d) and logged[-1] == "finished"


def test_eta_format():
    assert tg.format_eta(3725.9) == "1:02:05" and tg.format_eta(59) == "0:00:59"
