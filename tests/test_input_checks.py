"""Every input checked before work: each flag bounded by what it can mean, an old
spelling beside its new one refused, whole flag names only; every field of a checkpoint checked
where it is read, --resume latest falling back past a bad one; nothing built that the machine
cannot hold (plan of gpt2-xl on a CPU, a CPU run of hours warned of first); fp16 on a CPU; the
refusals' one line (no run config before it, torchrun's error file); a stop before any checkpoint;
the summary's skipped steps, -B auto's share of a host, --keep_last of this invocation."""
import contextlib
import functools
import glob
import io
import json
import os
import shutil
import signal
import sys
import traceback

import pytest
import torch

import common
import fineweb
import hellaswag
import rundir
import settings
import train_gpt2 as tg
from helpers import (SAVES, CliResult, assert_one_line_error, resume_args, run_args, run_cli,
                     series, write_corpus_jsonl)

HUGE = "99999999999999999999999"  # more than any flag can mean


def run_main(main, *args):
    """fineweb.py's or hellaswag.py's main(args) in this process, as run_cli runs train_gpt2.py's:
    its exit status (argparse's SystemExit taken as one) and output; an exception that left it in
    stderr with its traceback."""
    out, err, exception = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception as e:
            traceback.print_exc()
            code, exception = 1, e
    return CliResult(code, out.getvalue(), err.getvalue(), exception)


def no_work(*args, **kwargs):
    raise AssertionError("work started after flags that should have been refused")


def only_fake_models(monkeypatch):
    """tg.GPT that builds a model only on fake tensors (settings.fake_tensors: no memory); a real
    one is recorded in the returned list and refused, so that a test of a model too large for
    the machine never allocates it."""
    from torch._subclasses.fake_tensor import FakeTensor

    real_gpt, built = tg.GPT, []

    def gpt(config, *args, **kwargs):
        if not isinstance(torch.empty(0), FakeTensor):
            built.append(config)
            raise AssertionError(f"a real model was built: {config}")
        return real_gpt(config, *args, **kwargs)
    monkeypatch.setattr(tg, "GPT", gpt)
    return built


def damaged_copy(reference, tmp_path, change, name="model_00007.pt"):
    """A copy of the reference run's log dir whose checkpoint `name` change(ckpt) rewrote:
    (the log dir, that checkpoint's path)."""
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    path = os.path.join(log, name)
    ckpt = torch.load(path, weights_only=True)
    change(ckpt)
    torch.save(ckpt, path)
    return log, path


def assert_fell_back(r, log, bad, *named):
    """--resume latest warned that it skipped `bad` (naming each of named) and resumed from the
    previous checkpoint, model_00006.pt, at step 7."""
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) == 1 and bad in warnings[0], r.stdout
    for part in named:
        assert part in warnings[0], warnings[0]
    assert f"resumed from {os.path.join(log, 'model_00006.pt')} at step 7" in r.stdout, r.stdout


