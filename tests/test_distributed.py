"""Several processes on CPU (torchrun, gloo): DDP and FSDP give one process's losses, checkpoints move between them."""
import os
import re
import subprocess
import sys

import pytest
import torch

import train_gpt2 as tg
from conftest import REPO
from test_train_gpt2 import run_cli, tiny_run_args

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")

STEPS = ["--max_steps", "8", "--eval_every", "4", "--sample_every", "0", "--save_every", "0",
         "--total_batch_size", "256", "--val_tokens", "1000"]


def torchrun(*args, nproc=2, script=os.path.join(REPO, "train_gpt2.py")):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)


def losses(log_dir):
    return tg.read_log(os.path.join(log_dir, "log.txt"))


def assert_same_log(a, b, tol):
    la, lb = losses(a), losses(b)
    assert set(la) == set(lb)
    for kind in la:
        assert la[kind][0] == lb[kind][0], kind
        assert la[kind][1] == pytest.approx(lb[kind][1], abs=tol), kind


def reference_run(tmp_path_factory, name, *flags):
    """One process, 8 steps straight on fresh shards: the reference a distributed run is compared with."""
    from conftest import write_shards
    root = tmp_path_factory.mktemp(name)
    data = str(root / "data")
    write_shards(data, "val", [5000], seed=1)
    write_shards(data, "train", [7000, 6000, 6500], seed=2)
    log = str(root / "single")
    r = run_cli(*tiny_run_args(data, log, *STEPS, *flags))
    assert r.returncode == 0, r.stderr
    return data, log


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reference_run(tmp_path_factory, "dist")


def stop_then_resume(data, log, first, second, *first_flags):
    """Steps 0-3 with `first` (stopping with a checkpoint), then the rest with `second` from that checkpoint."""
    r = first(*tiny_run_args(data, log, *STEPS, "--stop_step", "4", *first_flags))
    assert r.returncode == 0, r.stderr
    resumed = second(*tiny_run_args(data, log, *STEPS, "--resume", "latest"))
    assert resumed.returncode == 0, resumed.stderr
    return r


def test_ddp_two_processes_then_resume_in_one(single, tmp_path):
    data, ref = single
    log = str(tmp_path / "ddp")
    r = stop_then_resume(data, log, torchrun, run_cli)
    assert " world_size=2" in r.stdout and " grad_accum_steps=2" in r.stdout
    assert r.stdout.count("step ") == 4  # only rank 0 prints step lines
    # steps 0-3 and the val losses at 0 and 4 came from 2 processes, the rest from 1: all match 1 process
    assert_same_log(log, ref, 1e-5)


def test_one_process_then_resume_in_two(single, tmp_path):
    data, ref = single
    log = str(tmp_path / "one-then-two")
    stop_then_resume(data, log, run_cli, torchrun)
    assert_same_log(log, ref, 1e-5)


def test_fsdp_matches_ddp_and_resumes_without_fsdp(single, tmp_path):
    data, ref = single
    log = str(tmp_path / "fsdp")
    stop_then_resume(data, log, torchrun, run_cli, "--fsdp")
    ckpt = torch.load(os.path.join(log, "model_00003.pt"), weights_only=False)  # written under FSDP
    plain = tg.GPT(tg.GPTConfig(**ckpt["config"]))
    plain.load_state_dict(ckpt["model"])  # a non-FSDP model loads it as is
    # fp32: FSDP's reduce-scatter sums in another order than DDP's all-reduce, nothing more
    assert_same_log(log, ref, 1e-5)


