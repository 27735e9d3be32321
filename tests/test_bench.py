"""bench.py runs on the CPU and reports every row (no timing is asserted)."""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO, assert_one_line_error, tiny_model


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_bench_json_has_every_row():
    r = bench("--preset", "tiny", "--device", "cpu", "-B", "2", "-T", "64", "--steps", "1",
              "--warmup", "0", "--gen_tokens", "4", "--hellaswag_examples", "4", "--long",
              "--rounds", "1", "--startup_shards", "2,3", "--startup_shard_tokens", "1000",
              "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["setting"]["device"] == "cpu" and out["setting"]["T"] == 64
    assert out["train"]["tokens_per_sec"] > 0 and out["train"]["tokens_per_step"] == 128
    # through train_gpt2.main
    assert out["train_loop"]["ms_per_step"] > 0 and out["train_loop"]["tokens_per_step"] == 128
    # train() and the reference loop: the same init, data and schedule give the same losses
    parity = out["parity"]
    assert parity["steps_compared"] == 2 and parity["max_loss_diff"] < 1e-5
    rounds = parity["rounds_ms"]  # one round: the ratio of its two runs
    assert parity["ratio"] == pytest.approx(rounds["train_gpt2"][0] / rounds["reference"][0])
    startup = out["startup"]
    assert startup["shards"] == [2, 3] and set(startup["loader_s"]) == {"2", "3"}
    assert out["hellaswag"]["same_predictions"] and out["hellaswag"]["examples"] == 4
    assert out["generate"]["kv_cache"] > 0 and out["generate"]["new_tokens"] == 4
    assert out["loader"]["us_per_batch"] > 0 and out["fineweb"]["tokens"] > 100_000
    assert out["save"]["seconds"] > 0 and 0.05 < out["save"]["gib"] < 0.2  # tiny: ~83 MiB


def test_bench_names_the_rows_it_left_out(capsys):
    import bench
    assert bench.main(["--device", "cpu", "--only", "startup", "-B", "2", "-T", "64", "--rounds",
                       "1", "--startup_shards", "2,3", "--startup_shard_tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "data start-up s, 2 / 3 shards" in out
    assert "--long adds parity and train_loop" in out and "optimizers_compare" in out
    assert bench.main(["--device", "cpu", "--only", "train,nosuchrow"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --only nosuchrow: no such row") and len(err.splitlines()) == 1


def test_headers_only_open_leaves_the_ids_to_the_reader(tmp_path):
    """The startup row's headers-only open: a bad id is found where a reader checks its window."""
    import bench

    import common
    import fineweb
    bench.write_sparse_shard(str(tmp_path / "a_train_000001.npy"), 5000)
    tokens = np.zeros(3000, dtype=np.uint16)
    tokens[1234] = 50300
    np.save(tmp_path / "a_train_000002.npy", tokens)
    paths, shards = fineweb.open_split(str(tmp_path), "train", None)
    assert [len(t) for t in shards] == [5000, 3000] and not shards[0].any()
    with pytest.raises(common.UsageError, match="token id"):
        fineweb.open_split(str(tmp_path), "train", 50257)  # the full check still reads them all
    fineweb.check_window(shards[1][:1234], 50257, paths[1])
    with pytest.raises(common.UsageError) as e:
        fineweb.check_window(shards[1][1000:2000], 50257, paths[1], 1000)
    assert str(e.value) == (f"{paths[1]}: token id 50300 at offset 1234 is >= the vocabulary "
                            f"size 50257")


@pytest.mark.slow
def test_bench_bad_device_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda is not an error")
    r = bench("--device", "cuda", "--only", "train", timeout=120)
    assert_one_line_error(r, "--device")


def test_gpu_suite_defaults_are_gpt2_with_the_real_batch():
    import bench
    args = bench.parse_args(["--suite", "gpu"])
    assert (args.preset, args.micro_batch_size, args.sequence_length, args.grad_accum) == \
        ("gpt2", 64, 1024, 8)
    assert args.micro_batch_size * args.sequence_length * args.grad_accum == 524_288
    # flags given win
    assert bench.parse_args(["--suite", "gpu", "--preset", "tiny", "-B", "2"]).micro_batch_size == 2


@pytest.mark.slow
def test_gpu_suite_plumbing_on_cpu(tmp_path):
    """The suite's rows, JSON and Markdown on the CPU with the tiny preset; its CUDA tests left
    out (no pytest in pytest)."""
    import bench
    out = tmp_path / "results"
    code = bench.main(["--suite", "gpu", "--out", str(out), "--device", "cpu", "--preset", "tiny",
                       "-B", "2", "-T", "64", "--grad_accum", "2", "--steps", "1", "--warmup", "0",
                       "--gen_tokens", "4", "--hellaswag_examples", "4", "--skip_tests"])
    assert code == 0
    res = json.loads((out / "gpu_suite.json").read_text())
    assert res["setting"]["preset"] == "tiny" and res["setting"]["grad_accum"] == 2
    assert "tests" not in res
    ours, nano = res["train"]["ours"], res["train"]["build_nanogpt"]
    assert ours["tokens_per_step"] == nano["tokens_per_step"] == 2 * 64 * 2
    assert nano["compile"] is False
    assert res["train"]["speedup"] == ours["tokens_per_sec"] / nano["tokens_per_sec"]
    assert res["hellaswag"]["examples"] == 4 and res["generate"]["new_tokens"] == 4
    page = (out / "gpu_suite.md").read_text()
    assert "| build-nanogpt: eager, foreach AdamW |" in page and "HellaSwag batched speedup" in page
    assert "CUDA tests: not run" in page


def test_gpu_suite_without_cuda_is_one_line(capsys):
    import bench
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert bench.main(["--suite", "gpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "CUDA" in err and len(err.strip().splitlines()) == 1


def test_junit_summary(tmp_path):
    import bench
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="3">'
                   '<testcase classname="tests.test_cuda" name="test_a" time="1.5"><properties>'
                   '<property name="mfu" value="0.51"/></properties></testcase>'
                   '<testcase name="test_b" time="0.1"><failure message="boom">trace</failure>'
                   '</testcase>'
                   '<testcase name="test_c" time="0"><skipped message="needs 2 GPUs"/></testcase>'
                   '</testsuite></testsuites>')
    s = bench.junit_summary(str(xml))
    assert s["counts"] == {"passed": 1, "failure": 1, "error": 0, "skipped": 1}
    assert s["properties"] == {"test_a": {"mfu": 0.51}}
    assert s["cases"][2]["message"] == "needs 2 GPUs"


@pytest.mark.slow
def test_bench_optimizer_rows():
    import bench

    import common
    args = argparse.Namespace(micro_batch_size=2, sequence_length=32, warmup=0, steps=1)
    row = bench.bench_optimizers(args, tiny_model().config, "cpu", "cpu",
                                 common.autocast_for("fp32", "cpu")[0])
    assert row["adamw_ms"] > 0 and row["muon_ms"] > 0
    assert bench.steps_to_reach([0, 10, 20, 30], [5.0, 4.0, 3.5, 3.0], 3.6) == 20
    assert bench.steps_to_reach([0, 10], [5.0, 4.0], 3.0) is None


def test_resident_memory_is_none_where_neither_proc_nor_resource_exists(monkeypatch):
    """Windows: no /proc and no resource module; the loader row then shows n/a."""
    import builtins

    import bench
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    assert bench.rss_bytes() > 0
    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setitem(sys.modules, "resource", None)
    assert bench.rss_bytes() is None and bench.fmt(None) == "n/a"
