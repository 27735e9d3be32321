"""A training run's directory (--log_dir) and what keeps the run in it safe and readable.

- checkpoints: model_{step:05d}.pt, written atomically, the newest --keep_last kept, loaded as data
  only (a pickle that would run code is refused), found and checked for --resume, and what wrote
  them (provenance); train_gpt2.py decides what a checkpoint holds, this file only stores it
  (and exports a model to a transformers directory);
- the claim on the log dir: one run at a time (a lock), an earlier run never overwritten by
  accident, nothing written through a symlink, a rollback's later checkpoints set aside;
- log.txt: one `step kind value` line per number, written and parsed only here;
- flag checks that need the resumed checkpoint or several flags at once;
- the memory a training step takes, estimated on fake tensors: -B auto and the plan command;
- the step line, W&B, the run's summary, the profiler; the stop signals, and the one line that
  says how a run ended
  (under torchrun, from the rank that failed and naming it on the others).

train_gpt2.py imports it; it imports nothing of train_gpt2.py.
"""

import argparse
import contextlib
import glob
import hashlib
import json
import math
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
from dataclasses import asdict

import numpy as np
import torch

from common import UsageError, atomic_write, dir_lock, flag_dest, one_line, print0, rank
from fineweb import EOT


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


def write_checkpoint(path, checkpoint, keep_last=0, master=True, agree=None):
    """torch.save(checkpoint) to path on the master process, under a temp name renamed when
    complete (never a truncated model_*.pt, even on a crash); then only the newest keep_last
    checkpoints are kept (0: all). agree (Proc.agree): every rank stops if the master could not
    write (a full disk). agree None, after a failure that may be one rank's alone: no collective,
    and a write that fails returns False (the failure's report names the newest checkpoint)."""
    error = None
    if master:
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
    if agree is None:
        return error is None
    ok = agree(error is None)
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
        raise UsageError(f"checkpoint not found: {path}")
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
    for key in ("model", "config", "args", "optimizer", "loader", "rng"):
        if key in ckpt and not isinstance(ckpt[key], dict):
            raise UsageError(f"{path} is not a usable checkpoint: its {key!r} is a "
                             f"{type(ckpt[key]).__name__}, not a dict")
    if check_weights and (bad := non_finite(ckpt["model"])):
        raise UsageError(f"{path} holds NaN or inf weights ({bad}): a diverged run's")
    return upgrade_checkpoint(ckpt)


def upgrade_checkpoint(ckpt):
    """A checkpoint in today's layout, from any layout train_gpt2.py has written."""
    args = ckpt.get("args")
    if isinstance(args, dict):
        args.setdefault("optimizer", "adamw")  # the only optimizer there was
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


def find_resume_checkpoint(resume, log_dir, print0=print):
    """(path, checkpoint) for --resume latest|PATH; latest skips unusable newer files with a
    warning."""
    if resume != "latest":
        return resume, read_checkpoint(resume, keys=RESUME_KEYS)
    found = find_checkpoints(log_dir)
    for path in reversed(found):
        try:
            return path, read_checkpoint(path, keys=RESUME_KEYS)
        except UsageError as e:
            print0(f"warning: skipping {e}")
    if found:
        raise UsageError(f"--resume latest: none of the {len(found)} checkpoints in {log_dir} "
                         f"is usable")
    raise UsageError(f"--resume latest: no model_*.pt checkpoint in {log_dir}")


def divergence(loss, norm):
    """What stops a run whose loss or gradient norm is no longer finite, and what to do."""
    return (f"the loss is {loss} and the gradient norm {norm}: the run diverged and stopped before "
            f"this update (lower --max_lr or raise --warmup_steps, and resume)")


def report_failure(e, step, log_dir, last_saved):
    """What stopped a run at `step`, naming the checkpoint of its last finished step: a stop
    signal's exit status is returned; an error of the environment or the input (UsageError,
    OSError) is raised as one line; a bug keeps its traceback. Under torchrun the failing rank
    leaves a note in log_dir, and a rank whose collective broke because of it names that rank."""
    held = ""
    if last_saved >= 0:
        held = f"; {checkpoint_path(log_dir, last_saved)} holds step {last_saved}"
    saved = f"{held}: continue with --resume latest" if held else ""
    line = None
    if isinstance(e, Stopped):
        line = (f"stopped by {e} at step {step}{held}: continue with python train_gpt2.py "
                f"--resume latest --log_dir {log_dir}")
    elif isinstance(e, UsageError):
        line = f"step {step} failed ({e}){saved}"
    elif isinstance(e, OSError):
        line = f"step {step} failed ({type(e).__name__}: {one_line(e)}){saved}"
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        other = peer_failure(log_dir, line or f"{type(e).__name__}: {one_line(e)}",
                             wait=2.0 if line is None else 0.0)
        if other is not None and line is None:  # our collective broke when that rank left
            raise UsageError(f"rank {other[0]}: {other[1]} (rank {rank()} stopped with it)",
                             rank_specific=True) from None
    if isinstance(e, Stopped):
        print0(line)
        return 128 + e.signum
    if line is not None:
        raise UsageError(line, rank_specific=world_size > 1) from None
    print(f"error at step {step}{saved}", file=sys.stderr, flush=True)
    raise e


