"""Shared test set-up: offline hub settings, one torch thread, and the fixtures more than one test
file uses (the tiny run's shards, its uninterrupted reference run, GPT-2's tokenizer). Plain helpers
are in helpers.py."""
import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# trust_remote_code copies an exported folder's modeling code into transformers' module cache:
# a folder of this test process's own (read when transformers is imported), not the user's ~/.cache
MODULES_CACHE = tempfile.mkdtemp(prefix="test-hf-modules-")
os.environ["HF_MODULES_CACHE"] = MODULES_CACHE


# The files by their time in one process, longest first (a per-process timeline of the whole
# suite, clean-clone CI on the idle 2-core VM, 2026-11-29): the two test processes of the README's
# command (-n 2 --dist loadfile, with pyproject.toml's --no-loadscope-reorder) take whole files in
# this order, so neither is left with a long file at the end. Within a file the order stays as
# written.
LONGEST_FIRST = ("test_cuda_simulated", "test_run_safety", "test_distributed", "test_bench",
                 "test_hellaswag", "test_core", "test_training", "test_fineweb", "test_notebook",
                 "test_modern_arch", "test_sft", "test_serve", "test_chat_eval",
                 "test_bundle_install", "test_input_checks", "test_flags", "test_model",
                 "test_modern_export", "test_platform", "test_own_tokenizer",
                 "test_settled_run", "test_gpu_paths_cpu", "test_optimizers", "test_fp16",
                 "test_monitoring", "test_commands", "test_output_paths", "test_scorer",
                 "test_tokenizer", "test_chat", "test_chat_command", "test_chat_data")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's own order


def pytest_collection_finish(session):
    """torch and the test files are imported now and stay to the end: the garbage collector's full
    passes (about 0.2 s each with them in the heap) need not walk them again. What the tests
    allocate is collected as before."""
    gc.freeze()


def pytest_sessionfinish(session):
    """The garbage collected once more (what is found still goes to pytest's check of exceptions
    raised in finalizers), then all that is left frozen too: what the tests imported (dynamo,
    transformers) is not walked again by the five full passes pytest runs as a test process ends,
    nor by the interpreter's own as it shuts down (about 1.5 s of a process's exit with
    transformers imported). The module cache of this process goes."""
    shutil.rmtree(MODULES_CACHE, ignore_errors=True)
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """torch in one thread. The tiny models run faster so on a small shared machine, and runs in
    this process give the numbers of the subprocess runs (OMP_NUM_THREADS=1) they are compared
    with, to the last bit."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def children_tmpdir(tmp_path_factory):
    """The processes the tests start make their temporary files under pytest's own temporary
    dir, which pytest prunes: torchrun's launcher leaves a torchelastic_* dir behind on each run.
    (This process's tempfile has read TMPDIR already.)"""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        yield


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """The tiny run's shards: one val shard of 3,000 tokens, three train shards of 6,000 in all.
    Read only: a test that damages shards writes its own."""
    from helpers import write_shards

    root = str(tmp_path_factory.mktemp("shards") / "data")
    write_shards(root, "val", [3000], seed=1)
    write_shards(root, "train", [2000, 1500, 2500], seed=2)
    return root


@pytest.fixture(scope="session")
def reference_run(data, tmp_path_factory):
    """The tiny run, uninterrupted, through main() in this process: (its log dir, its result).
    test_training.py checks that a real `python train_gpt2.py` writes the same log."""
    from helpers import SAVES, run_args, run_cli

    log = str(tmp_path_factory.mktemp("reference") / "log")
    r = run_cli(*run_args(data, log, *SAVES))
    assert r.returncode == 0, r.stderr
    return log, r


@pytest.fixture(scope="session")
def reference(reference_run):
    """The log dir every interrupted or resumed tiny run must reproduce. Read only: copy it to
    change it."""
    return reference_run[0]


@pytest.fixture(scope="session")
def enc():
    import fineweb

    return fineweb.get_encoding()  # checked against tiktoken's own gpt2 in test_tokenizer.py
