"""The GPU paths that a CPU can stand in for: fused AdamW, bf16 autocast for a training step and for scoring,
and the GPU names behind the MFU figure. tests/test_cuda.py runs the same helpers on CUDA."""
import copy
import json
import os

import pytest
import torch

import hellaswag
import train_gpt2 as tg
from conftest import write_hellaswag

TINY = dict(block_size=128, n_layer=2, n_head=4, n_embd=64)
BF16_LOSS_TOL = 0.05  # bf16 keeps 8 mantissa bits (~0.4%): a loss near 10.8 moves by a few 1e-3


def tiny_gpt(device, seed=0, **kw):
    torch.manual_seed(seed)
    return tg.GPT(tg.GPTConfig(**{**TINY, **kw})).to(device)


def random_batch(device, B=2, T=64, vocab=50257, seed=1):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, vocab, (B, T + 1), generator=g)
    return buf[:, :-1].to(device), buf[:, 1:].to(device)


def bf16_train_step(model, x, y):
    """Forward and backward under bf16 autocast; checks the dtypes a mixed-precision step must have."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits, loss = model(x, y)
    loss.backward()
    assert logits.dtype == torch.bfloat16  # the matmuls ran in bf16 ...
    assert loss.dtype == torch.float32 and torch.isfinite(loss)  # ... the softmax and loss in fp32
    for name, p in model.named_parameters():  # fp32 master weights get fp32 gradients
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    return loss.item()


def fused_vs_plain_adamw(device, steps):
    """Two copies of one model stepped with the same gradients: configure_optimizers' fused AdamW (what
    CUDA gets) and its non-fused one (what other devices get). Returns ((model, opt), (model, opt))."""
    model = tiny_gpt(device)
    ref = copy.deepcopy(model)
    fused = model.configure_optimizers(0.1, 1e-3, "cuda", verbose=False)  # fused on any device (torch >= 2.4)
    plain = ref.configure_optimizers(0.1, 1e-3, "cpu", verbose=False)
    for step in range(steps):
        x, y = random_batch(device, seed=step)
        model(x, y)[1].backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
        fused.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    return (model, fused), (ref, plain)


def memorize(model, rows, starts=None, lr=1e-2, max_steps=300, until=0.1):
    """Train on these token rows until the model knows them by heart: row i's tokens from index starts[i]
    on (default 1: all of them) are the targets. Random weights give near-ties that bf16 rounding may break
    either way; a memorized model's choices win by wide margins, so two bf16 code paths must agree exactly."""
    device = next(model.parameters()).device
    starts = starts or [1] * len(rows)
    T = max(len(r) for r in rows) - 1
    x = torch.zeros(len(rows), T, dtype=torch.long)
    y = torch.full((len(rows), T), -100, dtype=torch.long)  # padding and context: no target
    for i, (r, s) in enumerate(zip(rows, starts)):
        x[i, : len(r) - 1], y[i, s - 1: len(r) - 1] = torch.tensor(r[:-1]), torch.tensor(r[s:])
    x, y = x.to(device), y.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(max_steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if loss.item() < until:
            break
    return loss.item()


def kv_cache_vs_recompute_bf16(device):
    """Greedy continuations of a memorized prompt under bf16, with and without the KV cache."""
    model = tiny_gpt(device, vocab_size=512, real_vocab_size=500)  # a small vocab keeps training quick
    g = torch.Generator().manual_seed(2)
    # no token twice in a row: each token's successor is unique, a bigram table learnt in a few dozen steps
    seqs = torch.stack([torch.randperm(500, generator=g)[:48] for _ in range(2)])
    memorize(model, seqs.tolist())
    prompt = seqs[:, :8].to(device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        cached = model.generate(prompt, 40, top_k=1, use_cache=True)
        recomputed = model.generate(prompt, 40, top_k=1, use_cache=False)
    return cached.cpu(), recomputed.cpu(), seqs


def hellaswag_batched_vs_one_per_forward_bf16(device, folder, n=6):
    """HellaSwag results under bf16 of a model that memorized the fixture's right endings, batched and
    one example per forward (batch_tokens=0)."""
    import fineweb

    write_hellaswag(folder, n)
    enc = fineweb.get_encoding()
    with open(os.path.join(folder, "hellaswag_val.jsonl")) as f:
        examples = [json.loads(line) for line in f]
    ctxs = [enc.encode(ex["ctx"]) for ex in examples]
    rights = [enc.encode(" " + ex["endings"][ex["label"]]) for ex in examples]
    model = tiny_gpt(device)
    # only the right endings are targets: the made-up contexts are random words, slow to learn and not needed
    memorize(model, [c + e for c, e in zip(ctxs, rights)], starts=[len(c) for c in ctxs], until=0.5)
    return [hellaswag.evaluate(model, device, data_dir=folder, batch_tokens=bt, autocast_dtype=torch.bfloat16)
            for bt in (8192, 0)]


# ----------------------------------------------------------------------------- on CPU

def test_fused_adamw_matches_plain_on_cpu():
    (model, fused), (ref, plain) = fused_vs_plain_adamw("cpu", steps=3)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    assert [len(g["params"]) for g in fused.param_groups] == [len(g["params"]) for g in plain.param_groups]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_autocast_training_step_on_cpu():
    x, y = random_batch("cpu")
    bf16_loss = bf16_train_step(tiny_gpt("cpu"), x, y)
    fp32_loss = tiny_gpt("cpu")(x, y)[1].item()
    assert bf16_loss == pytest.approx(fp32_loss, abs=BF16_LOSS_TOL)


def test_bf16_kv_cache_greedy_equals_recompute_on_cpu():
    cached, recomputed, seqs = kv_cache_vs_recompute_bf16("cpu")
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, seqs)  # it was memorized: the margins are wide, the agreement is no luck


def test_bf16_hellaswag_batched_equals_one_per_forward_on_cpu(tmp_path):
    batched, single = hellaswag_batched_vs_one_per_forward_bf16("cpu", str(tmp_path / "hs"))
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
    ("Tesla T4", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_by_gpu_name(name, flops):
    assert tg.peak_flops(name) == flops
