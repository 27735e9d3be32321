"""CORE: the 22 in-context tasks of the DCLM paper, scored as nanochat scores them.

Three kinds of task (docs/evaluation.md has the rules and the table):

- multiple_choice: one question, each choice a continuation of it; the choice whose tokens have
  the lowest mean loss is the answer;
- schema: each context option followed by the one continuation; the option whose continuation has
  the lowest mean loss is the answer;
- language_modeling: correct only if greedy decoding reproduces every continuation token.

A task's accuracy is centred on its random baseline b, (acc - b) / (1 - b), and CORE is the mean of
the centred accuracies. The data is nanochat's eval bundle (core.yaml, eval_meta_data.csv and
eval_data/**.jsonl in llm-foundry's ICL format), installed once into a data folder (install)
with each file's SHA-256 in a manifest, checked at every load (load_tasks).

Importing this downloads, spawns and opens nothing, and imports neither torch nor requests.
"""

import csv
import hashlib
import io
import json
import math
import os
import random
import shutil
import tempfile
import time
import zipfile

import fineweb
import scorer
from common import UsageError, atomic_write, dir_lock, one_line

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
DEFAULT_DIR = os.path.join(fineweb.REPO_DIR, "eval_bundle")  # or $EVAL_BUNDLE_DIR, --eval_dir
CONFIG, META, DATA = "core.yaml", "eval_meta_data.csv", "eval_data"
MANIFEST = "manifest.json"  # written last: an install without it never happened
LOCK = ".install.lock"
TASK_TYPES = {"multiple_choice": "MC", "schema": "schema", "language_modeling": "LM"}
SHUFFLE_SEED = 1337  # the order --max_per_task takes the first N of
FEWSHOT_SEED = 1234  # example i's few-shot examples: random.Random(FEWSHOT_SEED + i)
FEWSHOT_SEPARATOR = "\n\n"
CONNECT_TIMEOUT, READ_TIMEOUT = 5, 60  # seconds: an offline machine says so within seconds
WAIT_FOR_INSTALL = 3600  # seconds another process's install may take before we give up on it


class BundleError(UsageError):
    """The eval bundle can't be had or read: one line naming the file (and line)."""


def data_dir(eval_dir=None):
    """The folder the bundle is installed in: --eval_dir, $EVAL_BUNDLE_DIR, or eval_bundle/ beside
    the scripts (the variable read at call time)."""
    return eval_dir or os.environ.get("EVAL_BUNDLE_DIR") or DEFAULT_DIR


# ===== Reading a bundle: core.yaml, the baselines, the task files ================================
class Task:
    """One task of core.yaml: label, kind (multiple_choice, schema, language_modeling), shots, the
    continuation delimiter, its file, its random baseline (a fraction) and its examples as
    (0-based line in the file, record) pairs, in file order until load_tasks shuffles them."""

    def __init__(self, label, kind, shots, delimiter, uri, baseline):
        self.label, self.kind, self.shots, self.delimiter = label, kind, shots, delimiter
        self.uri, self.baseline, self.examples = uri, baseline, []

    def __repr__(self):
        return f"Task({self.label}, {self.kind}, {self.shots}-shot, n={len(self.examples)})"


def _read_config(folder, where):
    """The tasks of core.yaml (no examples yet), each checked: a UsageError naming the file."""
    import yaml

    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise BundleError(f"{where(CONFIG)} is missing: the bundle has no task list")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise BundleError(f"{where(CONFIG)}: not valid YAML ({one_line(e, 120)})") from None
    entries = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(entries, list) or not entries:
        raise BundleError(f"{where(CONFIG)}: no icl_tasks list")
    tasks, seen = [], set()
    for k, entry in enumerate(entries):
        tasks.append(_task_of(entry, k, where(CONFIG)))
        if tasks[-1].label in seen:
            raise BundleError(f"{where(CONFIG)}: task {tasks[-1].label} is listed twice")
        seen.add(tasks[-1].label)
    return tasks


