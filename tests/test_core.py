"""CORE (`train_gpt2.py eval --tasks core`): its scores against a plain scorer written here from
the rules (one example per forward pass, no product code), the eval bundle's install (from a zip, a
folder, a URL served here; one download for two processes), its manifest, every bad bundle as one
line, the flags, 2 ranks == 1 and both architectures. No network: the bundles are fixtures written
here, and the default URL is pointed at a closed local port."""
import csv
import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
from dataclasses import asdict

import pytest
import torch
import yaml

import core_eval
import rundir
import settings
from helpers import (REPO, CORE_TASKS, Server, assert_one_line_error, core_records, edit_line,
                     hf_gpt2, run_args, run_cli, tiny_model, torchrun, write_core_bundle,
                     zip_folder)

EOT = 50256  # <|endoftext|>


def closed_port_url():
    """An http URL on 127.0.0.1 where nothing listens: a refused connection, at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/eval_bundle.zip"


@pytest.fixture(autouse=True)
def no_default_download(monkeypatch):
    """The default URL of this process refuses at once: no test reaches the internet."""
    monkeypatch.setattr(core_eval, "BUNDLE_URL", closed_port_url())
    monkeypatch.delenv("EVAL_BUNDLE_DIR", raising=False)


# ===== The reference: the rules as written in docs/evaluation.md, one example a forward pass =====
def logits_of(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    return (out[0] if isinstance(out, tuple) else out.logits)[0].float()  # (T, V)


def reference_rows(kind, item, shots, delim, enc):
    """(tokens, start, end) of each row, the prompts built as nanochat's templates render them."""
    if kind == "multiple_choice":
        blocks = [f"{e['query']}{delim}{e['choices'][e['gold']]}" for e in shots]
        texts = ["\n\n".join(blocks + [f"{item['query']}{delim}{c}"]) for c in item["choices"]]
    elif kind == "schema":
        blocks = [f"{e['context_options'][e['gold']]}{delim}{e['continuation']}" for e in shots]
        texts = ["\n\n".join(blocks + [f"{o}{delim}{item['continuation']}"])
                 for o in item["context_options"]]
    else:
        blocks = [f"{e['context'].strip()}{delim}{e['continuation']}" for e in shots]
        body = "\n\n".join(blocks + [item["context"].strip() + delim])
        texts = [body.strip(), body + item["continuation"]]
    toks = [[EOT] + enc.encode(t) for t in texts]
    if kind == "language_modeling":
        assert toks[1][: len(toks[0])] == toks[0]
        return [(toks[1], len(toks[0]), len(toks[1]))]
    shortest = min(len(t) for t in toks)
    n = 0
    if kind == "multiple_choice":
        while n < shortest and all(t[n] == toks[0][n] for t in toks):
            n += 1
        return [(t, n, len(t)) for t in toks]
    while n < shortest and all(t[-1 - n] == toks[0][-1 - n] for t in toks):
        n += 1
    return [(t, len(t) - n, len(t)) for t in toks]


