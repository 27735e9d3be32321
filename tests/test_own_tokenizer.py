"""A tokenizer trained on the user's text (tokenizer.py, fineweb.py --train_tokenizer/--tokenizer):
its merges against a plain BPE trainer written here, its encodings against tiktoken's decoding and
HF tokenizers, uint32 shards, and the commands of a run that uses it."""

import collections
import json
import os
import random

import numpy as np
import pytest
import regex
from tokenizers import Tokenizer as HFTokenizer

import fineweb
import tokenizer
from tests.helpers import assert_one_line_error, run_args, run_cli, write_corpus_jsonl

SPECIALS = len(tokenizer.SPECIAL_NAMES)


def plain_bpe(texts, n_merges, pattern):
    """BPE as the issue states it: the pattern's chunks counted, then n_merges times the most
    frequent pair of adjacent ids merged, a tie going to the smallest pair (left id, right id)."""
    words = collections.Counter(m.encode() for t in texts for m in regex.findall(pattern, t))
    words = {tuple(w): n for w, n in words.items()}
    vocab = {i: bytes([i]) for i in range(256)}
    for new in range(256, 256 + n_merges):
        pairs = collections.Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        vocab[new] = vocab[best[0]] + vocab[best[1]]
        merged = {}
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return {token: rank for rank, token in vocab.items()}