# ===== plan answers for gpt2-xl on a CPU without building or timing it ============================
@pytest.mark.slow
def test_plan_of_gpt2_xl_on_a_cpu_times_no_step_and_builds_no_model(data, tmp_path,
                                                                      monkeypatch):
    built = only_fake_models(monkeypatch)
    monkeypatch.setattr(settings, "measure_micro_step", no_work)
    r = run_cli("plan", "--preset", "gpt2-xl", "--device", "cpu", "--data_root", data,
                "--log_dir", str(tmp_path / "log"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert built == []
    lines = r.stdout.splitlines()
    assert any(line.startswith("plan: 1,5") and " parameters on 1 x cpu" in line
               for line in lines), r.stdout
    # the estimate and the verdict: 64 sequences of 1,024 tokens of gpt2-xl fit no CPU's memory
    memory = r.stdout.split("  memory: ")[1].split("  compute: ")[0]
    assert "a step's estimated peak" in memory and "it does not fit" in memory, r.stdout
    assert any(line.startswith("  time: at least ") for line in lines), r.stdout
    assert not os.path.exists(tmp_path / "log")


# gpt2-xl takes a minute or more to count on fake tensors on 2 cores; two of gpt2's
# blocks (still over a GiB a step, still days of CPU time) a second or two
MODELS = [pytest.param(["--preset", "gpt2", "--n_layer", "2"], id="gpt2-2-layers"),
          pytest.param(["--preset", "gpt2-xl"], id="gpt2-xl", marks=pytest.mark.slow)]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_a_training_step_the_machine_cannot_hold_is_refused_before_any_work(tmp_path,
                                                                           monkeypatch, model):
    """A step estimated (on fake tensors) above the machine's memory is
    one line before anything is built or prepared (a machine of 256 MiB: the fp32 weights,
    gradients and AdamW's state of two gpt2 blocks and its embeddings alone are over 800)."""
    built = only_fake_models(monkeypatch)
    monkeypatch.setattr(tg, "make_loaders", no_work)
    monkeypatch.setattr(settings, "device_memory", lambda device, processes=1:
                        (2**28, "a test's 256 MiB"), raising=False)
    log = str(tmp_path / "log")
    r = run_cli(*model, "-B", "1", "--device", "cpu", "--data_root", str(tmp_path / "data"),
                "--log_dir", log)
    assert_one_line_error(r, "-B 1", "a test's 256 MiB", "--preset tiny")
    assert built == [] and not os.path.exists(log)


TINY_SHAPE = ("--n_layer", "2", "--n_embd", "64", "--n_head", "2", "-T", "64",
              "--block_size", "64")
BOUNDED = [
    pytest.param(["--preset", "tiny", *TINY_SHAPE], id="tiny", marks=pytest.mark.slow),
    pytest.param(["--preset", "tiny", "--arch", "modern", "--dtype", "bf16", "--dropout", "0.2",
                  *TINY_SHAPE], id="tiny-modern-muon-bf16-dropout"),
    pytest.param(["--preset", "tiny", "--dtype", "fp16", *TINY_SHAPE, "--n_head", "4",
                  "--n_kv_head", "1"], id="tiny-fp16-mqa", marks=pytest.mark.slow),
    pytest.param(["--preset", "gpt2", "--dropout", "0.1"], id="gpt2-dropout",
                 marks=pytest.mark.slow),
    pytest.param(["--preset", "gpt2", "--arch", "modern"], id="gpt2-modern",
                 marks=pytest.mark.slow)]


@pytest.mark.parametrize("flags", BOUNDED)
def test_the_memory_bound_is_at_least_twice_the_counted_step(flags):
    """settings.step_memory_bound, which spares a run the count on fake tensors where it fits
    anyway, against that count (train_gpt2.estimate_step's), at two micro-batches."""
    run, _, _ = tg.settle(["--device", "cpu", *flags], planning=True)  # planning: not refused
    peak, n_params, _ = tg.count_step(run)
    for B in (1, 4):
        bound = settings.step_memory_bound(run.model, n_params, B, run.sequence_length)
        assert bound >= 2 * peak(B), (B, bound, peak(B))


def test_a_step_is_counted_only_where_the_bound_does_not_fit(monkeypatch, tmp_path):
    """The tiny run on this machine: the bound fits, nothing is counted. On a machine below the
    bound but above the step: counted, and the run goes on. Below the step: refused with the
    count's figure."""
    counted = []
    real_state = settings.with_optimizer_state

    def with_optimizer_state(*args):  # called once before a step's first count
        counted.append(args)
        real_state(*args)
    monkeypatch.setattr(settings, "with_optimizer_state", with_optimizer_state)
    monkeypatch.setattr(tg, "STEP_ESTIMATES", {})
    flags = ["--device", "cpu", "--preset", "tiny", *TINY_SHAPE, "-B", "1",
             "--data_root", str(tmp_path / "unread"), "--log_dir", str(tmp_path / "log")]
    tg.settle(flags)
    assert counted == []

    run, _, _ = tg.settle(flags, planning=True)
    peak, n_params, _ = tg.estimate_step(run)
    bound = settings.step_memory_bound(run.model, n_params, 1, run.sequence_length)
    need = peak(1)
    tg.STEP_ESTIMATES.clear()
    monkeypatch.setattr(settings, "device_memory", lambda device, processes=1:
                        (bound - 1, "a test's memory"))
    tg.settle(flags)  # counted: it fits
    assert len(counted) == 2  # estimate_step's count above, then this one

    monkeypatch.setattr(settings, "device_memory", lambda device, processes=1:
                        (need - 1, "a test's memory"))
    with pytest.raises(common.UsageError, match=rf"needs about {settings.gib(need)} "
                                                rf"\(estimated\), more than a test's"):
        tg.settle(flags)
    assert len(counted) == 2  # the count above, kept


# ===== a non-tensor in a checkpoint's model =======================================================
def non_tensor(ckpt):
    ckpt["model"]["transformer.wpe.weight"] = "abc"


def test_a_non_tensor_in_the_model_is_one_line_for_every_command(reference, tmp_path):
    _, bad = damaged_copy(reference, tmp_path, non_tensor)
    for command in (["sample", "--checkpoint", bad, "--device", "cpu", "--num_samples", "1",
                     "--max_new_tokens", "2"],
                    ["export", "--checkpoint", bad, "--out", str(tmp_path / "hf")],
                    ["eval", "--checkpoint", bad, "--device", "cpu", "--hellaswag_dir",
                     str(tmp_path / "hellaswag")],
                    ["--resume", bad, "--log_dir", str(tmp_path / "other"), "--device", "cpu"]):
        assert_one_line_error(run_cli(*command), bad, "transformer.wpe.weight", "not a tensor")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "other").exists()


@pytest.mark.slow
def test_resume_latest_falls_back_past_a_non_tensor_in_the_model(reference, tmp_path):
    log, bad = damaged_copy(reference, tmp_path, non_tensor)
    r = run_cli(*resume_args(log))
    assert_fell_back(r, log, bad, "transformer.wpe.weight")
    assert series(log)["train"][0] == list(range(8))  # step 7 trained again, after step 6's


# ===== a checkpoint's step and args ===============================================================
BAD_FIELD_CASES = {
    "step abc": (lambda c: c.update(step="abc"), "'step'"),
    "step -7": (lambda c: c.update(step=-7), "'step'"),
    "max_lr abc": (lambda c: c["args"].update(max_lr="abc"), "max_lr"),
}


@pytest.mark.parametrize("case", BAD_FIELD_CASES)
def test_a_bad_step_or_flag_in_a_checkpoint_is_one_line(reference, tmp_path, case):
    change, field = BAD_FIELD_CASES[case]
    _, bad = damaged_copy(reference, tmp_path, change)
    other = str(tmp_path / "other")
    assert_one_line_error(run_cli("--resume", bad, "--log_dir", other, "--device", "cpu"), bad,
                          field)
    assert not os.path.exists(other)


@pytest.mark.parametrize("case", BAD_FIELD_CASES)
def test_resume_latest_falls_back_past_a_bad_step_or_flag(reference, tmp_path, case):
    change, field = BAD_FIELD_CASES[case]
    log, bad = damaged_copy(reference, tmp_path, change)
    r = run_cli(*resume_args(log))
    assert_fell_back(r, log, bad, field)
    assert "resuming at step -6" not in r.stdout
    # the damaged newest checkpoint is moved aside after the step resumed from, never "-0007"
    assert [os.path.basename(p) for p in glob.glob(os.path.join(log, "after_step_*"))] == \
        ["after_step_00006"]


# ===== an old spelling beside its new one =========================================================
def test_fineweb_local_dir_with_data_root_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(fineweb, "prepare", no_work)
    corpus = write_corpus_jsonl(str(tmp_path / "corpus.jsonl"), n_docs=5)
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    r = run_main(fineweb.main, "--local_dir", a, "--data_root", b, "--input", corpus,
                 "--num_proc", "1")
    assert_one_line_error(r, "--local_dir", "--data_root")
    assert not os.path.exists(a) and not os.path.exists(b)


def test_eval_and_hellaswag_data_dir_with_hellaswag_dir_is_one_line(reference, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(hellaswag, "score", no_work)
    monkeypatch.setattr(hellaswag, "download", no_work)
    x, y = str(tmp_path / "X"), str(tmp_path / "Y")
    newest = rundir.find_checkpoints(reference)[-1]
    r = run_cli("eval", "--checkpoint", newest, "--device", "cpu", "--data_dir", x,
                "--hellaswag_dir", y)
    assert_one_line_error(r, "--data_dir", "--hellaswag_dir")
    r = run_main(hellaswag.main, "-m", "gpt2", "-d", "cpu", "--data_dir", x, "--hellaswag_dir", y)
    assert_one_line_error(r, "--data_dir", "--hellaswag_dir")


# ===== integer flags bounded by what they can mean ================================================
@pytest.mark.parametrize("flag", ["--num_samples", "--block_size", "--n_layer"])
def test_a_huge_training_flag_is_one_line_before_any_work(data, tmp_path, monkeypatch, flag):
    monkeypatch.setattr(tg, "GPT", no_work)  # the old code built --n_layer's blocks until OOM
    monkeypatch.setattr(tg, "make_loaders", no_work)
    log = str(tmp_path / "log")
    assert_one_line_error(run_cli(*run_args(data, log, flag, HUGE)), flag)
    assert not os.path.exists(log)


def test_a_huge_sample_count_is_one_line(reference, monkeypatch):
    monkeypatch.setattr(tg, "sample_texts", no_work)
    newest = rundir.find_checkpoints(reference)[-1]
    r = run_cli("sample", "--checkpoint", newest, "--device", "cpu", "--max_new_tokens", "2",
                "--num_samples", HUGE)
    assert_one_line_error(r, "--num_samples")


@pytest.mark.parametrize("flag, value", [("--shard_size", HUGE), ("--num_proc", "100000")])
def test_fineweb_shard_size_and_workers_are_bounded(tmp_path, monkeypatch, flag, value):
    monkeypatch.setattr(fineweb, "prepare", no_work)  # the old code started 100000 workers
    corpus = write_corpus_jsonl(str(tmp_path / "corpus.jsonl"), n_docs=5)
    out = str(tmp_path / "out")
    args = ["--input", corpus, "--data_root", out, "--num_proc", "1", flag, value]
    assert_one_line_error(run_main(fineweb.main, *args), flag)
    assert not os.path.exists(out)


# ===== The rough edges ============================================================================
def test_fp16_on_a_cpu_is_warned_of_with_the_reason(data, tmp_path, capsys):
    run, _, _ = tg.settle(run_args(data, str(tmp_path / "log"), "--dtype", "fp16"))
    assert run.precision.name == "fp16" and run.device_type == "cpu"
    warnings = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("warning:") and "fp16" in line]
    assert len(warnings) == 1 and "CPU" in warnings[0] and "slower" in warnings[0], warnings
    assert "--dtype fp32" in warnings[0]


@pytest.mark.parametrize("given, meant", [(["--max_step", "10"], "--max_steps"),
                                          (["--lr", "1e-3"], "--max_lr")])
def test_a_flag_is_its_whole_name_and_a_wrong_one_points_at_the_real_one(data, tmp_path, given,
                                                                         meant):
    log = str(tmp_path / "log")
    line = assert_one_line_error(run_cli(*run_args(data, log, *given)), given[0],
                                 f"did you mean {meant}?")
    assert "unrecognized arguments" in line
    assert not os.path.exists(log)


@pytest.mark.parametrize("model", MODELS)
def test_a_cpu_run_of_hours_is_warned_of_before_data_prep_and_any_model(tmp_path, monkeypatch,
                                                                        model):
    """--preset gpt2-xl (or two of gpt2's blocks) -B 1 on a CPU, on a machine with room for its
    step (1 TiB: the warning, not the refusal above, is what this checks): the warning pointing
    at --preset tiny comes before data preparation, which fails offline on an empty --data_root,
    and before any model is built; the run then ends with one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(settings, "device_memory", lambda device, processes=1:
                        (2**40, "a test's 1024.0 GiB"), raising=False)
    built = only_fake_models(monkeypatch)
    before_data, real_loaders = [], tg.make_loaders

    def make_loaders(*args, **kwargs):
        before_data.append(sys.stdout.getvalue())  # run_cli's: what was printed so far
        return real_loaders(*args, **kwargs)
    monkeypatch.setattr(tg, "make_loaders", make_loaders)
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli(*model, "-B", "1", "--device", "cpu", "--data_root", str(empty),
                "--log_dir", str(tmp_path / "log"))
    assert_one_line_error(r)
    assert built == []
    warned = [line for line in r.stdout.splitlines()
              if line.startswith("warning:") and "--preset tiny" in line]
    assert len(warned) == 1 and "takes at least" in warned[0] and "days" in warned[0], r.stdout
    assert len(before_data) == 1 and warned[0] in before_data[0]


def test_a_stop_before_any_checkpoint_says_nothing_was_saved(tmp_path, capsys):
    proc = common.Proc(environ={})
    code = rundir.report_failure(rundir.Stopped(signal.SIGTERM), 3, str(tmp_path), -1, proc)
    out = capsys.readouterr().out
    assert code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM at step 3" in out and "nothing was saved" in out, out
    assert "--resume" not in out


def test_a_run_stopped_before_its_first_save_says_nothing_was_saved(data, tmp_path, monkeypatch):
    """A real run stopped by SIGTERM during step 0's val loss, before any checkpoint."""
    real_evaluate = tg.evaluate_loss

    def evaluate_loss(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the run's handler raises Stopped here
        return real_evaluate(*args, **kwargs)
    monkeypatch.setattr(tg, "evaluate_loss", evaluate_loss)
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log))
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert rundir.find_checkpoints(log) == []
    assert "stopped by SIGTERM at step 0, before any checkpoint: nothing was saved" in r.stdout
    assert "--resume latest" not in r.stdout + r.stderr


