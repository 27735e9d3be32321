"""CORE's eval bundle install against hostile and careless inputs: a folder holding the user's
files, interrupted and killed installs, endless and slow URLs on 127.0.0.1, zip bombs, links,
devices and FIFOs, a manifest that points outside, malformed text, zips and baselines. Each case
asserts one error line, the exit status, and the user's files byte for byte afterwards. Every
server here stops by itself, and every hostile size is a few MiB (the limits are lowered by flag
or by the module's constants where the real ones are large)."""
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict

import pytest
import torch

import core_eval
from helpers import (HANG_LIMIT_S, REPO, Server, assert_one_line_error, edit_line, run_cli,
                     tiny_model, write_core_bundle, zip_folder)


@pytest.fixture(autouse=True)
def no_default_download(monkeypatch):
    """The default URL refuses at once: no test reaches the internet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(core_eval, "BUNDLE_URL", f"http://127.0.0.1:{port}/eval_bundle.zip")
    monkeypatch.delenv("EVAL_BUNDLE_DIR", raising=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = tiny_model()
    path = tmp_path_factory.mktemp("install_ckpt") / "model.pt"
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, path)
    return str(path)


@pytest.fixture
def bundle(tmp_path):
    return write_core_bundle(str(tmp_path / "src"), n=8)


def core(ckpt, *extra):
    return run_cli("eval", "--tasks", "core", "--checkpoint", ckpt, "--device", "cpu",
                   "--max_per_task", "5", *extra)


def snapshot(folder):
    """Everything under folder: {relative path: its bytes, 'dir', or 'link -> target'}."""
    out = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = f"link -> {os.readlink(path)}"
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                with open(path, "rb") as f:
                    out[rel] = f.read()
    return out


def users_folder(root):
    """A folder of the user's with a file in every place a bundle file could go, and a file named
    as our partial downloads once were."""
    files = {"core.yaml": b"mine: 1\n", "eval_meta_data.csv": b"a,b\n1,2\n",
             "eval_data/notes.jsonl": b'{"mine": true}\n', "train_gpt2.py": b"print('mine')\n",
             "mydata.zip.tmp": b"half of my download", ".staging.mine.tmp/keep": b"kept"}
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    return root


# ===== A folder of the user's is never written to ===============================================
def test_a_folder_with_the_users_files_is_refused_untouched(ckpt, bundle, tmp_path):
    ed = users_folder(str(tmp_path / "mine"))
    before = snapshot(ed)
    bundle_zip = zip_folder(bundle, tmp_path / "b.zip")
    for source in (bundle, bundle_zip):
        line = assert_one_line_error(core(ckpt, "--eval_bundle", source, "--eval_dir", ed),
                                     ed, "holds", "core.yaml", "no eval bundle")
        assert "train_gpt2.py" in line or "more" in line
        assert snapshot(ed) == before
    # one file of the user's is enough
    ed2 = str(tmp_path / "one")
    os.makedirs(ed2)
    with open(os.path.join(ed2, "results.json"), "w") as f:
        f.write("{}")
    assert_one_line_error(core(ckpt, "--eval_bundle", bundle, "--eval_dir", ed2),
                          "holds results.json")
    assert os.listdir(ed2) == ["results.json"]


def test_a_bundle_installs_only_its_own_files(ckpt, bundle, tmp_path):
    """A source folder that carries a script and a manifest of its own: neither is installed, and
    the install's own manifest is the one every load checks."""
    for name, data in (("train_gpt2.py", "print('from the bundle')\n"),
                       ("manifest.json", json.dumps({"source": "x", "sha256": {"a": "b"}}))):
        with open(os.path.join(bundle, name), "w") as f:
            f.write(data)
    for form, source in (("dir", bundle), ("zip", zip_folder(bundle, tmp_path / "b.zip"))):
        ed = str(tmp_path / form)
        r = core(ckpt, "--eval_bundle", source, "--eval_dir", ed, "--tasks", "mc_zero")
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(ed)) == [".install.lock", "core.yaml", "eval_data",
                                          "eval_meta_data.csv", "manifest.json"]
        with open(os.path.join(ed, "manifest.json")) as f:
            assert "core.yaml" in json.load(f)["sha256"]
        assert core(ckpt, "--eval_dir", ed, "--tasks", "mc_zero").returncode == 0  # verified


