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

import array
import contextlib
import csv
import io
import itertools
import json
import math
import os
import random
import shutil
import stat
import tempfile
import time
import zipfile
import zlib

import fineweb
import scorer
from common import (UsageError, atomic_write, did_you_mean, dir_lock, make_dirs, one_line,
                    sha256_file, stops_raise)

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
# The bounds of an install (docs/evaluation.md): a hostile or broken source ends in one line, not
# in a full disk or a download that never ends. nanochat's bundle is far inside every one of them.
DOWNLOAD_TIMEOUT = 1800  # seconds a download may take in all (--download_timeout)
MAX_BUNDLE_MB = 2048  # MiB a download may send, and the bundle's files may unpack to (in all)
MAX_RATIO = 100  # a zip member may unpack to 100x its packed size (text deflates 3-10x)
MAX_FILES = 10_000  # files in a bundle (nanochat's has a few dozen)
MAX_LINE = 16 << 20  # bytes in a task file's line; core.yaml and the CSV whole


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
        self.rendered = None  # (tokenizer, context, examples, {i: rows}): see rendered_rows

    def __repr__(self):
        return f"Task({self.label}, {self.kind}, {self.shots}-shot, n={len(self.examples)})"


def _read_config(folder, where):
    """The tasks of core.yaml (no examples yet), each checked: a UsageError naming the file."""
    import yaml

    text = _small_text(folder, CONFIG, where, "the bundle has no task list")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
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


