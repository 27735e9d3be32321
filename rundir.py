"""A training run's directory (--log_dir): the files a run leaves there and what keeps them safe.

- checkpoint files: model_{step:05d}.pt, written atomically, the newest --keep_last kept, loaded as
  data only (a pickle that would run code is refused), found and checked for --resume, and what
  wrote them (provenance); train_gpt2.py's Checkpointer decides what a checkpoint holds;
- the claim on the log dir: one run at a time (a lock), an earlier run never overwritten by
  accident, nothing written through a symlink, a rollback's later checkpoints set aside, the run
  config saved;
- log.txt: one `step kind value` line per number, written and parsed only here;
- the stop signals, and the one line that says how a run ended (under torchrun, from the rank that
  failed, naming it on the others).
"""

import contextlib
import glob
import hashlib
import json
import os
import pickle
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from common import (Stopped, UsageError, atomic_write, dir_lock, one_line, print0,
                    report_error)


# ===== Checkpoint files ==========================================================================
CKPT_RE = re.compile(r"model_(\d+)\.pt$")
# what resuming needs; sample, export and eval need only the first two
RESUME_KEYS = ("model", "config", "optimizer", "step", "val_loss", "loader", "rng", "args")


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"model_{step:05d}.pt")


def checkpoint_step(path):
    return int(CKPT_RE.search(os.path.basename(path)).group(1))


def find_checkpoints(log_dir):
    """Checkpoint paths in log_dir, oldest step first."""
    found = glob.glob(os.path.join(log_dir, "model_*.pt"))
    found = [p for p in found if CKPT_RE.search(os.path.basename(p))]
    return sorted(found, key=checkpoint_step)


def non_finite(model_state):
    """The name of the first weight holding a NaN or inf, or None."""
    for name, value in model_state.items():
        if value.is_floating_point() and not value.isfinite().all():
            return name
    return None


def write_checkpoint(path, checkpoint, keep_last, proc, collective=True):
    """torch.save(checkpoint) to path on the master process, under a temp name renamed when
    complete (never a truncated model_*.pt, even on a crash); then only the newest keep_last
    checkpoints are kept (0: all). Every rank stops if the master could not write (a full disk).
    collective=False, after a failure that may be one rank's alone: no collective, and a write
    that fails returns False (the failure's report names the newest checkpoint)."""
    error = None
    if proc.master:
        try:
            if bad := non_finite(checkpoint["model"]):
                raise UsageError(f"{bad} holds NaN or inf")
            atomic_write(path, lambda f: torch.save(checkpoint, f))
            if keep_last > 0:
                # the newest is this one: a resumed run set later ones aside when it started
                for old in find_checkpoints(os.path.dirname(path))[:-keep_last]:
                    os.remove(old)
        except (UsageError, OSError) as e:
            error = e
    if not collective:
        return error is None
    ok = proc.agree(error is None)
    if error is not None:
        raise UsageError(f"saving {path} failed: {one_line(error)}")
    if not ok:
        raise UsageError("saving failed on rank 0")
    return True