def _task_of(entry, k, where):
    """A Task from core.yaml's k-th icl_tasks entry, its fields checked (baseline unset)."""
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: icl_tasks entry {k} is not a mapping")
    label = entry.get("label")
    if not isinstance(label, str) or not label:
        raise BundleError(f"{where}: icl_tasks entry {k} has no label")
    kind = entry.get("icl_task_type")
    if kind not in TASK_TYPES:
        raise BundleError(f"{where}: task {label} has the unknown type {kind!r} (known: "
                          f"{', '.join(TASK_TYPES)})")
    shots = entry.get("num_fewshot")
    if (not isinstance(shots, list) or not shots or type(shots[0]) is not int
            or shots[0] < 0):
        raise BundleError(f"{where}: task {label}: num_fewshot must be a list starting with a "
                          f"count of shots, not {one_line(repr(shots), 40)}")
    delimiter = entry.get("continuation_delimiter", " ")
    uri = entry.get("dataset_uri")
    if not isinstance(delimiter, str) or not isinstance(uri, str) or not uri:
        raise BundleError(f"{where}: task {label}: dataset_uri and continuation_delimiter must "
                          f"be strings")
    if os.path.isabs(uri) or ".." in uri.replace("\\", "/").split("/"):
        raise BundleError(f"{where}: task {label}: dataset_uri {uri} is outside {DATA}/")
    return Task(label, kind, shots[0], delimiter, uri, None)


def _read_baselines(folder, where):
    """{task label: random baseline in percent} from eval_meta_data.csv."""
    path = os.path.join(folder, META)
    if not os.path.isfile(path):
        raise BundleError(f"{where(META)} is missing: the bundle has no random baselines")
    baselines = {}
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if not {"Eval Task", "Random baseline"} <= set(reader.fieldnames or ()):
            raise BundleError(f"{where(META)}: no 'Eval Task' and 'Random baseline' columns")
        for row in reader:
            try:
                baselines[row["Eval Task"]] = float(row["Random baseline"])
            except (TypeError, ValueError):
                raise BundleError(f"{where(META)}:{reader.line_num}: the random baseline "
                                  f"{row['Random baseline']!r} is not a number") from None
    return baselines


def _is_text(value):
    """A field rendered into a prompt: a string (or a number, printed as str() prints it)."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _check_record(rec, kind, where):
    """A UsageError naming where (file:line) unless rec is a record of its task's kind."""
    if not isinstance(rec, dict):
        raise BundleError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if kind == "language_modeling":
        fields = {"context": _is_text, "continuation": _is_text}
        options = None
    elif kind == "multiple_choice":
        fields = {"query": _is_text, "choices": list, "gold": int}
        options = "choices"
    else:
        fields = {"context_options": list, "continuation": _is_text, "gold": int}
        options = "context_options"
    for name, check in fields.items():
        if name not in rec:
            raise BundleError(f"{where}: missing field {name!r}")
        if check is _is_text:
            ok = _is_text(rec[name])
        else:
            ok = isinstance(rec[name], check) and not isinstance(rec[name], bool)
        if not ok:
            raise BundleError(f"{where}: field {name!r} is {type(rec[name]).__name__}")
    if options is None:
        return
    opts = rec[options]
    if not opts or not all(_is_text(o) for o in opts):
        raise BundleError(f"{where}: {options!r} must be a non-empty list of strings")
    if not 0 <= rec["gold"] < len(opts):
        raise BundleError(f"{where}: gold {rec['gold']} is outside the {len(opts)} {options}")


def _read_examples(task, folder, where):
    """task.examples from its file: (0-based line, record), every line checked."""
    rel = f"{DATA}/{task.uri}"
    path = os.path.join(folder, DATA, task.uri)
    if not os.path.isfile(path):
        raise BundleError(f"{where(rel)} is missing: the file of task {task.label}")
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise BundleError(f"{where(rel)}:{line_no + 1}: not valid JSON ({e.msg} at "
                                  f"column {e.colno})") from None
            _check_record(rec, task.kind, f"{where(rel)}:{line_no + 1}")
            examples.append((line_no, rec))
    if len(examples) < task.shots + 1:
        raise BundleError(f"{where(rel)}: task {task.label} has {len(examples)} examples, fewer "
                          f"than its {task.shots} shots + 1")
    task.examples = examples
    return task


