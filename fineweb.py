"""
FineWeb-Edu, or your own text, tokenized with GPT-2's BPE (gpt2_bpe/ through tiktoken: no network)
into the 1-D uint16 .npy shards train_gpt2.py reads: shard 0 (edufineweb_val_000000.npy) is the
validation split, every other one training data, each document after an <|endoftext|>;
manifest.json records the arguments and the finished shards, so the same command resumes.
https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu

    python fineweb.py                                  # sample-10BT, ~10B tokens, 100 shards
    python fineweb.py --max_tokens 100000000           # stream only the first 100M tokens
    python fineweb.py --input my_corpus/*.jsonl        # .txt/.md/.jsonl/.parquet, into local_text/

From Python: prepare(), prep_status(), open_shard() and ensure_prepared() (data on first use).
"""

import collections
import contextlib
import dataclasses
import glob
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shlex
import signal
import socket
import sys
import time
from typing import Optional

import numpy as np
from tqdm import tqdm

import tokenizer
from common import (DiskFullError, HelpFormatter, OneLineParser, Proc, UsageError, atomic_write,
                    count, dir_lock, hub_unreachable, one_line)

# ===== constants (train_gpt2.py relies on the shard names and the default data root) ==============
HF_DATASET = "HuggingFaceFW/fineweb-edu"
NAMES = ("sample-10BT", "sample-100BT", "sample-350BT")
REPO_DIR = os.path.dirname(os.path.abspath(__file__))  # data folders go beside the scripts
DEFAULT_DATA_ROOT = os.path.join(REPO_DIR, "edu_fineweb10B")
SHARD_PREFIX = "edufineweb"
# data made from --input is not FineWeb: its own default folder and shard names
LOCAL_DATA_ROOT = os.path.join(REPO_DIR, "local_text")
LOCAL_SHARD_PREFIX = "text"
SHARD_SIZE = 100_000_000  # tokens per shard, 200 MB of uint16
MAX_WORKERS = max(8, 4 * (os.cpu_count() or 1))  # tokenizer processes beyond these only queue up
TOKENIZER = "gpt2"
BPE_DIR = os.path.join(REPO_DIR, "gpt2_bpe")
# the sha256 tiktoken checks for these two files of OpenAI's GPT-2 release
BPE_FILES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
             "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
EOT = 50256  # <|endoftext|>, the GPT-2 document delimiter
GPT2_VOCAB_SIZE = EOT + 1  # GPT-2's tokens; ids past them in a padded vocab are padding
MANIFEST = "manifest.json"
LOCK = ".fineweb.lock"  # flock-ed by the prep writing a folder; kept (removing it breaks the lock)
LOCK_HOLDER = LOCK + ".holder"  # pid, host and command of the lock's holder (see common.dir_lock)
INPUT_TYPES = (".txt", ".md", ".jsonl", ".parquet")
BATCH_CHARS = 1 << 20  # ~1 MB of text (~250K tokens) per tokenizer task
HUB_BATCH = 1000  # documents per read from a HF dataset
# the tokenizer pool's start method: forkserver (a fork of a process with threads, as gloo's, can
# deadlock), else spawn (Windows); workers get only lists of str: the same shards either way
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else None


class DataPrepError(UsageError):
    """A UsageError of the data: bad input, a mismatched directory, no network."""

# ===== tokenization (runs in the worker processes; module level so that spawn can pickle it) ======
_enc = None

