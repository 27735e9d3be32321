"""Preparing conversations (chat.prepare, chat.open_split): local .jsonl/.parquet files and a HF
dataset (a local hub-style folder: no network) into token and mask arrays on disk, every kind of
bad row counted, the held-out val split, the manifest's checks, the one-line refusals, and nothing
left behind by a failed or interrupted prep."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import chat
from helpers import REPO, write_jsonl

SYSTEM = {"role": "system", "content": "Answer in one line."}


def conversation(i):
    """A small made-up conversation, different for each i: one to three turns, some with a system
    message."""
    messages = [SYSTEM] if i % 3 == 0 else []
    for turn in range(1 + i % 3):
        messages += [{"role": "user", "content": f"What is {i} times {turn + 2}?"},
                     {"role": "assistant", "content": f"{i} times {turn + 2} is {i * (turn + 2)}."}]
    return messages


GOOD = [conversation(i) for i in range(60)]
BAD_ROWS = {  # issue 56's kinds of bad row: a .jsonl line, and the reason the note gives
    "not JSON": ('{"messages": [', "not JSON"),
    "no messages": (json.dumps({"text": "hello"}), "no messages"),
    "unknown role": (json.dumps({"messages": [{"role": "bot", "content": "hi"}]}),
                     "unknown role 'bot'"),
    "roles out of order": (json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}),
                           "roles out of order"),
    "empty content": (json.dumps({"messages": [{"role": "user", "content": " "},
                                               {"role": "assistant", "content": "x"}]}),
                      "message 0 has no content"),
    "no assistant turn": (json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                          "no assistant turn"),
}


def write_parquet(path, rows, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": rows, **columns}), str(path))
    return str(path)


def key(ids):
    """docs/chat.md's val rule, written out: SHA-256 of the uint16 ids, its first 8 bytes as a
    little-endian number."""
    digest = hashlib.sha256(np.asarray(ids, dtype="<u2").tobytes()).digest()
    return int.from_bytes(digest[:8], "little")


def expected_split(conversations, enc, fraction):
    """(train, val) as lists of conversations, by the rule in docs/chat.md."""
    keys = [key(chat.render(c, enc)[0]) for c in conversations]
    val = [i for i, k in enumerate(keys) if k < fraction * 2**64]
    train = [i for i in range(len(keys)) if i not in val]
    if not train and val:
        train = [max(val, key=keys.__getitem__)]
        val.remove(train[0])
    if not val and len(train) >= 2:
        val = [min(train, key=keys.__getitem__)]
        train.remove(val[0])
    return [conversations[i] for i in train], [conversations[i] for i in val]


def assert_split(folder, split, conversations, enc):
    """The split holds exactly these conversations, in this order, each as render() gives it."""
    data = chat.open_split(folder, split)
    assert len(data) == len(conversations)
    assert data.ids.dtype == np.uint16 and data.mask.dtype == np.uint8
    assert data.starts.dtype == np.int64 and data.starts[0] == 0
    for i, messages in enumerate(conversations):
        ids, mask = chat.render(messages, enc)
        got_ids, got_mask = data.conversation(i)
        assert got_ids.tolist() == ids and got_mask.tolist() == mask
    assert data.starts[-1] == len(data.ids) == len(data.mask)
    ids, mask, starts = data  # as ChatLoader takes it
    assert ids is data.ids and mask is data.mask and starts is data.starts
    return data


def lines():
    said = []
    return said, said.append


@pytest.fixture
def talk(tmp_path):
    """A .jsonl file of the first 40 conversations and a .parquet of the other 20."""
    jsonl = write_jsonl(tmp_path / "talk.jsonl", [{"messages": c} for c in GOOD[:40]])
    parquet = write_parquet(tmp_path / "more.parquet", GOOD[40:])
    return jsonl, parquet


def test_files_round_trip_with_a_deterministic_disjoint_val_split(tmp_path, talk, enc):
    said, say = lines()
    out = chat.prepare(list(talk), tmp_path / "out", val_fraction=0.2, print0=say,
                       progress=False)
    assert out == str(tmp_path / "out")
    train, val = expected_split(GOOD, enc, 0.2)
    assert 5 <= len(val) <= 20 and len(train) + len(val) == 60  # both splits, disjoint
    assert_split(out, "train", train, enc)
    assert_split(out, "val", val, enc)
    manifest = chat.data_manifest(out)
    assert manifest["args"]["files"][0]["path"] == os.path.realpath(talk[0])
    tokens = sum(len(chat.render(c, enc)[0]) for c in val)
    trained = sum(sum(chat.render(c, enc)[1]) for c in val)
    assert manifest["counts"]["val"] == {"conversations": len(val), "tokens": tokens,
                                         "supervised": trained}
    assert manifest["counts"]["bad_rows"] == 0 and manifest["bad_rows"] == []
    for name, record in manifest["files"].items():
        path = os.path.join(out, name)
        with open(path, "rb") as f:
            assert record == {"sha256": hashlib.sha256(f.read()).hexdigest(),
                              "bytes": os.path.getsize(path)}
    assert said == [f"{out}: {len(train)} train and {len(val)} val conversations, "
                    f"{manifest['counts']['train']['tokens'] + tokens:,} tokens "
                    f"({manifest['counts']['train']['supervised'] + trained:,} trained)"]
    assert sorted(os.listdir(out)) == sorted([*chat.DATA_FILES, "manifest.json",
                                              ".chat_data.lock"])  # no staging, no holder
    # the same sources in another order and folder: the same val conversations
    again = chat.prepare(list(reversed(talk)), tmp_path / "again", val_fraction=0.2,
                         print0=say, progress=False)
    assert_split(again, "val", expected_split(GOOD[40:] + GOOD[:40], enc, 0.2)[1], enc)
    assert sorted(map(str, val)) == sorted(map(str, expected_split(GOOD[40:] + GOOD[:40], enc,
                                                                   0.2)[1]))


def test_val_holds_one_conversation_of_two_and_none_of_one(tmp_path, enc):
    two = write_jsonl(tmp_path / "two.jsonl", [{"messages": c} for c in GOOD[:2]])
    out = chat.prepare(two, tmp_path / "two", val_fraction=1e-9, print0=str, progress=False)
    train, val = expected_split(GOOD[:2], enc, 1e-9)
    assert len(val) == 1 and len(train) == 1
    assert_split(out, "train", train, enc)
    assert_split(out, "val", val, enc)
    # nearly all to val by the hash: train still gets one, the largest key
    out = chat.prepare(two, tmp_path / "most", val_fraction=1 - 1e-9, print0=str, progress=False)
    assert len(chat.open_split(out, "train")) == 1 and len(chat.open_split(out, "val")) == 1
    one = write_jsonl(tmp_path / "one.jsonl", [{"messages": GOOD[0]}])
    out = chat.prepare(one, tmp_path / "one", val_fraction=1 - 1e-9, print0=str, progress=False)
    assert_split(out, "train", GOOD[:1], enc)
    empty = assert_split(out, "val", [], enc)
    assert empty.starts.tolist() == [0] and len(empty.ids) == 0


def test_every_kind_of_bad_row_is_counted_with_its_first_line(tmp_path, enc):
    files = []
    for k, (kind, (line, _)) in enumerate(BAD_ROWS.items()):
        path = str(tmp_path / f"{kind.replace(' ', '_')}.jsonl")
        with open(path, "w") as f:  # a good row, the bad one at line 2, another bad, a good one
            f.write(json.dumps({"messages": GOOD[2 * k]}) + "\n" + line + "\n" + line + "\n")
            f.write(json.dumps({"messages": GOOD[2 * k + 1]}) + "\n")
        files.append(path)
    rows = list(GOOD[:12]) + [[{"role": "user", "content": "no answer"}]]
    files.append(write_parquet(tmp_path / "rows.parquet", rows))
    said, say = lines()
    out = chat.prepare(files, tmp_path / "out", print0=say, progress=False)
    notes = [f"{path}: 2 bad rows skipped, the first at line 2: " for path in files[:-1]]
    assert len(said) == len(files) + 1  # one line a file, then the summary
    for note, (_, reason), line in zip(notes, BAD_ROWS.values(), said):
        assert line.startswith(note) and reason in line, line
    assert said[-2] == f"{files[-1]}: 1 bad row skipped, the first at row 13: no assistant turn"
    manifest = chat.data_manifest(out)
    assert manifest["counts"]["bad_rows"] == 13
    assert [b["rows"] for b in manifest["bad_rows"]] == [2] * 6 + [1]
    train, val = expected_split(GOOD[:12] + GOOD[:12], enc, chat.VAL_FRACTION)
    assert_split(out, "train", train, enc)
    assert_split(out, "val", val, enc)


def test_a_file_with_no_usable_row_is_one_line_exit_1_and_leaves_nothing(tmp_path, talk, capsys):
    from common import run_cli

    bad = str(tmp_path / "bad.jsonl")
    with open(bad, "w") as f:
        f.write("\n".join(line for line, _ in BAD_ROWS.values()) + "\n")
    out = tmp_path / "deep" / "out"
    with pytest.raises(chat.ChatDataError, match=f"^{bad}: no usable conversation .6 bad, the "
                                                 f"first at line 1: not JSON.$"):
        chat.prepare([talk[0], bad], out, print0=str, progress=False)
    assert not (tmp_path / "deep").exists()
    assert run_cli(lambda: chat.prepare([bad], out, print0=str, progress=False)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: no usable conversation")
    assert not (tmp_path / "deep").exists()


@pytest.mark.parametrize("sources, words", [
    ([], "no conversation files given"),
    (["talk.csv"], "conversations come as .jsonl or .parquet files"),
    (["missing.jsonl"], "missing.jsonl: no such file"),
    (["talk.jsonl", "some/dataset"], "some/dataset names a dataset"),
])
def test_bad_sources_are_one_line(tmp_path, talk, sources, words, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(chat.ChatDataError, match=words):
        chat.prepare(sources, tmp_path / "out", print0=str, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_second_prep_does_nothing_and_other_sources_are_refused(tmp_path, talk, monkeypatch):
    out = chat.prepare(talk[0], tmp_path / "out", print0=str, progress=False)
    before = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out)}

    def never(*args):
        raise AssertionError("a finished prep was read again")
    monkeypatch.setattr(chat, "read_conversations", never)
    said, say = lines()
    assert chat.prepare([talk[0], talk[0]], out, print0=say, progress=False) == out
    assert said == [] and before == {n: os.stat(os.path.join(out, n)).st_mtime_ns
                                     for n in os.listdir(out)}
    with pytest.raises(chat.ChatDataError, match="prepared from other sources or settings .the "
                                                 "files differ"):
        chat.prepare(list(talk), out, print0=str, progress=False)
    with pytest.raises(chat.ChatDataError, match="val_fraction: 0.01 -> 0.5"):
        chat.prepare(talk[0], out, val_fraction=0.5, print0=str, progress=False)
    with pytest.raises(chat.ChatDataError, match="dataset: None -> 'HuggingFaceTB/smol-smoltalk'"):
        chat.prepare(None, out, print0=str, progress=False)
    os.utime(talk[0], ns=(before["manifest.json"], before["manifest.json"] + 5 * 10**9))
    with pytest.raises(chat.ChatDataError, match="the files differ"):  # an edited file
        chat.prepare(talk[0], out, print0=str, progress=False)
    with pytest.raises(chat.ChatDataError, match="between 0 and 1"):
        chat.prepare(talk[0], tmp_path / "other", val_fraction=0, print0=str, progress=False)


def test_open_split_checks_the_manifest(tmp_path, talk, monkeypatch):
    out = chat.prepare(list(talk), tmp_path / "out", print0=str, progress=False)
    hashed = []
    real = chat.sha256_file
    monkeypatch.setattr(chat, "sha256_file", lambda p: hashed.append(p) or real(p))
    chat.open_split(out, "train")
    chat.open_split(out, "train")  # hashed once in a process
    assert sorted(hashed) == sorted(os.path.join(out, f"train_{n}.npy")
                                    for n in ("ids", "mask", "starts"))
    ids = os.path.join(out, "train_ids.npy")
    st = os.stat(ids)
    with open(ids, "r+b") as f:  # one token changed, the size the same
        f.seek(st.st_size - 2)
        last = f.read(2)
        f.seek(st.st_size - 2)
        f.write(bytes([last[0] ^ 1, last[1]]))
    os.utime(ids, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as any later write leaves it
    with pytest.raises(chat.ChatDataError, match=f"^{ids} changed since the prep"):
        chat.open_split(out, "train")
    with open(ids, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(chat.ChatDataError, match=f"^{ids} is .* bytes, not the"):
        chat.open_split(out, "train")
    with pytest.raises(chat.ChatDataError, match="changed since the prep"):  # and prepare says so
        chat.prepare(list(talk), out, print0=str, progress=False)
    os.remove(os.path.join(out, "val_mask.npy"))
    with pytest.raises(chat.ChatDataError, match="val_mask.npy is missing"):
        chat.open_split(out, "val")
    os.remove(os.path.join(out, "manifest.json"))
    with pytest.raises(chat.ChatDataError, match="holds no prepared conversations"):
        chat.open_split(out, "val")
    with pytest.raises(chat.ChatDataError, match="no split 'test'"):
        chat.open_split(out, "test")


@pytest.mark.parametrize("where", ["while rendering", "writing the manifest", "Ctrl-C"])
def test_an_interrupted_prep_leaves_nothing(tmp_path, talk, monkeypatch, where):
    import common

    if where == "while rendering":
        calls, real = [], chat._render_batch

        def fail(batch, enc):
            calls.append(1)
            if len(calls) % 2 == 0:  # the second batch of each prep
                raise OSError(28, "No space left on device")
            return real(batch, enc)
        monkeypatch.setattr(chat, "DATA_BATCH", 16)
        monkeypatch.setattr(chat, "_render_batch", fail)
        error = OSError
    else:  # the arrays are in place, only the manifest is missing
        real = common.atomic_write

        def fail(path, write, size=None):
            if os.path.basename(path) == "manifest.json":
                assert set(chat.DATA_FILES) <= set(os.listdir(os.path.dirname(path)))
                raise KeyboardInterrupt if where == "Ctrl-C" else OSError(5, "I/O error")
            return real(path, write, size)
        monkeypatch.setattr(common, "atomic_write", fail)
        error = KeyboardInterrupt if where == "Ctrl-C" else OSError
    with pytest.raises(error):
        chat.prepare(list(talk), tmp_path / "new" / "out", print0=str, progress=False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(error):
        chat.prepare(list(talk), tmp_path / "empty", print0=str, progress=False)
    assert os.listdir(tmp_path / "empty") == []  # as it was
    monkeypatch.undo()
    out = chat.prepare(list(talk), tmp_path / "empty", print0=str, progress=False)
    assert len(chat.open_split(out, "train")) + len(chat.open_split(out, "val")) == 60


def test_a_killed_preps_leftovers_are_cleared_and_foreign_files_refused(tmp_path, talk, enc):
    out = tmp_path / "out"
    (out / ".chat_data-staging-x.tmp").mkdir(parents=True)
    (out / ".chat_data-staging-x.tmp" / "train_ids.npy").write_bytes(b"half")
    (out / "train_ids.npy").write_bytes(b"moved, but no manifest")
    chat.prepare(list(talk), out, print0=str, progress=False)
    assert sorted(os.listdir(out)) == sorted([*chat.DATA_FILES, "manifest.json",
                                              ".chat_data.lock"])
    assert_split(out, "train", expected_split(GOOD, enc, chat.VAL_FRACTION)[0], enc)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(chat.ChatDataError, match="holds notes.txt, which is not prepared"):
        chat.prepare(list(talk), tmp_path / "mine", print0=str, progress=False)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]  # untouched
    (tmp_path / "fineweb").mkdir()
    (tmp_path / "fineweb" / "manifest.json").write_text(json.dumps({"args": {}, "shards": []}))
    with pytest.raises(chat.ChatDataError, match="is not a manifest of prepared conversations"):
        chat.prepare(list(talk), tmp_path / "fineweb", print0=str, progress=False)


def test_one_prep_at_a_time(tmp_path, talk):
    from common import dir_lock

    out = tmp_path / "out"
    out.mkdir()
    with dir_lock(str(out), chat.DATA_LOCK, "busy"):  # another prep holds the folder
        with pytest.raises(chat.ChatDataError, match="is being prepared by another process "
                                                     r"\(pid \d+"):
            chat.prepare(list(talk), out, print0=str, progress=False)
    assert sorted(os.listdir(out)) == [".chat_data.lock"]


def test_sigterm_during_a_prep_leaves_nothing(tmp_path, talk):
    # the signal sent by the prep itself, at its second batch: the same moment on every run
    script = f"""
