"""Every CUDA path we ship, on tiny models unless stated: bf16 autocast, flash SDPA, fused AdamW,
torch.compile, the CLI (val, samples, HellaSwag, checkpoints, MFU and memory), resume on and across
devices, KV-cache and batched-HellaSwag agreement under bf16, NCCL with DDP and FSDP2, and GPT-2
124M's memory and MFU.

Skipped without CUDA. The GPU suite is this file: `python -m pytest -q -rfEs tests/test_cuda.py`;
the GPU benchmark is bench.py (`python bench.py --preset gpt2 -B 64 -T 1024 --device cuda`)."""
import argparse
import os
import re

import pytest
import torch

import metrics
import rundir
import settings
import train_gpt2 as tg
from helpers import (BF16_LOSS_TOL, DIST_FLAGS, GPU_ARCHS, GPU_SHAPE, assert_same_log,
                     bf16_train_step, fused_vs_plain_adamw,
                     hellaswag_batched_vs_one_per_forward_bf16, kv_cache_vs_recompute_bf16,
                     random_batch, run_args, run_cli, series, stop_then_resume, tiny_model,
                     torchrun, write_hellaswag)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available on this machine")

# Runs in bf16 agree to this much, not bit for bit: CUDA's atomics (embedding and attention
# backward) add in a varying order, and one process with 4 micro-steps rounds differently from 2
# ranks with 2 each
CUDA_LOSS_TOL = 2e-2
# bf16 on CUDA against fp32 on CPU: the rounding of every matmul, over a few steps
CROSS_DEVICE_LOSS_TOL = 5e-2
# A floor, not a target (about 50% is the aim): fp32 matmuls run as TF32 at half the bf16 peak
# and math attention writes (B, H, T, T) scores to memory, so a silent fallback to either lands
# far below it
MFU_FLOOR = 0.25


