"""play.ipynb: runs headless (nbclient) on generated logs, writes a valid PNG, and is committed
without outputs.

The kernel runs this interpreter through a kernelspec written to a temporary folder, so nothing
depends on which kernels the machine has registered. The log path reaches the notebook through
PLAY_LOG_PATH, the override its first markdown cell documents; the notebook file itself is never
changed.
"""
import math
import os
from dataclasses import asdict

import matplotlib.image
import nbformat
import numpy as np
import pytest
import torch
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

import rundir
import settings
import train_gpt2
from helpers import REPO

NOTEBOOK = os.path.join(REPO, "play.ipynb")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KERNEL_NAME = "play-notebook-test"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernelspec folder whose one kernel is this interpreter (torch, numpy, ... importable)."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("kernelspec")
    install(prefix=str(prefix), kernel_name=KERNEL_NAME)
    return os.path.join(str(prefix), "share", "jupyter", "kernels")


def execute_notebook(kernel_dir, log_path):
    """Run play.ipynb on log_path; returns the executed notebook and all its cells printed."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = AsyncKernelManager(kernel_name=KERNEL_NAME,
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_dir]))
    env = dict(os.environ, MPLBACKEND="Agg", PLAY_LOG_PATH=str(log_path))
    env.pop("PLAY_MODEL_SIZE", None)
    client = NotebookClient(nb, km=km, timeout=120, startup_timeout=120,
                            resources={"metadata": {"path": REPO}})
    client.execute(env=env)  # raises CellExecutionError, with the traceback, if a cell fails
    printed = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                      for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    return nb, printed


def check_png(path):
    assert os.path.isfile(path), f"no PNG at {path}"
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(np.std(image)) > 0  # not a blank canvas


def write_train(log_path, steps, rng, step_numbers=False):
    """A decreasing noisy loss curve, as a short run writes it; step_numbers: with each step's LR,
    norm, time and tokens/s, as today's runs write them (older logs have the loss alone)."""
    for step in range(steps):
        loss = 3.4 + 7.6 * math.exp(-step / 60) + rng.normal(0, 0.08)
        rundir.append_log(str(log_path), step, "train", loss)
        if step_numbers:
            dt = 250 + rng.normal(0, 5) + (4000 if step == 0 else 0)  # ms; step 0 compiles
            rundir.append_log(str(log_path), step, "lr", 6e-4 * min(1, (step + 1) / 30))
            rundir.append_log(str(log_path), step, "norm", 1 + rng.random())
            rundir.append_log(str(log_path), step, "dt", dt)
            rundir.append_log(str(log_path), step, "tok_s", 65536 / (dt / 1000))


@pytest.mark.slow
def test_notebook_plots_a_full_log(kernel_dir, tmp_path):
    rng = np.random.default_rng(0)
    log_path = tmp_path / "run" / "log.txt"
    log_path.parent.mkdir()
    write_train(log_path, 300, rng, step_numbers=True)
    for step in range(0, 300, 25):
        val = 3.5 + 7.5 * math.exp(-step / 60) + rng.normal(0, 0.03)
        rundir.append_log(str(log_path), step, "val", val)
    for step in range(0, 300, 50):
        hella = 0.25 + 0.01 * step / 50 + rng.normal(0, 0.003)
        rundir.append_log(str(log_path), step, "hella", hella)
    # what a run that diverged at the end logs: the best val loss must be the lowest finite one,
    # not nan
    rundir.append_log(str(log_path), 300, "val", float("nan"))
    rundir.append_log(str(log_path), 301, "val", float("-inf"))
    rundir.append_log(str(log_path), 300, "hella", float("nan"))

    series = rundir.read_log(str(log_path))  # the values as the log holds them (4 decimals)
    val_steps, val_values = series["val"]
    hella_steps, hella_values = series["hella"]
    assert math.isnan(val_values[-2]) and val_values[-1] == -math.inf
    assert math.isnan(hella_values[-1])
    i, j = int(np.argmin(val_values[:-2])), int(np.argmax(hella_values[:-1]))
    throughput = sorted(series["tok_s"][1])[149:151]  # the median of 300: the two middle ones

    _, printed = execute_notebook(kernel_dir, log_path)
    assert f"min val loss: {val_values[i]:.4f} at step {val_steps[i]}" in printed
    assert "2 non-finite val losses left out" in printed
    assert f"max HellaSwag acc_norm: {hella_values[j]:.4f} at step {hella_steps[j]}" in printed
    assert "1 non-finite values left out" in printed
    assert f"median throughput: {sum(throughput) / 2:,.0f} tok/s over 300 steps" in printed
    assert "panels: loss, HellaSwag acc_norm, throughput, learning rate" in printed
    assert "model size (auto): 124M" in printed  # no checkpoint beside the log
    assert "missing" not in printed
    png = tmp_path / "run" / "plot.png"
    assert f"saved {png}" in printed
    check_png(str(png))


@pytest.mark.slow
def test_notebook_tolerates_missing_series(kernel_dir, tmp_path):
    """Only train lines (an older log: no LR, no throughput), and a gpt2-medium checkpoint beside
    them: plots the loss, picks the 350M baselines."""
    log_path = tmp_path / "log.txt"
    write_train(log_path, 120, np.random.default_rng(1))
    config = asdict(train_gpt2.GPTConfig(**settings.MODEL_PRESETS["gpt2-medium"]))
    # config only, no weights
    torch.save({"config": config, "step": 119}, str(tmp_path / "model_00119.pt"))

    _, printed = execute_notebook(kernel_dir, log_path)
    assert ("missing (not plotted): val loss, HellaSwag acc_norm, throughput (tok/s), "
            "learning rate\n") in printed
    assert "panels: loss\n" in printed
    assert "min val loss" not in printed and "max HellaSwag" not in printed
    assert "throughput:" not in printed
    assert "model size (auto): 350M" in printed
    check_png(str(tmp_path / "plot.png"))


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "play.ipynb has no code cells"
    for cell in code:
        assert cell.get("outputs") == [], "play.ipynb must be committed with outputs cleared"
        assert cell.get("execution_count") is None, \
            "play.ipynb must be committed with execution counts cleared"
    # the first code cell holds the settings the markdown tells users to edit (and PLAY_* override)
    assert 'log_path = "log/log.txt"' in code[0].source and 'model_size = "auto"' in code[0].source
