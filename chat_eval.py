"""The chat tasks: a chat model asked multiple-choice questions in its chat format and scored as
nanochat's scripts/chat_eval.py scores its categorical tasks (ARC-Easy, ARC-Challenge, MMLU).

Each question is one user message, written as nanochat's tasks/common.py render_mc writes it, and
the prompt ends with the <|assistant_start|> that opens the answer (chat.render_prompt). nanochat's
answer is the letter whose token has the largest logit at that last position, among the question's
letters. Here the scorer that HellaSwag and CORE use decides (scorer.score_groups): a row per
letter, the prompt followed by the letter's token, that one token scored; the row of lowest loss
wins. The rows share the prompt, so their losses are one log-sum-exp less each letter's logit: the
lowest loss is the largest logit.

A task's accuracy comes with its standard error, and the tasks' accuracies centred on nanochat's
baseline of 0.25 are averaged (nanochat's ChatCORE rule, over these tasks only). The data is the
tasks' HF datasets (allenai/ai2_arc, cais/mmlu), downloaded once into a folder as JSONL with a
manifest of their SHA-256s, checked at every load. docs/evaluation.md ("The chat tasks") has the
rules, the files and the expected figures.

    python chat_eval.py --chat_eval_dir DIR     # the data only, on a machine with internet

Importing this downloads, spawns and opens nothing, and imports neither torch nor datasets.
"""

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from typing import NamedTuple

import chat
import core_eval
import fineweb
import scorer
from common import (OneLineParser, UsageError, atomic_write, did_you_mean, dir_lock,
                    hub_unreachable, make_dirs, one_line, run_cli)


class Spec(NamedTuple):
    """A chat task: its label here, nanochat's name for it, its HF dataset (name, config, split)
    and the number of rows that split has."""
    label: str
    name: str
    dataset: str
    config: str
    split: str
    rows: int


# nanochat's tasks and splits (scripts/chat_eval.py: ARC(subset, split="test"), MMLU(subset="all",
# split="test")), in its order; the row counts are the splits' sizes on the hub, which a download
# must match
TASKS = {s.label: s for s in (
    Spec("arc_easy", "ARC-Easy", "allenai/ai2_arc", "ARC-Easy", "test", 2376),
    Spec("arc_challenge", "ARC-Challenge", "allenai/ai2_arc", "ARC-Challenge", "test", 1172),
    Spec("mmlu", "MMLU", "cais/mmlu", "all", "test", 14042),
)}
GROUP, PREFIX = "chat", "chat:"  # --tasks chat: all of them; chat:LABEL: one
MMLU_LETTERS = ("A", "B", "C", "D")  # nanochat's MMLU.letters; ARC's come with each row
BASELINE = 0.25  # nanochat's baseline_accuracies for all three (ARC's 3- and 5-choice rows too)
SHUFFLE_SEED = 42  # nanochat: dataset.shuffle(seed=42), before --max_per_task takes the first N
DEFAULT_DIR = os.path.join(fineweb.REPO_DIR, "chat_eval_data")  # or $CHAT_EVAL_DIR
MANIFEST = "manifest.json"  # written after each file: a file it does not list was never had
LOCK = ".download.lock"
WAIT_FOR_DOWNLOAD = 3600  # seconds another process's download may take before we give up on it


class ChatEvalError(UsageError):
    """The chat tasks' data can't be had or read: one line naming the file (and line)."""


def data_dir(chat_eval_dir=None):
    """The data folder: --chat_eval_dir, $CHAT_EVAL_DIR, or chat_eval_data/ beside the scripts
    (the variable read at call time)."""
    return os.path.abspath(chat_eval_dir or os.environ.get("CHAT_EVAL_DIR") or DEFAULT_DIR)


def file_name(label):
    return f"{label}.jsonl"


# ===== --tasks ===================================================================================
def _items(spec):
    return [item.strip() for item in spec.split(",")]


def wanted(spec):
    """Whether --tasks names the chat tasks (chat, or any chat:LABEL); CORE's labels never do."""
    return any(item == GROUP or item.startswith(PREFIX) for item in _items(spec))