def peer_failure(log_dir, what, wait):
    """Note this rank's failure in log_dir (.failure.rank{N}); (rank, note) of the first other
    rank's failure that turns up within `wait` seconds, or None."""
    with contextlib.suppress(OSError):
        note = what.encode()
        atomic_write(os.path.join(log_dir, f".failure.rank{rank()}"), lambda f: f.write(note))
    deadline = time.monotonic() + wait
    while True:
        notes = glob.glob(os.path.join(log_dir, ".failure.rank*"))
        for path in sorted(notes, key=os.path.getmtime):
            other = int(path.rsplit("rank", 1)[1])
            if other != rank():
                with open(path) as f:
                    return other, f.read().strip()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


# the matmuls transformers' GPT-2 keeps as Conv1D, (in, out): transposed on import and export
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")


def model_from_checkpoint(ckpt, path, make_model, device="cpu"):
    """make_model(the checkpoint's config) with its weights; a UsageError if config and weights
    disagree. On device "meta" only that check, which allocates nothing."""
    try:
        with torch.device(device):
            model = make_model(ckpt["config"])
        model.load_state_dict(ckpt["model"], assign=device == "meta")
    except (TypeError, ValueError, RuntimeError) as e:  # an unknown key, a shape the weights lack
        raise UsageError(f"{path}: its config and weights disagree ({one_line(e, 200)})") from None
    return model


