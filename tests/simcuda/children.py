"""The simulated checks' child processes: the preload library must be loaded before torch is
imported, and pytest's process has imported torch already."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = os.path.join(HERE, "checks.py")
REPO = os.path.dirname(os.path.dirname(HERE))


class ChildFailed(Exception):
    """A child process gave no result for a check (it crashed or ran out of time)."""


class Children:
    """Child processes started together (the checks are single-threaded: two cores run two at a
    time), their output in files under folder; result(spec) waits for the one that runs spec and
    returns its RESULT entry."""

    def __init__(self, folder, timeout=600):
        self.folder, self.timeout = folder, timeout
        self.procs, self.owner, self.done = [], {}, {}

    def start(self, cmd, specs):
        n = len(self.procs)
        out_path = os.path.join(self.folder, f"{n}.out")
        err_path = os.path.join(self.folder, f"{n}.err")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=REPO)
        proc.files = (out_path, err_path)
        self.procs.append(proc)
        for spec in specs:
            self.owner[spec] = proc

    def start_checks(self, lib, specs):
        """checks.py with the preload library lib, running specs one after the other."""
        self.start([sys.executable, CHECKS, lib, *specs], specs)

    def output(self, proc):
        """(exit code, stdout, stderr) of proc, once it has finished."""
        if proc not in self.done:
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            texts = []
            for path in proc.files:
                with open(path) as f:
                    texts.append(f.read())
            self.done[proc] = (proc.returncode, *texts)
        return self.done[proc]

    def result(self, spec):
        """The RESULT entry of spec: {"spec", "ok", "result" | "error"}; ChildFailed if there is
        none."""
        code, out, err = self.output(self.owner[spec])
        for line in out.splitlines():
            if line.startswith("RESULT "):
                entry = json.loads(line[len("RESULT "):])
                if entry["spec"] == spec:
                    return entry
        raise ChildFailed(f"no result for {spec} (exit {code}, after at most {self.timeout} s):"
                          f"\n{err[-4000:]}")

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
