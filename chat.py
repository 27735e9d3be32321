"""Conversations: the format a fine-tuned (chat) model reads and writes, its special tokens, and
the conversation files it is fine-tuned on. docs/chat.md states the format as facts.

The special tokens live in GPT-2's padding rows (ids 50257 and up of the padded 50,304-entry
vocabulary): a base checkpoint of either architecture, or OpenAI's GPT-2, is fine-tuned into a chat
model without resizing anything. A tokenizer trained on one's own text (tokenizer.py) has them
right after its <|endoftext|>: ChatTokens are the ids of either, tokens_of(enc) an Encoding's. A
conversation is rendered as

    <|endoftext|> <|system_start|> ... <|system_end|> <|user_start|> ... <|user_end|>
    <|assistant_start|> ... <|assistant_end|> <|user_start|> ... (and so on)

its content encoded as plain text: text that spells a special token is those characters, never the
token, so a user cannot open a turn. The tokens trained (nanochat's rule) are the assistant's
content and its <|assistant_end|>: not the user's or the system's turns, and not the
<|assistant_start|> that opens a reply (the model is given it, then answers).

Importing this downloads, spawns and opens nothing, and imports neither torch nor datasets.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile

from common import UsageError, make_dirs, one_line, sha256_file

EOT = 50256  # <|endoftext|>: starts every conversation, as it starts every pretraining document
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = {  # name: id, in GPT-2's padding rows
    "<|system_start|>": 50257, "<|system_end|>": 50258,
    "<|user_start|>": 50259, "<|user_end|>": 50260,
    "<|assistant_start|>": 50261, "<|assistant_end|>": 50262,
}
START = {role: SPECIAL_TOKENS[f"<|{role}_start|>"] for role in ROLES}
END = {role: SPECIAL_TOKENS[f"<|{role}_end|>"] for role in ROLES}
CHAT_VOCAB_SIZE = max(SPECIAL_TOKENS.values()) + 1  # a chat model's real_vocab_size
INPUT_TYPES = (".jsonl", ".parquet")


class ChatTokens:
    """The ids of <|endoftext|> and the chat tokens in one tokenizer: eot, start and end by role,
    and vocab, the real_vocab_size of a chat model of it (every one of them predicted)."""

    def __init__(self, ids):
        self.eot = ids["<|endoftext|>"]
        self.start = {role: ids[f"<|{role}_start|>"] for role in ROLES}
        self.end = {role: ids[f"<|{role}_end|>"] for role in ROLES}
        self.vocab = max(ids.values()) + 1


GPT2_TOKENS = ChatTokens({"<|endoftext|>": EOT, **SPECIAL_TOKENS})


def tokens_of(enc):
    """The ChatTokens of enc, a tiktoken Encoding: a trained tokenizer's own special tokens (its
    Encoding has them all); GPT-2's in its padding (its Encoding has <|endoftext|> alone)."""
    if not set(SPECIAL_TOKENS) <= getattr(enc, "special_tokens_set", set()):
        return GPT2_TOKENS
    return ChatTokens({name: enc.encode_single_token(name)
                       for name in ("<|endoftext|>", *SPECIAL_TOKENS)})


# The same rendering as a Jinja chat template, for transformers' apply_chat_template (an exported
# chat model's tokenizer_config.json): its {% generation %} blocks mark the trained tokens, which
# return_assistant_tokens_mask=True reports. It gives render()'s ids for any content that does not
# spell a special token (a tokenizer reads such a spelling as the token; render() never does).
CHAT_TEMPLATE = (
    "{{ '<|endoftext|>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '_start|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|assistant_end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + '<|' + message['role'] + '_end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant_start|>' }}{% endif %}"
)


def is_chat_model(config, tokens=GPT2_TOKENS):
    """Whether a model (its GPTConfig) speaks this format: its padding mask lets the special
    tokens (tokens: its tokenizer's) be predicted (real_vocab_size covers them), as fine-tuning on
    conversations sets it."""
    return getattr(config, "real_vocab_size", 0) >= tokens.vocab


class ChatDataError(UsageError):
    """A conversation file that cannot be used: one line naming it."""

# ===== One conversation ==========================================================================
def problem(messages):
    """Why messages is not a conversation to train on (one short phrase), or None. A conversation
    is a list of {"role", "content"} objects: an optional system message first, then user and
    assistant turns alternating from a user's, with at least one assistant turn; every content a
    non-empty string."""
    if not isinstance(messages, list) or not messages:
        return "no messages"
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {k} is not a {{role, content}} object"
        if m["role"] not in ROLES:
            return f"message {k} has the unknown role {one_line(repr(m['role']), 30)}"
        if not isinstance(m["content"], str) or not m["content"].strip():
            return f"message {k} has no content"
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    for k, m in enumerate(turns):
        want = "user" if k % 2 == 0 else "assistant"
        if m["role"] != want:
            return f"roles out of order ({m['role']} where {want} was due)"
    if not any(m["role"] == "assistant" for m in turns):
        return "no assistant turn"
    return None


def render(messages, enc, tokens=None):
    """(ids, mask) of a conversation (problem() is None): mask[i] is 1 where ids[i] is trained (the
    assistant's content and end token), else 0. tokens: the special ids (tokens_of(enc))."""
    tokens = tokens or tokens_of(enc)
    ids, mask = [tokens.eot], [0]
    for m in messages:
        role = m["role"]
        content = enc.encode_ordinary(m["content"])  # special tokens' spellings stay plain text
        trained = int(role == "assistant")
        ids += [tokens.start[role], *content, tokens.end[role]]
        mask += [0] + [trained] * len(content) + [trained]
    return ids, mask