def reference(bundle, model, enc, context, max_per_task=None, stats=None):
    """(results as --results writes them, examples as --examples writes them); stats["cropped"]:
    the rows cropped to the context."""
    stats = {} if stats is None else stats
    stats["cropped"] = 0
    with open(os.path.join(bundle, "core.yaml")) as f:
        tasks = yaml.safe_load(f)["icl_tasks"]
    with open(os.path.join(bundle, "eval_meta_data.csv")) as f:
        baselines = {r["Eval Task"]: float(r["Random baseline"]) / 100 for r in csv.DictReader(f)}
    out, examples = {}, []
    for t in tasks:
        with open(os.path.join(bundle, "eval_data", t["dataset_uri"])) as f:
            data = [(k, json.loads(line)) for k, line in enumerate(f.read().splitlines())]
        random.Random(1337).shuffle(data)
        if max_per_task:
            data = data[:max_per_task]
        k, kind, delim = t["num_fewshot"][0], t["icl_task_type"], t.get("continuation_delimiter",
                                                                          " ")
        mine = []
        for idx, (line, item) in enumerate(data):
            others = [j for j in range(len(data)) if j != idx]
            shots = [data[j][1] for j in random.Random(1234 + idx).sample(others, k)] if k else []
            means, greedy = [], True
            for tokens, s, e in reference_rows(kind, item, shots, delim, enc):
                if len(tokens) > context:  # cropped from the left
                    cut = len(tokens) - context
                    stats["cropped"] += 1
                    tokens, s, e = tokens[cut:], s - cut, e - cut
                logits = logits_of(model, tokens)
                target = torch.tensor(tokens[1:])
                losses = torch.nn.functional.cross_entropy(logits[:-1], target, reduction="none")
                means.append(losses[s - 1:e - 1].mean().item())  # nan for no scored token
                greedy = bool((logits[s - 1:e - 1].argmax(-1) == target[s - 1:e - 1]).all())
            if kind == "language_modeling":
                mine.append({"task": t["label"], "index": line, "pred": None, "gold": None,
                             "correct": greedy})
            else:
                pred = means.index(min(means))
                mine.append({"task": t["label"], "index": line, "pred": pred,
                             "gold": item["gold"], "correct": pred == item["gold"]})
        acc = sum(e["correct"] for e in mine) / len(mine)
        b = baselines[t["label"]]
        out[t["label"]] = {"accuracy": acc, "centered": (acc - b) / (1 - b), "n": len(mine),
                           "se": math.sqrt(acc * (1 - acc) / len(mine)) / (1 - b)}
        examples += sorted(mine, key=lambda e: e["index"])
    core = sum(v["centered"] for v in out.values()) / len(out)
    se = math.sqrt(sum(v["se"] ** 2 for v in out.values())) / len(out)
    return {"core": core, "core_se": se, "tasks": out}, examples


def assert_matches(results_path, examples_path, want):
    want_results, want_examples = want
    with open(examples_path) as f:
        got = [json.loads(line) for line in f]
    assert got == want_examples  # example by example
    with open(results_path) as f:
        res = json.load(f)
    assert res["core"] == pytest.approx(want_results["core"], abs=1e-9)
    assert res["core_se"] == pytest.approx(want_results["core_se"], abs=1e-9)
    assert set(res["tasks"]) == set(want_results["tasks"])
    for label, t in want_results["tasks"].items():
        assert res["tasks"][label]["n"] == t["n"]
        for key in ("accuracy", "centered", "se"):
            assert res["tasks"][label][key] == pytest.approx(t[key], abs=1e-9), (label, key)


# ===== The fixtures: a tiny transformers GPT-2 of 64 positions, the bundle ======================
def lm_answers(hf, enc, n=3, seed=5):
    """(context, continuation) pairs a 0-shot LM task scores correct: the continuation is the
    model's greedy next token after the context, where that token is a space and a word."""
    rng, found = random.Random(seed), []
    words = "the river city school light plant animal old new grows".split()
    for _ in range(400):
        context = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize()
        token = int(logits_of(hf, [EOT] + enc.encode(context))[-1].argmax())
        text = enc.decode([token])
        if text.startswith(" ") and text[1:].isascii() and text[1:].isalpha():
            found.append((context, text[1:]))
        if len(found) == n:
            return found
    raise AssertionError("the tiny model predicts no word after 400 contexts")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny GPT2LMHeadModel (64 positions) and its save_pretrained folder (--init_from DIR)."""
    return hf_gpt2(tmp_path_factory.mktemp("core_model"))


def save_checkpoint(model, path):
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of a tiny GPT (64 positions): loaded without transformers, whose progress bar
    on stderr would sit beside the one error line the tests want."""
    return save_checkpoint(tiny_model(), tmp_path_factory.mktemp("core_ckpt") / "model.pt")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The fixture bundle's folder (eval_bundle/ with core.yaml ...)."""
    return write_core_bundle(str(tmp_path_factory.mktemp("core_bundle")), n=8)


