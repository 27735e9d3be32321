"""The chat format (chat.py): the special tokens in GPT-2's padding rows, the trained-token mask
(nanochat's rule), content encoded as plain text, cropping to a context, the conversation files'
bad rows; and transformers' apply_chat_template with chat.CHAT_TEMPLATE against render(), ids and
mask, as an exported chat model's tokenizer would give them."""
import json
import os
import shutil

import pytest

import chat
from helpers import REPO, write_jsonl

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [SYSTEM, {"role": "user", "content": "Name a river."},
     {"role": "assistant", "content": "The Nile."},
     {"role": "user", "content": " And a city,\nplease? "},
     {"role": "assistant", "content": "Cairo, on it. 日本語 too"}],
    [{"role": "user", "content": "Say <|endoftext|> and <|user_start|>"},
     {"role": "assistant", "content": "<|assistant_end|> is only text here"}],
]


def test_render_trains_the_assistant_content_and_end_only(enc):
    msgs = CONVERSATIONS[1]
    ids, mask = chat.render(msgs, enc)
    want_ids, want_mask = [chat.EOT], [0]
    for m in msgs:  # the rule, written out
        content = enc.encode_ordinary(m["content"])
        want_ids += [chat.START[m["role"]]] + content + [chat.END[m["role"]]]
        trained = 1 if m["role"] == "assistant" else 0
        want_mask += [0] + [trained] * len(content) + [trained]
    assert ids == want_ids and mask == want_mask
    assert ids[0] == 50256 and set(chat.SPECIAL_TOKENS.values()) == set(range(50257, 50263))
    trained = [t for t, k in zip(ids, mask) if k]
    assert trained.count(chat.END["assistant"]) == 2
    assert chat.START["assistant"] not in trained and chat.END["user"] not in trained
    assert enc.decode([t for t, k in zip(ids, mask) if k and t < chat.EOT]) == \
        "The Nile.Cairo, on it. 日本語 too"
    assert chat.render_prompt(msgs[:4], enc) == chat.render(msgs[:4], enc)[0] + [50261]


def test_text_that_spells_a_special_token_is_text(enc):
    ids, _ = chat.render(CONVERSATIONS[2], enc)
    specials = [t for t in ids if t >= chat.EOT]
    assert specials == [50256, 50259, 50260, 50261, 50262]  # the format's own, and only those
    assert "<|endoftext|>" in enc.decode([t for t in ids if t < chat.EOT])


@pytest.mark.parametrize("messages, words", [
    ([], "no messages"),
    ("hi", "no messages"),
    ([{"role": "user"}], "not a {role, content} object"),
    ([{"role": "bot", "content": "x"}], "unknown role 'bot'"),
    ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}], "no content"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "no content"),
    ([{"role": "assistant", "content": "x"}], "roles out of order"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles out of order"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, SYSTEM],
     "roles out of order"),
    ([SYSTEM, {"role": "user", "content": "a"}], "no assistant turn"),
])
def test_a_bad_conversation_says_why(messages, words):
    assert words in chat.problem(messages)


def test_good_conversations_have_no_problem():
    for msgs in CONVERSATIONS:
        assert chat.problem(msgs) is None
    assert chat.problem(CONVERSATIONS[0] + [{"role": "user", "content": "more?"}]) is None


def test_crop_ends_on_a_whole_assistant_turn(enc):
    ids, mask = chat.render(CONVERSATIONS[1], enc)
    first_end = ids.index(chat.END["assistant"]) + 1
    assert chat.crop(ids, mask, len(ids)) == (ids, mask, 0)
    for max_len in range(first_end, len(ids)):
        got_ids, got_mask, lost = chat.crop(ids, mask, max_len)
        assert got_ids == ids[:first_end] and got_mask == mask[:first_end]
        assert lost == sum(mask[first_end:]) and lost > 0
    assert chat.crop(ids, mask, first_end - 1) is None  # not even the first answer: dropped


