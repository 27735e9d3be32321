"""The settings of a run: defaults, presets and a resumed checkpoint's flags, --help, one-line
refusals of flags that cannot work (before any work), warnings for flags that look like mistakes,
--device and --dtype."""
import json
import os
import re
import shutil

import pytest
import torch

import common
import rundir
import settings
import train_gpt2 as tg
from helpers import (REPO, SAVES, SHAPE_FLAGS, assert_one_line_error, dir_bytes, newest_step,
                     resume_args, run_args, run_cli, write_corpus_jsonl)


def warnings_in(stdout, flag=""):
    return [line for line in stdout.splitlines() if line.startswith("warning:") and flag in line]


# --------------------------------------------------------------------------------- defaults, --help

def test_preset_defaults_and_overrides():
    args, given, ckpt = settings.read_flags([])
    assert ckpt is None and given == set()
    assert (args.max_lr, args.warmup_steps, args.max_steps, args.weight_decay) == \
        (6e-4, 715, 19073, 0.1)
    assert (args.total_batch_size, args.micro_batch_size, args.sequence_length) == \
        (524288, 64, 1024)
    assert (args.eval_every, args.sample_every, args.save_every, args.seed) == \
        (250, 250, 5000, 1337)
    assert args.data_root == os.path.join(REPO, "edu_fineweb10B") and args.log_dir == "log"
    tiny, given, _ = settings.read_flags(["--preset", "tiny", "--max_steps", "7"])
    assert given == {"preset", "max_steps"}
    assert tiny.sequence_length == 256 and tiny.max_steps == 7 and tiny.warmup_steps == 15
    assert tg.model_config(tiny).n_layer == 4
    two_layers, _, _ = settings.read_flags(["--preset", "tiny", "--n_layer", "2"])
    assert tg.model_config(two_layers).n_layer == 2


def flag_helps(text):
    """{flag: its help, on one line} of an argparse --help."""
    helps, flag = {}, None
    for line in text.splitlines():
        if re.match(r"  -", line):  # "  -T SEQUENCE_LENGTH, --sequence_length ...  help"
            flag = re.findall(r"--[\w-]+", line)[0]
            helps[flag] = line
        elif flag and line.startswith("    "):
            helps[flag] += " " + line
        else:
            flag = None
    return {f: " ".join(h.split()) for f, h in helps.items()}