@pytest.fixture(autouse=True)
def keep_matmul_precision():
    """The in-process CLI runs turn TF32 on: keep that out of the CPU tests that follow."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def on_cuda(*args):
    # eager: compile has its own tests, and a compile per resumed run would not fit the suite's
    # time
    return run_cli(*args, "--device", "cuda", "--no-compile")


@pytest.fixture(scope="module")
def cuda_single(data, tmp_path_factory):
    """Eight steps straight in one process on CUDA: the reference for the resume and NCCL runs."""
    log = str(tmp_path_factory.mktemp("cuda") / "single")
    r = on_cuda(*run_args(data, log, *DIST_FLAGS))
    assert r.returncode == 0, r.stderr
    return log


# -------------------------------------------------------------------------------- kernels, numerics

@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_bf16_autocast_forward_backward(arch):
    x, y = random_batch("cuda")
    bf16_loss = bf16_train_step(tiny_model(device="cuda", **GPU_SHAPE, **GPU_ARCHS[arch]), x, y)
    fp32_loss = tiny_model(**GPU_SHAPE, **GPU_ARCHS[arch])(x.cpu(), y.cpu())[1].item()
    assert bf16_loss == pytest.approx(fp32_loss, abs=BF16_LOSS_TOL)


@pytest.mark.parametrize("n_kv_head", [None, 2], ids=["mha", "gqa"])
def test_sdpa_uses_a_fused_kernel_for_train_shapes(n_kv_head):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # GPT-2's head size, 64
    model = tiny_model(device="cuda", n_embd=256, n_kv_head=n_kv_head, **GPU_SHAPE)
    x, y = random_batch("cuda", B=4, T=128)
    # without the math backend, an ineligible call raises instead of silently falling back to it
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
    assert torch.isfinite(loss)


def test_fused_adamw_is_used_and_matches_plain():
    (model, fused), (ref, plain) = fused_vs_plain_adamw("cuda", steps=1)
    # configure_optimizers(device_type="cuda") fuses
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_compile_no_graph_breaks_no_recompiles_and_matches_eager(arch):
    import torch._dynamo

    model = tiny_model(device="cuda", **GPU_SHAPE, **GPU_ARCHS[arch])
    compiled = torch.compile(model, fullgraph=True)  # a graph break is an error
    x, y = random_batch("cuda")
    bf16 = torch.autocast("cuda", dtype=torch.bfloat16)

    def train_step():
        with bf16:
            loss = compiled(x, y)[1]
        loss.backward()
        return loss.item()

    def eval_step():
        compiled.eval()
        with torch.no_grad(), bf16:
            compiled(x, y)
        compiled.train()

    torch._dynamo.reset()
    try:
        compiled_loss = train_step()
        eval_step()  # eval mode and no_grad: a second graph, compiled once
        with torch._dynamo.config.patch(error_on_recompile=True):
            train_step()
            eval_step()
            train_step()
    finally:
        torch._dynamo.reset()
    with torch.no_grad(), bf16:
        eager_loss = model(x, y)[1].item()  # no optimizer step above: the same weights
    assert compiled_loss == pytest.approx(eager_loss, abs=BF16_LOSS_TOL)


def test_kv_cache_greedy_equals_recompute_bf16():
    cached, recomputed, seqs = kv_cache_vs_recompute_bf16("cuda")
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, seqs)  # memorized: wide margins, so the agreement is no luck


def test_batched_hellaswag_equals_one_per_forward_bf16(tmp_path):
    batched, single = hellaswag_batched_vs_one_per_forward_bf16("cuda", str(tmp_path / "hs"))
    assert batched == single and batched["acc_norm"] == 1.0


# ---------------------------------------------------------------------------------- the CLI on CUDA

def test_cli_end_to_end_on_cuda(data, tmp_path, monkeypatch):
    write_hellaswag(str(tmp_path / "hs"), 8)
    monkeypatch.setenv("HELLASWAG_DIR", str(tmp_path / "hs"))
    log = str(tmp_path / "log")
    # an unknown GPU has no MFU by default: give it a peak so the column is still checked
    peak = [] if metrics.peak_flops(torch.cuda.get_device_name()) else ["--peak_flops", "1e15"]
    r = run_cli(*run_args(data, log, "--device", "cuda", "--hellaswag_every", "5", *peak))
    assert r.returncode == 0, r.stderr
    assert " precision=bf16" in r.stdout and " compile=True" in r.stdout  # CUDA defaults
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 8
    assert all(re.search(r"\| mfu \d+\.\d%", s) and re.search(r"\| mem \d+\.\dGiB", s)
               for s in steps), steps[-1]
    # samples at 3, 6 and of the final model; HellaSwag at 0, 5 and of the final model
    assert r.stdout.count("sample 0:") == 3 and r.stdout.count("HellaSwag accuracy: ") == 3
    logged = series(log)
    assert logged["val"][0] == [0, 3, 6, 8] and logged["hella"][0] == [0, 5, 8]
    # written on CUDA, loads on the CPU
    path = os.path.join(log, "model_00007.pt")
    model = tg.model_from_checkpoint(rundir.read_checkpoint(path), path)
    assert next(model.parameters()).device.type == "cpu"


def test_stop_and_resume_on_cuda(data, cuda_single, tmp_path):
    log = str(tmp_path / "resumed")
    stop_then_resume(data, log, on_cuda, on_cuda)
    assert_same_log(log, cuda_single, CUDA_LOSS_TOL)


@pytest.mark.parametrize("first, second", [(on_cuda, run_cli), (run_cli, on_cuda)],
                         ids=["cuda-cpu", "cpu-cuda"])
def test_checkpoint_moves_between_cuda_and_cpu(data, cuda_single, tmp_path, first, second):
    log = str(tmp_path / "moved")
    stop_then_resume(data, log, first, second)
    assert_same_log(log, cuda_single, CROSS_DEVICE_LOSS_TOL)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL across processes needs at least 2 CUDA GPUs")
@pytest.mark.parametrize("extra", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_gpus_nccl_match_one_process(data, cuda_single, tmp_path, extra):
    log = str(tmp_path / "nccl")
    # compiled, as shipped
    r = torchrun(*run_args(data, log, *DIST_FLAGS, "--device", "cuda", *extra))
    assert r.returncode == 0, r.stderr[-3000:]
    assert " world_size=2" in r.stdout and " compile=True" in r.stdout
    assert_same_log(log, cuda_single, CUDA_LOSS_TOL)


# --------------------------------------------------------------------------------------- GPT-2 124M

def test_gpt2_124m_compiled_memory_and_mfu(record_property):
    import bench

    torch.cuda.empty_cache()
    torch.set_float32_matmul_precision("high")
    args = argparse.Namespace(micro_batch_size=64, sequence_length=1024, grad_accum=1,
                              compile=True, compile_mode=None, foreach_adamw=False,
                              peak_flops=None, warmup=3, steps=3)
    config = tg.GPTConfig(**settings.MODEL_PRESETS["gpt2"])
    row = bench.bench_training(args, bench.Target(config, "cuda",
                                                  torch.autocast("cuda", dtype=torch.bfloat16)))
    for key in ("tokens_per_sec", "ms_per_step", "mfu", "peak_mem_gib"):
        record_property(key, row[key])  # in pytest's --junitxml report, for whoever keeps one
    print(f"GPT-2 124M B=64 T=1024 compiled bf16 on {torch.cuda.get_device_name()}: {row}")
    assert row["peak_mem_gib"] > 0
    if row["mfu"] is not None:  # None on a GPU that peak_flops does not know
        assert row["mfu"] >= MFU_FLOOR, row