# tiktoken's "gpt2" pre-tokenizer: GPT-2's pattern with possessive quantifiers (same splits, faster)
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def _read_bpe_file(name):
    path = os.path.join(BPE_DIR, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataPrepError(f"cannot read the GPT-2 tokenizer file {path} ({e.strerror or e}); "
                            f"restore it with: git checkout -- gpt2_bpe") from None
    if hashlib.sha256(data).hexdigest() != BPE_FILES[name]:
        raise DataPrepError(f"{path} is not GPT-2's {name} (its sha256 differs: changed line "
                            f"endings, or a git-lfs pointer?); restore it with: "
                            f"git checkout -- gpt2_bpe")
    return data


def _gpt2_byte_chars():
    """GPT-2's files spell every byte as a printable character: a byte whose character is printable
    (and not a space) stands for itself, the other 68 become chr(256), chr(257), ... in order.
    Returns {character: byte}, in rank order (single bytes are ranks 0-255 in this order)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(others)})
    return chars


def _gpt2_ranks():
    """GPT-2's BPE (gpt2_bpe/vocab.bpe) as tiktoken's mergeable ranks {token bytes: id}: the 256
    single bytes, then one token per merge line in file order (an id is a merge priority)."""
    chars = _gpt2_byte_chars()
    ranks = {bytes([b]): i for i, b in enumerate(chars.values())}
    lines = _read_bpe_file("vocab.bpe").decode("utf-8").split("\n")[1:]  # 0: "#version: 0.2"
    for line in filter(None, lines):
        left, right = line.split(" ")
        ranks[bytes(chars[c] for c in left + right)] = len(ranks)
    return ranks


def get_encoding():
    """tiktoken's "gpt2" Encoding, built once from the files in gpt2_bpe/: no download, no cache,
    no environment variable. Identical ids to tiktoken.get_encoding("gpt2")."""
    global _enc
    if _enc is None:
        import tiktoken
        _enc = tiktoken.Encoding(name=TOKENIZER, pat_str=GPT2_PAT, mergeable_ranks=_gpt2_ranks(),
                                 special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=EOT + 1)
    return _enc


_gpt2_tok = None


def gpt2_tokenizer():
    """GPT-2's BPE as a tokenizer.Tokenizer (built once): get_encoding()'s ids, its fingerprint
    taken as a trained tokenizer's is, the chat tokens at the ids chat.py reserves (50257..)."""
    global _gpt2_tok
    if _gpt2_tok is None:
        specials = {name: EOT + i for i, name in enumerate(tokenizer.SPECIAL_NAMES)}
        _gpt2_tok = tokenizer.Tokenizer(_gpt2_ranks(), GPT2_PAT, specials,
                                        encoding=get_encoding(), gpt2=True)
    return _gpt2_tok


_worker_tok = None  # the tokenizer of a pool's worker (None: GPT-2's)


def _init_worker(record=None):
    # Ctrl-C goes to the whole process group; let only the parent handle it (it terminates
    # the pool), so an interrupted run prints one message instead of one per worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _worker_tok
    if record is not None:
        _worker_tok = tokenizer.from_record(record, None)


def _encode(enc, text):
    # encode_to_numpy with no special tokens is encode_ordinary, but hands back the Rust
    # buffer as an array instead of building a Python list of ints (~20% faster overall)
    if hasattr(enc, "encode_to_numpy"):
        try:
            return enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        except UnicodeEncodeError:
            pass  # lone surrogates (e.g. from JSON escapes): encode_ordinary repairs them
    return np.array(enc.encode_ordinary(text), dtype=np.uint32)


def tokenize_batch(texts, tok=None):
    """Tokenize a list of documents with tok (None: this worker's, GPT-2's by default). Returns
    (tokens, lengths): all documents concatenated, each after an EOT, as uint16 (uint32 for a
    tokenizer of more than 65,536 tokens); and each document's token count (0: an empty text)."""
    tok = tok or _worker_tok
    if tok is None:
        enc, eot_id, dtype = get_encoding(), EOT, np.uint16
    else:
        enc, eot_id, dtype = tok.encoding(), tok.eot, tok.dtype
    eot = np.array([eot_id], dtype=np.uint32)
    pieces = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        if not text:
            continue
        ids = _encode(enc, text)
        pieces += [eot, ids]
        lengths[i] = len(ids) + 1
    if not pieces:
        return np.empty(0, dtype=dtype), lengths
    tokens = np.concatenate(pieces)
    # a real check, not an assert (python -O would drop it): the dtype must hold every id
    if int(tokens.max()) > np.iinfo(dtype).max:
        raise DataPrepError(f"token id {int(tokens.max())} does not fit in "
                            f"{np.dtype(dtype).name}")
    return tokens.astype(dtype), lengths


def _batched(texts):
    batch_chars, batch, size = BATCH_CHARS, [], 0
    for text in texts:
        batch.append(text)
        size += len(text) if text else 0
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tokenized(batches, num_proc, tok=None):
    """tokenize_batch(batch, tok) for each batch, in order, in num_proc processes. At most
    2 * num_proc batches in flight: a fast reader cannot fill the memory (Pool.imap would read it
    all ahead). tok None or GPT-2's: get_encoding()."""
    if tok is not None and tok.gpt2:
        tok = None
    if num_proc <= 1:
        for batch in batches:
            if tok is None:
                yield tokenize_batch(batch)
            else:
                yield tokenize_batch(batch, tok)
        return
    # the pool is made here, never at import, so spawn (macOS/Windows) works; a worker rebuilds
    # the tokenizer from its record (its files' text)
    record = None if tok is None else tok.record()
    with mp.get_context(START_METHOD).Pool(num_proc, initializer=_init_worker,
                                           initargs=(record,)) as pool:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(tokenize_batch, (batch,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

# ===== sources: local files or a HF dataset, each a plain iterator over document texts ============
def _expand_inputs(patterns):
    """Paths / globs -> sorted, de-duplicated absolute file paths of a supported type."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        matches = [pattern]
        if glob.has_magic(pattern):
            matches = sorted(m for m in glob.glob(pattern, recursive=True) if not os.path.isdir(m))
            if not matches:
                raise DataPrepError(f"no files match {pattern}")
        for path in matches:
            if os.path.isdir(path):
                raise DataPrepError(f"{path} is a directory; pass files or a glob such as "
                                    f"'{path}/*.parquet'")
            if not os.path.exists(path):
                raise DataPrepError(f"input file not found: {path}")
            if not path.endswith(INPUT_TYPES):
                raise DataPrepError(f"unsupported input {path}: use .txt, .md, .jsonl or "
                                    f".parquet files")
            path = os.path.abspath(path)
            if path not in files:
                files.append(path)
    if not files:
        raise DataPrepError("no input files given")
    return files


def _check_inputs(files, text_column):
    """Fail before any work on unreadable files or a missing text column."""
    import pyarrow.parquet as pq
    for path in files:
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise DataPrepError(f"cannot read {path}: {e.strerror or e}") from None
        if path.endswith(".parquet"):
            try:
                schema = pq.read_schema(path)
            except Exception as e:
                raise DataPrepError(f"cannot read {path}: not a valid Parquet file "
                                    f"({one_line(e)})") from None
            if text_column not in schema.names:
                raise DataPrepError(f"{path} has no column '{text_column}' (columns: "
                                    f"{', '.join(schema.names)}); choose one with --text_column")
            kind = str(schema.field(text_column).type)
            if kind not in ("string", "large_string", "string_view", "null"):
                raise DataPrepError(f"column '{text_column}' of {path} holds {kind}, not text")
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        _jsonl_text(path, lineno, line, text_column)
                        break


def _jsonl_text(path, lineno, line, text_column):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataPrepError(f"cannot read {path}:{lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or text_column not in obj:
        keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataPrepError(f"{path}:{lineno} has no field '{text_column}' (found: {keys}); "
                            f"choose one with --text_column")
    text = obj[text_column]
    if text is not None and not isinstance(text, str):
        raise DataPrepError(f"{path}:{lineno}: field '{text_column}' is {type(text).__name__}, "
                            f"not text")
    return text


def _iter_files(files, text_column):
    """Documents of files in order, streamed: a whole .txt or .md file, a .jsonl line, a row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    for path in files:
        try:
            if path.endswith((".txt", ".md")):
                with open(path, encoding="utf-8") as f:
                    yield f.read()
            elif path.endswith(".jsonl"):
                with open(path, encoding="utf-8") as f:
                    for lineno, line in enumerate(f, 1):
                        if line.strip():
                            yield _jsonl_text(path, lineno, line, text_column)
            else:
                with pq.ParquetFile(path) as pf:
                    for batch in pf.iter_batches(batch_size=HUB_BATCH, columns=[text_column]):
                        yield from batch.column(0).to_pylist()
        except UnicodeDecodeError as e:
            raise DataPrepError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte "
                                f"{e.start})") from None
        except (OSError, pa.ArrowException) as e:
            raise DataPrepError(f"cannot read {path}: {one_line(e)}") from None


def read_documents(inputs, text_column="text"):
    """The documents of local files (paths or globs, as --input takes), as prepare() reads them."""
    return _iter_files(_expand_inputs(inputs), text_column)


def _is_network_error(e):
    # datasets and huggingface_hub wrap connection errors in many ways: search the whole chain
    clients = ("requests", "urllib3", "httpx", "httpcore", "aiohttp", "huggingface_hub")
    words = ("Connect", "Timeout", "Offline", "Network", "Transport", "Protocol")
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError, socket.gaierror, socket.herror)):
            return True
        from_client = type(e).__module__.split(".")[0] in clients
        if from_client and any(word in type(e).__name__ for word in words):
            return True
        e = e.__cause__ or e.__context__
    return False


def _hub_error(dataset, name, e):
    if _is_network_error(e):
        return DataPrepError(f"the Hugging Face hub is unreachable, cannot load {dataset} "
                             f"({name}): {one_line(e, 160)}. To prepare data offline, pass local "
                             f".txt/.md/.jsonl/.parquet files with --input PATH")
    return DataPrepError(f"cannot load {dataset} ({name}): {type(e).__name__}: {one_line(e)}")


def _iter_hub(dataset, name, text_column, streaming, skip, num_proc):
    """Documents of a HF dataset from index `skip` on. `dataset`: a hub id or a local copy of one
    (how the tests run this offline); opened here, so an unreachable hub fails before any write."""
    import datasets  # heavy: imported only when a dataset is actually read
    if not os.path.exists(dataset) and hub_unreachable():
        raise _hub_error(dataset, name, ConnectionError(f"no connection to {dataset}'s host"))
    try:
        kwargs = {} if streaming else {"num_proc": num_proc if num_proc > 1 else None}
        ds = datasets.load_dataset(dataset, name=name, split="train", streaming=streaming, **kwargs)
    except Exception as e:
        raise _hub_error(dataset, name, e) from None
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise DataPrepError(f"{dataset} ({name}) has no column '{text_column}' (columns: "
                            f"{', '.join(columns)}); choose one with --text_column")
    ds = ds.select_columns([text_column])

    def downloaded():
        # a downloaded, memory-mapped dataset: resume jumps straight to the document
        for start in range(skip, len(ds), HUB_BATCH):
            yield from ds[start:start + HUB_BATCH][text_column]

    def streamed():
        # reads only what is consumed (--max_tokens); a resume has to re-read up to skip
        try:
            for batch in ds.skip(skip).iter(batch_size=HUB_BATCH):
                yield from batch[text_column]
        except Exception as e:  # e.g. a dropped connection in the middle of the stream
            raise _hub_error(dataset, name, e) from None

    return streamed() if streaming else downloaded()

