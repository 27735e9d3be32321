"""
A tokenizer: GPT-2's BPE (fineweb.gpt2_tokenizer(), from gpt2_bpe/) or a byte-level BPE trained on
your own text (fineweb.py --train_tokenizer DIR, which reads the inputs fineweb.py reads). Either
one is a Tokenizer: its mergeable ranks (token bytes -> id, ids 0..255 the single bytes), its split
pattern, its special tokens, each token's length in bytes, and a fingerprint, the SHA-256 of all of
that, by which shards, checkpoints and caches know which tokenizer made their ids. Encoding is
tiktoken's; training is rustbpe's (docs/tokenizer.md says why).

A trained tokenizer is a folder, written atomically (save):

    ranks.tiktoken     each token in base64 and its id, one a line (tiktoken's own file format)
    tokenizer.json     the split pattern, the special tokens, the vocabulary size, the fingerprint,
                       and what it was trained on (the held-out val text included)
    token_bytes.npy    each id's length in bytes (0 for a special token): bits per byte

Its special tokens follow the merges: <|endoftext|>, then the six chat tokens chat.py renders
conversations with, in chat.py's order (GPT-2's have them at 50256..50262).

Importing this trains, downloads and reads nothing.
"""

import base64
import hashlib
import json
import math
import os
import shutil

from common import UsageError, one_line

