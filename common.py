"""What the three command lines (train_gpt2.py, fineweb.py, hellaswag.py) share.

- errors a user can fix, reported as one line: UsageError, one_line, DiskFullError;
- files written safely: atomic_write (never a truncated file), umask, dir_lock (one process
  per folder);
- command lines: OneLineParser, HelpFormatter, the bounded argparse types, print0 and exit_process;
- stop signals: Stopped, and stops_raise (SIGTERM raises, so that cleanup runs);
- device, dtype and the device's settings: resolve_device, resolve_dtype, autocast_for, Precision,
  tune_for_device;
- the process's place in a run under torchrun: Proc (rank, world size, master, agree).

Nothing here trains, downloads or starts anything at import; torch is imported only where needed.
"""

import argparse
import contextlib
import difflib
import errno
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback


# ===== Errors a user can fix: one line, exit status 1 ===========================================
class UsageError(Exception):
    """A problem the user can fix (flags, data, files, no network): the CLIs print it as one line,
    `error: ...`, and exit 1. Under torchrun only rank 0 reports it (every rank meets the same
    problem), unless it is this rank's own (rank_specific)."""

    def __init__(self, message, rank_specific=False):
        super().__init__(message)
        self.rank_specific = rank_specific


DISK_FULL = {errno.ENOSPC} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())


def one_line(e, limit=300):
    """An exception (or text) as one line of at most `limit` characters. An OSError of a full disk
    or quota names the path and the space left there, as DiskFullError does."""
    if isinstance(e, OSError) and not isinstance(e, DiskFullError) and e.errno in DISK_FULL:
        free = None
        with contextlib.suppress(OSError, TypeError):
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(e.filename))).free
        e = DiskFullError(e.errno, e.filename or "a file", free)
    msg = " ".join(str(e).split()) or type(e).__name__
    if len(msg) <= limit:
        return msg
    return msg[: limit - 3] + "..."


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


class DiskFullError(OSError):
    """atomic_write ran out of space (ENOSPC) or quota (EDQUOT). Its temp file is gone and nothing
    under the final name changed; str() is one line naming the path, the space left there and what
    was written or needed."""

    def __init__(self, err, path, free=None, written=None, needed=None):
        self.path, self.free, self.written, self.needed = path, free, written, needed
        what = "no space left on device"
        if err == getattr(errno, "EDQUOT", None):
            what = "disk quota exceeded"
        facts = ["free space unknown"]
        if free is not None:
            facts = [f"{human_bytes(free)} free on its filesystem"]
        if written is not None:
            of = f" of about {human_bytes(needed)}" if needed else ""
            facts.append(f"{human_bytes(written)} written{of}")
        elif needed:
            facts.append(f"about {human_bytes(needed)} needed")
        self.message = (f"{what} writing {path} ({', '.join(facts)}); it was not written: "
                        f"free some space and run again")
        super().__init__(err, self.message)

    def __str__(self):
        return self.message