def _small_text(folder, rel, where, what):
    """The text of core.yaml or the CSV: a regular file of at most MAX_LINE bytes, UTF-8."""
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        raise BundleError(f"{where(rel)} is missing: {what}")
    with open(path, "rb") as f:
        data = f.read(MAX_LINE + 1)
    if len(data) > MAX_LINE:
        raise BundleError(f"{where(rel)}: larger than {MAX_LINE:,} bytes: not a bundle's file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError(f"{where(rel)}: not UTF-8 text (byte {e.start})") from None


def _read_baselines(folder, where):
    """{task label: random baseline in percent} from eval_meta_data.csv; each finite, in [0, 100)
    (a baseline of 100 leaves no room above chance to centre on)."""
    text = _small_text(folder, META, where, "the bundle has no random baselines")
    baselines = {}
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        if not {"Eval Task", "Random baseline"} <= set(reader.fieldnames or ()):
            raise BundleError(f"{where(META)}: no 'Eval Task' and 'Random baseline' columns")
        for row in reader:
            value = row["Random baseline"]
            try:
                baseline = float(value)
            except (TypeError, ValueError):
                baseline = None
            if baseline is None or not 0 <= baseline < 100:  # nan and inf fail this too
                raise BundleError(f"{where(META)}:{reader.line_num}: the random baseline "
                                  f"{one_line(repr(value), 40)} is not a percentage in [0, 100)")
            baselines[row["Eval Task"]] = baseline
    except csv.Error as e:  # a field over csv's limit, a NUL byte
        raise BundleError(f"{where(META)}:{reader.reader.line_num}: not a readable CSV row "
                          f"({one_line(e, 80)})") from None
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
    for line_no, line in _lines(path, where(rel)):
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


def _lines(path, where):
    """(0-based line number, text) of each line of a task file: UTF-8, at most MAX_LINE bytes a
    line (a file with no newline is not read whole into memory)."""
    with open(path, "rb") as f:
        for line_no in itertools.count():
            line = f.readline(MAX_LINE + 1)
            if not line:
                return
            if len(line) > MAX_LINE:
                raise BundleError(f"{where}:{line_no + 1}: a line longer than {MAX_LINE:,} "
                                  f"bytes: not a task file")
            try:
                yield line_no, line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BundleError(f"{where}:{line_no + 1}: not UTF-8 text (byte {e.start} of "
                                  f"the line)") from None


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


META_HEADER = ("Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,"
               "Centered Metric?,Description")


def write_bundle(folder, tasks):
    """The layout read_bundle reads, written into folder: core.yaml, eval_meta_data.csv (with
    the real bundle's columns) and eval_data/<category>/<label>.jsonl. tasks: dicts of label,
    kind (icl_task_type), shots, delimiter (None: core.yaml's default, left out), baseline (in
    percent), records (written a JSON line each) and category. The one writer of the layout, for
    the made-up bundles of bench.py and the tests. Returns folder."""
    config, meta = ["icl_tasks:"], [META_HEADER]
    for t in tasks:
        uri = f"{t['category']}/{t['label']}.jsonl"
        config += [f"- label: {t['label']}", f"  dataset_uri: {uri}",
                   f"  num_fewshot: [{t['shots']}]", f"  icl_task_type: {t['kind']}"]
        if t.get("delimiter") is not None:
            config.append(f"  continuation_delimiter: {json.dumps(t['delimiter'])}")
        meta.append(f"{t['label']},{t['category']},{t['kind']},{t['shots']},{len(t['records'])},"
                    f"{t['baseline']},,\"made up\"")
        path = os.path.join(folder, DATA, uri)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in t["records"])
    for name, lines in ((CONFIG, config), (META, meta)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return folder


# ===== Installing: download or copy, unpack, check, hash, then the manifest ======================
# An install writes only into a folder it owns: a new or empty one, or one whose manifest says it
# holds our install. Its partial files are one staging folder named STAGING...tmp (the download
# inside it); the bundle's entries move out of it only once every file is checked, listed first
# in JOURNAL, so that a killed install's entries are known as ours and taken away by the next.
STAGING = ".core_eval-install-"
JOURNAL = ".core_eval-moving.json"
BUNDLE_ENTRIES = (CONFIG, META, DATA)  # what an install puts in its folder, besides the manifest
OURS = (MANIFEST, LOCK, LOCK + ".holder", JOURNAL)
KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a device",
         stat.S_IFBLK: "a device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


class _Budget:
    """The bytes a download, or the bundle's unpacked files, may still take (--max_bundle_mb)."""

    def __init__(self, max_mb):
        self.max_mb, self.left = max_mb, max_mb << 20

    def take(self, n, what):
        self.left -= n
        if self.left < 0:
            raise BundleError(f"{what}: more than {self.max_mb} MiB (--max_bundle_mb): not "
                              f"nanochat's eval bundle; give a larger --max_bundle_mb if it is "
                              f"meant")


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


def _bundle_entry(name, root, source):
    """The parts of name's path inside the bundle when it is one of the bundle's files (core.yaml,
    eval_meta_data.csv, eval_data/...), else None: anything else a source holds is not copied (a
    manifest.json of its own, a script)."""
    if not name.startswith(root):
        return None
    parts = name[len(root):].split("/")
    if "__MACOSX" in parts or parts[0] not in BUNDLE_ENTRIES:
        return None
    if parts[0] == DATA and len(parts) == 1:  # a file where the task files' folder should be
        return None
    if parts[0] != DATA and len(parts) > 1:
        return None
    if any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise BundleError(f"{source}: {name} points outside the bundle")
    return parts


def _kind(mode):
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _staged_file(staged, parts, what):
    """A new file at staged/parts, open for writing."""
    out = os.path.join(staged, *parts)
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        return open(out, "xb")
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        raise BundleError(f"{what}: given twice, or both as a file and a folder") from None


def _copy(src, dst, budget, what, cap=None):
    """src's bytes into dst, each taken from budget; more than cap bytes is refused."""
    n = 0
    for block in iter(lambda: src.read(1 << 20), b""):
        n += len(block)
        budget.take(len(block), what)
        if cap is not None and n > cap:
            raise BundleError(f"{what} unpacks to over {MAX_RATIO}x its packed size: a zip "
                              f"bomb, not an eval bundle")
        dst.write(block)


# what a damaged or unsupported member raises (bz2's corrupt data: an OSError without errno)
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, NotImplementedError)
with contextlib.suppress(ImportError):  # a Python built without lzma cannot open such members
    import lzma
    ZIP_ERRORS += (lzma.LZMAError,)