@pytest.fixture(scope="module")
def scored_bundle(model_dir, tmp_path_factory, enc):
    """The fixture bundle, its 0-shot LM task answerable by the tiny model."""
    hf = model_dir[0]
    root = tmp_path_factory.mktemp("core_scored_bundle")
    return write_core_bundle(str(root), n=8, lm_answers=lm_answers(hf, enc))


@pytest.fixture(scope="module")
def bundle_zip(bundle, tmp_path_factory):
    return zip_folder(bundle, tmp_path_factory.mktemp("core_zip") / "eval_bundle.zip")


def core(ckpt, *extra):
    """`eval --tasks core` of a checkpoint on the CPU."""
    return run_cli("eval", "--tasks", "core", "--checkpoint", ckpt, "--device", "cpu", *extra)


# ===== Scores ====================================================================================
@pytest.mark.slow
def test_core_matches_the_plain_scorer(model_dir, scored_bundle, enc, tmp_path):
    """--examples agrees with the reference example by example, --results to 1e-9; the fixture
    exercises every type, the cropping (4-shot LM prompts past 64 positions), the empty span."""
    hf = model_dir[0]
    stats = {}
    want = reference(scored_bundle, hf, enc, context=64, stats=stats)
    assert stats["cropped"] > 8  # every 4-shot LM row at least
    outs = [str(tmp_path / "r.json"), str(tmp_path / "e.jsonl")]
    r = run_cli("eval", "--tasks", "core", "--init_from", model_dir[1], "--device", "cpu",
                "--eval_bundle", zip_folder(scored_bundle, tmp_path / "eval_bundle.zip"),
                "--eval_dir", str(tmp_path / "ed"), "--results", outs[0], "--examples", outs[1])
    assert r.returncode == 0, r.stderr
    assert_matches(*outs, want)
    lm = [e["correct"] for e in want[1] if e["task"] == "lm_zero"]
    assert True in lm and False in lm  # the greedy rule can go either way here
    mc = [e["correct"] for e in want[1] if e["task"].startswith(("mc", "schema"))]
    assert True in mc and False in mc
    for (label, kind, shots, _, _), row in zip(CORE_TASKS, r.stdout.splitlines()[1:]):
        t = want[0]["tasks"][label]
        assert row.split()[:4] == [label, core_eval.TASK_TYPES[kind], str(shots), str(t["n"])]
        assert row.split()[4:7] == [f"{t['accuracy']:.4f}", f"{t['centered']:.4f}",
                                    f"{t['se']:.4f}"]
        assert row.endswith(" ~") == (abs(t["centered"]) <= 2 * t["se"])
    assert f"CORE {want[0]['core']:.4f} (se {want[0]['core_se']:.4f}) over 6 tasks" in r.stdout


class CountingEncoder:
    """The tokenizer, counting the texts it encodes."""

    def __init__(self, enc):
        self.enc, self.texts = enc, 0
        self.eot_token = enc.eot_token

    def encode(self, text, **kwargs):
        self.texts += 1
        return self.enc.encode(text, **kwargs)


def test_a_runs_evaluations_render_each_prompt_once(bundle, enc):
    """Training's CORE evaluates the same tasks again and again: the second evaluation encodes no
    prompt and gives the first one's results; a model of another context renders them again."""
    tasks = core_eval.read_bundle(bundle, labels=["mc_shots", "lm_shots"])
    counting = CountingEncoder(enc)
    model = tiny_model().eval()
    first = core_eval.evaluate(model, "cpu", tasks, enc=counting)
    rendered = counting.texts
    assert rendered >= sum(len(t.examples) for t in tasks)
    again = core_eval.evaluate(model, "cpu", tasks, enc=counting)
    assert counting.texts == rendered and again == first
    shorter = tiny_model(block_size=48).eval()
    core_eval.evaluate(shorter, "cpu", tasks, enc=counting)
    assert counting.texts == 2 * rendered