def test_a_refusal_after_parsing_comes_without_the_run_config(data, reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)  # a log dir holding an earlier run
    r = run_cli(*run_args(data, log))
    assert_one_line_error(r, log, "--overwrite")
    assert "run config:" not in r.stdout, r.stdout


@pytest.mark.parametrize("bad, flag", [(["--max_lr", "-1"], "--max_lr"),
                                       (["--max_step", "10"], "--max_step")])
def test_a_refused_flag_is_in_torchruns_error_file(data, tmp_path, monkeypatch, bad, flag):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    line = assert_one_line_error(run_cli(*run_args(data, str(tmp_path / "log"), *bad)), flag)
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"].startswith("error: ") and flag in recorded["message"], recorded
    assert line.startswith(recorded["message"]), (line, recorded)


@pytest.mark.slow
def test_a_resumed_runs_summary_counts_this_sessions_skipped_steps(data, tmp_path, monkeypatch):
    """fp16 steps skipped (a loss scale far too high, as in test_fp16.py) before the stop; resumed
    in fp32 none are: the second summary has no skipped steps, log.txt keeps the first's."""
    scaler = functools.partial(torch.amp.GradScaler, init_scale=2.0**40, backoff_factor=2.0**-8)
    monkeypatch.setattr(torch.amp, "GradScaler", scaler)
    log = str(tmp_path / "log")
    flags = ["-B", "1", "-T", "8", "--total_batch_size", "8", "--max_steps", "5",
             "--eval_every", "0", "--sample_every", "0"]
    first = run_cli(*run_args(data, log, *flags, "--dtype", "fp16", "--stop_step", "2"))
    assert first.returncode == 0, first.stderr
    skipped = series(log)["skipped"]
    assert skipped[0] and skipped[0][0] == 0, skipped  # step 0 overflowed at 2^40
    assert f"  skipped steps (fp16 overflow): {len(skipped[0])}" in first.stdout, first.stdout
    second = run_cli(*resume_args(log, "--dtype", "fp32"))
    assert second.returncode == 0, second.stderr
    assert "run summary: steps 2-4" in second.stdout, second.stdout
    assert "skipped steps" not in second.stdout, second.stdout
    assert series(log)["skipped"] == skipped  # log.txt's count: the run's, as it was