# ===== Files written safely ======================================================================
def atomic_write(path, write, size=None):
    """Write a file through write(f) (binary) under a temp name, then rename it into place.

    A crash never leaves a truncated file under the final name, and the temp name is unique to this
    writer, so two writers never write into one temp file. It ends in .tmp: shard and checkpoint
    globs (*.npy, model_*.pt) never see it. Every file this repository writes for keeps goes
    through here. The file gets the mode open() would give it (0o666 less the umask), not mkstemp's
    0600, so that a group sharing a run can read it. Out of space or quota: the temp file is removed
    and DiskFullError says so in one line (size, the bytes the file takes when the caller knows).
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f = None

    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        f = os.fdopen(fd, "wb")
        write(f)
        f.flush()
        os.fsync(f.fileno())
        f.close()
        with contextlib.suppress(OSError):  # a filesystem without modes (FUSE, SMB) keeps its own
            os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException as e:  # the temp file goes, whatever happened; a full disk says so
        written = None
        if tmp is not None and os.path.exists(tmp):
            written = os.path.getsize(tmp)
        full = _disk_full_errno(e, tmp)
        if f is not None:
            with contextlib.suppress(OSError):  # its buffer cannot be written either
                f.close()
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)

        if full is None:
            raise
        free = None
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(folder).free
        raise DiskFullError(full, path, free, written, size) from e


PROBE_BYTES = 1 << 12


def _disk_full_errno(e, tmp):
    """ENOSPC / EDQUOT when e (or an error it wraps: torch.save raises RuntimeError from the
    OSError) is one."""
    seen, errno_less = set(), False
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            if e.errno in DISK_FULL:
                return e.errno
            errno_less |= e.errno is None
        e = e.__cause__ or e.__context__
    if not errno_less or tmp is None or not os.path.exists(tmp):
        return None
    # numpy's tofile (np.save to a file) reports a short write with no errno: one more block
    # appended to the temp file, which is about to be removed, says whether the filesystem is full
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return None
    try:
        if os.write(fd, b"\0" * PROBE_BYTES) < PROBE_BYTES:
            return errno.ENOSPC
        return None
    except OSError as probe:
        return probe.errno if probe.errno in DISK_FULL else None
    finally:
        os.close(fd)


_fallback_umask = None


def umask():
    """The process umask, read without setting it (os.umask can only swap it, which races with
    threads that create files meanwhile); where /proc has no Umask line, swapped once and kept."""
    global _fallback_umask
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    if _fallback_umask is None:
        _fallback_umask = os.umask(0o022)
        os.umask(_fallback_umask)
    return _fallback_umask


def check_writable_folder(path, flag):
    """A UsageError (naming flag and path) unless the folder that would hold path exists and takes
    a new file. A probe file is made there and removed: os.access says yes to root even on a
    read-only filesystem. mkstemp's name is new, so no file of the user's is touched."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        if os.path.exists(parent):
            raise UsageError(f"{flag} {path}: {parent} is not a folder")
        raise UsageError(f"{flag} {path}: its folder does not exist ({parent})")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_probe.", suffix=".tmp", dir=parent)
    except OSError as e:  # its strerror alone: the probe's name would only puzzle
        why = e.strerror or one_line(e, 100)
        raise UsageError(f"{flag} {path}: cannot write in {parent} ({why})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.remove(probe)


def check_outputs(paths_by_flag, overwrite=False, inputs=None):
    """A UsageError, before any work, unless each file asked for by name (flag -> path, None where
    not asked for) can be written at the end: not empty, not a directory or other non-file, an
    existing file only with overwrite, in a folder that takes a new file, and no two flags naming
    one file (by real path: a symlink or another spelling is the same file), an input's included
    (inputs: flag -> path, read by the command)."""
    outputs = {flag: path for flag, path in paths_by_flag.items() if path is not None}
    seen = {os.path.realpath(p): flag for flag, p in (inputs or {}).items() if p}
    for flag, path in outputs.items():  # all of them first: two the same is the likelier slip
        if not path:
            raise UsageError(f"{flag} is empty: give a file path")
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"{seen[real]} and {flag} name the same file ({path}): give "
                             f"{flag} another path")
        seen[real] = flag
    for flag, path in outputs.items():
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path} is a directory: give a file path")
        if path.endswith(os.sep) or os.path.exists(path) and not os.path.isfile(path):
            raise UsageError(f"{flag} {path} is not a regular file: give a file path")
        if os.path.exists(path) and not overwrite:
            raise UsageError(f"{flag} {path} exists: give --overwrite to replace it, or another "
                             f"path")
        check_writable_folder(path, flag)


def check_new_dir(path, flag):
    """A UsageError unless path can become a new directory (new_dir's checks, made before any
    work): not empty, new or an empty directory, in a folder that takes a new entry."""
    if not path:
        raise UsageError(f"{flag} is empty: give the directory to write")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"{flag} {path} exists and is not an empty directory: choose a new one")
    check_writable_folder(path, flag)


