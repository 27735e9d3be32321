"""Several processes on the CPU (torchrun, gloo): DDP and FSDP give one process's losses,
checkpoints move between process counts, HellaSwag splits its examples over the ranks, rank 0
prepares the data while the others wait, workers leave without interpreter shutdown."""
import os
import subprocess
import sys

import pytest
import torch

import common
import hellaswag
import settings
import train_gpt2 as tg
from helpers import (DIST_FLAGS, HANG_LIMIT_S, HOOKS, REPO, assert_one_line_error,
                     assert_same_log, dist_reference, run_args, run_cli, series, step_lines,
                     stop_then_resume, torchrun, write_corpus_jsonl, write_hellaswag,
                     write_shards)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def narrow_data(tmp_path_factory):
    """The tiny run's shards in 64 token ids. On `data`'s random ids of the whole vocabulary a
    head that starts near the uniform distribution starts near the best loss there is, and the
    losses hardly move; these it learns, so the losses show the head and wte, which AdamW trains
    (its state restored from the other process count). Muon's matrices hardly show in 8 steps:
    test_training.py resumes them bit for bit."""
    root = str(tmp_path_factory.mktemp("narrow") / "data")
    write_shards(root, "val", [3000], seed=1, vocab=64)
    write_shards(root, "train", [2000, 1500, 2500], seed=2, vocab=64)
    return root


# The runs that must give one process's: GPT-2 with AdamW, and the modern architecture with Muon
# + AdamW, a model without 1-D parameters (AdamW has no no-decay group, which torch's distributed
# state-dict helpers must still save and restore; Muon's Newton-Schulz runs on FSDP's sharded
# DTensors, which must gather each whole matrix); the fixture of each one's shards
ARCHS = {"gpt2": ("data", []),
         "modern-muon": ("narrow_data", ["--arch", "modern", "--optimizer", "muon"])}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    """(the shards, the flags) of the runs"""
    shards, flags = ARCHS[request.param]
    return request.getfixturevalue(shards), flags


@pytest.fixture(scope="module")
def single(arch, tmp_path_factory):
    data, flags = arch
    return dist_reference(data, str(tmp_path_factory.mktemp("dist") / "single"), *flags)


def assert_same_weights(log, single):
    """The final weights of a run across process counts against one process's: a block's matrix
    (Muon's, in the modern run) within a tenth of how far training moved it, which the losses alone
    hardly show in 8 steps; the difference is the reduction order and Muon's bf16 Newton-Schulz."""
    final, ref = (torch.load(os.path.join(d, "model_00007.pt"), weights_only=True)
                  for d in (log, single))
    torch.manual_seed(1337)  # the run's init
    init = tg.GPT(tg.GPTConfig(**ref["config"])).state_dict()
    name = "transformer.h.0.mlp.c_fc.weight"
    diff = (final["model"][name] - ref["model"][name]).abs().max()
    moved = (ref["model"][name] - init[name]).abs().max()
    assert diff < moved / 10, (diff, moved)


def write_driver(tmp_path):
    """train_gpt2.py as __main__, with an atexit hook that reports the interpreter's shutdown."""
    driver = tmp_path / "driver.py"
    driver.write_text(f"import atexit, runpy, sys\nsys.path.insert(0, {REPO!r})\n"
                      "atexit.register(lambda: print('interpreter shutdown', flush=True))\n"
                      f"runpy.run_path({os.path.join(REPO, 'train_gpt2.py')!r}, "
                      f"run_name='__main__')\n")
    return str(driver)


