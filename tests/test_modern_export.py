"""`export` of a model that is not GPT-2's architecture (--arch modern, a part flag): a folder with
its own modeling code, written from train_gpt2.py's model code, that transformers loads offline
with trust_remote_code=True and nothing of this repository; its logits against ours, its greedy
generate() against `sample --top_k 1`, a chat model's tokenizer, `--init_from DIR` reading
the folder back (either architecture) into the checkpoint's weights and run, and `sft --init_from
DIR` taking the run defaults that the checkpoint's run would give."""
import inspect
import json
import os
import shutil
import sys
from dataclasses import asdict

import pytest
import torch

import chat
import openai_gpt2
import rundir
import settings
import train_gpt2 as tg
from helpers import (REPO, RUN_FLAGS, SHAPE_FLAGS, assert_one_line_error, log_of, run_args,
                     run_cli, tiny_model)

GPT2, MODERN = settings.ARCHITECTURES["gpt2"], settings.ARCHITECTURES["modern"]
SHAPE = dict(block_size=32, n_layer=3, n_head=4, n_embd=32)  # heads of 8: 4 rotary pairs each
# Between them, each part of the architecture both ways (and none of them GPT-2's alone)
CONFIGS = {
    # --arch modern and the parts it leaves off: GQA, value embeddings, U-net skips, the
    # embedding's norm, a head that starts at zero
    "modern": dict(MODERN, n_kv_head=2, value_embeds=True, unet_skip=True, embed_norm=True,
                   zero_head=True),
    # GPT-2's parts but one key/value head (MQA), fine-tuned to chat: its tokens predicted
    "gpt2_mqa_chat": dict(GPT2, n_kv_head=1, real_vocab_size=chat.CHAT_VOCAB_SIZE),
    # rotary with LayerNorm and biases, GELU, QK-norm, a tied head with a bias and a soft-cap,
    # value embeddings without GQA, U-net skips without x0's
    "mixed": dict(GPT2, pos_emb="rope", qk_norm=True, head_bias=True, logit_softcap=30.0,
                  value_embeds=True, unet_skip=True, zero_init=True),
}


def scrambled(model, seed=1):
    """Every weight redrawn (the zero inits would hide what a part does), the head's bias on the
    logits' scale."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        if model.lm_head.bias is not None:
            model.lm_head.bias /= tg.HEAD_BIAS_SCALE
    return model.eval()


def ran(*argv):
    """A tiny run's flags, as its checkpoint records them (its args)."""
    return vars(settings.read_flags(["--preset", "tiny", *argv])[0])


