"""Shared test setup: offline hub settings, tiny shard fixtures, repository paths."""
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

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
        import fineweb
        np.save(os.path.join(root, fineweb.shard_name(first + i, split, prefix=prefix)), arr)
        arrays.append(arr)
    return arrays


@pytest.fixture
def shard_dir(tmp_path):
    """A data root with one val shard and three train shards of random tokens."""
    root = str(tmp_path / "data")
    write_shards(root, "val", [5000], seed=1)
    write_shards(root, "train", [7000, 6000, 6500], seed=2)
    return root


def write_hellaswag(folder, n, seed=0):
    """A hellaswag_val.jsonl of n made-up examples in the original schema."""
    import json
    import random
    rng = random.Random(seed)
    words = "the a man woman dog ball runs jumps into water slowly then picks up throws it over fence".split()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hellaswag_val.jsonl"), "w") as f:
        for i in range(n):
            ctx_a = " ".join(rng.choice(words) for _ in range(rng.randint(5, 12))).capitalize() + "."
            ctx_b = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
            endings = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "." for _ in range(4)]
            f.write(json.dumps({"ind": i, "activity_label": "Fixture", "ctx_a": ctx_a, "ctx_b": ctx_b,
                                "ctx": f"{ctx_a} {ctx_b}", "split": "val", "split_type": "indomain",
                                "endings": endings, "label": rng.randrange(4), "source_id": f"fixture~{i}"}) + "\n")


def write_corpus_jsonl(path, n_docs=200, seed=0):
    """A small .jsonl corpus of made-up English-like documents (a `text` field each)."""
    import json
    import random
    rng = random.Random(seed)
    words = ("the of and to in is was for on that with as by at from his her an were are which this be or "
             "river mountain city school teacher student science history water light energy plant animal "
             "learned built grew studied measured found wrote taught").split()
    with open(path, "w") as f:
        for _ in range(n_docs):
            sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "."
                         for _ in range(rng.randint(3, 8))]
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