def test_the_bundles_of_bench_and_the_tests_read_back_as_written(bundle, tmp_path):
    """core_eval.write_bundle, the one writer of the layout: bench.py's synthetic bundle and the
    tests' fixture read back with their tasks' types, shots, delimiters, baselines and records."""
    import bench

    bench.synthetic_core_bundle(str(tmp_path), 11)  # 10 shots and the example
    tasks = core_eval.read_bundle(str(tmp_path))
    assert [(t.label, t.kind, t.shots, t.delimiter) for t in tasks] == [
        (label, bench.CORE_KINDS[kind], shots, delimiter)
        for label, kind, shots, delimiter, *_ in bench.CORE_SHAPES]
    assert [t.baseline for t in tasks] == [
        0 if kind == "LM" else 1 / options for _, kind, *_, options in bench.CORE_SHAPES]
    assert {len(t.examples) for t in tasks} == {11}
    fixture = core_eval.read_bundle(bundle)
    assert [(t.label, t.kind, t.shots, t.delimiter or " ", t.baseline * 100) for t in fixture] \
        == [(label, kind, shots, delimiter or " ", baseline)
            for label, kind, shots, delimiter, baseline in CORE_TASKS]
    for k, t in enumerate(fixture):
        assert [rec for _, rec in t.examples] == core_records(t.kind, 8, k)


def test_fewshot_prompts_are_rendered_as_the_templates_do(bundle, tmp_path):
    """The text of a 3-shot MC prompt, a 2-shot schema prompt and a 4-shot LM pair, spelled out."""
    folder = core_eval.install(bundle, str(tmp_path / "ed"))
    tasks = {t.label: t for t in core_eval.load_tasks(folder)}
    mc = tasks["mc_shots"]
    shots = core_eval.fewshot(mc, 2)
    rec = mc.examples[2][1]
    head = "".join(f"{e['query']}\nAnswer: {e['choices'][e['gold']]}\n\n" for e in shots)
    assert core_eval.prompts(mc, 2) == [f"{head}{rec['query']}\nAnswer: {c}"
                                        for c in rec["choices"]]
    lm = tasks["lm_shots"]
    rec, shots = lm.examples[0][1], core_eval.fewshot(lm, 0)
    assert len(shots) == 4 and rec["context"].endswith(" ")
    head = "".join(f"{e['context'].strip()} => {e['continuation']}\n\n" for e in shots)
    without, with_ = core_eval.prompts(lm, 0)
    assert without == f"{head}{rec['context'].strip()} =>"  # the trailing space stripped
    assert with_ == f"{head}{rec['context'].strip()} => {rec['continuation']}"
    positions = [[i for i in range(8) if i != k] for k in range(8)]  # Random(1234 + k) samples
    picks = [[lm.examples[j][1] for j in random.Random(1234 + k).sample(positions[k], 4)]
             for k in range(8)]
    assert [core_eval.fewshot(lm, k) for k in range(8)] == picks


@pytest.mark.slow
def test_max_per_task_is_the_first_n_after_the_shuffle(model_dir, ckpt, bundle, enc, tmp_path):
    hf = model_dir[0]
    want = reference(bundle, hf, enc, context=64, max_per_task=5)
    outs = [str(tmp_path / "r.json"), str(tmp_path / "e.jsonl")]
    r = run_cli("eval", "--tasks", "core", "--init_from", model_dir[1], "--device", "cpu",
                "--eval_bundle", bundle, "--eval_dir", str(tmp_path / "ed"), "--max_per_task", "5",
                "--results", outs[0], "--examples", outs[1])
    assert r.returncode == 0, r.stderr
    assert_matches(*outs, want)
    lines = list(range(8))
    random.Random(1337).shuffle(lines)
    assert [e["index"] for e in want[1] if e["task"] == "mc_zero"] == sorted(lines[:5])
    r = core(ckpt, "--eval_dir", str(tmp_path / "ed"), "--max_per_task", "3")
    assert_one_line_error(r, "--max_per_task 3", "mc_shots", "3 shots + 1")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_a_checkpoint_of_each_architecture(arch, bundle, enc, tmp_path):
    torch.manual_seed(1)
    model = tiny_model(seed=3, **settings.ARCHITECTURES[arch]).eval()
    with torch.no_grad():  # zero-initialised parts (modern) would tie every option
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ckpt = save_checkpoint(model, tmp_path / "model.pt")
    want = reference(bundle, model, enc, context=model.config.block_size, max_per_task=5)
    outs = [str(tmp_path / "r.json"), str(tmp_path / "e.jsonl")]
    r = run_cli("eval", "--tasks", "mc_shots,schema_zero,lm_shots,mc_zero,schema_shots,lm_zero",
                "--checkpoint", ckpt, "--device", "cpu", "--eval_bundle", bundle, "--eval_dir",
                str(tmp_path / "ed"), "--max_per_task", "5", "--results", outs[0],
                "--examples", outs[1])
    assert r.returncode == 0, r.stderr
    order = ["mc_shots", "schema_zero", "lm_shots", "mc_zero", "schema_shots", "lm_zero"]
    want_examples = sorted(want[1], key=lambda e: order.index(e["task"]))  # stable: by line
    assert_matches(*outs, (want[0], want_examples))
    assert [row.split()[0] for row in r.stdout.splitlines()[2:8]] == order