def rng_state():
    """The python, numpy, torch (and CUDA) random generators' states, for an exact resume: tuples,
    lists, numbers and tensors, all a weights-only load reads back."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and len(state.get("cuda", ())) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def numpy_array_globals():
    """What the uint32 array of numpy's RNG state pickles as (checkpoints that kept it as an array):
    data only, allowed to a weights-only load under the names numpy 2 and numpy 1 write."""
    rebuild = np.ndarray.__reduce__(np.zeros(1))[0]  # multiarray._reconstruct
    return [rebuild, (rebuild, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
            type(np.dtype(np.uint32))]


def read_checkpoint(path, keys=("model", "config"), check_weights=True):
    """The dict in one of our checkpoints (memory-mapped, weights only: a pickle that asks to run
    anything is refused and nothing runs), in today's layout, or a UsageError saying why it cannot
    be used; check_weights=False skips the scan for NaN/inf."""
    if not os.path.exists(path):
        raise UsageError(f"checkpoint not found: {path} ({what_folder_holds(path)})")
    if not os.path.isfile(path):
        raise UsageError(f"{path} is not a checkpoint file (a directory or a device)")
    try:
        with torch.serialization.safe_globals(numpy_array_globals()):
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:  # a global the weights-only unpickler does not allow
        asked = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"({asked.group(1)}) " if asked else ""
        raise UsageError(f"{path} is not a safe checkpoint: its pickle asks to run code {what}"
                         f"and was refused; nothing from it ran") from None
    except Exception as e:  # truncated, or not a torch file at all
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UsageError(f"{path} is not a train_gpt2.py checkpoint (no {', '.join(missing)})")
    check_fields(ckpt, path)
    if check_weights and (bad := non_finite(ckpt["model"])):
        raise UsageError(f"{path} holds NaN or inf weights ({bad}): a diverged run's")
    return upgrade_checkpoint(ckpt)


def what_folder_holds(path, shown=4):
    """The checkpoints in the folder of a path that is not there, the newest `shown` named."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"there is no folder {folder}"
    found = [os.path.basename(p) for p in find_checkpoints(folder)]
    if not found:
        return f"{folder} holds no model_*.pt"
    older = ""
    if len(found) > shown:
        older = f" and {len(found) - shown} older"
    return f"{folder} holds {', '.join(found[-shown:])}{older}"


def check_fields(ckpt, path):
    """A UsageError naming path and the field, for a checkpoint whose fields are not what
    train_gpt2.py writes: dicts where it writes dicts, tensors in the model, a step and a token
    count that are non-negative integers, a val loss that is a number, a config of plain values.
    (The flags in its args are checked against the flag table by settings.py.)"""
    def bad(field, what):
        raise UsageError(f"{path} is not a usable checkpoint: its {field} {what}")

    for key in ("model", "config", "args", "optimizer", "loader", "rng"):
        if key in ckpt and not isinstance(ckpt[key], dict):
            bad(repr(key), f"is a {type(ckpt[key]).__name__}, not a dict")
    for name, value in ckpt.get("model", {}).items():
        if not isinstance(value, torch.Tensor):
            bad(f"model entry {name!r}", f"is a {type(value).__name__}, not a tensor")
    for key in ("step", "tokens_seen"):
        value = ckpt.get(key, 0)
        if type(value) is not int or value < 0:
            bad(repr(key), f"is {one_line(repr(value), 40)}, not a non-negative integer")
    loss = ckpt.get("val_loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        bad("'val_loss'", f"is {one_line(repr(loss), 40)}, not a number")
    for key, value in ckpt.get("config", {}).items():
        if not isinstance(key, str) or not isinstance(value, (int, float, str, type(None))):
            bad(f"config entry {one_line(repr(key), 40)}", f"is {one_line(repr(value), 40)}")


# Run flags train_gpt2.py gained after it first wrote checkpoints, each with what a run did
# before it: a checkpoint without one resumes as it was trained, not on today's default or the
# default an --arch / --preset given again brings (--arch modern's --wsd_decay and --embed_lr)
BEFORE_THE_FLAG = {"optimizer": "adamw", "batch_ramp_tokens": 0, "core_every": 0,
                   "wsd_decay": 0.0, "embed_lr": None}


def rounds_otherwise(config):
    """Whether a checkpoint's model computed its rotary embedding or its soft-capped logits and
    loss on the kernels train_gpt2.py had before Rotary and SoftcapHeadLoss, whose float rounding
    differs from theirs: resumed today it continues its run closely, not bit for bit, and undoing
    that would take the old kernels kept beside the new. Its sign is a config without x0_skip, a
    field that came two commits after them (a checkpoint of those two counts too)."""
    return "x0_skip" not in config and (config.get("pos_emb") == "rope"
                                        or (config.get("logit_softcap") or 0) > 0)


def upgrade_checkpoint(ckpt):
    """A checkpoint in today's layout, from any layout train_gpt2.py has written."""
    args = ckpt.get("args")
    if isinstance(args, dict):
        for flag, before in BEFORE_THE_FLAG.items():
            args.setdefault(flag, before)
        if "tokens_seen" not in ckpt and "step" in ckpt:  # no batch ramp: every step a full batch
            ckpt["tokens_seen"] = (ckpt["step"] + 1) * args["total_batch_size"]
    parts = ckpt.get("optimizer")
    if isinstance(parts, dict) and set(parts) == {"adamw", "muon"}:  # Muon's state kept apart
        ckpt["optimizer"] = {
            "state": {**parts["adamw"]["state"], **parts["muon"]["state"]},
            "param_groups": parts["adamw"]["param_groups"] + parts["muon"]["param_groups"]}
    return ckpt


def provenance(device):
    """What produced a run's numbers: the code (its git commit, and whether tracked files differed
    from it, in a git checkout; else a hash of train_gpt2.py), torch, Python and the device."""
    repo, code = os.path.dirname(os.path.abspath(__file__)), None
    try:
        git = ["git", "-C", repo]
        head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                     capture_output=True, text=True, timeout=10).stdout.strip()
            code = f"git {head.stdout.strip()}" + (" (dirty)" if changed else "")
    except (OSError, subprocess.SubprocessError):  # no git here
        pass
    if code is None:
        with open(os.path.join(repo, "train_gpt2.py"), "rb") as f:
            code = f"train_gpt2.py sha256 {hashlib.sha256(f.read()).hexdigest()}"
    name = platform.processor() or platform.machine() or "cpu"
    if str(device).startswith("cuda"):
        name = torch.cuda.get_device_name(device)
    return {"code": code, "torch": str(torch.__version__), "python": platform.python_version(),
            "device": f"{device} ({name})"}