# GPT-4's split pattern (cl100k_base's): numbers in groups of up to 3 digits, case-insensitive
# contractions, a newline kept with the punctuation before it. GPT-2's is fineweb.GPT2_PAT.
GPT4_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}|"""
                r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
EOT_NAME = "<|endoftext|>"
# chat.py's tokens in its id order; a trained tokenizer puts them right after <|endoftext|>
CHAT_NAMES = ("<|system_start|>", "<|system_end|>", "<|user_start|>", "<|user_end|>",
              "<|assistant_start|>", "<|assistant_end|>")
SPECIAL_NAMES = (EOT_NAME, *CHAT_NAMES)
DEFAULT_VOCAB_SIZE = 32_768  # nanochat's; the special tokens included
PAD_VOCAB_TO = 64  # a model's embedding rows: matmuls over a multiple of 64 are faster
RANKS_FILE, CONFIG_FILE, BYTES_FILE = "ranks.tiktoken", "tokenizer.json", "token_bytes.npy"
FILES = (RANKS_FILE, CONFIG_FILE, BYTES_FILE)
FORMAT = 1  # tokenizer.json's "format"


class TokenizerError(UsageError):
    """A tokenizer folder that cannot be used, or a tokenizer that does not match: one line."""


def ranks_text(ranks):
    """The ranks in tiktoken's file format: "base64(token) id" a line, in id order."""
    lines = [f"{base64.b64encode(token).decode()} {rank}\n"
             for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    return "".join(lines)


def fingerprint(ranks, pattern, special_tokens):
    """SHA-256 (hex) of what decides a tokenizer's ids: its ranks, split pattern, special tokens."""
    head = json.dumps({"pattern": pattern, "special_tokens": special_tokens}, sort_keys=True)
    h = hashlib.sha256(head.encode())
    h.update(b"\n")
    h.update(ranks_text(ranks).encode())
    return h.hexdigest()


# tiktoken Encodings by fingerprint: a retrain into the same folder is another key, never a hit
_ENCODINGS = {}


class Tokenizer:
    """A byte-level BPE: ranks {token bytes: id}, a split pattern (a regex), special_tokens
    {name: id}. encoding(): tiktoken's Encoding of it; gpt2: built from OpenAI's files (the
    Encoding fineweb.get_encoding() returns, only <|endoftext|> among its special tokens, its chat
    ids reserved in the padding)."""

    def __init__(self, ranks, pattern, special_tokens, *, path=None, info=None, encoding=None,
                 gpt2=False):
        self.ranks, self.pattern = ranks, pattern
        self.special_tokens = dict(special_tokens)
        self.path, self.info, self.gpt2 = path, dict(info or {}), gpt2
        self.fingerprint = fingerprint(ranks, pattern, self.special_tokens)
        self.eot = self.special_tokens[EOT_NAME]
        self.n_vocab = max(len(ranks), max(self.special_tokens.values()) + 1)
        if encoding is not None:
            _ENCODINGS[self.fingerprint] = encoding

    @property
    def name(self):
        """gpt2, or bpe-<the fingerprint's first 12 hex digits>: what messages call it."""
        return "gpt2" if self.gpt2 else f"bpe-{self.fingerprint[:12]}"

    def describe(self):
        """The tokenizer in a few words, for messages: its name, folder and size."""
        if self.gpt2:
            return "GPT-2's BPE"
        where = f" ({self.path})" if self.path else ""
        return f"{self.name}{where}, {self.n_vocab:,} tokens"

    @property
    def dtype(self):
        """The numpy dtype that holds its ids: uint16, or uint32 past 65,536 tokens."""
        import numpy as np
        return np.uint16 if self.n_vocab <= 1 << 16 else np.uint32

    @property
    def padded_vocab(self):
        """A model's embedding rows for it: n_vocab padded to a multiple of 64."""
        return math.ceil(self.n_vocab / PAD_VOCAB_TO) * PAD_VOCAB_TO

    def encoding(self):
        """tiktoken's Encoding of this tokenizer, built once a process per fingerprint."""
        enc = _ENCODINGS.get(self.fingerprint)
        if enc is None:
            import tiktoken
            enc = tiktoken.Encoding(name=self.name, pat_str=self.pattern,
                                    mergeable_ranks=self.ranks,
                                    special_tokens=self.special_tokens,
                                    explicit_n_vocab=self.n_vocab)
            _ENCODINGS[self.fingerprint] = enc
        return enc

    def token_bytes(self):
        """Each id's length in bytes, an int32 array of n_vocab (0: a special token, or a
        reserved id): what a text's bytes are counted by."""
        import numpy as np
        lengths = np.zeros(self.n_vocab, dtype=np.int32)
        for token, rank in self.ranks.items():
            lengths[rank] = len(token)
        return lengths

    def record(self):
        """What a checkpoint keeps of it: its fingerprint and, for a trained one, its files' text
        (the checkpoint then needs no folder); from_record() reads it back."""
        record = {"name": self.name, "fingerprint": self.fingerprint}
        if not self.gpt2:
            record["files"] = {RANKS_FILE: ranks_text(self.ranks),
                               CONFIG_FILE: json.dumps(self._config(), indent=1) + "\n"}
        return record

    def _config(self):
        return {"format": FORMAT, "fingerprint": self.fingerprint, "pattern": self.pattern,
                "special_tokens": self.special_tokens, "n_vocab": self.n_vocab, **self.info}


def _parse_ranks(text, where):
    ranks = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{where}:{lineno} is not a line of base64 token and id "
                                 f"(damaged?)") from None
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) < 256:
        raise TokenizerError(f"{where}: its ids are not 0..{len(ranks) - 1} in order over all 256 "
                             f"bytes and the merges (damaged?)")
    return ranks


def _from_texts(ranks_txt, config_txt, where, path=None):
    """A Tokenizer from its two files' text, checked against the fingerprint they record."""
    try:
        config = json.loads(config_txt)
        pattern, specials, recorded = (config["pattern"], config["special_tokens"],
                                       config["fingerprint"])
    except (ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"{where}: {CONFIG_FILE} is damaged ({one_line(e, 100)})") from None
    ranks = _parse_ranks(ranks_txt, f"{where}/{RANKS_FILE}")
    info = {k: v for k, v in config.items()
            if k not in ("format", "fingerprint", "pattern", "special_tokens", "n_vocab")}
    tok = Tokenizer(ranks, pattern, specials, path=path, info=info)
    if tok.fingerprint != recorded:
        raise TokenizerError(f"{where}: its files do not match the fingerprint {CONFIG_FILE} "
                             f"records (changed or damaged): train it again")
    return tok