def test_a_failure_at_the_last_step_leaves_the_folder_as_it_was(ckpt, bundle, tmp_path,
                                                               monkeypatch):
    """The manifest cannot be written (a full disk at the very end): every moved file goes, an
    empty folder of the user's is empty again, and a folder the command made is gone."""
    real = core_eval.atomic_write

    def no_manifest(path, write, size=None):
        if path.endswith(core_eval.MANIFEST):
            raise OSError(28, "No space left on device", path)
        return real(path, write, size)
    monkeypatch.setattr(core_eval, "atomic_write", no_manifest)
    empty = tmp_path / "empty"
    empty.mkdir()
    new = tmp_path / "new" / "deeper"
    for ed in (empty, new):
        r = core(ckpt, "--eval_bundle", bundle, "--eval_dir", str(ed))
        assert_one_line_error(r, "manifest.json")
    assert os.listdir(empty) == []
    assert not os.path.exists(tmp_path / "new")


def test_a_killed_install_is_taken_away_by_the_next(ckpt, bundle, tmp_path):
    """What kill -9 leaves mid-install (a staging folder, entries moved in under the journal, no
    manifest) is ours: the next install removes it and installs. The user's file beside it is
    not ours: refused, and everything stays."""
    ed = tmp_path / "ed"
    (ed / "eval_data" / "half").mkdir(parents=True)
    (ed / "core.yaml").write_text("half: moved\n")
    (ed / ".core_eval-install-x1y2.tmp" / "bundle").mkdir(parents=True)
    (ed / ".core_eval-install-x1y2.tmp" / "download.zip").write_bytes(b"PK partial")
    (ed / core_eval.JOURNAL).write_text(json.dumps(["core.yaml", "eval_data"]))
    (ed / "mine.txt").write_text("the user's")
    before = snapshot(ed)
    assert_one_line_error(core(ckpt, "--eval_bundle", bundle, "--eval_dir", str(ed)),
                          "holds mine.txt")
    assert snapshot(ed) == before
    (ed / "mine.txt").unlink()
    r = core(ckpt, "--eval_bundle", bundle, "--eval_dir", str(ed), "--tasks", "mc_zero")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(ed)) == [".install.lock", "core.yaml", "eval_data",
                                      "eval_meta_data.csv", "manifest.json"]
    assert not (ed / "eval_data" / "half").exists()
    core_eval.verify(str(ed))


# ===== Servers on 127.0.0.1 that never end, or crawl ============================================
BODY_LIMIT_S = 120


def drip(handler, every=0.1):
    """A byte at a time, forever as a client sees it (until BODY_LIMIT_S)."""
    handler.send_response(200)
    handler.send_header("Content-Length", str(1 << 30))
    handler.end_headers()
    end = time.monotonic() + BODY_LIMIT_S
    while time.monotonic() < end:
        handler.wfile.write(b"P")
        handler.wfile.flush()
        time.sleep(every)


def endless(handler):
    """64 KiB blocks with no Content-Length, as fast as taken (at most 64 MiB)."""
    handler.send_response(200)
    handler.end_headers()
    block = b"\0" * (1 << 16)
    for _ in range(1024):
        handler.wfile.write(block)


def too_large(handler):
    handler.send_response(200)
    handler.send_header("Content-Length", str(5 << 30))
    handler.end_headers()


