"""The chat command (`train_gpt2.py chat`, chat.Talk): the conversation's KV cache kept across
turns gives the tokens of a plain loop that runs the whole conversation again for every token, and
runs each token once; the oldest turns dropped when the context is outgrown; Ctrl-C stopping an
answer, not the chat; --prompt on stdout; a base model refused; the streamed text never splitting
a UTF-8 character."""
import builtins

import pytest
import torch

import chat
import train_gpt2 as tg
from helpers import (GPU_ARCHS, assert_one_line_error, chat_model, plain_reply, run_cli,
                     save_checkpoint, tiny_model)

US, UE = chat.START["user"], chat.END["user"]
AS, AE = chat.START["assistant"], chat.END["assistant"]
# the modern parts where a cache can go wrong: rotary positions, one key/value head (GQA), value
# embeddings, x0 skips, a soft-capped untied head
ARCHS = {"gpt2": {}, "modern": {**GPU_ARCHS["modern"], "n_kv_head": 1, "value_embeds": True}}
MESSAGES = ["Hi!", "What is the capital of France?", "And of Japan, 日本?", "Thanks."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(chat_model(), tmp_path_factory.mktemp("chat") / "model.pt")


def greedy(logits):
    return tg.sample_next(logits, temperature=0)


def user_turn(enc, text):
    return [US, *enc.encode_ordinary(text), UE, AS]


class Counting:
    """A model that records the tokens of each forward, and raises KeyboardInterrupt (as Ctrl-C
    would) at the forward numbered interrupt_at (1-based)."""

    def __init__(self, model, interrupt_at=None):
        self.model, self.config, self.runs = model, model.config, []
        self.interrupt_at = interrupt_at

    def make_kv_cache(self, *args):
        return self.model.make_kv_cache(*args)

    def __call__(self, idx, **kw):
        self.runs.append(idx.size(1))
        if len(self.runs) == self.interrupt_at:
            raise KeyboardInterrupt
        return self.model(idx, **kw)


# ===== The cache across turns =====================================================================
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_cache_across_turns_gives_recomputations_tokens(enc, arch, system):
    model = chat_model(**ARCHS[arch])
    counted = Counting(model)
    talk = chat.Talk(counted, enc, greedy, system=system, max_new_tokens=6)
    conversation = [chat.EOT] + ([chat.START["system"], *enc.encode_ordinary(system),
                                  chat.END["system"]] if system else [])
    first = [{"role": "system", "content": system}] if system else []
    first.append({"role": "user", "content": MESSAGES[0]})
    assert conversation + user_turn(enc, MESSAGES[0]) == chat.render_prompt(first, enc)
    for text in MESSAGES:
        conversation += user_turn(enc, text)
        n_runs, cached = len(counted.runs), talk.cache.pos
        pieces = list(talk.reply(text))
        want = plain_reply(model, conversation, 6)
        assert talk.last_reply() == want
        assert "".join(pieces) == enc.decode([t for t in want if t < chat.EOT])
        conversation += want + [AE]
        assert talk.ids == conversation
        # a turn runs the tokens not yet cached in one forward (after the first turn: the
        # last reply's final token if unfinished, its end and the new user's turn), then one
        # token a forward
        first, *rest = counted.runs[n_runs:]
        assert rest == [1] * len(rest) and first == len(talk.ids) - len(want) - 1 - cached
        assert text == MESSAGES[0] or first <= len(user_turn(enc, text)) + 2
    # every token ran once: all but the last reply's final token (if unfinished) and its end
    assert sum(counted.runs) == talk.cache.pos >= len(conversation) - 2


def test_recompute_gives_the_same_tokens_running_each_turn_whole(enc):
    model = chat_model()
    cached, counted = chat.Talk(model, enc, greedy, max_new_tokens=5), Counting(model)
    again = chat.Talk(counted, enc, greedy, max_new_tokens=5, recompute=True)
    for text in MESSAGES[:3]:
        n_runs = len(counted.runs)
        assert list(cached.reply(text)) == list(again.reply(text))
        assert cached.ids == again.ids
        assert counted.runs[n_runs] == len(again.ids) - len(again.last_reply()) - 1


def test_the_oldest_turns_are_dropped_when_the_context_is_outgrown(enc):
    model = chat_model(block_size=64)
    talk = chat.Talk(model, enc, greedy, system="Be brief.", max_new_tokens=8)
    head = talk.ids[:]
    turns, dropped_in_all = [], 0  # each turn's ids, user's and reply's
    for text in MESSAGES * 2:
        dropped = talk.ask(text)
        dropped_in_all += dropped
        kept = [t for turn in turns[dropped_in_all:] for t in turn]
        assert talk.ids == head + kept + user_turn(enc, text)
        assert len(talk.ids) + 8 + 1 <= 64  # room for a whole reply and its end
        list(talk.answer())
        want = plain_reply(model, head + kept + user_turn(enc, text), 8)
        assert talk.last_reply() == want
        turns.append(user_turn(enc, text) + want + [AE])
    assert dropped_in_all > 0 and talk.ids[: len(head)] == head  # the system message stays


def test_a_message_that_never_fits_leaves_the_conversation_as_it_was(enc):
    talk = chat.Talk(chat_model(block_size=64), enc, greedy, max_new_tokens=8)
    list(talk.reply("Hi!"))
    before = talk.ids[:]
    with pytest.raises(chat.ContextFull, match="context of 64 tokens"):
        talk.ask("word " * 60)
    assert talk.ids == before and not talk.open
    with pytest.raises(chat.ContextFull, match="--max_new_tokens 60 leaves no room"):
        chat.Talk(chat_model(block_size=64), enc, greedy, max_new_tokens=60)


# ===== Ctrl-C and the terminal loop ===============================================================
def test_ctrl_c_stops_the_answer_not_the_chat(enc, capsys):
    model = chat_model()
    counted = Counting(model, interrupt_at=3)  # the first answer's third forward: 2 tokens given
    talk = chat.Talk(counted, enc, greedy, max_new_tokens=6)
    said = iter(["Hi!", "Thanks."])

    def read(prompt):
        try:
            return next(said)
        except StopIteration:
            raise KeyboardInterrupt from None  # Ctrl-C at the prompt: the chat ends, status 0

    assert chat.converse(talk, read) == 0
    first = user_turn(enc, "Hi!")
    partial = plain_reply(model, [chat.EOT] + first, 2)
    conversation = [chat.EOT] + first + partial + [AE] + user_turn(enc, "Thanks.")
    want = plain_reply(model, conversation, 6)
    assert talk.ids == conversation + want + [AE]  # the stopped answer stays as far as it got
    out = capsys.readouterr().out
    assert out.count("Assistant: ") == 2 and out.endswith("\n\n")


def test_interactive_chat_reads_turns_until_end_of_input(ckpt, enc, monkeypatch):
    said = iter(["Hi!", "   ", "What is the capital of France?"])

    def fake_input(prompt=""):
        try:
            return next(said)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    r = run_cli("chat", "--checkpoint", ckpt, "--temperature", "0", "--max_new_tokens", "6",
                "--device", "cpu")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    model = tg.model_from_checkpoint(torch.load(ckpt), ckpt).eval()
    conversation, answers = [chat.EOT], []
    for text in ("Hi!", "What is the capital of France?"):  # the blank line is no message
        conversation += user_turn(enc, text)
        reply = plain_reply(model, conversation, 6)
        answers.append(enc.decode([t for t in reply if t < chat.EOT]))
        conversation += reply + [AE]
    written_by, banner, chatted = r.stdout.split("\n", 2)
    assert "Ctrl-C stops an answer" in banner
    # each answer on a line of its own; end of input: a new line, and the chat ends
    assert chatted == "".join(f"Assistant: {a}\n" for a in answers) + "\n"


def test_interactive_chat_says_when_the_conversation_outgrew_the_context(tmp_path, monkeypatch):
    path = save_checkpoint(chat_model(block_size=64), tmp_path / "model.pt")
    said = iter(MESSAGES)
    monkeypatch.setattr(builtins, "input", lambda prompt="": _next_or_eof(said))
    r = run_cli("chat", "--checkpoint", path, "--max_new_tokens", "16", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.strip()]
    assert notes and all(line.startswith("note: the conversation outgrew the model's context "
                                         "(64 tokens): its oldest ") for line in notes), r.stderr
    assert r.stdout.count("Assistant: ") == len(MESSAGES)


def _next_or_eof(it):
    try:
        return next(it)
    except StopIteration:
        raise EOFError from None


# ===== --prompt, and what is refused ==============================================================
def test_prompt_answers_on_stdout(ckpt, enc):
    r = run_cli("chat", "--checkpoint", ckpt, "--prompt", "Hi!", "--temperature", "0",
                "--max_new_tokens", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    model = tg.model_from_checkpoint(torch.load(ckpt), ckpt).eval()
    reply = plain_reply(model, [chat.EOT] + user_turn(enc, "Hi!"), 8)
    assert r.stdout == enc.decode([t for t in reply if t < chat.EOT]) + "\n"
    sampled = [run_cli("chat", "--checkpoint", ckpt, "--prompt", "Hi!", "--seed", "7",
                       "--system", "Be brief.", "--top_k", "20", "--temperature", "1.2",
                       "--device", "cpu") for _ in range(2)]
    assert [s.returncode for s in sampled] == [0, 0]
    assert sampled[0].stdout == sampled[1].stdout and sampled[0].stdout.strip()


def test_a_base_model_is_refused_saying_to_run_sft(tmp_path):
    base = save_checkpoint(tiny_model(), tmp_path / "base.pt")
    r = run_cli("chat", "--checkpoint", base, "--prompt", "Hi!")
    assert_one_line_error(r, base, "base model", "sft")
    r = run_cli("chat", "--init_from", "gpt2", "--prompt", "Hi!")  # before any download
    assert_one_line_error(r, "OpenAI's GPT-2 is a base model", "sft")
    assert_one_line_error(run_cli("chat", "--prompt", "Hi!"), "--checkpoint")


def test_a_prompt_that_outgrows_the_context_is_one_line(ckpt):
    r = run_cli("chat", "--checkpoint", ckpt, "--prompt", "word " * 120, "--device", "cpu")
    assert_one_line_error(r, "do not fit the model's context of 128 tokens", "--max_new_tokens")
    r = run_cli("chat", "--checkpoint", ckpt, "--prompt", "Hi!", "--max_new_tokens", "128",
                "--device", "cpu")
    assert_one_line_error(r, "--max_new_tokens 128 leaves no room")
    assert_one_line_error(run_cli("chat", "--checkpoint", ckpt, "--prompt", " "), "--prompt")


# ===== Streaming text =============================================================================
def test_streamed_text_never_splits_a_character(enc):
    text = "naïve 日本語 🙂 ok"
    ids = enc.encode_ordinary(text)
    alone = [enc.decode_single_token_bytes(t) for t in ids]
    assert any(not _utf8(b) for b in alone)  # some token is part of a character only
    stream = chat.TextStream(enc)
    pieces = []
    for t in ids:
        pieces.append(stream.push(t))
        pieces.append(stream.push(chat.START["user"]))  # special tokens are never text
    pieces.append(stream.flush())
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text
    # bytes that never finish a character: U+FFFD, as enc.decode gives them
    lead = enc.encode_single_token("日".encode()[:1])
    stream = chat.TextStream(enc)
    joined = "".join(stream.push(t) for t in [*ids[:2], lead, *ids[2:], lead]) + stream.flush()
    assert joined == enc.decode([*ids[:2], lead, *ids[2:], lead]) and joined.count("\ufffd") == 2


def _utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