def load(path):
    """The Tokenizer in folder path (as save() wrote it), its files checked; TokenizerError."""
    import numpy as np
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isdir(path):
        raise TokenizerError(f"--tokenizer {path}: no such folder (train one with fineweb.py "
                             f"--train_tokenizer)")
    texts = {}
    for name in (RANKS_FILE, CONFIG_FILE):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                texts[name] = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"--tokenizer {path}: cannot read its {name} "
                                 f"({one_line(e, 100)}); is it a tokenizer folder?") from None
    tok = _from_texts(texts[RANKS_FILE], texts[CONFIG_FILE], path, path)
    try:
        lengths = np.load(os.path.join(path, BYTES_FILE), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}/{BYTES_FILE}: cannot read it ({one_line(e, 100)})") from None
    if not np.array_equal(lengths, tok.token_bytes()):
        raise TokenizerError(f"{path}/{BYTES_FILE} does not hold its tokens' byte lengths "
                             f"(damaged): train it again")
    return tok


def from_record(record, gpt2):
    """The Tokenizer a checkpoint's record() names; gpt2: GPT-2's, for a record of it or none (a
    checkpoint from before tokenizers were recorded)."""
    if not record or "files" not in record:
        if record and record.get("fingerprint") != gpt2.fingerprint:
            raise TokenizerError(f"the checkpoint's tokenizer {record.get('name')} is not in it "
                                 f"and is not GPT-2's")
        return gpt2
    files = record["files"]
    return _from_texts(files.get(RANKS_FILE, ""), files.get(CONFIG_FILE, "{}"), "its checkpoint")


def check_new_folder(path, overwrite):
    """A TokenizerError, before training, unless path can take a new tokenizer: new, an empty
    folder, or (overwrite) a tokenizer folder to replace."""
    if not path:
        raise TokenizerError("--train_tokenizer is empty: give the folder to write")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise TokenizerError(f"--train_tokenizer {path} is a file, not a folder")
        if os.listdir(path) and not overwrite:
            raise TokenizerError(f"--train_tokenizer {path} already holds files: add --overwrite "
                                 f"to replace the tokenizer there, or choose a new folder")
        if overwrite and set(os.listdir(path)) - set(FILES):
            raise TokenizerError(f"--train_tokenizer {path} holds files other than a tokenizer's "
                                 f"({', '.join(FILES)}): refusing to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise TokenizerError(f"--train_tokenizer {path}: cannot write in {parent}")


def save(tok, path, overwrite=False):
    """Write tok into folder path: all its files in a temporary folder beside it, then renamed into
    place, so a reader finds the old tokenizer or the new one, never half of one."""
    import numpy as np
    check_new_folder(path, overwrite)
    out = os.path.abspath(path)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{os.getpid()}.tmp")
    old = tmp[:-4] + ".old"
    record = tok.record()
    try:
        os.makedirs(tmp)
        for name, text in record["files"].items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        np.save(os.path.join(tmp, BYTES_FILE), tok.token_bytes())
        if os.path.isdir(out) and os.listdir(out):
            os.replace(out, old)  # overwrite: the old folder aside, then removed
        elif os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except OSError as e:
        raise TokenizerError(f"--train_tokenizer {path}: cannot write there ({one_line(e)})") \
            from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    tok.path = out


def train_bpe(texts, vocab_size=DEFAULT_VOCAB_SIZE, pattern=GPT4_PATTERN, info=None):
    """A Tokenizer trained on texts (an iterable of str) by rustbpe: vocab_size ids in all, the
    256 bytes, the merges, then the special tokens. rustbpe counts the pattern's chunks and merges
    the most frequent pair of ids, a tie going to the smallest pair (left id, then right id)."""
    import rustbpe
    n_merges = vocab_size - 256 - len(SPECIAL_NAMES)
    if n_merges < 0:
        raise TokenizerError(f"--vocab_size {vocab_size} is too small: 256 bytes and "
                             f"{len(SPECIAL_NAMES)} special tokens need {256 + len(SPECIAL_NAMES)}")
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), 256 + n_merges, pattern=pattern)
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_NAMES)}
    return Tokenizer(ranks, pattern, specials, info=info)


def bytes_per_token(tok, texts):
    """(bytes, tokens) of texts encoded as ordinary text (special tokens' spellings are text)."""
    enc = tok.encoding()
    tokens = sum(len(ids) for ids in enc.encode_ordinary_batch(list(texts)))
    n_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return n_bytes, tokens
