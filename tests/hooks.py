"""`python tests/hooks.py ARGS`: `python train_gpt2.py ARGS` (main() left through exit_process, as
the script itself does) with test hooks that make races and kill points deterministic: a start
gate, and holds or pauses at a chosen point. helpers.start_hooked runs it; torchrun can too.

Set by the environment:
  HOOK_MODE     which hook (one of HOOKS below), or unset for none
  HOOK_ARG      the hook's argument (see each hook)
  HOOK_MARKER   a file the hook writes when it holds or pauses (its pid inside, for the holds),
                or, for fail_batch, when a stop signal comes
  HOOK_RELEASE  a file a hold waits for
  HOOK_GATE     a file to wait for before main() starts: racers past their imports

Every name a hook replaces is looked up (no default) and its parameters checked before anything
runs, whatever the mode: a renamed or reshaped function stops every hooked run with one line
naming it, never leaving a hook that silently does nothing. rundir's functions are replaced in
rundir's own globals, where rundir (and train_gpt2, through `rundir.`) calls them.
"""
import inspect
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # the repo first on the path, as `python train_gpt2.py` has it
    sys.path[0] = REPO
elif REPO not in sys.path:
    sys.path.insert(0, REPO)

import common  # noqa: E402
import rundir  # noqa: E402
import train_gpt2 as tg  # noqa: E402

# What the hooks replace: (owner, attribute, the leading parameters the hook relies on)
TARGETS = {
    "append_log": (rundir, "append_log", ("path", "step", "kind", "value")),
    "atomic_write": (rundir, "atomic_write", ("path", "write", "size")),
    "save_run_config": (rundir, "save_run_config", ()),
    "sample_texts": (tg, "sample_texts", ()),
    "next_batch": (tg.DataLoaderLite, "next_batch", ("self",)),
    "run": (tg, "run", ("argv",)),
    "train": (tg, "train", ("run", "proc")),
    "record_error": (common, "record_error", ("text",)),
    "outlived_the_launcher": (common, "outlived_the_launcher", ()),
    "agree": (common.Proc, "agree", ("self", "ok")),
    "handle": (rundir.StopSignals, "handle", ("self", "signum")),
}


class HookTargetMissing(RuntimeError):
    """A name a hook replaces is gone or takes other parameters: the hook would do nothing."""


def resolve(owner, name, params):
    """owner.name, checked: it exists, is callable, and its first parameters are params."""
    where = f"{getattr(owner, '__name__', owner)}.{name}"
    if not hasattr(owner, name):
        raise HookTargetMissing(f"tests/hooks.py: {where} is gone (renamed?); update the hook")
    target = getattr(owner, name)
    if not callable(target):
        raise HookTargetMissing(f"tests/hooks.py: {where} is not a function; update the hook")
    have = tuple(inspect.signature(target).parameters)[: len(params)]
    if have != params:
        raise HookTargetMissing(f"tests/hooks.py: {where} takes {have}, the hook passes {params}; "
                                "update the hook")
    return target


def check_targets():
    """Every target resolved: {key: the original function}."""
    return {key: resolve(*spec) for key, spec in TARGETS.items()}


def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.01)


def mark(pid=True):
    """HOOK_MARKER, holding this process's pid: written under a name of this process's own (the
    ranks of a run may mark at once) and renamed, so a test that sees it never reads it empty."""
    marker = os.environ["HOOK_MARKER"]
    own = f"{marker}.{os.getpid()}.tmp"
    with open(own, "w") as f:
        f.write(str(os.getpid()) if pid else "")
    os.replace(own, marker)


def pause():
    """Tell the test where we are, then wait for its kill -9."""
    mark(pid=False)
    while True:
        time.sleep(1)


def hook_log(real, mode, arg):
    """hold_after_log / pause_after_log, arg "5 train": once this log line is written, hold until
    HOOK_RELEASE exists, or pause."""
    def append_log(path, step, kind, value):
        real(path, step, kind, value)
        if f"{step} {kind}" != arg:
            return
        if mode == "pause_after_log":
            pause()
        mark()
        wait_for(os.environ["HOOK_RELEASE"])
    rundir.append_log = append_log


def hook_mid_save(real, arg):
    """pause_mid_save, arg a checkpoint's file name: paused once written under its temp name."""
    def atomic_write(path, write, size=None):
        def write_then_pause(f):
            write(f)
            f.flush()
            if os.path.basename(path) == arg:
                pause()
        return real(path, write_then_pause, size)
    rundir.atomic_write = atomic_write


def hook_lock(real, arg):
    """hold_lock, arg a file: the run waits for it after claiming the log dir."""
    def save_run_config(*a, **k):
        wait_for(arg)
        return real(*a, **k)
    rundir.save_run_config = save_run_config


def hook_samples():
    """slow_samples: a sample block that would run for minutes, its start marked."""
    def sample_texts(*a, **k):
        mark()
        time.sleep(300)
    tg.sample_texts = sample_texts