def help_of(*args):
    r = run_cli(*args, "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return flag_helps(r.stdout)


def test_help_shows_the_presets_defaults_each_once():
    gpt2, tiny = help_of(), help_of("--preset", "tiny")
    assert gpt2["--max_steps"].endswith("(default: 19073)")
    assert gpt2["--n_layer"].endswith("(default: 12)")
    assert tiny["--max_steps"].endswith("(default: 150)")
    assert tiny["--n_layer"].endswith("(default: 4)")
    assert tiny["--sequence_length"].endswith("(default: 256)")
    assert tiny["--preset"].endswith("(default: tiny)")
    assert gpt2.keys() == tiny.keys() and len(gpt2) > 50
    commands = [help_of(command) for command in tg.COMMANDS]
    for helps in (gpt2, tiny, *commands):
        for flag, text in helps.items():
            assert text.count("(default:") <= 1 and "(default: None)" not in text, text
    # a flag with no default says nothing of one
    assert "(default:" not in gpt2["--resume"] and "(default:" not in gpt2["--stop_step"]


def test_boolean_flags_have_a_no_form():
    args, _, _ = settings.read_flags(["--no-fsdp", "--no-overwrite", "--no-bias", "--no-compile"])
    assert (args.fsdp, args.overwrite, args.bias, args.compile) == (False, False, False, False)
    args, _, _ = settings.read_flags(["--fsdp", "--overwrite", "--bias", "--compile"])
    assert (args.fsdp, args.overwrite, args.bias, args.compile) == (True, True, True, True)


@pytest.mark.slow
def test_bad_flag_value_exits_nonzero_without_traceback():
    r = run_cli("--max_steps", "many", subprocess_run=True)  # the real script
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("error: argument --max_steps: expected an integer, not 'many' "
                                "(see --help)")


# ----------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("extra, drop, names", [
    (["--total_batch_size", "0"], (), ["--total_batch_size"]),
    (["--total_batch_size", "-1"], (), ["--total_batch_size"]),
    (["--total_batch_size", "100"], (), ["not divisible"]),
    (["-T", "128"], (), ["-T 128", "block_size 32"]),
    (["--max_steps", "0"], (), ["--max_steps"]),
    (["--max_lr", "-1"], (), ["--max_lr"]),
    (["--max_lr", "nan"], (), ["--max_lr"]),
    # it trains into NaNs, which nothing but the first sample would show
    (["--weight_decay", "inf"], (), ["--weight_decay"]),
    (["--val_tokens", "0"], (), ["--val_tokens"]),  # val is on (--eval_every 3)
    (["--val_steps", "0"], ("--val_tokens",), ["--val_steps"]),
    (["--n_head", "3"], (), ["divisible"]),
    (["--device", "cdua"], (), ["--device", "cdua"]),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"], (),
     ["--device"]),
    (["--sample_tokens", "40"], (), ["--sample_tokens", "block_size"]),  # prompt + 40 > 32
    (["--resume", "latest"], (), ["no model_*.pt"]),
    (["--resume", "latest", "--init_from", "gpt2"], (), ["--resume", "--init_from"]),
    (["--init_from", "gpt2"], (), ["--init_from", "--n_layer"]),  # the weights give the shape
    (["--init_from", "gpt2", "--n_kv_head", "1"], SHAPE_FLAGS, ["--init_from", "--n_kv_head"]),
    (["--seed", "-1"], (), ["--seed", "numpy's seed range"]),
    (["--seed", "99999999999999999999"], (), ["--seed", "numpy's seed range"]),
    (["--max_lr", "1e39"], (), ["--max_lr", "3.4e38"]),  # inf in the optimizer's float32
    (["--optimizer", "muon", "--muon_lr", "1e39"], (), ["--muon_lr", "3.4e38"]),
    (["--data_root", ""], (), ["--data_root is empty"]),
])
def test_bad_flags_are_one_line_before_any_work(data, tmp_path, extra, drop, names):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, *extra, drop=drop))
    assert_one_line_error(r, *names)
    assert not os.path.exists(log)  # refused before the log dir was made, let alone locked


@pytest.mark.parametrize("extra, message", [
    (["--resume", "latest", "--overwrite"],
     "--resume and --overwrite do not go together: give one"),
    (["--val_tokens", "64", "--val_steps", "2"],
     "--val_tokens and --val_steps do not go together: give one"),
])
def test_flags_that_do_not_go_together_are_one_line(data, reference, tmp_path, extra, message):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)  # a run to resume, or to overwrite
    before = dir_bytes(log)
    r = run_cli(*run_args(data, log, *extra))
    assert assert_one_line_error(r) == f"error: {message}"
    assert dir_bytes(log) == before


@pytest.mark.slow
def test_missing_data_offline_is_one_line_naming_input(tmp_path):
    # tries to prepare FineWeb-Edu there, offline: says --input reads local files instead
    r = run_cli(*run_args(str(tmp_path / "no" / "data"), str(tmp_path / "log")))
    assert_one_line_error(r, "--input")
    assert os.listdir(tmp_path) == ["no"]  # no log dir left behind by the failed prep


@pytest.mark.parametrize("flag", ["--log_dir", "--data_root"])
def test_a_file_where_a_folder_goes_is_one_line(data, tmp_path, flag):
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    args = run_args(data, str(tmp_path / "log"), flag, str(path))  # the later flag wins
    assert_one_line_error(run_cli(*args), flag, str(path))
    assert path.read_text() == "my notes\n" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


@pytest.mark.parametrize("prompt", ["", "<|endoftext|>Once upon a time"])
def test_sample_prompts_the_flag_check_accepts_also_sample(data, tmp_path, prompt):
    # the check encodes the prompt before any work; the sampler must encode it the same way, not
    # fail at step N
    r = run_cli(*run_args(data, str(tmp_path / "log"), "--max_steps", "4", "--eval_every", "0",
                          "--sample_prompt", prompt))
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("rank 0 sample 0:")]


# ----------------------------------------------------------------------------------------- warnings

