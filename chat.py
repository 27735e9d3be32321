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

