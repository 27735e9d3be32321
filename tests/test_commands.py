"""The commands that use a checkpoint or OpenAI's GPT-2: `train_gpt2.py sample`, `export` (to a
transformers GPT2LMHeadModel, checked logit for logit) and `eval` (HellaSwag, against
hellaswag.evaluate); `plan`, which works a run out; what they refuse, in one line."""
import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import types
from dataclasses import asdict

import pytest
import torch

import common
import hellaswag
import openai_gpt2
import rundir
import settings
import train_gpt2 as tg
from helpers import (REPO, RUN_FLAGS, SHAPE_FLAGS, assert_one_line_error, hf_gpt2, run_args,
                     run_cli, tiny_model, write_hellaswag)


def save_tiny_checkpoint(path, model):
    """What sample, export and eval read of a checkpoint: the weights and the config."""
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, path)
    return str(path)


# ------------------------------------------------------------------------------------------- sample

def test_sample_command(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "model.pt", tiny_model())
    flags = ["--device", "cpu", "--checkpoint", ckpt, "--prompt", "The sky is",
             "--num_samples", "2", "--max_new_tokens", "5", "--seed", "3"]
    r = run_cli("sample", *flags)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- sample") == 2 and r.stdout.count("The sky is") == 2
    again = run_cli("sample", *flags, "--no_kv_cache")
    assert again.stdout == r.stdout  # same seed: the cache changes the speed, not the text
    r = run_cli("sample", "--device", "cpu", "--checkpoint", ckpt, "--max_new_tokens", "100")
    assert_one_line_error(r, "--max_new_tokens (100)", "block_size 64")
    r = run_cli("sample", "--device", "cpu", "--checkpoint", str(tmp_path / "missing.pt"))
    assert_one_line_error(r, "checkpoint not found")
    r = run_cli("sample", "--device", "cpu")
    assert_one_line_error(r, "give one of --checkpoint (a model_*.pt) or --init_from")


@pytest.mark.slow
def test_sample_from_pretrained_dir(tmp_path, enc):
    hf, path = hf_gpt2(tmp_path)
    r = run_cli("sample", "--device", "cpu", "--init_from", path, "--max_new_tokens", "4",
                "--num_samples", "1", "--top_k", "1")
    assert r.returncode == 0, r.stderr
    prompt = torch.tensor([enc.encode("Hello, I'm a language model,")])
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=50256)
    assert enc.decode(want[0].tolist()) in r.stdout
    r = run_cli("sample", "--device", "cpu", "--init_from", str(tmp_path / "nowhere"))
    assert_one_line_error(r, "could not load GPT-2 model")


@pytest.mark.parametrize("flags, name", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--top_k", "0"], "--top_k"),
    (["--num_samples", "0"], "--num_samples"), (["--max_new_tokens", "-3"], "--max_new_tokens"),
])
def test_sample_flags_are_checked(reference, flags, name):
    r = run_cli("sample", "--checkpoint", rundir.find_checkpoints(reference)[-1], *flags)
    assert_one_line_error(r, name)


def test_sample_greedy_and_clean(reference):
    r = run_cli("sample", "--checkpoint", rundir.find_checkpoints(reference)[-1], "--device", "cpu",
                "--temperature", "0", "--num_samples", "2", "--max_new_tokens", "8",
                "--prompt", "The")
    assert r.returncode == 0, r.stderr
    samples = r.stdout.split("--- sample ")[1:]
    # greedy: the two samples are equal
    assert len(samples) == 2 and samples[0].split("\n", 1)[1] == samples[1].split("\n", 1)[1]
    assert "<|endoftext|>" not in r.stdout and "\n\n" not in r.stdout


# ------------------------------------------------------------------------------------------- export

@pytest.mark.slow
def test_export_roundtrip_logits(tmp_path):
    from transformers import GPT2LMHeadModel
    model = tiny_model(n_head=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # non-zero biases and LN shifts
    ckpt = save_tiny_checkpoint(tmp_path / "model_00010.pt", model)
    out = str(tmp_path / "hf_out")
    r = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == 50257
    idx = torch.randint(0, 50257, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0][..., :50257], atol=1e-5,
                                   rtol=1e-5)
    # never over an existing directory
    r = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert_one_line_error(r, "not an empty directory")


def test_a_failed_export_leaves_nothing_and_a_retry_works(reference, tmp_path, monkeypatch):
    ckpt = rundir.find_checkpoints(reference)[-1]
    out = tmp_path / "hf"
    real_export = openai_gpt2.export_hf

    def export_hf(model, out_dir, tok=None, run=None):
        open(os.path.join(out_dir, "config.json"), "w").write("{")
        path = os.path.join(out_dir, "model.safetensors")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    monkeypatch.setattr(openai_gpt2, "export_hf", export_hf)
    assert_one_line_error(run_cli("export", "--checkpoint", ckpt, "--out", str(out)),
                          "no space left")
    assert sorted(os.listdir(tmp_path)) == []  # no half-written folder, final name or temp one
    monkeypatch.setattr(openai_gpt2, "export_hf", real_export)
    r = run_cli("export", "--checkpoint", ckpt, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~common.umask())