# ===== The command's flags =======================================================================
def test_task_names_and_flags(ckpt, bundle, tmp_path):
    ed = ["--eval_bundle", bundle, "--eval_dir", str(tmp_path / "ed")]
    r = run_cli("eval", "--tasks", "mc_zero,schema_zeroo", "--checkpoint", ckpt,
                "--device", "cpu", *ed)
    assert_one_line_error(r, "'schema_zeroo' is not a task", "did you mean schema_zero?")
    r = run_cli("eval", "--tasks", "lm_zero,core:lm_zero", "--checkpoint", ckpt,
                "--device", "cpu", *ed)
    assert_one_line_error(r, "lm_zero is given twice")
    assert_one_line_error(core(ckpt, *ed, "--limit", "3"), "--limit goes with --tasks "
                          "hellaswag")
    r = run_cli("eval", "--checkpoint", ckpt, "--device", "cpu", "--results",
                str(tmp_path / "x.json"))
    assert_one_line_error(r, "--results goes with CORE's tasks")
    out = tmp_path / "r.json"
    out.write_text("mine\n")
    fresh = ["--eval_bundle", bundle, "--eval_dir", str(tmp_path / "fresh")]
    assert_one_line_error(core(ckpt, *fresh, "--results", str(out)), str(out),
                          "give --overwrite")
    assert out.read_text() == "mine\n"
    assert not (tmp_path / "fresh").exists()  # refused before anything was installed
    r = core(ckpt, *ed, "--results", str(out), "--overwrite", "--tasks", "lm_zero")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(out.read_text())["tasks"]) == {"lm_zero"}
    r = core(ckpt, *ed, "--examples", str(tmp_path / "no" / "e.jsonl"))
    assert_one_line_error(r, "its folder does not exist")


# ===== The bundle: install, manifest, bad bundles ================================================
def no_tmp_left(*folders):
    for folder in folders:
        for top, dirs, names in os.walk(folder):
            assert not [n for n in dirs + names if n.endswith(".tmp")], top


class Serving(Server):
    """zip_path served at url on 127.0.0.1 by a thread, while the with block runs: the paths
    asked for in `served`; `asked` set at the first request, whose answer waits for `release`
    (set from the start unless hold)."""

    def __init__(self, zip_path, hold=False):
        self.served, self.release = [], threading.Event()
        if not hold:
            self.release.set()

        def send_zip(handler):
            self.served.append(handler.path)
            self.release.wait(300)
            with open(zip_path, "rb") as f:
                body = f.read()
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        super().__init__(send_zip)

    def __exit__(self, *exc):
        self.release.set()
        super().__exit__(*exc)