def open_checkpoint(path):
    """read_checkpoint for the sample, export and eval commands, which say where it came from."""
    ckpt = read_checkpoint(path)
    made = ckpt.get("provenance")
    if isinstance(made, dict):
        made = ", ".join(f"{k} {v}" for k, v in made.items())
    step = ckpt.get("step", "?")
    print(f"{path}: step {step}, written by {made or 'a run that recorded no provenance'}",
          flush=True)
    return ckpt


# ===== The log dir: one run at a time, an earlier run never overwritten by accident ==============
class LogDirClaim(contextlib.ExitStack):
    """A run's hold on its log dir: close() unlocks it; abandon(), for a run that ends before its
    first step, also takes away a log dir the claim made (its lock, run config and empty log), so
    that a refused or failed run leaves nothing that looks like a run behind."""

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir, self.created = log_dir, False

    def abandon(self):
        if self.created:  # removed while still locked, so no other run can claim the dir between
            for name in ("run_config.json", "log.txt", ".lock"):
                path = os.path.join(self.log_dir, name)
                if os.path.isfile(path) and (name != "log.txt" or os.path.getsize(path) == 0):
                    with contextlib.suppress(OSError):  # Windows: filelock removes it on release
                        os.remove(path)
        self.close()  # unlocks; the lock's holder record goes with it
        if self.created:
            with contextlib.suppress(OSError):  # anything else in it (a profile, W&B files) stays
                os.rmdir(self.log_dir)


def claim_log_dir(run, ckpt, proc):
    """Rank 0 locks --log_dir for the run, readies it for a new run or for resuming ckpt, and saves
    the run config; every rank stops if it cannot. Returns a LogDirClaim; close() unlocks."""
    log_dir, resume_step = run.log_dir, None
    if ckpt is not None:
        resume_step = ckpt["step"]
    held, error = LogDirClaim(log_dir), None
    if proc.master:
        try:
            try:
                os.makedirs(log_dir)
                held.created = True
            except FileExistsError:  # there already, or just made by a run started with this one
                pass
            busy = "is in use by a live run ({holder}): wait for it to end, or choose another"
            try:
                held.enter_context(dir_lock(log_dir, ".lock", f"{busy} --log_dir"))
            except UsageError:  # the dir is the holder's, even one this run made a moment ago
                held.created = False
                raise
            for warning in prepare_log_dir(log_dir, resume_step, run.overwrite):
                print(f"warning: {warning}", flush=True)
            save_run_config(log_dir, run.as_dict())
        except OSError as e:  # a file in the way, no permission, a read-only or full filesystem
            error = UsageError(f"--log_dir {log_dir}: cannot write there ({one_line(e)})")
        except UsageError as e:
            error = e
    if not proc.agree(error is None):
        held.abandon()
        raise error or UsageError("rank 0 could not claim the log dir (see its message)")
    return held