def _unzip(zip_path, source, staged, budget):
    """The bundle's files of the zip at zip_path into staged: regular, unencrypted files only,
    each within MAX_RATIO of its packed size, all within budget."""
    try:
        z = zipfile.ZipFile(zip_path)
    except ZIP_ERRORS + (OSError,) as e:
        raise BundleError(f"{source}: not a readable zip file ({one_line(e, 100)})") from None
    with z:
        members = [m for m in z.infolist() if not m.is_dir()]
        if len(members) > MAX_FILES:
            raise BundleError(f"{source}: {len(members)} files, more than a bundle's "
                              f"{MAX_FILES}: not an eval bundle")
        root = _bundle_root({m.filename for m in members}, source)
        for m in members:
            parts = _bundle_entry(m.filename, root, source)
            if parts is None:
                continue
            what = f"{source}: {m.filename}"
            mode = m.external_attr >> 16
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG):  # 0: an archiver that keeps no modes
                raise BundleError(f"{what} is {_kind(mode)}: a bundle holds regular files only")
            if m.flag_bits & 0x1:
                raise BundleError(f"{what} is encrypted: a bundle's files are not")
            with _staged_file(staged, parts, what) as dst:
                try:
                    with z.open(m) as src:
                        _copy(src, dst, budget, what, cap=max(MAX_RATIO * m.compress_size, 1 << 20))
                except ZIP_ERRORS as e:
                    raise BundleError(f"{what}: cannot be unpacked ({one_line(e, 100)})") from None
                except OSError as e:
                    if e.errno is not None:  # the machine's: a full disk
                        raise
                    raise BundleError(f"{what}: cannot be unpacked ({one_line(e, 100)})") \
                        from None


def _copy_dir(folder, staged, budget):
    """The bundle's files under folder (core.yaml at its top or one folder down) into staged:
    regular files only (a link, device or FIFO is refused, never followed), all within budget."""
    modes = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(top, name)
            modes[os.path.relpath(path, folder).replace(os.sep, "/")] = os.lstat(path).st_mode
        if len(modes) > MAX_FILES:
            raise BundleError(f"{folder}: more than a bundle's {MAX_FILES} files: not an eval "
                              f"bundle")
    root = _bundle_root(set(modes), folder)
    for name, mode in sorted(modes.items()):
        parts = _bundle_entry(name, root, folder)
        if parts is None or stat.S_ISDIR(mode):
            continue
        what = os.path.join(folder, *name.split("/"))
        if not stat.S_ISREG(mode):
            raise BundleError(f"{what} is {_kind(mode)}: a bundle holds regular files only")
        # O_NOFOLLOW and O_NONBLOCK: a file swapped for a link or a FIFO since is refused, at once
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(what, flags)
        except OSError as e:
            raise BundleError(f"{what}: cannot be read ({one_line(e, 100)})") from None
        with os.fdopen(fd, "rb") as src, _staged_file(staged, parts, what) as dst:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BundleError(f"{what} is {_kind(os.fstat(fd).st_mode)}: a bundle holds "
                                  f"regular files only")
            _copy(src, dst, budget, what)


def _download(url, path, timeout, budget):
    """url's body into path, within timeout seconds in all and budget's bytes; a one-line
    BundleError when it can't be had."""
    import requests
    import urllib3

    hint = (f"give a local copy: fetch {url} on a machine with internet and pass the .zip (or "
            f"the folder it unpacks to) with --eval_bundle PATH")
    print(f"core: downloading the eval bundle from {url}", flush=True)
    deadline = time.monotonic() + timeout
    try:
        # a read waits at most READ_TIMEOUT (or the whole limit, if shorter) for a byte; the
        # limit itself is checked between reads, so that a server sending a byte now and then
        # ends too
        with requests.get(url, stream=True,
                          timeout=(CONNECT_TIMEOUT, min(READ_TIMEOUT, timeout))) as r:
            if r.status_code != 200:
                raise BundleError(f"cannot download the CORE eval bundle: {url} answered HTTP "
                                  f"{r.status_code}; {hint}")
            expected = r.headers.get("Content-Length")
            if expected is not None and expected.isdigit():
                budget.take(int(expected), f"{url} (its Content-Length)")
                budget.left += int(expected)  # the bytes themselves are taken as they come
            got = 0
            with open(path, "wb") as f:
                while True:
                    if time.monotonic() > deadline:
                        raise BundleError(f"the download of {url} took over {timeout:g} s "
                                          f"(--download_timeout); {hint}")
                    block = r.raw.read1(1 << 20, decode_content=True)  # what has come, at once
                    if not block:
                        break
                    budget.take(len(block), url)
                    f.write(block)
                    got += len(block)
    except (requests.RequestException, urllib3.exceptions.HTTPError) as e:
        raise BundleError(f"cannot download the CORE eval bundle from {url} ({one_line(e, 120)});"
                          f" {hint}") from None
    if expected is not None and expected.isdigit() and int(expected) != got:
        raise BundleError(f"the download of {url} stopped after {got} of {expected} bytes; run "
                          f"again, or {hint}")