# ===== shards and the manifest ====================================================================
def _save_manifest(local_dir, manifest):
    data = (json.dumps(manifest, indent=1) + "\n").encode()
    atomic_write(os.path.join(local_dir, MANIFEST), lambda f: f.write(data))


def _load_manifest(local_dir):
    path = os.path.join(local_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        manifest["args"], manifest["shards"]  # noqa: B018 (both must be there)
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataPrepError(f"{path} is damaged ({one_line(e, 100)}); delete {local_dir} to start "
                            f"over") from None


# shard names in one place (train_gpt2.py finds shards only through list_shards)
def shard_split(index):
    """The split of the shard at `index` in a prep: shard 0 is val, every other one train."""
    return "val" if index == 0 else "train"


def shard_name(index, split=None, prefix=SHARD_PREFIX):
    """The file name of shard `index`, e.g. edufineweb_train_000001.npy (split: shard_split)."""
    return f"{prefix}_{split or shard_split(index)}_{index:06d}.npy"


def shard_glob(split):
    """The glob pattern that matches the names shard_name() gives to `split` shards (any prefix)."""
    return f"*_{split}_[0-9]*.npy"


def list_shards(data_root, split):
    """The shard files of `split` in data_root (any prefix), in index order; none if no folder."""
    # six zero-padded digits sort by name in index order; the pattern's .npy end keeps .tmp out
    return sorted(glob.glob(os.path.join(data_root, shard_glob(split))))


def _check_shards(local_dir, manifest):
    paths = []
    for shard in manifest["shards"]:
        path = os.path.join(local_dir, shard["file"])
        try:  # the header and the size, not every token
            n = _open_checked(path, lambda f: _read_shard_header(path, f))
        except ShardError:
            n = None
        if n != shard["tokens"]:
            raise DataPrepError(f"{path} is missing or does not hold the {shard['tokens']} tokens "
                                f"recorded in {MANIFEST}; delete {local_dir} to start over")
        paths.append(path)
    return paths


def _args_diff(old, new):
    diffs = []
    for k in sorted(set(old) | set(new)):
        if k == "inputs" and old.get(k) != new.get(k):
            diffs.append("inputs (files, sizes or modification times differ)")
        elif old.get(k) != new.get(k):
            diffs.append(f"{k}: {old.get(k)!r} -> {new.get(k)!r}")
    return "; ".join(diffs)


class _ShardWriter:
    """The shard being filled, and the manifest that records each finished one with the stream
    position just after it (document index, token offset in it): a later run restarts there."""

    def __init__(self, local_dir, manifest, shard_size, val_tokens, dtype=np.uint16):
        self.local_dir, self.manifest, self.shards = local_dir, manifest, manifest["shards"]
        self.index = len(self.shards)  # of the shard being filled
        self.prefix = manifest.get("prefix", SHARD_PREFIX)  # a manifest with none is FineWeb's
        self.shard_size = shard_size
        self.cap = val_tokens if self.index == 0 else shard_size  # its capacity
        self.buf = np.empty(shard_size, dtype=dtype)  # the only shard-sized allocation
        self.fill = 0
        self.cut = None  # stream position where the buffer content ends, once it is full

    def _record(self, index, n_tokens, position):
        self.shards.append({"file": shard_name(index, prefix=self.prefix),
                            "split": shard_split(index), "tokens": int(n_tokens),
                            "next_doc": position[0], "next_offset": position[1]})
        self.manifest["total_tokens"] = sum(s["tokens"] for s in self.shards)

    def _write(self, index, tokens):
        path = os.path.join(self.local_dir, shard_name(index, prefix=self.prefix))
        try:
            atomic_write(path, lambda f: np.save(f, tokens))
        except DiskFullError as e:  # np.save's header of a 1-D token array is 128 bytes
            raise DiskFullError(e.errno, e.path, e.free, e.written,
                                tokens.nbytes + 128) from e.__cause__

    def _flush(self):
        if not os.path.exists(os.path.join(self.local_dir, MANIFEST)):
            _save_manifest(self.local_dir, self.manifest)  # claim the directory first
        self._write(self.index, self.buf[:self.fill])
        self._record(self.index, self.fill, self.cut)
        _save_manifest(self.local_dir, self.manifest)  # the shard exists before it is named here
        self.index += 1
        self.fill, self.cap = 0, self.shard_size

    def add(self, tokens, ends, i, remaining, doc):
        """Copy tokens[i:] into shards, at most `remaining` of them (None: no limit). `ends` are the
        cumulative document lengths of the batch, whose first document is `doc` of the stream.
        Returns the position in `tokens` reached and what remains."""
        while i < len(tokens) and remaining != 0:
            if self.fill == self.cap:  # full and more tokens coming: write it (lazily, see finish)
                self._flush()
            n = min(self.cap - self.fill, len(tokens) - i)
            if remaining is not None:
                n = min(n, remaining)
                remaining -= n
            # one slice copy per shard boundary, not per document
            self.buf[self.fill:self.fill + n] = tokens[i:i + n]
            self.fill += n
            i += n
            if self.fill == self.cap or remaining == 0:
                d = int(np.searchsorted(ends, i, side="right"))
                self.cut = (doc + d, i - (int(ends[d - 1]) if d else 0))
        return i, remaining

    def finish(self):
        """Write the last shard(s), mark the prep complete; returns every shard path, val first."""
        # the buffer is written only once more tokens arrive (add) or here: data that ended before
        # the first train token is split so that both a val and a train shard exist
        if self.index == 0:
            self._split_small_corpus()
        elif self.fill > 0:
            self._flush()  # the last, usually partial, shard
        self.manifest["complete"] = True
        _save_manifest(self.local_dir, self.manifest)
        return [os.path.join(self.local_dir, s["file"]) for s in self.shards]

    def _split_small_corpus(self):
        if self.fill == 0:
            raise DataPrepError("the input contains no text")
        if self.fill < 2:
            raise DataPrepError(f"the input has only {self.fill} token; need at least 2 for a val "
                                f"and a train shard")
        n_val = max(1, self.fill // 10)
        # both shards are recorded in one manifest update: an interruption redoes this small prep
        _save_manifest(self.local_dir, self.manifest)
        self._write(0, self.buf[:n_val])
        self._write(1, self.buf[n_val:self.fill])
        self._record(0, n_val, (None, None))
        self._record(1, self.fill - n_val, self.cut)
        self.index = 2


def write_shards(local_dir, texts, manifest=None, *, shard_size, val_tokens, max_tokens=None,
                 num_proc=1, progress=False, tok=None):
    """Tokenize `texts` with tok (None: GPT-2's BPE) into shards in local_dir after those
    manifest["shards"] lists (no manifest: a new prep); returns every shard path, val first.
    prepare() adds checks, the lock, resuming."""
    if manifest is None:
        manifest = _new_manifest({}, tok)
    dtype = np.uint16 if tok is None else tok.dtype
    writer = _ShardWriter(local_dir, manifest, shard_size, val_tokens, dtype)
    shards = manifest["shards"]
    done = sum(s["tokens"] for s in shards)
    doc, skip = (shards[-1]["next_doc"], shards[-1]["next_offset"]) if shards else (0, 0)
    remaining = None if max_tokens is None else max_tokens - done
    pbar = None  # made at the first batch, so an input error is not preceded by an empty bar
    # (remaining == 0: a resumed run that had written everything but the "complete" flag)
    batches = _tokenized(_batched(texts), num_proc, tok) if remaining != 0 else (b for b in ())

    try:
        for tokens, lengths in batches:
            if pbar is None and len(tokens):
                # disable=None: no bar when stderr is not a terminal (a log would fill with redraws)
                pbar = tqdm(total=max_tokens, initial=done, unit="tok", unit_scale=True,
                            disable=None if progress else True, desc=f"shard {writer.index}",
                            dynamic_ncols=True)
            # after a resume, the first batch drops what the previous shard already holds
            end, remaining = writer.add(tokens, np.cumsum(lengths), skip, remaining, doc)
            if pbar is not None:
                pbar.update(end - skip)
                pbar.set_description_str(f"shard {writer.index}")
            skip = 0
            if remaining == 0:
                break
            doc += len(lengths)
        else:
            writer.cut = (doc, 0)  # the source is exhausted
    finally:
        batches.close()  # stops the pool (and a stream) right away when max_tokens is reached
        if pbar is not None:
            pbar.close()
    return writer.finish()


# ===== opening a shard for training: checked, then memory-mapped ==================================
class ShardError(ValueError):
    """A token shard that cannot be trained on; its one-line message names the file and why."""


CHECK_CHUNK = 1 << 22  # tokens (8 MB) per read of the token-id check: one buffer for any shard size
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}


TOKEN_DTYPES = (np.uint16, np.uint32)  # uint32: a tokenizer of more than 65,536 tokens


def _read_shard_header(path, f):
    """Check the .npy header of the open file f; returns the token count, f at the first token."""
    return _read_shard_layout(path, f)[0]


def _read_shard_layout(path, f):
    """_read_shard_header's check; returns (token count, the ids' dtype: uint16 or uint32)."""
    try:
        version = np.lib.format.read_magic(f)
    except ValueError:
        # np.load would say "allow_pickle=False": misleading, nothing here is a pickle
        raise ShardError(f"{path}: not a .npy file (no NumPy header)") from None
    if version not in _HEADER_READERS:
        raise ShardError(f"{path}: unsupported .npy format version {version[0]}.{version[1]}")
    try:
        shape, _, dtype = _HEADER_READERS[version](f)
    except ValueError as e:
        raise ShardError(f"{path}: damaged .npy header ({one_line(e, 100)})") from None
    if dtype not in TOKEN_DTYPES:
        raise ShardError(f"{path}: holds {dtype} values, expected uint16 (or uint32) token ids")
    if len(shape) != 1:
        raise ShardError(f"{path}: holds an array of shape {shape}, expected a 1-D token stream")

    n, header_bytes, width = shape[0], f.tell(), dtype.itemsize
    size = os.fstat(f.fileno()).st_size
    # np.load(mmap_mode="r") would only say "mmap length is greater than file size"
    if size != header_bytes + width * n:
        what = "truncated" if size < header_bytes + width * n else "longer than its header says"
        raise ShardError(f"{path}: {what}: {size:,} bytes, but its header promises {n:,} tokens "
                         f"({header_bytes + width * n:,} bytes)")
    if n == 0:
        raise ShardError(f"{path}: holds no tokens")
    return n, dtype


def _check_token_ids(path, f, n, vocab_size, dtype=np.uint16):
    """Check the n token ids after f's position, CHECK_CHUNK at a time into one reused buffer."""
    buf = np.empty(min(CHECK_CHUNK, n), dtype=dtype)
    raw, width = memoryview(buf).cast("B"), buf.itemsize
    for start in range(0, n, len(buf)):
        count = min(len(buf), n - start)
        if f.readinto(raw[:width * count]) != width * count:
            raise ShardError(f"{path}: changed while it was being read")
        check_window(buf[:count], vocab_size, path, start, ShardError)


def check_window(tokens, vocab_size, path, offset=0, error=UsageError):
    """Raise error naming path and the offset of the first id >= vocab_size in tokens, if any."""
    if len(tokens) and int(np.asarray(tokens).max()) >= vocab_size:  # asarray: memmap's max is slow
        i = int(np.argmax(tokens >= vocab_size))
        raise error(f"{path}: token id {int(tokens[i])} at offset {offset + i} is >= the "
                    f"vocabulary size {vocab_size}")


def _open_checked(path, check):
    """Open path, let check(f) read it; an unreadable file is a ShardError too."""
    try:
        with open(path, "rb") as f:
            return check(f)
    except OSError as e:
        raise ShardError(f"{path}: cannot read it ({e.strerror or one_line(e, 100)})") from None


def open_shard(path, vocab_size):
    """A token shard as a read-only memory-mapped 1-D uint16 (or uint32) array, after checking it:
    a .npy file of such ids, 1-D, as long as its header says, ids < vocab_size (None: unread);
    else ShardError."""
    path = os.fspath(path)

    def check(f):
        (n, dtype), offset = _read_shard_layout(path, f), f.tell()
        if vocab_size is not None:
            _check_token_ids(path, f, n, vocab_size, dtype)
        return n, dtype, offset

    n, dtype, offset = _open_checked(path, check)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,))


