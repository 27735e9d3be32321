"""The GPT model against transformers' GPT2LMHeadModel with the same weights: presets, init,
attention, the KV cache and generation, GQA/MQA, dropout and bias, from_pretrained."""
import contextlib
import json
import math
import os
import socket
import threading

import pytest
import torch

import metrics
import settings
import train_gpt2 as tg
from helpers import assert_one_line_error, hf_gpt2, run_cli, tiny_model


# ---------------------------------------------------------------------------------- shapes and init

def hf_param_count(n_layer, n_head, n_embd, n_positions=1024, vocab=50257):
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                        n_positions=n_positions, vocab_size=vocab))
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.slow  # transformers' GPT-2 models of each size, built
@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"])
def test_presets_match_hf_parameter_counts(name):
    config = tg.GPTConfig(**settings.MODEL_PRESETS[name])
    with torch.device("meta"):
        model = tg.GPT(config)
    padding = (config.vocab_size - config.real_vocab_size) * config.n_embd
    expected = hf_param_count(config.n_layer, config.n_head, config.n_embd, config.block_size)
    assert model.get_num_params() - padding == expected
    if name == "gpt2":
        assert expected == 124_439_808
    if name == "tiny":
        assert 1e6 < model.get_num_params() < 1e7


def test_config_defaults_and_validation():
    c = tg.GPTConfig()
    assert (c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd) == (1024, 50304, 12, 12, 768)
    with pytest.raises(ValueError, match="divisible"):
        tg.GPTConfig(n_embd=100, n_head=3)


def test_forward_shapes_tying_and_init():
    model = tiny_model(n_layer=4)
    idx = torch.randint(0, 50257, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 50304) and loss is None
    _, loss = model(idx, idx)
    assert loss.ndim == 0
    assert model.lm_head.weight is model.transformer.wte.weight
    gelu = model.transformer.h[0].mlp.gelu
    assert isinstance(gelu, torch.nn.GELU) and gelu.approximate == "tanh"
    # residual projections at 0.02 / sqrt(2 * n_layer), other matmuls at 0.02, biases zero
    blocks = model.transformer.h
    proj = torch.cat([w.flatten() for b in blocks for w in (b.attn.c_proj.weight,
                                                             b.mlp.c_proj.weight)])
    fc = torch.cat([w.flatten() for b in blocks for w in (b.attn.c_attn.weight, b.mlp.c_fc.weight)])
    assert abs(proj.std().item() - 0.02 / math.sqrt(8)) < 0.0015
    assert abs(fc.std().item() - 0.02) < 0.0015
    assert all((m.bias == 0).all() for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.bias is not None)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_attention_is_causal_and_matches_explicit_softmax():
    model = tiny_model()
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 10, 64)
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(C // 2)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    att = att.masked_fill(future, float("-inf")).softmax(-1)
    ref = attn.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(attn(x), ref, atol=1e-5, rtol=1e-5)
    # the future never leaks: changing the last token leaves earlier outputs unchanged
    idx = torch.randint(0, 50257, (1, 12))
    idx2 = idx.clone()
    idx2[0, -1] = (idx[0, -1] + 1) % 50257
    torch.testing.assert_close(model(idx)[0][:, :-1], model(idx2)[0][:, :-1])


def test_loss_at_init_is_uniform():
    model = tiny_model()
    idx = torch.randint(0, 50257, (4, 64))
    _, loss = model(idx, torch.randint(0, 50257, (4, 64)))
    assert abs(loss.item() - math.log(50257)) < 0.3


def test_padding_tokens_never_produced():
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[50257:] = 50.0  # would dominate every softmax if it were not masked
    idx = torch.randint(0, 50257, (2, 8))
    logits, loss = model(idx, idx)
    assert torch.isinf(logits[..., 50257:]).all() and (logits[..., 50257:] < 0).all()
    assert torch.isfinite(logits[..., :50257]).all() and torch.isfinite(loss)
    assert logits.argmax(-1).max() < 50257
    out = model.generate(idx, 20, top_k=None, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 28) and out.max() < 50257
    assert torch.equal(out[:, :8], idx)


def test_tiny_model_overfits_one_batch():
    model = tiny_model(vocab_size=512, real_vocab_size=500)  # a small vocab: 300 steps go fast
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1)
    buf = torch.randint(0, 500, (4, 33))
    x, y = buf[:, :-1], buf[:, 1:]
    for step in range(300):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if loss.item() < 0.5:
            break
    assert loss.item() < 0.5, f"loss {loss.item():.3f} after {step + 1} steps"