@pytest.mark.parametrize("body, flags, words", [
    (drip, ("--download_timeout", "1.5"), ["took over 1.5 s (--download_timeout)"]),
    (endless, ("--max_bundle_mb", "2"), ["more than 2 MiB (--max_bundle_mb)"]),
    (too_large, (), ["(its Content-Length)", "more than 2048 MiB"]),
])
def test_a_url_that_never_ends_is_cut_off(body, flags, words, ckpt, tmp_path):
    ed = tmp_path / "a" / "ed"
    with Server(body) as server:
        r = core(ckpt, "--eval_bundle", server.url, "--eval_dir", str(ed), *flags)
    assert_one_line_error(r, server.url, *words)
    assert os.listdir(tmp_path) == []  # no folder of its own left, no partial file


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_download_undoes_the_install(signum, ckpt, tmp_path):
    """A real process, stopped mid-download: one line, 128 + the signal, nothing left behind: no
    lock, no staging folder, no folder the command made."""
    ed = tmp_path / "made" / "ed"
    with Server(drip) as server:
        cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), "eval", "--tasks", "core",
               "--checkpoint", ckpt, "--device", "cpu", "--eval_bundle", server.url,
               "--eval_dir", str(ed)]
        p = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            assert server.asked.wait(HANG_LIMIT_S), "the download never started"
            # the staging folder is made before the request goes out: there by now
            assert any(n.startswith(core_eval.STAGING) for n in os.listdir(ed)), os.listdir(ed)
            time.sleep(0.3)  # some bytes in
            p.send_signal(signum)
            out, err = p.communicate(timeout=HANG_LIMIT_S)
        finally:
            if p.poll() is None:
                p.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 128 + signum, err
    assert lines == [f"error: interrupted by {signal.Signals(signum).name}"], err
    assert os.listdir(tmp_path) == [], snapshot(tmp_path)


# ===== Zips and folders that are not what they say ===============================================
def zip_with(path, members):
    """A zip of (ZipInfo or name, bytes, compression) members."""
    with zipfile.ZipFile(path, "w") as z:
        for info, data, compression in members:
            z.writestr(info, data, compress_type=compression)
    return str(path)


def bundle_members(bundle, skip=()):
    out = []
    for top, _, names in os.walk(bundle):
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(top, name), bundle).replace(os.sep, "/")
            if rel not in skip:
                with open(os.path.join(top, name), "rb") as f:
                    out.append((rel, f.read(), zipfile.ZIP_DEFLATED))
    return out


def test_a_zip_bomb_and_an_oversized_bundle_are_cut_off(ckpt, bundle, tmp_path):
    task = "eval_data/fixture/mc_zero.jsonl"
    bomb = zip_with(tmp_path / "bomb.zip", bundle_members(bundle, skip=[task]) + [
        (task, b" " * (8 << 20), zipfile.ZIP_DEFLATED)])  # 8 MiB of spaces: ~8 KiB packed
    assert os.path.getsize(bomb) < 64 << 10
    ed = tmp_path / "ed"
    assert_one_line_error(core(ckpt, "--eval_bundle", bomb, "--eval_dir", str(ed)), task,
                          "unpacks to over 100x its packed size")
    big = zip_with(tmp_path / "big.zip", bundle_members(bundle, skip=[task]) + [
        (task, os.urandom(3 << 20), zipfile.ZIP_STORED)])
    assert_one_line_error(core(ckpt, "--eval_bundle", big, "--eval_dir", str(ed),
                               "--max_bundle_mb", "2"), "more than 2 MiB (--max_bundle_mb)")
    assert not ed.exists()


