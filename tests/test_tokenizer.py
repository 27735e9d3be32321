"""fineweb.get_encoding(): GPT-2's BPE built from gpt2_bpe/, with no network and no tiktoken cache.

References: tiktoken's own "gpt2" encoding (which downloads the same two files; run in a subprocess
pointed at the shared cache beside the repository, skipped without it) and Hugging Face's GPT-2
tokenizer built from the same files (a separate implementation: transformers/tokenizers)."""

import hashlib
import inspect
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

import fineweb
from fineweb import DataPrepError

from helpers import HANG_LIMIT_S, REPO

SHARED_CACHE = os.path.join(os.path.dirname(REPO), "shared", "tiktoken_cache")
EOT_TEXT = "<|endoftext|>"

TEXTS = [
    "Hello world",
    " Hello world",
    "Café naïve façade résumé Ångström, Œuvre; Zürich, São Paulo, Kraków, İstanbul, ß",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "emoji: 🤗🚀 family 👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 ❤️ skin tone 👍🏽",
    "spaces:   three,\t\ttabs, trailing   ",
    "   leading spaces and a lone space at the end ",
    "newlines\n\nparagraph\r\nwindows\n\n\n   \n indented\n",
    "contractions: I'll don't we've they're she'd I'm it's DON'T Y'ALL 'quoted' o'clock",
    "numbers 1234567 3.14159 1,000,000 ½ ² ٣٤ 2024-01-01",
    f"{EOT_TEXT}A document.{EOT_TEXT}Another one{EOT_TEXT}",
    f"glued{EOT_TEXT}to words {EOT_TEXT} and spaced, <|endoftext| not quite, <|endoftext|>>",
    "code:\n    def f(x):\n\treturn x**2  # comment\n\n",
    "mixed scripts: Ελληνικά Русский עברית العربية हिन्दी ไทย",
    "zero\u200bwidth, combining e\u0301, nbsp\u00a0here, ideographic\u3000space, \x00nul \x7fdel",
    "",
    " ",
    "\n",
]


def fuzz_texts(n=300, seed=0):
    """Short random strings over pieces where pre-tokenizers tend to disagree: whitespace runs
    before letters, apostrophes, digits, punctuation, non-Latin letters, emoji and the end-of-text
    token."""
    rng = random.Random(seed)
    pieces = ["a", "Z", "é", "ß", "日", "本", "🤗", "👍🏽", "1", "٣", "'", "'s", "'ll", "'T", ".",
              ",", "!?", "—", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", EOT_TEXT,
              "x", "word", " the"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(n)]


ALL_TEXTS = TEXTS + fuzz_texts()


def ours(enc, texts):
    return [enc.encode(t, allowed_special={EOT_TEXT}) for t in texts]


