"""macOS and Windows on this Linux box: shards prepared under the spawn start method (their
default) against the default one's, the scripts imported and a default run trained with the
POSIX-only parts of os, signal and the standard library taken away, and `--device auto` on a faked
Apple-silicon (MPS) backend."""
import contextlib
import glob
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import common
import fineweb
from helpers import HANG_LIMIT_S, REPO, SAVES, log_of, run_args, write_corpus_jsonl

# What Windows lacks, taken away before anything is imported (macOS lacks prctl and /proc only).
# Kept where numpy's and torch's own Linux branches use them (os.uname, signal.SIGKILL). The
# spawned tokenizer workers start without them too: they run this script's top part.
WINDOWS_LIKE = textwrap.dedent("""\
    import os, signal, sys
    for name in ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGCHLD",
                 "SIGPIPE", "alarm", "setitimer", "siginterrupt", "pause"):
        delattr(signal, name)
    for name in ("fork", "forkpty", "getuid", "geteuid", "getgid", "getpgid", "setsid", "killpg",
                 "O_NOFOLLOW", "getloadavg", "sysconf", "confstr"):
        delattr(os, name)
    for name in ("fcntl", "resource", "pwd", "grp", "termios"):
        sys.modules[name] = None  # import fails as on Windows
    sys.path.insert(0, {repo!r})
    if __name__ == "__main__":
        import json
        import bench, common, fineweb, hellaswag, rundir, train_gpt2  # noqa: F401
        fineweb.START_METHOD = "spawn"  # no os.fork: the pool could not start otherwise
        fineweb.BATCH_CHARS = 1000  # several tasks per worker
        prep = fineweb.main({prep_args!r})
        run = train_gpt2.main({run_args!r})
        print(json.dumps({{"prep": prep, "run": run}}))
    """)
PREP_FLAGS = ["--shard_size", "700", "--num_proc", "2"]


def shards(folder):
    """{name: bytes} of the .npy shards in folder."""
    return {p.name: p.read_bytes() for p in sorted(pathlib.Path(folder).glob("*.npy"))}


@pytest.fixture(scope="module")
def windows_like(data, tmp_path_factory):
    """One Windows-like process: a 2-worker prep under spawn, then the tiny run (its log dir)."""
    tmp = tmp_path_factory.mktemp("windows_like")
    corpus = write_corpus_jsonl(str(tmp / "corpus.jsonl"), n_docs=60, seed=5)
    prep_args = ["--input", corpus, "--data_root", str(tmp / "spawn"), *PREP_FLAGS]
    script = tmp / "windows_like.py"
    script.write_text(WINDOWS_LIKE.format(repo=REPO, prep_args=prep_args,
                                          run_args=run_args(data, str(tmp / "log"), *SAVES)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the reference run's numbers, to the last bit
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                       timeout=HANG_LIMIT_S, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == '{"prep": 0, "run": 0}', r.stdout
    return tmp


@pytest.mark.slow
def test_spawn_writes_the_default_start_methods_shards(windows_like, monkeypatch, capsys, enc):
    # on Linux and macOS the pool's start method is forkserver: workers forked, not fresh
    if fineweb.START_METHOD is None:
        pytest.skip("spawn is this platform's start method: nothing to compare it with")
    assert fineweb.START_METHOD == "forkserver"
    monkeypatch.setattr(fineweb, "BATCH_CHARS", 1000)
    corpus = str(windows_like / "corpus.jsonl")
    default = windows_like / "default"
    assert fineweb.main(["--input", corpus, "--data_root", str(default), *PREP_FLAGS]) == 0
    capsys.readouterr()

    spawned, forked = shards(windows_like / "spawn"), shards(default)
    assert len(forked) >= 3 and spawned == forked  # byte for byte, names included
    expected = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:  # the tokenizer on its own, one document at a time, in file order
            expected += [fineweb.EOT, *enc.encode_ordinary(json.loads(line)["text"])]
    val = sorted(glob.glob(str(default / "*_val_*.npy")))
    train = sorted(glob.glob(str(default / "*_train_*.npy")))
    assert np.concatenate([np.load(p) for p in val + train]).tolist() == expected


@pytest.mark.slow
def test_default_run_without_posix_only_calls(windows_like, reference):
    assert log_of(str(windows_like / "log")) == log_of(reference)  # to the last digit

    def kept(folder):  # the lock files differ: filelock falls back to a soft lock without fcntl
        return sorted(name for name in os.listdir(folder) if not name.startswith("."))

    assert kept(windows_like / "log") == kept(reference)


class OldMacAutocast:
    """torch.autocast as on macOS 13, whose MPS has no bf16: a warning, then autocast off."""

    def __init__(self, real):
        self.real = real

    def __call__(self, device_type, dtype=None, **kwargs):
        if device_type == "mps" and dtype == torch.bfloat16:
            warnings.warn("MPS Autocast only supports dtype of torch.float16 currently.")
            return self.real(device_type, dtype, enabled=False)
        return self.real(device_type, dtype, **kwargs)


def test_auto_picks_mps_and_a_dtype_it_supports(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert common.resolve_device("auto") == "mps"
    assert common.resolve_device("mps") == "mps"

    ctx, name = common.autocast_for("auto", "mps")  # Apple silicon on macOS 14 and later
    assert name == "bf16" and (ctx.device, ctx.fast_dtype) == ("mps", torch.bfloat16)
    assert common.autocast_for("fp32", "mps")[1] == "fp32"

    monkeypatch.setattr(torch, "autocast", OldMacAutocast(torch.autocast))
    ctx, name = common.autocast_for("auto", "mps")
    assert name == "fp32" and isinstance(ctx, contextlib.nullcontext)
    ctx, name = common.autocast_for("fp16", "mps")
    assert name == "fp16" and (ctx.device, ctx.fast_dtype) == ("mps", torch.float16)
    with pytest.raises(common.UsageError, match="--dtype bf16: autocast to bfloat16 on mps"):
        common.autocast_for("bf16", "mps")  # asked for by name: never fp32 in silence

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert common.resolve_device("auto") == "cpu"
    assert common.autocast_for("auto", "cpu")[1] == "fp32"


# A step's large tensor, over and over: n bytes allocated, filled and freed each time. Prints the
# page faults of one such cycle as glibc does it by default (a block this large is mapped afresh
# and faulted in page by page), then those of the last 8 of 20 cycles after tune_for_device("cpu")
# (its heap reaches a steady state within a few cycles: then nothing is faulted in again)
REFAULTS = textwrap.dedent("""\
    import resource, sys
    sys.path.insert(0, {repo!r})
    import torch
    import common

    def faults(n, cycles):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(cycles):
            torch.empty(n, dtype=torch.uint8).fill_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    n = 64 << 20
    faults(n, 1)
    plain = faults(n, 1)
    common.tune_for_device("cpu")
    faults(n, 12)
    print(plain, faults(n, 8))
""")


@pytest.mark.skipif(not common.glibc(), reason="glibc's malloc only")
def test_a_cpu_run_reuses_freed_memory_instead_of_faulting_it_in_again():
    """On a CPU, the settings every run makes (tune_for_device) keep freed blocks for the next
    allocations: a tiny step's logits are not faulted in page by page again each step."""
    r = subprocess.run([sys.executable, "-c", REFAULTS.format(repo=REPO)], capture_output=True,
                       text=True, timeout=HANG_LIMIT_S)
    assert r.returncode == 0, r.stderr
    plain, tuned = map(int, r.stdout.split())
    assert plain >= (64 << 20) // (2 << 20)  # at least a fault a page (2 MiB if huge pages)
    assert tuned * 4 < plain, (plain, tuned)
