"""Shared test setup: offline tokenizer, tiny shard fixtures, repository paths."""
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# tiktoken's GPT-2 files, pre-cached beside the repository (CI exports this too)
_cache = os.path.join(os.path.dirname(REPO), "shared", "tiktoken_cache")
if "TIKTOKEN_CACHE_DIR" not in os.environ and os.path.isdir(_cache):
    os.environ["TIKTOKEN_CACHE_DIR"] = _cache
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def write_shards(root, split, sizes, seed=0, vocab=50257, prefix="test"):
    """Write uint16 shards `{prefix}_{split}_NNNNNN.npy` of the given token counts; returns the arrays."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    first = 0 if split == "val" else 1
    arrays = []
    for i, n in enumerate(sizes):
        arr = rng.integers(0, vocab, size=n, dtype=np.int64).astype(np.uint16)
        np.save(os.path.join(root, f"{prefix}_{split}_{first + i:06d}.npy"), arr)
        arrays.append(arr)
    return arrays


@pytest.fixture
def shard_dir(tmp_path):
    """A data root with one val shard and three train shards of random tokens."""
    root = str(tmp_path / "data")
    write_shards(root, "val", [5000], seed=1)
    write_shards(root, "train", [7000, 6000, 6500], seed=2)
    return root