def render_prompt(messages, enc):
    """The ids a chat model answers: the conversation so far (ending with a user's turn), then
    <|assistant_start|>. The model's reply ends at <|assistant_end|>."""
    ids, _ = render(messages, enc)
    return ids + [tokens_of(enc).start["assistant"]]


def crop(ids, mask, max_len, tokens=GPT2_TOKENS):
    """A rendered conversation cut to at most max_len tokens so that it still ends on a whole
    assistant turn (its end token, of tokens: a ChatTokens), as (ids, mask, supervised tokens
    lost); None when not even its first assistant turn fits (the conversation is dropped)."""
    if len(ids) <= max_len:
        return ids, mask, 0
    end = None
    for i in range(max_len - 1, -1, -1):
        if ids[i] == tokens.end["assistant"]:
            end = i + 1
            break
    if end is None:
        return None
    return ids[:end], mask[:end], sum(mask[end:])


# ===== Conversation files ========================================================================
def _jsonl_rows(path):
    """(line number, messages or None, the bad row's reason) of a .jsonl file's non-blank lines."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield line_no, None, "not UTF-8"
                continue
            except json.JSONDecodeError:
                yield line_no, None, "not JSON"
                continue
            if not isinstance(row, dict) or "messages" not in row:
                yield line_no, None, "no messages"
                continue
            yield line_no, row["messages"], None


def _parquet_rows(path):
    """(row number, messages, None) of a .parquet file's rows (its `messages` column)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as pf:
        if "messages" not in pf.schema_arrow.names:
            raise ChatDataError(f"{path} has no 'messages' column (columns: "
                                f"{', '.join(pf.schema_arrow.names)})")
        row_no = 0
        for batch in pf.iter_batches(batch_size=1024, columns=["messages"]):
            for messages in batch.column(0).to_pylist():
                row_no += 1
                yield row_no, messages, None


def read_conversations(path):
    """The usable conversations of a .jsonl or .parquet file (HF's `messages` layout), and a note
    on the bad rows skipped ("N bad rows skipped, the first at line L: REASON") or None. A file
    with no usable row is a ChatDataError (one line)."""
    import pyarrow as pa

    if not path.endswith(INPUT_TYPES):
        raise ChatDataError(f"{path}: conversations come as .jsonl or .parquet files")
    rows = _jsonl_rows(path) if path.endswith(".jsonl") else _parquet_rows(path)
    good, bad, first = [], 0, None
    try:
        for where, messages, why in rows:
            if why is None:
                why = problem(messages)
            if why is None:
                good.append(messages)
                continue
            bad += 1
            if first is None:
                first = (where, why)
    except FileNotFoundError:
        raise ChatDataError(f"{path}: no such file") from None
    except (OSError, pa.ArrowException) as e:
        raise ChatDataError(f"cannot read {path}: {one_line(e, 200)}") from None
    unit = "line" if path.endswith(".jsonl") else "row"
    note = None
    if bad:
        note = (f"{path}: {bad} bad row{'s' if bad > 1 else ''} skipped, the first at {unit} "
                f"{first[0]}: {first[1]}")
    if not good:
        said = f" ({bad} bad, the first at {unit} {first[0]}: {first[1]})" if bad else ""
        raise ChatDataError(f"{path}: no usable conversation{said}")
    return good, note


# ===== Talking: a conversation's KV cache across turns ===========================================
# The chat command's engine. One KV cache holds the whole conversation, so a new turn runs only
# its new tokens (the last reply's final token and <|assistant_end|>, then the user's turn and
# <|assistant_start|>): the cost of a turn's first token does not grow with the turns before it.
# The model comes in as a value (anything with train_gpt2.GPT's make_kv_cache, config and
# forward), and so does the sampling rule, so this file stays free of the training script.
class ContextFull(UsageError):
    """A message that does not fit the model's context, even with every earlier turn dropped."""

class TextStream:
    """The text of a reply's tokens as they come. GPT-2's byte-level BPE can split one UTF-8
    character over several tokens, so a token's bytes are held until they complete a character:
    no piece ends in half of one. Bytes that never make a character come out as U+FFFD, as
    enc.decode gives them, so the pieces join to enc.decode of the text tokens. Special tokens
    (<|endoftext|> and the chat tokens, the ids from <|endoftext|> on) are never text."""
    def __init__(self, enc):
        import codecs

        self.enc, self.eot = enc, tokens_of(enc).eot
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token):
        """The text that token completes: "" while a character is still unfinished."""
        if token >= self.eot:
            return ""
        return self.utf8.decode(self.enc.decode_single_token_bytes(token))

    def flush(self):
        """What is left when the reply ends: U+FFFD for an unfinished character, else ""."""
        return self.utf8.decode(b"", final=True)


