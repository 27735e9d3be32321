"""Generation with a KV cache, the sample/export commands, GQA/MQA, dropout/bias, --init_from."""
import os

import pytest
import torch

import train_gpt2 as tg
from test_train_gpt2 import run_cli, tiny_model, tiny_run_args, without_shape_flags


def save_tiny_checkpoint(path, model):
    torch.save({"model": model.state_dict(), "config": tg.asdict(model.config)}, path)


def hf_dir(tmp_path, vocab=50257, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=vocab))
    path = str(tmp_path / "hf")
    hf.save_pretrained(path)
    return hf.eval(), path


# ----------------------------------------------------------------------------- generate

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
    pieces = [model(idx[:, :7], kv_cache=cache, logits_to_keep=1)[0]]  # a prefill, then a chunk of 3 (masked), then singles
    pieces.append(model(idx[:, 7:10], kv_cache=cache, logits_to_keep=1)[0])
    pieces += [model(idx[:, t:t + 1], kv_cache=cache, logits_to_keep=1)[0] for t in range(10, 20)]
    got = torch.cat(pieces, dim=1)
    want = full[:, [6, 9] + list(range(10, 20))]
    torch.testing.assert_close(got[..., :50257], want[..., :50257], atol=1e-5, rtol=1e-5)


def test_generate_sampling_is_seeded_and_never_padding():
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[50257:] = 10.0
    idx = torch.randint(0, 50257, (4, 3))
    a = model.generate(idx, 20, top_k=50, generator=torch.Generator().manual_seed(1))
    b = model.generate(idx, 20, top_k=50, generator=torch.Generator().manual_seed(1))
    c = model.generate(idx, 20, top_k=0, temperature=2.0, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and a.max() < 50257 and c.max() < 50257


def test_generate_refuses_beyond_block_size():
    model = tiny_model()
    with pytest.raises(ValueError, match="block_size 64"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 5)


# ----------------------------------------------------------------------------- GQA / MQA

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
    sd = {k: v.clone() for k, v in gqa.state_dict().items()}
    for i in range(2):
        for kind in ("weight", "bias"):
            w = sd[f"transformer.h.{i}.attn.c_attn.{kind}"]
            q, k, v = w.split([4 * hs, 2 * hs, 2 * hs], dim=0)
            rep = lambda t: t.view(2, hs, *t.shape[1:]).repeat_interleave(2, dim=0).reshape(4 * hs, *t.shape[1:])
            sd[f"transformer.h.{i}.attn.c_attn.{kind}"] = torch.cat([q, rep(k), rep(v)])
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


# ----------------------------------------------------------------------------- dropout, bias

def test_dropout_only_in_training():
    model = tiny_model(dropout=0.2)
    idx = torch.randint(0, 50257, (2, 16))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])
    model.train()
    a = model.generate(idx, 8, top_k=1)
    assert torch.equal(a, model.generate(idx, 8, top_k=1)) and model.training  # eval inside, mode restored


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


# ----------------------------------------------------------------------------- export

def test_export_roundtrip_logits(tmp_path):
    from transformers import GPT2LMHeadModel
    model = tiny_model(n_head=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # non-zero biases and LN shifts
    ckpt = str(tmp_path / "model_00010.pt")
    save_tiny_checkpoint(ckpt, model)
    out = str(tmp_path / "hf_out")
    r = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(os.path.join(out, "config.json")) and os.path.exists(os.path.join(out, "model.safetensors"))
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == 50257
    idx = torch.randint(0, 50257, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0][..., :50257], atol=1e-5, rtol=1e-5)
    # never over an existing directory
    r = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert r.returncode == 1 and "not an empty directory" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("kw, message", [(dict(bias=False), "no biases"), (dict(n_head=4, n_kv_head=2), "n_kv_head")])
def test_export_refuses_non_gpt2_architectures(tmp_path, kw, message):
    with pytest.raises(tg.UsageError, match=message):
        tg.export_hf(tiny_model(**kw), str(tmp_path / "out"))


# ----------------------------------------------------------------------------- sample command, init_from