@pytest.mark.parametrize("flags, unused", [
    (["--eval_every", "0", "--val_tokens", "100"], "--val_tokens"),
    (["--eval_every", "0", "--val_steps", "3"], "--val_steps"),
    (["--sample_every", "0", "--sample_tokens", "9"], "--sample_tokens"),
    (["--hellaswag_every", "0", "--hellaswag_limit", "9"], "--hellaswag_limit"),
    (["--batch_ramp_start", "4096"], "--batch_ramp_start"),
    (["--profile_schedule", "0,0,1"], "--profile_schedule"),
    (["--wandb_run_name", "x"], "--wandb_run_name"),
    (["--muon_lr", "0.01"], "--muon_lr"),
])
def test_flags_for_a_part_that_is_off_are_stated(capsys, tmp_path, flags, unused):
    tg.settle([*flags, "--preset", "tiny", "--device", "cpu", "--log_dir", str(tmp_path / "log"),
               "--data_root", str(tmp_path / "data")])  # stated before any work
    out = capsys.readouterr().out
    assert [w for w in warnings_in(out, unused) if "no effect" in w], out


def test_start_up_warnings_once_and_keep_last(data, reference, tmp_path):
    log, corpus = str(tmp_path / "log"), str(tmp_path / "corpus.jsonl")
    write_corpus_jsonl(corpus, n_docs=5)
    # --input only prepares an empty data_root: with shards there it is stated, not ignored
    r = run_cli(*run_args(data, log, *SAVES, "--warmup_steps", "8", "--keep_last", "2",
                         "--input", corpus))
    assert r.returncode == 0, r.stderr
    before_the_run = r.stdout.split("run config:")[0]  # the flag checks, at start-up
    for flag in ("--warmup_steps", "--input"):
        assert len(warnings_in(r.stdout, flag)) == 1 == len(warnings_in(before_the_run, flag)), \
            r.stdout
    # the two newest of the checkpoints an unpruned run writes
    names = [os.path.basename(p) for p in rundir.find_checkpoints(reference)]
    assert [os.path.basename(p) for p in rundir.find_checkpoints(log)] == names[-2:]


@pytest.mark.slow
def test_val_tokens_past_the_val_shards_warn_once(data, tmp_path):
    r = run_cli(*run_args(data, str(tmp_path / "log"), "--val_tokens", "100000", "--max_steps", "2",
                          "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines()
                if "the val shards hold 2,999 targets" in line]
    assert len(warnings) == 1


# ----------------------------------------------------------------------------------------- --resume

def test_parse_args_reads_the_resume_checkpoint_once(reference, tmp_path, monkeypatch):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    loads, reads = [], []
    real_load, real_read = torch.load, rundir.read_checkpoint

    def load(*a, **k):
        loads.append(a[0])
        return real_load(*a, **k)

    def read_checkpoint(*a, **k):
        reads.append(a[0])
        return real_read(*a, **k)
    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(rundir, "read_checkpoint", read_checkpoint)
    newest = rundir.find_checkpoints(log)[-1]
    r = run_cli(*resume_args(log))  # step 7 of 8: only the final evaluation is left
    assert r.returncode == 0, r.stderr
    assert f"resumed from {newest} at step 8" in r.stdout
    assert reads == [newest] and loads == [newest]


@pytest.mark.slow
def test_resume_latest_takes_a_non_default_shape_from_the_checkpoint(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--n_layer", "2", "--n_head", "4", "--n_embd", "16",
                          "--block_size", "48", "--sample_every", "0", "--eval_every", "0",
                          "--stop_step", "2"))
    assert r.returncode == 0, r.stderr
    first = torch.load(rundir.find_checkpoints(log)[-1], weights_only=False)["config"]
    assert (first["n_layer"], first["n_head"], first["n_embd"], first["block_size"]) == \
        (2, 4, 16, 48)
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert torch.load(rundir.find_checkpoints(log)[-1], weights_only=False)["config"] == first


def test_resume_flags_checked_against_the_checkpoint(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--sample_every", "0", "--max_steps", "4", "--val_steps", "1",
                          "--stop_step", "2", drop=("--val_tokens",)))
    assert r.returncode == 0, r.stderr
    at = newest_step(log)
    before = dir_bytes(log)
    # a resume that would train nothing (a stop or an end at or before the checkpoint) is a
    # mistake, not a no-op
    for flags in (["--stop_step", str(at + 1)], ["--max_steps", str(at)]):
        assert_one_line_error(run_cli(*resume_args(log, *flags)), "nothing to train")
        assert dir_bytes(log) == before
    # the warmup warning is about the run as it goes on: the checkpoint's --max_steps, not the
    # default's; --val_tokens given now replaces the checkpoint's --val_steps (they set one
    # number), not dropped in silence
    r = run_cli(*resume_args(log, "--warmup_steps", "6", "--val_tokens", "128"))
    assert r.returncode == 0, r.stderr
    assert warnings_in(r.stdout, "--warmup_steps"), r.stdout
    saved = json.load(open(os.path.join(log, "run_config.json")))
    assert saved["val_tokens"] == 128 and saved["val_steps"] is None