def sha256_file(path):
    """The SHA-256 (hex) of a file's bytes, read a MiB at a time."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_dirs(folder, flag, error=UsageError):
    """Create folder and its missing parents; returns the ones created, deepest first, so that an
    undo can remove them (rmdir: only while empty). One that cannot be made is error(one line
    naming flag and folder)."""
    made, path = [], folder
    while not os.path.isdir(path):
        made.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise error(f"{flag} {folder}: cannot create it ({one_line(e, 100)})") from None
    return made


@contextlib.contextmanager
def new_dir(path, flag):
    """A folder to fill in the body, renamed to path (a new or empty directory) when the body ends
    without an error: a failed write leaves nothing behind. flag names the path in errors."""
    check_new_dir(path, flag)
    out = os.path.abspath(path)
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        os.makedirs(tmp)
        yield tmp
        os.replace(tmp, out)
    except OSError as e:  # a read-only parent, a full disk
        raise UsageError(f"{flag} {path}: cannot write there ({one_line(e)})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hub_unreachable(timeout=3.0):
    """True when the Hugging Face hub does not answer an HTTP request within `timeout` seconds
    (refused, no route, or a silent host): its clients would retry for minutes before saying so.
    Unsure (a proxy, or offline mode asked for) -> False."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                                       "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    import urllib.error
    import urllib.request

    from huggingface_hub import constants
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:  # an answer, even an error status: the hub is there
        return False
    except (OSError, ValueError):  # URLError, a timeout, a refused connection, a bad URL
        return True
    return False


def _live_holder(record):
    """The holder record at `record` as 'pid N on HOST, since T: COMMAND' when it names a live
    process, else None: a killed holder's record stays until the next holder writes over it."""
    try:
        with open(record) as f:
            h = json.load(f)
        pid, host = h["pid"], h["host"]
        text = f"pid {pid} on {host}, since {h['started']}: {one_line(h['command'], 1000)}"
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if type(pid) is not int or pid <= 0:  # os.kill(0, 0) would signal our own process group
        return None
    # signal 0 tests a pid on POSIX only: on Windows os.kill(pid, 0) sends a Ctrl-C event
    if host == socket.gethostname() and os.name == "posix":
        try:
            os.kill(pid, 0)
        except PermissionError:
            pass  # alive, another user's
        except (OSError, OverflowError):
            return None
    return text  # or another host's (a shared filesystem), or on Windows: not checked here


@contextlib.contextmanager
def dir_lock(folder, name, busy, error=UsageError, wait_for_holder=10.0):
    """Hold folder/name, an flock, while the body runs: one process at a time per folder. The kernel
    drops an flock when its process dies (kill -9 included), so it is never stale. The holder
    records its pid, host, start time and command in folder/name.holder (filelock records none) and
    removes it on release.

    When another process holds the lock, this retries for up to wait_for_holder seconds until that
    record names a live process (the holder writes it just after taking the lock), then raises
    error(f"{folder} {busy}"), "{holder}" in busy replaced by that record, or by "pid not recorded"
    if none turned up. folder must exist; an OSError (not writable, disk full) passes through."""
    import filelock  # only a prep or a training run needs it

    path, record = os.path.join(folder, name), os.path.join(folder, name + ".holder")
    for link in (path, record):  # filelock truncates its file: never one a link points to
        if os.path.islink(link):
            raise error(f"{link} is a symbolic link: remove it (a lock is a plain file)")
    lock = filelock.FileLock(path, thread_local=False, is_singleton=False)
    deadline = time.monotonic() + wait_for_holder
    while True:
        try:
            lock.acquire(timeout=0)
            break
        except filelock.Timeout:
            holder = _live_holder(record)
        if holder or time.monotonic() > deadline:
            raise error(f"{folder} " + busy.replace("{holder}", holder or "pid not recorded"))
        time.sleep(0.02)
    try:
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "command": shlex.join(["python", *sys.argv])}).encode()
        atomic_write(record, lambda f: f.write(info))
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(record)
        lock.release()


# ===== Command lines =============================================================================
def rank():
    """This process's rank under torchrun (0 without it)."""
    return int(os.environ.get("RANK", 0))


