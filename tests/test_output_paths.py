"""The commands' outputs checked before any work: eval's --results and --examples (files written
after the whole evaluation) and export's --out (a directory written after the checkpoint is read)
are refused in one line when they could not be written, or would write over each other, an input
or a directory; nothing of the user's is touched. sample writes no file.

A refusal that comes before any work is shown by a --checkpoint that does not exist and an
--eval_dir that must not appear: a check made after the model was loaded would say so instead."""
import json
import os
from dataclasses import asdict

import pytest
import torch

from helpers import assert_one_line_error, run_cli, tiny_model, write_core_bundle

MISSING_CKPT = "/nonexistent/model.pt"


def core_refused(tmp_path, *flags, ckpt=MISSING_CKPT):
    """`eval --tasks core` of ckpt with flags; the eval dir it would install into is never made."""
    ed = tmp_path / "never_made"
    r = run_cli("eval", "--tasks", "core", "--checkpoint", ckpt, "--device", "cpu",
                "--eval_bundle", str(tmp_path / "no_bundle"), "--eval_dir", str(ed), *flags)
    assert not ed.exists()
    assert r.stdout == ""
    return r


@pytest.fixture
def mine(tmp_path):
    """A folder of the user's files (one in a subfolder), and their bytes to compare after."""
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "r.json").write_bytes(b"my results\n")
    (folder / "e.jsonl").write_bytes(b"my examples\n")
    (folder / "sub" / "keep.txt").write_bytes(b"keep\n")
    return folder


def snapshot(folder):
    """{path under folder: bytes} of every file, symlinks followed (to show nothing changed)."""
    return {os.path.relpath(os.path.join(top, n), folder): open(os.path.join(top, n), "rb").read()
            for top, _, names in os.walk(folder) for n in names}


# ===== eval: --results and --examples ============================================================
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_the_same_file_twice_is_refused_however_spelled(tmp_path, mine, monkeypatch, overwrite):
    before = snapshot(mine)
    os.symlink(mine / "r.json", mine / "link.json")
    monkeypatch.chdir(mine)
    spellings = [("r.json", "r.json"), ("r.json", str(mine / "r.json")),
                 ("r.json", "./sub/../r.json"), ("r.json", "link.json"),
                 ("new.json", "./new.json")]  # a file that does not exist yet is no different
    for results, examples in spellings:
        r = core_refused(tmp_path, "--results", results, "--examples", examples, *overwrite)
        assert_one_line_error(r, "--results and --examples name the same file", examples)
    os.remove(mine / "link.json")
    assert snapshot(mine) == before and not (mine / "new.json").exists()


def test_an_output_that_is_an_input_is_refused(tmp_path, mine):
    ckpt = mine / "model.pt"
    torch.save({"model": tiny_model().state_dict(), "config": asdict(tiny_model().config)}, ckpt)
    before = snapshot(mine)
    r = core_refused(tmp_path, "--results", str(ckpt), "--overwrite", ckpt=str(ckpt))
    assert_one_line_error(r, "--checkpoint and --results name the same file", str(ckpt))
    zip_path = mine / "bundle.zip"
    zip_path.write_bytes(b"PK")
    before = snapshot(mine)
    r = run_cli("eval", "--tasks", "core", "--checkpoint", MISSING_CKPT, "--eval_bundle",
                str(zip_path), "--eval_dir", str(tmp_path / "ed"), "--examples", str(zip_path),
                "--overwrite")
    assert_one_line_error(r, "--eval_bundle and --examples name the same file")
    assert snapshot(mine) == before and not (tmp_path / "ed").exists()


@pytest.mark.parametrize("flag", ["--results", "--examples"])
def test_a_directory_is_refused_even_with_overwrite(tmp_path, mine, flag):
    before = snapshot(mine)
    for overwrite in ([], ["--overwrite"]):
        r = core_refused(tmp_path, flag, str(mine / "sub"), *overwrite)
        assert_one_line_error(r, f"{flag} {mine / 'sub'} is a directory")
        r = core_refused(tmp_path, flag, str(mine / "sub") + "/", *overwrite)
        assert_one_line_error(r, "is a directory")
    assert snapshot(mine) == before


def test_what_is_not_a_regular_file_is_refused(tmp_path, mine):
    """/dev/null with --overwrite would be replaced (as root) by a rename; a path ending in / can
    only be a folder."""
    r = core_refused(tmp_path, "--results", os.devnull, "--overwrite")
    assert_one_line_error(r, f"--results {os.devnull} is not a regular file")
    r = core_refused(tmp_path, "--examples", str(mine / "new") + "/")
    assert_one_line_error(r, "--examples", "is not a regular file")
    assert not (mine / "new").exists()


@pytest.mark.parametrize("flag", ["--results", "--examples"])
def test_an_empty_path_is_refused(tmp_path, flag):
    assert_one_line_error(core_refused(tmp_path, flag, ""), f"{flag} is empty")