@pytest.mark.parametrize("where", ["under_a_file", "missing_parent", "unwritable"])
def test_export_to_a_bad_place_is_one_line(reference, tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = {"under_a_file": tmp_path / "file" / "hf",
           "missing_parent": tmp_path / "no" / "such" / "hf",
           "unwritable": "/proc/hf_export"}[where]
    r = run_cli("export", "--checkpoint", rundir.find_checkpoints(reference)[-1], "--out", str(out))
    assert_one_line_error(r, "--out")
    assert sorted(os.listdir(tmp_path)) == ["file"]


# --------------------------------------------------------------------------------------------- eval

@pytest.mark.slow
def test_eval_command_scores_a_checkpoint_like_hellaswag_evaluate(reference, tmp_path):
    """`train_gpt2.py eval --checkpoint` reports what hellaswag.evaluate gives for the same model
    and data."""
    data = str(tmp_path / "hs")
    write_hellaswag(data, 12)
    ckpt = rundir.find_checkpoints(reference)[-1]
    r = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--hellaswag_dir", data,
                "--batch_tokens", "256")
    assert r.returncode == 0, r.stderr
    model = tg.model_from_checkpoint(rundir.read_checkpoint(ckpt), ckpt)
    want = hellaswag.evaluate(model, "cpu", data_dir=data, batch_tokens=0)
    assert f"acc_norm {want['acc_norm']:.4f} ({want['correct_norm']}/12)" in r.stdout
    assert f"acc {want['acc']:.4f} ({want['correct']}/12)" in r.stdout
    assert "(fp32)" in r.stdout  # --dtype auto: fp32 off CUDA
    # --data_dir: a hidden alias of --hellaswag_dir, as in hellaswag.py
    old = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--data_dir", data,
                  "--batch_tokens", "256")
    assert old.returncode == 0 and f"acc_norm {want['acc_norm']:.4f}" in old.stdout, old.stderr
    r = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--hellaswag_dir",
                str(tmp_path / "none"))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr  # after its line saying what it tried
    assert len(errors) == 1 and "Rowan/hellaswag" in errors[0], r.stderr