def save_checkpoint(path, model, args=None):
    """A checkpoint of the model; with args, the flags of the run that trained it."""
    torch.save({"model": model.state_dict(), "config": asdict(model.config),
                **({"args": args} if args else {})}, path)
    return str(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{name: (our model, its checkpoint, the folder `export` wrote of it)} for CONFIGS; the
    modern one's checkpoint records its run's flags (so its folder does), the others' none (as
    the folders of exports from before the record)."""
    root = tmp_path_factory.mktemp("modern_export")
    made = {}
    for i, (name, kw) in enumerate(CONFIGS.items()):
        model = scrambled(tiny_model(i, **{**SHAPE, **kw}), seed=i)
        args = ran("--arch", "modern", "--optimizer", "muon") if name == "modern" else None
        ckpt = save_checkpoint(root / f"{name}.pt", model, args)
        out = str(root / name)
        r = run_cli("export", "--checkpoint", ckpt, "--out", out)
        assert r.returncode == 0, r.stderr
        assert f"AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True)" in r.stdout
        made[name] = model, ckpt, out
    return made


def load(out):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


@pytest.fixture
def without_the_repository(monkeypatch):
    """This repository's modules made unimportable: the folder's code must need none of them."""
    for file in os.listdir(REPO):
        if file.endswith(".py"):
            monkeypatch.setitem(sys.modules, file[: -len(".py")], None)


def test_the_folder_loads_on_its_own_and_gives_our_logits_and_loss(exported,
                                                                   without_the_repository):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50257, (2, SHAPE["block_size"]), generator=g)
    for name, (model, _, out) in exported.items():
        hf = load(out)
        assert "train_gpt2" not in type(hf).__module__ and hf.config.model_type == "fineweb_gpt"
        assert not hf.training and next(hf.parameters()).dtype == torch.float32
        real = model.config.real_vocab_size
        with torch.no_grad():
            got = hf(idx, labels=idx)
            want, _ = model(idx)
            _, want_loss = model(idx[:, :-1], idx[:, 1:])
        # our logits over the real vocabulary: the padding ids, never predicted, left out
        assert got.logits.shape == (2, SHAPE["block_size"], real), name
        torch.testing.assert_close(got.logits, want[..., :real], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.loss, want_loss, atol=1e-5, rtol=0)
        assert torch.isinf(want[..., real:]).all()
    with pytest.raises(ValueError, match="no padding"):  # it has no mask to honour one with
        hf(idx, attention_mask=torch.ones_like(idx).tril())


def test_the_folder_code_is_train_gpt2s_own(exported):
    """The modeling file is written from train_gpt2.py's source, GPT's methods that load OpenAI's
    weights and make the optimizers left out, and written again it is the same."""
    with open(os.path.join(exported["modern"][2], openai_gpt2.CUSTOM_FILE)) as f:
        written = f.read()
    assert written == openai_gpt2.modeling_source(tg)
    for part in (tg.CausalSelfAttention, tg.MLP, tg.Block, tg.Skips, tg.Rotary, tg.ReLUSquared,
                 tg.X0Mix, tg.SoftcapHeadLoss, tg.KVCache, tg.rotary_tables, tg.config_buffers,
                 tg.GPT.forward, tg.GPT.head, tg.GPT.generate, tg.sample_next):
        assert inspect.getsource(part) in written, part
    for left_out in (tg.GPT.from_pretrained, tg.GPT.configure_optimizers):
        assert inspect.getsource(left_out) not in written
    assert "import train_gpt2" not in written and "openai_gpt2" not in written.split('"""')[2]
    config = json.load(open(os.path.join(exported["modern"][2], "config.json")))
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_fineweb_gpt.")
    assert {k: config[k] for k in asdict(exported["modern"][0].config)} == asdict(
        exported["modern"][0].config)