def read_bundle(folder, where=None, labels=None):
    """The tasks of the bundle in folder (core.yaml order, or those of labels), their baselines
    and examples read and checked. where(relative path) names a file in errors."""
    if where is None:
        def where(rel):
            return os.path.join(folder, rel)
    tasks = _read_config(folder, where)
    baselines = _read_baselines(folder, where)
    if labels is not None:
        by_label = {t.label: t for t in tasks}
        tasks = [by_label[label] for label in labels]
    for task in tasks:
        if task.label not in baselines:
            raise BundleError(f"{where(META)}: no random baseline for task {task.label}")
        task.baseline = baselines[task.label] / 100
        _read_examples(task, folder, where)
    return tasks


# ===== Installing: download or copy, unpack, check, hash, then the manifest ======================
def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _bundle_root(names, source):
    """The prefix of the bundle's files among an archive's or folder's names: "" when core.yaml is
    at the top, "eval_bundle/" (or another one folder) when it is one level down."""
    if CONFIG in names:
        return ""
    tops = sorted(n[: -len(CONFIG)] for n in names
                  if n.endswith("/" + CONFIG) and n.count("/") == 1)
    if not tops:
        raise BundleError(f"{source}: no {CONFIG} in it (at its top or one folder down): not "
                          f"an eval bundle")
    return tops[0]


def _unzip(zip_path, source, staging):
    """The bundle's files of the zip at zip_path into staging."""
    try:
        with zipfile.ZipFile(zip_path) as z:
            members = [m for m in z.infolist() if not m.is_dir()]
            root = _bundle_root({m.filename for m in members}, source)
            for m in members:
                name = m.filename
                parts = name.split("/")
                if not name.startswith(root) or "__MACOSX" in parts:
                    continue
                if name.startswith("/") or ".." in parts:
                    raise BundleError(f"{source}: member {name} points outside the bundle")
                out = os.path.join(staging, *name[len(root):].split("/"))
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(m) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise BundleError(f"{source}: not a readable zip file ({one_line(e, 100)})") from None


def _copy_dir(folder, staging):
    """The bundle's files under folder (core.yaml at its top or one folder down) into staging."""
    names = set()
    for top, _, files in os.walk(folder):
        for name in files:
            names.add(os.path.relpath(os.path.join(top, name), folder).replace(os.sep, "/"))
    root = _bundle_root(names, folder)
    for name in sorted(names):
        parts = name.split("/")
        if not name.startswith(root) or name.endswith(".tmp") or parts[-1] in (
                MANIFEST, LOCK, LOCK + ".holder"):
            continue
        out = os.path.join(staging, *name[len(root):].split("/"))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        shutil.copyfile(os.path.join(folder, *parts), out)


def _download(url, path):
    """url's body into path; a one-line BundleError when it can't be had."""
    import requests

    hint = (f"give a local copy: fetch {url} on a machine with internet and pass the .zip (or "
            f"the folder it unpacks to) with --eval_bundle PATH")
    print(f"core: downloading the eval bundle from {url}", flush=True)
    try:
        with requests.get(url, stream=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)) as r:
            if r.status_code != 200:
                raise BundleError(f"cannot download the CORE eval bundle: {url} answered HTTP "
                                  f"{r.status_code}; {hint}")
            expected = r.headers.get("Content-Length")
            got = 0
            with open(path, "wb") as f:
                for chunk in r.iter_content(1 << 20):
                    f.write(chunk)
                    got += len(chunk)
    except requests.RequestException as e:
        raise BundleError(f"cannot download the CORE eval bundle from {url} ({one_line(e, 120)});"
                          f" {hint}") from None
    if expected is not None and expected.isdigit() and int(expected) != got:
        raise BundleError(f"the download of {url} stopped after {got} of {expected} bytes; run "
                          f"again, or {hint}")


def _stage(source, staging):
    """The bundle of source (a URL, a .zip or a folder) unpacked into staging."""
    if source.startswith(("http://", "https://")):
        fd, zip_path = tempfile.mkstemp(suffix=".zip.tmp", dir=os.path.dirname(staging))
        os.close(fd)
        try:
            _download(source, zip_path)
            _unzip(zip_path, source, staging)
        finally:
            os.remove(zip_path)
    elif os.path.isdir(source):
        _copy_dir(source, staging)
    elif os.path.isfile(source):
        _unzip(source, source, staging)
    else:
        raise BundleError(f"--eval_bundle {source}: no such file or folder (give a .zip, the "
                          f"folder it unpacks to, or an http(s) URL)")