@pytest.mark.parametrize("flag", ["--eval_bundle", "--eval_dir", "--hellaswag_dir"])
def test_an_empty_input_or_data_folder_is_refused_not_defaulted(tmp_path, flag):
    for tasks in ("core", "hellaswag"):
        r = run_cli("eval", "--tasks", tasks, "--checkpoint", MISSING_CKPT, "--device", "cpu",
                    flag, "")
        assert_one_line_error(r, f"{flag} is empty")


@pytest.mark.parametrize("flag", ["--results", "--examples"])
def test_an_existing_file_needs_overwrite(tmp_path, mine, flag):
    before = snapshot(mine)
    path = str(mine / ("r.json" if flag == "--results" else "e.jsonl"))
    assert_one_line_error(core_refused(tmp_path, flag, path), f"{flag} {path} exists",
                          "give --overwrite")
    assert snapshot(mine) == before


def unwritable_places(tmp_path):
    """Folders no file can be made in, by name: under a file, missing, /proc (where even root
    cannot create a file), /sys (where os.access tells root yes: only the probe file says no), and
    a read-only folder where the tests do not run as root (root writes there all the same)."""
    (tmp_path / "a_file").write_bytes(b"x")
    places = {"under_a_file": (tmp_path / "a_file" / "out", "is not a folder"),
              "missing": (tmp_path / "no" / "such" / "out", "its folder does not exist"),
              "proc": ("/proc/self/out", "cannot write in /proc/self")}
    if os.path.isdir("/sys/kernel"):
        places["sys"] = ("/sys/kernel/out", "cannot write in /sys/kernel")
    if os.geteuid() != 0:
        ro = tmp_path / "read_only"
        ro.mkdir()
        ro.chmod(0o555)
        places["read_only"] = (ro / "out", f"cannot write in {ro}")
    return places


@pytest.mark.parametrize("flag", ["--results", "--examples"])
def test_an_unwritable_folder_is_refused_before_any_work(tmp_path, flag):
    try:
        for where, (path, message) in unwritable_places(tmp_path).items():
            r = core_refused(tmp_path, flag, str(path), "--overwrite")
            assert_one_line_error(r, f"{flag} {path}", message)
            assert not os.path.lexists(path), where
        assert (tmp_path / "a_file").read_bytes() == b"x"
        if (tmp_path / "read_only").exists():
            assert os.listdir(tmp_path / "read_only") == []
    finally:
        if (tmp_path / "read_only").exists():
            (tmp_path / "read_only").chmod(0o755)


def test_good_outputs_are_written_and_the_check_leaves_nothing(tmp_path, mine, monkeypatch):
    """A checked path writes as before: over the user's files with --overwrite, each its own, and
    the probe files of the check gone."""
    ckpt = tmp_path / "model.pt"
    model = tiny_model()
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, ckpt)
    bundle = write_core_bundle(str(tmp_path / "bundle"), n=8)
    monkeypatch.chdir(mine)
    r = run_cli("eval", "--tasks", "lm_zero", "--checkpoint", str(ckpt), "--device", "cpu",
                "--eval_bundle", bundle, "--eval_dir", str(tmp_path / "ed"), "--max_per_task",
                "2", "--results", "r.json", "--examples", str(mine / "e.jsonl"), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert set(json.loads((mine / "r.json").read_text())["tasks"]) == {"lm_zero"}
    assert len((mine / "e.jsonl").read_text().splitlines()) == 2
    assert sorted(os.listdir(mine)) == ["e.jsonl", "r.json", "sub"]


def test_hellaswag_takes_no_file_outputs(tmp_path):
    for flag in ("--results", "--examples"):
        r = run_cli("eval", "--checkpoint", MISSING_CKPT, "--device", "cpu", flag,
                    str(tmp_path / "x.json"))
        assert_one_line_error(r, f"{flag[2:]} goes with CORE's tasks")


# ===== export's --out ============================================================================
def test_export_out_is_checked_before_the_checkpoint_is_read(tmp_path, mine):
    before = snapshot(mine)
    r = run_cli("export", "--checkpoint", MISSING_CKPT, "--out", "")
    assert_one_line_error(r, "--out is empty")
    for overwrite_target in (mine, mine / "r.json"):  # not an empty directory: never written over
        r = run_cli("export", "--checkpoint", MISSING_CKPT, "--out", str(overwrite_target))
        assert_one_line_error(r, f"--out {overwrite_target} exists and is not an empty directory")
    try:
        for where, (path, message) in unwritable_places(tmp_path).items():
            r = run_cli("export", "--checkpoint", MISSING_CKPT, "--out", str(path))
            assert_one_line_error(r, f"--out {path}", message)
            assert not os.path.lexists(path), where
    finally:
        if (tmp_path / "read_only").exists():
            (tmp_path / "read_only").chmod(0o755)
    assert snapshot(mine) == before

