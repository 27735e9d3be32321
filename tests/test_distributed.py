"""Several processes on the CPU (torchrun, gloo): DDP and FSDP give one process's losses,
checkpoints move between process counts, HellaSwag splits its examples over the ranks, rank 0
prepares the data while the others wait, workers leave without interpreter shutdown."""
import os
import subprocess
import sys

import pytest
import torch

import hellaswag
import train_gpt2 as tg
from helpers import (REPO, assert_one_line_error, assert_same_log, dist_reference, run_args,
                     run_cli, series, stop_then_resume, torchrun, write_corpus_jsonl,
                     write_hellaswag)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    return dist_reference(data, str(tmp_path_factory.mktemp("dist") / "single"))


def test_ddp_two_processes_then_resume_in_one(data, single, tmp_path):
    log = str(tmp_path / "ddp")
    r = stop_then_resume(data, log, torchrun, run_cli)
    assert " world_size=2" in r.stdout and " grad_accum_steps=2" in r.stdout
    # only rank 0 prints step lines (counted as lines: other lines may say "at step N")
    assert sum(line.startswith("step ") for line in r.stdout.splitlines()) == 4
    # steps 0-3 and the val losses at 0 and 4 came from 2 processes, the rest from 1: all match 1
    assert_same_log(log, single, 1e-5)


def test_one_process_then_resume_in_two(data, single, tmp_path):
    log = str(tmp_path / "one-then-two")
    stop_then_resume(data, log, run_cli, torchrun)
    assert_same_log(log, single, 1e-5)


def test_fsdp_matches_ddp_and_resumes_without_fsdp(data, single, tmp_path):
    log = str(tmp_path / "fsdp")
    stop_then_resume(data, log, torchrun, run_cli, "--fsdp")
    ckpt = torch.load(os.path.join(log, "model_00003.pt"), weights_only=False)  # written by FSDP
    plain = tg.GPT(tg.GPTConfig(**ckpt["config"]))
    plain.load_state_dict(ckpt["model"])  # a non-FSDP model loads it as is
    # fp32: FSDP's reduce-scatter sums in another order than DDP's all-reduce, nothing more
    assert_same_log(log, single, 1e-5)


def test_fsdp_needs_torchrun(data, tmp_path):
    r = run_cli(*run_args(data, str(tmp_path / "log"), "--fsdp"))
    assert_one_line_error(r, "--fsdp", "torchrun")


def test_torchrun_workers_leave_without_interpreter_shutdown(data, tmp_path):
    """Under torchrun, train_gpt2.py ends its processes with os._exit once main() is done
    (exit_process): gloo threads that torch keeps alive can abort a process during Python's
    shutdown. Output is flushed first, and one process without torchrun still exits the usual
    way."""
    # train_gpt2.py as __main__, with an atexit hook that reports the shutdown
    driver = tmp_path / "driver.py"
    driver.write_text(f"import atexit, runpy, sys\nsys.path.insert(0, {REPO!r})\n"
                      "atexit.register(lambda: print('interpreter shutdown', flush=True))\n"
                      f"runpy.run_path({os.path.join(REPO, 'train_gpt2.py')!r}, "
                      f"run_name='__main__')\n")
    flags = ("--max_steps", "2", "--eval_every", "0", "--sample_every", "0", "-B", "1")
    r = torchrun(*run_args(data, str(tmp_path / "two"), *flags), script=str(driver))
    assert r.returncode == 0, r.stderr
    assert "saved " in r.stdout and "interpreter shutdown" not in r.stdout
    # a refusal keeps its exit code and its one message, from rank 0 alone, no traceback of ours
    bad = torchrun(*run_args(data, str(tmp_path / "bad"), "--total_batch_size", "192"),
                   script=str(driver))
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and len(errors) == 1 and "not divisible" in errors[0], bad.stderr
    assert 'train_gpt2.py", line' not in bad.stderr  # torchrun adds its own report
    one = subprocess.run([sys.executable, str(driver),
                          *run_args(data, str(tmp_path / "one"), *flags)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert one.returncode == 0 and "interpreter shutdown" in one.stdout, one.stderr


def test_hellaswag_in_training_one_and_two_processes(data, tmp_path, monkeypatch):
    hdir = str(tmp_path / "hs")
    write_hellaswag(hdir, 13)  # odd, so the ranks get 7 and 6 examples
    monkeypatch.setenv("HELLASWAG_DIR", hdir)
    hs = ["--max_steps", "2", "--hellaswag_every", "1", "--eval_every", "0", "--sample_every", "0",
          "--save_every", "0", "--total_batch_size", "256"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    r = run_cli(*run_args(data, one, *hs))
    assert r.returncode == 0, r.stderr
    r2 = torchrun(*run_args(data, two, *hs))
    assert r2.returncode == 0, r2.stderr
    assert "HellaSwag accuracy: " in r.stdout and "/13=" in r2.stdout
    a, b = series(one)["hella"], series(two)["hella"]
    assert a[0] == b[0] == [0, 1, 2] and a[1] == pytest.approx(b[1], abs=1e-9)
    # step 0 scores the freshly initialized model: the same number from hellaswag.evaluate
    torch.manual_seed(1337)
    init = tg.GPT(tg.model_config_from_args(tg.parse_args(run_args(data, one))[0]))
    assert hellaswag.evaluate(init, "cpu")["acc_norm"] == pytest.approx(a[1][0], abs=1e-4)


def test_rank0_prepares_data_while_others_wait(tmp_path):
    corpus = write_corpus_jsonl(tmp_path / "corpus.jsonl")
    root, log = str(tmp_path / "data"), str(tmp_path / "log")
    r = torchrun(*run_args(root, log, "--input", corpus, "--max_steps", "2", "--sample_every", "0",
                           "--save_every", "0", "--total_batch_size", "256"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("preparing them from") == 1
    assert series(log)["train"][0] == [0, 1]