def random_text(rng, n):
    """Arbitrary Unicode: ASCII, whitespace, 2-, 3- and 4-byte characters, mixed."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.45:
            out.append(chr(rng.randint(32, 126)))
        elif r < 0.6:
            out.append(rng.choice(" \n\t\r'"))
        elif r < 0.75:
            out.append(chr(rng.randint(0x80, 0x7FF)))
        elif r < 0.95:
            out.append(chr(rng.randint(0x800, 0xD7FF)))
        else:
            out.append(chr(rng.randint(0x10000, 0x10FFFF)))
    return "".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own_tok")
    rng = random.Random(0)
    rows = [{"text": " ".join(["Über die Straße 123 läuft das Kätzchen.", "print(x_1 + 42)",
                               random_text(rng, 30)][i % 3] for i in range(rng.randint(3, 9)))}
            for _ in range(60)]
    path = folder / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, str(path), [r["text"] for r in rows]


@pytest.fixture(scope="module")
def trained(corpus):
    folder, path, _ = corpus
    out = str(folder / "tok")
    assert fineweb.main(["--input", path, "--train_tokenizer", out, "--vocab_size", "400"]) == 0
    return tokenizer.load(out)


@pytest.mark.parametrize("pattern", ["gpt4", "gpt2"])
def test_the_trainer_makes_a_plain_bpe_trainers_merges(corpus, pattern):
    _, _, texts = corpus
    n_merges = 150
    tok = tokenizer.train_bpe(texts, 256 + n_merges + SPECIALS, fineweb.PATTERNS[pattern])
    assert tok.ranks == plain_bpe(texts, n_merges, fineweb.PATTERNS[pattern])
    assert tok.special_tokens == {name: 256 + n_merges + i
                                  for i, name in enumerate(tokenizer.SPECIAL_NAMES)}


def test_round_trips_and_byte_lengths(trained):
    enc, rng = trained.encoding(), random.Random(1)
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 80))
        assert enc.decode(enc.encode_ordinary(text)) == text
    lengths = trained.token_bytes()
    assert len(lengths) == trained.n_vocab
    for i in range(trained.eot):
        assert lengths[i] == len(enc.decode_single_token_bytes(i))
    assert (lengths[trained.eot:] == 0).all()  # the special tokens: no text


def test_the_folder_fingerprint_overwrite_and_no_stale_cache(corpus, trained, capsys):
    folder, path, texts = corpus
    out = trained.path
    assert sorted(os.listdir(out)) == sorted(tokenizer.FILES)
    assert tokenizer.load(out).fingerprint == trained.fingerprint  # the same content, the same
    gpt2 = fineweb.gpt2_tokenizer()
    assert gpt2.fingerprint == tokenizer.fingerprint(fineweb._gpt2_ranks(), fineweb.GPT2_PAT,
                                                     gpt2.special_tokens)
    assert gpt2.encoding() is fineweb.get_encoding()  # GPT-2's ids unchanged
    # a second training into the folder needs --overwrite; with it, the new ranks are used
    r = fineweb.main(["--input", path, "--train_tokenizer", out, "--vocab_size", "300"])
    assert r == 1 and "--overwrite" in capsys.readouterr().err
    assert fineweb.main(["--input", path, "--train_tokenizer", out, "--vocab_size", "300",
                         "--overwrite"]) == 0
    again = tokenizer.load(out)
    assert again.fingerprint != trained.fingerprint and again.n_vocab == 300
    assert again.encoding().encode_ordinary(texts[0]) != trained.encoding().encode_ordinary(
        texts[0])
    tokenizer.save(trained, out, overwrite=True)  # as it was, for the tests after this one
    with open(os.path.join(out, tokenizer.RANKS_FILE), "a") as f:
        f.write("IQ== 9999\n")
    with pytest.raises(tokenizer.TokenizerError, match="ids are not|fingerprint"):
        tokenizer.load(out)
    tokenizer.save(trained, out, overwrite=True)


def test_uint32_shards_read_back_exactly(tmp_path, corpus):
    _, path, texts = corpus
    # every single byte and every pair of bytes: 65,792 tokens, ids past uint16
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({bytes([a, b]): 256 + 256 * a + b for a in range(256) for b in range(256)})
    specials = {name: len(ranks) + i for i, name in enumerate(tokenizer.SPECIAL_NAMES)}
    tok = tokenizer.Tokenizer(ranks, tokenizer.GPT4_PATTERN, specials)
    assert tok.dtype == np.uint32
    paths = fineweb.prepare(tmp_path / "data", inputs=[path], shard_size=2000, val_tokens=500,
                            num_proc=2, progress=False, tok=tok)
    got = np.concatenate([np.load(p) for p in paths])
    assert np.load(paths[0]).dtype == np.uint32
    enc = tok.encoding()
    want = [i for t in texts for i in [tok.eot, *enc.encode_ordinary(t)]]
    assert got.tolist() == want and max(want) > 65535
    assert fineweb.open_shard(paths[1], tok.n_vocab).dtype == np.uint32
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["tokenizer"]["fingerprint"] == tok.fingerprint
    assert manifest["args"]["tokenizer"] == tok.fingerprint


def test_an_unfinished_preps_command_names_its_tokenizer(tmp_path, corpus, trained):
    """A prep with a trained tokenizer cut back to its first two shards, as a stop leaves it: its
    resume command gives --tokenizer its folder, and run as it is, writes the shards again."""
    import shlex
    _, path, _ = corpus
    out = tmp_path / "out"
    paths = fineweb.prepare(out, inputs=[path], shard_size=1000, val_tokens=500, num_proc=1,
                            progress=False, tok=trained)
    want = {os.path.basename(p): open(p, "rb").read() for p in paths}
    manifest = json.loads((out / "manifest.json").read_text())
    for shard in manifest["shards"][2:]:
        os.remove(out / shard["file"])
    manifest["shards"], manifest["complete"] = manifest["shards"][:2], False
    manifest["total_tokens"] = sum(shard["tokens"] for shard in manifest["shards"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    words = shlex.split(fineweb.prep_status(out).resume_command)
    assert words[:2] == ["python", "fineweb.py"] and len(want) > 2
    assert words[words.index("--tokenizer") + 1] == trained.path
    assert fineweb.main([*words[2:], "--num_proc", "1"]) == 0
    assert {p.name: p.read_bytes() for p in out.glob("*.npy")} == want


def test_exported_tokenizer_json_gives_tiktokens_ids(tmp_path, trained):
    import openai_gpt2
    openai_gpt2.export_tokenizer(str(tmp_path), tok=trained)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    enc, rng = trained.encoding(), random.Random(2)
    texts = [random_text(rng, rng.randint(0, 100)) for _ in range(300)]
    texts += ["<|endoftext|>Hallo<|user_start|>", open(fineweb.__file__).read()[:20000]]
    for text in texts:
        want = enc.encode(text, allowed_special="all")  # HF reads a special token's spelling so
        assert hf.encode(text, add_special_tokens=False).ids == want, text


@pytest.fixture(scope="module")
def own_run(tmp_path_factory, trained):
    """A tiny run on shards of the trained tokenizer: 4 steps, a checkpoint at step 3."""
    folder = tmp_path_factory.mktemp("own_run")
    src = write_corpus_jsonl(folder / "c.jsonl", n_docs=150)
    data, log = str(folder / "data"), str(folder / "log")
    assert fineweb.main(["--input", src, "--tokenizer", trained.path, "--data_root", data,
                         "--num_proc", "1"]) == 0
    r = run_cli(*run_args(data, log, "--tokenizer", trained.path, "--max_steps", "4"))
    assert r.returncode == 0, r.stderr
    return data, log, src


def test_a_run_with_its_own_tokenizer(own_run, trained, tmp_path):
    data, log, _ = own_run
    lines = open(os.path.join(log, "log.txt")).read().split("\n")
    bpb = [line.split() for line in lines if " val_bpb " in line]
    val = [line.split() for line in lines if " val " in line]
    assert [b[0] for b in bpb] == [v[0] for v in val] and len(bpb) >= 2
    import torch
    ckpt = torch.load(os.path.join(log, "model_00003.pt"), weights_only=True)
    assert ckpt["tokenizer"]["fingerprint"] == trained.fingerprint
    assert ckpt["config"]["vocab_size"] == trained.padded_vocab == 448
    assert ckpt["config"]["real_vocab_size"] == trained.eot + 1
    # sample and export take the checkpoint's tokenizer with no flag
    r = run_cli("sample", "--checkpoint", os.path.join(log, "model_00003.pt"), "--device", "cpu",
                "--num_samples", "1", "--max_new_tokens", "4", "--prompt", "Über die")
    assert r.returncode == 0 and "Über die" in r.stdout, r.stderr
    out = str(tmp_path / "hf")
    r = run_cli("export", "--checkpoint", os.path.join(log, "model_00003.pt"), "--out", out)
    assert r.returncode == 0, r.stderr
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(out)
    text = "Der Fluss, the river: 42."
    assert hf.encode(text) == trained.encoding().encode_ordinary(text)
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["vocab_size"] == trained.eot + 1 and config["eos_token_id"] == trained.eot
    # eval --tasks val: the run's last val line again, from the checkpoint's data and settings
    results = tmp_path / "val.json"
    r = run_cli("eval", "--tasks", "val", "--checkpoint", os.path.join(log, "model_00003.pt"),
                "--device", "cpu", "--results", str(results))
    assert r.returncode == 0, r.stderr
    got = json.loads(results.read_text())
    assert got["tokenizer"] == trained.name and got["tokens"] == 64  # the run's --val_tokens
    assert (got["val_loss"], got["val_bpb"]) == pytest.approx(
        (float(val[-1][2]), float(bpb[-1][2])), abs=1e-4)  # log.txt's 4 decimals
    assert f"loss {got['val_loss']:.4f}, {got['val_bpb']:.4f} bits per byte" in r.stdout


def test_sft_and_chat_with_its_own_tokenizer(own_run, trained, tmp_path):
    """sft of the run's checkpoint renders the conversations with its tokenizer's chat tokens
    (right after <|endoftext|>, built here from its special tokens); chat --prompt answers with
    the greedy reply of a plain loop over the whole sequence; serve renders the same prompt; the
    exported folder's chat template too, its eos <|assistant_end|>."""
    import torch

    import chat
    import serve
    import train_gpt2 as tg
    from tests.helpers import write_jsonl

    _, log, _ = own_run
    ids = trained.special_tokens
    talk = [{"messages": [{"role": "user", "content": f"Farbe {i}?"},
                          {"role": "assistant", "content": f"Blau {i}."}]} for i in range(8)]
    write_jsonl(tmp_path / "talk.jsonl", talk)
    r = run_cli("sft", "--init_from", os.path.join(log, "model_00003.pt"), "--chat_data",
                str(tmp_path / "talk.jsonl"), "--chat_dir", str(tmp_path / "chat"), "--log_dir",
                str(tmp_path / "sft"), "--device", "cpu", "-B", "2", "-T", "32",
                "--total_batch_size", "64", "--max_steps", "2", "--eval_every", "0",
                "--save_every", "0")
    assert r.returncode == 0, r.stderr
    enc = trained.encoding()
    split = chat.open_split(str(tmp_path / "chat"), "train")
    manifest = chat.data_manifest(str(tmp_path / "chat"))
    assert manifest["args"]["tokenizer"] == trained.fingerprint
    chat.open_split(str(tmp_path / "chat"), "train", tok=trained)  # plan --sft's check
    with pytest.raises(chat.ChatDataError, match="rendered by another tokenizer"):
        chat.open_split(str(tmp_path / "chat"), "train", tok=fineweb.gpt2_tokenizer())
    conv_ids = [int(t) for t in split.conversation(0)[0]]
    question = enc.decode(conv_ids[2:conv_ids.index(ids["<|user_end|>"])])
    answer = {m["messages"][0]["content"]: m["messages"][1]["content"] for m in talk}[question]
    assert conv_ids == [ids["<|endoftext|>"], ids["<|user_start|>"], *enc.encode_ordinary(question),
                        ids["<|user_end|>"], ids["<|assistant_start|>"],
                        *enc.encode_ordinary(answer), ids["<|assistant_end|>"]]
    ckpt = os.path.join(tmp_path, "sft", "model_00001.pt")
    model = tg.model_from_checkpoint(torch.load(ckpt, weights_only=True), ckpt).eval()
    assert model.config.real_vocab_size == trained.n_vocab  # the chat tokens predicted

    r = run_cli("chat", "--checkpoint", ckpt, "--prompt", "Farbe 3?", "--temperature", "0",
                "--max_new_tokens", "6", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    prompt = [ids["<|endoftext|>"], ids["<|user_start|>"], *enc.encode_ordinary("Farbe 3?"),
              ids["<|user_end|>"], ids["<|assistant_start|>"]]
    seq, reply = list(prompt), []
    for _ in range(6):  # greedy, the whole sequence each token
        with torch.no_grad():
            logits, _ = model(torch.tensor([seq]))
        token = int(logits[0, -1, :trained.n_vocab].argmax())
        if token == ids["<|assistant_end|>"]:
            break
        seq.append(token)
        reply.append(token)
    assert r.stdout == enc.decode([t for t in reply if t < trained.eot]) + "\n"
    request = serve.read_request({"messages": [{"role": "user", "content": "Farbe 3?"}]}, enc,
                                 "m", model.config.block_size, serve.Defaults())
    assert list(request.prompt) == prompt
    assert serve.Job(request, enc, lambda event: None).end == ids["<|assistant_end|>"]
    # export: its turn ends at <|assistant_end|>, its template renders the same ids
    out = str(tmp_path / "hf")
    assert run_cli("export", "--checkpoint", ckpt, "--out", out).returncode == 0
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Farbe 3?"}]
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False) == prompt
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["eos_token_id"] == ids["<|assistant_end|>"]