def export_hf(model, out_dir):
    """Write a GPT (train_gpt2.py's) as a transformers GPT2LMHeadModel directory, the vocab
    unpadded: what `train_gpt2.py export` makes of a checkpoint."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.config
    if not c.bias or c.n_kv_head != c.n_head:
        raise UsageError(f"only GPT-2's architecture exports to GPT2LMHeadModel: this model has "
                         f"bias={c.bias}, n_kv_head={c.n_kv_head}, n_head={c.n_head}")
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=c.real_vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
        n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu_new",
        layer_norm_epsilon=1e-5, resid_pdrop=c.dropout, embd_pdrop=c.dropout,
        attn_pdrop=c.dropout, bos_token_id=EOT, eos_token_id=EOT, tie_word_embeddings=True))
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        if k.endswith(CONV1D_WEIGHTS):
            v = v.t()
        if k in ("transformer.wte.weight", "lm_head.weight"):
            v = v[: c.real_vocab_size]
        sd[k] = v.contiguous()
    hf.load_state_dict(sd, strict=True)
    hf.save_pretrained(out_dir)
    return hf


# ===== The log dir: one run at a time, an earlier run never overwritten by accident ==============
def claim_log_dir(args, ckpt, run_config, master, agree):
    """Rank 0 locks --log_dir for the run, readies it for a new run or for resuming ckpt, and saves
    the run config; every rank stops if it cannot. Returns an ExitStack; close() unlocks."""
    log_dir, resume_step = args.log_dir, None
    if ckpt is not None:
        resume_step = ckpt["step"]
    held, error = contextlib.ExitStack(), None
    if master:
        try:
            os.makedirs(log_dir, exist_ok=True)
            held.enter_context(dir_lock(log_dir, ".lock", "is in use by a live run ({holder}): "
                                        "wait for it to end, or choose another --log_dir"))
            for warning in prepare_log_dir(log_dir, resume_step, args.overwrite):
                print(f"warning: {warning}", flush=True)
            save_run_config(log_dir, run_config)
        except OSError as e:  # a file in the way, no permission, a read-only or full filesystem
            error = UsageError(f"--log_dir {log_dir}: cannot write there ({one_line(e)})")
        except UsageError as e:
            error = e
    if not agree(error is None):
        held.close()
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
    if os.path.islink(log_file):  # appending or truncating would write to wherever it points
        raise UsageError(f"{log_file} is a symbolic link (to {os.readlink(log_file)}): the run "
                         f"writes its own log.txt; remove the link or choose another --log_dir")
    if resume_step is None:
        earlier = os.path.exists(log_file) and os.path.getsize(log_file) > 0
        if (earlier or find_checkpoints(log_dir)) and not overwrite:
            raise UsageError(f"{log_dir} holds an earlier run (log.txt or model_*.pt): pass "
                             f"--resume latest to continue it, --overwrite to start afresh, or "
                             f"another --log_dir")
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


# The parts of a run that can be off: (what turns it off, whether it is off given the run's
# settings, the settings that matter only while it is on). The printed run config leaves those out
# while their part is off; check_flags warns of any given on the command line then.
OFF_PARTS = [
    ("--eval_every 0", lambda c: c["eval_every"] <= 0, ("val_tokens", "val_steps")),
    ("--sample_every 0", lambda c: c["sample_every"] <= 0,
     ("sample_prompt", "num_samples", "sample_tokens")),
    ("--hellaswag_every 0", lambda c: c["hellaswag_every"] <= 0, ("hellaswag_limit",)),
    ("no --batch_ramp_tokens", lambda c: c["batch_ramp_tokens"] <= 0, ("batch_ramp_start",)),
    ("no --profile", lambda c: not c["profile"], ("profile_schedule",)),
    ("no --wandb_project", lambda c: not c["wandb_project"], ("wandb_run_name",)),
    ("no --optimizer muon", lambda c: c["optimizer"] != "muon",
     ("muon_lr", "muon_momentum", "muon_ns_steps", "muon_adjust_lr")),
]
CONFIG_WIDTH = 100
CONFIG_INDENT = "    "  # a group's lines after its first


def format_run_config(run_config, settings):
    """The run config in short, in lines of at most CONFIG_WIDTH columns: each group of flags in
    settings ({title: [(flags, ...)]}) with the values this run uses (not None or False, nor the
    settings of a part that is off: OFF_PARTS), then what the run worked out, then each dict in it
    (the model's config, the provenance). save_run_config keeps all of it."""
    groups = {title.split(" (")[0]: [flag_dest(e[0]) for e in entries]
              for title, entries in settings.items()}
    shown = {k for names in groups.values() for k in names}
    groups["this run"] = [k for k, v in run_config.items()
                          if k not in shown and not isinstance(v, dict)]
    unused = set()
    for _, is_off, keys in OFF_PARTS:
        if is_off(run_config):
            unused.update(keys)

    lines = ["run config:"]
    for title, names in groups.items():
        items = [f"{k}={run_config[k]}" for k in names if k not in unused
                 and run_config[k] is not None and run_config[k] is not False]
        if items:  # a group with nothing set is left out
            lines += wrap_items(f"  {title}:", items)
    for key, value in run_config.items():
        if isinstance(value, dict):
            title = "GPTConfig" if key == "model" else key
            lines += wrap_items(f"  {title}:", [f"{k}={v}" for k, v in value.items()])
    return "\n".join(lines)


def wrap_items(head, items):
    """head, then the items space-separated, in lines of CONFIG_WIDTH at most: an item that does
    not fit moves whole to a line of its own, one longer than that is broken (break_text). The
    head's line keeps at least the first piece of its first item (a reader finds "title: k=v")."""
    lines, line = [], head
    for item in items:
        if len(line) + 1 + len(item) > CONFIG_WIDTH and line != head:
            lines.append(line)
            line = ""
        start = line + " " if line else CONFIG_INDENT
        pieces = break_text(item, CONFIG_WIDTH - len(start), CONFIG_WIDTH - len(CONFIG_INDENT))
        for piece in pieces[:-1]:
            lines.append(start + piece)
            start = CONFIG_INDENT
        line = start + pieces[-1]
    lines.append(line)
    return lines


def break_text(text, first, width):
    """text in pieces, the first of at most `first` characters and the others of `width`, each
    broken after the last space, '/' or ',' in its second half (a long path stays readable), or
    else at the limit."""
    pieces, limit = [], first
    while len(text) > limit:
        cut = max(text.rfind(c, 0, limit) for c in " /,") + 1
        if cut <= limit // 2:
            cut = limit
        pieces.append(text[:cut].rstrip(" "))
        text, limit = text[cut:].lstrip(" "), width
    return pieces + [text]


def save_run_config(log_dir, run_config):
    """The whole run config, printed in short at the start, as log_dir/run_config.json."""
    data = (json.dumps(run_config, indent=1, default=str) + "\n").encode()
    atomic_write(os.path.join(log_dir, "run_config.json"), lambda f: f.write(data))


# ===== log.txt: one `step kind value` line per number ============================================
# each step: its train loss, LR, gradient norm, time (ms) and tokens/s, and on a step the fp16
# scaler skipped, the run's count of skipped steps so far; each evaluation: val loss, HellaSwag
LOG_FORMATS = {"train": "{:.6f}", "lr": "{:.4e}", "norm": "{:.4f}", "dt": "{:.2f}",
               "tok_s": "{:.0f}", "skipped": "{:d}", "val": "{:.4f}", "hella": "{:.4f}"}
# the kinds that measure the clock: two runs of the same steps differ in these alone
TIMING_KINDS = ("dt", "tok_s")


def append_log(path, step, kind, value):
    # never through a symbolic link: the run's log stays its own (the claim refuses one)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with os.fdopen(fd, "a") as f:
        f.write(f"{step} {kind} {LOG_FORMATS[kind].format(value)}\n")


def parse_log_line(line):
    """(step, kind, value) of a log.txt line, or None for a damaged one (a crash can leave NUL
    bytes)."""
    parts = line.split()
    if len(parts) != 3 or parts[1] not in LOG_FORMATS:
        return None
    try:
        return int(parts[0]), parts[1], float(parts[2])
    except ValueError:
        return None


def read_log(path):
    """{kind: (steps, values)} for the kinds in a log.txt (LOG_FORMATS; an older log has fewer);
    bad lines skipped."""
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


# ===== Flag checks: what argparse cannot check alone, all before any work ========================
# the flags that decide which tokens each step sees and at which LR: a change on resume is stated
SCHEDULE_FLAGS = ("max_steps", "max_lr", "min_lr_ratio", "warmup_steps", "total_batch_size",
                  "batch_ramp_tokens", "batch_ramp_start", "seed")


def usable_val_tokens(args, status, train_tokens, val_tokens_held, val_tokens):
    """The val size the val shards can give (a warning when less than asked); also warns of shards
    no manifest vouches for and notes a run that reads its train data more than once."""
    if not status.has_manifest:
        print0(f"warning: {args.data_root} has no manifest.json: its shards were not written by "
               f"fineweb.py (or lost their record), so they are not checked against a prep")
    reads = args.max_steps * args.total_batch_size
    if reads > train_tokens:
        print0(f"note: the run reads {reads:,} train tokens and {args.data_root} holds "
               f"{train_tokens:,}: it passes over them {reads / train_tokens:.1f} times")
    if args.eval_every > 0 and val_tokens > val_tokens_held:  # ==: a prep's own val size
        print0(f"warning: the val loss is asked over {val_tokens:,} tokens but the val shards "
               f"hold {val_tokens_held - 1:,} targets: it is taken over those")
        return val_tokens_held - 1
    return val_tokens


def check_prompt_fits(n_prompt, n_new, block_size, flags, hint=""):
    """A UsageError when a prompt of n_prompt tokens and n_new more do not fit the model."""
    if n_prompt + n_new > block_size:
        raise UsageError(f"{flags[0]} ({n_prompt} tokens) + {flags[1]} ({n_new}) exceeds the "
                         f"model's block_size {block_size}{hint}")


def accumulation_steps(args, world_size, block_size):
    """Micro-steps per optimizer step, or a UsageError saying what does not fit."""
    B, T = args.micro_batch_size, args.sequence_length
    if T > block_size:
        raise UsageError(f"-T {T} is longer than the model's block_size {block_size}")
    unit = B * T * world_size
    if args.total_batch_size % unit != 0:
        raise UsageError(f"--total_batch_size {args.total_batch_size} is not divisible by "
                         f"B*T*world_size = {B}*{T}*{world_size} = {unit}: make it a multiple, "
                         f"or change -B")
    return args.total_batch_size // unit


def end_step(args):
    """The step the run stops before: --max_steps, or --stop_step when that comes first."""
    if args.stop_step is None:
        return args.max_steps
    return min(args.max_steps, args.stop_step)


def check_pairs(given):
    """Flags that cannot be given together, given ({dest: value}): checked before a resume reads its
    checkpoint."""
    for a, b in (("val_tokens", "val_steps"), ("resume", "overwrite"), ("resume", "init_from")):
        if given.get(a) and given.get(b):
            raise UsageError(f"--{a} and --{b} do not go together: give one")


def check_flags(args, given, ckpt, shape_flags, asked_shape, get_lr):
    """One-line UsageErrors for flags that cannot work together, or (ckpt) with the checkpoint
    resumed; returns warnings for settings that work but look like mistakes. given: the flags on
    the command line; asked_shape: the model config the flags describe; get_lr: train_gpt2's
    schedule."""
    shape = sorted(f"--{k}" for k in shape_flags if k in given)
    if args.init_from and shape:
        raise UsageError(f"--init_from takes the model's shape from the weights: drop "
                         f"{', '.join(shape)}")
    for key in ("log_dir", "data_root"):  # found now, not mid-run
        path = getattr(args, key)
        if not path:
            raise UsageError(f"--{key} is empty: give a folder")
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--{key} {path} is a file, not a folder")

    warnings = []
    if args.warmup_steps >= args.max_steps:
        warnings.append(f"--warmup_steps {args.warmup_steps} >= --max_steps {args.max_steps}: "
                        f"the LR never leaves warmup")
    if args.init_from and "preset" in given:
        warnings.append(f"--init_from {args.init_from}: --preset {args.preset} gives only run "
                        f"settings, not the shape")
    if "input" in given and glob.glob(os.path.join(args.data_root, "*.npy")):
        warnings.append(f"--input has no effect: {args.data_root} already holds shards (use "
                        f"another --data_root to prepare one from it)")

    # flags given for a part of the run that is off: stated, not dropped in silence
    for why, is_off, keys in OFF_PARTS:
        unused = sorted(f"--{k}" for k in keys if k in given)
        if unused and is_off(vars(args)):
            verb = "has" if len(unused) == 1 else "have"
            warnings.append(f"{', '.join(unused)} {verb} no effect with {why}")

    if ckpt is None:
        return warnings
    return warnings + check_resumed_flags(args, given, ckpt, shape_flags, asked_shape, get_lr)


def check_resumed_flags(args, given, ckpt, shape_flags, asked_shape, get_lr):
    """check_flags' part for a resumed run: the flags against the checkpoint they continue."""
    # a block switched on now: its settings, maybe the checkpoint's zeros, must be usable
    for on, keys in ((args.eval_every, ["val_tokens"]),
                     (args.sample_every, ["num_samples", "sample_tokens"])):
        values = [getattr(args, k) for k in keys]
        if on and any(v is not None and v < 1 for v in values):
            shown = ", ".join(f"--{k} {v}" for k, v in zip(keys, values))
            raise UsageError(f"{args.resume} has {shown}: give positive values now that this "
                             f"block is on")

    # the model's shape is the checkpoint's: shape flags (and -T, --preset) given now must agree
    saved, step = ckpt["args"], ckpt["step"]
    asked = {**asked_shape, "sequence_length": args.sequence_length, "preset": args.preset}
    had = {**ckpt["config"], "sequence_length": saved.get("sequence_length"),
           "preset": saved.get("preset")}
    checked = set(shape_flags) | {"dropout", "sequence_length", "preset"}
    differ = sorted(k for k in checked & set(given) if asked[k] != had[k])
    if differ:
        had_s = ", ".join(f"{k}={had[k]}" for k in differ)
        asked_s = ", ".join(f"{k}={asked[k]}" for k in differ)
        raise UsageError(f"{args.resume} holds a model trained with {had_s}; the flags ask for "
                         f"{asked_s} (a resumed run needs no shape flags)")
    if args.optimizer != saved["optimizer"]:
        kind = saved["optimizer"]
        raise UsageError(f"{args.resume} holds {kind} optimizer state but --optimizer "
                         f"{args.optimizer} was given: resume with --optimizer {kind} (or without "
                         f"the flag), or start a new run")

    # nothing left but the final evaluation (a checkpoint of step max_steps - 1) is fine
    if step + 1 >= end_step(args) and step + 1 != args.max_steps:
        stop = f" / --stop_step {args.stop_step}" if args.stop_step else ""
        raise UsageError(f"{args.resume} is at step {step}: --max_steps {args.max_steps}{stop} "
                         f"leave nothing to train")

    warnings = []
    for k in SCHEDULE_FLAGS:
        if k in given and k in saved and getattr(args, k) != saved[k]:
            warnings.append(f"--{k} is {getattr(args, k)} now but was {saved[k]} in the "
                            f"checkpoint")
    lrs = []
    for f in ({**vars(args), **saved}, vars(args)):
        lrs.append(get_lr(step + 1, f["max_lr"], f["max_lr"] * f["min_lr_ratio"],
                          f["warmup_steps"], f["max_steps"]))
    then, now = lrs
    if not math.isclose(then, now, rel_tol=1e-9):
        warnings.append(f"the schedule changed: step {step + 1} gets LR {now:.4e} (the "
                        f"checkpoint's schedule would give {then:.4e})")
    return warnings



# ===== The micro-batch that fits: -B auto, and the plan command's memory figure ==================
# Tensor memory is what the estimate counts; the CUDA context, cuBLAS's workspaces and the
# allocator's slack come on top: a fifth of a GPU is left for them. On a CPU (or Apple's unified
# memory) half of the machine's memory is left to the system, the data and Python.
USABLE_GPU_MEMORY, USABLE_HOST_MEMORY = 0.8, 0.5


def memory_budget(device):
    """(bytes a training step may use on device, what that is of) or a UsageError if unknown."""
    if str(device).startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return USABLE_GPU_MEMORY * props.total_memory, f"{props.name}'s {gib(props.total_memory)}"
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return USABLE_HOST_MEMORY * total, f"this machine's {gib(total)}"
    raise UsageError("-B auto: this system does not say how much memory it has: give -B N")


def gib(n):
    return f"{n / 2**30:.1f} GiB"


def with_optimizer_state(model, optimizer):
    """The optimizer's state made (AdamW makes it on its first step): a step over zero gradients,
    so that an estimate sees the steady state."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()


def estimated_step(model, optimizer, x, y, autocast_ctx, counted=contextlib.nullcontext()):
    """The training step the estimates measure: forward under autocast and backward (inside
    ``counted``), clipping, the optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    with counted:
        with autocast_ctx:
            _, loss = model(x, y)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def step_memory(make_model, make_optimizer, T, vocab, device, autocast_ctx):
    """A function B -> the peak tensor memory of one training step of B sequences of T tokens (the
    forward under autocast, backward, clipping, an optimizer step whose state exists already), as
    torch's MemTracker counts it on fake tensors: nothing is allocated, and one model serves every
    B asked."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    mode = FakeTensorMode()
    with mode, torch.device(device):
        model = make_model()
        optimizer = make_optimizer(model)
        with_optimizer_state(model, optimizer)
    known = {}

    def peak(B):
        if B in known:
            return known[B]
        with mode, torch.device(device):
            x = torch.randint(0, vocab, (B, T))
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                estimated_step(model, optimizer, x, x, autocast_ctx)
        snapshot = tracker.get_tracker_snapshot("peak")
        kind = torch.device(device).type
        known[B] = max(v["Total"] for d, v in snapshot.items() if d.type == kind)
        return known[B]

    return peak


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_candidates(args, world_size):
    """The micro-batches that divide the step's sequences per process, ascending."""
    T, total = args.sequence_length, args.total_batch_size
    if total % (T * world_size):
        raise UsageError(f"--total_batch_size {total} is not a multiple of T*world_size = "
                         f"{T}*{world_size}: a step must be whole sequences on every process")
    return divisors(total // (T * world_size))


def largest_fitting(peak, candidates, budget, of_what):
    """(B, its estimate): the largest of candidates (ascending) whose step fits in budget bytes,
    by bisection (memory grows with B); a UsageError if none does."""
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if peak(candidates[mid]) <= budget:
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise UsageError(f"-B auto: even -B 1 needs about {gib(peak(candidates[0]))}, more than "
                         f"the {gib(budget)} usable of {of_what}: a smaller model or -T")
    return best, peak(best)


def forked_rng(device):
    """torch.random.fork_rng over the CPU's generator and device's: they are as they were after."""
    dev = torch.device(device)
    return torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev.index or 0],
                                 device_type=dev.type)


