"""The chat tasks (`train_gpt2.py eval --tasks chat`, chat_eval.py): their results against a
plain scorer written here from nanochat's scripts/chat_eval.py (one forward pass a question, the
argmax of the letters' logits at the prompt's last position), on a planted model whose answers are
known and on tiny chat models of both architectures; the accuracies, standard errors and centred
mean against their formulas; the data's download (datasets' load_dataset replaced by fixture rows),
its manifest and checks, each refusal one line; a base model refused; CORE's labels untouched. No
network: the data are fixture files in the on-disk format, written here."""
import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import chat
import chat_eval
import settings
from helpers import (CHAT_EVAL_SOURCES, HANG_LIMIT_S, REPO, arc_rows, assert_one_line_error,
                     mmlu_rows, run_cli, tiny_model, torchrun, write_chat_eval_data,
                     write_core_bundle)

EOT, USER_START, USER_END, ASSISTANT_START = 50256, 50259, 50260, 50261  # docs/chat.md's ids
# ===== Fixture rows, in the HF datasets' own fields (helpers) ===================================
SOURCES = CHAT_EVAL_SOURCES
ROWS = {"arc_easy": arc_rows(23, 1), "arc_challenge": arc_rows(17, 2), "mmlu": mmlu_rows(19, 3)}
write_data = write_chat_eval_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("chat_eval_data"))


# ===== The reference: nanochat's categorical evaluation, one question a forward pass ==============
def nanochat_question(label, row):
    """(question, letters, choices, gold letter) as nanochat's tasks/arc.py and tasks/mmlu.py
    read a row."""
    if label == "mmlu":
        letters = ["A", "B", "C", "D"]
        return row["question"], letters, row["choices"], letters[row["answer"]]
    return row["question"], row["choices"]["label"], row["choices"]["text"], row["answerKey"]


def reference_prompt(question, letters, choices, enc):
    """nanochat's render_mc as the user's message, rendered as docs/chat.md says, then the
    assistant's start."""
    message = (f"Multiple Choice question: {question}\n"
               + "".join(f"- {c}={letter}\n" for letter, c in zip(letters, choices))
               + "\nRespond only with the letter of the correct answer.")
    return [EOT, USER_START] + enc.encode_ordinary(message) + [USER_END, ASSISTANT_START]


