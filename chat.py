"""Conversations: the format a fine-tuned (chat) model reads and writes, its special tokens, and
the conversation files it is fine-tuned on. docs/chat.md states the format as facts.

The special tokens live in GPT-2's padding rows (ids 50257 and up of the padded 50,304-entry
vocabulary): a base checkpoint of either architecture, or OpenAI's GPT-2, is fine-tuned into a chat
model without resizing anything. A conversation is rendered as

    <|endoftext|> <|system_start|> ... <|system_end|> <|user_start|> ... <|user_end|>
    <|assistant_start|> ... <|assistant_end|> <|user_start|> ... (and so on)

its content encoded as plain text: text that spells a special token is those characters, never the
token, so a user cannot open a turn. The tokens trained (nanochat's rule) are the assistant's
content and its <|assistant_end|>: not the user's or the system's turns, and not the
<|assistant_start|> that opens a reply (the model is given it, then answers).

Importing this downloads, spawns and opens nothing, and imports neither torch nor datasets.
"""

import json

from common import UsageError, one_line

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


def is_chat_model(config):
    """Whether a model (its GPTConfig) speaks this format: its padding mask lets the special
    tokens be predicted (real_vocab_size covers them), as fine-tuning on conversations sets it."""
    return getattr(config, "real_vocab_size", 0) >= CHAT_VOCAB_SIZE


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


def render(messages, enc):
    """(ids, mask) of a conversation (problem() is None): mask[i] is 1 where ids[i] is trained (the
    assistant's content and end token), else 0."""
    ids, mask = [EOT], [0]
    for m in messages:
        role = m["role"]
        content = enc.encode_ordinary(m["content"])  # special tokens' spellings stay plain text
        trained = int(role == "assistant")
        ids += [START[role], *content, END[role]]
        mask += [0] + [trained] * len(content) + [trained]
    return ids, mask


def render_prompt(messages, enc):
    """The ids a chat model answers: the conversation so far (ending with a user's turn), then
    <|assistant_start|>. The model's reply ends at <|assistant_end|>."""
    ids, _ = render(messages, enc)
    return ids + [START["assistant"]]


def crop(ids, mask, max_len):
    """A rendered conversation cut to at most max_len tokens so that it still ends on a whole
    assistant turn (its end token), as (ids, mask, supervised tokens lost); None when not even its
    first assistant turn fits (the conversation is dropped)."""
    if len(ids) <= max_len:
        return ids, mask, 0
    end = None
    for i in range(max_len - 1, -1, -1):
        if ids[i] == END["assistant"]:
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
    (<|endoftext|> and the chat tokens) are never text."""

    def __init__(self, enc):
        import codecs

        self.enc = enc
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token):
        """The text that token completes: "" while a character is still unfinished."""
        if token >= EOT:
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
        self.block_size = model.config.block_size
        self.n_vocab = model.config.real_vocab_size  # the padding rows are never sampled
        # a quarter of the context by default: nanochat's 256 at GPT-2's 1024
        self.max_new_tokens = max_new_tokens or max(1, self.block_size // 4)
        self.device, self.recompute = device, recompute
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        self.ids = [EOT]
        if system:
            self.ids += [START["system"], *enc.encode_ordinary(system), END["system"]]
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
        turn = [START["user"], *self.enc.encode_ordinary(text), END["user"], START["assistant"]]
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
                if token == END["assistant"]:
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
        opened = self.ids.index(START["assistant"], start) + 1
        return self.ids[opened: len(self.ids) - (0 if self.open else 1)]

    def _next_token(self):
        """The next token: the ids not yet in the cache run through it (a turn's first token:
        its new tokens; then the last token sampled), one sampled after them."""
        import torch

        new = torch.tensor([self.ids[self.cache.pos:]], dtype=torch.long, device=self.device)
        with torch.no_grad(), self.autocast:
            logits, _ = self.model(new, kv_cache=self.cache, logits_to_keep=1)
        return int(self.sample(logits[:, -1, : self.n_vocab]).item())

    def _close(self):
        if self.open:
            self.ids.append(END["assistant"])
            self.open = False


def say(text="", end="\n", err=False):
    """text printed at once (streamed pieces appear as they come), on stderr for notes."""
    import sys

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