def test_flops_per_token_124m():
    config = tg.GPTConfig()
    with torch.device("meta"):
        n = tg.GPT(config).get_num_params(non_embedding=True)
    # by hand: wte 50304*768 + 12 blocks * (12*768^2 + 13*768) + final LN 2*768
    assert n == 50304 * 768 + 12 * (12 * 768 ** 2 + 13 * 768) + 2 * 768 == 123_689_472
    assert metrics.flops_per_token(config, n, 1024) == 6 * 123_689_472 + 12 * 12 * 12 * 64 * 1024


# --------------------------------------------------------------------------------------- generation

def test_generate_top_k_1_is_greedy():
    model = tiny_model()
    model.eval()
    idx = torch.randint(0, 50257, (2, 5))
    out = model.generate(idx, 6, top_k=1)
    ref = idx
    for _ in range(6):
        ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("n_kv_head", [2, 1])  # MHA (n_head 2) and MQA
def test_kv_cache_greedy_equals_recompute(n_kv_head):
    model = tiny_model(n_kv_head=n_kv_head)
    idx = torch.randint(0, 50257, (3, 9))
    cached = model.generate(idx, 40, top_k=1)
    full = model.generate(idx, 40, top_k=1, use_cache=False)
    assert cached.shape == (3, 49) and torch.equal(cached[:, :9], idx)
    assert torch.equal(cached, full)
    assert torch.equal(model.generate(idx, 5, temperature=0.0), cached[:, :14])


def test_kv_cache_logits_match_full_forward():
    model = tiny_model(n_head=4, n_kv_head=2).eval()
    idx = torch.randint(0, 50257, (2, 20))
    full, _ = model(idx)
    cache = tg.KVCache(model.config, 2, 20, "cpu", torch.float32)
    with torch.no_grad():  # as generate() runs it (with autograd on: see the next test)
        # a prefill, then a chunk of 3 (masked), then single tokens
        pieces = [model(idx[:, :7], kv_cache=cache, logits_to_keep=1)[0]]
        pieces.append(model(idx[:, 7:10], kv_cache=cache, logits_to_keep=1)[0])
        pieces += [model(idx[:, t:t + 1], kv_cache=cache, logits_to_keep=1)[0]
                   for t in range(10, 20)]
    got = torch.cat(pieces, dim=1)
    want = full[:, [6, 9] + list(range(10, 20))]
    torch.testing.assert_close(got[..., :50257], want[..., :50257], atol=1e-5, rtol=1e-5)


def test_kv_cache_forward_with_autograd_on():
    model = tiny_model()
    cache = tg.KVCache(model.config, 1, 8, "cpu", torch.float32)
    logits, _ = model(torch.randint(0, 50257, (1, 8)), kv_cache=cache)
    assert logits.shape == (1, 8, 50304) and cache.pos == 8