def test_b_auto_shares_a_hosts_memory_among_its_processes(data, tmp_path, monkeypatch, capsys):
    whole, of_whole = settings.memory_budget("cpu")
    half, of_half = settings.memory_budget("cpu", 2)
    assert half == pytest.approx(whole / 2) and of_half.startswith("1/2 of "), of_half
    memory, _ = settings.device_memory("cpu", processes=2)
    assert memory == pytest.approx(settings.device_memory("cpu")[0] / 2)

    # a process of two on this host (LOCAL_WORLD_SIZE; no RANK/WORLD_SIZE: no process group)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    run, proc, _ = tg.settle(run_args(data, str(tmp_path / "log"), "-B", "auto",
                                      "--max_steps", "2"))
    assert not proc.distributed and run.world_size == 1 and run.local_world_size == 2
    assert run.micro_batch_fit["memory_budget_gib"] == round(half / 2**30, 2)
    fitted = [line for line in capsys.readouterr().out.splitlines() if line.startswith("-B auto")]
    assert len(fitted) == 1 and "1/2 of this machine's" in fitted[0], fitted


def test_keep_last_is_this_invocations(data, tmp_path):
    """A run that kept its newest checkpoint only, resumed without --keep_last, keeps them all."""
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, *SAVES, "--keep_last", "1", "--stop_step", "5"))
    assert r.returncode == 0, r.stderr
    assert [os.path.basename(p) for p in rundir.find_checkpoints(log)] == ["model_00004.pt"]
    assert torch.load(rundir.find_checkpoints(log)[-1], weights_only=True)["args"]["keep_last"] == 1
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert [os.path.basename(p) for p in rundir.find_checkpoints(log)] == \
        ["model_00004.pt", "model_00006.pt", "model_00007.pt"]