def test_bpe_files_have_tiktokens_hashes():
    # the expected sha256 of both files, as tiktoken's gpt2 definition checks them after a download
    import tiktoken_ext.openai_public as public
    source = inspect.getsource(public.gpt2)
    expected = {"vocab.bpe": re.search(r'vocab_bpe_hash="([0-9a-f]{64})"', source).group(1),
                "encoder.json": re.search(r'encoder_json_hash="([0-9a-f]{64})"', source).group(1)}
    for name, sha in expected.items():
        with open(os.path.join(REPO, "gpt2_bpe", name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha, name
    assert fineweb.BPE_FILES == expected
    for name in ("LICENSE", "README.md"):
        assert os.path.getsize(os.path.join(REPO, "gpt2_bpe", name)) > 0
    with open(os.path.join(REPO, "gpt2_bpe", "LICENSE"), encoding="utf-8") as f:
        assert "Copyright (c) 2019 OpenAI" in f.read()


def test_ranks_are_encoder_json_ids(enc):
    # tiktoken's ids are merge ranks: every token of GPT-2's encoder.json must get its own id
    with open(os.path.join(REPO, "gpt2_bpe", "encoder.json"), encoding="utf-8") as f:
        encoder = json.load(f)
    assert len(encoder) == 50257 and encoder[EOT_TEXT] == 50256
    # GPT-2's published byte <-> character table, written out independently of fineweb's
    byte_chars = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                  *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in byte_chars}
    others = [b for b in range(256) if b not in byte_chars]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    ranks = fineweb._gpt2_ranks()
    assert len(ranks) == 50256
    for token, i in encoder.items():
        if token != EOT_TEXT:
            assert ranks[bytes(table[c] for c in token)] == i, token
    assert enc.name == "gpt2" and enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.special_tokens_set == {EOT_TEXT}


def test_known_ids(enc):
    # the ids transformers documents for GPT-2's tokenizer ("Hello world" vs " Hello world")
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode(" Hello world") == [18435, 995]
    assert enc.encode(EOT_TEXT, allowed_special={EOT_TEXT}) == [50256]
    # tiktoken's default: special text in a document is refused, not encoded
    with pytest.raises(ValueError):
        enc.encode(EOT_TEXT)
    for text in TEXTS:
        assert enc.decode(enc.encode(text, allowed_special={EOT_TEXT})) == text


def test_same_as_tiktokens_gpt2(enc):
    if not os.path.isdir(SHARED_CACHE):
        pytest.skip(f"tiktoken's own gpt2 needs its files cached offline: no {SHARED_CACHE}")
    # a subprocess: the cache variable and tiktoken's registry stay out of this process
    code = (
        "import json, sys, tiktoken, fineweb\n"
        "texts = json.load(sys.stdin)\n"
        "ref, ours = tiktoken.get_encoding('gpt2'), fineweb.get_encoding()\n"
        "tables = [ref.name == ours.name, ref.n_vocab == ours.n_vocab,\n"
        "          ref._pat_str == ours._pat_str, ref._special_tokens == ours._special_tokens,\n"
        "          ref._mergeable_ranks == ours._mergeable_ranks]\n"
        "encode = lambda e: [e.encode(t, allowed_special={'<|endoftext|>'}) for t in texts]\n"
        "ordinary = lambda e: [e.encode_ordinary(t) for t in texts]\n"
        "json.dump({'tables': tables, 'ref': encode(ref), 'ours': encode(ours),\n"
        "           'ref_ordinary': ordinary(ref), 'ours_ordinary': ordinary(ours)}, sys.stdout)\n")
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": SHARED_CACHE}
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(ALL_TEXTS), cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tables"] == [True] * 5
    for text, ref, got in zip(ALL_TEXTS, out["ref"], out["ours"]):
        assert got == ref, text
    for text, ref, got in zip(ALL_TEXTS, out["ref_ordinary"], out["ours_ordinary"]):
        assert got == ref, text
    assert out["ours"] == ours(enc, ALL_TEXTS)  # the subprocess built the same encoding as this one


def hf_tokenizers(folder):
    """transformers' GPT-2 tokenizer class(es) loaded from the two files under their HF names (the
    pure-Python GPT2Tokenizer of transformers 4.x too, when it is a class of its own)."""
    from transformers import GPT2Tokenizer, GPT2TokenizerFast
    shutil.copy(os.path.join(REPO, "gpt2_bpe", "encoder.json"), os.path.join(folder, "vocab.json"))
    shutil.copy(os.path.join(REPO, "gpt2_bpe", "vocab.bpe"), os.path.join(folder, "merges.txt"))
    return [cls.from_pretrained(folder) for cls in {GPT2TokenizerFast, GPT2Tokenizer}]


def test_same_as_transformers_gpt2(enc, tmp_path):
    tokenizers = hf_tokenizers(str(tmp_path))
    expected = ours(enc, ALL_TEXTS)
    for tok in tokenizers:
        for text, want in zip(ALL_TEXTS, expected):
            assert tok.encode(text) == want, (type(tok).__name__, text)


def test_fresh_process_offline_with_no_cache(tmp_path):
    # no cache variable, an empty temp dir (tiktoken's default cache lives there) and every socket
    # refused
    code = (
        "import socket\n"
        "def refuse(*args, **kwargs):\n"
        "    raise OSError('network blocked by the test')\n"
        "socket.socket.connect = socket.socket.connect_ex = refuse\n"
        "socket.create_connection = socket.getaddrinfo = refuse\n"
        "import fineweb, tiktoken\n"
        "enc = fineweb.get_encoding()\n"
        "print(enc.encode('Hello world'), enc.encode(' <|endoftext|>', allowed_special='all'))\n"
        "try:\n"
        "    tiktoken.get_encoding('gpt2')\n"
        "    print('tiktoken loaded gpt2')\n"
        "except Exception as e:\n"
        "    print('tiktoken could not load gpt2')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")}
    env.update(TMPDIR=str(tmp_path), TEMP=str(tmp_path), TMP=str(tmp_path), HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=HANG_LIMIT_S)
    assert r.returncode == 0, r.stderr
    # the second line shows the sandbox holds: tiktoken's own loader finds neither a cache nor the
    # network
    assert r.stdout.splitlines() == ["[15496, 995] [220, 50256]", "tiktoken could not load gpt2"]
    assert os.listdir(tmp_path) == []  # and nothing was cached anywhere


@pytest.mark.parametrize("damage, message", [
    ("missing", "cannot read the GPT-2 tokenizer file"),
    ("crlf", "sha256 differs"),
    ("lfs", "sha256 differs"),
])
def test_damaged_bpe_file_is_a_one_line_error(tmp_path, monkeypatch, damage, message):
    shutil.copy(os.path.join(REPO, "gpt2_bpe", "encoder.json"), tmp_path / "encoder.json")
    with open(os.path.join(REPO, "gpt2_bpe", "vocab.bpe"), "rb") as f:
        vocab = f.read()
    if damage == "crlf":  # what a checkout with core.autocrlf would write without .gitattributes
        (tmp_path / "vocab.bpe").write_bytes(vocab.replace(b"\n", b"\r\n"))
    elif damage == "lfs":
        pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:00\n"
        (tmp_path / "vocab.bpe").write_bytes(pointer)
    monkeypatch.setattr(fineweb, "BPE_DIR", str(tmp_path))
    monkeypatch.setattr(fineweb, "_enc", None)
    with pytest.raises(DataPrepError, match=message) as e:
        fineweb.get_encoding()
    message = str(e.value)
    assert "\n" not in message and "vocab.bpe" in message
    assert "git checkout -- gpt2_bpe" in message


def test_bpe_folder_is_tracked_byte_exact():
    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout")
    for name in ("encoder.json", "vocab.bpe", "LICENSE", "README.md"):
        path = f"gpt2_bpe/{name}"
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert ignored.returncode == 1, f"{path} is git-ignored"
    for name in ("encoder.json", "vocab.bpe"):
        attr = subprocess.run(["git", "check-attr", "text", f"gpt2_bpe/{name}"], cwd=REPO,
                              capture_output=True, text=True)
        assert attr.stdout.strip().endswith("text: unset"), attr.stdout  # no line-ending conversion