def test_a_files_bad_rows_are_counted_and_named(tmp_path):
    path = str(tmp_path / "talk.jsonl")
    good = CONVERSATIONS[0]
    with open(path, "w") as f:
        f.write(json.dumps({"messages": good}) + "\n\n")  # a blank line is no row
        f.write("{not json\n")
        f.write(json.dumps({"text": "no messages"}) + "\n")
        f.write(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
        f.write(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    rows, note = chat.read_conversations(path)
    assert rows == [good, CONVERSATIONS[1]]
    assert note == f"{path}: 3 bad rows skipped, the first at line 3: not JSON"
    write_jsonl(path, [{"messages": good}])
    assert chat.read_conversations(path) == ([good], None)


def test_a_file_with_no_usable_row_is_one_error(tmp_path):
    path = str(tmp_path / "bad.jsonl")
    write_jsonl(path, [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(chat.ChatDataError, match="no usable conversation .1 bad, the first at "
                                                 "line 1: roles out of order"):
        chat.read_conversations(path)
    with open(path, "wb") as f:
        f.write(b'{"messages": "\xff"}\n')
    with pytest.raises(chat.ChatDataError, match="line 1: not UTF-8"):
        chat.read_conversations(path)
    with pytest.raises(chat.ChatDataError, match="no such file"):
        chat.read_conversations(str(tmp_path / "none.jsonl"))
    with pytest.raises(chat.ChatDataError, match=".jsonl or .parquet"):
        chat.read_conversations(str(tmp_path / "talk.csv"))


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "talk.parquet")
    rows = CONVERSATIONS + [[{"role": "user", "content": "no answer"}]]
    pq.write_table(pa.table({"messages": rows}), path)
    got, note = chat.read_conversations(path)
    assert got == CONVERSATIONS
    assert note == f"{path}: 1 bad row skipped, the first at row 4: no assistant turn"
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(chat.ChatDataError, match="no 'messages' column"):
        chat.read_conversations(path)


def hf_chat_tokenizer(folder):
    """transformers' GPT-2 tokenizer from gpt2_bpe/, with the special tokens and CHAT_TEMPLATE, as
    an exported chat model's folder would hold it."""
    from transformers import GPT2TokenizerFast

    shutil.copy(os.path.join(REPO, "gpt2_bpe", "encoder.json"), os.path.join(folder, "vocab.json"))
    shutil.copy(os.path.join(REPO, "gpt2_bpe", "vocab.bpe"), os.path.join(folder, "merges.txt"))
    tok = GPT2TokenizerFast.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": list(chat.SPECIAL_TOKENS)})
    tok.chat_template = chat.CHAT_TEMPLATE
    return tok


def test_transformers_chat_template_gives_our_ids_and_mask(enc, tmp_path):
    tok = hf_chat_tokenizer(str(tmp_path))
    assert [tok.convert_tokens_to_ids(t) for t in chat.SPECIAL_TOKENS] == \
        list(chat.SPECIAL_TOKENS.values())
    for msgs in CONVERSATIONS[:2]:  # content that spells no special token
        ids, mask = chat.render(msgs, enc)
        out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids
        assert out["assistant_masks"] == mask
        prompt = tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True,
                                         return_dict=True)
        assert prompt["input_ids"] == chat.render_prompt(msgs[:-1], enc)


OLD_TRANSFORMERS = os.environ.get("HELLASWAG_OLD_TRANSFORMERS", "")
_OLD_TEMPLATE = """
import json, sys
sys.path[:0] = [{old!r}]
sys.modules["kernels"] = None  # today's `kernels` fails on the older huggingface_hub
import transformers
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained({folder!r})
out = [tok.apply_chat_template(m, tokenize=True, return_dict=True,
                               return_assistant_tokens_mask=True) for m in {conversations!r}]
print(json.dumps({{"version": transformers.__version__,
                  "rendered": [[o["input_ids"], o["assistant_masks"]] for o in out]}}))
"""


@pytest.mark.skipif(not os.path.isdir(OLD_TRANSFORMERS),
                    reason="HELLASWAG_OLD_TRANSFORMERS is not set to a folder holding an older "
                           "transformers (.ci/run installs 4.53.3 there)")
def test_an_exported_chat_tokenizer_loads_in_older_transformers(enc, tmp_path):
    """The tokenizer files export writes with today's transformers, read by the oldest one
    requirements.txt allows: the same ids and trained-token mask as chat.render."""
    import subprocess
    import sys

    import openai_gpt2
    from helpers import HANG_LIMIT_S

    folder = str(tmp_path / "hf")
    openai_gpt2.export_tokenizer(folder, talks=True)
    script = tmp_path / "old.py"
    script.write_text(_OLD_TEMPLATE.format(old=OLD_TRANSFORMERS, folder=folder,
                                           conversations=CONVERSATIONS[:2]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=HANG_LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert int(out["version"].split(".")[0]) < 5, out  # really the older one
    assert out["rendered"] == [list(chat.render(m, enc)) for m in CONVERSATIONS[:2]]


# ===== Export: a chat model as a transformers folder, its tokenizer and chat template ============
@pytest.mark.slow
def test_an_exported_chat_model_talks_as_the_chat_command_does(enc, tmp_path):
    """export of a chat model: transformers loads the folder as it is (AutoTokenizer,
    AutoModelForCausalLM); apply_chat_template gives our ids and trained-token mask; greedy
    generate() from the exported model gives `chat --prompt`'s greedy answer, token for token,
    and stops at <|assistant_end|>."""
    from dataclasses import asdict

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers import run_cli, tiny_model

    model = tiny_model(seed=4, real_vocab_size=chat.CHAT_VOCAB_SIZE)
    ckpt = str(tmp_path / "model.pt")
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, ckpt)
    out = str(tmp_path / "hf")
    r = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    for msgs in CONVERSATIONS[:2]:
        ids, mask = chat.render(msgs, enc)
        got = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert got["input_ids"] == ids and got["assistant_masks"] == mask
    question = "Name a river."
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                     add_generation_prompt=True, return_dict=True)["input_ids"]
    assert prompt == chat.render_prompt([{"role": "user", "content": question}], enc)
    new = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    new = new.tolist()
    if chat.END["assistant"] in new:  # generate() stops there: the eos token of a chat model
        assert new[-1] == chat.END["assistant"]
        new = new[:-1]
    r = run_cli("chat", "--checkpoint", ckpt, "--prompt", question, "--top_k", "1",
                "--max_new_tokens", "12", "--device", "cpu", "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    text = enc.decode([t for t in new if t < chat.EOT])
    assert text and r.stdout.rstrip("\n") == text


def test_an_exported_base_model_loads_in_a_pipeline(tmp_path):
    """export of a base model writes GPT-2's tokenizer beside it: transformers' pipeline loads the
    folder as it is, with no chat template."""
    from dataclasses import asdict

    import torch
    from transformers import pipeline

    from helpers import run_cli, tiny_model

    model = tiny_model(seed=2)
    ckpt = str(tmp_path / "model.pt")
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, ckpt)
    out = str(tmp_path / "hf")
    assert run_cli("export", "--checkpoint", ckpt, "--out", out).returncode == 0
    generate = pipeline("text-generation", model=out)
    text = generate("Hello", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("Hello") and generate.tokenizer.chat_template is None