def select(spec):
    """The labels --tasks names: chat (all, in nanochat's order) or a comma list of chat:LABEL.
    A UsageError for anything else in it, with the nearest label to a typo."""
    items = _items(spec)
    if items == [GROUP]:
        return list(TASKS)
    chosen = []
    for item in items:
        if item == GROUP:
            raise UsageError("--tasks: chat is the group of all the chat tasks, not a label: give "
                             "it alone (--tasks chat), or name chat:LABEL items")
        if not item.startswith(PREFIX):
            raise UsageError(f"--tasks: {item!r} is not a chat task: the chat tasks run apart from "
                             f"HellaSwag and CORE's, give chat:LABEL items only (chat:"
                             f"{', chat:'.join(TASKS)})")
        label = item[len(PREFIX):]
        if label not in TASKS:
            hint = did_you_mean(label, TASKS, prefix=PREFIX)
            raise UsageError(f"--tasks: {item!r} is not a chat task{hint}; the chat tasks: chat "
                             f"(all), chat:{', chat:'.join(TASKS)}")
        if label in chosen:
            raise UsageError(f"--tasks: chat:{label} is given twice")
        chosen.append(label)
    return chosen


# ===== The questions =============================================================================
def render_mc(question, letters, choices):
    """The user's message: nanochat's tasks/common.py render_mc, character for character (each
    letter after its choice with no space, as the assistant's answer is the bare letter)."""
    query = f"Multiple Choice question: {question}\n"
    query += "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    query += "\nRespond only with the letter of the correct answer."
    return query


def letter_token(letter, enc):
    """The one token of a letter as the assistant writes it ("A", no space); None if it is not
    one token (nanochat asserts it is)."""
    ids = enc.encode_ordinary(letter)
    return ids[0] if len(ids) == 1 else None


def _is_strings(value, n=None):
    return (isinstance(value, list) and all(isinstance(v, str) for v in value)
            and (n is None or len(value) == n))


def question_of(label, rec, where, enc):
    """A row of a task's file as {"question", "letters", "choices", "gold"} (gold: a letter); a
    ChatEvalError naming where unless the row has the fields of its dataset: ARC's question,
    choices {text, label} and answerKey among the labels; MMLU's question, four choices and
    answer 0-3."""
    if not isinstance(rec, dict):
        raise ChatEvalError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if not isinstance(rec.get("question"), str):
        raise ChatEvalError(f"{where}: no 'question' string")
    if label == "mmlu":
        choices, answer = rec.get("choices"), rec.get("answer")
        if not _is_strings(choices, len(MMLU_LETTERS)):
            raise ChatEvalError(f"{where}: 'choices' must be a list of {len(MMLU_LETTERS)} "
                                f"strings")
        if type(answer) is not int or not 0 <= answer < len(MMLU_LETTERS):
            raise ChatEvalError(f"{where}: 'answer' {one_line(repr(answer), 40)} is not an "
                                f"index 0-{len(MMLU_LETTERS) - 1}")
        letters, gold = list(MMLU_LETTERS), MMLU_LETTERS[answer]
    else:
        c = rec.get("choices")
        choices = c.get("text") if isinstance(c, dict) else None
        letters = c.get("label") if isinstance(c, dict) else None
        if not _is_strings(choices) or not _is_strings(letters, len(choices)) or not choices:
            raise ChatEvalError(f"{where}: 'choices' must hold lists 'text' and 'label' of "
                                f"strings, as long as each other")
        if len(set(letters)) != len(letters):
            raise ChatEvalError(f"{where}: a choice label is given twice ({', '.join(letters)})")
        gold = rec.get("answerKey")
        if gold not in letters:
            raise ChatEvalError(f"{where}: answerKey {one_line(repr(gold), 40)} is not one of "
                                f"the labels {', '.join(letters)}")
    for letter in letters:
        if letter_token(letter, enc) is None:
            raise ChatEvalError(f"{where}: the label {one_line(repr(letter), 40)} is not one "
                                f"token: its logit can't be read")
    return {"question": rec["question"], "letters": letters, "choices": choices, "gold": gold}


def prompt_ids(q, enc):
    """A question's prompt: <|endoftext|>, the user's turn holding render_mc's message, then
    <|assistant_start|>."""
    message = render_mc(q["question"], q["letters"], q["choices"])
    return chat.render_prompt([{"role": "user", "content": message}], enc)