import os, signal, sys
sys.path.insert(0, {REPO!r})
import chat
real, calls = chat._render_batch, []
def render_batch(batch, enc):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(batch, enc)
chat._render_batch, chat.DATA_BATCH = render_batch, 16
chat.prepare({list(talk)!r}, {str(tmp_path / "new" / "out")!r}, progress=False)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "Stopped: SIGTERM" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()


class FakeProc:
    """One rank of a two-process run: agree() is the AND of this rank's flag and the other's."""

    def __init__(self, master, others_ok=True):
        self.master, self.others_ok, self.votes = master, others_ok, []

    def agree(self, ok, long_wait=False):
        self.votes.append((ok, long_wait))
        return ok and self.others_ok


def test_ready_prepares_once_on_the_master(tmp_path, talk):
    said, say = lines()
    out = chat.ready(list(talk), tmp_path / "out", print0=say, progress=False)
    assert chat.ready(list(talk), tmp_path / "out", print0=say, progress=False) == out
    assert len(said) == 1 and "val conversations" in said[0]  # prepared once
    rank1 = FakeProc(master=False)  # after the master: finds it, checks it
    assert chat.ready(list(talk), out, proc=rank1, print0=say, progress=False) == out
    assert rank1.votes == [(True, True)] and len(said) == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "no messages"}])
    with pytest.raises(chat.ChatDataError, match="no usable conversation"):  # the master's line
        chat.ready([bad], tmp_path / "b", proc=FakeProc(master=True), print0=str)
    with pytest.raises(chat.ChatDataError, match="failed on rank 0"):  # the others': no prep
        chat.ready([bad], tmp_path / "b", proc=FakeProc(master=False, others_ok=False),
                   print0=str)
    assert not (tmp_path / "b").exists()