def _source_of(source):
    """The source as the manifest records it: a URL as is, a path made absolute."""
    if source.startswith(("http://", "https://")):
        return source
    return os.path.abspath(source)


def _install_locked(source, folder):
    """Install source into folder, which this process has locked and which holds no manifest."""
    for name in os.listdir(folder):  # an interrupted install's leftovers: never complete
        path = os.path.join(folder, name)
        if name.startswith(".staging.") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".zip.tmp"):
            os.remove(path)
    staging = tempfile.mkdtemp(prefix=".staging.", suffix=".tmp", dir=folder)
    moved = []
    try:
        _stage(source, staging)
        read_bundle(staging, where=lambda rel: f"{source}: {rel}")  # every task, every line
        files = {}
        for top, _, names in os.walk(staging):
            for name in names:
                full = os.path.join(top, name)
                files[os.path.relpath(full, staging).replace(os.sep, "/")] = _sha256(full)
        for name in sorted(os.listdir(staging)):  # the bundle's entries into place, then the
            target = os.path.join(folder, name)  # manifest that makes them an install
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
            moved.append(target)
        manifest = {"source": _source_of(source), "sha256": dict(sorted(files.items()))}
        data = (json.dumps(manifest, indent=1) + "\n").encode()
        atomic_write(os.path.join(folder, MANIFEST), lambda f: f.write(data))
    except BaseException:
        for target in moved:  # nothing half-installed stays: no manifest, no files
            if os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            elif os.path.exists(target):
                os.remove(target)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _Busy(Exception):
    """Another process holds the install lock."""


def install(source=None, eval_dir=None):
    """The folder holding the installed bundle, installing it first if it is not there: from
    source (a URL, a .zip or an unpacked folder; None: nanochat's URL). One process installs
    (common.dir_lock); another waits for it, then finds the install done. A bundle installed from
    another source than one given here is refused (one line). Returns the folder."""
    folder = os.path.abspath(data_dir(eval_dir))
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest):
        made = not os.path.isdir(folder)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise BundleError(f"--eval_dir {folder}: cannot create it ({one_line(e, 100)})") \
                from None
        try:
            _install_waiting(source or BUNDLE_URL, folder)
        except BaseException:
            if made and set(os.listdir(folder)) <= {LOCK, LOCK + ".holder"}:
                shutil.rmtree(folder, ignore_errors=True)
            raise
    if source is not None:
        recorded = _read_manifest(folder).get("source")
        if recorded != _source_of(source):
            raise BundleError(f"{folder} holds the eval bundle of {recorded}, not of {source}: "
                              f"give another --eval_dir, or delete {folder} to install this one")
    return folder


def _install_waiting(source, folder):
    """Install under the lock, or wait while another process installs into folder."""
    deadline, said = time.monotonic() + WAIT_FOR_INSTALL, False
    busy = "is being installed into by another process ({holder})"
    while True:
        try:
            with dir_lock(folder, LOCK, busy, error=_Busy):
                if not os.path.isfile(os.path.join(folder, MANIFEST)):
                    _install_locked(source, folder)
                return
        except _Busy as e:
            if time.monotonic() > deadline:
                raise BundleError(f"{e}: waited {WAIT_FOR_INSTALL} s; stop it or wait") from None
            if not said:
                print(f"core: {e}; waiting for it", flush=True)
                said = True
            time.sleep(0.5)


def _read_manifest(folder):
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["sha256"]
        if not isinstance(files, dict):
            raise TypeError("sha256 is not a mapping")
    except FileNotFoundError:
        raise BundleError(f"{folder} holds no installed eval bundle ({MANIFEST} is missing)") \
            from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{path}: not a bundle manifest ({one_line(e, 80)}); delete {folder} "
                          f"to install again") from None
    return manifest


_VERIFIED = {}  # path: (size, mtime_ns, sha256) of a file hashed once by this process