# ===== The data: downloaded once, checked at every load ==========================================
def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def _read_manifest(folder):
    """{label: entry} of folder's manifest ({} when there is none); one line if it is not one."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ChatEvalError(f"{path}: not a chat eval manifest ({one_line(e, 80)}); delete it "
                            f"to download the data again") from None
    if not isinstance(manifest, dict) or not all(isinstance(v, dict) for v in manifest.values()):
        raise ChatEvalError(f"{path}: not a chat eval manifest (a mapping of the tasks' entries);"
                            f" delete it to download the data again")
    return manifest


def _load_hf_rows(spec):
    """The rows of spec's split through HF datasets (which reads only its cache under
    HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1)."""
    import logging

    import datasets

    # the hub client's retry warnings stay out of the one line that says what went wrong
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return datasets.load_dataset(spec.dataset, spec.config, split=spec.split)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _unavailable(spec, folder, why):
    path = os.path.join(folder, file_name(spec.label))
    return ChatEvalError(
        f"chat eval data unavailable: {path} is missing and fetching HF {spec.dataset} "
        f"({spec.config}, {spec.split} split) failed ({why}); on a machine with internet run "
        f"`python chat_eval.py --chat_eval_dir DIR` and copy DIR's .jsonl files and {MANIFEST} "
        f"into {folder} (or give that folder with --chat_eval_dir or $CHAT_EVAL_DIR)")


def _write_rows(spec, rows, folder, enc):
    """rows as JSONL, checked as they are written (count and fields), then the file's manifest
    entry: both written atomically."""
    path = os.path.join(folder, file_name(spec.label))
    digest, count = hashlib.sha256(), 0

    def write(f):
        nonlocal count
        for row in rows:
            row = dict(row)
            question_of(spec.label, row, f"HF {spec.dataset} ({spec.config}) row {count}", enc)
            line = (json.dumps(row) + "\n").encode("utf-8")
            digest.update(line)
            f.write(line)
            count += 1
        if count != spec.rows:
            raise _unavailable(spec, folder, f"{count} rows, where its {spec.split} split has "
                                             f"{spec.rows}")
    atomic_write(path, write)
    manifest = _read_manifest(folder)
    manifest[spec.label] = {"file": file_name(spec.label), "sha256": digest.hexdigest(),
                            "rows": count, "dataset": spec.dataset, "config": spec.config,
                            "split": spec.split}
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    atomic_write(os.path.join(folder, MANIFEST), lambda f: f.write(data))


def _have(label, folder):
    """Whether folder holds label's file and its manifest entry (checked at load)."""
    return (label in _read_manifest(folder)
            and os.path.lexists(os.path.join(folder, file_name(label))))


class _Busy(Exception):
    """Another process holds the download lock."""


def download(label, chat_eval_dir=None, enc=None):
    """The path of label's file in the data folder, downloaded first if the folder lacks it or its
    manifest entry: the task's split through HF datasets, every row checked, the row count
    matched, then the file and the manifest written atomically. One process downloads into a
    folder at a time (common.dir_lock); another waits, then finds the file. A ChatEvalError (one
    line) when it can't be had; a folder this call made is removed again then."""
    spec, folder = TASKS[label], data_dir(chat_eval_dir)
    if os.path.isdir(folder) and _have(label, folder):
        return os.path.join(folder, file_name(label))
    if hub_unreachable():  # datasets' client would retry for half a minute before saying so
        raise _unavailable(spec, folder, "the hub is unreachable; HF_HUB_OFFLINE=1 reads a copy "
                                         "in the datasets cache")
    made = make_dirs(folder, "--chat_eval_dir", ChatEvalError)
    try:
        _download_waiting(spec, folder, enc or fineweb.get_encoding())
    except BaseException:
        if os.path.isdir(folder) and set(os.listdir(folder)) <= {LOCK}:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, LOCK))
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only if empty: what another process put there stays
        raise
    return os.path.join(folder, file_name(label))


def _download_waiting(spec, folder, enc):
    deadline, said = time.monotonic() + WAIT_FOR_DOWNLOAD, False
    while True:
        try:
            with dir_lock(folder, LOCK, "is being downloaded into by another process ({holder})",
                          error=_Busy):
                if not _have(spec.label, folder):
                    _fetch(spec, folder, enc)
                return
        except _Busy as e:
            if time.monotonic() > deadline:
                raise ChatEvalError(f"{e}: waited {WAIT_FOR_DOWNLOAD} s; stop it or wait") \
                    from None
            if not said:
                print(f"chat eval: {e}; waiting for it", flush=True)
                said = True
            time.sleep(0.5)