def print0(*args, **kwargs):
    """print on rank 0 only: every rank runs the same code, one of them reports."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`error: ... (see --help)`, exit status 1); under
    torchrun only rank 0 prints it, as every rank meets the same flags. A flag is its whole name
    (--max_step is not taken for --max_steps); an unknown one is answered with the nearest real
    one; a flag's old spelling still works, but not beside its new one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.old_spellings = {}  # old flag: its new name

    def add_old_spelling(self, old, new, **kwargs):
        """old, an earlier name of the flag new (same dest), hidden from --help."""
        self.old_spellings[old] = new
        return self.add_argument(old, help=argparse.SUPPRESS, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        words = sys.argv[1:] if args is None else list(args)
        given = {w.split("=", 1)[0] for w in words if isinstance(w, str) and w.startswith("--")}
        for old, new in self.old_spellings.items():
            if old in given and new in given:
                self.error(f"{old} is the old spelling of {new}: give one of them")
        return super().parse_known_args(args, namespace)

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            unknown = message.split(": ", 1)[1].split()[0].split("=")[0]
            known = set(re.findall(r"--[A-Za-z][\w-]*", self.format_help()))
            if unknown.startswith("-"):
                message += did_you_mean(unknown, sorted(known))
        report_error(f"error: {one_line(message, 10_000)} (see --help)", said_elsewhere=rank() > 0)
        sys.exit(1)


def did_you_mean(word, choices, prefix=""):
    """" (did you mean X?)" with the choice nearest to word (prefix before it), for a message
    that names a flag or a label it does not know; "" when none is near."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    if not near:
        return ""
    return f" (did you mean {prefix}{near[0]}?)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with each flag's default, and descriptions printed as written."""


def bounded(kind, low, high=math.inf, low_open=False, high_open=False, what=None):
    """An argparse type: a finite int or float in [low, high], either end open if asked."""
    if what is None:
        what = f">= {low}"
        if low_open or (kind is int and low == 1):
            what = "positive"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}") from None
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be {what}, not {text}")
        return value
    return parse


def count(low, high):
    """An argparse type: an integer in low..high, high the most that the flag can mean (a model, a
    context, a batch a machine can hold; steps a run can take; workers a machine can run)."""
    return bounded(int, low, high, what=f"in {low}..{high:,}")