def hook_batch(real, mode, arg):
    """fail_batch / hold_batch, arg "RANK CALL": that rank's CALL-th train batch (1 is the first)
    is an OSError, or is read once HOOK_RELEASE exists (a hold mid-step, between micro-steps)."""
    at_rank, at_call = (int(v) for v in arg.split())
    calls = [0]

    def next_batch(self):
        if self.split == "train" and common.rank() == at_rank:
            calls[0] += 1
            if calls[0] == at_call and mode == "fail_batch":
                raise OSError(5, "Input/output error (a test's)", self.shards[0])
            if calls[0] == at_call:
                mark()
                wait_for(os.environ["HOOK_RELEASE"])
        return real(self)
    tg.DataLoaderLite.next_batch = next_batch


def hook_fail_batch(real, arg):
    """fail_batch, arg "RANK CALL": that rank's CALL-th train batch fails (hook_batch), and every
    other rank says why it stopped only once a stop signal has come to it (HOOK_MARKER written:
    torchrun's SIGTERM, sent once the failing rank has left), as a slow rank on a busy machine
    may."""
    hook_batch(real["next_batch"], "fail_batch", arg)
    at_rank = int(arg.split()[0])
    marker = os.environ["HOOK_MARKER"]

    def handle(self, signum, *a, **k):
        open(marker, "w").close()
        return real["handle"](self, signum, *a, **k)

    def record_error(text):
        if common.rank() != at_rank:
            wait_for(marker)
        real["record_error"](text)
    rundir.StopSignals.handle, common.record_error = handle, record_error


def hook_rank0_last(real):
    """rank0_last (under torchrun): a refusal that every rank meets is left by rank 1 first; rank 0
    raises its own only once rank 1 has recorded it (HOOK_MARKER) and then exited or started to
    wait to be stopped (HOOK_MARKER + ".waits")."""
    marker = os.environ["HOOK_MARKER"]

    def run(argv):
        try:
            return real["run"](argv)
        except common.UsageError:
            if common.rank() == 0:
                wait_for(marker)
                with open(marker) as f:
                    rank1 = int(f.read())
                while not os.path.exists(marker + ".waits") and alive(rank1):
                    time.sleep(0.01)
                if not alive(rank1):  # rank 1 left first: torchrun stops rank 0 while it holds
                    pause()
            raise

    def record_error(text):
        real["record_error"](text)
        if common.rank() == 1:
            mark()

    def outlived_the_launcher(*a, **k):
        if common.rank() == 1:
            open(marker + ".waits", "w").close()
        return real["outlived_the_launcher"](*a, **k)
    tg.run, common.record_error = run, record_error
    common.outlived_the_launcher = outlived_the_launcher


def alive(pid):
    """pid is running (a zombie, exited but not yet reaped by torchrun, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def hook_refuse_alone(real, arg):
    """refuse_alone, arg a message: rank 0 refuses with it at the start of train(), alone, once
    rank 1 has entered a collective (Proc.agree): rank 1's collective breaks when rank 0 leaves."""
    def agree(self, ok, *a, **k):
        if self.rank == 1:
            open(os.environ["HOOK_MARKER"], "w").close()
        return real["agree"](self, ok, *a, **k)

    def train(run, proc, *a, **k):
        if proc.rank == 0:
            wait_for(os.environ["HOOK_MARKER"])
            raise common.UsageError(arg)
        return real["train"](run, proc, *a, **k)
    common.Proc.agree, tg.train = agree, train


HOOKS = {
    "hold_after_log": lambda real, arg: hook_log(real["append_log"], "hold_after_log", arg),
    "pause_after_log": lambda real, arg: hook_log(real["append_log"], "pause_after_log", arg),
    "pause_mid_save": lambda real, arg: hook_mid_save(real["atomic_write"], arg),
    "hold_lock": lambda real, arg: hook_lock(real["save_run_config"], arg),
    "slow_samples": lambda real, arg: hook_samples(),
    "fail_batch": hook_fail_batch,
    "hold_batch": lambda real, arg: hook_batch(real["next_batch"], "hold_batch", arg),
    "rank0_last": lambda real, arg: hook_rank0_last(real),
    "refuse_alone": hook_refuse_alone,
}


def install(mode, arg):
    """The hook of mode (none for ""), after every target is checked."""
    real = check_targets()
    if mode and mode not in HOOKS:
        raise HookTargetMissing(f"tests/hooks.py: no hook {mode!r}; there are {sorted(HOOKS)}")
    if mode:
        HOOKS[mode](real, arg)


def main():
    try:
        install(os.environ.get("HOOK_MODE", ""), os.environ.get("HOOK_ARG", ""))
    except HookTargetMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("HOOK_GATE"):  # start line: both racers are past their imports
        wait_for(os.environ["HOOK_GATE"])
    return tg.main()


if __name__ == "__main__":
    common.exit_process(main())