def prepare_log_dir(log_dir, resume_step, overwrite):
    """Ready log_dir for this run (the lock is held); returns the warnings to print. Removes a
    crash's temp files. A resumed run moves later checkpoints (a rollback, or newer damaged files)
    and a copy of log.txt to after_step_N/, where --resume latest cannot pick up an abandoned step,
    and cuts log.txt back to its checkpoint. --overwrite deletes an earlier run's log and
    checkpoints; otherwise such a run is refused."""
    for tmp in glob.glob(os.path.join(log_dir, "*.tmp")) + glob.glob(os.path.join(log_dir,
                                                                              ".failure.rank*")):
        os.remove(tmp)  # a crash's temp files, an earlier run's failure notes
    log_file, warnings = os.path.join(log_dir, "log.txt"), []
    check_log_dir(log_dir, resume_step, overwrite)
    if resume_step is None:
        for path in find_checkpoints(log_dir):
            os.remove(path)
        open(log_file, "w").close()
        return warnings

    later = [p for p in find_checkpoints(log_dir) if checkpoint_step(p) > resume_step]
    if later:
        base, n = os.path.join(log_dir, f"after_step_{resume_step:05d}"), 1
        dest = base
        while os.path.exists(dest):
            n += 1
            dest = f"{base}_{n}"
        os.makedirs(dest)
        if os.path.exists(log_file):
            shutil.copy2(log_file, os.path.join(dest, "log.txt"))
        for path in later:
            os.replace(path, os.path.join(dest, os.path.basename(path)))
        warnings.append(f"resuming at step {resume_step + 1}: {len(later)} later checkpoint(s) "
                        f"and a copy of log.txt moved to {dest}")
    if damaged := truncate_log(log_file, resume_step):
        warnings.append(f"dropped {damaged} damaged line(s) from {log_file}")
    return warnings


def check_log_dir(log_dir, resume_step, overwrite):
    """What refuses a run of log_dir (resuming resume_step, or a new one: None), found without
    changing anything: before any work, and again once the run holds the lock."""
    log_file = os.path.join(log_dir, "log.txt")
    if os.path.islink(log_file):  # appending or truncating would write to wherever it points
        raise UsageError(f"{log_file} is a symbolic link (to {os.readlink(log_file)}): the run "
                         f"writes its own log.txt; remove the link or choose another --log_dir")
    earlier = os.path.exists(log_file) and os.path.getsize(log_file) > 0
    if resume_step is None and (earlier or find_checkpoints(log_dir)) and not overwrite:
        raise UsageError(f"{log_dir} holds an earlier run (log.txt or model_*.pt): pass "
                         f"--resume latest to continue it, --overwrite to start afresh, or "
                         f"another --log_dir")


def save_run_config(log_dir, run_config):
    """The whole run config, printed in short at the start, as log_dir/run_config.json."""
    data = (json.dumps(run_config, indent=1, default=str) + "\n").encode()
    atomic_write(os.path.join(log_dir, "run_config.json"), lambda f: f.write(data))


# ===== log.txt: one `step kind value` line per number ============================================
# each step: its train loss, LR, gradient norm, time (ms) and tokens/s, and on a step the fp16
# scaler skipped, the run's count of skipped steps so far; each evaluation: val loss (and val_bpb,
# the same in bits per byte of text: runs of different tokenizers compare), HellaSwag,
# CORE and each of its tasks' centred accuracy (core/LABEL: a kind of the core family), the chat
# tasks' centred mean and each one's (chat, chat/LABEL)
LOG_FORMATS = {"train": "{:.6f}", "lr": "{:.4e}", "norm": "{:.4f}", "dt": "{:.2f}",
               "tok_s": "{:.0f}", "skipped": "{:d}", "val": "{:.4f}", "val_bpb": "{:.4f}",
               "hella": "{:.4f}", "core": "{:.4f}", "chat": "{:.4f}"}