def open_split(data_root, split, vocab_size):
    """(paths, memory-mapped arrays) of a split's shards checked by open_shard (vocab_size None:
    headers only, 10B tokens as fast as 10M; check_window() checks reads), or this rank's error."""
    paths = list_shards(data_root, split)
    if not paths:
        raise UsageError(f"no {split} shards (*_{split}_NNNNNN.npy) in {data_root}: prepare them "
                         f"with fineweb.py", rank_specific=True)
    try:
        return paths, [open_shard(path, vocab_size) for path in paths]
    except ShardError as e:
        raise UsageError(str(e), rank_specific=True) from None

# ===== the public entry point =====================================================================
def _recorded_args(name, inputs, text_column, shard_size, max_tokens, val_tokens, dataset,
                   tok=None):
    """Check prepare's arguments; returns what determines the shards (manifest.json's "args"):
    GPT-2's BPE as "gpt2", another tokenizer by its fingerprint."""
    if int(shard_size) < 1:
        raise DataPrepError(f"--shard_size must be positive, got {shard_size}")
    if max_tokens is not None and int(max_tokens) < 2:
        raise DataPrepError(f"--max_tokens must be at least 2 (one val and one train token), got "
                            f"{max_tokens}")
    if val_tokens is None:
        val_tokens = _held_out_tokens(tok, name, inputs, text_column, dataset, shard_size)
    if val_tokens is None:
        # a full shard of val data, as build-nanogpt; but only 10% of a small --max_tokens
        val_tokens = shard_size if max_tokens is None else max(1, min(shard_size, max_tokens // 10))
    if not 1 <= val_tokens <= shard_size:
        raise DataPrepError(f"--val_shard_tokens must be between 1 and --shard_size "
                            f"({shard_size}), got {val_tokens}")
    if inputs is None and dataset == HF_DATASET and name not in NAMES:
        raise DataPrepError(f"unknown --fineweb_name {name!r}; choose one of {', '.join(NAMES)}")
    name_of_tok = TOKENIZER if tok is None or tok.gpt2 else tok.fingerprint
    args = {"tokenizer": name_of_tok, "shard_size": int(shard_size), "val_tokens": int(val_tokens),
            "max_tokens": None if max_tokens is None else int(max_tokens),
            "text_column": text_column}
    if inputs is None:
        args.update(dataset=dataset, name=name, streaming=max_tokens is not None)
    else:
        args["inputs"] = _input_records(inputs)
    return args


def _source(name, inputs, text_column, dataset):
    """What a prep or a tokenizer's training read: the input files (each one's path, size and
    modification time), or the dataset; and the text column."""
    if inputs is None:
        return {"dataset": dataset, "name": name, "text_column": text_column}
    return {"inputs": _input_records(inputs), "text_column": text_column}


def _held_out_tokens(tok, name, inputs, text_column, dataset, shard_size):
    """The val shard's size for data tokenized by a tokenizer trained on the same source: the
    tokens of the text its training held out, so that its val split holds no text it was trained
    on. None for GPT-2's BPE, or a tokenizer trained on other text."""
    held = (tok.info.get("held_out") if tok is not None else None) or {}
    if not held or held.get("source") != _source(name, inputs, text_column, dataset):
        return None
    return max(1, min(int(held["val_tokens"]), int(shard_size)))


def _input_records(inputs):
    """What a manifest records of its input files: each one's path, size and modification time."""
    return [{"path": p, "size": os.path.getsize(p), "mtime": int(os.path.getmtime(p))}
            for p in _expand_inputs(inputs)]


def _new_manifest(args, tok=None):
    prefix = LOCAL_SHARD_PREFIX if "inputs" in args else SHARD_PREFIX
    tok = tok or gpt2_tokenizer()
    return {"version": 1, "args": args, "prefix": prefix, "shards": [], "complete": False,
            "total_tokens": 0, "tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint,
                                             "n_vocab": tok.n_vocab,
                                             "dtype": np.dtype(tok.dtype).name,
                                             "path": tok.path}}


def _remove_stale_temps(local_dir):
    # a half-written shard or manifest (NAME.XXXXXXXX.tmp, NAME.tmp) of a killed atomic_write
    for pattern in (shard_glob("*") + "*.tmp", MANIFEST + ".*tmp", LOCK_HOLDER + ".*.tmp"):
        for stale in glob.glob(os.path.join(local_dir, pattern)):
            os.remove(stale)


def _manifest_for(local_dir, args, tok=None):
    """The manifest a prep with `args` continues in local_dir (new if none), or DataPrepError."""
    manifest = _load_manifest(local_dir)
    if manifest is None:
        if list_shards(local_dir, "val") or list_shards(local_dir, "train"):
            raise DataPrepError(f"{local_dir} already holds .npy shards but no {MANIFEST} (made by "
                                f"another tool?); refusing to mix or overwrite them: use another "
                                f"--data_root or delete them")
        return _new_manifest(args, tok)
    if manifest["args"] != args:
        raise DataPrepError(f"{local_dir} was prepared with different arguments "
                            f"({_args_diff(manifest['args'], args)}); refusing to mix: use "
                            f"another --data_root, or delete it to start over")
    return manifest


@contextlib.contextmanager
def _prep_lock(local_dir, made_dir=False):
    """dir_lock on local_dir's LOCK: one prep at a time per folder, another refused (DataPrepError).
    made_dir: local_dir was made for this prep; a body failing before writing there removes it."""
    busy = ("is being prepared by another process ({holder}); refusing to mix: wait for it to "
            "end, or stop it, then run again")
    unused = False
    try:
        with dir_lock(local_dir, LOCK, busy, error=DataPrepError):
            try:
                yield
            except BaseException:
                unused = made_dir and set(os.listdir(local_dir)) <= {LOCK, LOCK_HOLDER}
                if unused:  # unlinked while still held: one who opened it meanwhile finds it gone
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(local_dir, LOCK))
                raise
    finally:
        if unused:
            with contextlib.suppress(OSError):
                os.rmdir(local_dir)