def test_generate_sampling_is_seeded_and_never_padding():
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[50257:] = 10.0
    idx = torch.randint(0, 50257, (4, 3))
    a = model.generate(idx, 20, top_k=50, generator=torch.Generator().manual_seed(1))
    b = model.generate(idx, 20, top_k=50, generator=torch.Generator().manual_seed(1))
    c = model.generate(idx, 20, top_k=0, temperature=2.0,
                       generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and a.max() < 50257 and c.max() < 50257


def test_generate_refuses_beyond_block_size():
    model = tiny_model()
    with pytest.raises(ValueError, match="block_size 64"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 5)


def test_decode_sample_stops_at_end_of_text(enc):
    import fineweb
    prompt = enc.encode("Hello")
    tokens = prompt + enc.encode(" world.\n\n\nBye") + [fineweb.EOT] + enc.encode(" unrelated")
    assert tg.decode_sample(enc, tokens, len(prompt)) == "Hello world.\nBye"


def test_logits_to_keep_matches_full_logits_and_hf(tmp_path):
    """logits_to_keep: an int keeps the last k positions (as transformers' does), a (B, T) bool
    mask its K True positions as (K, vocab) logits, row by row (transformers' 1-D positions are
    that mask with the same positions in every row)."""
    hf, path = hf_gpt2(tmp_path)
    ours = tg.GPT.from_pretrained(path).eval()
    idx = torch.randint(0, 50257, (2, 12))
    positions = torch.tensor([1, 5, 6, 11])
    same = torch.zeros(idx.shape, dtype=torch.bool)
    same[:, positions] = True
    ragged = torch.zeros(idx.shape, dtype=torch.bool)  # other positions in each row
    ragged[0, [0, 3, 11]] = True
    ragged[1, [2, 5, 6, 7, 9]] = True
    with torch.no_grad():
        full, _ = ours(idx)
        last, _ = ours(idx, logits_to_keep=3)
        some, _ = ours(idx, logits_to_keep=same)
        picked, _ = ours(idx, logits_to_keep=ragged)
        hf_last = hf(idx, logits_to_keep=3).logits
        hf_some = hf(idx, logits_to_keep=positions).logits
    assert last.shape == (2, 3, 50304) and some.shape == (8, 50304) and picked.shape == (8, 50304)
    torch.testing.assert_close(last, full[:, -3:])
    torch.testing.assert_close(some.view(2, 4, -1), full[:, positions])
    torch.testing.assert_close(picked, full[ragged])
    torch.testing.assert_close(last[..., :50257], hf_last, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(some.view(2, 4, -1)[..., :50257], hf_some, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="logits_to_keep"):
        ours(idx, targets=idx, logits_to_keep=1)


# ---------------------------------------------------------------------------------------- GQA / MQA

def test_gqa_parameter_count():
    nh, hs, L, C = 4, 16, 2, 64
    mha, gqa, mqa = (tiny_model(n_head=nh, n_kv_head=k) for k in (4, 2, 1))
    for model, nkv in ((mha, 4), (gqa, 2), (mqa, 1)):
        assert model.transformer.h[0].attn.c_attn.weight.shape == ((nh + 2 * nkv) * hs, C)
    # each k/v head fewer saves 2 * (C * hs + hs) parameters per layer
    assert mha.get_num_params() - gqa.get_num_params() == L * 2 * 2 * (C * hs + hs)
    assert mha.get_num_params() - mqa.get_num_params() == L * 3 * 2 * (C * hs + hs)
    with pytest.raises(ValueError, match="must divide"):
        tg.GPTConfig(n_head=4, n_kv_head=3)


def test_n_kv_head_equal_n_head_is_exactly_mha():
    a, b = tiny_model(seed=3, n_head=4), tiny_model(seed=3, n_head=4, n_kv_head=4)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    idx = torch.randint(0, 50257, (2, 16))
    assert torch.equal(a(idx)[0], b(idx)[0])


def test_gqa_matches_mha_with_repeated_kv_heads():
    """A GQA model equals the MHA model whose k/v heads are copies of the shared ones."""
    gqa = tiny_model(n_head=4, n_kv_head=2).eval()
    mha = tiny_model(n_head=4).eval()
    hs = 16

    def repeat(t):
        return t.view(2, hs, *t.shape[1:]).repeat_interleave(2, dim=0).reshape(4 * hs, *t.shape[1:])

    sd = {k: v.clone() for k, v in gqa.state_dict().items()}
    for i in range(2):
        for kind in ("weight", "bias"):
            w = sd[f"transformer.h.{i}.attn.c_attn.{kind}"]
            q, k, v = w.split([4 * hs, 2 * hs, 2 * hs], dim=0)
            sd[f"transformer.h.{i}.attn.c_attn.{kind}"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(sd)
    idx = torch.randint(0, 50257, (2, 16))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], atol=1e-5, rtol=1e-5)


def test_mqa_trains():
    model = tiny_model(n_head=4, n_kv_head=1, vocab_size=512, real_vocab_size=500)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    buf = torch.randint(0, 500, (4, 33))
    first = None
    for _ in range(60):
        opt.zero_grad()
        _, loss = model(buf[:, :-1], buf[:, 1:])
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first - 2.0


# ------------------------------------------------------------------------------------ dropout, bias

def test_dropout_only_in_training():
    model = tiny_model(dropout=0.2)
    idx = torch.randint(0, 50257, (2, 16))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])
    model.train()
    a = model.generate(idx, 8, top_k=1)
    # eval mode inside generate, the training mode restored after it
    assert torch.equal(a, model.generate(idx, 8, top_k=1)) and model.training