# ===== Refused before any work: the data, the micro-steps, the log dir ============================
def no_model_no_data(monkeypatch):
    """A run that builds a real model (not one on fake tensors) or reads or prepares data fails
    the test."""
    only_fake_models(monkeypatch)
    monkeypatch.setattr(tg, "make_loaders", no_work)


@pytest.mark.parametrize("B, T, split, tokens", [("200", "32", "train", "6,000"),
                                                 ("100", "32", "val", "3,000")])
def test_shards_too_small_for_a_batch_are_refused_before_the_run_config(data, tmp_path,
                                                                       monkeypatch, B, T, split,
                                                                       tokens):
    """The tiny run's shards (6,000 train, 3,000 val tokens) cannot fill one batch of -B x -T:
    one line naming the split, its size and both flags, before the run config is printed, any
    model is built or the data is opened, and no log dir is made."""
    no_model_no_data(monkeypatch)
    log = str(tmp_path / "log")
    total = str(int(B) * int(T))
    r = run_cli(*run_args(data, log, "-B", B, "-T", T, "--block_size", T,
                          "--total_batch_size", total))
    assert_one_line_error(r, f"hold {tokens} {split} tokens", f"-B {B} x -T {T} + 1", "smaller -B")
    assert "run config:" not in r.stdout and not os.path.exists(log)