# -----------------------------------------------------------------------------
# a HF dataset: a local folder laid out as a hub dataset repo (datasets reads it offline)

@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """datasets' cache (and its lock files) out of the user's ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def make_hub_repo(root, train, test=None):
    """A folder like HuggingFaceTB/smol-smoltalk's: data/train-*.parquet (and data/test-*), a
    `messages` column and a `source` one."""
    (root / "data").mkdir(parents=True)
    write_parquet(root / "data" / "train-00000-of-00001.parquet", train,
                  source=["made up"] * len(train))
    if test is not None:
        write_parquet(root / "data" / "test-00000-of-00001.parquet", test,
                      source=["made up"] * len(test))
    return str(root)


def test_a_hub_dataset_gives_train_and_its_test_split_as_val(tmp_path, hf_cache, enc):
    no_answer = [{"role": "user", "content": "no answer"}]
    repo = make_hub_repo(tmp_path / "repo", GOOD[:30] + [no_answer, None] + GOOD[30:50],
                         GOOD[50:])
    said, say = lines()
    out = chat.prepare(repo, tmp_path / "out", print0=say, progress=False)
    assert said[0] == (f"{repo} (train split): 2 bad rows skipped, the first at row 31: no "
                       f"assistant turn")
    assert len(said) == 2  # the note, the summary: no note for a clean split
    assert_split(out, "train", GOOD[:50], enc)
    assert_split(out, "val", GOOD[50:], enc)
    manifest = chat.data_manifest(out)
    assert manifest["args"]["dataset"] == os.path.realpath(repo)
    assert manifest["args"]["hf_split"] == ["train", "test"] and manifest["dataset_hash"]
    assert manifest["counts"]["bad_rows"] == 2 and manifest["val"] == "the 'test' split"
    assert chat.prepare(repo, out, print0=say, progress=False) == out and len(said) == 2


def test_the_default_dataset_and_a_dataset_without_test_split(tmp_path, hf_cache, enc,
                                                              monkeypatch):
    import datasets

    repo = make_hub_repo(tmp_path / "repo", GOOD)
    real, asked = datasets.load_dataset_builder, []

    def load(path, **kwargs):  # the default name, read from the local copy
        asked.append((path, kwargs))
        return real(repo, **kwargs)
    monkeypatch.setattr(datasets, "load_dataset_builder", load)
    said, say = lines()
    out = chat.prepare(None, tmp_path / "out", val_fraction=0.2, print0=say, progress=False)
    assert asked == [(chat.DEFAULT_DATASET, {"revision": None})]
    assert said[0].startswith(f"{chat.DEFAULT_DATASET} has no split 'test' (splits: train): "
                              f"val is held out of 'train'")
    train, val = expected_split(GOOD, enc, 0.2)
    assert_split(out, "train", train, enc)
    assert_split(out, "val", val, enc)
    assert chat.data_manifest(out)["args"]["dataset"] == chat.DEFAULT_DATASET


def test_an_offline_hub_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceTB/smol-smoltalk' on the Hub "
                              "(OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset_builder", offline)
    with pytest.raises(chat.ChatDataError) as e:
        chat.prepare(None, tmp_path / "out", print0=str, progress=False)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("the Hugging Face hub is unreachable, cannot load "
                                   "HuggingFaceTB/smol-smoltalk")
    assert ".jsonl/.parquet" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_hub_split_with_no_usable_row_or_no_messages_is_one_line(tmp_path, hf_cache):
    repo = make_hub_repo(tmp_path / "repo", GOOD[:5], [[{"role": "bot", "content": "x"}]])
    with pytest.raises(chat.ChatDataError, match=r"\(test split\): no usable conversation \(1 "
                                                 r"bad, the first at row 1: message 0 has the "
                                                 r"unknown role 'bot'\)$"):
        chat.prepare(repo, tmp_path / "out", print0=str, progress=False)
    assert not (tmp_path / "out").exists()
    plain = tmp_path / "plain"
    (plain / "data").mkdir(parents=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b"]}), str(plain / "data" / "train-0.parquet"))
    with pytest.raises(chat.ChatDataError, match="has no 'messages' column .columns: text"):
        chat.prepare(str(plain), tmp_path / "out", print0=str, progress=False)
    assert not (tmp_path / "out").exists()