def auto_or(kind):
    """An argparse type: the word "auto", or a value of kind."""
    def parse(text):
        if text == "auto":
            return text
        try:
            return kind(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (or auto)") from None
    return parse


POSITIVE_INT, NONNEG_INT = bounded(int, 1), bounded(int, 0)
POSITIVE, NONNEG = bounded(float, 0, low_open=True), bounded(float, 0)
SEED = bounded(int, 0, 2**32 - 1, what="in 0..4294967295, numpy's seed range")
FLOAT32_MAX = 3.4028234663852886e38  # a larger learning rate is inf in the optimizer's float32
LEARNING_RATE = bounded(float, 0, FLOAT32_MAX, low_open=True, what="positive, below 3.4e38")
LEARNING_RATE_OR_OFF = bounded(float, 0, FLOAT32_MAX, what=">= 0 (0: off), below 3.4e38")


def flag_dest(flags):
    """The argparse dest of a table entry's flags: "-B --micro_batch_size" -> micro_batch_size."""
    return flags.split()[-1].lstrip("-")


def add_flags(parser, entries, shown=None):
    """argparse arguments for (flags, default, type, meaning) entries, --help giving each default
    once. A type is an argparse type, a list of choices, bool (--x / --no-x) or a dict of argparse
    keywords. shown=None: the defaults are argparse's own. train_gpt2.py passes shown (its preset's
    defaults) and leaves argparse's at None, which is how it tells which flags were given."""
    for flags, default, kind, meaning in entries:
        kwargs = {}
        if shown is None:
            kwargs["default"] = default
        else:
            default = shown.get(flag_dest(flags), default)
        if default is not None:
            meaning += f" (default: {default})"
        kwargs["help"] = meaning.replace("%", "%%")
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(kind, dict):
            kwargs.update(kind)
        elif isinstance(kind, list):
            kwargs["choices"] = kind
        else:
            kwargs["type"] = kind
        parser.add_argument(*flags.split(), **kwargs)


class Stopped(KeyboardInterrupt):
    """A stop signal: raised at once outside a training step's micro-steps (evaluation, samples,
    data prep, an install), or between two micro-steps on every rank together (agreed: the ranks
    can still save together). run_cli exits with 128 + signum."""

    def __init__(self, signum, agreed=False):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.agreed = signum, agreed


@contextlib.contextmanager
def stops_raise():
    """SIGTERM raises Stopped while the body runs, as Ctrl-C does, so that the body's cleanup runs
    (an install undone) instead of the process dying where it stands; a second signal is let pass
    until the body has left, so that it cannot cut the cleanup short. A handler someone else set
    (a training run's StopSignals) is left as it is; so is every handler outside the main thread,
    where none can be set."""
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    ours = {}
    if threading.current_thread() is threading.main_thread():
        ours = {s: h for s, h in defaults.items() if signal.getsignal(s) == h}
    raised = []

    def stop(signum, frame):
        if not raised:
            raised.append(signum)
            raise Stopped(signum)
    for s in ours:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in ours.items():
            signal.signal(s, handler)


def run_cli(main, *args):
    """main(*args)'s exit status, with what a user can fix as one line on stderr: a UsageError
    (status 1; under torchrun from rank 0, or from the rank it concerns), an OSError such as a full
    disk (1), Ctrl-C or a stop signal outside a training step (128 + the signal). Anything else is
    a bug and keeps its traceback. Under torchrun the line (or the traceback) also goes to
    torchrun's error file, so that its failure summary names the cause; a rank stopped because
    another one left (PeerLost) leaves without a word."""
    try:
        return main(*args)
    except UsageError as e:
        report_error(f"error: {e}", said_elsewhere=rank() > 0 and not e.rank_specific)
        return 1
    except PeerLost as e:  # the rank that left says why
        report_error(f"error: {e}", said_elsewhere=under_torchrun())
        return 1
    except OSError as e:  # the machine's: a full disk, a file that cannot be read or written
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        record_error(f"error: {one_line(e)}")
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or Stopped: a stop signal
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"error: interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        return 128 + signum
    except Exception:
        record_error(traceback.format_exc())
        raise


def report_error(line, said_elsewhere=False):
    """line on stderr and in torchrun's error file. said_elsewhere: another rank says why (rank 0
    of a problem that every rank meets; the rank that left, of a PeerLost). Under torchrun such a
    rank waits to be stopped (outlived_the_launcher) rather than leave first, which would have
    torchrun stop the rank that says why before it does; it says the line only if no stop comes."""
    record_error(line)
    if said_elsewhere and under_torchrun():
        said_elsewhere = not outlived_the_launcher()
    if not said_elsewhere:
        print(line, file=sys.stderr, flush=True)


class PeerLost(RuntimeError):
    """A collective failed: another process of the run left or stopped answering (its own message
    says why: a refusal, a crash, a signal)."""


# What a collective raises when another process is gone: gloo's plain RuntimeError names the closed
# or reset connection or the wait that timed out; NCCL's DistBackendError, the remote failure or
# the aborted communicator; the store's and the network's have their own classes (peer_gone)
PEER_GONE = re.compile(r"connection (was )?(closed|reset|refused)|closed by (remote )?peer|"
                       r"broken pipe|timed out|timeout|remote (process|peer|error)|"
                       r"communicator was aborted|network error", re.IGNORECASE)


def peer_gone(error):
    """Whether a collective's RuntimeError means another process of the run left or stopped
    answering (PeerLost), rather than a bug in the call (which keeps its traceback)."""
    import torch.distributed as dist

    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return PEER_GONE.search(str(error)) is not None


def under_torchrun():
    """True in a worker that torchrun started (it stops every worker once one has exited)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1


# How long a worker whose run is over waits for torchrun to stop it (see outlived_the_launcher):
# torchrun notices an exited worker within a second; this bound only matters if it never does.
LAUNCHER_GRACE_S = 120.0


def outlived_the_launcher(seconds=LAUNCHER_GRACE_S):
    """Wait for torchrun to stop this worker: once one worker has exited, torchrun stops the
    others (SIGTERM). A rank > 0 that met a problem rank 0 meets too, or whose collective broke
    because another rank left, waits here rather than leave first: leaving first would have
    torchrun stop rank 0 before it says why. True if the stop never came (the caller then reports
    the problem itself); False after Ctrl-C, which every worker gets and torchrun reports."""
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        return False
    return True


def record_error(text):
    """Under torchrun, text as this worker's error (TORCHELASTIC_ERROR_FILE, the file the record
    decorator of torch.distributed.elastic writes), which torchrun's failure summary shows."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            extra = {"py_callstack": text, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": text.strip().splitlines()[-1],
                                   "extraInfo": extra}}, f)