# the kinds that measure the clock: two runs of the same steps differ in these alone
TIMING_KINDS = ("dt", "tok_s")


def log_format(kind):
    """The format of a log.txt kind (core/LABEL: core's), or None for no kind of log.txt."""
    family, _, label = kind.partition("/")
    if label and family not in ("core", "chat"):
        return None
    return LOG_FORMATS.get(family)


def append_log(path, step, kind, value):
    # never through a symbolic link: the run's log stays its own (the claim refuses one)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with os.fdopen(fd, "a") as f:
        f.write(f"{step} {kind} {log_format(kind).format(value)}\n")


def parse_log_line(line):
    """(step, kind, value) of a log.txt line, or None for a damaged one (a crash can leave NUL
    bytes)."""
    parts = line.split()
    if len(parts) != 3 or log_format(parts[1]) is None:
        return None
    try:
        return int(parts[0]), parts[1], float(parts[2])
    except ValueError:
        return None


def read_log(path):
    """{kind: (steps, values)} for the kinds in a log.txt (LOG_FORMATS and core/LABEL; an older
    log has fewer); bad lines skipped."""
    series = {}
    with open(path, errors="replace") as f:
        for line in f:
            parsed = parse_log_line(line)
            if parsed is None:
                continue
            step, kind, value = parsed
            steps, values = series.setdefault(kind, ([], []))
            steps.append(step)
            values.append(value)
    return series