def confirm_micro_batch(model, candidates, B, T, device, autocast_ctx, agree):
    """B, or the next smaller candidate until one real forward and backward of B x T tokens fits
    on every rank (the estimate leaves out fragmentation and the kernels' workspaces); the model
    is left without gradients. Random generators are left as they were."""
    while True:
        fits = True
        with forked_rng(device):
            try:
                x = torch.zeros(B, T, dtype=torch.long, device=device)
                with autocast_ctx:
                    _, loss = model(x, x)
                loss.backward()
            except torch.OutOfMemoryError:
                fits = False
        x = loss = None
        model.zero_grad(set_to_none=True)
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
        if agree(fits):
            return B
        smaller = [c for c in candidates if c <= B // 2]
        if not smaller:
            raise UsageError(f"-B auto: even -B {B} runs out of memory here: a smaller model or -T")
        B = smaller[-1]


def auto_micro_batch(make_model, make_optimizer, args, device, world_size, autocast_ctx, vocab,
                     agree):
    """-B auto: the largest micro-batch that divides the step's sequences per rank and whose
    estimated step fits this device's memory, confirmed on CUDA by a real step; returns it and the
    run config's record of the choice."""
    T = args.sequence_length
    if args.fsdp:
        raise UsageError("-B auto estimates a whole model per GPU, not FSDP's shards: give -B N")
    candidates = micro_batch_candidates(args, world_size)
    budget, of_what = memory_budget(device)
    peak = step_memory(make_model, make_optimizer, T, vocab, device, autocast_ctx)
    B, estimate = largest_fitting(peak, candidates, budget, of_what)
    if str(device).startswith("cuda"):
        confirmed = confirm_micro_batch(make_model().to(device), candidates, B, T, device,
                                        autocast_ctx, agree)
        if confirmed != B:
            B, estimate = confirmed, peak(confirmed)
    print0(f"-B auto: {B} (a step's estimated peak {gib(estimate)} of the {gib(budget)} usable "
           f"of {of_what}); micro-steps a step: {args.total_batch_size // (B * T * world_size)}")
    return B, {"micro_batch_estimate_gib": round(estimate / 2**30, 2),
               "memory_budget_gib": round(budget / 2**30, 2)}


def measure_micro_step(make_model, make_optimizer, B, T, vocab, device, autocast_ctx, repeats=3):
    """(fastest, slowest) seconds of a few real micro-steps (forward, backward, optimizer step) of
    B x T tokens on device, after one to warm up; random generators are left as they were."""
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    x = torch.zeros(B, T, dtype=torch.long, device=device)
    seconds = []
    with forked_rng(device):
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with autocast_ctx:
                _, loss = model(x, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # waits for the device
            seconds.append(time.perf_counter() - t0)
    return min(seconds[1:]), max(seconds[1:])


def plan(args, settings, config, make_model, make_optimizer, device, autocast_ctx, dtype):
    """The plan command's report of the run these flags make (under torchrun: per process): its
    config, size, batch, memory, compute and time, worked out before anything is written (and, on
    a GPU, allocated)."""
    T, total = args.sequence_length, args.total_batch_size
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    candidates = micro_batch_candidates(args, world_size)
    peak = step_memory(make_model, make_optimizer, T, config.vocab_size, device, autocast_ctx)
    budget, of_what = memory_budget(device)
    B = args.micro_batch_size
    if B == "auto":
        B, _ = largest_fitting(peak, candidates, budget, of_what)
    args.micro_batch_size = B
    micro_steps = accumulation_steps(args, world_size, config.block_size)
    with torch.device("meta"):
        model = make_model()
    n_params = model.get_num_params()
    step_flops = flops_per_token(config, model.get_num_params(non_embedding=True), T) * total
    steps = end_step(args)
    run_config = {**vars(args), "device": device,
                  "world_size": world_size, "grad_accum_steps": micro_steps,
                  "autocast_dtype": dtype, "model": asdict(config)}

    peak_per_gpu = args.peak_flops
    if peak_per_gpu is None and str(device).startswith("cuda"):
        peak_per_gpu = peak_flops(torch.cuda.get_device_name(device))
    if peak_per_gpu:  # compiled GPT-2 training runs reach about 30-50% of a GPU's peak
        fast = steps * step_flops / (world_size * peak_per_gpu * 0.5)
        slow, how = fast * 0.5 / 0.3, f"at 50% to 30% MFU of {peak_per_gpu / 1e12:.0f} TFLOP/s"
    else:  # measured at -B 1 and scaled: no peak to go by
        fastest, slowest = measure_micro_step(make_model, make_optimizer, 1, T,
                                              config.vocab_size, device, autocast_ctx)
        fast, slow = (steps * micro_steps * B * t for t in (fastest, slowest))
        how = f"from 3 micro-steps of 1 sequence measured on {device}, times {B * micro_steps}"
    fits = ""
    if peak(B) > budget:
        fits = ": it does not fit, -B auto picks one that does"
    return "\n".join([
        format_run_config(run_config, settings),
        f"plan: {n_params:,} parameters on {world_size} x {device} in {dtype}",
        f"  tokens: {steps:,} steps x {total:,} = {steps * total:,}",
        f"  batch: -B {B} x -T {T} x {world_size} process(es), {micro_steps} micro-step(s) a step",
        f"  memory: a step's estimated peak {gib(peak(B))} per process,",
        f"    of {gib(budget)} usable of {of_what}{fits}",
        f"  compute: {step_flops / 1e12:,.1f} TFLOP a step (6N + attention), "
        f"{steps * step_flops / 1e18:,.2f} EFLOP in all",
        f"  time: {format_eta(fast)} to {format_eta(slow)} ({how})"])


# ===== The step line, log.txt and W&B ============================================================
# Peak dense bf16 FLOP/s (half NVIDIA's with-sparsity figures), fp16 for GPUs without bf16 (T4,
# V100: their datasheets' tensor-core figures), matched in order as substrings of the device name:
# SXM parts have no form factor in theirs, so NVL and PCIe come first.
PEAK_BF16_FLOPS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("H200 NVL", 835e12), ("H200", 989e12), ("A100", 312e12),
                   ("V100S", 130e12), ("V100-PCIE", 112e12), ("V100", 125e12), ("T4", 65e12)]


def peak_flops(device_name):
    """Peak dense bf16 FLOP/s of a GPU named like torch.cuda.get_device_name(), or None."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.casefold() in device_name.casefold():
            return flops
    return None


def format_eta(seconds):
    return f"{int(seconds) // 3600}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"


def flops_per_token(config, n_params, seq_len):
    """Training FLOPs per token, forward + backward: 6N + 12·L·H·Q·T (PaLM, appendix B). n_params
    leaves out wpe (a lookup) and counts the tied wte/lm_head once; 12·L·H·Q·T are the attention
    matmuls."""
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, seq_len
    return 6 * n_params + 12 * L * H * Q * T


class Metrics:
    """Where a run's numbers go: the step line (loss, lr, norm, speed, MFU, memory, ETA) on stdout,
    log.txt on rank 0, and W&B with --wandb_project; at the end, the run's summary."""

    def __init__(self, args, device, world_size, first_step, end, config, n_params, run_config):
        self.log_file, self.device = os.path.join(args.log_dir, "log.txt"), device
        self.world_size = world_size
        self.flops_per_token = flops_per_token(config, n_params, args.sequence_length)
        self.first_step, self.end, self.show_batch = first_step, end, args.batch_ramp_tokens > 0
        self.on_cuda, self.master = str(device).startswith("cuda"), rank() == 0
        # a full-size run on a CPU takes days: said once, from the first steps' time
        self.warn_slow = str(device) == "cpu" and args.preset != "tiny"
        self.peak = args.peak_flops
        if self.peak is None and self.on_cuda:
            self.peak = peak_flops(torch.cuda.get_device_name(device))

        # for the summary: this session's clock, steps and tokens; the whole run's evaluations and
        # skipped steps, a resumed run's earlier ones from its log.txt (already cut to its step)
        self.start, self.steps, self.tokens, self.last_step = time.time(), 0, 0, None
        self.evals, self.skipped = {"val": [], "hella": []}, 0
        if self.master and first_step > 0 and os.path.exists(self.log_file):
            earlier = read_log(self.log_file)
            for kind in self.evals:
                steps, values = earlier.get(kind, ([], []))
                self.evals[kind] = [(s, v) for s, v in zip(steps, values) if s < first_step]
            if "skipped" in earlier:
                self.skipped = int(earlier["skipped"][1][-1])

        self.wandb_run, self.dt_avg = None, None
        if args.wandb_project and self.master:
            try:
                import wandb
            except ImportError:
                message = "--wandb_project needs the wandb package: pip install wandb"
                raise UsageError(message) from None
            self.wandb_run = wandb.init(project=args.wandb_project, name=args.wandb_run_name,
                                        config=run_config)

    def log(self, step, kind, value, **extra):
        """kind (train/val/hella) to log.txt on rank 0, with the extra numbers that are log.txt
        kinds too (lr, norm, dt, ...); all to W&B, the extra ones as kind/name."""
        if kind in self.evals:
            self.evals[kind].append((step, value))
        if self.master:
            append_log(self.log_file, step, kind, value)
            for name, number in extra.items():
                if name in LOG_FORMATS:
                    append_log(self.log_file, step, name, number)
        if self.wandb_run is not None:
            extra = {f"{kind}/{k}": v for k, v in extra.items()}
            self.wandb_run.log({kind: value, **extra}, step=step)

    def report_step(self, step, loss, lr, norm, dt, batch_size, skipped=False):
        """The step line and the step's numbers (dt in seconds, batch_size in tokens). skipped: the
        fp16 scaler found inf/nan gradients (norm) and did not apply this update."""
        tokens_per_sec = batch_size / dt
        self.steps, self.tokens, self.last_step = self.steps + 1, self.tokens + batch_size, step
        first_timed = False
        if step > self.first_step:  # the first step compiles and warms up: not in the ETA
            if self.dt_avg is None:
                self.dt_avg, first_timed = dt, True
            else:
                self.dt_avg = 0.9 * self.dt_avg + 0.1 * dt
        extra = {"lr": lr, "norm": norm, "dt": 1000 * dt, "tok_s": tokens_per_sec}
        line = f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f}"
        if skipped:
            self.skipped += 1
            extra["skipped"] = self.skipped
            line += " | skipped (fp16 overflow)"
        line += f" | dt {dt * 1000:.2f}ms | tok/sec {tokens_per_sec:.0f}"
        if self.show_batch:
            line += f" | batch {batch_size}"
        if self.peak:
            extra["mfu"] = self.flops_per_token * tokens_per_sec / (self.peak * self.world_size)
            line += f" | mfu {100 * extra['mfu']:.1f}%"
        if self.on_cuda:
            extra["mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            line += f" | mem {extra['mem_gib']:.1f}GiB"
        eta = None
        if self.dt_avg is not None:
            eta = (self.end - step - 1) * self.dt_avg
            line += f" | eta {format_eta(eta)}"
        if self.master:
            print(line, flush=True)
            if first_timed and self.warn_slow and eta > 3600:
                print(f"warning: on the CPU this run takes about {format_eta(eta)} (from the "
                      f"first steps); for a run of minutes use --preset tiny", flush=True)
        self.log(step, "train", loss, **extra)

    def summary(self, last_checkpoint):
        """The run in a few lines, for its end: this session's wall time (from this object's
        making), steps and tokens; the final and best val loss and the last HellaSwag accuracy
        (a resumed run's earlier ones included); last_checkpoint (a path, or None); the skipped
        steps, if any."""
        trained = "no step trained"
        if self.steps:
            trained = (f"steps {self.first_step}-{self.last_step} ({self.steps:,} steps, "
                       f"{self.tokens:,} tokens)")
        lines = [f"run summary: {trained} in {format_eta(time.time() - self.start)}"]
        if self.evals["val"]:
            step, value = self.evals["val"][-1]
            line = f"  val loss: {value:.4f} at step {step}"
            finite = [(v, s) for s, v in self.evals["val"] if math.isfinite(v)]
            if finite:
                best, best_step = min(finite)
                line += f", best {best:.4f} at step {best_step}"
            lines.append(line)
        if self.evals["hella"]:
            step, value = self.evals["hella"][-1]
            lines.append(f"  HellaSwag acc_norm: {value:.4f} at step {step}")
        lines.append(f"  last checkpoint: {last_checkpoint or 'none'}")
        if self.skipped:
            lines.append(f"  skipped steps (fp16 overflow): {self.skipped}")
        return "\n".join(lines)

    def finish(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()


# ===== The profiler and the stop signals =========================================================
def profile_schedule(text):
    """argparse type of --profile_schedule: WAIT,WARMUP,ACTIVE steps."""
    if not re.fullmatch(r"\d+,\d+,0*[1-9]\d*", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers WAIT,WARMUP,ACTIVE "
                                         f"(>= 0, >= 0, >= 1)")
    return text


class Profiler:
    """torch.profiler over a few training steps (--profile_schedule): a trace, then the top ops.
    Without --profile every call does nothing."""

    def __init__(self, args, device_type, process_rank):
        self.mode, self.steps_left, self.on_cuda = args.profile, 0, device_type == "cuda"
        if self.mode is None:
            return
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler
        wait, warmup, active = (int(v) for v in args.profile_schedule.split(","))
        activities = [ProfilerActivity.CPU]
        if self.on_cuda:
            activities.append(ProfilerActivity.CUDA)
        self.out = os.path.join(args.log_dir, "profile")
        handler = tensorboard_trace_handler(self.out, f"rank{process_rank}")
        self.prof = profile(activities=activities, record_shapes=True, on_trace_ready=handler,
                            schedule=torch.profiler.schedule(wait=wait, warmup=warmup,
                                                             active=active, repeat=1))
        self.prof.start()
        self.steps_left = wait + warmup + active

    def step(self):
        """Call after each training step; True when the run should stop here (--profile exit)."""
        if self.mode is None or self.steps_left < 0:
            return False
        self.steps_left -= 1
        if self.steps_left >= 0:
            self.prof.step()
        if self.steps_left != 0:  # still recording
            return False
        self.steps_left = -1
        self.prof.stop()  # the trace handler wrote <log_dir>/profile/rank{r}.*.pt.trace.json
        if rank() == 0:
            sort = "self_cuda_time_total" if self.on_cuda else "self_cpu_time_total"
            print(self.prof.key_averages().table(sort_by=sort, row_limit=20), flush=True)
            print(f"profiler trace in {self.out} (open in ui.perfetto.dev or TensorBoard)",
                  flush=True)
        return self.mode == "exit"


class Stopped(KeyboardInterrupt):
    """A stop signal that arrived outside a training step: evaluation, samples, data prep."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before a time limit): during a training step
    the run finishes the step, saves a checkpoint and exits with 128 + the signal; anywhere else
    (evaluation, samples, data prep) the signal raises Stopped at once, so that a preempted run
    saves its last finished step inside the scheduler's kill window. A second Ctrl-C leaves at
    once. Under torchrun a worker also gets SIGTERM when its launcher dies (Linux), so it never
    trains on as an orphan. Installed when made; restore() puts the previous handlers back."""

    def __init__(self):
        self.signum, self.previous, self.interruptible, self.raised = None, {}, True, False
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for name in ("SIGTERM", "SIGINT", "SIGUSR1"):  # no SIGUSR1 on Windows
                if hasattr(signal, name):
                    s = getattr(signal, name)
                    self.previous[s] = signal.signal(s, self.handle)
        if "WORLD_SIZE" in os.environ and sys.platform == "linux":
            import ctypes  # prctl(PR_SET_PDEATHSIG, SIGTERM): the kernel signals us when the
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # launcher dies

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum is not None and signum == signal.SIGINT:
            os.write(2, f"error: {name} again: leaving now, without saving this step\n".encode())
            os._exit(128 + signum)
        self.signum = self.signum or signum
        if self.interruptible and not self.raised:  # once: the save after it runs to the end
            self.raised = True
            raise Stopped(signum)
        if rank() == 0:
            os.write(2, f"{name}: finishing this step, then saving a checkpoint (Ctrl-C again: "
                        f"now)\n".encode())

    def allow_interrupts(self, allowed):
        """Whether a signal interrupts what runs now (not a training step's update). One that came
        while it could not is raised now in a single process; with several, where it may have come
        to one rank alone, the next step's read-back stops every rank after the same step."""
        self.interruptible = allowed
        alone = int(os.environ.get("WORLD_SIZE", 1)) == 1
        if allowed and alone and self.signum is not None and not self.raised:
            self.raised = True
            raise Stopped(self.signum)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
