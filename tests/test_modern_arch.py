"""--arch modern against independent references: rotary embeddings (transformers' Llama, the
complex-number formula), RMSNorm and QK-norm written out, soft-capped logits, the zero inits (the
loss at init is ln(50,257)), parameter counts by hand; the KV cache and HellaSwag on a modern model;
each part one flag; the commands on a modern checkpoint; GPT-2's architecture unchanged."""
import json
import math
import os
import re
import shutil
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

import hellaswag
import openai_gpt2
import rundir
import settings
import train_gpt2 as tg
from helpers import (RUN_FLAGS, SHORT, TINY, assert_one_line_error, classic_scores, log_of,
                     make_records, preds, resume_args, run_args, run_cli, series, step_lines,
                     tiny_model, write_hellaswag)

GPT2, MODERN = settings.ARCHITECTURES["gpt2"], settings.ARCHITECTURES["modern"]
SHAPE = {**TINY, "n_head": 4}  # heads of 16: 8 rotary pairs each
V, C, L, HS = tg.GPTConfig().vocab_size, TINY["n_embd"], TINY["n_layer"], TINY["n_embd"] // 4
REAL_V = tg.GPT2_VOCAB_SIZE


def modern_model(seed=0, **kw):
    """A seeded modern GPT of TINY's shape with 4 heads, changed by kw, in eval mode."""
    return tiny_model(seed, **{**MODERN, "n_head": 4, **kw}).eval()


def scrambled(model, std=0.1, seed=1):
    """Every weight redrawn from N(0, std): at init the zero projections make each block the
    identity, which would hide what attention does. The head's bias is drawn so that it adds
    N(0, std) to the logits (it enters them times tg.HEAD_BIAS_SCALE)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
        if model.lm_head.bias is not None:
            model.lm_head.bias /= tg.HEAD_BIAS_SCALE
    return model


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def tokens(B, T, seed=0):
    return torch.randint(0, REAL_V, (B, T), generator=torch.Generator().manual_seed(seed))


def parts(config):
    return {k: getattr(config, k) for k in settings.ARCH_PARTS}


# ===== The references, written from the definitions (no code of train_gpt2's) ====================
def rms_reference(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + tg.RMS_EPS)


def rotate_reference(x, positions, base=10000.0):
    """x (..., T, hs) at these positions, turned by RoFormer's complex formula (in float64): pair
    (x[i], x[i + hs/2]) as the number x[i] + j*x[i + hs/2], times exp(j * pos * base^(-2i/hs))."""
    hs = x.shape[-1]
    z = torch.complex(*x.double().chunk(2, dim=-1))
    theta = base ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    turned = z * torch.exp(1j * positions.double()[:, None] * theta)
    return torch.cat((turned.real, turned.imag), dim=-1).to(x.dtype)


def llama_rotary(x, positions):
    """transformers' Llama rotary embedding (rope_theta 10000) of x (B, nh, T, hs): (x turned,
    Llama's cos table (T, hs))."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)
    nh, hs = x.shape[1], x.shape[-1]
    config = LlamaConfig(hidden_size=nh * hs, num_attention_heads=nh, rope_theta=10000.0,
                         max_position_embeddings=TINY["block_size"])
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    return apply_rotary_pos_emb(x, x, cos, sin)[0], cos[0]


def attention_reference(attn, x, qk_norm, ve=None):
    """A modern CausalSelfAttention (no biases) written out: q, k, v from c_attn's weight, each
    head's q and k RMS-normalized (qk_norm) and turned to its position, an explicit causal softmax,
    then c_proj. ve (B, T, C): value embeddings, each head's added to its v times 2 sigmoid(its
    gate's row . the input's first channels)."""
    B, T, _ = x.shape
    q, k, v = (t.view(B, T, attn.n_head, attn.hs).transpose(1, 2)
               for t in F.linear(x, attn.c_attn.weight).split(attn.n_head * attn.hs, dim=2))
    if ve is not None:
        w = attn.ve_gate.weight  # (n_head, channels)
        gate = 2 * torch.sigmoid(x[..., : w.shape[1]] @ w.t())  # (B, T, n_head)
        v = v + (gate[..., None] * ve.view(B, T, attn.n_head, attn.hs)).transpose(1, 2)
    if qk_norm:
        q, k = rms_reference(q), rms_reference(k)
    q, k = rotate_reference(q, torch.arange(T)), rotate_reference(k, torch.arange(T))
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    att = (q @ k.transpose(-2, -1) / math.sqrt(attn.hs)).masked_fill(future, -math.inf)
    y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    return F.linear(y, attn.c_proj.weight)


def forward_reference(model, idx):
    """The modern GPT's logits over the real vocabulary from its parts: the token embedding (x0),
    pre-norm blocks of attention_reference and a ReLU² MLP, each block's input adding
    x0_lambdas[i] * x0, the final RMSNorm, the untied head and its bias, then cap * tanh(logits /
    cap). (skips_reference: with the optional parts too.)"""
    return skips_reference(model, idx)


# ----------------------------------------------------------------------------- rotary embeddings