def test_every_mismatch_is_refused_in_one_line(own_run, trained, corpus, tmp_path):
    data, log, _ = own_run
    other = str(tmp_path / "other")
    tokenizer.save(tokenizer.train_bpe(corpus[2], 300), other)
    # shards of the trained tokenizer, a run of GPT-2's
    r = run_cli(*run_args(data, str(tmp_path / "a")))
    assert_one_line_error(r, "was tokenized with the tokenizer", "not the run's GPT-2's BPE")
    r = run_cli(*run_args(data, str(tmp_path / "b"), "--tokenizer", other))
    assert_one_line_error(r, "was tokenized with the tokenizer", trained.name[:10])
    # OpenAI's GPT-2 reads GPT-2's ids only: refused before any download
    r = run_cli(*run_args(data, str(tmp_path / "c"), "--init_from", "gpt2", "--tokenizer", other,
                          drop=("--n_layer", "--n_head", "--n_embd", "--block_size")))
    assert_one_line_error(r, "--init_from gpt2", "drop --tokenizer")
    # a resumed run given another tokenizer
    r = run_cli("--resume", "latest", "--log_dir", log, "--device", "cpu", "--tokenizer", other)
    assert_one_line_error(r, f"--tokenizer {other}", "is not the tokenizer of --resume")
    # eval --tasks val of the checkpoint on shards of GPT-2's BPE; --val_tokens without it
    gpt2_data = str(tmp_path / "gpt2_data")
    assert fineweb.main(["--input", own_run[2], "--data_root", gpt2_data, "--num_proc", "1"]) == 0
    ckpt = os.path.join(log, "model_00003.pt")
    r = run_cli("eval", "--tasks", "val", "--checkpoint", ckpt, "--data_root", gpt2_data,
                "--device", "cpu")
    assert_one_line_error(r, "was tokenized with GPT-2's BPE", trained.name)
    r = run_cli("eval", "--checkpoint", ckpt, "--val_tokens", "64")
    assert_one_line_error(r, "--val_tokens goes with --tasks val")
    # fineweb.py: shards of another tokenizer into a folder of this one's
    r = fineweb.main(["--input", own_run[2], "--tokenizer", other, "--data_root", data])
    assert r == 1