def test_a_line_without_end_is_cut_off(ckpt, bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(core_eval, "MAX_LINE", 4096)
    path = os.path.join(bundle, "eval_data/fixture/lm_zero.jsonl")
    with open(path, "a") as f:
        f.write('{"context": "' + "word " * 2000)  # no newline, no end
    assert_one_line_error(core(ckpt, "--eval_bundle", bundle, "--eval_dir", str(tmp_path / "e")),
                          "eval_data/fixture/lm_zero.jsonl:9", "a line longer than 4,096 bytes")


def link_member(name, target):
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode(), zipfile.ZIP_STORED


def test_links_devices_and_fifos_are_refused(ckpt, bundle, tmp_path):
    task = "eval_data/fixture/mc_zero.jsonl"
    cases = []
    for target in ("/etc/passwd", "/dev/zero"):
        src = tmp_path / f"link{len(cases)}"
        shutil.copytree(bundle, src)
        os.remove(src / task)
        os.symlink(target, src / task)
        cases.append((str(src), "is a symbolic link"))
    src = tmp_path / "fifo"
    shutil.copytree(bundle, src)
    os.remove(src / task)
    os.mkfifo(src / task)
    cases.append((str(src), "is a FIFO"))
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # only root makes device files (CI is root)
        src = tmp_path / "device"
        shutil.copytree(bundle, src)
        os.remove(src / task)
        os.mknod(src / task, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        cases.append((str(src), "is a device"))
    src = tmp_path / "dirlink"
    shutil.copytree(bundle, src)
    shutil.rmtree(src / "eval_data/fixture")
    os.symlink(os.path.join(bundle, "eval_data/fixture"), src / "eval_data/fixture")
    cases.append((str(src), "eval_data/fixture is a symbolic link"))
    zipped = zip_with(tmp_path / "link.zip", bundle_members(bundle, skip=[task]) + [
        link_member(task, "/etc/passwd")])
    cases.append((zipped, "is a symbolic link"))
    ed = tmp_path / "ed"
    for source, words in cases:
        assert_one_line_error(core(ckpt, "--eval_bundle", source, "--eval_dir", str(ed)),
                              source, words, "regular files only")
        assert not ed.exists()


def test_a_manifest_that_points_outside_or_at_a_link_is_refused(ckpt, bundle, tmp_path):
    ed = str(tmp_path / "ed")
    assert core(ckpt, "--eval_bundle", bundle, "--eval_dir", ed, "--tasks", "mc_zero"
                ).returncode == 0
    manifest = os.path.join(ed, "manifest.json")
    with open(manifest) as f:
        original = json.load(f)
    for entry in ("../../../../../../dev/zero", "/dev/zero", "eval_data/../../x"):
        with open(manifest, "w") as f:
            json.dump({**original, "sha256": {entry: "0" * 64, **original["sha256"]}}, f)
        assert_one_line_error(core(ckpt, "--eval_dir", ed), "manifest.json",
                              f"the entry {entry!r} is not a file of the bundle")
    with open(manifest, "w") as f:
        json.dump(original, f)
    task = os.path.join(ed, "eval_data/fixture/lm_zero.jsonl")
    os.remove(task)
    os.symlink("/dev/zero", task)
    assert_one_line_error(core(ckpt, "--eval_dir", ed), task, "is a symbolic link")
    os.remove(manifest)
    os.symlink("/dev/zero", manifest)
    assert_one_line_error(core(ckpt, "--eval_dir", ed), "not a bundle manifest")


# ===== Malformed text, zips and baselines: one line naming the file and line =====================
def set_baseline(root, value):
    path = os.path.join(root, "eval_meta_data.csv")
    edit_line(path, 2, lambda line: line.replace(",30.0,", f",{value},"))


def write_bytes_at(path, line, data):
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    lines[line] = data
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))


