"""Tests for fineweb.py on small local fixtures: no network, tiny shards, a few seconds."""

import errno
import glob
import json
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import common
import fineweb
from fineweb import EOT, DataPrepError, prepare
from helpers import (HANG_LIMIT_S, REPO, assert_one_line_error, dir_bytes, write_corpus_jsonl,
                     write_jsonl, write_shards)

WORDS = ("the of and to in is was for on that with as by at from education learning school "
         "students teacher science history water energy cell plant animal river mountain city "
         "number theory experiment result data model children reading writing mathematics "
         "language world").split()


def make_docs(n, seed=0, min_words=20, max_words=200):
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        end = rng.randint(0, 10**6)
        docs.append(f"Document {i}. " + " ".join(words) + ".\n\nThe end, n=" + str(end))
    return docs


def write_docs(path, docs, key="text"):
    """A .jsonl corpus: one document a line, under `key`, beside a field fineweb.py must skip."""
    return write_jsonl(path, [{key: d, "id": len(d)} for d in docs])


def write_parquet(path, docs, key="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({key: docs, "score": [1.0] * len(docs)}), str(path), row_group_size=50)
    return str(path)


def expected_tokens(enc, docs):
    out = []
    for d in docs:
        out.append(EOT)
        out.extend(enc.encode_ordinary(d))
    return np.array(out, dtype=np.uint16)


def load(paths):
    arrays = [np.load(p) for p in paths]
    for a in arrays:
        assert a.dtype == np.uint16 and a.ndim == 1
    return np.concatenate(arrays)


def cli(*args, env_extra=None):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", **(env_extra or {}))
    return subprocess.run([sys.executable, os.path.join(REPO, "fineweb.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=HANG_LIMIT_S)


# -----------------------------------------------------------------------------
# layout, content, boundaries

def test_constants():
    assert EOT == 50256
    assert os.path.isabs(fineweb.DEFAULT_DATA_ROOT)
    assert fineweb.DEFAULT_DATA_ROOT == os.path.join(REPO, "edu_fineweb10B")
    assert fineweb.shard_name(0) == "edufineweb_val_000000.npy"
    assert fineweb.shard_name(12) == "edufineweb_train_000012.npy"
    assert fineweb.LOCAL_DATA_ROOT == os.path.join(REPO, "local_text")
    assert fineweb.shard_name(1, prefix=fineweb.LOCAL_SHARD_PREFIX) == "text_train_000001.npy"


@pytest.mark.slow
def test_shard_layout_and_names(tmp_path, enc):
    docs = make_docs(60)
    src = write_parquet(tmp_path / "data.parquet", docs)
    out = tmp_path / "out"
    paths = prepare(out, inputs=[src], shard_size=1000, num_proc=1, progress=False)
    expected = expected_tokens(enc, docs)
    n_shards = -(-len(expected) // 1000)
    assert n_shards >= 4
    names = [os.path.basename(p) for p in paths]
    assert names == ["text_val_000000.npy"] + [f"text_train_{i:06d}.npy"
                                               for i in range(1, n_shards)]
    # what the loader globs, and nothing else (no temp files left behind)
    assert sorted(glob.glob(str(out / "*_val_[0-9]*.npy"))) == paths[:1]
    assert sorted(glob.glob(str(out / "*_train_[0-9]*.npy"))) == paths[1:]
    # the holder file is gone
    assert sorted(os.listdir(out)) == sorted(names + ["manifest.json", fineweb.LOCK])
    sizes = [len(np.load(p)) for p in paths]
    assert sizes[:-1] == [1000] * (n_shards - 1)  # val is a full shard by default
    assert 0 < sizes[-1] <= 1000  # the last partial shard is written
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["total_tokens"] == len(expected) == sum(sizes)
    assert [s["file"] for s in manifest["shards"]] == names


def test_round_trip_mixed_inputs(tmp_path, enc):
    docs = make_docs(30, seed=1)
    docs[3] = "Unicode: héllo wörld — 你好 🙂, and a literal <|endoftext|> inside the text."
    txt_docs = ["A plain text file.\nSecond line.\n", "Another file, one document."]
    for i, d in enumerate(txt_docs):
        (tmp_path / f"t{i}.txt").write_text(d, encoding="utf-8")
    a = write_docs(tmp_path / "a.jsonl", docs[:10])
    b = write_parquet(tmp_path / "b.parquet", docs[10:])
    # a quoted glob is expanded by fineweb itself, sorted
    (tmp_path / "notes.md").write_text("# Notes\n\nMarkdown is plain text: one document.\n",
                                       encoding="utf-8")
    paths = prepare(tmp_path / "out",
                    inputs=[a, b, str(tmp_path / "t*.txt"), str(tmp_path / "notes.md")],
                    shard_size=700, num_proc=1, progress=False)
    all_docs = docs + txt_docs + ["# Notes\n\nMarkdown is plain text: one document.\n"]
    tokens = load(paths)
    assert tokens[0] == EOT
    assert np.array_equal(tokens, expected_tokens(enc, all_docs))
    assert enc.decode(tokens.tolist()) == "".join("<|endoftext|>" + d for d in all_docs)
    # the literal "<|endoftext|>" in a document is text, not the delimiter
    assert int((tokens == EOT).sum()) == len(all_docs)


def test_document_split_across_shard_boundary(tmp_path, enc):
    docs = make_docs(20, seed=2, min_words=150, max_words=300)
    src = write_docs(tmp_path / "d.jsonl", docs)
    paths = prepare(tmp_path / "out", inputs=[src], shard_size=500, num_proc=1, progress=False)
    shards = [np.load(p) for p in paths]
    # documents are longer than a shard, so shards start inside a document...
    assert sum(s[0] != EOT for s in shards[1:]) >= 3
    # ...and the document simply continues there: nothing lost, duplicated or reordered
    assert np.array_equal(np.concatenate(shards), expected_tokens(enc, docs))


def test_empty_documents_are_skipped(tmp_path, enc):
    docs = ["first", "", "third"]
    src = write_parquet(tmp_path / "d.parquet", docs)
    paths = prepare(tmp_path / "out", inputs=[src], shard_size=100, num_proc=1, progress=False)
    assert np.array_equal(load(paths), expected_tokens(enc, ["first", "third"]))


def test_tokenize_batch_matches_encode_ordinary(enc):
    texts = ["Hello world", "", None, "lone surrogate \ud800 from a JSON escape",
             "<|endoftext|> as text"]
    tokens, lengths = fineweb.tokenize_batch(texts)
    expected = []
    for t in texts:
        if t:
            expected += [EOT] + enc.encode_ordinary(t)
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected
    assert lengths.tolist() == [len(enc.encode_ordinary(t)) + 1 if t else 0 for t in texts]


def test_token_ids_checked_against_uint16(monkeypatch):
    class Huge:
        def encode_to_numpy(self, text, **kw):
            return np.array([70000], dtype=np.uint32)
    monkeypatch.setattr(fineweb, "_enc", Huge())
    with pytest.raises(DataPrepError, match="uint16"):
        fineweb.tokenize_batch(["x"])


# -----------------------------------------------------------------------------
# small corpora, --val_tokens, --max_tokens

def test_small_corpus_gets_val_and_train(tmp_path, enc):
    docs = make_docs(5, seed=4)
    src = write_docs(tmp_path / "d.jsonl", docs)
    expected = expected_tokens(enc, docs)
    assert len(expected) < 5000  # smaller than one (val) shard
    paths = prepare(tmp_path / "out", inputs=[src], shard_size=5000, num_proc=1, progress=False)
    assert [os.path.basename(p) for p in paths] == ["text_val_000000.npy", "text_train_000001.npy"]
    val, train = np.load(paths[0]), np.load(paths[1])
    assert len(val) == len(expected) // 10 and len(train) == len(expected) - len(val)
    assert np.array_equal(np.concatenate([val, train]), expected)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["total_tokens"] == len(expected)


def test_explicit_val_tokens(tmp_path, enc):
    docs = make_docs(20, seed=5)
    src = write_docs(tmp_path / "d.jsonl", docs)
    paths = prepare(tmp_path / "out", inputs=[src], shard_size=1000, val_tokens=123, num_proc=1,
                    progress=False)
    assert len(np.load(paths[0])) == 123
    assert all(len(np.load(p)) == 1000 for p in paths[1:-1])
    assert np.array_equal(load(paths), expected_tokens(enc, docs))
    with pytest.raises(DataPrepError, match="val_shard_tokens"):
        prepare(tmp_path / "bad", inputs=[src], shard_size=1000, val_tokens=1001, progress=False)


def test_max_tokens_stops(tmp_path, enc, monkeypatch):
    docs = make_docs(200, seed=6)
    src = write_docs(tmp_path / "d.jsonl", docs)
    monkeypatch.setattr(fineweb, "BATCH_CHARS", 1000)
    seen = []
    real = fineweb.tokenize_batch
    monkeypatch.setattr(fineweb, "tokenize_batch", lambda texts: seen.extend(texts) or real(texts))
    paths = prepare(tmp_path / "out", inputs=[src], shard_size=1000, max_tokens=2500, num_proc=1,
                    progress=False)
    sizes = [len(np.load(p)) for p in paths]
    assert sizes == [250, 1000, 1000, 250]  # val: 10% of max_tokens by default
    assert np.array_equal(load(paths), expected_tokens(enc, docs)[:2500])
    assert len(seen) < len(docs) // 2  # stopped reading, did not tokenize the rest
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["total_tokens"] == 2500


# -----------------------------------------------------------------------------
# the HF datasets code path, on a local copy of a hub-style repo (no network)

def make_hub_repo(root, docs):
    """A folder laid out like HuggingFaceFW/fineweb-edu: README configs + parquet files."""
    data = root / "sample" / "10BT"
    data.mkdir(parents=True)
    half = len(docs) // 2
    write_parquet(data / "000_00000.parquet", docs[:half])
    write_parquet(data / "001_00000.parquet", docs[half:])
    (root / "README.md").write_text(textwrap.dedent("""\
        ---
        configs:
        - config_name: sample-10BT
          data_files:
          - split: train
            path: sample/10BT/*.parquet
        ---
        Local stand-in for the FineWeb-Edu repo.
        """))
    return str(root)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep datasets' cache (and its lock files) out of the user's ~/.cache."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.mark.slow
def test_streaming_path_on_local_dataset(tmp_path, enc, hf_cache):
    docs = make_docs(60, seed=7)
    repo = make_hub_repo(tmp_path / "repo", docs)
    paths = prepare(tmp_path / "out", dataset=repo, name="sample-10BT", shard_size=1000,
                    max_tokens=3000, num_proc=1, progress=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["args"]["streaming"] is True and manifest["args"]["name"] == "sample-10BT"
    assert manifest["prefix"] == "edufineweb"  # FineWeb data keeps FineWeb's names
    assert [os.path.basename(p) for p in paths] == ["edufineweb_val_000000.npy"] + \
        [f"edufineweb_train_{i:06d}.npy" for i in (1, 2, 3)]
    assert np.array_equal(load(paths), expected_tokens(enc, docs)[:3000])
    assert [len(np.load(p)) for p in paths] == [300, 1000, 1000, 700]
    # prep_status describes a hub prep too: its resume command names the dataset and the sample
    manifest["complete"] = False  # as a crash just before the last manifest update leaves it
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    status = fineweb.prep_status(tmp_path / "out")
    assert status.prepare_kwargs["dataset"] == repo
    assert status.prepare_kwargs["name"] == "sample-10BT"
    words = shlex.split(status.resume_command)
    assert words[:2] == ["python", "fineweb.py"]
    assert "--dataset" in words and "--max_tokens" in words
    assert fineweb.main(words[2:] + ["--num_proc", "1"]) == 0
    assert fineweb.prep_status(tmp_path / "out").complete


def test_download_path_on_local_dataset(tmp_path, enc, hf_cache):
    docs = make_docs(40, seed=8)
    repo = make_hub_repo(tmp_path / "repo", docs)
    paths = prepare(tmp_path / "out", dataset=repo, name="sample-10BT", shard_size=1000, num_proc=1,
                    progress=False)
    assert np.array_equal(load(paths), expected_tokens(enc, docs))
    with pytest.raises(DataPrepError, match="no column 'body'"):
        prepare(tmp_path / "out2", dataset=repo, name="sample-10BT", text_column="body",
                max_tokens=100, progress=False)


def test_hub_network_failure_is_a_clear_error(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub "
                              "(LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataPrepError) as e:
        prepare(tmp_path / "out", max_tokens=1000, progress=False)
    assert "unreachable" in str(e.value) and "--input" in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_offline_hub(tmp_path):
    r = cli("--data_root", tmp_path / "out", "--max_tokens", 1000)
    assert_one_line_error(r, "unreachable", "--input")


# -----------------------------------------------------------------------------
# resume and refusal

def test_resume_after_interrupted_run(tmp_path, enc, monkeypatch):
    docs = make_docs(100, seed=9)
    src = write_docs(tmp_path / "d.jsonl", docs)
    out = tmp_path / "out"
    monkeypatch.setattr(fineweb, "BATCH_CHARS", 1500)
    real_write = fineweb.atomic_write

    def crash_on_shard_3(path, write):
        if path.endswith("_000003.npy"):
            with open(path + ".tmp", "wb") as f:
                f.write(b"half a shard")  # what a crash leaves behind
            raise KeyboardInterrupt
        real_write(path, write)
    monkeypatch.setattr(fineweb, "atomic_write", crash_on_shard_3)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, inputs=[src], shard_size=1000, num_proc=1, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and len(manifest["shards"]) == 3
    assert manifest["shards"][-1]["next_offset"] > 0  # the interruption fell inside a document
    assert manifest["prefix"] == "text"
    before = {p: os.stat(p).st_mtime_ns for p in glob.glob(str(out / "*.npy"))}
    assert len(before) == 3

    monkeypatch.setattr(fineweb, "atomic_write", real_write)
    seen = []
    real_tokenize = fineweb.tokenize_batch
    monkeypatch.setattr(fineweb, "tokenize_batch",
                        lambda texts: seen.extend(texts) or real_tokenize(texts))
    paths = prepare(out, inputs=[src], shard_size=1000, num_proc=1, progress=False)
    assert len(paths) > 4
    # finished shards kept as they were
    assert {p: os.stat(p).st_mtime_ns for p in paths[:3]} == before
    # only the rest was tokenized
    assert len(seen) == len(docs) - manifest["shards"][-1]["next_doc"]
    assert seen[0] == docs[manifest["shards"][-1]["next_doc"]]
    assert np.array_equal(load(paths), expected_tokens(enc, docs))
    assert not glob.glob(str(out / "*.tmp"))
    assert all(os.path.basename(p).startswith("text_") for p in paths)  # the resume kept the prefix
    # a third run finds it complete and reads nothing
    monkeypatch.setattr(fineweb, "_iter_files",
                        lambda *a: pytest.fail("re-read a complete directory"))
    assert prepare(out, inputs=[src], shard_size=1000, num_proc=1, progress=False) == paths


def test_resume_of_a_prep_without_a_recorded_prefix_keeps_its_names(tmp_path, enc, monkeypatch):
    # manifests written before the prefix was recorded named every shard edufineweb_, --input or not
    docs = make_docs(40, seed=18)
    src = write_docs(tmp_path / "d.jsonl", docs)
    out = tmp_path / "out"
    real_write = fineweb.atomic_write

    def crash_on_shard_2(path, write):
        if path.endswith("_000002.npy"):
            raise KeyboardInterrupt
        real_write(path, write)
    monkeypatch.setattr(fineweb, "atomic_write", crash_on_shard_2)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, inputs=[src], shard_size=800, num_proc=1, progress=False)
    monkeypatch.setattr(fineweb, "atomic_write", real_write)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["prefix"]
    for shard in manifest["shards"]:
        new = shard["file"].replace("text_", "edufineweb_")
        os.rename(out / shard["file"], out / new)
        shard["file"] = new
    (out / "manifest.json").write_text(json.dumps(manifest))
    paths = prepare(out, inputs=[src], shard_size=800, num_proc=1, progress=False)
    assert len(paths) > 3
    assert [os.path.basename(p) for p in paths] == ["edufineweb_val_000000.npy"] + \
        [f"edufineweb_train_{i:06d}.npy" for i in range(1, len(paths))]
    assert np.array_equal(load(paths), expected_tokens(enc, docs))


@pytest.mark.parametrize("max_tokens", [None, 1500])
def test_resume_when_only_the_complete_flag_is_missing(tmp_path, enc, monkeypatch, max_tokens):
    docs = make_docs(30, seed=13)
    src = write_docs(tmp_path / "d.jsonl", docs)
    out = tmp_path / "out"
    real_save = fineweb._save_manifest

    def crash_at_the_end(local_dir, manifest):
        if manifest["complete"]:
            raise KeyboardInterrupt
        real_save(local_dir, manifest)
    monkeypatch.setattr(fineweb, "_save_manifest", crash_at_the_end)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, inputs=[src], shard_size=1000, max_tokens=max_tokens, num_proc=1,
                progress=False)
    monkeypatch.setattr(fineweb, "_save_manifest", real_save)
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    paths = prepare(out, inputs=[src], shard_size=1000, max_tokens=max_tokens, num_proc=1,
                    progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert np.array_equal(load(paths), expected_tokens(enc, docs)[:max_tokens])


def test_refuses_mismatched_arguments(tmp_path):
    docs = make_docs(20, seed=10)
    src = write_docs(tmp_path / "d.jsonl", docs)
    out = tmp_path / "out"
    paths = prepare(out, inputs=[src], shard_size=1000, num_proc=1, progress=False)
    before = {p: os.stat(p).st_mtime_ns for p in paths}
    with pytest.raises(DataPrepError, match=r"different arguments \(shard_size: 1000 -> 2000"):
        prepare(out, inputs=[src], shard_size=2000, num_proc=1, progress=False)
    other = write_docs(tmp_path / "other.jsonl", docs[:5])
    with pytest.raises(DataPrepError, match="inputs"):
        prepare(out, inputs=[other], shard_size=1000, num_proc=1, progress=False)
    r = cli("--input", src, "--data_root", out, "--shard_size", 1000, "--max_tokens", 500)
    assert_one_line_error(r, "different arguments", "max_tokens")
    assert {p: os.stat(p).st_mtime_ns for p in paths} == before  # nothing touched


def test_refuses_directory_of_foreign_shards(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # e.g. from build-nanogpt
    np.save(out / "edufineweb_val_000000.npy", np.zeros(10, dtype=np.uint16))
    src = write_docs(tmp_path / "d.jsonl", make_docs(3))
    with pytest.raises(DataPrepError, match="no manifest.json"):
        prepare(out, inputs=[src], shard_size=1000, progress=False)
    assert len(np.load(out / "edufineweb_val_000000.npy")) == 10


# -----------------------------------------------------------------------------
# input errors: exception and CLI

@pytest.mark.slow
def test_missing_text_column(tmp_path):
    pq = write_parquet(tmp_path / "d.parquet", ["a", "b"], key="content")
    jl = write_docs(tmp_path / "d.jsonl", ["a", "b"], key="content")
    for src in (pq, jl):
        with pytest.raises(DataPrepError, match="no (column|field) 'text'.*--text_column"):
            prepare(tmp_path / "out", inputs=[src], progress=False)
        assert_one_line_error(cli("--input", src, "--data_root", tmp_path / "out"), "'text'",
                              "--text_column")
    assert not (tmp_path / "out").exists()
    # and with the right column it works
    paths = prepare(tmp_path / "ok", inputs=[pq], text_column="content", shard_size=100, num_proc=1,
                    progress=False)
    assert len(paths) == 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "blank_texts"])
def test_empty_input(tmp_path, kind):
    if kind == "txt":
        src = tmp_path / "e.txt"
        src.write_text("")
    elif kind == "jsonl":
        src = tmp_path / "e.jsonl"
        src.write_text("\n")
    elif kind == "parquet":
        src = write_parquet(tmp_path / "e.parquet", [])
    else:
        src = write_docs(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(DataPrepError, match="contains no text"):
        prepare(tmp_path / "out", inputs=[str(src)], shard_size=100, num_proc=1, progress=False)
    assert not glob.glob(str(tmp_path / "out" / "*"))  # no manifest claiming the directory
    assert_one_line_error(cli("--input", src, "--data_root", tmp_path / "out", "--num_proc", 1),
                          "no text")


@pytest.mark.slow
def test_unreadable_inputs(tmp_path):
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"this is not parquet at all")
    bad_txt = tmp_path / "bad.txt"
    bad_txt.write_bytes(b"caf\xe9 latin-1 bytes")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": broken\n')
    cases = [(bad_parquet, "not a valid Parquet file"), (bad_txt, "not UTF-8"),
             (bad_json, "bad.jsonl:2: invalid JSON"), (tmp_path / "missing.jsonl", "not found"),
             (tmp_path / "x.csv", "unsupported"),
             (str(tmp_path / "nothing*.parquet"), "no files match")]
    (tmp_path / "x.csv").write_text("a,b\n")
    for src, message in cases:
        with pytest.raises(DataPrepError, match=message):
            prepare(tmp_path / "out", inputs=[str(src)], shard_size=100, num_proc=1, progress=False)
        assert_one_line_error(cli("--input", src, "--data_root", tmp_path / "out", "--num_proc", 1),
                              message)


def test_permission_denied(tmp_path, monkeypatch):
    src = tmp_path / "secret.txt"
    src.write_text("text")
    src.chmod(0)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # root reads it anyway: what others get
        def refused(path, *args, **kwargs):
            if os.fspath(path) == str(src):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return open(path, *args, **kwargs)
        monkeypatch.setattr(fineweb, "open", refused, raising=False)
    with pytest.raises(DataPrepError, match=r"^cannot read .*secret\.txt: Permission denied$"):
        prepare(tmp_path / "out", inputs=[str(src)], progress=False)
    assert not (tmp_path / "out").exists()  # refused before the output dir is made


# -----------------------------------------------------------------------------
# CLI, import side effects, spawn

@pytest.mark.slow
def test_cli_success(tmp_path, enc):
    docs = make_docs(10, seed=11)
    src = write_docs(tmp_path / "d.jsonl", docs)
    r = cli("--input", src, "--data_root", tmp_path / "out", "--shard_size", 500, "--num_proc", 1)
    assert r.returncode == 0, r.stderr
    assert "tokens in" in r.stdout
    paths = sorted(glob.glob(str(tmp_path / "out" / "*_val_*.npy"))) + \
        sorted(glob.glob(str(tmp_path / "out" / "*_train_*.npy")))
    assert np.array_equal(load(paths), expected_tokens(enc, docs))


def test_cli_input_defaults_to_the_local_text_folder(tmp_path, monkeypatch, enc):
    # roots moved into tmp_path: the test must not write beside the real script
    local, fw = tmp_path / "local_text", tmp_path / "edu_fineweb10B"
    monkeypatch.setattr(fineweb, "LOCAL_DATA_ROOT", str(local))
    monkeypatch.setattr(fineweb, "DEFAULT_DATA_ROOT", str(fw))
    docs = make_docs(20, seed=19)
    src = write_docs(tmp_path / "d.jsonl", docs)
    assert fineweb.main(["--input", src, "--shard_size", "600", "--num_proc", "1"]) == 0
    assert not fw.exists()
    names = sorted(os.listdir(local))
    assert names[0] == fineweb.LOCK
    names = names[1:]
    assert names[-1] == "text_val_000000.npy" and names[0] == "manifest.json"
    assert names[1:-1] == [f"text_train_{i:06d}.npy" for i in range(1, len(names) - 1)]
    assert len(names) > 3
    assert fineweb.list_shards(str(local), "val") == [str(local / "text_val_000000.npy")]
    paths = fineweb.list_shards(str(local), "val") + fineweb.list_shards(str(local), "train")
    assert np.array_equal(load(paths), expected_tokens(enc, docs))
    # an explicit --data_root still wins, with the same local-text names
    args = ["--input", src, "--data_root", str(tmp_path / "mine"), "--num_proc", "1"]
    assert fineweb.main(args) == 0
    assert sorted(os.listdir(tmp_path / "mine")) == [".fineweb.lock", "manifest.json",
                                                     "text_train_000001.npy", "text_val_000000.npy"]


def test_cli_fineweb_keeps_its_default_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(fineweb, "LOCAL_DATA_ROOT", str(tmp_path / "local_text"))
    monkeypatch.setattr(fineweb, "DEFAULT_DATA_ROOT", str(tmp_path / "edu_fineweb10B"))
    calls = []

    def fake_prepare(local_dir, **kwargs):
        calls.append((local_dir, kwargs["inputs"]))
        raise DataPrepError("stopped by the test")
    monkeypatch.setattr(fineweb, "prepare", fake_prepare)
    assert fineweb.main(["--max_tokens", "1000"]) == 1
    assert calls == [(str(tmp_path / "edu_fineweb10B"), None)]


def test_cli_old_flag_names_still_work():
    parser = fineweb.build_parser()
    new = parser.parse_args(["--data_root", "d", "--fineweb_name", "sample-100BT",
                             "--val_shard_tokens", "5"])
    old = parser.parse_args(["--local_dir", "d", "--name", "sample-100BT", "--val_tokens", "5"])
    assert old == new
    shown = parser.format_help()
    assert "--data_root" in shown
    assert not {"--local_dir", "--name", "--val_tokens"} & set(shown.split())


def test_import_has_no_side_effects():
    code = ("import multiprocessing as mp, sys; import fineweb; "
            "assert not mp.active_children(); assert 'datasets' not in sys.modules; "
            "assert 'tiktoken' not in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=HANG_LIMIT_S)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_unreachable_hub_fails_fast_with_input_hint(tmp_path, monkeypatch):
    import socket
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy",
                "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    calls = []

    def refuse(address, *args, **kwargs):
        calls.append(address)
        raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(fineweb.DataPrepError, match="unreachable.*--input"):
        fineweb.prepare(str(tmp_path / "out"), max_tokens=1000, progress=False)
    assert calls and calls[0][0] == "huggingface.co"
    assert not os.path.exists(tmp_path / "out")  # nothing written


@pytest.mark.slow
def test_no_progress_bar_in_non_interactive_logs(tmp_path):
    corpus = str(tmp_path / "c.jsonl")
    write_corpus_jsonl(corpus, 300)
    r = subprocess.run([sys.executable, os.path.join(REPO, "fineweb.py"), "--input", corpus,
                        "--data_root", str(tmp_path / "out"), "--num_proc", "1"],
                       capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert r.returncode == 0, r.stderr
    # stderr is a pipe: tqdm stays quiet
    assert "tok/s" not in r.stderr and "shard 0" not in r.stderr
    assert "tokens in 2 shards" in r.stdout


# -----------------------------------------------------------------------------
# shard naming: the names prepare writes are the ones list_shards finds

def test_shard_names_and_list_shards_agree(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    named = {"val": [fineweb.shard_name(0)],
             "train": [fineweb.shard_name(i) for i in (2, 10, 100, 1)]}
    # list_shards takes any prefix
    named["train"] += [fineweb.shard_name(3, "train", prefix="other")]
    for name in named["val"] + named["train"]:
        np.save(root / name, np.zeros(1, dtype=np.uint16))
    # things that are not shards: temp files of an interrupted write, another split, other files
    for junk in (fineweb.shard_name(7) + ".a1b2c3.tmp", fineweb.shard_name(8, "test"),
                 "edufineweb_train_.npy", "notes_train.txt", "manifest.json"):
        (root / junk).write_bytes(b"x")
    found = {split: [os.path.basename(p) for p in fineweb.list_shards(str(root), split)]
             for split in ("val", "train")}
    assert found["val"] == ["edufineweb_val_000000.npy"]
    # in index order (zero-padded), whatever the order they were written in
    assert found["train"] == ["edufineweb_train_000001.npy", "edufineweb_train_000002.npy",
                              "edufineweb_train_000010.npy", "edufineweb_train_000100.npy",
                              "other_train_000003.npy"]
    assert fineweb.list_shards(str(tmp_path / "missing"), "train") == []


def test_prepare_writes_what_list_shards_finds(tmp_path):
    src = write_docs(tmp_path / "d.jsonl", make_docs(30, seed=14))
    paths = prepare(tmp_path / "out", inputs=[src], shard_size=800, num_proc=1, progress=False)
    out = str(tmp_path / "out")
    assert fineweb.list_shards(out, "val") + fineweb.list_shards(out, "train") == paths
    assert len(paths) >= 3


# -----------------------------------------------------------------------------
# open_shard: a shard is checked when it is opened

def test_open_shard_returns_a_read_only_memmap(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 10_000).astype(np.uint16)
    tokens[-1] = 50256  # the largest id GPT-2 has
    np.save(tmp_path / "s.npy", tokens)
    shard = fineweb.open_shard(str(tmp_path / "s.npy"), 50257)
    assert isinstance(shard, np.memmap) and shard.dtype == np.uint16 and shard.shape == (10_000,)
    assert np.array_equal(shard, tokens)
    with pytest.raises(ValueError, match="read-only"):
        shard[0] = 1


def test_open_shard_reads_what_prepare_wrote(tmp_path, enc):
    docs = make_docs(20, seed=15)
    paths = prepare(tmp_path / "out", inputs=[write_docs(tmp_path / "d.jsonl", docs)],
                    shard_size=700, num_proc=1, progress=False)
    tokens = np.concatenate([fineweb.open_shard(p, enc.n_vocab) for p in paths])
    assert np.array_equal(tokens, expected_tokens(enc, docs))


def write_broken_shard(path, kind):
    if kind == "truncated":  # a copy cut short: np.load(mmap_mode="r") fails with an mmap message
        np.save(path, np.arange(1000, dtype=np.uint16))
        data = open(path, "rb").read()
        open(path, "wb").write(data[:-100])
    elif kind == "too long":
        np.save(path, np.arange(1000, dtype=np.uint16))
        open(path, "ab").write(b"\0" * 6)
    elif kind == "not npy":
        open(path, "w").write("<html>404 Not Found</html>\n")
    elif kind == "empty file":
        open(path, "wb").close()
    elif kind == "int32":
        np.save(path, np.arange(1000, dtype=np.int32))
    elif kind == "2-D":
        np.save(path, np.zeros((10, 100), dtype=np.uint16))
    elif kind == "big id":
        tokens = np.zeros(3000, dtype=np.uint16)
        tokens[1234] = 50300
        np.save(path, tokens)


@pytest.mark.parametrize("kind, message", [
    ("truncated", r"truncated: 2,\d+ bytes, but its header promises 1,000 tokens"),
    ("too long", "longer than its header says"),
    ("not npy", r"not a \.npy file"),
    ("empty file", r"not a \.npy file"),
    ("int32", "holds int32 values, expected uint16"),
    ("2-D", r"holds an array of shape \(10, 100\), expected a 1-D token stream"),
    ("big id", "token id 50300 at offset 1234 is >= the vocabulary size 50257"),
    ("missing", "cannot read it"),
])
def test_open_shard_names_the_file_and_the_problem(tmp_path, kind, message):
    path = str(tmp_path / "edufineweb_train_000001.npy")
    write_broken_shard(path, kind)
    with pytest.raises(fineweb.ShardError) as e:
        fineweb.open_shard(path, 50257)
    assert isinstance(e.value, ValueError)
    text = str(e.value)
    assert text.startswith(path + ": ") and "\n" not in text
    assert re.search(message, text), text


def test_open_shard_finds_a_bad_id_in_any_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(fineweb, "CHECK_CHUNK", 1000)  # many chunks, a short last one
    tokens = np.full(10_500, 7, dtype=np.uint16)
    np.save(tmp_path / "s.npy", tokens)
    assert len(fineweb.open_shard(str(tmp_path / "s.npy"), 8)) == 10_500
    for offset in (0, 999, 1000, 7777, 10_499):
        bad = tokens.copy()
        bad[offset] = 8
        bad[-1] = 9 if offset != 10_499 else 8  # the first bad id is the one reported
        np.save(tmp_path / "s.npy", bad)
        with pytest.raises(fineweb.ShardError,
                           match=f"token id 8 at offset {offset} is >= the vocabulary size 8"):
            fineweb.open_shard(str(tmp_path / "s.npy"), 8)


def test_padded_vocabulary_accepts_ids_below_it(tmp_path):
    np.save(tmp_path / "s.npy", np.array([0, 50300, 50303], dtype=np.uint16))
    assert fineweb.open_shard(str(tmp_path / "s.npy"), 50304).tolist() == [0, 50300, 50303]


# -----------------------------------------------------------------------------
# prep_status, and finishing a prep killed with kill -9

def shard_bytes(folder):
    paths = fineweb.list_shards(str(folder), "val") + fineweb.list_shards(str(folder), "train")
    return {os.path.basename(p): open(p, "rb").read() for p in paths}


def test_prep_status_of_empty_and_foreign_dirs(tmp_path):
    np.save(tmp_path / "edufineweb_val_000000.npy", np.zeros(5, dtype=np.uint16))  # another tool's
    for root in (tmp_path / "missing", tmp_path):
        status = fineweb.prep_status(root)
        assert status.data_root == str(root) and not status.has_manifest and not status.complete
        assert status.args is None and status.resume_command is None
        assert status.prepare_kwargs is None


@pytest.mark.slow
def test_kill_9_then_prepare_finishes_the_same_shards(tmp_path):
    corpus = str(tmp_path / "c.jsonl")
    write_corpus_jsonl(corpus, 3000)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "fineweb.py"), "--input", corpus,
                             "--data_root", str(out), "--shard_size", "1000", "--num_proc", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # the manifest is replaced atomically
        while proc.poll() is None and fineweb.prep_status(out).shards < 3:
            time.sleep(0.002)
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup
        _, stderr = proc.communicate()
    assert proc.returncode == -9, f"the prep ended before it could be killed: {stderr!r}"

    status = fineweb.prep_status(out)
    assert status.has_manifest and not status.complete and status.shards >= 3
    # the recorded shards are there; one more if the kill fell between a shard's rename and the
    # manifest update (the resume writes it again); nothing half-written under a shard name (temp
    # name, then rename)
    on_disk = shard_bytes(out)
    recorded = json.loads((out / "manifest.json").read_text())["shards"]
    assert [s["file"] for s in recorded] == list(on_disk)[:status.shards]
    assert status.shards <= len(on_disk) <= status.shards + 1
    assert status.args["shard_size"] == 1000
    assert [i["path"] for i in status.args["inputs"]] == [corpus]
    assert status.resume_command.startswith("python fineweb.py --data_root ")
    assert f"--input {corpus}" in status.resume_command
    assert "--shard_size 1000" in status.resume_command

    paths = prepare(out, inputs=[corpus], shard_size=1000, num_proc=1, progress=False)
    reference = prepare(tmp_path / "reference", inputs=[corpus], shard_size=1000, num_proc=1,
                        progress=False)
    assert len(paths) == len(reference) > status.shards
    assert shard_bytes(out) == shard_bytes(tmp_path / "reference")
    assert fineweb.prep_status(out).complete and fineweb.prep_status(out).resume_command is None
    assert not glob.glob(str(out / "*.tmp"))


@pytest.mark.slow
def test_resume_command_finishes_the_prep(tmp_path, monkeypatch):
    # a space: the command must quote it
    src = write_docs(tmp_path / "my corpus.jsonl", make_docs(60, seed=16))
    out = tmp_path / "out dir"
    kwargs = dict(inputs=[src], shard_size=700, val_tokens=300, max_tokens=5000, text_column="text")
    real_write = fineweb.atomic_write

    def crash_on_shard_4(path, write):
        if path.endswith("_000004.npy"):
            raise KeyboardInterrupt
        real_write(path, write)
    monkeypatch.setattr(fineweb, "atomic_write", crash_on_shard_4)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, num_proc=1, progress=False, **kwargs)
    monkeypatch.setattr(fineweb, "atomic_write", real_write)
    # what a kill -9 in the middle of a write leaves behind
    (out / (fineweb.shard_name(4) + ".k3x9q2.tmp")).write_bytes(b"half a shard")
    (out / "manifest.json.7f2a1c.tmp").write_bytes(b"{")

    status = fineweb.prep_status(out)
    assert not status.complete and status.shards == 4 and status.tokens == 300 + 3 * 700
    words = shlex.split(status.resume_command)
    assert words[:2] == ["python", "fineweb.py"]
    r = subprocess.run([sys.executable, os.path.join(REPO, "fineweb.py"), *words[2:],
                        "--num_proc", "1"], capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert r.returncode == 0, r.stderr
    assert fineweb.prep_status(out).complete
    reference = prepare(tmp_path / "reference", num_proc=1, progress=False, **kwargs)
    assert shard_bytes(out) == shard_bytes(tmp_path / "reference") and len(reference) == 8
    assert not glob.glob(str(out / "*.tmp"))


# -----------------------------------------------------------------------------
# bench.py's fineweb row

def bench(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=HANG_LIMIT_S, cwd=REPO)


@pytest.mark.slow
def test_bench_fineweb_row(tmp_path, enc):
    docs = make_docs(300, seed=17)
    src = write_docs(tmp_path / "corpus.jsonl", docs)
    r = bench("--only", "fineweb", "--fineweb_input", src, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fineweb"]["tokens"] == len(expected_tokens(enc, docs))
    assert out["fineweb"]["tokens_per_sec"] > 0
    assert "train" not in out and "loader" not in out  # only the rows asked for
    assert not hasattr(fineweb, "compare_with_naive")


@pytest.mark.slow
def test_bench_fineweb_bad_input_is_one_line(tmp_path):
    r = bench("--only", "fineweb", "--fineweb_input", tmp_path / "missing.jsonl")
    assert_one_line_error(r, "not found")


# -----------------------------------------------------------------------------
# ensure_prepared: train_gpt2.py's data on first use (these call it directly; training runs that
# prepare their data are in test_training.py, test_run_safety.py, test_distributed.py)

def ensure(root, printed, **kwargs):
    kwargs = {"train_tokens": 1000, "val_tokens": 100, **kwargs}
    return fineweb.ensure_prepared(root, print0=printed.append, **kwargs)


def interrupt_at_shard(monkeypatch, index, **kwargs):
    """prepare(**kwargs) stopped as by kill -9 just before shard `index` was written."""
    real_write = fineweb.atomic_write

    def crash(path, write):
        if path.endswith(f"_{index:06d}.npy"):
            raise KeyboardInterrupt
        real_write(path, write)
    with monkeypatch.context() as m:
        m.setattr(fineweb, "atomic_write", crash)
        with pytest.raises(KeyboardInterrupt):
            prepare(**kwargs)


@pytest.mark.slow
def test_ensure_prepared_prepares_an_empty_root_once(tmp_path, monkeypatch):
    src = write_docs(tmp_path / "d.jsonl", make_docs(40, seed=20))
    root, printed = str(tmp_path / "data"), []
    status = ensure(root, printed, inputs=[src])
    assert printed == [f"no shards in {root}: preparing them from {src}"]
    assert status.complete and status.args["inputs"][0]["path"] == src
    assert status.args["max_tokens"] is None
    reference = prepare(tmp_path / "reference", inputs=[src], num_proc=1, progress=False)
    assert shard_bytes(root) == shard_bytes(os.path.dirname(reference[0]))
    # once there, it is checked, not prepared again; --input given again is pointed out
    monkeypatch.setattr(fineweb, "prepare", lambda *a, **k: pytest.fail("prepared twice"))
    printed.clear()
    assert ensure(root, printed, inputs=[src], inputs_given=True) == status
    assert printed == [f"warning: --input has no effect: {root} already holds shards (use another "
                       f"--data_root to prepare one from it)"]
    printed.clear()
    # passing over the data twice: train_gpt2.py says so
    ensure(root, printed, train_tokens=status.tokens + 1)
    assert printed == []


@pytest.mark.parametrize("train_tokens, val_tokens, max_tokens, prep_val_tokens", [
    (1_000, 100, 10_000_000, 100),  # a tiny run still gets MIN_PREP_TOKENS
    (20_000_000, 1_000_000, 21_000_000, 1_000_000),
    (30_000_000, 0, 30_000_000, 1),  # no val evaluation: the prep still needs one val token
    # most of sample-10BT: take it whole, val as fineweb.py's default
    (9_500_000_000, 10_000_000, None, None),
])
def test_ensure_prepared_sizes_a_hub_prep_to_the_run(tmp_path, monkeypatch, train_tokens,
                                                     val_tokens, max_tokens, prep_val_tokens):
    calls = []
    monkeypatch.setattr(fineweb, "prepare", lambda root, **kw: calls.append((root, kw)))
    root, printed = str(tmp_path / "data"), []
    ensure(root, printed, train_tokens=train_tokens, val_tokens=val_tokens)
    assert calls == [(root, dict(name="sample-10BT", inputs=None, text_column="text",
                                 max_tokens=max_tokens, val_tokens=prep_val_tokens, tok=None))]
    assert printed == [f"no shards in {root}: preparing them from FineWeb-Edu sample-10BT"
                       + (f" ({max_tokens:,} tokens)" if max_tokens else "")]


def test_ensure_prepared_finishes_an_unfinished_prep(tmp_path, monkeypatch):
    src = write_docs(tmp_path / "d.jsonl", make_docs(60, seed=21))
    root = str(tmp_path / "data")
    kwargs = dict(inputs=[src], shard_size=600, val_tokens=300, num_proc=1, progress=False)
    interrupt_at_shard(monkeypatch, 3, local_dir=root, **kwargs)
    printed = []
    status = ensure(root, printed)  # no inputs: the manifest names the source
    assert printed == [f"{root}: an earlier prep stopped after 3 shards; finishing it"]
    assert status.complete and status.shards > 3
    prepare(tmp_path / "whole", **kwargs)
    assert shard_bytes(root) == shard_bytes(tmp_path / "whole")


def test_ensure_prepared_unfinished_prep_without_its_source(tmp_path, monkeypatch):
    src = write_docs(tmp_path / "d.jsonl", make_docs(60, seed=21))
    root = str(tmp_path / "data")
    interrupt_at_shard(monkeypatch, 3, local_dir=root, inputs=[src], shard_size=600, val_tokens=300,
                       num_proc=1, progress=False)
    os.remove(src)
    before = dir_bytes(root)
    with pytest.raises(DataPrepError) as e:
        ensure(root, [])
    command = fineweb.prep_status(root).resume_command
    assert str(e.value) == (f"{root} is an unfinished prep and finishing it failed (input file "
                            f"not found: {src}); finish it with: {command}")
    assert dir_bytes(root) == before


def test_ensure_prepared_failure_is_one_line(tmp_path):
    src = write_docs(tmp_path / "d.jsonl", make_docs(5), key="body")
    root = str(tmp_path / "data")
    with pytest.raises(DataPrepError,
                       match=rf"^preparing {re.escape(root)} failed: .*has no field 'text'") as e:
        ensure(root, [], inputs=[src])
    assert "\n" not in str(e.value) and not os.path.exists(root)


class Ranks:
    """The proc of one rank among several (master or not): agree()'s AND over all ranks is what the
    other ranks are set to answer."""

    def __init__(self, master=True, others_ok=True, others_ok_after_prep=True):
        self.master, self.calls = master, []
        self.others_ok, self.others_ok_after_prep = others_ok, others_ok_after_prep

    def agree(self, ok, long_wait=False):
        self.calls.append((ok, long_wait))
        return ok and (self.others_ok_after_prep if long_wait else self.others_ok)


def test_ensure_prepared_only_the_master_prepares(tmp_path, monkeypatch):
    monkeypatch.setattr(fineweb, "prepare", lambda *a, **k: pytest.fail("a non-master prepared"))
    root, printed = str(tmp_path / "data"), []
    ranks = Ranks(master=False)  # rank 0 prepared: the long wait ends with every rank agreeing
    ensure(root, printed, proc=ranks)
    assert ranks.calls == [(True, False), (False, False), (True, True)] and printed == []
    ranks = Ranks(master=False, others_ok_after_prep=False)  # rank 0's prep failed
    with pytest.raises(DataPrepError,
                       match=r"^data preparation failed on rank 0 \(see its message\)$"):
        ensure(root, printed, proc=ranks)
    # a shard check that failed on another rank (here the data is fine): every rank stops, none
    # prepares
    write_shards(root, "val", [100])
    write_shards(root, "train", [300])
    with pytest.raises(DataPrepError, match="the data check failed on another rank"):
        ensure(root, printed, proc=Ranks(others_ok=False))


def test_ensure_prepared_takes_shards_with_no_manifest_as_they_are(data, monkeypatch):
    monkeypatch.setattr(fineweb, "prepare", lambda *a, **k: pytest.fail("prepared hand-made"))
    status = ensure(data, [], inputs_given=False)
    assert not status.has_manifest


@pytest.mark.parametrize("only", ["train", "val"])
def test_a_missing_split_is_named(tmp_path, monkeypatch, only):
    monkeypatch.setattr(fineweb, "prepare", lambda *a, **k: pytest.fail("prepared a split"))
    root = str(tmp_path / "data")
    write_shards(root, only, [500, 400])
    missing = "val" if only == "train" else "train"
    with pytest.raises(DataPrepError,
                       match=rf"^no {missing} shard in {re.escape(root)} \(2 {only} shards, "
                             rf"but no file matching \*_{missing}_\[0-9\]\*\.npy\)"):
        ensure(root, [])


# -----------------------------------------------------------------------------
# data can't be mixed: the manifest check, the lock, two real fineweb.py processes

@pytest.fixture
def prepared(tmp_path):
    """A complete prep of 5 shards (val 300 tokens, train 1000 each, the last shorter): (root,
    corpus)."""
    src = write_docs(tmp_path / "d.jsonl", make_docs(40, seed=22))
    root = str(tmp_path / "data")
    paths = prepare(root, inputs=[src], shard_size=1000, val_tokens=300, max_tokens=4000,
                    num_proc=1, progress=False)
    assert [len(np.load(p)) for p in paths] == [300, 1000, 1000, 1000, 700]
    return root, src


def edit_manifest(root, change):
    path = os.path.join(root, fineweb.MANIFEST)
    manifest = json.loads(open(path).read())
    change(manifest)
    open(path, "w").write(json.dumps(manifest))


def test_ensure_prepared_checks_headers_against_the_manifest_not_tokens(prepared, monkeypatch):
    root, _ = prepared
    monkeypatch.setattr(fineweb, "_check_token_ids", lambda *a: pytest.fail("read every token"))
    monkeypatch.setattr(fineweb, "prepare", lambda *a, **k: pytest.fail("prepared a whole prep"))
    status = ensure(root, [])
    assert status.complete and status.shards == 5


def shard(root, index):
    return os.path.join(root, fineweb.shard_name(index, prefix=fineweb.LOCAL_SHARD_PREFIX))


@pytest.mark.parametrize("damage, message", [
    (lambda root: np.save(shard(root, 5), np.ones(50, np.uint16)),
     "(5 train shards on disk, 4 recorded; not recorded: text_train_000005.npy)"),
    (lambda root: os.remove(shard(root, 2)),
     "(3 train shards on disk, 4 recorded; missing: text_train_000002.npy)"),
    (lambda root: np.save(shard(root, 3), np.ones(700, np.uint16)),
     "(text_train_000003.npy holds 700 tokens, 1,000 recorded)"),
    (lambda root: edit_manifest(root, lambda m: m["args"].update(shard_size=2000)),
     "(text_train_000001.npy holds 1,000 tokens; the recorded shard size is 2,000)"),
    (lambda root: edit_manifest(root, lambda m: m["args"].update(val_tokens=200)),
     "(text_val_000000.npy holds 300 tokens; the recorded shard size is 1,000 and val size 200)"),
])
def test_ensure_prepared_refuses_shards_that_do_not_match_the_manifest(prepared, damage, message):
    root, _ = prepared
    damage(root)
    with pytest.raises(DataPrepError) as e:
        ensure(root, [])
    assert str(e.value) == (f"{root} does not match its manifest.json {message}: the directory was "
                            f"mixed or changed after its prep: delete it and prepare it again")


def test_ensure_prepared_refuses_another_tokenizer_and_a_small_vocabulary(prepared):
    root, _ = prepared
    with pytest.raises(DataPrepError, match="holds gpt2 token ids up to 50256, which a model "
                                            "with vocab_size 1000"):
        ensure(root, [], vocab_size=1000)
    edit_manifest(root, lambda m: m["args"].update(tokenizer="cl100k_base"))
    with pytest.raises(DataPrepError,
                       match=f"{re.escape(root)} was tokenized with 'cl100k_base', not the "
                             f"run's GPT-2's BPE: give --tokenizer"):
        ensure(root, [])


def test_two_preps_with_different_shard_sizes_one_after_the_other(prepared, tmp_path):
    """Two preps into one folder, in turn: the second is refused and the first one's shards stay as
    they were."""
    root, src = prepared
    before = shard_bytes(root)
    r = cli("--input", src, "--data_root", root, "--shard_size", 700, "--val_shard_tokens", 300,
            "--max_tokens", 4000)
    assert_one_line_error(r, root, "different arguments (shard_size: 1000 -> 700)")
    assert shard_bytes(root) == before
    # what two runs at once would leave without the lock: shards of both, the manifest of one
    other = str(tmp_path / "other")
    prepare(other, inputs=[src], shard_size=700, val_tokens=300, max_tokens=4000, num_proc=1,
            progress=False)
    for name in (fineweb.MANIFEST, os.path.basename(shard(root, 5)),
                 os.path.basename(shard(root, 6))):
        os.replace(os.path.join(other, name), os.path.join(root, name))
    with pytest.raises(DataPrepError, match=f"^{re.escape(root)} does not match its manifest.json "
                                            f"\\(text_train_000001.npy holds 1,000 tokens, 700 "
                                            f"recorded\\)"):
        ensure(root, [])


def test_a_held_lock_refuses_a_second_prep(tmp_path):
    src = write_docs(tmp_path / "d.jsonl", make_docs(10, seed=23))
    root = tmp_path / "data"
    root.mkdir()
    with fineweb._prep_lock(str(root)):  # flock: another open is refused, in this process too
        holder = json.loads((root / fineweb.LOCK_HOLDER).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(DataPrepError) as e:
            prepare(root, inputs=[src], num_proc=1, progress=False)
        assert str(e.value).startswith(f"{root} is being prepared by another process (pid "
                                       f"{os.getpid()} on {holder['host']}, since "
                                       f"{holder['started']}: python ")
        assert sorted(os.listdir(root)) == [fineweb.LOCK, fineweb.LOCK_HOLDER]  # nothing written
    assert sorted(os.listdir(root)) == [fineweb.LOCK]  # released, the holder file gone
    assert prepare(root, inputs=[src], num_proc=1, progress=False)


HOLD_THE_LOCK = """
import os, sys, time
sys.path.insert(0, {repo!r})
import fineweb
real_write_shards = fineweb.write_shards

def write_shards_when_told(*args, **kwargs):  # the lock is held from here on
    open({holding!r}, "w").close()
    while not os.path.exists({go!r}):
        time.sleep(0.01)
    return real_write_shards(*args, **kwargs)

fineweb.write_shards = write_shards_when_told
sys.exit(fineweb.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_two_concurrent_fineweb_processes(tmp_path):
    """A second fineweb.py on a directory another one is writing is refused with the holder named,
    whatever its arguments; the first one finishes unmixed. The first is held at its first shard
    until the second has run."""
    src = write_docs(tmp_path / "d.jsonl", make_docs(40, seed=24))
    root, holding, go = str(tmp_path / "data"), str(tmp_path / "holding"), str(tmp_path / "go")
    first_args = ["--input", src, "--data_root", root, "--shard_size", "1000", "--num_proc", "1"]
    script = HOLD_THE_LOCK.format(repo=REPO, holding=holding, go=go)
    first = subprocess.Popen([sys.executable, "-c", script, *first_args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_LIMIT_S
        while not os.path.exists(holding) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(holding), first.communicate()
        for shard_size in (700, 1000):  # other arguments, and the same ones
            r = cli("--input", src, "--data_root", root, "--shard_size", shard_size,
                    "--num_proc", 1)
            assert_one_line_error(r, f"{root} is being prepared by another process (pid "
                                     f"{first.pid} on {socket.gethostname()}, since ",
                                  "--shard_size 1000", "wait for it to end")
        assert not fineweb.list_shards(root, "val")
        assert not os.path.exists(os.path.join(root, fineweb.MANIFEST))
    finally:
        open(go, "w").close()
        out, err = first.communicate(timeout=HANG_LIMIT_S)
    assert first.returncode == 0, err
    reference = prepare(tmp_path / "reference", inputs=[src], shard_size=1000, num_proc=1,
                        progress=False)
    assert shard_bytes(root) == shard_bytes(os.path.dirname(reference[0]))
    # the lock is free again: the same command finds the prep complete, another shard size is
    # refused
    assert cli(*first_args).returncode == 0
    r = cli("--input", src, "--data_root", root, "--shard_size", 700)
    assert_one_line_error(r, "different arguments (shard_size: 1000 -> 700; val_tokens: 1000 "
                             "-> 700)")


# -----------------------------------------------------------------------------
# a full disk: atomic_write (shards, manifests, HellaSwag caches, checkpoints, log.txt) and the prep

def write_then_fail(err, after=5000):
    def write(f):
        f.write(b"x" * after)
        f.flush()  # on disk, as a real write that filled the disk would be
        raise OSError(err, os.strerror(err))
    return write


@pytest.mark.parametrize("err, what", [(errno.ENOSPC, "no space left on device"),
                                       (errno.EDQUOT, "disk quota exceeded")])
def test_atomic_write_disk_full_keeps_the_old_file(tmp_path, err, what):
    path = tmp_path / "model_00010.pt"
    path.write_bytes(b"the good checkpoint")
    with pytest.raises(common.DiskFullError) as e:
        common.atomic_write(str(path), write_then_fail(err))
    assert isinstance(e.value, OSError) and e.value.errno == err and e.value.written == 5000
    free = e.value.free
    assert free is not None and abs(free - shutil.disk_usage(tmp_path).free) < 1 << 30
    assert str(e.value) == (f"{what} writing {path} ({common.human_bytes(free)} free on its "
                            f"filesystem, 4.9 KiB written); it was not written: free some space "
                            f"and run again")
    assert os.listdir(tmp_path) == ["model_00010.pt"]
    assert path.read_bytes() == b"the good checkpoint"


def test_atomic_write_finds_a_wrapped_disk_full_and_passes_other_errors_on(tmp_path):
    def torch_like(f):  # torch.save raises RuntimeError("... unexpected pos ...") from the OSError
        try:
            write_then_fail(errno.ENOSPC)(f)
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 "
                               "vs 598") from e
    with pytest.raises(common.DiskFullError, match="no space left on device writing"):
        common.atomic_write(str(tmp_path / "a.pt"), torch_like)
    for error in (OSError(errno.EIO, "Input/output error"), OSError("42 requested and 7 written"),
                  ValueError("bad")):
        def fail(f, error=error):
            f.write(b"data")
            raise error
        with pytest.raises(type(error)) as e:
            common.atomic_write(str(tmp_path / "b.npy"), fail)
        assert e.value is error  # not taken for a full disk: the probe write fitted
    assert os.listdir(tmp_path) == []


def test_human_bytes():
    assert [common.human_bytes(n) for n in (0, 1023, 1024, 5000, 3 << 20, 5 << 50)] == \
        ["0 B", "1,023 B", "1.0 KiB", "4.9 KiB", "3.0 MiB", "5,120.0 TiB"]


def fail_shard_write(monkeypatch, index, err=errno.ENOSPC):
    """The np.save of shard `index` (the index-th np.save of a prep) writes half of it, then the
    disk is full."""
    real_save, calls = np.save, []

    def save(f, array, *a, **k):
        calls.append(array)
        if len(calls) == index + 1:
            f.write(b"\x93NUMPY" + b"\0" * (array.nbytes // 2))
            f.flush()
            raise OSError(err, os.strerror(err))
        return real_save(f, array, *a, **k)
    monkeypatch.setattr(fineweb.np, "save", save)


def test_prep_on_a_full_disk_says_one_line_and_resumes(tmp_path, monkeypatch, capsys):
    src = write_docs(tmp_path / "d.jsonl", make_docs(40, seed=25))
    out = str(tmp_path / "out")
    args = ["--input", src, "--data_root", out, "--shard_size", "1000", "--num_proc", "1"]
    with monkeypatch.context() as m:
        fail_shard_write(m, 3)
        assert fineweb.main(args) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: no space left on device writing {shard(out, 3)} (")
    assert (" free on its filesystem, 1,006 B written of about 2.1 KiB); it was not written"
            in lines[0])
    # nothing partial under a shard name, no temp file; the manifest lists the three finished shards
    assert sorted(os.listdir(out)) == sorted([fineweb.LOCK, fineweb.MANIFEST]
                                             + [os.path.basename(shard(out, i)) for i in range(3)])
    assert fineweb.prep_status(out).shards == 3
    assert fineweb.main(args) == 0  # space freed: the same command finishes it
    reference = prepare(tmp_path / "reference", inputs=[src], shard_size=1000, num_proc=1,
                        progress=False)
    assert shard_bytes(out) == shard_bytes(os.path.dirname(reference[0]))


def test_ensure_prepared_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    src = write_docs(tmp_path / "d.jsonl", make_docs(40, seed=25))
    root = str(tmp_path / "data")
    fail_shard_write(monkeypatch, 0)
    with pytest.raises(DataPrepError) as e:
        ensure(root, [], inputs=[src])
    assert str(e.value).startswith(f"preparing {root} failed: no space left on device writing "
                                   f"{shard(root, 0)} (")
    assert "\n" not in str(e.value) and not fineweb.list_shards(root, "val")


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 256 KiB tmpfs (root only: skipped where mount is not permitted); unmounted
    afterwards."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.slow
def test_prep_fills_a_real_tmpfs_then_resumes(tmp_path, tiny_tmpfs, enc):
    docs = make_docs(1500, seed=26)  # ~180K tokens, 360 KB of shards: more than 256 KiB
    src = write_docs(tmp_path / "d.jsonl", docs)
    out = str(tiny_tmpfs / "data")
    args = ("--input", src, "--data_root", out, "--shard_size", 20_000, "--num_proc", 1)
    r = cli(*args)
    assert_one_line_error(r, "no space left on device writing " + os.path.join(out, ""),
                          " free on its filesystem")
    status = fineweb.prep_status(out)
    assert not status.complete and status.shards >= 3
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    for written in json.loads(open(os.path.join(out, fineweb.MANIFEST)).read())["shards"]:
        # whole, as recorded
        assert len(np.load(os.path.join(out, written["file"]))) == written["tokens"]
    subprocess.run(["mount", "-o", "remount,size=2m", str(tiny_tmpfs)], check=True)  # space freed
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    paths = fineweb.list_shards(out, "val") + fineweb.list_shards(out, "train")
    assert np.array_equal(load(paths), expected_tokens(enc, docs))


# -----------------------------------------------------------------------------
# files others can read: the umask, not mkstemp's 0600

@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_written_files_follow_the_umask(tmp_path, umask):
    src = write_docs(tmp_path / "d.jsonl", make_docs(10, seed=27))
    old = os.umask(umask)
    try:
        assert common.umask() == umask
        common.atomic_write(str(tmp_path / "log.txt"), lambda f: f.write(b"0 train 10.9\n"))
        paths = prepare(tmp_path / "out", inputs=[src], shard_size=500, num_proc=1, progress=False)
    finally:
        os.umask(old)
    for path in [str(tmp_path / "log.txt"), str(tmp_path / "out" / fineweb.MANIFEST), *paths]:
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask, path