def _fetch(spec, folder, enc):
    try:
        rows = _load_hf_rows(spec)
    except Exception as e:  # offline with no cache, the hub down, datasets missing, ...
        why = f"{type(e).__name__}: {one_line(e, 120)}" if str(e).strip() else type(e).__name__
        raise _unavailable(spec, folder, why) from None
    # said once the rows are had: offline, the error is the one line
    print(f"chat eval: writing HF {spec.dataset} ({spec.config}, {spec.split} split) into "
          f"{os.path.join(folder, file_name(spec.label))}", file=sys.stderr, flush=True)
    try:
        _write_rows(spec, rows, folder, enc)
    except ChatEvalError:
        raise
    except OSError as e:  # a full disk, a read-only folder: nothing is left under the name
        raise _unavailable(spec, folder, one_line(e, 300)) from None


def ready_on_every_rank(proc, labels, chat_eval_dir=None):
    """The data folder, holding every label's file, on every rank: the master downloads what is
    missing, then the others find it. A failure is one line from the master; the other ranks
    stop with it."""
    def fetch_all():
        for label in labels:
            download(label, chat_eval_dir)
        return data_dir(chat_eval_dir)

    if proc is None or proc.world_size == 1:
        return fetch_all()
    folder, error = None, None
    for masters_turn in (True, False):
        if proc.master == masters_turn:
            try:
                folder = fetch_all()
            except UsageError as e:
                error = e
        if not proc.agree(error is None):
            raise error or ChatEvalError("the chat eval data could not be had on another rank")
    return folder


class Task:
    """A chat task's questions: (0-based line in its file, question_of's dict), in nanochat's
    order (the file's rows shuffled by seed 42) and cut to --max_per_task."""

    def __init__(self, spec, examples):
        self.spec, self.label, self.examples = spec, spec.label, examples
        self.file = file_name(spec.label)

    def __repr__(self):
        return f"Task({self.label}, n={len(self.examples)})"


def read_task(folder, label, enc):
    """label's rows from folder, the file checked against its manifest entry first (SHA-256 and
    row count; a changed file is one line saying to delete it), every row checked: (line,
    question) pairs in file order."""
    spec, path = TASKS[label], os.path.join(folder, file_name(label))
    entry = _read_manifest(folder).get(label)
    if entry is None:
        raise ChatEvalError(f"{path} is not listed in {os.path.join(folder, MANIFEST)}: delete "
                            f"it to download it again")
    source = {k: entry.get(k) for k in ("dataset", "config", "split")}
    if source != {"dataset": spec.dataset, "config": spec.config, "split": spec.split}:
        raise ChatEvalError(f"{os.path.join(folder, MANIFEST)}: {label} comes from "
                            f"{source}, not HF {spec.dataset} ({spec.config}, {spec.split} "
                            f"split); delete {path} to download it again")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ChatEvalError(f"{path}: cannot be read ({one_line(e, 100)}); delete it to "
                            f"download it again") from None
    if _sha256(data) != entry.get("sha256"):
        raise ChatEvalError(f"{path} changed since it was downloaded (SHA-256 {_sha256(data)}, "
                            f"not {entry.get('sha256')}); delete it to download it again")
    lines = data.split(b"\n")
    if lines[-1] == b"":  # the newline that ends the last line
        lines.pop()
    rows = []
    for line_no, line in enumerate(lines):
        where = f"{path}:{line_no + 1}"
        try:
            rec = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatEvalError(f"{where}: not a JSON line ({one_line(e, 80)})") from None
        rows.append((line_no, question_of(label, rec, where, enc)))
    if len(rows) != entry.get("rows"):
        raise ChatEvalError(f"{path}: {len(rows)} rows, where its manifest says "
                            f"{entry.get('rows')}; delete it to download it again")
    if not rows:
        raise ChatEvalError(f"{path}: no questions")
    return rows