def test_torchrun_workers_leave_without_interpreter_shutdown(shard_dir, tmp_path):
    """Under torchrun, train_gpt2.py ends its processes with os._exit once main() is done (exit_process): gloo
    threads that torch keeps alive can abort a process during Python's shutdown. Output is flushed first, and
    one process without torchrun still exits the usual way."""
    driver = tmp_path / "driver.py"  # train_gpt2.py as __main__, with an atexit hook that reports the shutdown
    driver.write_text(f"import atexit, runpy, sys\nsys.path.insert(0, {REPO!r})\n"
                      "atexit.register(lambda: print('interpreter shutdown', flush=True))\n"
                      f"runpy.run_path({os.path.join(REPO, 'train_gpt2.py')!r}, run_name='__main__')\n")
    flags = ("--max_steps", "2", "--eval_every", "0", "--sample_every", "0")
    r = torchrun(*tiny_run_args(shard_dir, str(tmp_path / "two"), *flags), script=str(driver))
    assert r.returncode == 0, r.stderr
    assert "saved " in r.stdout and "interpreter shutdown" not in r.stdout
    # a refusal keeps its exit code and its one message, from rank 0 alone, with no traceback of ours
    bad = torchrun(*tiny_run_args(shard_dir, str(tmp_path / "bad"), "--total_batch_size", "192"), script=str(driver))
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and len(errors) == 1 and "not divisible" in errors[0], bad.stderr
    assert 'train_gpt2.py", line' not in bad.stderr  # torchrun adds its own report
    one = subprocess.run([sys.executable, str(driver), *tiny_run_args(shard_dir, str(tmp_path / "one"), *flags)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert one.returncode == 0 and "interpreter shutdown" in one.stdout, one.stderr


def test_fsdp_needs_torchrun(shard_dir, tmp_path):
    r = run_cli(*tiny_run_args(shard_dir, str(tmp_path / "log"), "--fsdp"))
    assert r.returncode != 0 and "torchrun" in r.stderr and "Traceback" not in r.stderr


def test_batch_size_ramp_schedule():
    unit = 64
    sizes = [tg.batch_size_at(t, 2048, 512, unit, start=128) for t in (0, 512, 1024, 2047, 2048, 10 ** 6)]
    assert sizes == [128, 192, 320, 448, 512, 512]  # 128 + 384*t/2048, rounded down to a multiple of 64
    assert tg.batch_size_at(0, 0, 512, unit) == 512  # off
    assert tg.batch_size_at(0, 10 ** 9, 524288, 8 * 65536) == 8 * 65536  # never below one micro-step


def test_batch_ramp_resumes_exactly(shard_dir, tmp_path):
    ramp = ["--max_steps", "8", "--total_batch_size", "512", "--batch_ramp_tokens", "2048",
            "--batch_ramp_start", "128", "--eval_every", "0", "--sample_every", "0", "--save_every", "0"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    r = run_cli(*tiny_run_args(shard_dir, a, *ramp))
    assert r.returncode == 0, r.stderr
    assert re.search(r"\| batch 128\b", r.stdout) and re.search(r"\| batch 320\b", r.stdout)  # grows with the tokens
    r = run_cli(*tiny_run_args(shard_dir, b, *ramp, "--stop_step", "3"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*tiny_run_args(shard_dir, b, *ramp, "--resume", "latest"))
    assert r.returncode == 0, r.stderr
    assert open(os.path.join(a, "log.txt")).read() == open(os.path.join(b, "log.txt")).read()


def test_hellaswag_in_training_one_and_two_processes(single, tmp_path, monkeypatch):
    from conftest import write_hellaswag
    import hellaswag
    data, _ = single
    hdir = str(tmp_path / "hs")
    write_hellaswag(hdir, 13)  # odd, so the ranks get 7 and 6 examples
    monkeypatch.setenv("HELLASWAG_DIR", hdir)
    hs = ["--max_steps", "2", "--hellaswag_every", "1", "--eval_every", "0", "--sample_every", "0",
          "--save_every", "0", "--total_batch_size", "256"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    r = run_cli(*tiny_run_args(data, one, *hs))
    assert r.returncode == 0, r.stderr
    r2 = torchrun(*tiny_run_args(data, two, *hs))
    assert r2.returncode == 0, r2.stderr
    assert "HellaSwag accuracy: " in r.stdout and "/13=" in r2.stdout
    a, b = losses(one)["hella"], losses(two)["hella"]
    assert a[0] == b[0] == [0, 1, 2] and a[1] == pytest.approx(b[1], abs=1e-9)
    # step 0 scores the freshly initialized model: the same number from hellaswag.evaluate directly
    torch.manual_seed(1337)
    init = tg.GPT(tg.model_config_from_args(tg.parse_args(tiny_run_args(data, one))))
    assert hellaswag.evaluate(init, "cpu")["acc_norm"] == pytest.approx(a[1][0], abs=1e-4)


def test_rank0_prepares_data_while_others_wait(tmp_path):
    from conftest import write_corpus_jsonl
    corpus = str(tmp_path / "corpus.jsonl")
    write_corpus_jsonl(corpus)
    data, log = str(tmp_path / "data"), str(tmp_path / "log")
    r = torchrun(*tiny_run_args(data, log, "--input", corpus, "--max_steps", "2", "--sample_every", "0",
                                "--save_every", "0", "--total_batch_size", "256"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("preparing them from") == 1
    assert tg.read_log(os.path.join(log, "log.txt"))["train"][0] == [0, 1]