class Talk:
    """A conversation with a chat model: its token ids so far (<|endoftext|>, the system message
    if any, then each turn) and a KV cache holding the first cache.pos of them. ask() adds the
    user's turn, answer() streams the reply; the reply's tokens are the sampled ids themselves,
    never its text encoded again (which could tokenize differently from what the model saw).

    A turn must leave room for a reply of max_new_tokens and its <|assistant_end|>. When the
    context cannot, the oldest turns are dropped (the system message stays) and what follows them
    is run again at its new positions; a message that does not fit even alone is ContextFull.
    recompute=True runs the whole conversation again at each turn: the baseline the cache is
    measured against."""
    def __init__(self, model, enc, sample, system=None, max_new_tokens=None, device="cpu",
                 dtype=None, autocast=None, recompute=False):
        import contextlib

        self.model, self.enc, self.sample = model, enc, sample  # sample: (1, V) logits -> (1, 1)
        self.tokens = tokens_of(enc)
        self.block_size = model.config.block_size
        self.n_vocab = model.config.real_vocab_size  # the padding rows are never sampled
        # a quarter of the context by default: nanochat's 256 at GPT-2's 1024
        self.max_new_tokens = max_new_tokens or max(1, self.block_size // 4)
        self.device, self.recompute = device, recompute
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        start, end = self.tokens.start, self.tokens.end
        self.ids = [self.tokens.eot]
        if system:
            self.ids += [start["system"], *enc.encode_ordinary(system), end["system"]]
        self.head = len(self.ids)  # what dropping turns keeps
        self.turns = []  # where each user's turn starts in ids
        self.open = False  # a user's turn asked whose answer is not closed yet
        smallest = self.head + 4 + self.max_new_tokens + 1  # a one-token message, a full reply
        if smallest > self.block_size:
            system_takes = f" (the system message takes {self.head - 1})" if system else ""
            raise ContextFull(f"--max_new_tokens {self.max_new_tokens} leaves no room for a "
                              f"message in the model's context of {self.block_size} tokens"
                              f"{system_takes}")
        self.cache = model.make_kv_cache(1, self.block_size, device, dtype)

    def ask(self, text):
        """The user's message added (as plain text): returns how many of the oldest turns were
        dropped to make room for it and its reply (0 while the conversation fits). A ContextFull
        leaves the conversation as it was."""
        self._close()  # an answer never started (Ctrl-C before it) is an empty reply
        start, end = self.tokens.start, self.tokens.end
        turn = [start["user"], *self.enc.encode_ordinary(text), end["user"], start["assistant"]]
        need = len(turn) + self.max_new_tokens + 1
        starts = self.turns + [len(self.ids)]  # drop k turns: keep the ids from starts[k] on
        for k, start in enumerate(starts):
            if self.head + len(self.ids) - start + need <= self.block_size:
                break
        else:
            system_takes = f", the system message {self.head - 1}" if self.head > 1 else ""
            raise ContextFull(f"a message of {len(turn) - 3} tokens and a reply of up to "
                              f"{self.max_new_tokens} (--max_new_tokens{system_takes}) do not fit "
                              f"the model's context of {self.block_size} tokens")
        if k:
            cut = starts[k]
            self.ids = self.ids[: self.head] + self.ids[cut:]
            self.turns = [s - (cut - self.head) for s in self.turns[k:]]
            # the turns kept moved to earlier positions: their keys and values are computed anew
            self.cache.pos = min(self.cache.pos, self.head)
        self.turns.append(len(self.ids))
        self.ids += turn
        self.open = True
        return k

    def answer(self):
        """The reply to the message asked, as text pieces while its tokens come. It ends at
        <|assistant_end|> or after max_new_tokens, and stays in the conversation however it ends:
        a caller that stops it (closes the generator, as Ctrl-C does) keeps the tokens given so
        far as the reply, closed by <|assistant_end|>."""
        if not self.open:
            raise ValueError("answer() follows ask()")
        if self.recompute:
            self.cache.pos = 0
        text = TextStream(self.enc)
        try:
            for _ in range(self.max_new_tokens):
                token = self._next_token()
                if token == self.tokens.end["assistant"]:
                    break
                self.ids.append(token)
                piece = text.push(token)
                if piece:
                    yield piece
            tail = text.flush()
            if tail:
                yield tail
        finally:
            self._close()

    def reply(self, text):
        """ask(text), then answer()'s pieces (the number of turns dropped is not told)."""
        self.ask(text)
        yield from self.answer()

    def last_reply(self):
        """The ids of the last reply (without its <|assistant_end|>)."""
        start = self.turns[-1]
        opened = self.ids.index(self.tokens.start["assistant"], start) + 1
        return self.ids[opened: len(self.ids) - (0 if self.open else 1)]

    def _next_token(self):
        """The next token: the ids not yet in the cache run through it (a turn's first token:
        its new tokens; then the last token sampled), one sampled after them."""
        import torch

        new = torch.tensor([self.ids[self.cache.pos:]], dtype=torch.long, device=self.device)
        with torch.inference_mode(), self.autocast:
            logits, _ = self.model(new, kv_cache=self.cache, logits_to_keep=1)
        return int(self.sample(logits[:, -1, : self.n_vocab]).item())

    def _close(self):
        if self.open:
            self.ids.append(self.tokens.end["assistant"])
            self.open = False


def say(text="", end="\n", err=False):
    """text printed at once (streamed pieces appear as they come), on stderr for notes."""
    print(text, end=end, file=sys.stderr if err else sys.stdout, flush=True)


def answer_once(talk, text):
    """The chat command's --prompt: one message answered on stdout."""
    if not text.strip():
        raise UsageError("--prompt is empty: give a message")
    talk.ask(text)  # a ContextFull is the one error line
    for piece in talk.answer():
        say(piece, end="")
    say()
    return 0


def converse(talk, read=None):
    """The terminal chat: a message read, its answer streamed, until end of input or Ctrl-C at
    the prompt (status 0). Ctrl-C during an answer stops that answer, not the chat: what it said
    so far stays in the conversation."""
    if read is None:  # input() as it is now, not as it was when this file was imported
        read = input
        try:
            import readline  # noqa: F401 (input() then edits the line and keeps a history)
        except ImportError:  # not on Windows
            pass
    while True:
        try:
            text = read("User: ")
        except (EOFError, KeyboardInterrupt):
            say()
            return 0
        if not text.strip():
            continue
        pieces = None
        try:
            dropped = talk.ask(text)
            if dropped:
                say(f"note: the conversation outgrew the model's context ({talk.block_size} "
                    f"tokens): its oldest {dropped} turn{'s' if dropped > 1 else ''} dropped",
                    err=True)
            say("Assistant: ", end="")
            pieces = talk.answer()
            for piece in pieces:
                say(piece, end="")
        except ContextFull as e:
            say(f"error: {e}", err=True)
            continue
        except KeyboardInterrupt:
            if pieces is not None:
                pieces.close()  # the reply is the tokens given so far
        say()


# ===== Preparing conversations: token and mask arrays on disk ====================================
# docs/chat.md ("The prepared data") states the format. The stdlib and numpy are imported inside
# the functions: importing chat.py stays free of heavy imports, and the top of the file belongs to
# the format's code.
DEFAULT_DATASET = "HuggingFaceTB/smol-smoltalk"
HF_SPLITS = ("train", "test")  # a dataset's splits read as our train and val
VAL_FRACTION = 0.01  # of local conversations held out for val (by hash; see _val_key)
DATA_SPLITS = ("train", "val")
DATA_ARRAYS = {"ids": "<u2", "mask": "u1", "starts": "<i8"}  # {split}_{name}.npy: their dtypes
DATA_MANIFEST = "manifest.json"
DATA_FORMAT = "chat conversations, version 1"  # tells our manifest from fineweb.py's
DATA_LOCK = ".chat_data.lock"  # flock-ed by the prep; kept (removing it breaks the lock)
DATA_STAGING = ".chat_data-staging-"  # + random + .tmp: a prep's files until they are complete
DATA_BATCH = 1000  # conversations rendered at once (their contents encoded in tiktoken's threads)
_DATA_VERIFIED = {}  # path: (size, mtime_ns, sha256) of a file this process has hashed


def data_file(split, name):
    """A prepared array's file name: data_file("train", "ids") == "train_ids.npy"."""
    return f"{split}_{name}.npy"


DATA_FILES = tuple(data_file(s, n) for s in DATA_SPLITS for n in DATA_ARRAYS)


class ChatSplit:
    """One split of prepared conversations: ids (uint16) and mask (uint8, 1 = trained) of all of
    them concatenated, memory-mapped, and starts (int64, n + 1 offsets): conversation i is
    ids[starts[i]:starts[i + 1]]. It unpacks as (ids, mask, starts), the data ChatLoader takes."""
    def __init__(self, ids, mask, starts):
        self.ids, self.mask, self.starts = ids, mask, starts

    def __iter__(self):
        return iter((self.ids, self.mask, self.starts))

    def __len__(self):
        return len(self.starts) - 1

    def conversation(self, i):
        """(ids, mask) of conversation i, as views of the arrays."""
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return self.ids[a:b], self.mask[a:b]


def _is_dataset_name(source):
    """A HF dataset: an existing folder (a local copy of one), or a name with no file suffix that
    names nothing here (HuggingFaceTB/smol-smoltalk)."""
    return os.path.isdir(source) or (not os.path.exists(source)
                                     and not os.path.splitext(source)[1])


def _resolve_sources(sources):
    """("dataset", name) or ("files", [paths as given, each file once by its real path])."""
    if sources is None:
        return "dataset", DEFAULT_DATASET
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    sources = [os.path.expanduser(os.fspath(s)) for s in sources]
    if not sources:
        raise ChatDataError("no conversation files given")
    named = [s for s in sources if _is_dataset_name(s)]
    if named and len(sources) > 1:
        raise ChatDataError(f"{named[0]} names a dataset, not a .jsonl or .parquet file: give one "
                            f"dataset, or conversation files")
    if named:
        return "dataset", named[0]
    files, seen = [], set()
    for path in sources:
        if not path.endswith(INPUT_TYPES):
            raise ChatDataError(f"{path}: conversations come as .jsonl or .parquet files, or as a "
                                f"HF dataset's name such as {DEFAULT_DATASET}")
        if not os.path.isfile(path):
            raise ChatDataError(f"{path}: no such file")
        real = os.path.realpath(path)
        if real not in seen:  # a file named twice is read once
            seen.add(real)
            files.append(path)
    return "files", files


def _recorded_args(kind, what, val_fraction, hf_split, revision, tok=None):
    """What determines a prep's arrays (manifest.json's "args"): a prep with other args is refused
    rather than mixed or silently replaced. tok: the tokenizer.Tokenizer rendering them (None:
    GPT-2's BPE, "gpt2"; another by its fingerprint)."""
    try:
        val_fraction = float(val_fraction)
    except (TypeError, ValueError):
        val_fraction = float("nan")
    if not 0 < val_fraction < 1:
        raise ChatDataError(f"val_fraction must be between 0 and 1 (exclusive), got "
                            f"{val_fraction}")
    if tok is not None and tok.n_vocab > 1 << 16:
        raise ChatDataError(f"conversations are prepared as uint16 ids: {tok.describe()} has "
                            f"more than 65,536")
    args = {"tokenizer": _tokenizer_key(tok)}
    if kind == "files":
        args["files"] = [{"path": os.path.realpath(p), "bytes": os.path.getsize(p),
                          "mtime": int(os.path.getmtime(p))} for p in what]
        args["val_fraction"] = val_fraction
        return args
    hf_split = list(hf_split) if hf_split is not None else []
    if len(hf_split) != 2 or not isinstance(hf_split[0], str) or not (
            hf_split[1] is None or isinstance(hf_split[1], str)):
        raise ChatDataError(f"hf_split must be (train split, val split or None), got {hf_split}")
    args["dataset"] = os.path.realpath(what) if os.path.isdir(what) else what
    args.update(revision=revision, hf_split=hf_split, val_fraction=val_fraction)
    return args


def _tokenizer_key(tok):
    """How a prep's manifest names the tokenizer that rendered it: "gpt2" for GPT-2's BPE (or
    None), a trained one by its fingerprint."""
    if tok is None or tok.gpt2:
        return "gpt2"
    return tok.fingerprint


def _args_diff(old, new):
    """The first difference between two recorded args, in words."""
    for key in ("dataset", "files", "revision", "hf_split", "val_fraction", "tokenizer"):
        if old.get(key) != new.get(key):
            if key == "files" and old.get(key) and new.get(key):
                return "the files differ (paths, sizes or modification times)"
            return f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
    return "the arguments differ"


def _read_data_manifest(folder, missing_ok=False):
    """The manifest of prepared conversations in folder (None if missing_ok and there is none);
    a ChatDataError in one line when it is missing, damaged or another tool's."""
    path = os.path.join(folder, DATA_MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise ChatDataError(f"{folder} holds no prepared conversations ({DATA_MANIFEST} is "
                            f"missing): prepare them first") from None
    except (OSError, ValueError) as e:
        raise ChatDataError(f"{path} is damaged ({one_line(e, 100)}); delete {folder} to "
                            f"prepare it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != DATA_FORMAT:
        raise ChatDataError(f"{path} is not a manifest of prepared conversations ({DATA_FORMAT}): "
                            f"give another folder")
    try:
        for name in DATA_FILES:
            int(manifest["files"][name]["bytes"]), str(manifest["files"][name]["sha256"])
        manifest["args"]["tokenizer"], manifest["counts"]["train"]  # noqa: B018 (must be there)
    except (KeyError, TypeError, ValueError) as e:
        raise ChatDataError(f"{path} is damaged (no {one_line(e, 60)}); delete {folder} to "
                            f"prepare it again") from None
    return manifest


def data_manifest(folder):
    """The manifest.json of prepared conversations (the counts, sources and files it records)."""
    return _read_data_manifest(os.path.abspath(os.path.expanduser(os.fspath(folder))))


def _check_data_file(folder, name, record, hash_it=True):
    """A ChatDataError naming the file unless it is there with the recorded size and (hash_it)
    SHA-256; a file whose size and mtime this process has hashed already is not hashed again."""
    path = os.path.join(folder, name)
    fix = f"delete {folder} and prepare it again"
    try:
        st = os.stat(path)
    except OSError:
        raise ChatDataError(f"{path} is missing from the prepared conversations: {fix}") from None
    if st.st_size != record["bytes"]:
        raise ChatDataError(f"{path} is {st.st_size:,} bytes, not the {record['bytes']:,} its "
                            f"manifest records: it changed since the prep; {fix}")
    if not hash_it:
        return
    seen = _DATA_VERIFIED.get(path)
    if seen == (st.st_size, st.st_mtime_ns, record["sha256"]):
        return
    got = sha256_file(path)
    if got != record["sha256"]:
        raise ChatDataError(f"{path} changed since the prep (its SHA-256 is not the one its "
                            f"manifest records): {fix}")
    _DATA_VERIFIED[path] = (st.st_size, st.st_mtime_ns, got)


def open_split(folder, split, tok=None):
    """The prepared conversations of split ("train" or "val") in folder as a ChatSplit, its files
    checked against the manifest first: their sizes every time, their SHA-256 once per process
    (again when a file's size or mtime changes). A missing or changed file is a ChatDataError in
    one line naming it; so are conversations rendered by another tokenizer than tok (a
    tokenizer.Tokenizer; None: not checked)."""
    import numpy as np

    if split not in DATA_SPLITS:
        raise ChatDataError(f"no split {split!r} in prepared conversations: "
                            f"{' or '.join(DATA_SPLITS)}")
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    manifest = _read_data_manifest(folder)
    if tok is not None:
        made_by = manifest["args"].get("tokenizer", "gpt2")
        if made_by != _tokenizer_key(tok):
            raise ChatDataError(f"{folder} holds conversations rendered by another tokenizer "
                                f"({made_by}) than the run's ({tok.describe()}): give another "
                                f"--chat_dir")
    arrays = {}
    for name, dtype in DATA_ARRAYS.items():
        file = data_file(split, name)
        _check_data_file(folder, file, manifest["files"][file])
        path = os.path.join(folder, file)
        try:
            arrays[name] = np.load(path, mmap_mode="r" if name != "starts" else None)
        except (OSError, ValueError) as e:
            raise ChatDataError(f"cannot read {path}: {one_line(e, 120)}") from None
        if arrays[name].dtype != np.dtype(dtype) or arrays[name].ndim != 1:
            raise ChatDataError(f"{path} holds {arrays[name].dtype} of {arrays[name].ndim} "
                                f"dimensions, not 1-D {np.dtype(dtype)}")
    ids, mask, starts = arrays["ids"], arrays["mask"], arrays["starts"]
    count = manifest["counts"][split]
    if (len(ids) != len(mask) or len(starts) != count["conversations"] + 1 or starts[0] != 0
            or starts[-1] != len(ids) or len(ids) != count["tokens"]):
        raise ChatDataError(f"{folder}'s {split} arrays do not agree with each other or their "
                            f"manifest; delete {folder} and prepare it again")
    return ChatSplit(ids, mask, starts)


def _val_key(ids):
    """A conversation's place in the held-out val rule: the first 8 bytes of the SHA-256 of its
    rendered ids (uint16, little-endian) as a little-endian number below 2^64. The same
    conversation always gets the same key, wherever and however often it appears."""
    return int.from_bytes(hashlib.sha256(ids.tobytes()).digest()[:8], "little")


def _render_batch(batch, enc):
    """render() of each conversation in batch, their contents encoded in one call that tiktoken
    spreads over threads; render() itself puts them together, so the ids and masks are its own."""
    tokens = tokens_of(enc)
    texts = [m["content"] for messages in batch for m in messages]
    encoded = iter(enc.encode_ordinary_batch(texts))

    class Encoded:  # hands render() each content's ids in the order it asks for them
        @staticmethod
        def encode_ordinary(text):
            return next(encoded)

    return [render(messages, Encoded, tokens) for messages in batch]


class _SplitWriter:
    """The ids and mask .npy files of one split, appended to conversation by conversation; the
    header's length is given when the file opens (numpy leaves room for the length to grow), so
    finish() writes the real length in place."""
    def __init__(self, folder, split):

        self.folder, self.split = folder, split
        self.files = {name: open(os.path.join(folder, data_file(split, name)), "w+b")
                      for name in ("ids", "mask")}
        self.header_bytes = {name: self._header(name, 0) for name in self.files}
        for name, f in self.files.items():
            f.write(self.header_bytes[name])
        self.starts, self.keys, self.supervised = [0], [], 0

    @staticmethod
    def _header(name, n):
        import io

        import numpy as np

        b = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            b, {"descr": DATA_ARRAYS[name], "fortran_order": False, "shape": (n,)})
        return b.getvalue()

    def __len__(self):
        return len(self.keys)

    def add(self, ids, mask, key):
        self.files["ids"].write(ids.tobytes())
        self.files["mask"].write(mask.tobytes())
        self.starts.append(self.starts[-1] + len(ids))
        self.keys.append(key)
        self.supervised += int(mask.sum())

    def take(self, i):
        """Remove conversation i: (ids, mask, key), the later ones moved down in the files."""
        import numpy as np

        a, b = self.starts[i], self.starts[i + 1]
        out = []
        for name, f in self.files.items():
            itemsize = np.dtype(DATA_ARRAYS[name]).itemsize
            head = len(self.header_bytes[name])
            f.seek(head + a * itemsize)
            out.append(np.frombuffer(f.read((b - a) * itemsize), DATA_ARRAYS[name]))
            _cut(f, head + a * itemsize, head + b * itemsize)
        self.starts = self.starts[:i] + [s - (b - a) for s in self.starts[i + 1:]]
        key = self.keys.pop(i)
        self.supervised -= int(out[1].sum())
        return out[0], out[1], key

    def finish(self):
        """The arrays' real lengths into their headers, the files closed, starts saved."""
        import numpy as np

        n = self.starts[-1]
        for name, f in self.files.items():
            header = self._header(name, n)
            if len(header) != len(self.header_bytes[name]):  # numpy pads it; never expected
                raise RuntimeError(f"the .npy header of {n} tokens changed length")
            f.seek(0)
            f.write(header)
            f.seek(0, os.SEEK_END)
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(os.path.join(self.folder, data_file(self.split, "starts")), "wb") as f:
            np.save(f, np.asarray(self.starts, dtype=DATA_ARRAYS["starts"]))
            f.flush()
            os.fsync(f.fileno())

    def close(self):
        for f in self.files.values():
            f.close()

    def counts(self):
        return {"conversations": len(self), "tokens": self.starts[-1],
                "supervised": self.supervised}


def _cut(f, start, end, chunk=1 << 24):
    """Remove bytes [start, end) of the open file f, moving what follows down."""
    size = f.seek(0, os.SEEK_END)
    src, dst = end, start
    while src < size:
        f.seek(src)
        block = f.read(min(chunk, size - src))
        f.seek(dst)
        f.write(block)
        src, dst = src + len(block), dst + len(block)
    f.truncate(dst)


def _balance(writers):
    """The hash rule's two guarantees: train is never empty (the val conversation with the largest
    key moves to it), and val holds at least one conversation when there are two or more (the
    train conversation with the smallest key moves to it)."""
    train, val = writers["train"], writers["val"]
    if not len(train) and len(val):
        train.add(*val.take(max(range(len(val)), key=val.keys.__getitem__)))
    if not len(val) and len(train) >= 2:
        val.add(*train.take(min(range(len(train)), key=train.keys.__getitem__)))


class _BadRows:
    """The bad-row rule of read_conversations for rows of a HF dataset split: how many, and the
    first one's row number and reason."""
    def __init__(self, where):
        self.where, self.count, self.first = where, 0, None

    def good(self, rows):
        """The usable conversations of rows ((row number, messages) pairs)."""
        for row_no, messages in rows:
            why = problem(messages)
            if why is None:
                yield messages
                continue
            self.count += 1
            if self.first is None:
                self.first = (row_no, why)

    def note(self):
        if not self.count:
            return None
        return (f"{self.where}: {self.count} bad row{'s' if self.count > 1 else ''} skipped, the "
                f"first at row {self.first[0]}: {self.first[1]}")

    def none_usable(self):
        said = ""
        if self.count:
            said = f" ({self.count} bad, the first at row {self.first[0]}: {self.first[1]})"
        return ChatDataError(f"{self.where}: no usable conversation{said}")


def _hub_error(dataset, e):
    import fineweb

    if fineweb._is_network_error(e):
        return ChatDataError(f"the Hugging Face hub is unreachable, cannot load {dataset}: "
                             f"{one_line(e, 160)}. To prepare conversations offline, give local "
                             f".jsonl/.parquet files (--chat_data FILES)")
    return ChatDataError(f"cannot load {dataset}: {type(e).__name__}: {one_line(e, 200)}")


def _load_hub(dataset, revision, hf_split, print0):
    """{our split: a datasets.Dataset} of a HF dataset (a hub name or a local copy of one),
    downloaded and prepared once into datasets' cache (it reuses what it has), and the version's
    hash (the hub's commit). No val split in it (hf_split[1] None or absent): {"train": ...} only,
    and val is held out of it by the hash rule."""
    import datasets  # heavy: only when a dataset is read

    from common import hub_unreachable

    if not os.path.exists(dataset) and hub_unreachable():  # its client would retry for minutes
        raise _hub_error(dataset, ConnectionError(f"no connection to {dataset}'s host"))
    try:
        builder = datasets.load_dataset_builder(dataset, revision=revision)
        builder.download_and_prepare()
        have = list(builder.info.splits or ())
        train, val = hf_split
        if train not in have:
            raise ChatDataError(f"{dataset} has no split {train!r} (splits: {', '.join(have)})")
        if val is not None and val not in have:
            print0(f"{dataset} has no split {val!r} (splits: {', '.join(have)}): val is held "
                   f"out of {train!r} by the hash rule")
            val = None
        out = {"train": builder.as_dataset(split=train)}
        if val is not None:
            out["val"] = builder.as_dataset(split=val)
    except ChatDataError:
        raise
    except Exception as e:  # datasets' and huggingface_hub's many errors, each said in one line
        raise _hub_error(dataset, e) from None
    return out, getattr(builder, "hash", None)


def _hub_rows(ds, where):
    """(row number, messages) of a dataset split's `messages` column, a batch at a time."""
    if "messages" not in ds.column_names:
        raise ChatDataError(f"{where} has no 'messages' column (columns: "
                            f"{', '.join(ds.column_names)})")
    ds = ds.select_columns(["messages"])
    for start in range(0, len(ds), DATA_BATCH):
        rows = ds[start:start + DATA_BATCH]["messages"]
        yield from enumerate(rows, start + 1)


def _batches(items):
    size, batch = DATA_BATCH, []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_conversations(folder, kind, what, args, print0, progress, enc):
    """Render every usable conversation with enc into the split writers in folder (the staging
    folder); returns what the manifest records besides its files."""
    import numpy as np
    from tqdm import tqdm

    writers = {split: _SplitWriter(folder, split) for split in DATA_SPLITS}
    cut = round(args["val_fraction"] * 2**64)
    bar = tqdm(unit=" conversations", disable=not progress, desc="rendering")
    bad, record, by_hash = [], {}, True
    try:
        def add(conversations, split=None):  # split None: the hash rule decides
            for batch in _batches(conversations):
                for ids, mask in _render_batch(batch, enc):
                    ids, mask = np.asarray(ids, "<u2"), np.asarray(mask, "u1")
                    key = _val_key(ids)
                    writers[split or ("val" if key < cut else "train")].add(ids, mask, key)
                bar.update(len(batch))

        if kind == "files":
            for path in what:
                conversations, note = read_conversations(path)
                if note:
                    print0(note)
                    bad.append({"source": path, "rows": int(note[len(path) + 2:].split()[0]),
                                "note": note})
                add(conversations)
            record["val"] = f"held out by the hash rule, val_fraction {args['val_fraction']}"
        else:
            splits, record["dataset_hash"] = _load_hub(what, args["revision"], args["hf_split"],
                                                       print0)
            by_hash = "val" not in splits
            for split, ds in splits.items():
                where = f"{what} ({args['hf_split'][DATA_SPLITS.index(split)]} split)"
                rows = _BadRows(where)
                before = len(writers["train"]) + len(writers["val"])
                add(rows.good(_hub_rows(ds, where)), None if by_hash else split)
                if len(writers["train"]) + len(writers["val"]) == before:
                    raise rows.none_usable()
                if rows.note():
                    print0(rows.note())
                    bad.append({"source": where, "rows": rows.count, "note": rows.note()})
            record["val"] = (f"held out of {args['hf_split'][0]!r} by the hash rule, val_fraction "
                             f"{args['val_fraction']}" if by_hash else
                             f"the {args['hf_split'][1]!r} split")
        if by_hash:
            _balance(writers)
        for w in writers.values():
            w.finish()
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    record["counts"] = {split: w.counts() for split, w in writers.items()}
    record["counts"]["bad_rows"] = sum(b["rows"] for b in bad)
    record["bad_rows"] = bad
    return record


def _leftovers(folder, clear=True):
    """Refuse a folder that holds anything but a prep's files, then (clear) remove what a killed
    prep left there: its staging folders, and its arrays, moved in but with no manifest to make
    them a prep."""
    ours = set(DATA_FILES) | {DATA_LOCK, DATA_LOCK + ".holder"}
    leftovers = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        staged = name.startswith(DATA_STAGING) and os.path.isdir(path)
        temp = name.startswith((DATA_MANIFEST + ".", DATA_LOCK + ".holder."))  # atomic_write's
        ours_killed = name in DATA_FILES and os.path.isfile(path)
        if ((staged or temp) and name.endswith(".tmp")) or ours_killed:
            leftovers.append(path)
        elif name not in ours:
            raise ChatDataError(f"{folder} holds {name}, which is not prepared conversations: "
                                f"give a new or empty folder, or one prepared before")
    for path in leftovers if clear else ():
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def _prepare_locked(folder, kind, what, args, print0, progress, enc):
    """Write the arrays into a staging folder inside folder, move them into place and write the
    manifest last: until it is there, the folder holds no prep; a failure removes what moved."""
    import contextlib

    from common import atomic_write

    _leftovers(folder)
    staging = tempfile.mkdtemp(prefix=DATA_STAGING, suffix=".tmp", dir=folder)
    moved = []
    try:
        record = _write_conversations(staging, kind, what, args, print0, progress, enc)
        files = {name: {"sha256": sha256_file(os.path.join(staging, name)),
                        "bytes": os.path.getsize(os.path.join(staging, name))}
                 for name in DATA_FILES}
        manifest = {"format": DATA_FORMAT, "args": args, **record, "files": files}
        for name in DATA_FILES:
            os.replace(os.path.join(staging, name), os.path.join(folder, name))
            moved.append(name)
        data = (json.dumps(manifest, indent=1) + "\n").encode()
        atomic_write(os.path.join(folder, DATA_MANIFEST), lambda f: f.write(data))
    except BaseException:
        if not os.path.exists(os.path.join(folder, DATA_MANIFEST)):
            for name in moved:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def prepare(sources, out_dir, *, val_fraction=VAL_FRACTION, hf_split=HF_SPLITS,
            revision=None, print0=print, progress=True, tok=None):
    """Prepare conversations once into out_dir's token and mask arrays (docs/chat.md, "The
    prepared data"); returns out_dir's absolute path.

    sources: local .jsonl/.parquet files (a path or a list), or a HF dataset's name (None:
    DEFAULT_DATASET; an existing folder: a local copy of one) at revision (None: the newest),
    whose hf_split pair of splits become train and val (val None, or a split it lacks: val is held
    out of train by the hash rule, as it is for files). Every bad row is skipped and each file's
    (split's) note is print0-ed in one line; a file or split with no usable row is a ChatDataError.

    A folder prepared from the same sources and settings is checked (its files' sizes) and left as
    it is; one of other sources, or another process's prep in progress, is refused in one line.
    Arrays are written in a staging folder inside out_dir and the manifest last: an interrupted
    prep (an error, Ctrl-C, SIGTERM) leaves nothing, no folder it made, and runs again from the
    start. tok: the tokenizer.Tokenizer the conversations are rendered with (None: GPT-2's BPE),
    recorded: a prep of another is refused."""
    import contextlib

    from common import dir_lock, stops_raise

    folder = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    kind, what = _resolve_sources(sources)
    args = _recorded_args(kind, what, val_fraction, hf_split, revision, tok)

    def done(manifest):  # a finished prep: the same one, checked, or a refusal
        if manifest["args"] != args:
            raise ChatDataError(f"{folder} was prepared from other sources or settings "
                                f"({_args_diff(manifest['args'], args)}): give another folder, "
                                f"or delete it to prepare it again")
        for name in DATA_FILES:
            _check_data_file(folder, name, manifest["files"][name], hash_it=False)
        return folder

    empty = False  # a folder there and empty: a failed prep leaves it so, without the lock
    if os.path.isdir(folder):  # a finished prep is only read: no lock
        manifest = _read_data_manifest(folder, missing_ok=True)
        if manifest is not None:
            return done(manifest)
        _leftovers(folder, clear=False)  # another's folder is refused before a lock is put there
        empty = not os.listdir(folder)
    elif os.path.lexists(folder):
        raise ChatDataError(f"{folder} exists and is not a folder: give a folder for the "
                            f"prepared conversations")
    busy = ("is being prepared by another process ({holder}); wait for it to end, or stop it, "
            "then run again")
    with stops_raise():  # SIGTERM, as Ctrl-C, undoes the prep
        made = make_dirs(folder, "--chat_dir", ChatDataError)
        try:
            with dir_lock(folder, DATA_LOCK, busy, error=ChatDataError):
                try:
                    manifest = _read_data_manifest(folder, missing_ok=True)
                    if manifest is not None:  # another process finished it meanwhile
                        return done(manifest)
                    if tok is None:
                        import fineweb
                        tok = fineweb.gpt2_tokenizer()
                    manifest = _prepare_locked(folder, kind, what, args, print0, progress,
                                               tok.encoding())
                except BaseException:
                    if (made or empty) and \
                            set(os.listdir(folder)) <= {DATA_LOCK, DATA_LOCK + ".holder"}:
                        # unlinked while still held: a process that opened it meanwhile finds it
                        # gone, and this folder goes with it below
                        with contextlib.suppress(OSError):
                            os.remove(os.path.join(folder, DATA_LOCK))
                    raise
        except BaseException:
            for path in made:
                with contextlib.suppress(OSError):
                    os.rmdir(path)  # only if empty: what another process put there stays
            raise
    counts = manifest["counts"]
    print0(f"{folder}: {counts['train']['conversations']:,} train and "
           f"{counts['val']['conversations']:,} val conversations, "
           f"{counts['train']['tokens'] + counts['val']['tokens']:,} tokens "
           f"({counts['train']['supervised'] + counts['val']['supervised']:,} trained)")
    return folder


def ready(sources, folder, *, proc=None, print0=print, **kwargs):
    """folder, prepared from sources (prepare()'s arguments) unless it is already, on every rank of
    a run: the master prepares, the others wait for it, then each checks the folder. A failure is
    one line from the master (a ChatDataError); the other ranks stop with it."""
    from common import Proc

    proc = proc or Proc()
    failure = None
    if proc.master:
        try:
            prepare(sources, folder, print0=print0, **kwargs)
        except (UsageError, OSError) as e:
            failure = e
    if not proc.agree(failure is None, long_wait=True):
        if failure is not None:
            raise failure
        raise ChatDataError("preparing the conversations failed on rank 0 (see its message)")
    if not proc.master:
        prepare(sources, folder, print0=print0, **{**kwargs, "progress": False})  # checked
    return folder
