"""Seeded device bugs, the negative controls of the simulated checks: copies of train_gpt2.py /
scorer.py with one tensor left on the CPU (a device= dropped, a .to(device) dropped) at a place
found by pattern; the check that covers the place must fail with the device mismatch a GPU
raises."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# how torch words a cuda/cpu mix: fake tensors' own check, and the checks inside ops'
# decompositions
DEVICE_BUG = re.compile(r"FakeTensorDeviceMismatchError|found at least two devices"
                        r"|expected to be in the same device")


def drop_device_argument(line):
    return re.sub(r",\s*device=[\w.]+", "", line)


def drop_transfer(line):
    return re.sub(r"\.to\([^()]*device[^()]*\)", "", line)


def transfer_lines(lines):
    """Indices of the lines that move a freshly loaded batch to the device: the first
    `.to(...device...)` line after each `next_batch(` call, within the same function."""
    found = []
    for i, line in enumerate(lines):
        if "next_batch(" not in line or line.lstrip().startswith(("def ", "#")):
            continue
        for j in range(i, min(i + 12, len(lines))):
            if j > i and lines[j].lstrip().startswith("def "):
                break
            if re.search(r"\.to\([^()]*device[^()]*\)", lines[j]):
                found.append(j)
                break
    return found


def enclosing_function(lines, i):
    for j in range(i, -1, -1):
        m = re.match(r"\s*def (\w+)", lines[j])
        if m:
            return m.group(1)
    return None


def matching(pattern, in_function=None):
    """A finder: the indices of the lines that match pattern (inside the def named in_function,
    if given)."""
    def find(lines):
        return [i for i, line in enumerate(lines) if re.search(pattern, line)
                and (in_function is None or enclosing_function(lines, i) == in_function)]
    return find


# (what, file, how its lines are found, the seeded change, the check that must catch it)
SEEDS = [
    ("positions in forward", "train_gpt2.py", matching(r"torch\.arange\(.*device=", "forward"),
     drop_device_argument, "inference"),
    ("the attention mask of the cached path", "train_gpt2.py",
     matching(r"torch\.ones\(.*torch\.bool.*device="), drop_device_argument, "inference"),
    ("the batch transfer after next_batch", "train_gpt2.py", transfer_lines, drop_transfer,
     "train"),
    ("the scorer's token batches", "scorer.py",
     matching(r"torch\.from_numpy\(tok\)\.to\(device\)"), drop_transfer, "inference"),
    ("the scorer's per-row loss sums", "scorer.py",
     matching(r"sum_loss = torch\.zeros\(.*device="), drop_device_argument, "inference"),
]


def seeded_copies(folder, what, filename, find, change):
    """One copy of filename per line find() picks, that line changed, each in a new folder under
    folder (a pathlib.Path): [(folder, line number, function)]; or why there is none (the pattern
    matches nothing any more)."""
    with open(os.path.join(REPO, filename)) as f:
        lines = f.read().splitlines(keepends=True)
    picked = find(lines)
    if not picked:
        return (f"seed '{what}': no line of {filename} matches its pattern any more: update it "
                f"in SEEDS")
    copies = []
    for n, i in enumerate(picked):
        changed = change(lines[i])
        assert changed != lines[i], \
            f"seed '{what}' changed nothing on {filename}:{i + 1}: {lines[i]!r}"
        seed = folder / f"seed{n}"
        seed.mkdir()
        (seed / filename).write_text("".join(lines[:i] + [changed] + lines[i + 1:]))
        copies.append((str(seed), i + 1, enclosing_function(lines, i)))
    return copies