def test_sample_command(tmp_path):
    ckpt = str(tmp_path / "model.pt")
    save_tiny_checkpoint(ckpt, tiny_model())
    r = run_cli("sample", "--device", "cpu", "--checkpoint", ckpt, "--prompt", "The sky is", "--num_samples", "2",
                "--max_new_tokens", "5", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- sample") == 2 and r.stdout.count("The sky is") == 2
    again = run_cli("sample", "--device", "cpu", "--checkpoint", ckpt, "--prompt", "The sky is", "--num_samples", "2",
                    "--max_new_tokens", "5", "--seed", "3", "--no_kv_cache")
    assert again.stdout == r.stdout  # same seed: the cache changes the speed, not the text
    r = run_cli("sample", "--device", "cpu", "--checkpoint", ckpt, "--max_new_tokens", "100")
    assert r.returncode == 1 and "block_size 64" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("sample", "--device", "cpu", "--checkpoint", str(tmp_path / "missing.pt"))
    assert r.returncode == 1 and "checkpoint not found" in r.stderr


def test_sample_from_pretrained_dir(tmp_path):
    hf, path = hf_dir(tmp_path)
    r = run_cli("sample", "--device", "cpu", "--init_from", path, "--max_new_tokens", "4", "--num_samples", "1", "--top_k", "1")
    assert r.returncode == 0, r.stderr
    import fineweb
    enc = fineweb.get_encoding()
    prompt = torch.tensor([enc.encode("Hello, I'm a language model,")])
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=50256)
    assert enc.decode(want[0].tolist()) in r.stdout
    r = run_cli("sample", "--device", "cpu", "--init_from", str(tmp_path / "nowhere"))
    assert r.returncode == 1 and "could not load GPT-2 weights" in r.stderr and "Traceback" not in r.stderr


def test_init_from_pretrained_trains(shard_dir, tmp_path):
    import numpy as np
    hf, path = hf_dir(tmp_path)
    log = str(tmp_path / "log")
    r = run_cli(*without_shape_flags(tiny_run_args(shard_dir, log, "--init_from", path, "--max_steps", "2",
                                                   "--eval_every", "1", "--sample_every", "0", "--val_tokens", "256")))
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(os.path.join(log, "model_00001.pt"), weights_only=False)
    assert ckpt["config"]["vocab_size"] == 50304 and ckpt["config"]["real_vocab_size"] == 50257
    # the step-0 val loss is OpenAI-format weights' loss on the first 256 val targets, computed by HF
    val = np.load(tg.list_shards(shard_dir, "val")[0]).astype(np.int64)
    x = torch.from_numpy(val[:256]).view(8, 32)
    y = torch.from_numpy(val[1:257]).view(8, 32)
    with torch.no_grad():
        logits = hf(x).logits
    want = torch.nn.functional.cross_entropy(logits.view(-1, 50257), y.reshape(-1)).item()
    assert tg.read_log(os.path.join(log, "log.txt"))["val"][1][0] == pytest.approx(want, abs=1e-4)
    r = run_cli(*tiny_run_args(shard_dir, str(tmp_path / "log2"), "--init_from", path, "--n_kv_head", "1"))
    assert r.returncode == 1 and "--init_from takes the model's shape from the weights: drop" in r.stderr
    assert "--n_kv_head" in r.stderr and not os.path.exists(str(tmp_path / "log2"))


def test_logits_to_keep_matches_full_logits_and_hf(tmp_path):
    """transformers' logits_to_keep: an int keeps the last k positions, a 1-D tensor those positions."""
    hf, path = hf_dir(tmp_path)
    ours = tg.GPT.from_pretrained(path).eval()
    idx = torch.randint(0, 50257, (2, 12))
    positions = torch.tensor([1, 5, 6, 11])
    with torch.no_grad():
        full, _ = ours(idx)
        last, _ = ours(idx, logits_to_keep=3)
        some, _ = ours(idx, logits_to_keep=positions)
        hf_some = hf(idx, logits_to_keep=positions).logits
    assert last.shape == (2, 3, 50304) and some.shape == (2, 4, 50304)
    torch.testing.assert_close(last, full[:, -3:])
    torch.testing.assert_close(some, full[:, positions])
    torch.testing.assert_close(some[..., :50257], hf_some, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="logits_to_keep"):
        ours(idx, targets=idx, logits_to_keep=1)


def test_eval_command_scores_a_checkpoint_like_hellaswag_evaluate(shard_dir, tmp_path):
    """`train_gpt2.py eval --checkpoint` reports what hellaswag.evaluate gives for the same model and data."""
    import hellaswag
    from conftest import write_hellaswag

    log = str(tmp_path / "log")
    assert run_cli(*tiny_run_args(shard_dir, log, "--max_steps", "1", "--eval_every", "0", "--sample_every", "0")).returncode == 0
    data = str(tmp_path / "hs")
    write_hellaswag(data, 12)
    ckpt = os.path.join(log, "model_00000.pt")
    r = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--data_dir", data, "--batch_tokens", "256")
    assert r.returncode == 0, r.stderr
    want = hellaswag.evaluate(tg.model_from_checkpoint(ckpt), "cpu", data_dir=data, batch_tokens=0)
    assert f"acc_norm {want['acc_norm']:.4f} ({want['correct_norm']}/12)" in r.stdout
    assert f"acc {want['acc']:.4f} ({want['correct']}/12)" in r.stdout
    r = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--data_dir", str(tmp_path / "none"))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "Rowan/hellaswag" in errors[0] and "Traceback" not in r.stderr