def last_logits(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    return (out[0] if isinstance(out, tuple) else out)[0, -1].float()


def reference(folder, labels, model, enc, context, max_per_task=None):
    """(results as --results writes them, examples as --examples writes them)."""
    out, examples = {}, []
    for label in labels:
        with open(os.path.join(folder, f"{label}.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        order = np.random.default_rng(42).permutation(len(rows))[:max_per_task]
        mine = []
        for line in order:
            question, letters, choices, gold = nanochat_question(label, rows[line])
            prompt = reference_prompt(question, letters, choices, enc)
            cropped = len(prompt) + 1 > context  # the prompt and the letter: cut from the left
            if cropped:
                prompt = prompt[len(prompt) + 1 - context:]
            ids = [enc.encode_ordinary(letter) for letter in letters]
            assert all(len(i) == 1 for i in ids)
            focus = last_logits(model, prompt)[[i[0] for i in ids]]
            pred = letters[int(focus.argmax())]
            mine.append({"task": label, "index": int(line), "pred": pred, "gold": gold,
                         "correct": pred == gold, "cropped": cropped})
        n = len(mine)
        p = sum(e["correct"] for e in mine) / n
        se = math.sqrt(p * (1 - p) / n)
        out[label] = {"accuracy": p, "accuracy_se": se, "centered": (p - 0.25) / 0.75,
                      "centered_se": se / 0.75, "n": n,
                      "cropped": sum(e["cropped"] for e in mine)}
        examples += sorted(mine, key=lambda e: e["index"])
    mean = sum(t["centered"] for t in out.values()) / len(out)
    mean_se = math.sqrt(sum(t["centered_se"] ** 2 for t in out.values())) / len(out)
    return {"centered_mean": mean, "centered_mean_se": mean_se, "tasks": out}, examples


def assert_matches(results, examples, want):
    want_results, want_examples = want
    assert examples == want_examples  # question by question
    assert results["centered_mean"] == pytest.approx(want_results["centered_mean"], abs=1e-12)
    assert results["centered_mean_se"] == pytest.approx(want_results["centered_mean_se"],
                                                        abs=1e-12)
    assert set(results["tasks"]) == set(want_results["tasks"])
    for label, t in want_results["tasks"].items():
        got = results["tasks"][label]
        assert (got["n"], got["cropped"]) == (t["n"], t["cropped"])
        for key in ("accuracy", "accuracy_se", "centered", "centered_se"):
            assert got[key] == pytest.approx(t[key], abs=1e-12), (label, key)


def read_outputs(results_path, examples_path):
    with open(results_path) as f:
        results = json.load(f)
    with open(examples_path) as f:
        return results, [json.loads(line) for line in f]


# ===== A planted model: its answer to each fixture question is chosen here =======================
class Planted(torch.nn.Module):
    """A stand-in chat model: after a prompt it was given (the reference's rendering), its logits
    are the ones planted for that prompt's letters; everywhere else all 0. Like our GPT and
    transformers' models, it returns only the positions asked for with logits_to_keep."""

    def __init__(self, plants, block_size):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size,
                                      real_vocab_size=chat.CHAT_VOCAB_SIZE)
        self.plants = plants  # {prompt ids: {token: logit}}

    def forward(self, idx, logits_to_keep=None):
        R, N = idx.shape
        positions = list(range(N)) if logits_to_keep is None else logits_to_keep.tolist()
        logits = torch.zeros(R, len(positions), 50304)
        for r in range(R):
            row = idx[r].tolist()
            for k, t in enumerate(positions):
                for token, value in self.plants.get(tuple(row[:t + 1]), {}).items():
                    logits[r, k, token] = value
        return logits


def plant(enc):
    """(the planted model, {(label, line): the letter it answers}): gold for most questions, a
    wrong letter for every third, and all letters tied for every fifth (the first one wins, as
    torch's argmax picks it)."""
    plants, answers = {}, {}
    for label, rows in ROWS.items():
        for line, row in enumerate(rows):
            question, letters, choices, gold = nanochat_question(label, row)
            ids = [enc.encode_ordinary(letter)[0] for letter in letters]
            g = letters.index(gold)
            if line % 5 == 0:
                values, answer = [3.0] * len(letters), letters[0]
            elif line % 3 == 0:
                wrong = (g + 1) % len(letters)
                values = [0.5 * j for j in range(len(letters))]
                values[wrong], values[g], answer = 4.0, 3.5, letters[wrong]
            else:
                values = [0.1 * j for j in range(len(letters))]
                values[g], answer = 4.0, gold
            plants[tuple(reference_prompt(question, letters, choices, enc))] = dict(zip(ids,
                                                                                        values))
            answers[label, line] = answer
    return Planted(plants, block_size=1024), answers


def test_a_planted_model_answers_as_planted(enc, data):
    """The product, the plain scorer and the planted answers agree question by question; the
    figures are the formulas' (computed here from the planted answers)."""
    model, answers = plant(enc)
    labels = list(chat_eval.TASKS)
    tasks = chat_eval.load_tasks(data, labels)
    res = chat_eval.evaluate(model, "cpu", tasks)
    want = reference(data, labels, model, enc, context=1024)
    assert_matches(res, res["examples"], want)
    assert [(e["task"], e["index"], e["pred"]) for e in res["examples"]] == \
        sorted(((label, line, a) for (label, line), a in answers.items()),
               key=lambda x: (labels.index(x[0]), x[1]))
    for label, t in res["tasks"].items():
        rows = ROWS[label]
        right = sum(answers[label, line] == nanochat_question(label, row)[3]
                    for line, row in enumerate(rows))
        p = right / len(rows)
        assert t["n"] == len(rows) and t["accuracy"] == right / len(rows)
        assert t["accuracy_se"] == pytest.approx(math.sqrt(p * (1 - p) / len(rows)), abs=1e-15)
        assert t["centered"] == pytest.approx((p - 0.25) / 0.75, abs=1e-15)
        assert 0 < p < 1
    one = chat_eval.evaluate(model, "cpu", tasks, batch_tokens=0)  # one question a pass
    assert one["examples"] == res["examples"]


def test_the_prompt_is_nanochats_render_mc_in_the_chat_format(enc):
    row = {"question": "Which grows?", "choices": {"text": ["a plant", "a stone", "a cup"],
                                                   "label": ["1", "2", "3"]}, "answerKey": "1"}
    q = chat_eval.question_of("arc_easy", row, "x", enc)
    ids = chat_eval.prompt_ids(q, enc)
    assert ids == reference_prompt(*nanochat_question("arc_easy", row)[:3], enc)
    assert ids[:2] == [EOT, USER_START] and ids[-2:] == [USER_END, ASSISTANT_START]
    assert enc.decode(ids[2:-2]) == ("Multiple Choice question: Which grows?\n- a plant=1\n"
                                     "- a stone=2\n- a cup=3\n\nRespond only with the letter of "
                                     "the correct answer.")
    assert q["gold"] == "1" and chat_eval.letter_token("A", enc) == enc.encode("A")[0] == 32


# ===== Tiny chat models of both architectures, through the command ===============================
def chat_model(arch="gpt2", seed=3, **kw):
    torch.manual_seed(1)
    model = tiny_model(seed=seed, real_vocab_size=chat.CHAT_VOCAB_SIZE,
                       **{**settings.ARCHITECTURES[arch], "block_size": 256, **kw}).eval()
    with torch.no_grad():  # zero-initialised parts (modern) would tie every letter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def save_checkpoint(model, path):
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(chat_model(), tmp_path_factory.mktemp("chat_ckpt") / "model.pt")


def chat_eval_cli(ckpt, data, tasks="chat", *extra):
    return run_cli("eval", "--tasks", tasks, "--checkpoint", ckpt, "--device", "cpu",
                   "--chat_eval_dir", data, *extra)


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_eval_tasks_chat_matches_the_plain_scorer(arch, enc, data, tmp_path):
    model = chat_model(arch)
    ckpt = save_checkpoint(model, tmp_path / "model.pt")
    outs = [str(tmp_path / "r.json"), str(tmp_path / "e.jsonl")]
    r = chat_eval_cli(ckpt, data, "chat", "--results", outs[0], "--examples", outs[1])
    assert r.returncode == 0, r.stderr
    want = reference(data, list(chat_eval.TASKS), model, enc, context=256)
    assert_matches(*read_outputs(*outs), want)
    correct = [e["correct"] for e in want[1]]
    assert True in correct and False in correct
    rows = r.stdout.splitlines()
    rows = rows[[row.split()[:2] for row in rows].index(["task", "n"]):]  # the table
    for label, row in zip(chat_eval.TASKS, rows[1:4]):
        t = want[0]["tasks"][label]
        assert row.split()[:6] == [f"chat:{label}", str(t["n"]), f"{t['accuracy']:.4f}",
                                   f"{t['accuracy_se']:.4f}", f"{t['centered']:.4f}",
                                   f"{t['centered_se']:.4f}"]
        assert row.endswith(" ~") == (abs(t["centered"]) <= 2 * t["centered_se"])
    assert rows[4].startswith(f"centered mean {want[0]['centered_mean']:.4f} (se "
                              f"{want[0]['centered_mean_se']:.4f}) over 3 tasks")


def test_one_task_alone_the_first_n_and_a_short_context(enc, data, tmp_path):
    """chat:arc_easy alone; --max_per_task N: the first N after the seed-42 shuffle; a 58-position
    model: the prompts that do not fit lose their start, counted (the fixture's are 45 to 67
    tokens)."""
    model = chat_model(block_size=58)
    ckpt = save_checkpoint(model, tmp_path / "model.pt")
    outs = [str(tmp_path / "r.json"), str(tmp_path / "e.jsonl")]
    r = chat_eval_cli(ckpt, data, "chat:arc_easy", "--max_per_task", "9", "--results", outs[0],
                      "--examples", outs[1])
    assert r.returncode == 0, r.stderr
    want = reference(data, ["arc_easy"], model, enc, context=58, max_per_task=9)
    assert_matches(*read_outputs(*outs), want)
    first9 = sorted(int(k) for k in np.random.default_rng(42).permutation(23)[:9])
    assert [e["index"] for e in want[1]] == first9
    cut = want[0]["tasks"]["arc_easy"]["cropped"]
    assert 0 < cut < 9  # some prompts fit, some do not
    assert f"note: {cut} prompts longer than the model's context of 58 positions" in r.stdout
    assert "over 1 tasks" in r.stdout
    r = chat_eval_cli(ckpt, data, "chat:mmlu,chat:arc_challenge", "--max_per_task", "50",
                      "--results", outs[0], "--examples", outs[1], "--overwrite")
    assert r.returncode == 0, r.stderr
    want = reference(data, ["mmlu", "arc_challenge"], model, enc, context=58)
    assert_matches(*read_outputs(*outs), want)  # N past a task's size: all of it
    assert list(want[0]["tasks"]) == ["mmlu", "arc_challenge"]


@pytest.mark.slow
def test_two_ranks_give_what_one_does(ckpt, data, tmp_path):
    """torchrun, 2 processes (gloo): the same --results and --examples as 1."""
    one = [str(tmp_path / "r1.json"), str(tmp_path / "e1.jsonl")]
    r = chat_eval_cli(ckpt, data, "chat", "--results", one[0], "--examples", one[1])
    assert r.returncode == 0, r.stderr
    two = [str(tmp_path / "r2.json"), str(tmp_path / "e2.jsonl")]
    r = torchrun("eval", "--tasks", "chat", "--checkpoint", ckpt, "--device", "cpu",
                 "--chat_eval_dir", data, "--results", two[0], "--examples", two[1])
    assert r.returncode == 0, r.stderr
    for a, b in zip(one, two):
        with open(a) as fa, open(b) as fb:
            assert fa.read() == fb.read()
    assert r.stdout.count("centered mean") == 1  # rank 0 reports


# ===== Refusals, each one line ===================================================================
def test_a_base_model_is_refused(data, tmp_path):
    base = save_checkpoint(tiny_model(), tmp_path / "base.pt")
    empty = str(tmp_path / "none")
    r = chat_eval_cli(base, empty)
    assert_one_line_error(r, base, "base model", "sft")
    assert not os.path.exists(empty)  # refused before any download


def test_task_names_and_flags(ckpt, data, tmp_path):
    r = chat_eval_cli(ckpt, data, "chat:arc_eassy")
    assert_one_line_error(r, "'chat:arc_eassy' is not a chat task", "did you mean chat:arc_easy")
    assert_one_line_error(chat_eval_cli(ckpt, data, "chat:mmlu,arc_easy"), "'arc_easy'",
                          "chat:LABEL items only")
    assert_one_line_error(chat_eval_cli(ckpt, data, "chat,chat:mmlu"), "give it alone")
    assert_one_line_error(chat_eval_cli(ckpt, data, "chat:mmlu,chat:mmlu"), "given twice")
    assert_one_line_error(chat_eval_cli(ckpt, data, "chat", "--limit", "3"),
                          "--limit goes with --tasks hellaswag")
    assert_one_line_error(chat_eval_cli(ckpt, "", "chat"), "--chat_eval_dir is empty")
    r = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--examples",
                str(tmp_path / "x.jsonl"))
    assert_one_line_error(r, "--examples goes with CORE's tasks", "the chat tasks (--tasks chat)")
    out = tmp_path / "r.json"
    out.write_text("mine\n")
    assert_one_line_error(chat_eval_cli(ckpt, data, "chat", "--results", str(out)), str(out),
                          "give --overwrite")
    assert out.read_text() == "mine\n"


def test_cores_labels_keep_their_meaning(ckpt, data, tmp_path):
    """--tasks arc_easy is CORE's task of that label (a bundle's), --tasks core all of CORE's: no
    chat data read, none needed."""
    bundle = write_core_bundle(str(tmp_path / "b"), n=6,
                               tasks=[("arc_easy", "multiple_choice", 0, None, 25.0),
                                      ("mc_zero", "multiple_choice", 0, None, 25.0)])
    for tasks, n in (("arc_easy", 1), ("core", 2)):
        r = run_cli("eval", "--tasks", tasks, "--checkpoint", ckpt, "--device", "cpu",
                    "--eval_bundle", bundle, "--eval_dir", str(tmp_path / "ed"),
                    "--chat_eval_dir", str(tmp_path / "no_chat_data"))
        assert r.returncode == 0, r.stderr
        assert f"over {n} tasks" in r.stdout and "CORE " in r.stdout
        assert "centered mean" not in r.stdout
    assert not os.path.exists(tmp_path / "no_chat_data")


# ===== The data: the files, the manifest, the download ===========================================
def test_a_changed_or_unlisted_file_is_one_line(ckpt, tmp_path):
    folder = write_data(tmp_path / "d")
    path = os.path.join(folder, "mmlu.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(mmlu_rows(1, 9)[0]) + "\n")
    assert_one_line_error(chat_eval_cli(ckpt, folder, "chat:mmlu"), path,
                          "changed since it was downloaded", "delete it")
    manifest = os.path.join(folder, "manifest.json")
    with open(manifest) as f:
        entries = json.load(f)
    del entries["mmlu"]
    with open(manifest, "w") as f:
        json.dump(entries, f)
    with pytest.raises(chat_eval.ChatEvalError, match="not listed in"):
        chat_eval.read_task(folder, "mmlu", chat_eval.fineweb.get_encoding())


@pytest.mark.parametrize("label, change, words", [
    ("mmlu", lambda r: {**r, "answer": 4}, "'answer' 4 is not an index 0-3"),
    ("mmlu", lambda r: {**r, "choices": r["choices"][:3]}, "a list of 4 strings"),
    ("arc_easy", lambda r: {**r, "answerKey": "Z"}, "answerKey 'Z' is not one of the labels"),
    ("arc_easy", lambda r: {**r, "choices": {"text": ["x", "y"], "label": ["A", "A"]}},
     "given twice"),
    ("arc_easy", lambda r: {**r, "choices": {"text": ["x", "y"], "label": ["A", "BB C"]},
                            "answerKey": "A"}, "is not one token"),
    ("arc_challenge", lambda r: {k: v for k, v in r.items() if k != "question"},
     "no 'question' string"),
])
def test_a_bad_row_is_one_line_naming_its_line(label, change, words, ckpt, tmp_path):
    rows = list(ROWS[label])
    rows[4] = change(rows[4])
    folder = write_data(tmp_path / "d", {label: rows})
    r = chat_eval_cli(ckpt, folder, f"chat:{label}")
    assert_one_line_error(r, f"{os.path.join(folder, label + '.jsonl')}:5: ", words)


@pytest.fixture
def fake_load_dataset(monkeypatch):
    """datasets.load_dataset replaced by one that records its arguments and serves rows (an
    exception: raised)."""
    import datasets

    state = {"calls": [], "rows": {}}

    def load_dataset(path, name=None, split=None, **kwargs):
        state["calls"].append((path, name, split))
        rows = state["rows"]
        if isinstance(rows, Exception):
            raise rows
        return rows[path, name]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(chat_eval, "TASKS", {
        label: spec._replace(rows=len(ROWS[label])) for label, spec in chat_eval.TASKS.items()})
    monkeypatch.delenv("CHAT_EVAL_DIR", raising=False)
    return state


def test_the_download_writes_the_files_and_manifest_once(fake_load_dataset, data, tmp_path):
    """chat_eval.py's download (the command the offline error names): each split's rows as
    JSONL, the manifest that the fixtures here are written as, byte for byte; once."""
    fake_load_dataset["rows"] = {SOURCES[label][:2]: rows for label, rows in ROWS.items()}
    folder = str(tmp_path / "new" / "dl")
    assert chat_eval.main(["--chat_eval_dir", folder]) == 0
    assert fake_load_dataset["calls"] == [(*SOURCES[label],) for label in chat_eval.TASKS]
    want = str(tmp_path / "want")
    write_data(want)
    assert sorted(os.listdir(folder)) == sorted(os.listdir(want) + [chat_eval.LOCK])
    for label in ROWS:
        with open(os.path.join(folder, f"{label}.jsonl"), "rb") as a, \
                open(os.path.join(want, f"{label}.jsonl"), "rb") as b:
            assert a.read() == b.read()
    with open(os.path.join(folder, "manifest.json")) as a, \
            open(os.path.join(want, "manifest.json")) as b:
        assert json.load(a) == json.load(b)
    assert chat_eval.main(["--chat_eval_dir", folder, "--tasks", "chat:mmlu"]) == 0
    assert len(fake_load_dataset["calls"]) == 3  # had already: not fetched again
    os.remove(os.path.join(folder, "mmlu.jsonl"))  # deleted: fetched again
    assert chat_eval.download("mmlu", folder) == os.path.join(folder, "mmlu.jsonl")
    assert len(fake_load_dataset["calls"]) == 4


@pytest.mark.parametrize("served, words", [
    (ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub\n(more)"), "Couldn't reach"),
    ("short", "18 rows, where its test split has 19"),
    ("bad row", "HF cais/mmlu (all) row 2: 'answer' 7 is not an index 0-3"),
])
def test_a_failed_download_is_one_line_and_leaves_nothing(served, words, fake_load_dataset,
                                                          capsys, tmp_path):
    rows = {SOURCES[label][:2]: rows for label, rows in ROWS.items()}
    if served == "short":
        rows["cais/mmlu", "all"] = ROWS["mmlu"][:-1]
    elif served == "bad row":
        rows["cais/mmlu", "all"] = [*ROWS["mmlu"][:2], {**ROWS["mmlu"][2], "answer": 7}]
    fake_load_dataset["rows"] = served if isinstance(served, Exception) else rows
    folder = str(tmp_path / "new" / "dl")
    assert chat_eval.main(["--chat_eval_dir", folder, "--tasks", "chat:mmlu"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (1 if isinstance(served, Exception) else 2), err  # and "writing ..."
    assert err[-1].startswith("error: ") and words in err[-1], err
    err = err[-1:]
    assert "python chat_eval.py --chat_eval_dir DIR" in err[0] or served == "bad row"
    assert not os.path.exists(tmp_path / "new")  # the folders it made are gone


@pytest.mark.slow
@pytest.mark.parametrize("offline", ["told", "not told"])
def test_offline_with_no_data_is_one_line(offline, ckpt, tmp_path):
    """The real datasets library with an empty cache, through the command: offline and told so
    (HF_HUB_OFFLINE=1), or not told (the hub's address a closed local port, found before
    datasets would retry): one line saying how to provide the files; no socket opened to the
    internet, no folder left."""
    folder = str(tmp_path / "chat_data")
    code = textwrap.dedent(f"""
        import socket, sys
        sys.path.insert(0, {REPO!r})
        connect = socket.socket.connect
        def local_only(self, address, *a):
            if not (isinstance(address, tuple) and address[0] == "127.0.0.1"):
                raise AssertionError(f"network access attempted: {{address}}")
            return connect(self, address, *a)
        socket.socket.connect = local_only
        import train_gpt2
        sys.exit(train_gpt2.main(["eval", "--tasks", "chat:arc_easy", "--checkpoint", {ckpt!r},
                                  "--device", "cpu", "--chat_eval_dir", {folder!r}]))
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE",
                        "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "CHAT_EVAL_DIR")}
    env["HF_HOME"] = str(tmp_path / "hf_home")
    if offline == "told":
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    else:
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=HANG_LIMIT_S, env=env, cwd=REPO)
    line = assert_one_line_error(r, "chat eval data unavailable",
                                 os.path.join(folder, "arc_easy.jsonl"),
                                 "allenai/ai2_arc (ARC-Easy, test split)",
                                 "python chat_eval.py --chat_eval_dir DIR", "manifest.json")
    assert ("the hub is unreachable" in line) == (offline == "not told")
    assert not os.path.exists(folder)


def test_no_work_at_import():
    code = ("import sys, threading; sys.path.insert(0, %r); import chat_eval; "
            "assert not {'torch', 'requests', 'datasets'} & set(sys.modules); "
            "assert threading.active_count() == 1" % REPO)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=HANG_LIMIT_S)