@pytest.mark.parametrize("past", [0, 21])  # a prefill, and a chunk after 21 cached positions
def test_rotary_matches_llama_and_the_complex_formula(past):
    T = 32
    cos, sin = tg.rotary_tables(tg.GPTConfig(**SHAPE, **MODERN))
    q = randn(2, 4, T, HS)
    positions = torch.arange(past, past + T)
    ours = tg.apply_rotary(q, cos[past: past + T], sin[past: past + T])
    llama, llama_cos = llama_rotary(q, positions)
    torch.testing.assert_close(ours, llama, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, rotate_reference(q, positions), atol=1e-5, rtol=1e-5)
    # the table itself is Llama's (which repeats it for the second half of a head)
    torch.testing.assert_close(cos[past: past + T], llama_cos[:, : HS // 2])
    assert not torch.allclose(ours[:, :, 1:], q[:, :, 1:], atol=1e-3)  # it turns something


def test_rotated_dot_product_depends_only_on_the_distance():
    cos, sin = tg.rotary_tables(tg.GPTConfig(**SHAPE, **MODERN))
    q, k = randn(2, HS, seed=3)

    def score(m, n):  # q at position m against k at position n
        def at(x, p):
            return tg.apply_rotary(x.view(1, 1, 1, HS), cos[p: p + 1], sin[p: p + 1]).flatten()
        return (at(q, m) @ at(k, n)).item()

    for m, n in [(0, 0), (5, 2), (2, 5), (30, 1)]:
        for shift in (1, 9, 63 - max(m, n)):  # the last: to the end of the block
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-4, abs=1e-5)
    # ... and on the distance it does (no rotation at all would pass the shifts above)
    distances = [score(10 + d, 10) for d in (-3, 0, 3, 20)]
    assert min(abs(a - b) for i, a in enumerate(distances) for b in distances[i + 1:]) > 1e-3


def test_rotary_gradient_is_the_turn_back():
    """Rotary's own backward (the opposite turn) against autograd through the complex formula."""
    cos, sin = tg.rotary_tables(tg.GPTConfig(**SHAPE, **MODERN))
    positions = torch.arange(5, 37)
    q = randn(2, 4, 32, HS, seed=6).double().requires_grad_()
    grad = randn(2, 4, 32, HS, seed=7).double()
    ours = tg.apply_rotary(q, cos[5:37].double(), sin[5:37].double())
    (want,) = torch.autograd.grad(rotate_reference(q, positions), q, grad)
    (got,) = torch.autograd.grad(ours, q, grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the tables are fp32
    assert not torch.allclose(got, grad, atol=1e-3)  # it turns something


# ------------------------------------------------------------------------------ RMSNorm, QK-norm

def test_rmsnorm_is_x_over_root_mean_square_plus_eps():
    model = modern_model(embed_norm=True)
    t = model.transformer
    norms = [t.ln_e, t.ln_f] + [n for b in t.h for n in (b.ln_1, b.ln_2)]
    assert all(not list(n.parameters()) for n in norms)  # no weights: nothing to learn there
    # 1e-4: mean(x²) = 1e-8, under eps, which then sets the result (eps inside the root, its value)
    for scale in (3.0, 1e-4):
        x = randn(2, 32, C) * scale
        for norm in norms:
            torch.testing.assert_close(norm(x), rms_reference(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_with_qk_norm_and_rotary_written_out(qk_norm):
    model = scrambled(modern_model(qk_norm=qk_norm))
    attn, T = model.transformer.h[0].attn, 32
    x = rms_reference(randn(2, T, C, seed=4))  # what ln_1 hands the attention
    got = attn(x, rotary=(model.rotary_cos[:T], model.rotary_sin[:T]))
    torch.testing.assert_close(got, attention_reference(attn, x, qk_norm), atol=1e-5, rtol=1e-4)
    # the norm matters at these weights: an attention that skipped it would fail above
    other = attention_reference(attn, x, not qk_norm)
    assert (got - other).abs().max() > 1e-3


def test_relu_squared_and_head_norm_against_their_plain_formulas():
    h = (randn(4, 8, 3 * C, seed=8).double() * 2).requires_grad_()
    grad = randn(4, 8, 3 * C, seed=9).double()
    ours = tg.ReLUSquared.apply(h)
    want = F.relu(h) ** 2
    assert ours.equal(want) and (h < 0).any() and (h > 0).any()
    torch.testing.assert_close(torch.autograd.grad(ours, h, grad)[0],
                               torch.autograd.grad(want, h, grad)[0], rtol=0, atol=0)
    # QK-norm in the head's own dtype under autocast (bf16 in, bf16 out), the norm in fp32 rounded
    q = randn(2, 4, 16, HS, seed=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tg.head_rms_norm(q.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), rms_reference(q.bfloat16().float()), rtol=2e-2,
                               atol=2e-2)


def test_modern_forward_is_its_parts_written_out():
    """The whole model, wired: embedding norm, the blocks, ReLU², the final norm and the cap."""
    model = scrambled(modern_model())
    idx = tokens(2, 32, seed=5)
    with torch.no_grad():
        logits, _ = model(idx)
        torch.testing.assert_close(logits[..., :REAL_V], forward_reference(model, idx),
                                   atol=1e-4, rtol=1e-4)


# -------------------------------------------------------------------------------- soft-capping

def test_logits_are_soft_capped_and_padding_stays_minus_inf():
    model = scrambled(modern_model())
    cap = model.config.logit_softcap
    with torch.no_grad():
        model.lm_head.weight.copy_(randn(V, C, seed=6))  # raw logits of std ~8: the cap acts
        model.lm_head.weight[REAL_V:] = 50.0  # padding rows that would win every softmax
    final = []  # ln_f's output: the head's input
    model.transformer.ln_f.register_forward_hook(lambda module, args, out: final.append(out))
    idx, targets = tokens(2, 32, seed=7), tokens(2, 32, seed=8)
    with torch.no_grad():
        logits, _ = model(idx)
        none, loss = model(idx, targets)  # the loss only: training never reads the logits
    assert none is None
    raw = F.linear(final[0], model.lm_head.weight, tg.HEAD_BIAS_SCALE * model.lm_head.bias)
    real = logits[..., :REAL_V]
    assert raw[..., :REAL_V].abs().max() > 2 * cap
    torch.testing.assert_close(real, cap * torch.tanh(raw[..., :REAL_V] / cap))
    assert torch.isfinite(real).all() and real.abs().max() <= cap
    assert torch.isneginf(logits[..., REAL_V:]).all()
    assert logits.softmax(-1)[..., REAL_V:].max() == 0  # padding: probability 0
    # the loss is the capped logits' cross-entropy over the real vocabulary
    want = F.cross_entropy(real.reshape(-1, REAL_V), targets.reshape(-1))
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    out = model.generate(idx[:, :8], 20, top_k=None, generator=torch.Generator().manual_seed(0))
    assert out.max() < REAL_V


def test_the_logits_bias_without_a_soft_cap_is_its_plain_formula():
    """--head_bias with --logit_softcap 0: logits x @ w.T + HEAD_BIAS_SCALE * b, padding -inf,
    and the loss and the bias's gradient those of F.cross_entropy on them."""
    model = scrambled(modern_model(logit_softcap=0.0)).double()
    final = []  # ln_f's output: the head's input
    model.transformer.ln_f.register_forward_hook(lambda module, args, out: final.append(out))
    idx, targets = tokens(2, 16, seed=14), tokens(2, 16, seed=15)
    logits, loss = model(idx, targets)
    b = model.lm_head.bias
    want = final[0] @ model.lm_head.weight[:REAL_V].t() + tg.HEAD_BIAS_SCALE * b[:REAL_V]
    torch.testing.assert_close(logits[..., :REAL_V], want, rtol=1e-12, atol=1e-12)
    assert torch.isneginf(logits[..., REAL_V:]).all()
    (grad,) = torch.autograd.grad(loss, b)
    (ref,) = torch.autograd.grad(F.cross_entropy(want.reshape(-1, REAL_V), targets.view(-1)), b)
    torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-14)
    assert grad.abs().max() > 0 and (grad[REAL_V:] == 0).all()


def softcap_reference(x, w, b, targets, cap, n_real):
    """The soft-capped head and its loss by the plain formula: every (N, vocab) tensor kept."""
    logits = cap * torch.tanh(F.linear(x, w, b) / cap)
    logits = torch.cat((logits[:, :n_real], torch.full_like(logits[:, n_real:], -math.inf)), 1)
    return logits, F.cross_entropy(logits, targets)


@pytest.mark.parametrize("chunk", [1, 7, 10_000])  # rows a chunk: one, a ragged last, all
@pytest.mark.parametrize("bias", [False, True])
def test_softcap_head_loss_matches_the_plain_formula(chunk, bias, monkeypatch):
    N, width, vocab, n_real, cap = 50, 24, 300, 290, 5.0
    monkeypatch.setitem(tg.HEAD_CHUNK, "cpu", chunk * vocab)
    x = (randn(N, width, seed=1).double() * 3).requires_grad_()
    w = randn(vocab, width, seed=2).double().requires_grad_()
    inputs, b = (x, w), None
    if bias:
        b = (randn(vocab, seed=4).double() * 4).requires_grad_()
        inputs = (x, w, b)
    targets = tokens(1, N, seed=3)[0] % n_real
    targets[[4, 31]] = -100  # ignored, as F.cross_entropy's ignore_index
    want_logits, want = softcap_reference(x, w, b, targets, cap, n_real)
    want_grads = torch.autograd.grad(2.5 * want, inputs)
    loss = tg.SoftcapHeadLoss.apply(x, w, b, targets, cap, n_real, True)
    grads = torch.autograd.grad(2.5 * loss, inputs)
    assert want.abs() > 1 and want_logits[:, n_real:].isneginf().all()
    assert (F.linear(x, w).abs() > 4 * cap).any()  # the cap acts: raw logits far beyond it
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)
    assert all((g[n_real:] == 0).all() for g in grads[1:])  # padding ids' rows never learn


def test_the_modern_model_trains_through_the_chunked_head_as_by_the_plain_formula():
    model = scrambled(modern_model()).double()
    idx, targets = tokens(2, 32, seed=4), tokens(2, 32, seed=5)
    _, loss = model(idx, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    params = dict(model.named_parameters())
    # the plain formula for the same model: the head's logits without targets, then the loss
    logits, _ = model(idx)
    want = F.cross_entropy(logits.view(-1, V), targets.view(-1))
    want_grads = torch.autograd.grad(want, list(params.values()))
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for name, got, ref in zip(params, grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-13, msg=name)
    with torch.no_grad():  # the same loss without a graph
        assert model(idx, targets)[1].item() == loss.item()
    # bf16 autocast: the chunked head computes in fp32 what the plain formula does in bf16
    model = scrambled(modern_model()).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, targets)
        want = F.cross_entropy(model(idx)[0].float().view(-1, V), targets.view(-1))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(want.item(), rel=2e-2)


# ------------------------------------------------------------------------------ init, and GPT-2's

def test_zero_inits_give_the_uniform_loss_at_init():
    model = modern_model()
    blocks = model.transformer.h
    assert all((w == 0).all() for b in blocks for w in (b.attn.c_proj.weight, b.mlp.c_proj.weight))
    assert model.lm_head.weight is not model.transformer.wte.weight  # untied
    # what is not zeroed keeps GPT-2's N(0, 0.02): the head too, unless --zero_head
    for w in (model.transformer.wte.weight, blocks[0].attn.c_attn.weight,
              blocks[1].mlp.c_fc.weight, model.lm_head.weight):
        assert abs(w.std().item() - 0.02) < 0.002
    zero_head = modern_model(zero_head=True)
    _, loss = zero_head(tokens(4, 64, seed=9), tokens(4, 64, seed=10))
    logits, _ = zero_head(tokens(4, 64, seed=9))
    assert abs(loss.item() - math.log(REAL_V)) < 1e-5  # every real token equally likely
    assert (logits[..., :REAL_V] == 0).all() and (zero_head.lm_head.weight == 0).all()
    # GPT-2's tied head is its embedding, which the flag leaves alone
    tied = tiny_model(n_head=4, zero_head=True)
    assert abs(tied.lm_head.weight.std().item() - 0.02) < 0.002
    # no biases but the head's, no norm weights: the x0 scalars and the head's bias are its 1-D
    # parameters, both starting at 0, in AdamW's no-decay group
    assert [n for n, p in model.named_parameters() if p.dim() != 2] == \
        ["transformer.skips.x0_lambdas", "lm_head.bias"]
    assert (model.transformer.skips.x0_lambdas == 0).all() and (model.lm_head.bias == 0).all()
    opt = model.configure_optimizers(0.1, 1e-3, "cpu", verbose=False)
    assert [len(g["params"]) for g in opt.param_groups] == [len(list(model.parameters())) - 2, 2]
    # without them, AdamW has one group: an empty no-decay one is what torch's state-dict helpers
    # refuse
    bare = modern_model(x0_skip=False, head_bias=False)
    opt = bare.configure_optimizers(0.1, 1e-3, "cpu", verbose=False)
    assert [len(g["params"]) for g in opt.param_groups] == [len(list(bare.parameters()))]


def test_gpt2_is_the_default_architecture_and_unchanged():
    assert set(GPT2) == set(MODERN) == set(settings.ARCH_PARTS) <= set(asdict(tg.GPTConfig()))
    assert parts(tg.GPTConfig()) == GPT2 and tg.GPTConfig().gpt2_differences() == []
    # modern changes GPT-2's nine parts; the later ones are each a flag, in modern where measured
    # to win (docs/performance.md)
    changed = {k: v for k, v in MODERN.items() if v != GPT2[k]}
    assert set(changed) >= {"bias", "pos_emb", "norm", "qk_norm", "activation",
                            "tie_embeddings", "zero_init", "head_bias", "logit_softcap"}
    assert tg.GPTConfig(**MODERN).gpt2_differences() == [f"{k}={v}" for k, v in changed.items()]
    args, _, _ = settings.read_flags(["--preset", "tiny"])
    assert args.arch == "gpt2" and parts(tg.model_config(args)) == GPT2
    # the same seed, the same weights, with the parts left to their defaults or given
    default, explicit = tiny_model(n_head=4), tiny_model(n_head=4, **GPT2)
    a, b = default.state_dict(), explicit.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    # GPT-2's modules: a learned wpe, LayerNorms with biases, biased Linears, the tied head
    assert {"transformer.wpe.weight", "transformer.h.0.ln_1.bias", "transformer.h.1.mlp.c_fc.bias",
            "transformer.ln_f.weight"} <= set(a)
    assert default.lm_head.weight is default.transformer.wte.weight


# ---------------------------------------------------------------------------- parameter counts

def test_parameter_counts_by_hand():
    T = TINY["block_size"]
    matrices = L * (C * 3 * C + C * C + C * 4 * C + 4 * C * C)  # c_attn, c_proj, c_fc, c_proj
    modern = modern_model()
    x0 = L  # a scalar a block
    # wte, the untied lm_head and its bias
    assert modern.get_num_params() == 2 * V * C + V + matrices + x0
    # wte, a lookup, left out; lm_head, a matmul, kept
    assert modern.get_num_params(non_embedding=True) == V * C + V + matrices + x0
    tied = modern_model(tie_embeddings=True)  # one table, the head's: counted once, kept
    assert tied.get_num_params() == tied.get_num_params(non_embedding=True) == \
        V * C + V + matrices + x0
    gpt2 = tiny_model(n_head=4)
    biases = L * (3 * C + C + 4 * C + C)
    layernorms = L * 2 * 2 * C + 2 * C  # ln_1, ln_2 (weight, bias) per block, ln_f
    assert gpt2.get_num_params() == V * C + T * C + matrices + biases + layernorms
    assert gpt2.get_num_params(non_embedding=True) == V * C + matrices + biases + layernorms


# ------------------------------------------------------ value embeddings, x0 and U-net skips

PARTS = dict(value_embeds=True, x0_skip=True, unet_skip=True)


def skips_reference(model, idx):
    """The logits of a modern GPT with value embeddings, x0 and U-net skips, from the parts'
    definitions: block i's input adds x0_lambdas[i] * x0 (the normalized embedding) and, in the
    second half, unet_lambdas[j] * (block j's output) for its mirror j = n - 1 - i; the blocks
    with a value table (every other one, the last among them) add its rows to their values."""
    x = x0 = model.transformer.wte.weight[idx]
    if model.config.embed_norm:
        x = x0 = rms_reference(x0)
    t, outputs = model.transformer, []
    skips = t.skips if "skips" in t else None
    tables = t.ve if "ve" in t else {}
    n = len(model.transformer.h)
    for i, block in enumerate(model.transformer.h):
        if skips is not None and skips.x0_lambdas is not None:
            x = x + skips.x0_lambdas[i] * x0
        if skips is not None and skips.unet_lambdas is not None and n - 1 - i < n // 2:
            x = x + skips.unet_lambdas[n - 1 - i] * outputs[n - 1 - i]
        ve = tables[str(i)].weight[idx] if str(i) in tables else None
        x = x + attention_reference(block.attn, rms_reference(x), qk_norm=True, ve=ve)
        h = F.linear(rms_reference(x), block.mlp.c_fc.weight)
        x = x + F.linear(F.relu(h) ** 2, block.mlp.c_proj.weight)
        outputs.append(x)
    logits = rms_reference(x) @ model.lm_head.weight[:REAL_V].t()
    if model.lm_head.bias is not None:  # the bias's parameter scaled (AdamW's steps: ~its LR)
        logits = logits + tg.HEAD_BIAS_SCALE * model.lm_head.bias[:REAL_V]
    cap = MODERN["logit_softcap"]
    return cap * torch.tanh(logits / cap)


def test_value_embeddings_and_skips_are_their_definitions_written_out():
    model = scrambled(modern_model(n_layer=4, **PARTS))  # lambdas and gates away from 0 too
    assert sorted(model.transformer.ve) == ["1", "3"]  # every other block, the last among them
    assert [b.attn.ve_gate is not None for b in model.transformer.h] == [False, True, False, True]
    idx = tokens(2, 32, seed=12)
    with torch.no_grad():
        logits, _ = model(idx)
    torch.testing.assert_close(logits[..., :REAL_V], skips_reference(model, idx), atol=1e-5,
                               rtol=1e-4)
    # each part matters at these weights: the model without it gives other logits
    for part in PARTS:
        other = scrambled(modern_model(n_layer=4, **{**PARTS, part: False}))
        with torch.no_grad():
            assert (other(idx)[0][..., :REAL_V] - logits[..., :REAL_V]).abs().max() > 1e-3
    # the tables are embeddings (AdamW, decayed, out of the non-embedding count); the lambdas
    # are scalars (AdamW, not decayed); the gates are matrices in the blocks (Muon's)
    base = modern_model(n_layer=4, x0_skip=False)
    tables = sum(p.numel() for p in model.transformer.ve.parameters())
    gates = sum(b.attn.ve_gate.weight.numel() for b in model.transformer.h[1::2])
    assert model.get_num_params(True) == base.get_num_params(True) + gates + 4 + 2
    assert model.get_num_params() == base.get_num_params() + tables + gates + 4 + 2
    opt = model.configure_optimizers(0.1, 1e-3, "cpu", verbose=False, muon={})
    adamw, muon = opt
    decayed, plain = (set(map(id, g["params"])) for g in adamw.param_groups)
    assert {id(p) for p in model.transformer.ve.parameters()} <= decayed
    assert {id(p) for p in model.transformer.skips.parameters()} | {id(model.lm_head.bias)} == plain
    gate = model.transformer.h[1].attn.ve_gate.weight
    assert id(gate) in set(map(id, muon.param_groups[0]["params"]))


def test_skips_start_as_the_model_without_them():
    """The lambdas start at 0: at init the skips change nothing (value embeddings do: their gate
    starts at 1)."""
    idx = tokens(2, 16, seed=13)
    plain = scrambled(modern_model(n_layer=4, x0_skip=False))
    skips = modern_model(n_layer=4, x0_skip=True, unet_skip=True)
    missing = skips.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["transformer.skips.unet_lambdas", "transformer.skips.x0_lambdas"]
    with torch.no_grad():
        assert torch.equal(skips(idx)[0], plain(idx)[0])
        skips.transformer.skips.x0_lambdas.fill_(0.5)  # ... and once they move, they act
        assert not torch.equal(skips(idx)[0], plain(idx)[0])


# ------------------------------------------------------------------------------------ KV cache

@pytest.mark.parametrize("kw", [dict(n_kv_head=4), dict(n_kv_head=1),  # MHA and MQA
                                dict(n_kv_head=2, n_layer=4, **PARTS)])
def test_kv_cache_greedy_equals_recompute(kw):
    model = scrambled(modern_model(**kw))
    idx = tokens(3, 9, seed=11)
    cached = model.generate(idx, 40, top_k=1)
    recomputed = model.generate(idx, 40, top_k=1, use_cache=False)
    assert torch.equal(cached[:, :9], idx) and torch.equal(cached, recomputed)
    assert len(set(cached[:, 9:].flatten().tolist())) > 5  # not one token whatever the position


def test_kv_cache_logits_match_full_forward():
    """Every position's logits, fed through the cache as a prefill, a chunk of 3 (masked), then
    token by token: the rotary positions continue where the cache left off."""
    model = scrambled(modern_model(n_kv_head=2))
    idx = tokens(2, 20, seed=12)
    cuts = [0, 7, 10, *range(11, 21)]
    cache = tg.KVCache(model.config, 2, 20, "cpu", torch.float32)
    with torch.no_grad():
        full, _ = model(idx)
        pieces = [model(idx[:, a:b], kv_cache=cache)[0] for a, b in zip(cuts, cuts[1:])]
    got = torch.cat(pieces, dim=1)
    torch.testing.assert_close(got[..., :REAL_V], full[..., :REAL_V], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- HellaSwag

def test_hellaswag_batched_equals_one_example_per_forward():
    model = scrambled(modern_model())
    recs = make_records(8, seed=3, **SHORT)
    ref = classic_scores(model, recs)  # one example per forward, every position's logits
    with torch.no_grad():
        runs = [hellaswag.score_examples(model, recs, "cpu", batch_tokens=bt)
                for bt in (0, 400, 8192)]
    for res in runs:
        assert preds(res) == [(p, pn) for p, pn, _ in ref]
        assert [r["sum_loss"] for r in res] == [pytest.approx(s, rel=1e-4) for _, _, s in ref]


# --------------------------------------------------------------------------------------- flags

def config_of(*argv):
    args, given, _ = settings.read_flags(list(argv))
    return tg.model_config(args), given


def one_flag(part, value):
    if isinstance(value, bool):
        return [f"--{part}" if value else f"--no-{part}"]
    return [f"--{part}", str(value)]


def test_arch_modern_gives_every_part():
    config, given = config_of("--arch", "modern")
    assert given == {"arch"} and parts(config) == MODERN
    assert config.n_layer == settings.MODEL_PRESETS["gpt2"]["n_layer"]  # the shape: the preset's
    config, _ = config_of("--arch", "modern", "--no-qk_norm")
    assert parts(config) == {**MODERN, "qk_norm": False}


@pytest.mark.parametrize("part", settings.ARCH_PARTS)
def test_each_part_is_one_flag(part):
    """From modern, one flag gives back GPT-2's part; from GPT-2, one flag takes modern's. Each
    mix builds a model that trains."""
    for arch, base, other in (("modern", MODERN, GPT2), ("gpt2", GPT2, MODERN)):
        config, given = config_of("--arch", arch, *one_flag(part, other[part]))
        assert given == {"arch", part} and parts(config) == {**base, part: other[part]}
        model = tg.GPT(replace(config, **SHAPE, n_kv_head=4))
        _, loss = model(tokens(1, 16), tokens(1, 16, seed=1))
        loss.backward()
        assert torch.isfinite(loss)


def test_the_architecture_has_its_own_learning_rate_per_preset():
    modern_lr = settings.ARCH_RUN_PRESETS["modern"]["tiny"]["max_lr"]
    assert modern_lr != settings.RUN_PRESETS["tiny"]["max_lr"]  # else this test shows nothing

    def max_lr(*argv):
        return settings.read_flags(["--preset", "tiny", *argv])[0].max_lr

    assert max_lr("--arch", "modern") == modern_lr
    assert max_lr() == max_lr("--arch", "gpt2") == settings.RUN_PRESETS["tiny"]["max_lr"]
    assert max_lr("--arch", "modern", "--max_lr", "1e-3") == 1e-3  # a flag given wins
    r = run_cli("--preset", "tiny", "--arch", "modern", "--help")  # --help shows it
    assert f"--max_lr MAX_LR peak learning rate (default: {modern_lr})" in " ".join(
        r.stdout.split())


# ------------------------------------------------------------------------------------ commands

@pytest.fixture(scope="module")
def modern_run(data, tmp_path_factory):
    """The tiny run (helpers.RUN_FLAGS) with --arch modern: (its log dir, its result)."""
    log = str(tmp_path_factory.mktemp("modern") / "log")
    r = run_cli(*run_args(data, log, "--arch", "modern"))
    assert r.returncode == 0, r.stderr
    return log, r


def test_a_modern_run_starts_near_the_uniform_loss_and_records_its_parts(modern_run):
    log, r = modern_run
    # the head's N(0, 0.02) and zero bias start every logit near 0: the loss near the uniform's
    # (random tokens: nothing to learn that carries over to val, so the loss moves, either way)
    assert step_lines(r.stdout)[0][0] == pytest.approx(math.log(REAL_V), abs=0.02)
    val_steps, val_losses = series(log)["val"]
    assert val_losses[0] == pytest.approx(math.log(REAL_V), abs=0.02)
    assert val_losses[-1] != val_losses[0], val_losses
    ckpt = torch.load(rundir.find_checkpoints(log)[-1], weights_only=True)
    assert parts(tg.GPTConfig(**ckpt["config"])) == MODERN
    assert ckpt["model"]["transformer.h.0.mlp.c_proj.weight"].abs().max() > 0  # left zero
    with open(os.path.join(log, "run_config.json")) as f:
        recorded = json.load(f)
    assert recorded["arch"] == "modern" and parts(tg.GPTConfig(**recorded["model"])) == MODERN


@pytest.mark.slow
def test_a_modern_checkpoint_from_before_the_skips_resumes_exactly(data, tmp_path):
    """A checkpoint whose config has no value_embeds, x0_skip, unet_skip, zero_head, head_bias
    (the modern model before them: its embedding normalized, its zero_init zeroing the head too)
    and whose flags have no --wsd_decay and no --embed_lr (the cosine schedule, and wte in AdamW's
    decayed group, before them; --arch modern's defaults now) resumes as the model without them,
    on the cosine, exactly: also with --arch modern and the tiny preset given again, whose
    defaults are the warmup-stable-decay schedule and an --embed_lr (and the parts that differ
    given as they were). (Its runs give wte the decayed group's LR, 8e-3: the same steps in a
    group of its own. Its weights are today's: one the code of then trained is resumed on kernels
    that round otherwise, as the run's warning says.)"""
    logs = [str(tmp_path / name) for name in ("whole", "resumed")]
    parts = ("--no-x0_skip", "--embed_norm", "--no-head_bias")
    old = ("--arch", "modern", *parts, "--zero_head", "--wsd_decay", "0", "--embed_lr", "8e-3")
    r = run_cli(*run_args(data, logs[0], *old))
    assert r.returncode == 0, r.stderr
    r = run_cli(*run_args(data, logs[1], *old, "--stop_step", "5"))
    assert r.returncode == 0, r.stderr
    path = rundir.find_checkpoints(logs[1])[-1]
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["args"]["max_lr"] == 8e-3
    for field in ("value_embeds", "x0_skip", "unet_skip", "zero_head", "head_bias"):
        del ckpt["config"][field]
    del ckpt["args"]["zero_head"], ckpt["args"]["head_bias"]
    assert "lm_head.bias" not in ckpt["model"]
    del ckpt["args"]["wsd_decay"], ckpt["args"]["embed_lr"]
    groups = ckpt["optimizer"]["param_groups"]
    wte = groups.pop()  # --embed_lr's group, the last: back into the decayed group, the first
    assert wte["params"] == ["transformer.wte.weight"], wte
    groups[0]["params"].insert(0, wte["params"][0])
    torch.save(ckpt, path)
    again = shutil.copytree(logs[1], str(tmp_path / "again"))
    r = run_cli(*resume_args(logs[1]))
    assert r.returncode == 0, r.stderr
    assert log_of(logs[1]) == log_of(logs[0])
    plain_warnings = [line.replace(logs[1], "LOG") for line in r.stdout.splitlines()
                      if line.startswith("warning")]
    assert sum("not bit for bit" in line for line in plain_warnings) == 1  # its shape says so
    r = run_cli(*resume_args(again, "--arch", "modern", *parts, "--preset", "tiny"))
    assert r.returncode == 0, r.stderr
    assert [line.replace(again, "LOG") for line in r.stdout.splitlines()
            if line.startswith("warning")] == plain_warnings, r.stdout  # none about the schedule
    assert log_of(again) == log_of(logs[0])


# What a checkpoint written before Rotary and SoftcapHeadLoss (the kernels the modern model's
# rotary embedding and soft-capped head run on) lacks of today's: 5109747's, checked against one
NOT_BEFORE_THE_KERNELS = {
    "config": ("value_embeds", "x0_skip", "unet_skip", "zero_head", "head_bias"),
    "args": ("value_embeds", "x0_skip", "unet_skip", "zero_head", "head_bias", "wsd_decay",
             "embed_lr", "core_every", "core_max_per_task", "max_micro_steps")}


def test_a_checkpoint_from_before_the_kernels_resumes_saying_it_is_not_bit_for_bit(data,
                                                                                  tmp_path):
    """A modern Muon checkpoint shaped as one from before today's rotary and soft-capped head
    kernels, which round otherwise than those it was trained on (resumed, the old code's tiny
    Muon run leaves its uninterrupted run in the sixth digit of the loss), resumes with one line
    that says so; the same run's checkpoint as today writes it, without. Its weights are today's:
    here both go on the same."""
    log, today = str(tmp_path / "old"), str(tmp_path / "today")
    old = ("--arch", "modern", "--optimizer", "muon", "--no-x0_skip", "--embed_norm",
           "--no-head_bias", "--zero_head", "--wsd_decay", "0", "--embed_lr", "0")
    r = run_cli(*run_args(data, log, *old, "--stop_step", "3"))
    assert r.returncode == 0, r.stderr
    shutil.copytree(log, today)
    path = rundir.find_checkpoints(log)[-1]
    ckpt = torch.load(path, weights_only=True)
    for part, keys in NOT_BEFORE_THE_KERNELS.items():
        for key in keys:
            del ckpt[part][key]
    torch.save(ckpt, path)
    for folder, said in ((log, 1), (today, 0)):
        r = run_cli(*resume_args(folder))
        assert r.returncode == 0, r.stderr
        warned = [line for line in r.stdout.splitlines() if "bit for bit" in line]
        assert len(warned) == said, r.stdout
    assert log_of(log) == log_of(today)


def test_which_checkpoints_round_otherwise():
    """rundir.rounds_otherwise: a config without x0_skip whose model has rotary embeddings or a
    soft-cap; not GPT-2's (its kernels are the same), not a config of today's."""
    modern = asdict(tg.GPTConfig(**settings.ARCHITECTURES["modern"]))
    gpt2 = asdict(tg.GPTConfig())

    def before(config):
        return {k: v for k, v in config.items() if k != "x0_skip"}
    assert rundir.rounds_otherwise(before(modern)) and not rundir.rounds_otherwise(modern)
    assert not rundir.rounds_otherwise(before(gpt2))
    for part in ({"pos_emb": "rope"}, {"logit_softcap": 15.0}):
        assert rundir.rounds_otherwise(before({**gpt2, **part}))
        assert not rundir.rounds_otherwise({**gpt2, **part})


def test_a_modern_run_resumes_exactly(data, modern_run, tmp_path):
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--arch", "modern", "--stop_step", "5"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert log_of(log) == log_of(modern_run[0])
    # the losses barely move in 8 steps on random tokens: the weights, bit for bit
    a, b = (torch.load(rundir.checkpoint_path(d, 7), weights_only=True)["model"]
            for d in (log, modern_run[0]))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sample_and_eval_on_a_modern_checkpoint(modern_run, tmp_path):
    ckpt = rundir.find_checkpoints(modern_run[0])[-1]
    flags = ["--device", "cpu", "--checkpoint", ckpt, "--prompt", "The sky is",
             "--num_samples", "2", "--max_new_tokens", "5", "--seed", "3"]
    r = run_cli("sample", *flags)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- sample") == 2 and r.stdout.count("The sky is") == 2
    assert run_cli("sample", *flags, "--no_kv_cache").stdout == r.stdout
    data = str(tmp_path / "hs")
    write_hellaswag(data, 8)
    r = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--hellaswag_dir", data,
                "--batch_tokens", "256")
    assert r.returncode == 0, r.stderr
    model = tg.model_from_checkpoint(rundir.read_checkpoint(ckpt), ckpt).eval()
    want = hellaswag.evaluate(model, "cpu", data_dir=data, batch_tokens=256)
    assert f"acc_norm {want['acc_norm']:.4f} ({want['correct_norm']}/8)" in r.stdout


def test_init_from_gpt2_refuses_the_modern_architecture(tmp_path, monkeypatch):
    def fetched(*args, **kwargs):  # a refusal after the download would show this traceback
        raise AssertionError("OpenAI's GPT-2 read before the flags were checked")

    monkeypatch.setattr(openai_gpt2, "pretrained_config", fetched)
    monkeypatch.setattr(tg.GPT, "from_pretrained", fetched)
    log = tmp_path / "log"
    for command in ([], ["plan"]):
        for flags, named in ((["--arch", "modern"], "--arch"),
                             (["--no-tie_embeddings"], "--tie_embeddings")):
            r = run_cli(*command, "--init_from", "gpt2", *flags, "--device", "cpu",
                        "--log_dir", str(log))
            assert_one_line_error(r, "--init_from", named)
    assert not log.exists()


def test_a_gpt2_checkpoint_from_before_the_arch_flags_resumes_as_gpt2(reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    for path in rundir.find_checkpoints(log):
        if rundir.checkpoint_step(path) > 4:
            os.remove(path)
    path = rundir.checkpoint_path(log, 4)
    ckpt = torch.load(path, weights_only=True)
    for key in set(settings.ARCH_PARTS) - {"bias"}:  # bias was a field and a flag before
        del ckpt["config"][key], ckpt["args"][key]
    del ckpt["args"]["arch"]
    ckpt["args"]["bias"] = True  # the flag's default then
    torch.save(ckpt, path)
    # asked for another architecture: refused, naming the parts that differ
    assert_one_line_error(run_cli(*resume_args(log, "--arch", "modern")), "pos_emb=learned",
                          "pos_emb=rope")
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert log_of(log) == log_of(reference)
    resumed = torch.load(rundir.checkpoint_path(log, 7), weights_only=True)
    assert parts(tg.GPTConfig(**resumed["config"])) == GPT2


def test_plan_counts_the_modern_model(data, tmp_path):
    log = tmp_path / "log"

    def planned(*flags):  # --peak_flops: a time from the FLOPs, no micro-steps timed here
        r = run_cli("plan", *run_args(data, str(log), "--peak_flops", "1e12", *flags))
        assert r.returncode == 0, r.stderr
        return int(re.search(r"^plan: ([\d,]+) parameters", r.stdout, re.M)[1].replace(",", ""))

    c, t, layers = (int(RUN_FLAGS[f]) for f in ("--n_embd", "--block_size", "--n_layer"))
    # an untied head and its bias, no wpe, no other biases (9C a block), no LayerNorm weights
    # (4C a block, 2C ln_f), x0's scalar a block
    expected = V * c + V - t * c - layers * (9 * c + 4 * c) - 2 * c + layers
    modern = planned("--arch", "modern")
    assert modern - planned() == expected
    assert planned("--arch", "modern", "-B", "auto") == modern
    assert not log.exists()