def _is_url(source):
    return source.startswith(("http://", "https://"))


def _stage(source, area, staged, timeout, max_mb):
    """The bundle of source (a URL, a .zip or a folder) unpacked into staged; a download goes to
    area (the staging folder staged is in)."""
    if _is_url(source):
        zip_path = os.path.join(area, "download.zip")
        _download(source, zip_path, timeout, _Budget(max_mb))
        _unzip(zip_path, source, staged, _Budget(max_mb))
    elif os.path.isdir(source):
        _copy_dir(source, staged, _Budget(max_mb))
    elif os.path.isfile(source):
        _unzip(source, source, staged, _Budget(max_mb))
    elif os.path.exists(source):
        raise BundleError(f"--eval_bundle {source} is {_kind(os.stat(source).st_mode)}: give a "
                          f".zip, the folder it unpacks to, or an http(s) URL")
    else:
        raise BundleError(f"--eval_bundle {source}: no such file or folder (give a .zip, the "
                          f"folder it unpacks to, or an http(s) URL)")


def _source_of(source):
    """The source as the manifest records it: a URL as is, a path by its real path (the same zip
    through a link is the same source)."""
    if _is_url(source):
        return source
    return os.path.realpath(source)


def _journal(folder):
    """The bundle entries an interrupted install was moving into folder (JOURNAL), or []."""
    try:
        with open(os.path.join(folder, JOURNAL), encoding="utf-8") as f:
            names = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names if n in BUNDLE_ENTRIES]


def _foreign(folder):
    """What folder holds that no install of ours put there (empty when it holds our install)."""
    names = os.listdir(folder)
    if MANIFEST in names:  # written before the journal goes: an install, done
        return []
    ours = set(OURS) | set(_journal(folder))
    return sorted(n for n in names
                  if n not in ours and not (n.startswith(STAGING) and n.endswith(".tmp")))


def _refuse_foreign(folder):
    foreign = _foreign(folder)
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4
                                          else "")
        raise BundleError(f"{folder} holds {shown} and no eval bundle ({MANIFEST} is missing): "
                          f"the bundle installs only into a new or empty folder; give another "
                          f"--eval_dir, or move those out")


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _install_locked(source, folder, timeout, max_mb):
    """Install source into folder, which this process has locked and which holds no manifest."""
    for name in os.listdir(folder):  # an interrupted install's staging folder: never complete
        if name.startswith(STAGING) and name.endswith(".tmp"):
            _remove(os.path.join(folder, name))
    for name in _journal(folder):  # a killed install's entries, moved but never made an install
        _remove(os.path.join(folder, name))
    _remove(os.path.join(folder, JOURNAL))
    _refuse_foreign(folder)
    area = tempfile.mkdtemp(prefix=STAGING, suffix=".tmp", dir=folder)
    staged, moved = os.path.join(area, "bundle"), []
    try:
        os.mkdir(staged)
        _stage(source, area, staged, timeout, max_mb)
        read_bundle(staged, where=lambda rel: f"{source}: {rel}")  # every task, every line
        files = {}
        for top, _, names in os.walk(staged):
            for name in names:
                full = os.path.join(top, name)
                files[os.path.relpath(full, staged).replace(os.sep, "/")] = sha256_file(full)
        entries = sorted(os.listdir(staged))
        data = json.dumps(entries).encode()
        atomic_write(os.path.join(folder, JOURNAL), lambda f: f.write(data))
        for name in entries:  # the bundle's entries into place, then the manifest that makes
            target = os.path.join(folder, name)  # them an install
            if os.path.lexists(target):  # _refuse_foreign left none: another process's
                raise BundleError(f"{target} appeared during the install: is another process "
                                  f"writing to {folder}?")
            os.rename(os.path.join(staged, name), target)
            moved.append(target)
        manifest = {"source": _source_of(source), "sha256": dict(sorted(files.items()))}
        data = (json.dumps(manifest, indent=1) + "\n").encode()
        atomic_write(os.path.join(folder, MANIFEST), lambda f: f.write(data))
        os.remove(os.path.join(folder, JOURNAL))
    except BaseException:
        if not os.path.lexists(os.path.join(folder, MANIFEST)):
            for target in moved:  # nothing half-installed stays: no manifest, no files
                _remove(target)
            _remove(os.path.join(folder, JOURNAL))
        raise
    finally:
        shutil.rmtree(area, ignore_errors=True)