@pytest.mark.slow
def test_one_process_then_two_then_one(arch, single, tmp_path):
    """Steps 0-1 in one process, 2-5 in two (DDP) from its checkpoint, 6-7 in one again from
    theirs: both ways across process counts, one launch. Under torchrun the workers end with
    os._exit once main() is done (exit_process: gloo threads that torch keeps alive can abort a
    process during Python's shutdown), their output flushed first."""
    log = str(tmp_path / "one-two-one")
    data, flags = arch
    args = run_args(data, log, *DIST_FLAGS, *flags)
    assert run_cli(*args, "--stop_step", "2").returncode == 0
    r = torchrun(*args, "--resume", "latest", "--stop_step", "6", script=write_driver(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "saved " in r.stdout and "interpreter shutdown" not in r.stdout
    assert " world_size=2" in r.stdout and " grad_accum_steps=2" in r.stdout
    assert sorted(step_lines(r.stdout)) == [2, 3, 4, 5]  # only rank 0 prints step lines
    last = run_cli(*args, "--resume", "latest")
    assert last.returncode == 0, last.stderr
    # steps 2-5 and the val loss at 4 came from 2 processes, the rest from 1: all match 1
    assert_same_log(log, single, 1e-5)
    assert_same_weights(log, single)


@pytest.mark.slow
def test_fsdp_matches_ddp_and_resumes_without_fsdp(arch, single, tmp_path):
    log = str(tmp_path / "fsdp")
    data, flags = arch
    stop_then_resume(data, log, torchrun, run_cli, "--fsdp", *flags)  # resumed: the checkpoint's
    ckpt = torch.load(os.path.join(log, "model_00003.pt"), weights_only=False)  # written by FSDP
    plain = tg.GPT(tg.GPTConfig(**ckpt["config"]))
    plain.load_state_dict(ckpt["model"])  # a non-FSDP model loads it as is
    # fp32: FSDP's reduce-scatter sums in another order than DDP's all-reduce, nothing more
    assert_same_log(log, single, 1e-5)
    assert_same_weights(log, single)


def test_fsdp_needs_torchrun(data, tmp_path):
    r = run_cli(*run_args(data, str(tmp_path / "log"), "--fsdp"))
    assert_one_line_error(r, "--fsdp", "torchrun")


@pytest.mark.slow
def test_two_processes_prepare_the_data_and_split_hellaswag(tmp_path, monkeypatch):
    """One two-process run on a corpus not yet tokenized, with HellaSwag at every step: rank 0
    prepares the shards while rank 1 waits; the ranks split the 13 examples (7 and 6) and give one
    process's accuracy."""
    corpus = write_corpus_jsonl(tmp_path / "corpus.jsonl")
    hdir = str(tmp_path / "hs")
    write_hellaswag(hdir, 13)
    monkeypatch.setenv("HELLASWAG_DIR", hdir)
    root, one, two = str(tmp_path / "data"), str(tmp_path / "one"), str(tmp_path / "two")
    hs = ["--max_steps", "2", "--hellaswag_every", "1", "--eval_every", "0", "--sample_every", "0",
          "--total_batch_size", "256"]
    r2 = torchrun(*run_args(root, two, "--input", corpus, *hs))
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.count("preparing them from") == 1 and "/13=" in r2.stdout

    r = run_cli(*run_args(root, one, *hs))  # one process, on the shards rank 0 wrote
    assert r.returncode == 0, r.stderr
    assert "HellaSwag accuracy: " in r.stdout
    a, b = series(one)["hella"], series(two)["hella"]
    assert a[0] == b[0] == [0, 1, 2] and a[1] == pytest.approx(b[1], abs=1e-9)
    assert series(two)["train"][0] == [0, 1]
    # step 0 scores the freshly initialized model: the same number from hellaswag.evaluate
    torch.manual_seed(1337)
    init = tg.GPT(tg.model_config(settings.read_flags(run_args(root, one))[0]))
    assert hellaswag.evaluate(init, "cpu")["acc_norm"] == pytest.approx(a[1][0], abs=1e-4)


@pytest.mark.slow
def test_torchrun_refusal_and_one_process_exit(data, tmp_path):
    """Under torchrun a refusal keeps its exit code and its one message, from rank 0 alone, even
    when rank 1 is done with it first (rank 1 waits for torchrun to stop it: leaving first would
    have torchrun stop rank 0 before it says why); a rank whose collective breaks because rank 0
    refused alone leaves without a word. One process without torchrun still leaves through the
    interpreter's usual shutdown."""
    def refused(name, hook, *flags):
        hook = {**hook, "marker": str(tmp_path / f"{name}.marker")}
        env = {f"HOOK_{k.upper()}": v for k, v in hook.items()}
        r = torchrun(*run_args(data, str(tmp_path / name / "log"), *flags), script=HOOKS, env=env)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode != 0 and len(errors) == 1, r.stderr
        assert f'File "{REPO}' not in r.stderr, r.stderr  # torchrun's own traceback only
        return errors[0]

    assert "not divisible" in refused("last", {"mode": "rank0_last"}, "--total_batch_size", "192")
    alone = refused("alone", {"mode": "refuse_alone", "arg": "rank 0 alone refuses (a test's)"},
                    "-B", "1")
    assert alone == "error: rank 0 alone refuses (a test's)"

    driver = write_driver(tmp_path)
    flags = ("--max_steps", "2", "--eval_every", "0", "--sample_every", "0", "-B", "1")
    one = subprocess.run([sys.executable, driver, *run_args(data, str(tmp_path / "one"), *flags)],
                         capture_output=True, text=True, cwd=REPO, timeout=HANG_LIMIT_S)
    assert one.returncode == 0 and "interpreter shutdown" in one.stdout, one.stderr


# gloo's own words (torch 2.13) when the other process of a two-process run exits, and when it stops
# answering for longer than the group's timeout
GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
               "peer [127.0.0.1]:27050. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 5000ms for recv operation to complete")


@pytest.mark.parametrize("error", [RuntimeError(GLOO_CLOSED), RuntimeError(GLOO_TIMEOUT),
                                   torch.distributed.DistNetworkError("recv failed"),
                                   torch.distributed.DistStoreError("wait timeout")],
                         ids=["closed", "timeout", "network", "store"])
def test_agree_names_a_lost_peer_and_keeps_a_bugs_traceback(monkeypatch, error):
    """A vote's collective that fails because the other process is gone is PeerLost (one line,
    saying so); any other RuntimeError of the call (a bug: here a tensor on a device the group
    has no backend for) is raised as it came, with its traceback."""
    proc = common.Proc("cpu", environ={"RANK": "0", "WORLD_SIZE": "2"})

    def raises(exc):
        def all_reduce(*args, **kwargs):
            raise exc
        return all_reduce

    monkeypatch.setattr(torch.distributed, "all_reduce", raises(error))
    with pytest.raises(common.PeerLost, match="another process of the run left") as lost:
        proc.agree(True)
    assert lost.value.__cause__ is error
    bug = RuntimeError("No backend type associated with device type cuda")
    monkeypatch.setattr(torch.distributed, "all_reduce", raises(bug))
    with pytest.raises(RuntimeError) as raised:
        proc.agree(True)
    assert raised.value is bug


def test_setup_distributed_takes_the_device_and_fsdp_as_values(monkeypatch):
    """What eval and the other commands call with their own flags: no argparse Namespace."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    proc = tg.setup_distributed("cpu")
    assert (proc.device, proc.world_size, proc.distributed) == ("cpu", 1, False)
    assert tg.setup_distributed().device == tg.resolve_device("auto")
    with pytest.raises(common.UsageError, match="--fsdp shards the model across processes"):
        tg.setup_distributed("cpu", fsdp=True)
