"""bench.py runs on CPU and reports every row (no timing is asserted)."""
import json
import os
import subprocess
import sys

from conftest import REPO


def test_bench_json_has_every_row():
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), "--preset", "tiny", "-B", "2", "-T", "64",
                        "--steps", "1", "--warmup", "0", "--gen_tokens", "4", "--hellaswag_examples", "4", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["setting"]["device"] == "cpu" and out["setting"]["T"] == 64
    assert out["train"]["tokens_per_sec"] > 0 and out["train"]["tokens_per_step"] == 128
    assert out["hellaswag"]["same_predictions"] and out["hellaswag"]["examples"] == 4
    assert out["generate"]["kv_cache"] > 0 and out["generate"]["new_tokens"] == 4
    assert out["loader"]["us_per_batch"] > 0 and out["fineweb"]["tokens"] > 100_000


def test_bench_bad_device_is_one_line():
    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda is not an error")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), "--device", "cuda", "--only", "train"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