def test_install_from_a_zip_a_folder_and_a_url(bundle, tmp_path):
    bundle_zip = zip_folder(bundle, tmp_path / "eval_bundle.zip")
    manifests = []
    with Serving(bundle_zip) as server:
        for name, source in (("zip", bundle_zip), ("dir", bundle), ("url", server.url)):
            folder = core_eval.install(source, str(tmp_path / name))
            with open(os.path.join(folder, core_eval.MANIFEST)) as f:
                manifests.append(json.load(f))
            assert core_eval.install(source, folder) == folder  # installed: nothing again
            assert core_eval.install(None, folder) == folder
    assert server.served == ["/eval_bundle.zip"]
    url = server.url
    files = [m["sha256"] for m in manifests]
    assert files[0] == files[1] == files[2] and "core.yaml" in files[0]
    assert "eval_data/fixture/lm_shots.jsonl" in files[0]
    assert manifests[2]["source"] == url
    with pytest.raises(core_eval.BundleError, match="holds the eval bundle of"):
        core_eval.install(bundle_zip, str(tmp_path / "url"))  # another source: refused
    no_tmp_left(tmp_path / "zip", tmp_path / "dir", tmp_path / "url")


def test_offline_without_a_bundle_is_one_line(ckpt, tmp_path):
    ed = str(tmp_path / "ed")
    r = core(ckpt, "--eval_dir", ed)  # the default URL: a closed port here
    assert_one_line_error(r, "cannot download the CORE eval bundle", "--eval_bundle PATH")
    assert not os.path.exists(ed)
    r = core(ckpt, "--eval_dir", ed, "--eval_bundle", str(tmp_path / "nothing.zip"))
    assert_one_line_error(r, "nothing.zip: no such file or folder")
    assert not os.path.exists(ed)


def test_manifest_names_a_changed_or_missing_file(ckpt, bundle, tmp_path):
    ed = str(tmp_path / "ed")
    assert core(ckpt, "--eval_bundle", bundle, "--eval_dir", ed,
                "--tasks", "lm_zero").returncode == 0
    task_file = os.path.join(ed, "eval_data", "fixture", "mc_zero.jsonl")
    with open(task_file, "a") as f:
        f.write(" ")
    assert_one_line_error(core(ckpt, "--eval_dir", ed, "--tasks", "lm_zero"), task_file,
                          "changed since the eval bundle was installed")
    os.remove(task_file)
    assert_one_line_error(core(ckpt, "--eval_dir", ed), task_file, "is missing")


def keep_lines(path, n):
    with open(path) as f:
        lines = f.readlines()[:n]
    with open(path, "w") as f:
        f.writelines(lines)


def gold_out(line):
    rec = json.loads(line)
    rec["gold"] = 7
    return json.dumps(rec)


def bad_yaml(root):
    with open(os.path.join(root, "core.yaml")) as f:
        text = f.read()
    with open(os.path.join(root, "core.yaml"), "w") as f:
        f.write(text.replace("icl_task_type: schema", "icl_task_type: ranking", 1))