def test_commands_refuse_a_nan_checkpoint(reference, tmp_path):
    ckpt = torch.load(rundir.find_checkpoints(reference)[-1], weights_only=False)
    ckpt["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    bad = str(tmp_path / "nan.pt")
    torch.save(ckpt, bad)
    for command in (["sample", "--checkpoint", bad, "--device", "cpu"],
                    ["export", "--checkpoint", bad, "--out", str(tmp_path / "hf")],
                    ["eval", "--checkpoint", bad, "--device", "cpu", "--hellaswag_dir",
                     str(tmp_path)]):
        assert_one_line_error(run_cli(*command), bad, "NaN or inf")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------- what a checkpoint must be to be used

def rewritten(reference, tmp_path, name, change):
    ckpt = torch.load(rundir.find_checkpoints(reference)[-1], weights_only=True)
    change(ckpt)
    path = str(tmp_path / name)
    torch.save(ckpt, path)
    return path


@pytest.mark.parametrize("name, change, message", [
    ("shape.pt", lambda c: c["config"].update(n_layer=3), "its config and weights disagree"),
    ("key.pt", lambda c: c["config"].update(flux=1), "its config and weights disagree"),
    ("args.pt", lambda c: c.update(args=[1, 2]), "its 'args' is a list, not a dict"),
])
def test_a_checkpoint_that_does_not_hold_together_is_one_line(reference, tmp_path, name, change,
                                                              message):
    path = rewritten(reference, tmp_path, name, change)
    for args in (["sample", "--checkpoint", path, "--device", "cpu"],
                 ["--resume", path, "--log_dir", str(tmp_path), "--device", "cpu"]):
        assert_one_line_error(run_cli(*args), path, message)


def test_what_is_not_a_checkpoint_or_a_place_is_said_so(reference, tmp_path):
    newest = rundir.find_checkpoints(reference)[-1]
    assert_one_line_error(run_cli("sample", "--checkpoint", "/dev/null"),
                          "/dev/null is not a checkpoint file")
    assert_one_line_error(run_cli("sample", "--checkpoint", newest, "--seed", "-1"), "--seed")
    assert_one_line_error(run_cli("export", "--checkpoint", newest, "--out", ""),
                          "--out is empty")


def test_provenance_is_recorded_and_told(reference, tmp_path):
    newest = rundir.find_checkpoints(reference)[-1]
    with open(os.path.join(reference, "run_config.json")) as f:
        recorded = json.load(f)["provenance"]
    assert torch.load(newest, weights_only=True)["provenance"] == recorded
    assert set(recorded) == {"code", "torch", "python", "device"}
    assert recorded["torch"] == str(torch.__version__) and recorded["device"].startswith("cpu")
    assert recorded["code"].startswith("git ")  # the tests run in a git checkout
    r = run_cli("sample", "--checkpoint", newest, "--device", "cpu", "--num_samples", "1",
                "--max_new_tokens", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{newest}: step 7, written by code {recorded['code']}, torch ")


def test_provenance_outside_a_git_checkout_is_a_hash_of_train_gpt2(tmp_path, monkeypatch):
    for name in ("train_gpt2.py", "rundir.py"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    spec = importlib.util.spec_from_file_location("rundir_elsewhere", tmp_path / "rundir.py")
    elsewhere = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(elsewhere)
    monkeypatch.setenv("GIT_DIR", "/nonexistent")  # no repository, wherever tmp_path is
    digest = hashlib.sha256((tmp_path / "train_gpt2.py").read_bytes()).hexdigest()
    assert elsewhere.provenance("cpu")["code"] == f"train_gpt2.py sha256 {digest}"


# --------------------------------------------------------------------------------------------- plan

@pytest.mark.slow
def test_plan_works_out_a_run_on_the_cpu_and_writes_nothing(data, tmp_path):
    """The tiny run's plan: its config block, size, batch, a memory estimate and a time measured
    on this CPU; no log dir, no data prepared. The GPU side (the 124M recipe on an H100, its time
    from the peak FLOP/s) is in test_cuda_simulated.py."""
    log, before = tmp_path / "log", sorted(os.listdir(data))
    r = run_cli("plan", *run_args(data, str(log)))
    assert r.returncode == 0, r.stderr
    assert "run config:" in r.stdout and "\nplan: " in r.stdout
    plan = r.stdout.split("\nplan: ", 1)[1]
    shape = {flag[2:]: int(RUN_FLAGS[flag]) for flag in SHAPE_FLAGS}
    n_params = tiny_model(**shape).get_num_params()
    assert plan.startswith(f"{n_params:,} parameters on 1 x cpu in fp32"), plan
    assert "tokens: 8 steps x 64 = 512" in plan
    assert "batch: -B 2 x -T 32 x 1 process(es), 1 micro-step(s) a step" in plan
    assert "memory: a step's estimated peak " in plan and "usable of this machine's" in plan
    assert "(steps and val passes, from micro-steps of -B 2 x -T 32 timed on cpu: " in plan
    assert not log.exists() and sorted(os.listdir(data)) == before
    assert_one_line_error(run_cli("plan", *run_args(data, str(log), "-B", "3")),
                          "not divisible by B*T*world_size")
    assert not log.exists()


def evaluations_by_the_loop(every, first_step, end_step, max_steps):
    """How many times train_gpt2's loop runs an every-N block, step by step as the loop goes."""
    n = 0
    for step in range(first_step, max_steps + 1):
        last_step = step == max_steps
        if step == end_step and not last_step:
            break
        n += tg.due(every, step, last_step)
    return n


def test_the_evaluations_a_plan_counts_are_those_the_loop_runs():
    """settings.evaluations against the loop, resumed or not, stopped early or not."""
    for max_steps in range(1, 16):
        for end_step in range(1, max_steps + 1):
            for first_step in range(end_step + 1):
                run = types.SimpleNamespace(end_step=end_step, max_steps=max_steps)
                for every in range(6):
                    assert (settings.evaluations(every, run, first_step)
                            == evaluations_by_the_loop(every, first_step, end_step, max_steps)), (
                        every, first_step, end_step, max_steps)


def plan_evaluations(data, log, max_steps, *extra):
    """The val and CORE counts of plan's report of the tiny run (0: off)."""
    r = run_cli("plan", *run_args(data, log, "--max_steps", str(max_steps), "--eval_every", "7",
                                  "--core_every", "11", *extra))
    assert r.returncode == 0, r.stderr
    line = r.stdout.split("  evaluations: ", 1)[1].split("\n", 1)[0]
    val, core = re.fullmatch(r"val (\d+) time\(s\); CORE (\d+) time\(s\), .*", line).groups()
    return int(val), int(core)


@pytest.mark.parametrize("max_steps, stop", [(40, ()), (40, ("--stop_step", "23")),
                                             (10**9, ()), (10**9, ("--stop_step", "500000000"))])
def test_plan_counts_the_evaluations_of_any_number_of_steps(data, tmp_path, max_steps, stop):
    """The val passes and CORE evaluations of a plan: those the loop would run, counted by it
    for 40 steps; for the most steps a run may have (which the loop would take minutes to step
    through), ceil(steps / N) and the final model's, worked out here."""
    counts = plan_evaluations(data, str(tmp_path / "log"), max_steps, *stop)
    end_step = int(stop[1]) if stop else max_steps
    if max_steps < 100:
        assert counts == tuple(evaluations_by_the_loop(every, 0, end_step, max_steps)
                               for every in (7, 11))
    else:
        assert counts == tuple(-(-end_step // every) + (end_step == max_steps)
                               for every in (7, 11))
    assert not (tmp_path / "log").exists()