def verify(folder):
    """A one-line BundleError naming the first file of the manifest that is missing or changed
    since the install (by SHA-256; a file whose size and mtime this process has seen match is not
    hashed again)."""
    for rel, want in _read_manifest(folder)["sha256"].items():
        path = os.path.join(folder, *rel.split("/"))
        try:
            st = os.stat(path)
        except OSError:
            raise BundleError(f"{path} is missing from the installed eval bundle; delete "
                              f"{folder} to install it again") from None
        seen = _VERIFIED.get(path)
        if seen is not None and seen[:2] == (st.st_size, st.st_mtime_ns) and seen[2] == want:
            continue
        got = _sha256(path)
        if got != want:
            raise BundleError(f"{path} changed since the eval bundle was installed (SHA-256 {got}"
                              f", not {want}); delete {folder} to install it again")
        _VERIFIED[path] = (st.st_size, st.st_mtime_ns, got)


def ready_on_every_rank(proc, source=None, eval_dir=None):
    """The installed bundle's folder on every rank: the master installs (or checks) it, then the
    others find it. A failure is one line from the master; the other ranks stop with it."""
    if proc is None or proc.world_size == 1:
        return install(source, eval_dir)
    folder, error = None, None
    for masters_turn in (True, False):
        if proc.master == masters_turn:
            try:
                folder = install(source, eval_dir)
            except UsageError as e:
                error = e
        if not proc.agree(error is None):
            raise error or BundleError("the eval bundle could not be installed on another rank")
    return folder


# ===== Choosing tasks and examples ================================================================
def task_labels(folder):
    """The labels of core.yaml in the installed bundle, in its order."""
    return [t.label for t in _read_config(folder, lambda rel: os.path.join(folder, rel))]


def select(spec, labels):
    """The labels a --tasks of comma-separated bundle labels names, or 'core' (them all). A label
    may be written core:LABEL (the bundle's hellaswag alone: core:hellaswag). An unknown one is a
    UsageError with the nearest label."""
    import difflib

    if spec == "core":
        return list(labels)
    chosen = []
    for item in spec.split(","):
        label = item.strip()
        if label.startswith("core:"):
            label = label[len("core:"):]
        if label not in labels:
            near = difflib.get_close_matches(label, list(labels) + ["core"], n=1, cutoff=0.5)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UsageError(f"--tasks: {label!r} is not a task of core.yaml{hint}; the tasks: "
                             f"core (all), {', '.join(labels)}")
        if label in chosen:
            raise UsageError(f"--tasks: {label} is given twice")
        chosen.append(label)
    return chosen


def load_tasks(folder, labels=None, max_per_task=None):
    """The tasks of labels (None: all of core.yaml) from the installed bundle in folder, its files
    checked against the manifest first. Each task's examples are shuffled by
    random.Random(SHUFFLE_SEED), then cut to the first max_per_task: nanochat's subsample."""
    verify(folder)
    tasks = read_bundle(folder, labels=labels)
    for task in tasks:
        random.Random(SHUFFLE_SEED).shuffle(task.examples)
        if max_per_task is not None:
            task.examples = task.examples[:max_per_task]
        if len(task.examples) < task.shots + 1:
            raise UsageError(f"--max_per_task {max_per_task} leaves task {task.label} "
                             f"{len(task.examples)} examples, fewer than its {task.shots} shots "
                             f"+ 1: give at least {task.shots + 1}")
    return tasks


# ===== Prompts and rows ==========================================================================
def fewshot(task, i):
    """The records of example i's few-shot examples: random.Random(FEWSHOT_SEED + i) samples
    task.shots of the other positions of the (shuffled, subsampled) list."""
    if task.shots == 0:
        return []
    # sample() picks by index alone, so drawing from range(n - 1) and stepping over i draws what
    # drawing from the list of the other positions does, without building that list per example
    picks = random.Random(FEWSHOT_SEED + i).sample(range(len(task.examples) - 1), task.shots)
    return [task.examples[j if j < i else j + 1][1] for j in picks]