@pytest.mark.slow
def test_resume_states_a_new_schedule_and_refuses_new_shapes(data, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, *SAVES, "--sample_every", "0", "--stop_step", "4",
                          "--keep_last", "1"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*resume_args(log, "--max_steps", "12", "--stop_step", "6"))
    assert r.returncode == 0, r.stderr
    warning = [line for line in r.stdout.splitlines() if "gets LR" in line]
    old = tg.get_lr(4, 2e-3, 2e-4, 2, 8)
    new = tg.get_lr(4, 2e-3, 2e-4, 2, 12)
    assert warning and f"step 4 gets LR {new:.4e}" in warning[0] and f"{old:.4e}" in warning[0]
    assert warnings_in(r.stdout, "--max_steps is 12 now but was 8 in the checkpoint")
    # --keep_last is this invocation's: the checkpoint's 1 did not come along
    assert [rundir.checkpoint_step(p) for p in rundir.find_checkpoints(log)] == [3, 4, 5]
    before = dir_bytes(log)
    for flags, names in ((["-T", "16"], ["sequence_length=32", "sequence_length=16"]),
                         (["--preset", "gpt2"], ["preset=tiny", "preset=gpt2"])):
        assert_one_line_error(run_cli(*resume_args(log, *flags)), *names)
    assert dir_bytes(log) == before


def test_values_from_the_checkpoint_are_checked_when_their_block_comes_on(reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    newest = rundir.find_checkpoints(log)[-1]
    ckpt = torch.load(newest, weights_only=False)
    ckpt["args"].update(eval_every=0, val_tokens=0)  # a val size no flag can give
    torch.save(ckpt, newest)
    before = dir_bytes(log)
    r = run_cli("--resume", newest, "--log_dir", log, "--device", "cpu", "--max_steps", "10",
                "--eval_every", "2")
    assert_one_line_error(r, newest, "its flag val_tokens is 0")
    assert dir_bytes(log) == before


# -------------------------------------------------------------------------------- --device, --dtype

def test_device_strings(monkeypatch):
    assert common.resolve_device("cpu") == "cpu"
    expected = "cuda" if torch.cuda.is_available() else (
        "mps" if torch.backends.mps.is_available() else "cpu")
    assert common.resolve_device("auto") == expected
    bad = ["cdua", "cuda:x", "gpu", "", "meta", "cuda:99"]
    if not torch.cuda.is_available():
        bad += ["cuda", "cuda:1"]
    for name in bad:
        with pytest.raises(common.UsageError, match="--device") as e:
            common.resolve_device(name)
        assert "\n" not in str(e.value) and repr(name) in str(e.value)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(common.UsageError, match="mps"):
        common.resolve_device("mps")


def test_autocast_and_tf32():
    x = torch.randn(4, 4)
    with common.autocast("cpu", None):
        assert (x @ x).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    with common.autocast("cpu", torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    assert common.autocast_for("auto", "cpu")[1] == "fp32"  # auto: a GPU's dtype, fp32 on a CPU
    assert common.autocast_for("bf16", "cpu")[1] == "bf16"
    assert common.autocast_for("fp16", "cpu")[1] == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        common.tune_for_device("cpu")
        common.tune_for_device("mps")
        assert torch.get_float32_matmul_precision() == "highest"
        common.tune_for_device("cuda:1")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_shards_without_a_manifest_train_after_a_warning(data, tmp_path):
    # the test shards are written by hand, as another tool would: nothing vouches for them
    r = run_cli(*run_args(data, str(tmp_path / "log"), "--max_steps", "1", "--sample_every", "0"))
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stdout.splitlines() if "has no manifest.json" in line]
    assert warned == [f"warning: {data} has no manifest.json: its shards were not written by "
                      f"fineweb.py (or lost their record), so they are not checked against a prep"]