def prepare(local_dir, *, name="sample-10BT", inputs=None, text_column="text",
            shard_size=SHARD_SIZE, max_tokens=None, val_tokens=None, num_proc=None, progress=True,
            dataset=HF_DATASET, tok=None):
    """Download (inputs=None) or read local files, tokenize with tok (a tokenizer.Tokenizer; None:
    GPT-2's BPE), write the shards to local_dir; returns
    their paths, val first. Called again, a complete directory with the same arguments is returned
    as is, an incomplete one resumed; one of other arguments, or one another prep writes (LOCK),
    raises DataPrepError. Out of disk: DiskFullError, and the same call resumes."""
    local_dir = os.path.abspath(os.path.expanduser(str(local_dir)))
    num_proc = num_proc or os.cpu_count() or 1
    args = _recorded_args(name, inputs, text_column, shard_size, max_tokens, val_tokens, dataset,
                          tok)
    manifest = _manifest_for(local_dir, args, tok)  # refused before anything is locked or made
    if manifest.get("complete"):  # a finished prep is only read: no lock
        return _check_shards(local_dir, manifest)
    made_dir = not os.path.isdir(local_dir)
    os.makedirs(local_dir, exist_ok=True)
    with _prep_lock(local_dir, made_dir):
        manifest = _manifest_for(local_dir, args, tok)  # again: another prep may have written it
        paths = _check_shards(local_dir, manifest)
        if manifest.get("complete"):
            return paths

        # skip whole documents already in finished shards without tokenizing them again
        skip = manifest["shards"][-1]["next_doc"] if manifest["shards"] else 0
        if inputs is None:
            texts = _iter_hub(dataset, name, text_column, args["streaming"], skip, num_proc)
        else:
            files = [i["path"] for i in args["inputs"]]
            _check_inputs(files, text_column)
            texts = itertools.islice(_iter_files(files, text_column), skip, None)
        _remove_stale_temps(local_dir)
        return write_shards(local_dir, texts, manifest, shard_size=int(shard_size),
                            val_tokens=args["val_tokens"], max_tokens=args["max_tokens"],
                            num_proc=num_proc, progress=progress, tok=tok)


@dataclasses.dataclass(frozen=True)
class PrepStatus:
    """What prep_status() found in a data root."""
    data_root: str  # absolute path
    has_manifest: bool  # False: nothing prepared there by fineweb.py (maybe foreign shards)
    complete: bool  # every shard written and the manifest marked complete
    args: Optional[dict]  # the arguments manifest.json records (see _recorded_args); or None
    shards: int  # finished shards recorded in the manifest
    tokens: int  # tokens in them
    prepare_kwargs: Optional[dict]  # prepare(data_root, **these) writes this very prep; or None
    resume_command: Optional[str]  # the same as a fineweb.py command line; None unless incomplete