def test_a_step_of_too_many_micro_steps_is_refused_with_the_numbers_and_the_flag(data, tmp_path,
                                                                                monkeypatch):
    """--total_batch_size 10^12 in micro-steps of 2 x 32 tokens: 15,625,000,000 micro-steps a
    step, refused with the numbers and the flag that insists; -B auto's search of the divisors of
    a huge step is no hang either. --max_micro_steps insists."""
    no_model_no_data(monkeypatch)
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--total_batch_size", str(10**12)))
    line = assert_one_line_error(r, "15,625,000,000 micro-steps of -B 2 x -T 32",
                                 f"--max_micro_steps {settings.MICRO_STEPS:,}",
                                 "--max_micro_steps 15625000000")
    assert "run config:" not in r.stdout and not os.path.exists(log), line
    assert settings.divisors(720) == [d for d in range(1, 721) if 720 % d == 0]
    n = 10**12 // 32  # 2^7 * 5^12: a search by trial division up to n would take hours
    assert settings.divisors(n)[-3:] == [n // 4, n // 2, n]
    monkeypatch.undo()
    flags = run_args(data, log, "-B", "1", "--total_batch_size", "128", "--max_steps", "2")
    assert_one_line_error(run_cli(*flags, "--max_micro_steps", "2"), "4 micro-steps",
                          "--max_micro_steps 4")
    run, _, _ = tg.settle([*flags, "--max_micro_steps", "4"])
    assert run.grad_accum_steps == 4


def test_a_tiny_run_of_hours_on_a_cpu_is_warned_of_without_the_tiny_hint(data, tmp_path, capsys):
    run, _, _ = tg.settle(run_args(data, str(tmp_path / "log"), "--max_steps", "1000000",
                                   "--total_batch_size", "65536", "-B", "32"))
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if "takes at least" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: on this CPU"), out
    assert "--preset" not in warned[0] and run.preset == "tiny"


def test_plan_computes_its_time_once_and_prints_it_once(data, tmp_path, monkeypatch):
    """Two of gpt2's blocks on a CPU, too slow to time: the matmul rate is measured once, and
    the "at least" figure comes in the report alone, with the tiny hint; nothing is written."""
    only_fake_models(monkeypatch)
    rates = []

    def matmul_flops(device, n=512, repeats=8):
        rates.append(device)
        return 1e9
    monkeypatch.setattr(settings, "matmul_flops", matmul_flops)
    log = str(tmp_path / "log")
    r = run_cli("plan", "--preset", "gpt2", "--n_layer", "2", "--device", "cpu",
                "--data_root", data, "--log_dir", log)
    assert r.returncode == 0, r.stderr
    figures = [line for line in r.stdout.splitlines() if "at least" in line]
    assert len(figures) == 1 and figures[0].startswith("  time: at least "), r.stdout
    assert figures[0].endswith(": for a run of minutes use --preset tiny"), figures
    assert rates == ["cpu"] and not os.path.exists(log)


# ===== Nothing left behind, the fix named =========================================================
@pytest.mark.slow
def test_a_run_refused_after_its_data_prep_leaves_no_log_dir(tmp_path, monkeypatch):
    """Local text too short for one batch is refused right after its prep (only tokenizing tells
    its size), before any model is built; the log dir the run had made goes again. An input file
    that is not there is refused before any work."""
    only_fake_models(monkeypatch)
    corpus, data, log = str(tmp_path / "c.jsonl"), str(tmp_path / "data"), str(tmp_path / "log")
    write_corpus_jsonl(corpus, n_docs=2)
    flags = run_args(data, log, "-B", "8", "--total_batch_size", "256", drop=("--val_tokens",))
    assert_one_line_error(run_cli(*flags, "--input", str(tmp_path / "no.txt")), "no.txt")
    assert not os.path.exists(data) and not os.path.exists(log)
    assert_one_line_error(run_cli(*flags, "--input", corpus), "-B 8 x -T 32 + 1", "smaller -B")
    assert fineweb.split_sizes(data) is not None and not os.path.exists(log)


def test_a_missing_checkpoint_names_those_its_folder_holds(reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    missing = os.path.join(log, "model_00009.pt")
    assert_one_line_error(run_cli("--resume", missing, "--log_dir", log, "--device", "cpu"),
                          f"checkpoint not found: {missing} ({log} holds model_00002.pt, "
                          f"model_00004.pt, model_00006.pt, model_00007.pt)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(run_cli("sample", "--checkpoint", str(empty / "model_00001.pt")),
                          f"{empty} holds no model_*.pt")


@pytest.mark.slow
def test_local_text_twice_is_warning_free_and_the_refusal_names_overwrite(tmp_path):
    """The README's offline demo, small: a first run on local text prints no warning (the preset's
    val tokens are more than 10% of so small a corpus holds: the val loss is over what it holds);
    a second one into the same log dir is refused before any work, naming --overwrite; with it,
    the same --input again is no warning either."""
    corpus, data, log = str(tmp_path / "c.jsonl"), str(tmp_path / "data"), str(tmp_path / "log")
    write_corpus_jsonl(corpus)
    flags = run_args(data, log, "--input", corpus, "--max_steps", "2", "--warmup_steps", "1",
                     "--sample_every", "0",
                     drop=("--val_tokens", "--sample_every", "--num_samples", "--sample_tokens"))
    first = run_cli(*flags)
    assert first.returncode == 0, first.stderr
    assert "warning" not in first.stdout + first.stderr, first.stdout
    assert_one_line_error(run_cli(*flags), log, "--overwrite", "--resume latest")
    again = run_cli(*flags, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert "warning" not in again.stdout + again.stderr, again.stdout