def test_greedy_generate_is_sample_top_k_1(exported, enc):
    from transformers import AutoTokenizer, pipeline

    _, ckpt, out = exported["modern"]
    prompt = "The sky is"
    r = run_cli("sample", "--checkpoint", ckpt, "--prompt", prompt, "--top_k", "1",
                "--max_new_tokens", "12", "--num_samples", "1", "--device", "cpu",
                "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    want = r.stdout.split("--- sample 0\n", 1)[1].rstrip("\n")
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == enc.encode(prompt)
    hf = load(out)
    got = hf.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()
    assert len(got) == ids.size(1) + 12 or got[-1] == tg.EOT
    assert tg.decode_sample(enc, got, ids.size(1)) == want
    # GPT's own generate(), with its KV cache, is in the folder too
    assert hf.model.generate(ids, 12, top_k=1)[0].tolist()[: len(got)] == got
    generate = pipeline("text-generation", model=out, trust_remote_code=True)
    text = generate(prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert text == tok.decode(got)


def test_a_chat_model_exports_with_its_chat_template(exported, enc):
    from transformers import AutoTokenizer

    _, _, out = exported["gpt2_mqa_chat"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == chat.CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Name a river."}]
    prompt = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert prompt == chat.render_prompt(messages, enc)
    hf = load(out)
    assert hf.generation_config.eos_token_id == chat.END["assistant"]  # generate() stops there
    assert len(tok) == hf.config.real_vocab_size == chat.CHAT_VOCAB_SIZE


@pytest.mark.parametrize("arch", ["modern", "gpt2"])
def test_init_from_the_folder_continues_as_from_the_checkpoint(arch, data, tmp_path):
    """--init_from DIR of either architecture's export: the checkpoint's weights (a GPT2LMHeadModel
    folder's vocabulary has no padding rows: they come back as zeros, and no step reads them), and
    a short run from it is the run from the checkpoint, step for step."""
    shape = {k.removeprefix("--"): int(RUN_FLAGS[k]) for k in SHAPE_FLAGS}
    model = scrambled(tiny_model(5, **shape, **settings.ARCHITECTURES[arch]))
    assert bool(model.config.gpt2_differences()) == (arch == "modern")
    ckpt = save_checkpoint(tmp_path / "model.pt", model)
    out = str(tmp_path / "hf")
    assert run_cli("export", "--checkpoint", ckpt, "--out", out).returncode == 0
    loaded = tg.GPT.from_pretrained(out)
    assert loaded.config == model.config
    real = model.config.real_vocab_size
    for k, v in model.state_dict().items():
        if arch == "gpt2" and k in ("transformer.wte.weight", "lm_head.weight"):
            assert not loaded.state_dict()[k][real:].any()
            v = v[:real]
        assert torch.equal(loaded.state_dict()[k][: len(v)], v), k
    logs, weights = [], []
    for source in (ckpt, out):
        log = str(tmp_path / f"log{len(logs)}")
        r = run_cli(*run_args(data, log, "--init_from", source, "--max_steps", "3",
                              "--eval_every", "2", "--sample_every", "0", drop=SHAPE_FLAGS))
        assert r.returncode == 0, r.stderr
        logs.append(log_of(log))
        weights.append(torch.load(rundir.checkpoint_path(log, 2), weights_only=True)["model"])
    assert logs[0] == logs[1]
    for k, v in weights[0].items():
        assert torch.equal(weights[1][k][:real], v[:real]), k


def test_a_folder_saved_again_by_transformers_reads_back_the_same(exported, tmp_path):
    model, _, out = exported["mixed"]  # its head tied to the embedding: one tensor in the file
    load(out).save_pretrained(tmp_path / "again")
    loaded = tg.GPT.from_pretrained(str(tmp_path / "again"))
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_a_folder_is_read_back_without_running_its_code(exported, tmp_path):
    """--init_from reads the folder's config and weights as data: its modeling file never runs;
    a folder without its weights is one line."""
    model, ckpt, out = exported["modern"]
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    (folder / openai_gpt2.CUSTOM_FILE).write_text("raise SystemExit('the folder code ran')\n")
    flags = ["--device", "cpu", "--prompt", "The sky is", "--max_new_tokens", "6", "--top_k", "1"]
    r = run_cli("sample", "--init_from", str(folder), *flags)
    assert r.returncode == 0, r.stderr
    want = run_cli("sample", "--checkpoint", ckpt, *flags).stdout
    assert r.stdout == want[want.index("--- sample 0"):]
    os.remove(folder / "model.safetensors")
    assert_one_line_error(run_cli("sample", "--init_from", str(folder), *flags),
                          "could not read the weights", str(folder))


def test_sft_from_the_folder_takes_the_run_defaults_of_the_checkpoint(exported, tmp_path):
    """sft --init_from DIR settles the run that sft --init_from the model_*.pt it was exported
    from does: the folder (either kind, and saved again by transformers) records the run's
    preset, arch and optimizer, whose LRs and run settings follow. A folder without the record
    (OpenAI's GPT-2, an older export) takes GPT-2's, as OpenAI's weights do."""
    from transformers import GPT2LMHeadModel

    def settled(source):
        return vars(settings.read_flags(["--sft", "--init_from", source])[0])

    _, ckpt, out = exported["modern"]
    want = settled(ckpt)
    assert (want["preset"], want["arch"], want["optimizer"]) == ("tiny", "modern", "muon")
    assert settled(out) == {**want, "init_from": out}
    load(out).save_pretrained(tmp_path / "again")
    assert settled(str(tmp_path / "again")) == {**want, "init_from": str(tmp_path / "again")}

    model = tiny_model(6, **SHAPE, **GPT2)  # GPT-2's architecture: a GPT2LMHeadModel folder
    ckpt = save_checkpoint(tmp_path / "gpt2.pt", model, ran("--optimizer", "muon"))
    out = str(tmp_path / "gpt2")
    assert run_cli("export", "--checkpoint", ckpt, "--out", out).returncode == 0
    record = dict(preset="tiny", arch="gpt2", optimizer="muon")
    assert GPT2LMHeadModel.from_pretrained(out).config.train_gpt2_run == record
    assert settled(out) == {**settled(ckpt), "init_from": out}

    out = exported["mixed"][2]
    assert settled(out) == {**settled("gpt2"), "init_from": out}
    assert (settled(out)["preset"], settled(out)["arch"]) == ("gpt2", "gpt2")
