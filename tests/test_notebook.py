"""play.ipynb: run headless as the README says (`PLAY_LOG_PATH=... jupyter execute play.ipynb`) on
generated logs, it prints its summary in the terminal, titles the plot with the run's own model,
writes a valid PNG and leaves itself unchanged; its baselines come from baselines.json alone, and
the README quotes the same figures; it is committed without outputs.

The kernel runs this interpreter through a kernelspec written to a temporary folder (found through
JUPYTER_PATH), so nothing depends on which kernels the machine has registered. The log path reaches
the notebook through PLAY_LOG_PATH, the override its first markdown cell documents.
"""
import glob
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict

import nbformat
import numpy as np
import pytest
import torch

import rundir
import settings
import train_gpt2
from helpers import HANG_LIMIT_S, REPO

NOTEBOOK = os.path.join(REPO, "play.ipynb")
BASELINES = os.path.join(REPO, "baselines.json")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KERNEL_NAME = "play-notebook-test"


def baselines():
    with open(BASELINES, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
    """A JUPYTER_PATH folder whose one kernel is this interpreter (torch, numpy, ... importable)."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("kernelspec")
    install(prefix=str(prefix), kernel_name=KERNEL_NAME)
    return os.path.join(str(prefix), "share", "jupyter")


def run_headless(jupyter_path, log_path, executed_dir):
    """`PLAY_LOG_PATH=log_path jupyter execute play.ipynb`, as the README has it, with the executed
    copy written to executed_dir (play.ipynb itself stays as it is). Returns the terminal's stdout
    and the text the executed copy's cells printed."""
    with open(NOTEBOOK, "rb") as f:
        before = f.read()
    env = dict(os.environ, MPLBACKEND="Agg", PLAY_LOG_PATH=str(log_path),
               JUPYTER_PATH=jupyter_path)
    env.pop("PLAY_MODEL_SIZE", None)
    os.makedirs(executed_dir, exist_ok=True)
    executed = os.path.join(str(executed_dir), "executed")
    # `jupyter execute` is nbclient's app (the jupyter-execute entry point): run with this Python
    jupyter_execute = [sys.executable, "-c", "from nbclient.cli import main; main()"]
    proc = subprocess.run(jupyter_execute + [f"--timeout={HANG_LIMIT_S}",  # a cell's: a hang only
                                             f"--kernel_name={KERNEL_NAME}",
                                             f"--output={executed}", NOTEBOOK],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(NOTEBOOK, "rb") as f:
        assert f.read() == before, "jupyter execute changed play.ipynb"
    nb = nbformat.read(executed + ".ipynb", as_version=4)
    printed = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                      for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    return proc.stdout, printed


def check_png(path, title):
    import matplotlib.image  # here: the headless runs alone read PNGs (and it takes 0.7 s)
    from PIL import Image

    assert os.path.isfile(path), f"no PNG at {path}"
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(np.std(image)) > 0  # not a blank canvas
    with Image.open(path) as png:
        assert png.text.get("Title") == title  # the figure's title, stored with it


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
def test_headless_run_prints_the_summary(jupyter_path, tmp_path):
    """A tiny-preset run (7M parameters) with a batch ramp, every series (val bits per byte too),
    a diverged end and fp16 skips: the terminal of `jupyter execute` gets the whole summary, the
    cells the same lines once, and the title names the run's own size, not a GPT-2 one."""
    run_dir = tmp_path / "run"
    # the run config as a real run writes it: the tiny preset with a batch-size ramp
    run, _, _ = train_gpt2.settle(["--preset", "tiny", "--device", "cpu", "-B", "2",
                                   "--log_dir", str(run_dir), "--batch_ramp_tokens", "100000",
                                   "--batch_ramp_start", "1024",
                                   "--data_root", str(tmp_path / "data")])
    run_dir.mkdir(exist_ok=True)
    rundir.save_run_config(str(run_dir), run.as_dict())
    rng = np.random.default_rng(0)
    log_path = run_dir / "log.txt"
    write_train(log_path, 300, rng, step_numbers=True)
    for step in range(0, 300, 25):
        val = 3.5 + 7.5 * math.exp(-step / 60) + rng.normal(0, 0.03)
        rundir.append_log(str(log_path), step, "val", val)
        rundir.append_log(str(log_path), step, "val_bpb", val * 0.37 + rng.normal(0, 0.01))
    for step in range(0, 300, 50):
        hella = 0.25 + 0.01 * step / 50 + rng.normal(0, 0.003)
        rundir.append_log(str(log_path), step, "hella", hella)
    for step in range(0, 300, 100):  # CORE and its tasks' lines (core/LABEL)
        rundir.append_log(str(log_path), step, "core", 0.02 + 0.01 * step / 100)
        rundir.append_log(str(log_path), step, "core/copa", 0.1 + 0.02 * step / 100)
    for step in (100, 200, 299):  # an sft run's --chat_every: chat and its tasks' (chat/LABEL)
        rundir.append_log(str(log_path), step, "chat", 0.05 - 0.01 * step / 100)
        rundir.append_log(str(log_path), step, "chat/arc_easy", 0.1 - 0.01 * step / 100)
    rundir.append_log(str(log_path), 120, "skipped", 1)
    rundir.append_log(str(log_path), 210, "skipped", 2)
    # what a run that diverged at the end logs: the best val loss must be the lowest finite one,
    # not nan
    rundir.append_log(str(log_path), 300, "val", float("nan"))
    rundir.append_log(str(log_path), 301, "val", float("-inf"))
    rundir.append_log(str(log_path), 300, "hella", float("nan"))

    series = rundir.read_log(str(log_path))  # the values as the log holds them (4 decimals)
    train_steps, train_values = series["train"]
    val_steps, val_values = series["val"]
    hella_steps, hella_values = series["hella"]
    bpb_steps, bpb_values = series["val_bpb"]
    k = int(np.argmin(bpb_values))
    core_steps, core_values = series["core"]
    assert series["core/copa"][0] == core_steps == [0, 100, 200]
    chat_steps, chat_values = series["chat"]
    assert series["chat/arc_easy"][0] == chat_steps == [100, 200, 299]
    assert math.isnan(val_values[-2]) and val_values[-1] == -math.inf
    assert math.isnan(hella_values[-1])
    i, j = int(np.argmin(val_values[:-2])), int(np.argmax(hella_values[:-1]))
    throughput = sorted(series["tok_s"][1])[149:151]  # the median of 300: the two middle ones
    n_params = train_gpt2.GPT(run.model).get_num_params()  # what the run prints
    assert 5e6 < n_params < 10e6
    tokens = 0  # the run's schedule, steps 0..299
    for _ in range(300):
        tokens += run.schedule.batch_size(tokens)
    assert tokens < 300 * run.total_batch_size  # the ramp counted
    ref = baselines()
    gpt2_val = ref["gpt2_val_loss"]["loss"]["124M"]
    gpt2_hella = ref["gpt2_hellaswag"]["acc_norm"]["124M"]
    gpt3_hella = ref["gpt3_hellaswag"]["accuracy"]["125M"]
    gpt2_core = ref["gpt2_core"]["core"]["124M"]
    png = run_dir / "plot.png"
    summary = "\n".join([
        f"summary of {log_path}",
        f"  model: {n_params:,} parameters (n_layer=4, n_head=4, n_embd=128), "
        f"from run_config.json",
        f"  steps: 0-299 (300 logged), {tokens:,} tokens seen",
        f"  train loss: {train_values[-1]:.4f} at step {train_steps[-1]} (last)",
        f"  val loss: -inf at step 301, best {val_values[i]:.4f} at step {val_steps[i]} "
        f"(OpenAI GPT-2 124M: {gpt2_val:.4f}); 2 non-finite left out",
        f"  val bits per byte: {bpb_values[-1]:.4f} at step 275, best {bpb_values[k]:.4f} at "
        f"step {bpb_steps[k]}",
        f"  HellaSwag acc_norm: nan at step 300, best {hella_values[j]:.4f} at step "
        f"{hella_steps[j]} (OpenAI GPT-2 124M: {gpt2_hella:.4f}, GPT-3 125M: {gpt3_hella:.3f}); "
        f"1 non-finite left out",
        f"  CORE: {core_values[-1]:.4f} at step 200, best {core_values[-1]:.4f} at step 200 "
        f"(OpenAI GPT-2 124M: {gpt2_core:.4f})",
        f"  chat evaluation (centred mean): {chat_values[-1]:.4f} at step 299, best "
        f"{chat_values[0]:.4f} at step 100",
        f"  throughput: median {sum(throughput) / 2:,.0f} tok/s over 300 steps",
        "  skipped steps (fp16 overflow): 2",
        f"  plot: {png}",
    ]) + "\n"
    title = (f"{log_path}: {n_params / 1e6:.1f}M parameters (n_layer=4, n_head=4, n_embd=128); "
             f"baselines: GPT-2 up to 124M, GPT-3 up to 125M")

    terminal, printed = run_headless(jupyter_path, log_path, tmp_path)
    assert summary in terminal
    assert printed.count(summary) == 1  # the notebook's cells: the same lines, once
    for text in (terminal, printed):
        assert ("panels: loss, val bits per byte, HellaSwag acc_norm, CORE, chat evaluation, "
                "throughput, learning rate\n") in text
        assert "baselines of size (auto): 124M\n" in text  # 7M parameters: 124M's baselines
        assert f"title: {title}\n" in text
        assert "missing" not in text
    check_png(str(png), title)


@pytest.mark.slow
def test_headless_run_tolerates_missing_series(jupyter_path, tmp_path):
    """Only train lines (an older log: no LR, no throughput), no run_config.json, and a
    gpt2-medium checkpoint beside them: plots the loss, takes the model from the checkpoint and
    picks the 350M baselines."""
    log_path = tmp_path / "log.txt"
    write_train(log_path, 120, np.random.default_rng(1))
    config = train_gpt2.GPTConfig(**settings.MODEL_PRESETS["gpt2-medium"])
    # config only, no weights
    torch.save({"config": asdict(config), "step": 119}, str(tmp_path / "model_00119.pt"))
    with torch.device("meta"):
        n_params = train_gpt2.GPT(config).get_num_params()
    assert 300e6 < n_params < 400e6

    terminal, printed = run_headless(jupyter_path, log_path, tmp_path / "out")
    model = f"{n_params:,} parameters (n_layer=24, n_head=16, n_embd=1024), from model_00119.pt"
    for text in (terminal, printed):
        assert ("missing (not plotted): val loss, val bits per byte, HellaSwag acc_norm, CORE, "
                "throughput (tok/s), learning rate\n") in text
        assert "panels: loss\n" in text
        assert f"model: {model}\n" in text
        assert "baselines of size (auto): 350M\n" in text
        assert "baselines drawn for: 124M, 350M\n" in text
        assert "  steps: 0-119 (120 logged)\n" in text  # no run_config.json: no token count
        assert "val loss:" not in text and "HellaSwag acc_norm:" not in text
        assert "throughput:" not in text
    title = (f"{log_path}: {n_params / 1e6:.1f}M parameters (n_layer=24, n_head=16, "
             f"n_embd=1024); baselines: GPT-2 up to 350M, GPT-3 up to 350M")
    check_png(str(tmp_path / "plot.png"), title)


# ===== One set of baselines: baselines.json, which the notebook reads and the README quotes ======
# "GPT-2 124M ...: 0.2859 / 0.2955", "GPT-2 XL (1558M) 0.3842 / 0.4893", "gpt2-xl ... a / b":
# acc / acc_norm after a GPT-2 size, within one sentence's words (no other number between)
GPT2_QUOTE = re.compile(r"GPT-?2[ -]?\(?(124M|1558M|XL|1\.5B)\)?(?: \((?:124M|1558M|1\.5B)\))?"
                        r"[^0-9|]{0,60}?(0\.\d{4}) / (0\.\d{4})", re.IGNORECASE)
# a table row: "| gpt2 (124M) | 0.2859 | 0.2955 |"
GPT2_ROW = re.compile(r"\|\s*GPT-?2(?:[ -]?XL)?\s*\((124M|1558M)\)\s*\|\s*(0\.\d{4})\s*\|\s*"
                      r"(0\.\d{4})\s*\|", re.IGNORECASE)
SIZE_OF_LABEL = {"124m": "124M", "1558m": "1558M", "xl": "1558M", "1.5b": "1558M"}


def quoted_gpt2_hellaswag(path):
    """[(size, acc, acc_norm)] for every GPT-2 HellaSwag figure the Markdown file quotes."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"\s+", " ", f.read())  # a quote may wrap across lines
    return [(SIZE_OF_LABEL[m.group(1).lower()], float(m.group(2)), float(m.group(3)))
            for pattern in (GPT2_QUOTE, GPT2_ROW) for m in pattern.finditer(text)]


def test_gpt2_quote_pattern():
    """The pattern finds the README's phrasings and nothing else."""
    text = ("GPT-2 124M scores 0.2859 / 0.2955 and GPT-2 XL (1558M) 0.3842 / 0.4893 (acc / "
            "acc_norm). | gpt2 (124M) | 0.2859 | 0.2955 | gpt2-xl 0.3842 / 0.4893; GPT-2 124M's "
            "published reference: 0.2859 / 0.2955. The harness: gpt2 28.92 / 31.14. "
            "GPT-2 124M val loss 3.2924, 12 steps of 0.5 / 0.25")
    assert [(SIZE_OF_LABEL[m.group(1).lower()], m.group(2), m.group(3))
            for m in GPT2_QUOTE.finditer(text)] == [
        ("124M", "0.2859", "0.2955"), ("1558M", "0.3842", "0.4893"),
        ("1558M", "0.3842", "0.4893"), ("124M", "0.2859", "0.2955")]
    assert [m.groups() for m in GPT2_ROW.finditer(text)] == [("124M", "0.2859", "0.2955")]


def test_readme_quotes_the_baselines_file():
    """The README quotes GPT-2's HellaSwag acc / acc_norm for every size baselines.json has, and
    the README and docs/ quote no other GPT-2 figure."""
    gpt2 = baselines()["gpt2_hellaswag"]
    expected = {size: (gpt2["acc"][size], gpt2["acc_norm"][size]) for size in gpt2["acc_norm"]}
    assert set(expected) == {"124M", "1558M"}
    readme = os.path.join(REPO, "README.md")
    quoted = quoted_gpt2_hellaswag(readme)
    missing = sorted(set(expected) - {size for size, _, _ in quoted})
    phrases = [f"GPT-2 {'XL (1558M)' if size == '1558M' else size} scores "
               f"{expected[size][0]:.4f} / {expected[size][1]:.4f}" for size in missing]
    assert not missing, (f"README.md quotes no GPT-2 HellaSwag acc / acc_norm (baselines.json) "
                         f"for {', '.join(missing)}: write e.g. {'; '.join(phrases)}")
    for path in [readme] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        for size, acc, acc_norm in quoted_gpt2_hellaswag(path):
            assert (acc, acc_norm) == expected[size], (
                f"{os.path.relpath(path, REPO)} quotes GPT-2 {size} HellaSwag as {acc:.4f} / "
                f"{acc_norm:.4f}; baselines.json has {expected[size][0]:.4f} / "
                f"{expected[size][1]:.4f}")


def test_notebook_takes_every_baseline_from_the_file():
    """No baseline figure is written into play.ipynb: it reads them from baselines.json, whose
    every group names its source."""
    ref = baselines()
    values = [ref["gpt2_val_loss"]["loss"], ref["gpt2_hellaswag"]["acc_norm"],
              ref["gpt2_hellaswag"]["acc"], ref["gpt3_hellaswag"]["accuracy"]]
    numbers = {v for group in values for v in group.values()}
    assert all(isinstance(v, float) and 0 < v < 10 for v in numbers)
    for key in ("gpt2_hellaswag", "gpt2_val_loss", "gpt3_hellaswag"):
        assert ref[key]["source"].strip() and ref[key]["what"].strip()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    source = "\n".join(cell.source for cell in nb.cells)
    assert "baselines.json" in source
    written = {float(x) for x in re.findall(r"(?<![\d.])\d\.\d{3,}(?![\d.])", source)}
    assert not written & numbers, f"play.ipynb writes out baselines: {sorted(written & numbers)}"


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
