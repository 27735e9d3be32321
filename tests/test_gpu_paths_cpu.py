"""The GPU paths that a CPU can stand in for: fused AdamW, bf16 autocast for a training step and
for scoring, and the GPU names behind the MFU figure. tests/test_cuda.py runs the same checks
(helpers.py) on CUDA."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

import common
import metrics
import settings
from helpers import (BF16_LOSS_TOL, GPU_ARCHS, GPU_SHAPE, bf16_train_step, fused_vs_plain_adamw,
                     hellaswag_batched_vs_one_per_forward_bf16, kv_cache_vs_recompute_bf16,
                     random_batch, run_args, run_cli, tiny_model)


def test_fused_adamw_matches_plain_on_cpu():
    (model, fused), (ref, plain) = fused_vs_plain_adamw("cpu", steps=3)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    assert [len(g["params"]) for g in fused.param_groups] == \
        [len(g["params"]) for g in plain.param_groups]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_bf16_autocast_training_step_on_cpu(arch):
    x, y = random_batch("cpu")
    bf16_loss = bf16_train_step(tiny_model(**GPU_SHAPE, **GPU_ARCHS[arch]), x, y)
    fp32_loss = tiny_model(**GPU_SHAPE, **GPU_ARCHS[arch])(x, y)[1].item()
    assert bf16_loss == pytest.approx(fp32_loss, abs=BF16_LOSS_TOL)


def test_bf16_kv_cache_greedy_equals_recompute_on_cpu():
    cached, recomputed, seqs = kv_cache_vs_recompute_bf16("cpu")
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, seqs)  # it was memorized: wide margins, the agreement is no luck


@pytest.mark.slow
def test_bf16_hellaswag_batched_equals_one_per_forward_on_cpu(tmp_path):
    batched, single = hellaswag_batched_vs_one_per_forward_bf16("cpu", str(tmp_path / "hs"), n=3)
    assert batched == single and batched["acc_norm"] == 1.0


@pytest.mark.parametrize("name, flops", [
    ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("Tesla T4", 65e12),  # fp16: no bf16 there
    ("Tesla V100-SXM2-16GB", 125e12),
    ("Tesla V100-PCIE-32GB", 112e12),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_by_gpu_name(name, flops):
    assert metrics.peak_flops(name) == flops


class Hungry(torch.nn.Module):
    """A model that runs out of memory above `limit` sequences, as a GPU would."""

    def __init__(self, limit):
        super().__init__()
        self.limit, self.w = limit, torch.nn.Parameter(torch.ones(()))

    def forward(self, x, y):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return None, self.w * x.float().mean()


def test_auto_micro_batch_halves_until_a_real_step_fits():
    """-B auto's confirming step: where the estimate's choice runs out of memory on any rank, the
    next candidate at most half as large, until one fits everywhere; no gradient is left, no
    random generator moved."""
    agreed, rng = [], torch.get_rng_state()
    model = Hungry(limit=5)
    run = SimpleNamespace(sequence_length=4, device="cpu", device_type="cpu",
                          precision=SimpleNamespace(autocast=contextlib.nullcontext()))
    proc = SimpleNamespace(agree=lambda ok: agreed.append(ok) or ok)
    B = settings.confirm_micro_batch(model, [1, 2, 4, 8, 16], 16, run, proc)
    assert B == 4 and agreed == [False, False, True]
    assert model.w.grad is None and torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(common.UsageError, match="even -B 1 runs out of memory"):
        settings.confirm_micro_batch(Hungry(limit=0), [1, 2], 2, run,
                                     SimpleNamespace(agree=lambda ok: ok))


def test_auto_micro_batch_on_the_cpu_says_what_it_chose(data, tmp_path):
    r = run_cli(*run_args(data, str(tmp_path / "log"), "-B", "auto", "--max_steps", "1"))
    assert r.returncode == 0, r.stderr
    # 64-token steps of 32-token sequences: 2 at most, and a tiny model fits
    assert "-B auto: 2 (a step's estimated peak " in r.stdout
    assert "micro-steps a step: 1" in r.stdout