def load_tasks(folder, labels, max_per_task=None, enc=None):
    """The tasks of labels from the data folder, each file checked. A task's questions are
    shuffled as nanochat's dataset.shuffle(seed=42) shuffles them (numpy's default_rng(42)
    permutation, which HF datasets' shuffle is), then cut to the first max_per_task."""
    import numpy as np

    enc = enc or fineweb.get_encoding()
    tasks = []
    for label in labels:
        rows = read_task(folder, label, enc)
        order = np.random.default_rng(SHUFFLE_SEED).permutation(len(rows))
        examples = [rows[int(k)] for k in order]
        if max_per_task is not None:
            examples = examples[:max_per_task]
        tasks.append(Task(TASKS[label], examples))
    return tasks


# ===== Scoring ===================================================================================
def score_task(model, task, device, positions, enc, *, batch_tokens=8192, autocast_dtype=None,
               device_type=None, desc=None, proc=None):
    """The results of the questions at positions (of the shuffled list) of task, one dict each:
    task, index (0-based line in its file), pred and gold (letters), correct, and cropped (the
    prompt was longer than the model's context and lost its start)."""
    context = scorer.max_positions(model)
    groups, cropped = [], []
    for i in positions:
        line, q = task.examples[i]
        prompt = prompt_ids(q, enc)
        where = f"{task.file}:{line + 1}"
        rows = []
        for letter in q["letters"]:
            # the letter's token follows <|assistant_start|> and is the row's one scored token:
            # its loss is read from the logits at the prompt's last position
            row = (prompt + [letter_token(letter, enc)], len(prompt), len(prompt) + 1)
            rows.append(scorer.Row(*core_eval.fit(row, context, where)))
        groups.append(rows)
        cropped.append(context is not None and len(prompt) + 1 > context)
    scored = scorer.score_groups(model, groups, device, batch_tokens=batch_tokens,
                                 autocast_dtype=autocast_dtype, device_type=device_type,
                                 desc=desc, proc=proc)
    out = []
    for i, rows, cut in zip(positions, scored, cropped):
        line, q = task.examples[i]
        pred = q["letters"][core_eval.lowest([s.mean_loss for s in rows])]  # first on ties
        out.append({"task": task.label, "index": line, "pred": pred, "gold": q["gold"],
                    "correct": pred == q["gold"], "cropped": cut})
    return out


def summarize(tasks, examples):
    """{"centered_mean", "centered_mean_se", "tasks": {label: {"accuracy", "accuracy_se",
    "centered", "centered_se", "n", "cropped"}}}: a task's accuracy p of n with sqrt(p (1 - p) /
    n); centred (p - 0.25) / 0.75, its SE that over 0.75; their mean over the tasks, whose SE is
    the root of the sum of the squared SEs over the number of tasks."""
    out = {}
    for task in tasks:
        mine = [e for e in examples if e["task"] == task.label]
        n = len(mine)
        acc = sum(e["correct"] for e in mine) / n
        se = math.sqrt(acc * (1 - acc) / n)
        out[task.label] = {"accuracy": acc, "accuracy_se": se,
                           "centered": (acc - BASELINE) / (1 - BASELINE),
                           "centered_se": se / (1 - BASELINE), "n": n,
                           "cropped": sum(e["cropped"] for e in mine)}
    mean = sum(t["centered"] for t in out.values()) / len(out)
    mean_se = math.sqrt(sum(t["centered_se"] ** 2 for t in out.values())) / len(out)
    return {"centered_mean": mean, "centered_mean_se": mean_se, "tasks": out}


def evaluate(model, device, tasks, *, batch_tokens=8192, autocast_dtype=None, device_type=None,
             proc=None, progress=False, enc=None):
    """The chat tasks of a chat model: summarize's dict plus "examples", every question's result
    ordered by task, then line. Question i of a task is scored on rank i % world size and the
    results are gathered on every rank, so 2 ranks give what 1 does."""
    enc = enc or fineweb.get_encoding()
    rank, world = 0, 1
    if proc is not None:
        rank, world = proc.rank, max(proc.world_size, 1)
    examples = []
    for task in tasks:
        desc = f"chat:{task.label}" if progress and rank == 0 else None
        examples += score_task(model, task, device, range(rank, len(task.examples), world), enc,
                               batch_tokens=batch_tokens, autocast_dtype=autocast_dtype,
                               device_type=device_type, desc=desc, proc=proc)
    order = {t.label: k for k, t in enumerate(tasks)}
    examples = sorted(scorer.gather(examples, proc), key=lambda e: (order[e["task"]], e["index"]))
    return {**summarize(tasks, examples), "examples": examples}