BAD = {  # a defect of the fixture bundle: (what it does to the bundle's folder, the error's words)
    "no core.yaml": (lambda root: os.remove(os.path.join(root, "core.yaml")),
                     ["no core.yaml in it"]),
    "no task file": (lambda root: os.remove(os.path.join(root, "eval_data/fixture/lm_zero.jsonl")),
                     ["eval_data/fixture/lm_zero.jsonl is missing"]),
    "bad json": (lambda root: edit_line(os.path.join(root, "eval_data/fixture/schema_zero.jsonl"),
                                        2, lambda line: line[:-3]),
                 ["eval_data/fixture/schema_zero.jsonl:3: not valid JSON"]),
    "gold": (lambda root: edit_line(os.path.join(root, "eval_data/fixture/mc_zero.jsonl"), 1,
                                    gold_out),
             ["eval_data/fixture/mc_zero.jsonl:2: gold 7 is outside the 3 choices"]),
    "type": (bad_yaml, ["core.yaml", "task schema_zero has the unknown type 'ranking'"]),
    "few": (lambda root: keep_lines(os.path.join(root, "eval_data/fixture/mc_shots.jsonl"), 3),
            ["eval_data/fixture/mc_shots.jsonl", "3 examples, fewer than its 3 shots + 1"]),
    "baseline": (lambda root: keep_lines(os.path.join(root, "eval_meta_data.csv"), 6),
                 ["eval_meta_data.csv: no random baseline for task lm_shots"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("form", ["dir", "zip"])
def test_a_bad_bundle_is_one_line_and_leaves_nothing(case, form, ckpt, tmp_path):
    root = write_core_bundle(str(tmp_path / "src"), n=8)
    damage, words = BAD[case]
    damage(root)
    source = root if form == "dir" else zip_folder(root, tmp_path / "b.zip")
    ed = str(tmp_path / "ed")
    line = assert_one_line_error(core(ckpt, "--eval_bundle", source, "--eval_dir", ed),
                                 *words)
    assert source in line
    assert not os.path.exists(ed)  # nothing half-installed
    no_tmp_left(tmp_path)


def test_a_file_that_is_no_zip_is_one_line(ckpt, tmp_path):
    bad = tmp_path / "eval_bundle.zip"
    bad.write_bytes(b"PK\x03\x04 this is not a zip archive")
    ed = str(tmp_path / "ed")
    assert_one_line_error(core(ckpt, "--eval_bundle", str(bad), "--eval_dir", ed), str(bad),
                          "not a readable zip file")
    assert not os.path.exists(ed)
    no_tmp_left(tmp_path)


@pytest.mark.slow
def test_two_processes_install_once(bundle_zip, tmp_path):
    """Two processes install from one URL into one folder at the same time: the first downloads
    (the server holds its answer until the second waits on the lock), the second waits, then
    both find the install."""
    server = Serving(bundle_zip, hold=True)
    url = server.url
    ed = str(tmp_path / "ed")
    code = f"import core_eval; print('installed', core_eval.install({url!r}, {ed!r}))"
    env = {**os.environ, "PYTHONPATH": REPO}

    def start():
        return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs = []
    try:
        with server:
            procs.append(start())
            assert server.asked.wait(300), "the first process never asked for the bundle"
            procs.append(start())
            seen = []
            for line in procs[1].stdout:  # until the second says it waits for the first
                seen.append(line)
                if "waiting for it" in line:
                    break
            assert seen and "is being installed into by another process" in seen[-1], seen
            server.release.set()
            outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(f"installed {ed}" in out for out, _ in outs)
    assert server.served == ["/eval_bundle.zip"]  # one download
    core_eval.verify(ed)


@pytest.mark.slow
def test_two_ranks_give_what_one_does(ckpt, bundle_zip, tmp_path):
    """torchrun, 2 processes (gloo), installing the bundle as it goes: the same files as 1."""
    one = [str(tmp_path / "r1.json"), str(tmp_path / "e1.jsonl")]
    r = core(ckpt, "--eval_bundle", bundle_zip, "--eval_dir", str(tmp_path / "ed1"),
             "--results", one[0], "--examples", one[1])
    assert r.returncode == 0, r.stderr
    two = [str(tmp_path / "r2.json"), str(tmp_path / "e2.jsonl")]
    r = torchrun("eval", "--tasks", "core", "--checkpoint", ckpt, "--device", "cpu",
                 "--eval_bundle", bundle_zip, "--eval_dir", str(tmp_path / "ed2"),
                 "--results", two[0], "--examples", two[1])
    assert r.returncode == 0, r.stderr
    for a, b in zip(one, two):
        with open(a) as fa, open(b) as fb:
            assert fa.read() == fb.read()
    assert r.stdout.count("CORE ") == 1  # rank 0 reports


# ===== In training ===============================================================================
@pytest.mark.slow
def test_training_logs_core_and_goes_on_without_a_bundle(data, bundle_zip, tmp_path, monkeypatch):
    """--core_every: log.txt gets core and a core/LABEL per task at the steps due and for the final
    model, the CORE that `eval` gives its checkpoint; the summary ends with it. Offline with no
    bundle, the run warns once and trains on without CORE."""
    folder = core_eval.install(str(bundle_zip), str(tmp_path / "installed"))
    monkeypatch.setenv("EVAL_BUNDLE_DIR", folder)
    log = str(tmp_path / "log")
    r = run_cli(*run_args(data, log, "--core_every", "4", "--core_max_per_task", "8"))
    assert r.returncode == 0, r.stderr
    series = rundir.read_log(os.path.join(log, "log.txt"))
    labels = core_eval.task_labels(folder)
    assert series["core"][0] == [0, 4, 8]  # due at 0 and 4, and the final model's (after step 7)
    for label in labels:
        assert series[f"core/{label}"][0] == [0, 4, 8]
    results = str(tmp_path / "final.json")
    ev = core(os.path.join(log, "model_00007.pt"), "--max_per_task", "8", "--results", results)
    assert ev.returncode == 0, ev.stderr
    with open(results) as f:
        final = json.load(f)
    assert series["core"][1][-1] == pytest.approx(final["core"], abs=5e-5)  # 4 decimals logged
    for label in labels:
        logged = series[f"core/{label}"][1][-1]
        assert logged == pytest.approx(final["tasks"][label]["centered"], abs=5e-5)
    assert f"  CORE: {series['core'][1][-1]:.4f} at step 8\n" in r.stdout

    monkeypatch.setenv("EVAL_BUNDLE_DIR", str(tmp_path / "empty"))  # nothing installed, offline
    r = run_cli(*run_args(data, str(tmp_path / "log2"), "--core_every", "4"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("warning: CORE evaluation turned off:") == 1
    assert "core" not in rundir.read_log(str(tmp_path / "log2" / "log.txt"))


@pytest.mark.slow
def test_plan_counts_core():
    """plan's time and FLOPs count CORE's forward passes: at most 22 tasks x --core_max_per_task
    examples of a context each, at every evaluation due (here steps 0, 50, 100 and the final
    model's)."""
    import dataclasses

    import train_gpt2

    run, _, _ = train_gpt2.settle(["--preset", "tiny", "--device", "cpu", "--core_every", "50",
                                   "--core_max_per_task", "100"], planning=True)
    off = dataclasses.replace(run, core_every=0)
    assert settings.evaluations(run.core_every, run, 0) == 4
    assert settings.core_tokens(run) == 4 * 22 * 100 * 256 and settings.core_tokens(off) == 0
    unit = run.micro_batch_size * run.sequence_length
    extra = settings.plan_time(run, 1.0) - settings.plan_time(off, 1.0)
    assert extra == pytest.approx(settings.core_tokens(run) / unit / 3)
    assert settings.least_seconds(run, 10**6, 1e9) > settings.least_seconds(off, 10**6, 1e9)
    assert settings.core_tokens(run, first_step=120) == 22 * 100 * 256  # the final model's alone


@pytest.mark.slow
def test_fsdp_two_ranks_log_the_core_of_one(data, bundle_zip, tmp_path, monkeypatch):
    """CORE in a run sharded by FSDP over 2 torchrun ranks (examples split, every rank running as
    many forward passes) logs what one process logs."""
    folder = core_eval.install(str(bundle_zip), str(tmp_path / "installed"))
    monkeypatch.setenv("EVAL_BUNDLE_DIR", folder)  # torchrun's ranks inherit it
    flags = ("--core_every", "4", "--core_max_per_task", "8", "--total_batch_size", "128",
             "--max_steps", "4", "--sample_every", "0")
    logs = [str(tmp_path / "one"), str(tmp_path / "two")]
    r = run_cli(*run_args(data, logs[0], *flags))
    assert r.returncode == 0, r.stderr
    r = torchrun(*run_args(data, logs[1], "--fsdp", *flags))
    assert r.returncode == 0, r.stderr
    one, two = (rundir.read_log(os.path.join(log, "log.txt")) for log in logs)
    kinds = [k for k in one if k == "core" or k.startswith("core/")]
    assert len(kinds) == 1 + len(core_eval.task_labels(folder))
    for kind in kinds:
        assert one[kind] == two[kind], kind  # steps 0 and 4, to the logged digit