def truncate_log(path, last_step):
    """Keep the lines up to last_step; returns how many damaged lines were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, errors="replace") as f:
        lines = [(line, parse_log_line(line)) for line in f if line.strip()]
    kept = [line for line, parsed in lines if parsed is not None and parsed[0] <= last_step]
    atomic_write(path, lambda f: f.writelines(line.encode() for line in kept))
    return sum(parsed is None for _, parsed in lines)


# ===== How a run ends: stop signals, and the line that says what stopped it =====================
class StopSignals:
    """SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before a time limit): during a training
    step's gradient accumulation the run drops the step at the next micro-step (poll; nothing of
    it applied yet), after its last micro-step it finishes the step; either way it saves the last
    finished step and exits with 128 + the signal. Anywhere else (evaluation, samples, data prep)
    the signal raises Stopped at once. So a preempted run saves inside the scheduler's kill window,
    however long a step is. A second Ctrl-C leaves at once. Under torchrun a worker also gets
    SIGTERM when its launcher dies (Linux), so it never trains on as an orphan. Installed when
    made; restore() puts the previous handlers back."""

    def __init__(self, proc):
        self.signum, self.previous, self.interruptible, self.raised = None, {}, True, False
        self.ending = False
        self.proc = proc
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for name in ("SIGTERM", "SIGINT", "SIGUSR1"):  # no SIGUSR1 on Windows
                if hasattr(signal, name):
                    s = getattr(signal, name)
                    self.previous[s] = signal.signal(s, self.handle)
        if proc.distributed and sys.platform == "linux":
            import ctypes  # prctl(PR_SET_PDEATHSIG, SIGTERM): the kernel signals us when the
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # launcher dies

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum is not None and signum == signal.SIGINT:
            os.write(2, f"error: {name} again: leaving now, without saving this step\n".encode())
            os._exit(128 + signum)
        self.signum = self.signum or signum
        if self.ending:  # the run is saying how it ended: a signal (torchrun stopping the other
            return  # ranks once one has left) must not cut that line off
        if self.interruptible and not self.raised:  # once: the save after it runs to the end
            self.raised = True
            raise Stopped(signum)
        if self.proc.master:
            os.write(2, f"{name}: stopping at the next micro-step (or this step's end), then "
                        f"saving the last finished step (Ctrl-C again: now)\n".encode())

    def allow_interrupts(self, allowed):
        """Whether a signal interrupts what runs now (not a training step's update). One that came
        while it could not is raised now in a single process; with several, where it may have come
        to one rank alone, the next step's read-back stops every rank after the same step."""
        self.interruptible = allowed
        alone = self.proc.world_size == 1
        if allowed and alone and self.signum is not None and not self.raised:
            self.raised = True
            raise Stopped(self.signum)

    def poll(self):
        """Between two micro-steps, a point every rank reaches at the same micro-step: a stop signal
        that came to any rank raises Stopped(agreed) on every rank, so the step is dropped before
        its update and the ranks save the step before together. One process reads its flag;
        several vote over the CPU (a GPU's queued work is not waited for) and none is inside
        DDP's gradient all-reduce, which runs on a step's last micro-step alone."""
        if self.proc.world_size == 1:
            stop = self.signum is not None
        else:
            stop = not self.proc.agree(self.signum is None, on_cpu=True)
        if stop:
            self.raised = True
            raise Stopped(self.signum or signal.SIGTERM, agreed=True)  # another rank's: the same

    def end(self):
        """The run has failed or been stopped: from here until restore(), a stop signal is only
        noted (the last step is being kept and the line that says why is on its way out)."""
        self.ending = True

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def report_failure(e, step, log_dir, last_saved, proc):
    """What stopped a run at `step`, naming the checkpoint of its last finished step, said here
    (before the stop signals' handlers go: torchrun stops the other ranks once one has left, and
    its SIGTERM must not cut the line off): the exit status, 128 + the signal of a stop, 1 of an
    error of the environment or the input (UsageError, OSError: one line); a bug keeps its
    traceback. Under torchrun the failing rank leaves a note in log_dir, and a rank whose
    collective broke because of it names that rank."""
    held = ""
    if last_saved >= 0:
        held = f"; {checkpoint_path(log_dir, last_saved)} holds step {last_saved}"
    saved = f"{held}: continue with --resume latest" if held else ""
    line = None
    if isinstance(e, Stopped) and not held:
        line = f"stopped by {e} at step {step}, before any checkpoint: nothing was saved"
    elif isinstance(e, Stopped):
        line = (f"stopped by {e} at step {step}{held}: continue with python train_gpt2.py "
                f"--resume latest --log_dir {log_dir}")
    elif isinstance(e, UsageError):
        line = f"step {step} failed ({e}){saved}"
    elif isinstance(e, OSError):
        line = f"step {step} failed ({type(e).__name__}: {one_line(e)}){saved}"
    if proc.world_size > 1 and not (isinstance(e, Stopped) and e.agreed):
        other = peer_failure(log_dir, line or f"{type(e).__name__}: {one_line(e)}",
                             wait=2.0 if line is None else 0.0, rank=proc.rank)
        if other is not None and line is None:  # our collective broke when that rank left
            line = f"rank {other[0]}: {other[1]} (rank {proc.rank} stopped with it)"
    if isinstance(e, Stopped):
        print0(line)
        return 128 + e.signum
    if line is not None:  # each rank its own line: the failure may be this rank's alone
        report_error(f"error: {line}")
        return 1
    print(f"error at step {step}{saved}", file=sys.stderr, flush=True)
    raise e


def peer_failure(log_dir, what, wait, rank):
    """Note this rank's failure in log_dir (.failure.rank{N}); (rank, note) of the first other
    rank's failure that turns up within `wait` seconds, or None."""
    with contextlib.suppress(OSError):
        note = what.encode()
        atomic_write(os.path.join(log_dir, f".failure.rank{rank}"), lambda f: f.write(note))
    deadline = time.monotonic() + wait
    while True:
        notes = glob.glob(os.path.join(log_dir, ".failure.rank*"))
        for path in sorted(notes, key=os.path.getmtime):
            other = int(path.rsplit("rank", 1)[1])
            if other != rank:
                with open(path) as f:
                    return other, f.read().strip()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