class _Busy(Exception):
    """Another process holds the install lock."""


def install(source=None, eval_dir=None, timeout=DOWNLOAD_TIMEOUT, max_mb=MAX_BUNDLE_MB):
    """The folder holding the installed bundle, installing it first if it is not there: from
    source (a URL, a .zip or an unpacked folder; None: nanochat's URL), a download within timeout
    seconds, the download and the unpacked files within max_mb MiB each. One process installs
    (common.dir_lock); another waits for it, then finds the install done. A folder holding
    anything but our install is refused before anything is read or written; a bundle installed
    from another source than one given here is refused (one line). A failure or a stop signal
    leaves the folder as it was, and no folder this call made. Returns the folder."""
    folder = os.path.abspath(data_dir(eval_dir))
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.lexists(manifest):  # any manifest.json: read (and checked) below, never replaced
        if os.path.isdir(folder):
            _refuse_foreign(folder)
        elif os.path.lexists(folder):
            raise BundleError(f"--eval_dir {folder} is {_kind(os.lstat(folder).st_mode)}, not "
                              f"a folder")
        with stops_raise():  # SIGTERM, as Ctrl-C, undoes what the install did
            made = make_dirs(folder, "--eval_dir", BundleError)
            try:
                _install_waiting(source or BUNDLE_URL, folder, timeout, max_mb)
            except BaseException:
                if os.path.isdir(folder) and os.listdir(folder) == [LOCK]:  # as it was: no lock
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(folder, LOCK))
                for path in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(path)  # only if empty: what another process put there stays
                raise
    if source is not None:
        recorded = _read_manifest(folder).get("source")
        same = recorded == source
        if isinstance(recorded, str) and not _is_url(source) and not _is_url(recorded):
            same = os.path.realpath(recorded) == os.path.realpath(source)
        if not same:
            raise BundleError(f"{folder} holds the eval bundle of {recorded}, not of {source}: "
                              f"give another --eval_dir, or delete {folder} to install this one")
    return folder


def _install_waiting(source, folder, timeout, max_mb):
    """Install under the lock, or wait while another process installs into folder."""
    deadline, said = time.monotonic() + WAIT_FOR_INSTALL, False
    busy = "is being installed into by another process ({holder})"
    while True:
        try:
            with dir_lock(folder, LOCK, busy, error=_Busy):
                if not os.path.lexists(os.path.join(folder, MANIFEST)):
                    _install_locked(source, folder, timeout, max_mb)
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
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"it is {_kind(st.st_mode)}")
        if st.st_size > MAX_LINE:
            raise ValueError(f"over {MAX_LINE:,} bytes")
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


def _manifest_path(folder, rel):
    """The path of a manifest entry, which must name a file of the bundle inside folder."""
    parts = rel.split("/")
    # the folders on the way resolved (a linked eval_data/ leads out); the file itself is lstat'ed
    root = os.path.realpath(folder)
    on_the_way = os.path.realpath(os.path.join(folder, *parts[:-1]))
    inside = on_the_way == root or on_the_way.startswith(root + os.sep)
    if parts[0] not in BUNDLE_ENTRIES or any(p in ("", ".", "..") for p in parts) or not inside:
        raise BundleError(f"{os.path.join(folder, MANIFEST)}: the entry {rel!r} is not a file "
                          f"of the bundle inside {folder}; delete {folder} to install again")
    return os.path.join(folder, *parts)


def verify(folder):
    """A one-line BundleError naming the first file of the manifest that is missing or changed
    since the install (by SHA-256; a file whose size and mtime this process has seen match is not
    hashed again), or is no longer a regular file inside folder."""
    for rel, want in _read_manifest(folder)["sha256"].items():
        path = _manifest_path(folder, rel)
        try:
            st = os.lstat(path)
        except OSError:
            raise BundleError(f"{path} is missing from the installed eval bundle; delete "
                              f"{folder} to install it again") from None
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(f"{path} is {_kind(st.st_mode)}, not the file installed; delete "
                              f"{folder} to install it again")
        seen = _VERIFIED.get(path)
        if seen is not None and seen[:2] == (st.st_size, st.st_mtime_ns) and seen[2] == want:
            continue
        got = sha256_file(path)
        if got != want:
            raise BundleError(f"{path} changed since the eval bundle was installed (SHA-256 {got}"
                              f", not {want}); delete {folder} to install it again")
        _VERIFIED[path] = (st.st_size, st.st_mtime_ns, got)