def prompts(task, i):
    """Example i's prompts as text. multiple_choice: one per choice; schema: one per context
    option; language_modeling: (without the continuation, with it). Few-shot blocks each end
    with a blank line; an LM context is stripped, as is the LM prompt without its continuation."""
    rec, d = task.examples[i][1], task.delimiter
    shots = fewshot(task, i)
    if task.kind == "multiple_choice":
        head = "".join(f"{ex['query']}{d}{ex['choices'][ex['gold']]}{FEWSHOT_SEPARATOR}"
                       for ex in shots)
        return [f"{head}{rec['query']}{d}{choice}" for choice in rec["choices"]]
    if task.kind == "schema":
        head = "".join(f"{ex['context_options'][ex['gold']]}{d}{ex['continuation']}"
                       f"{FEWSHOT_SEPARATOR}" for ex in shots)
        return [f"{head}{option}{d}{rec['continuation']}" for option in rec["context_options"]]
    head = "".join(f"{str(ex['context']).strip()}{d}{ex['continuation']}{FEWSHOT_SEPARATOR}"
                   for ex in shots)
    without = f"{head}{str(rec['context']).strip()}{d}"
    return [without.strip(), f"{without}{rec['continuation']}"]


def _common_length(seqs, from_end=False):
    """The length of the token prefix (or suffix) every sequence of seqs shares."""
    n = min(len(s) for s in seqs)
    for k in range(n):
        at = -1 - k if from_end else k
        if any(s[at] != seqs[0][at] for s in seqs):
            return k
    return n


def spans(task, i, enc):
    """Example i's token rows as (tokens, start, end): <|endoftext|> first, tokens[start:end]
    scored. multiple_choice: what follows the choices' common token prefix; schema: their common
    token suffix; language_modeling: one row, the tokens of the prompt with the continuation past
    those of the prompt without it."""
    texts = prompts(task, i)
    seqs = [[fineweb.EOT] + enc.encode(t, allowed_special="all") for t in texts]
    if task.kind == "multiple_choice":
        start = _common_length(seqs)
        return [(s, start, len(s)) for s in seqs]
    if task.kind == "schema":
        suffix = _common_length(seqs, from_end=True)
        return [(s, len(s) - suffix, len(s)) for s in seqs]
    without, with_ = seqs
    if len(without) >= len(with_) or with_[: len(without)] != without:
        line = task.examples[i][0] + 1
        raise BundleError(f"{DATA}/{task.uri}:{line}: the tokens of the prompt without its "
                          f"continuation are not a prefix of those with it")
    return [(with_, len(without), len(with_))]


def fit(row, context, where):
    """A row cropped from the left to the model's context, start and end shifted with it; a
    UsageError when the scored tokens themselves do not fit."""
    tokens, start, end = row
    crop = 0
    if context is not None:  # None: a model that does not say (scorer.max_positions)
        crop = len(tokens) - context
    if crop <= 0:
        return row
    if start - crop < 1:
        raise UsageError(f"{where}: its {end - start} scored tokens and the one before them do "
                         f"not fit the model's context of {context} positions")
    return tokens[crop:], start - crop, end - crop


# ===== Scoring ===================================================================================
def lowest(means):
    """The first option of lowest mean loss, as Python's min() then list.index() pick it: an option
    with no scored token (None) is never chosen, unless it is the first (min() keeps its nan)."""
    best = 0
    for k in range(1, len(means)):
        if means[best] is not None and means[k] is not None and means[k] < means[best]:
            best = k
    return best


def _judge(task, i, scored):
    """Example i's result from its rows and their scores (None for a row with no scored token)."""
    line, rec = task.examples[i]
    if task.kind == "language_modeling":
        return {"task": task.label, "index": line, "pred": None, "gold": None,
                "correct": bool(scored[0].greedy)}
    means = [None if s is None else s.mean_loss for s in scored]
    pred = lowest(means)
    return {"task": task.label, "index": line, "pred": pred, "gold": rec["gold"],
            "correct": pred == rec["gold"]}


def score_task(model, task, device, positions, enc, *, batch_tokens=8192, autocast_dtype=None,
               device_type=None, desc=None, proc=None):
    """The results of the examples at positions (of the shuffled list) of task, one dict each:
    task, index (0-based line in its file), pred (the chosen option; None for LM), gold (None for
    LM) and correct."""
    context = scorer.max_positions(model)
    groups, kept = [], []
    for i in positions:
        where = f"{DATA}/{task.uri}:{task.examples[i][0] + 1}"
        rows = [fit(r, context, where) for r in spans(task, i, enc)]
        keep = [k for k, (_, start, end) in enumerate(rows) if start < end]
        groups.append([scorer.Row(*rows[k]) for k in keep])
        kept.append((len(rows), keep))
    nonempty = [g for g in groups if g]
    results = iter(scorer.score_groups(model, nonempty, device, batch_tokens=batch_tokens,
                                       autocast_dtype=autocast_dtype, device_type=device_type,
                                       desc=desc, proc=proc))
    out = []
    for i, group, (n_rows, keep) in zip(positions, groups, kept):
        scored = [None] * n_rows
        if group:
            for k, s in zip(keep, next(results)):
                scored[k] = s
        out.append(_judge(task, i, scored))
    return out