def exit_process(code):
    """sys.exit(code); under torchrun, without Python's interpreter shutdown: torch keeps process
    groups alive past destroy_process_group, and a gloo thread freeing a tensor during shutdown
    aborts a good run."""
    if "WORLD_SIZE" in os.environ:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)


# ===== Device, dtype, TF32: one policy for training, sampling and evaluation =====================
DEVICE_TYPES = ("cpu", "cuda", "mps")


def resolve_device(name):
    """A device string for `name`: "auto" picks cuda > mps > cpu; "cpu", "cuda", "cuda:1", "mps"
    are checked to exist here. A UsageError naming --device for junk or a device this machine
    does not have."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    mps_ok = mps is not None and mps.is_available()
    if name in (None, "auto"):
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if mps_ok else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise UsageError(f"--device: unknown device {name!r}: expected auto, cpu, cuda, cuda:N "
                         f"or mps")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {name!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= count:
            raise UsageError(f"--device {name!r}: this machine has {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1})")
    if dev.type == "mps" and not mps_ok:
        raise UsageError(f"--device {name!r}: MPS is not available on this machine")
    return str(name)


def device_type_of(device):
    """'cuda' for 'cuda:3': autocast, fused AdamW and synchronize take the type, not the index."""
    return str(device).split(":")[0]


def autocast(device_type, dtype):
    """torch.autocast(device_type, dtype), or a do-nothing context when dtype is None (fp32).

    An autocast torch cannot honour (CUDA unavailable, a dtype the device lacks) turns itself off
    with only a warning, and everything would run in fp32 while bf16 was asked for: a ValueError
    (one line, with torch's reason) instead."""
    if dtype is None:
        return contextlib.nullcontext()
    import warnings

    import torch

    device_type = device_type_of(device_type)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = torch.autocast(device_type=device_type, dtype=dtype)
        with ctx:
            enabled = torch.is_autocast_enabled(device_type)
    if not enabled:
        why = "; ".join(one_line(w.message, 100) for w in caught) or "torch turned it off"
        name = str(dtype).replace("torch.", "")
        raise ValueError(f"autocast to {name} on {device_type} is not available here ({why})")
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return ctx


DTYPES = ("auto", "fp32", "bf16", "fp16")  # the choices of every command's --dtype


def resolve_dtype(dtype, device_type):
    """What a --dtype of auto|fp32|bf16|fp16 means on device_type: auto is bf16 on a GPU that
    computes in it (CUDA from Ampere on, Apple's MPS), fp16 on an older CUDA GPU (T4, V100: bf16
    there is emulated, several times slower), and fp32 on the CPU."""
    if dtype != "auto":
        return dtype
    import torch

    kind = device_type_of(device_type)
    if kind == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16"
        return "fp16"
    if kind == "mps":
        return "bf16"
    return "fp32"


def torch_dtype(name):
    """torch's dtype for "bf16" or "fp16"; None for "fp32" (no autocast)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)


def autocast_for(dtype, device_type):
    """(autocast context, dtype name) for a --dtype (resolve_dtype); a dtype the device cannot
    honour is a UsageError, except auto on an MPS without bf16 (macOS before 14), which is fp32."""
    name = resolve_dtype(dtype, device_type)
    try:
        return autocast(device_type, torch_dtype(name)), name
    except ValueError as e:  # torch would have run fp32 in silence
        if dtype == "auto" and device_type_of(device_type) == "mps":
            return contextlib.nullcontext(), "fp32"
        raise UsageError(f"--dtype {dtype}: {e}; use --dtype fp32") from None


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def tune_for_device(device_type):
    """The process-wide settings that make a device fast, set once before any work. CUDA: TF32
    matmuls (set_float32_matmul_precision("high")). A CPU under glibc: freed memory kept for
    reuse (mallopt: no block of its own mapped for a large allocation, and the heap never
    trimmed). glibc otherwise maps each allocation over its mmap threshold (at most 32 MiB) afresh
    and unmaps it when freed, so every training step page-faults its large tensors in again (the
    vocabulary's logits and their gradient): 40% of the tiny preset's step on a 2-core VM
    (docs/performance.md, "Freed memory kept for reuse on the CPU"). The price: memory freed is
    not given back to the system before the process ends."""
    kind = device_type_of(device_type)
    if kind == "cuda":
        import torch

        torch.set_float32_matmul_precision("high")
    elif kind == "cpu" and glibc():
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # mallopt's int: trim only beyond 2 GiB


def glibc():
    """Whether this process's C library is glibc (Linux's usual; not macOS's, Windows' or
    musl's)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):
        return False


class Precision:
    """What a --dtype means on a device, resolved once: its name (fp32, bf16, fp16), torch's dtype
    for autocast (None: fp32), the autocast context, and whether fp16's loss scaler is on."""

    def __init__(self, flag, device):
        self.autocast, self.name = autocast_for(flag, device)
        self.dtype = torch_dtype(self.name)
        self.scaler = self.name == "fp16"  # bf16 has fp32's range: no loss scaling

    def __repr__(self):
        return self.name


# ===== The process's place in a run: rank, world size, the collective that agrees ===============
class Proc:
    """This process in the run: torchrun's RANK, LOCAL_RANK and WORLD_SIZE (one process without
    it), the device its collectives use, and agree(), the AND of a flag over every process."""

    def __init__(self, device="cpu", environ=None):
        environ = os.environ if environ is None else environ
        self.distributed = "RANK" in environ and "WORLD_SIZE" in environ  # under torchrun
        self.rank = int(environ.get("RANK", 0))
        self.local_rank = int(environ.get("LOCAL_RANK", 0))
        self.world_size = int(environ.get("WORLD_SIZE", 1))
        self.local_world_size = int(environ.get("LOCAL_WORLD_SIZE", 1))  # processes on this host
        self.master = self.rank == 0
        self.device = device
        self.long_wait_group = self.cpu_group = None

    def agree(self, ok, long_wait=False, on_cpu=False):
        """ok on every rank (a barrier too); long_wait: a gloo group waits 48 h (data prep);
        on_cpu: over gloo on the CPU, which a GPU's queued work does not hold up (a vote between
        micro-steps)."""
        if self.world_size == 1:
            return bool(ok)
        import datetime

        import torch
        import torch.distributed as dist

        on_cpu = on_cpu and device_type_of(self.device) != "cpu"  # a CPU run's group is gloo
        flag = torch.tensor(float(ok), device="cpu" if long_wait or on_cpu else self.device)
        try:
            if long_wait and self.long_wait_group is None:
                hours48 = datetime.timedelta(hours=48)
                self.long_wait_group = dist.new_group(backend="gloo", timeout=hours48)
            if on_cpu and self.cpu_group is None:  # every rank makes it at its first vote
                self.cpu_group = dist.new_group(backend="gloo")
            group = None
            if long_wait:
                group = self.long_wait_group
            elif on_cpu:
                group = self.cpu_group
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        except RuntimeError as e:
            if not peer_gone(e):  # a bug in the vote itself keeps its traceback
                raise
            raise PeerLost(f"rank {self.rank} stopped: another process of the run left or stopped "
                           f"answering ({one_line(e, 200)})") from e
        return flag.item() == 1.0