def ready_on_every_rank(proc, source=None, eval_dir=None, timeout=DOWNLOAD_TIMEOUT,
                        max_mb=MAX_BUNDLE_MB):
    """The installed bundle's folder on every rank: the master installs (or checks) it, then the
    others find it. A failure is one line from the master; the other ranks stop with it."""
    if proc is None or proc.world_size == 1:
        return install(source, eval_dir, timeout, max_mb)
    folder, error = None, None
    for masters_turn in (True, False):
        if proc.master == masters_turn:
            try:
                folder = install(source, eval_dir, timeout, max_mb)
            except UsageError as e:
                error = e
        if not proc.agree(error is None):
            raise error or BundleError("the eval bundle could not be installed on another rank")
    return folder


# ===== Choosing tasks and examples ================================================================
def task_labels(folder):
    """The labels of core.yaml in the installed bundle, in its order: its files checked against
    the manifest first (an edited core.yaml is a changed file, not a malformed one)."""
    verify(folder)
    return [t.label for t in _read_config(folder, lambda rel: os.path.join(folder, rel))]


def select(spec, labels):
    """The labels a --tasks of comma-separated bundle labels names, or 'core' (them all). A label
    may be written core:LABEL (the bundle's hellaswag alone: core:hellaswag). An unknown one is a
    UsageError with the nearest label."""
    if spec == "core":
        return list(labels)
    chosen = []
    for item in spec.split(","):
        label = item.strip()
        if label == "core":
            raise UsageError("--tasks: core is the group of all the tasks, not a label: give it "
                             "alone (--tasks core), or name the labels")
        if label.startswith("core:"):
            label = label[len("core:"):]
        if label not in labels:
            hint = did_you_mean(label, labels)
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
    seqs = [[enc.eot_token] + enc.encode(t, allowed_special="all") for t in texts]
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


def rendered_rows(task, i, enc, context):
    """Example i's rows (spans, fitted to the model's context), rendered once per task, tokenizer
    and context and kept on the task: a run scores the same examples at every evaluation, as
    HellaSwag's cached rows are. Kept as 4-byte arrays (CORE's 22 tasks of 500 examples: about
    11M tokens, 44 MB over the ranks together; lists of ints would take 9 times that), given back
    as lists."""
    cached = task.rendered
    if cached is None or not (cached[0] is enc and cached[1] == context
                              and cached[2] is task.examples):
        cached = task.rendered = (enc, context, task.examples, {})
    rows = cached[3].get(i)
    if rows is None:
        where = f"{DATA}/{task.uri}:{task.examples[i][0] + 1}"
        rows = [(array.array("i", tokens), start, end)
                for tokens, start, end in (fit(r, context, where) for r in spans(task, i, enc))]
        cached[3][i] = rows
    return [(tokens.tolist(), start, end) for tokens, start, end in rows]


def score_task(model, task, device, positions, enc, *, batch_tokens=8192, autocast_dtype=None,
               device_type=None, desc=None, proc=None):
    """The results of the examples at positions (of the shuffled list) of task, one dict each:
    task, index (0-based line in its file), pred (the chosen option; None for LM), gold (None for
    LM) and correct."""
    context = scorer.max_positions(model)
    groups, kept = [], []
    for i in positions:
        rows = rendered_rows(task, i, enc, context)
        keep = [k for k, (_, start, end) in enumerate(rows) if start < end]
        groups.append([scorer.Row(*rows[k]) for k in keep])
        kept.append((len(rows), keep))
    nonempty = [g for g in groups if g]
    results = iter(scorer.score_groups(model, nonempty, device, batch_tokens=batch_tokens,
                                       autocast_dtype=autocast_dtype, device_type=device_type,
                                       desc=desc, proc=proc,
                                       greedy=task.kind == "language_modeling"))
    out = []
    for i, group, (n_rows, keep) in zip(positions, groups, kept):
        scored = [None] * n_rows
        if group:
            for k, s in zip(keep, next(results)):
                scored[k] = s
        out.append(_judge(task, i, scored))
    return out


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
    examples = sorted(scorer.gather(examples, proc), key=lambda e: (order[e["task"]], e["index"]))
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