MALFORMED = {
    "jsonl not utf-8": (lambda root: write_bytes_at(
        os.path.join(root, "eval_data/fixture/mc_zero.jsonl"), 3, b'{"query": "caf\xe9"}'),
        ["eval_data/fixture/mc_zero.jsonl:4: not UTF-8 text"]),
    "csv not utf-8": (lambda root: write_bytes_at(os.path.join(root, "eval_meta_data.csv"), 2,
                                                  b"mc_shots,\xff\xfe"),
                      ["eval_meta_data.csv: not UTF-8 text"]),
    "csv field too long": (lambda root: edit_line(
        os.path.join(root, "eval_meta_data.csv"), 3,
        lambda line: line + ',"' + "x" * 140_000 + '"'), ["eval_meta_data.csv:4",
                                                          "not a readable CSV row"]),
    **{f"baseline {v}": (lambda root, v=v: set_baseline(root, v),
                         ["eval_meta_data.csv:3", "is not a percentage in [0, 100)"])
       for v in ("100", "150", "nan", "-inf", "inf", "-1", "x")},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_text_is_one_line(case, ckpt, bundle, tmp_path):
    damage, words = MALFORMED[case]
    damage(bundle)
    for source in (bundle, zip_folder(bundle, tmp_path / "b.zip")):
        ed = tmp_path / "ed"
        line = assert_one_line_error(
            core(ckpt, "--eval_bundle", source, "--eval_dir", str(ed)), *words)
        assert source in line
        assert not ed.exists()


def zip_deflated(folder, path):
    """folder deflated into path with its name as the top entry, as eval_bundle.zip is."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for top, _, names in os.walk(folder):
            for name in sorted(names):
                full = os.path.join(top, name)
                z.write(full, os.path.relpath(full, os.path.dirname(folder)))
    return path


def central_entry(data, name):
    """The offset of name's entry in a zip's central directory."""
    at = data.index(b"PK\x01\x02")
    while data[at + 46: at + 46 + len(name)] != name:
        at = data.index(b"PK\x01\x02", at + 4)
    return at


def set_flag_bits(data, info, bits):
    data[info.header_offset + 6] |= bits  # the local header's flags, then the central directory's
    data[central_entry(data, info.filename.encode()) + 8] |= bits


def set_method(data, info, method):
    data[info.header_offset + 8: info.header_offset + 10] = method.to_bytes(2, "little")
    at = central_entry(data, info.filename.encode())
    data[at + 10: at + 12] = method.to_bytes(2, "little")


def corrupt_stream(data, info):
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for k in range(start + 2, start + min(info.compress_size, 40)):
        data[k] ^= 0xA5


@pytest.mark.parametrize("case, patch, words", [
    ("encrypted", lambda d, i: set_flag_bits(d, i, 0x1), "is encrypted"),
    ("method", lambda d, i: set_method(d, i, 99), "cannot be unpacked"),
    ("deflate", corrupt_stream, "cannot be unpacked"),
])
def test_a_damaged_zip_member_is_one_line(case, patch, words, ckpt, bundle, tmp_path):
    path = zip_deflated(bundle, tmp_path / "b.zip")
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("eval_bundle/eval_data/fixture/mc_zero.jsonl")
    data = bytearray(path.read_bytes())
    patch(data, info)
    path.write_bytes(bytes(data))
    ed = tmp_path / "ed"
    assert_one_line_error(core(ckpt, "--eval_bundle", str(path), "--eval_dir", str(ed)),
                          str(path), "eval_data/fixture/mc_zero.jsonl", words)
    assert not ed.exists()


# ===== The smaller cases ==========================================================================
def test_core_in_a_list_a_changed_core_yaml_and_a_linked_source(ckpt, bundle, tmp_path):
    bundle_zip = zip_folder(bundle, tmp_path / "b.zip")
    ed = str(tmp_path / "ed")
    assert core(ckpt, "--eval_bundle", bundle_zip, "--eval_dir", ed,
                "--tasks", "mc_zero").returncode == 0
    assert_one_line_error(core(ckpt, "--eval_dir", ed, "--tasks", "core,mc_zero"),
                          "core is the group of all the tasks, not a label: give it alone")
    linked = tmp_path / "linked.zip"
    os.symlink(bundle_zip, linked)
    r = core(ckpt, "--eval_bundle", str(linked), "--eval_dir", ed, "--tasks", "mc_zero")
    assert r.returncode == 0, r.stderr  # the same zip, by its real path
    config = os.path.join(ed, "core.yaml")
    with open(config, "a") as f:
        f.write("icl_tasks: [broken\n")  # edited: a changed file, not a malformed one
    assert_one_line_error(core(ckpt, "--eval_dir", ed, "--tasks", "mc_zero"), config,
                          "changed since the eval bundle was installed")