def test_no_bias():
    model = tiny_model(bias=False)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith(".bias") for n in names)
    assert model.transformer.ln_f.bias is None
    with_bias = tiny_model()
    assert with_bias.get_num_params() - model.get_num_params() == sum(
        p.numel() for n, p in with_bias.named_parameters() if n.endswith(".bias"))
    _, loss = model(torch.randint(0, 50257, (2, 8)), torch.randint(0, 50257, (2, 8)))
    loss.backward()


# ------------------------------------------------------------------------------------- transformers

@pytest.mark.parametrize("vocab", [50257, 100])
def test_from_pretrained_matches_hf(tmp_path, vocab):
    hf, path = hf_gpt2(tmp_path, vocab=vocab, n_head=4, n_positions=48)
    # random biases and LayerNorm affines, so a missed or swapped tensor cannot hide
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hf.save_pretrained(path)
    ours = tg.GPT.from_pretrained(path)
    assert ours.config.vocab_size % 64 == 0 and ours.config.real_vocab_size == vocab
    assert ours.config.block_size == 48
    ours.eval()
    idx = torch.randint(0, vocab, (3, 48))
    with torch.no_grad():
        ref = hf(idx).logits
        got, _ = ours(idx)
    torch.testing.assert_close(got[..., :vocab], ref, atol=1e-5, rtol=1e-5)
    assert torch.isinf(got[..., vocab:]).all()


# ---------------------------------------------------------- --init_from what is not GPT-2, offline

def test_init_from_a_folder_that_is_not_gpt2_is_one_line(tmp_path):
    foreign = tmp_path / "bert"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    _, path = hf_gpt2(tmp_path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"not the weights")  # config.json fine, the weights unloadable
    for folder in (str(foreign), path):
        r = run_cli("sample", "--device", "cpu", "--init_from", folder)
        assert_one_line_error(r, "could not load GPT-2 model", folder, "save_pretrained")


@pytest.mark.slow
def test_init_from_the_hub_offline_asks_it_once_and_says_what_to_do(tmp_path, monkeypatch):
    """A hub that accepts connections and never answers: transformers alone would retry for
    minutes; one probe, then one complete line on what to pass instead."""
    from huggingface_hub import constants

    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen(16)
    accepted = []

    def silent():
        while True:
            try:
                accepted.append(hub.accept()[0])
            except OSError:
                return
    threading.Thread(target=silent, daemon=True).start()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{hub.getsockname()[1]}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    r = run_cli("sample", "--init_from", "gpt2", "--device", "cpu")
    with contextlib.suppress(OSError):  # Linux: wakes the thread's accept(), which close() does not
        hub.shutdown(socket.SHUT_RDWR)
    hub.close()
    line = assert_one_line_error(r, "could not load GPT-2 model 'gpt2'", "unreachable",
                                 "not in the local cache")
    assert line.endswith("pass a local directory written by GPT2LMHeadModel.save_pretrained")
    assert len(accepted) == 1  # the probe; nothing waited on the hub's answer after it