def _command_line(data_root, kwargs, tokenizer_dir=None):
    """The fineweb.py command line that calls prepare(data_root, **kwargs), with --tokenizer
    tokenizer_dir where one is given."""
    flags = {"dataset": "--dataset", "name": "--fineweb_name", "shard_size": "--shard_size",
             "max_tokens": "--max_tokens", "val_tokens": "--val_shard_tokens",
             "text_column": "--text_column"}  # prepare()'s keyword -> the flag that sets it
    parser = build_parser()
    words = ["python", "fineweb.py", "--data_root", data_root]
    if "inputs" in kwargs:
        words += ["--input", *kwargs["inputs"]]
    for key, flag in flags.items():
        if key in kwargs and kwargs[key] != parser.get_default(flag[2:]):
            words += [flag, str(kwargs[key])]
    if tokenizer_dir is not None:
        words += ["--tokenizer", tokenizer_dir]
    return shlex.join(words)


def prep_status(data_root):
    """Whether data_root holds a prep by fineweb.py, complete or not, and how to finish it.
    Reads only manifest.json; raises DataPrepError when it is damaged."""
    data_root = os.path.abspath(os.path.expanduser(str(data_root)))
    manifest = _load_manifest(data_root)
    if manifest is None:
        return PrepStatus(data_root, False, False, None, 0, 0, None, None)
    args = manifest["args"]
    # prepare()'s keyword arguments that reproduce the recorded args (val_tokens explicit)
    kwargs = {key: args[key] for key in ("shard_size", "val_tokens", "max_tokens", "text_column")}
    if "inputs" in args:
        kwargs["inputs"] = [i["path"] for i in args["inputs"]]
    else:
        kwargs.update(dataset=args["dataset"], name=args["name"])
    complete = bool(manifest.get("complete"))
    tokenizer_dir = None  # a trained tokenizer's folder, as the prep recorded it
    if args.get("tokenizer", TOKENIZER) != TOKENIZER:
        recorded = manifest.get("tokenizer") or {}
        tokenizer_dir = recorded.get("path") or f"<the folder of bpe-{args['tokenizer'][:12]}>"
    command = None if complete else _command_line(data_root, kwargs, tokenizer_dir)
    return PrepStatus(data_root, True, complete, dict(args), len(manifest["shards"]),
                      sum(s["tokens"] for s in manifest["shards"]), kwargs, command)

# ===== data on first use (train_gpt2.py): check what is there, prepare what is missing ============
# about the GPT-2 tokens of each FineWeb-Edu sample: a run needing most of one takes it whole
FINEWEB_SAMPLE_TOKENS = {"sample-10BT": 10e9, "sample-100BT": 100e9, "sample-350BT": 350e9}
MIN_PREP_TOKENS = 10_000_000


def check_tokenizer(data_root, manifest, tok):
    """A DataPrepError unless the prep in data_root was tokenized by tok (GPT-2's: None)."""
    tok = tok or gpt2_tokenizer()
    made_by = manifest["args"].get("tokenizer", TOKENIZER)
    wanted = TOKENIZER if tok.gpt2 else tok.fingerprint
    if made_by == wanted:
        return
    if made_by == TOKENIZER:
        had = "GPT-2's BPE"
    else:
        had = f"the tokenizer bpe-{made_by[:12]}" if len(made_by) == 64 else repr(made_by)
    fix = ("give --tokenizer the folder it was prepared with" if tok.gpt2 else
           "prepare it again with fineweb.py --tokenizer, or use another --data_root")
    raise DataPrepError(f"{data_root} was tokenized with {had}, not the run's {tok.describe()}: "
                        f"{fix}")


def _check_against_manifest(data_root, manifest, val, train, vocab_size, tok=None):
    """The shards the loader opens (val, train) are those the manifest records, as long as recorded,
    tokenized by tok (None: GPT-2's BPE) with ids below vocab_size. Reads .npy headers and file
    sizes, never the tokens."""
    args = manifest["args"]
    check_tokenizer(data_root, manifest, tok)
    eot = EOT if tok is None else tok.eot
    if vocab_size <= eot:
        name = TOKENIZER if tok is None else tok.name
        raise DataPrepError(f"{data_root} holds {name} token ids up to {eot}, which a model "
                            f"with vocab_size {vocab_size} cannot embed")

    mismatch = f"{data_root} does not match its {MANIFEST}"
    fix = "the directory was mixed or changed after its prep: delete it and prepare it again"
    recorded = {s["file"]: s for s in manifest["shards"]}
    for split, found in (("val", val), ("train", train)):
        names = [os.path.basename(p) for p in found]
        want = [s["file"] for s in manifest["shards"] if s["split"] == split]
        if names != want:
            odd = sorted(set(names) - set(want))
            gone = sorted(set(want) - set(names))
            detail = f"{len(names)} {split} shards on disk, {len(want)} recorded"
            if odd:
                detail += f"; not recorded: {odd[0]}"
            elif gone:
                detail += f"; missing: {gone[0]}"
            else:
                detail += "; in another order"
            raise DataPrepError(f"{mismatch} ({detail}): {fix}")

    shard_size, val_tokens = args["shard_size"], args["val_tokens"]
    for path in val + train:
        name, shard = os.path.basename(path), recorded[os.path.basename(path)]
        try:
            n = _open_checked(path, lambda f: _read_shard_header(path, f))
        except ShardError as e:
            raise DataPrepError(str(e)) from None
        if n != shard["tokens"]:
            raise DataPrepError(f"{mismatch} ({name} holds {n:,} tokens, {shard['tokens']:,} "
                                f"recorded): {fix}")
        # every train shard but the last is full; val and the last train shard may be shorter
        full = shard_size if path in train[:-1] else None
        cap = val_tokens if path in val else shard_size
        if n > cap or (full is not None and n != full):
            val_size = f" and val size {val_tokens:,}" if path in val else ""
            raise DataPrepError(f"{mismatch} ({name} holds {n:,} tokens; the recorded shard size "
                                f"is {shard_size:,}{val_size}): {fix}")


def _usable_shards(data_root, status, vocab_size, tok=None):
    """True when data_root holds val and train shards (checked against a manifest if any), False
    when it holds none; DataPrepError when only one split is there or they mismatch the manifest."""
    val, train = list_shards(data_root, "val"), list_shards(data_root, "train")
    if not val and not train:
        return False
    if not val:
        raise DataPrepError(f"no val shard in {data_root} ({len(train)} train shards, but no file "
                            f"matching {shard_glob('val')}): the val split is shard 0 of a "
                            f"fineweb.py prep; restore it, or prepare the directory again")
    if not train:
        raise DataPrepError(f"no train shard in {data_root} ({len(val)} val shards, but no file "
                            f"matching {shard_glob('train')}): restore them, or prepare the "
                            f"directory again")
    if status.has_manifest:
        _check_against_manifest(data_root, _load_manifest(data_root), val, train, vocab_size,
                                tok)
    return True


def check_inputs(inputs):
    """A DataPrepError, before any work, if an input file is missing or of a type the prep cannot
    read."""
    _expand_inputs(inputs)