# ===== Reporting =================================================================================
def report(tasks, res, seconds, context=None):
    """The table the eval command prints: a row per task, then the centred mean with its SE."""
    lines = [f"{'task':18} {'n':>6} {'accuracy':>8} {'se':>6} {'centered':>8} {'se':>6}"]
    for task in tasks:
        t = res["tasks"][task.label]
        chance = " ~" if abs(t["centered"]) <= 2 * t["centered_se"] else ""
        lines.append(f"{'chat:' + task.label:18} {t['n']:6d} {t['accuracy']:8.4f} "
                     f"{t['accuracy_se']:6.4f} {t['centered']:8.4f} {t['centered_se']:6.4f}"
                     f"{chance}")
    lines.append(f"centered mean {res['centered_mean']:.4f} (se {res['centered_mean_se']:.4f}) "
                 f"over {len(tasks)} tasks, nanochat's ChatCORE rule (baseline {BASELINE}) "
                 f"[{seconds:.1f} s]; ~: centered within 2 standard errors of chance")
    cut = {label: t["cropped"] for label, t in res["tasks"].items() if t["cropped"]}
    if cut:
        lines.append(f"note: {sum(cut.values())} prompts longer than the model's context of "
                     f"{context} positions lost their start ("
                     + ", ".join(f"{label} {k}" for label, k in cut.items()) + ")")
    return "\n".join(lines)


def write_results(path, res):
    """--results: the summary as JSON, written atomically."""
    data = json.dumps({k: res[k] for k in ("centered_mean", "centered_mean_se", "tasks")},
                      indent=1) + "\n"
    atomic_write(path, lambda f: f.write(data.encode()))


def write_examples(path, res):
    """--examples: one JSON line per question, written atomically."""
    data = "".join(json.dumps(e) + "\n" for e in res["examples"])
    atomic_write(path, lambda f: f.write(data.encode()))


def run(args, labels, model, device, precision, proc, enc=None):
    """`eval --tasks chat...` once the model is loaded: a base model refused, the data had on
    every rank, the tasks scored, rank 0 reporting and writing --results and --examples. enc: the
    model's tokenizer's Encoding (None: GPT-2's)."""
    enc = enc or fineweb.get_encoding()
    if not chat.is_chat_model(getattr(model, "config", None), chat.tokens_of(enc)):
        name = args.checkpoint or args.init_from
        raise UsageError(f"{name} is a base model, not a chat model (its vocabulary has no "
                         f"special tokens): the chat tasks ask a model in its chat format; "
                         f"fine-tune it on conversations first (python train_gpt2.py sft "
                         f"--init_from ...)")
    folder = ready_on_every_rank(proc, labels, args.chat_eval_dir)
    tasks = load_tasks(folder, labels, args.max_per_task, enc)
    t0 = time.perf_counter()
    res = evaluate(model, device, tasks, batch_tokens=args.batch_tokens, proc=proc,
                   autocast_dtype=precision.dtype, progress=True, enc=enc)
    if proc is None or proc.master:
        print(report(tasks, res, time.perf_counter() - t0, scorer.max_positions(model)),
              flush=True)
        if args.results:
            write_results(args.results, res)
        if args.examples:
            write_examples(args.examples, res)
    return 0


# ===== CLI: the data alone =======================================================================
def build_parser():
    p = OneLineParser(prog="chat_eval.py",
                      description="Download the chat tasks' data (the test splits of HF "
                                  "allenai/ai2_arc's ARC-Easy and ARC-Challenge and cais/mmlu's "
                                  "all) into a folder, once; `python train_gpt2.py eval --tasks "
                                  "chat` reads it there")
    p.add_argument("--tasks", default=GROUP,
                   help="chat (all) or a comma list of chat:arc_easy, chat:arc_challenge, "
                        "chat:mmlu")
    p.add_argument("--chat_eval_dir", default=None,
                   help="the data folder (default: $CHAT_EVAL_DIR, or chat_eval_data/ beside "
                        "the scripts)")
    return p


def _download_all(args):
    if args.chat_eval_dir == "":
        raise UsageError("--chat_eval_dir is empty: give a path, or leave the flag out")
    for label in select(args.tasks):
        print(download(label, args.chat_eval_dir))
    return 0


def main(argv=None):
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_cli(_download_all, args)


if __name__ == "__main__":
    sys.exit(main())