def _gather(examples, proc):
    """Every rank's example results on every rank (all_gather_object), ordered by task then by
    line: the same list for any number of ranks."""
    if proc is not None and proc.world_size > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            parts = [None] * proc.world_size
            dist.all_gather_object(parts, examples)
            examples = [e for part in parts for e in part]
    return examples


def summarize(tasks, examples):
    """{"core", "core_se", "tasks": {label: {"accuracy", "centered", "n", "se"}}} from the
    example results: se is the centred accuracy's standard error, sqrt(p (1 - p) / n) / (1 - b);
    CORE's the root of the sum of their squares over the number of tasks."""
    out = {}
    for task in tasks:
        mine = [e for e in examples if e["task"] == task.label]
        n = len(mine)
        acc = sum(e["correct"] for e in mine) / n
        b = task.baseline
        out[task.label] = {"accuracy": acc, "centered": (acc - b) / (1 - b), "n": n,
                           "se": math.sqrt(acc * (1 - acc) / n) / (1 - b)}
    core = sum(t["centered"] for t in out.values()) / len(out)
    core_se = math.sqrt(sum(t["se"] ** 2 for t in out.values())) / len(out)
    return {"core": core, "core_se": core_se, "tasks": out}


def evaluate(model, device, tasks, *, batch_tokens=8192, autocast_dtype=None, device_type=None,
             proc=None, progress=False, enc=None):
    """CORE of model over tasks (load_tasks): summarize's dict plus "examples", every example's
    result ordered by task then line. Example i of a task is scored on rank i % world_size; the
    results are gathered on every rank, so 2 ranks give what 1 does."""
    enc = enc or fineweb.get_encoding()
    rank, world = 0, 1
    if proc is not None:
        rank, world = proc.rank, max(proc.world_size, 1)
    examples = []
    for task in tasks:
        desc = task.label if progress and rank == 0 else None
        examples += score_task(model, task, device, range(rank, len(task.examples), world), enc,
                               batch_tokens=batch_tokens, autocast_dtype=autocast_dtype,
                               device_type=device_type, desc=desc, proc=proc)
    order = {t.label: k for k, t in enumerate(tasks)}
    examples = sorted(_gather(examples, proc), key=lambda e: (order[e["task"]], e["index"]))
    return {**summarize(tasks, examples), "examples": examples}


# ===== Reporting =================================================================================
def report(tasks, res, seconds):
    """The table the eval command prints: a row per task, then CORE with its standard error."""
    lines = [f"{'task':34} {'type':6} {'shots':>5} {'n':>6} {'accuracy':>8} {'centered':>8} "
             f"{'se':>6}"]
    for task in tasks:
        t = res["tasks"][task.label]
        chance = " ~" if abs(t["centered"]) <= 2 * t["se"] else ""
        lines.append(f"{task.label:34} {TASK_TYPES[task.kind]:6} {task.shots:5d} {t['n']:6d} "
                     f"{t['accuracy']:8.4f} {t['centered']:8.4f} {t['se']:6.4f}{chance}")
    lines.append(f"CORE {res['core']:.4f} (se {res['core_se']:.4f}) over {len(tasks)} tasks "
                 f"[{seconds:.1f} s]; ~: centered within 2 standard errors of chance")
    return "\n".join(lines)


def write_results(path, res):
    """--results: the summary as JSON, written atomically."""
    data = json.dumps({k: res[k] for k in ("core", "core_se", "tasks")}, indent=1) + "\n"
    atomic_write(path, lambda f: f.write(data.encode()))


def write_examples(path, res):
    """--examples: one JSON line per example, written atomically."""
    buf = io.StringIO()
    for e in res["examples"]:
        buf.write(json.dumps(e) + "\n")
    atomic_write(path, lambda f: f.write(buf.getvalue().encode()))