def split_sizes(data_root):
    """{"train": tokens, "val": tokens} of the shards in data_root, read from their .npy headers;
    None where there is no finished prep to read (no shards of a split, an unfinished or damaged
    prep: ensure_prepared prepares it, or says what is wrong)."""
    try:
        status = prep_status(data_root)
    except DataPrepError:
        return None
    if status.has_manifest and not status.complete:
        return None
    sizes = {}
    for split in ("train", "val"):
        paths = list_shards(data_root, split)
        try:
            sizes[split] = sum(_open_checked(p, lambda f, p=p: _read_shard_header(p, f))
                               for p in paths)
        except ShardError:
            return None
        if not paths:
            return None
    return sizes


def prepared_from(data_root, inputs):
    """Whether data_root's manifest records a prep of these very input files (the same paths,
    sizes and modification times): given again, --input changes nothing."""
    try:
        status = prep_status(data_root)
        files = _input_records(inputs)
    except (DataPrepError, OSError):
        return False
    return status.has_manifest and status.args.get("inputs") == files


def _prepare_first_use(data_root, status, train_tokens, val_tokens, name, inputs, text_column,
                       print0, tok=None):
    """prepare() the tokens a run needs (at least MIN_PREP_TOKENS) or the whole source, or finish
    an unfinished prep with the arguments it recorded. Returns None, or the one-line error."""
    if status.has_manifest and not status.complete:
        print0(f"{data_root}: an earlier prep stopped after {status.shards} shards; finishing it")
        try:
            prepare(data_root, **status.prepare_kwargs, tok=tok)
        except (DataPrepError, OSError) as e:
            return (f"{data_root} is an unfinished prep and finishing it failed ({one_line(e)}); "
                    f"finish it with: {status.resume_command}")
        return None
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    needed = max(train_tokens + val_tokens, MIN_PREP_TOKENS)
    full = inputs is not None or needed >= 0.9 * FINEWEB_SAMPLE_TOKENS.get(name, float("inf"))
    max_tokens = None if full else needed
    val_shard = None if full else min(max(val_tokens, 1), needed // 2)
    what = " ".join(inputs) if inputs else f"FineWeb-Edu {name}"
    size = f" ({max_tokens:,} tokens)" if max_tokens else ""
    print0(f"no shards in {data_root}: preparing them from {what}{size}")
    try:
        prepare(data_root, name=name, inputs=inputs, text_column=text_column,
                max_tokens=max_tokens, val_tokens=val_shard, tok=tok)
    except (DataPrepError, OSError) as e:
        return f"preparing {data_root} failed: {one_line(e)}"
    return None


def ensure_prepared(data_root, *, train_tokens, val_tokens, name="sample-10BT", inputs=None,
                    text_column="text", inputs_given=False, proc=None, print0=print,
                    vocab_size=GPT2_VOCAB_SIZE, tok=None):
    """Make sure data_root holds train and val shards a run can open, prepared on first use from
    `inputs` or FineWeb-Edu `name` (the train_tokens + val_tokens a run needs unless that is most of
    the sample; an unfinished prep is finished), checked against their manifest. inputs_given:
    inputs passed for a folder with shards (a warning). Every rank calls it with its proc
    (common.Proc; None: one process), whose agree(ok, long_wait) is the AND of ok over the ranks
    (long_wait: the wait for the master's prep, maybe hours); only the master prepares and prints.
    tok: the run's tokenizer (None: GPT-2's BPE), which a prep uses and shards must be made by.
    Raises DataPrepError; returns prep_status(data_root)."""
    proc = proc or Proc()
    master, agree = proc.master, proc.agree
    data_root = os.path.abspath(os.path.expanduser(str(data_root)))
    try:
        status = prep_status(data_root)
        unfinished = status.has_manifest and not status.complete
        if unfinished:  # finished with the run's tokenizer only if it was begun with it
            check_tokenizer(data_root, _load_manifest(data_root), tok)
        usable = not unfinished and _usable_shards(data_root, status, vocab_size, tok)
        problem = None
    except DataPrepError as e:
        problem, usable = str(e), False
    if not agree(problem is None):  # every rank takes the same branch
        raise DataPrepError(problem or "the data check failed on another rank (see its message)")
    if agree(usable):
        if master and inputs_given:
            print0(f"warning: --input has no effect: {data_root} already holds shards (use "
                   f"another --data_root to prepare one from it)")
        return status
    message = None
    if master:
        message = _prepare_first_use(data_root, status, train_tokens, val_tokens, name, inputs,
                                     text_column, print0, tok)
    if not agree(message is None, long_wait=True):
        raise DataPrepError(message or "data preparation failed on rank 0 (see its message)")
    return prep_status(data_root)


# ===== a tokenizer trained on the same inputs ====================================================
TOKENIZER_VAL_CHARS = 10_000_000  # the most text held out as val; 10% of a smaller input
TOKENIZER_TRAIN_CHARS = 2_000_000_000  # nanochat's: the characters a tokenizer trains on at most
PATTERNS = {"gpt4": tokenizer.GPT4_PATTERN, "gpt2": GPT2_PAT}


def _split_held_out(docs, val_chars, train_chars, held):
    """The training text of docs: what follows their first val_chars characters (which go into
    held, a list, cut inside a document where they end), up to train_chars characters."""
    got, used = 0, 0
    for doc in docs:
        if not doc:
            continue
        if got < val_chars:
            part = doc[:val_chars - got]
            held.append(part)
            got += len(part)
            doc = doc[len(part):]
            if not doc:
                continue
        doc = doc[:train_chars - used]
        used += len(doc)
        yield doc
        if used >= train_chars:
            return


def _held_out_token_count(tok, held):
    """The tokens the held-out texts take in a prep's val shard: each document's <|endoftext|>
    and ids (the last one cut where the held-out text ends)."""
    return sum(len(ids) + 1 for ids in tok.encoding().encode_ordinary_batch(held))


def train_tokenizer(out, *, name="sample-10BT", inputs=None, text_column="text",
                    dataset=HF_DATASET, vocab_size=tokenizer.DEFAULT_VOCAB_SIZE, pattern="gpt4",
                    train_chars=TOKENIZER_TRAIN_CHARS, overwrite=False, num_proc=None,
                    print_fn=print):
    """Train a BPE tokenizer on the documents prepare() would read (the first TOKENIZER_VAL_CHARS,
    or 10% of smaller local files, held out: the val text a prep of the same source with it keeps
    as its val shard) and save it into folder out; returns it. Prints bytes per token on the
    held-out text, against GPT-2's BPE."""
    tokenizer.check_new_folder(out, overwrite)
    if int(vocab_size) > 1 << 32:
        raise DataPrepError(f"--vocab_size {vocab_size} does not fit in uint32 shards")
    source = _source(name, inputs, text_column, dataset)
    if inputs is None:
        if dataset == HF_DATASET and name not in NAMES:
            raise DataPrepError(f"unknown --fineweb_name {name!r}; choose one of "
                                f"{', '.join(NAMES)}")
        total = train_chars
        docs = _iter_hub(dataset, name, text_column, True, 0, num_proc or 1)
    else:
        files = [i["path"] for i in source["inputs"]]
        _check_inputs(files, text_column)
        total = sum(i["size"] for i in source["inputs"])  # bytes: about the characters
        docs = _iter_files(files, text_column)
    val_chars = max(1, min(TOKENIZER_VAL_CHARS, total // 10))
    held = []
    t0 = time.time()
    trained_on = collections.Counter()

    def counted(texts):
        for text in texts:
            trained_on["chars"] += len(text)
            yield text

    tok = tokenizer.train_bpe(counted(_split_held_out(docs, val_chars, train_chars, held)),
                              vocab_size, PATTERNS[pattern])
    seconds = time.time() - t0
    if not trained_on["chars"]:
        raise DataPrepError(f"the input holds only {sum(map(len, held)):,} characters, all held "
                            f"out as val text: give more text")
    import rustbpe  # noqa: F401 (its version is recorded)
    from importlib.metadata import version
    tok.info = {"pattern_name": pattern,
                "trained_on": {"source": source, "chars": trained_on["chars"],
                               "trainer": f"rustbpe {version('rustbpe')}",
                               "seconds": round(seconds, 1)},
                "held_out": {"source": source, "chars": sum(map(len, held)),
                             "val_tokens": _held_out_token_count(tok, held)}}
    tokenizer.save(tok, out, overwrite)
    print_fn(f"trained {tok.describe()} on {trained_on['chars']:,} characters in "
             f"{seconds:.1f}s ({pattern} split pattern); wrote {tok.path}")
    own_bytes, own = tokenizer.bytes_per_token(tok, held)
    _, gpt2 = tokenizer.bytes_per_token(gpt2_tokenizer(), held)
    if own and gpt2:
        print_fn(f"held-out val text ({own_bytes:,} bytes): {own_bytes / own:.2f} bytes a token, "
                 f"GPT-2's BPE {own_bytes / gpt2:.2f} ({gpt2 / own:.2f}x its tokens)")
    return tok


# ===== command line ===============================================================================
def build_parser():
    p = OneLineParser(
        description="Download FineWeb-Edu (or read local files) and tokenize it with GPT-2 BPE "
                    "into uint16 .npy shards for train_gpt2.py. Re-run the same command to resume.",
        epilog="Validation split: shard 0 (val) gets the first --val_shard_tokens tokens: one full "
               "shard, or 10% of --max_tokens when given. Data that ends before the first train "
               "token is split 10% (at least 1) val, the rest train: a tiny corpus trains too.",
        formatter_class=HelpFormatter)

    # flag names as train_gpt2.py's; the old names (hidden) still work
    p.add_argument("--fineweb_name", default="sample-10BT", choices=NAMES,
                   help="FineWeb-Edu sample to download")
    p.add_old_spelling("--name", "--fineweb_name", dest="fineweb_name", choices=NAMES)
    p.add_argument("--dataset", default=HF_DATASET,
                   help="HF dataset repo id, or a local copy of it with the same configs")
    p.add_argument("--data_root", default=None,
                   help=f"output directory; if not given, {os.path.basename(DEFAULT_DATA_ROOT)}/ "
                        f"beside this script (the one train_gpt2.py reads), or "
                        f"{os.path.basename(LOCAL_DATA_ROOT)}/ beside it with --input")
    p.add_old_spelling("--local_dir", "--data_root", dest="data_root")
    # a shard is built in memory (4 GiB of uint16 at most); more workers than a few per core only
    # queue up; token counts beyond 2^50 are more text than exists
    p.add_argument("--shard_size", type=count(1, 2**31), default=SHARD_SIZE,
                   help="tokens per shard")
    p.add_argument("--num_proc", type=count(1, MAX_WORKERS), default=os.cpu_count(),
                   help="tokenizer processes")
    p.add_argument("--max_tokens", type=count(1, 2**50), default=None,
                   help="stop after this many tokens; streamed, so no more is downloaded")
    p.add_argument("--val_shard_tokens", type=count(1, 2**50), default=None,
                   help="tokens in the val shard (see below)")
    p.add_old_spelling("--val_tokens", "--val_shard_tokens", dest="val_shard_tokens",
                       type=count(1, 2**50))
    p.add_argument("--input", dest="inputs", nargs="+", metavar="PATH", default=None,
                   help="local .txt/.md/.jsonl/.parquet files or globs to use instead of "
                        "downloading (a .txt or .md file is one document)")
    p.add_argument("--text_column", default="text",
                   help="field holding the text in .jsonl/.parquet inputs")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenize with the tokenizer in this folder (made by --train_tokenizer); "
                        "default: GPT-2's BPE")
    t = p.add_argument_group("training a tokenizer on the input instead (docs/tokenizer.md)")
    t.add_argument("--train_tokenizer", default=None, metavar="DIR",
                   help="train a byte-level BPE on the input (its first text held out as val) "
                        "into this folder; writes no shards")
    t.add_argument("--vocab_size", type=count(256 + len(tokenizer.SPECIAL_NAMES), 2**32),
                   default=None, help=f"tokens in all, the special tokens included (default "
                                      f"{tokenizer.DEFAULT_VOCAB_SIZE:,})")
    t.add_argument("--pattern", choices=list(PATTERNS), default=None,
                   help="the split pattern: GPT-4's (default) or GPT-2's")
    t.add_argument("--train_chars", type=count(1, 2**50), default=None,
                   help=f"train on at most this many characters (default "
                        f"{TOKENIZER_TRAIN_CHARS:,})")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the tokenizer already in --train_tokenizer's folder")
    return p


TRAINING_FLAGS = ("vocab_size", "pattern", "train_chars", "overwrite")


def tokenizer_main(args):
    """fineweb.py --train_tokenizer DIR: the flags checked, the tokenizer trained and reported."""
    if args.tokenizer is not None:
        raise DataPrepError("--tokenizer and --train_tokenizer do not go together: train first, "
                            "then prepare the shards with --tokenizer")
    train_tokenizer(args.train_tokenizer, name=args.fineweb_name, inputs=args.inputs,
                    text_column=args.text_column, dataset=args.dataset,
                    vocab_size=args.vocab_size or tokenizer.DEFAULT_VOCAB_SIZE,
                    pattern=args.pattern or "gpt4",
                    train_chars=args.train_chars or TOKENIZER_TRAIN_CHARS,
                    overwrite=args.overwrite, num_proc=args.num_proc)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.data_root is None:
        args.data_root = LOCAL_DATA_ROOT if args.inputs is not None else DEFAULT_DATA_ROOT
    t0 = time.time()
    try:
        if args.train_tokenizer is not None:
            return tokenizer_main(args)
        unused = [f"--{k}" for k in TRAINING_FLAGS if getattr(args, k) not in (None, False)]
        if unused:
            raise DataPrepError(f"{', '.join(unused)} goes with --train_tokenizer DIR")
        tok = None if args.tokenizer is None else tokenizer.load(args.tokenizer)
        paths = prepare(args.data_root, name=args.fineweb_name, inputs=args.inputs,
                        text_column=args.text_column, shard_size=args.shard_size,
                        max_tokens=args.max_tokens, val_tokens=args.val_shard_tokens,
                        num_proc=args.num_proc, dataset=args.dataset, tok=tok)
    except UsageError as e:  # a DataPrepError: bad input, a mismatched directory, no network
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk (DiskFullError), an unwritable --data_root, ...
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.train_tokenizer is not None:
            print("interrupted: no tokenizer written", file=sys.stderr)
            return 130
        print("interrupted: run the same command again to continue where it stopped",
              file=sys.stderr)
        return 130
    status = prep_status(args.data_root)
    print(f"{status.tokens:,} tokens in {len(paths)} shards in {status.data_root} "
          f"({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
