"""HellaSwag evaluation, completion style.

Each example has a context and four candidate endings. Every ending is appended to the context (as
``" " + ending``) and scored by the cross-entropy of its tokens given everything before them:
``acc`` picks the ending with the lowest *summed* loss, ``acc_norm`` the lowest *mean* loss.

A library (``train_gpt2.py`` takes :func:`evaluate` from it) and a CLI
that scores OpenAI's GPT-2 through transformers' own ``GPT2LMHeadModel``, an implementation
independent of ours (ours: ``python train_gpt2.py eval --checkpoint log/model_19072.pt``)::

    python hellaswag.py -m gpt2 -d cuda          # openai-community/gpt2 (or a save_pretrained dir)
    python hellaswag.py -m gpt2-xl --limit 500   # a quick subset

Data: ``hellaswag_{train,val,test}.jsonl`` in a folder next to this file (or ``--hellaswag_dir``,
``$HELLASWAG_DIR``); a missing file is fetched from ``Rowan/hellaswag``'s parquet conversion through
HF ``datasets`` in the original schema. Every record is checked before it is scored. Importing this
downloads, spawns and opens nothing, and imports neither torch nor datasets.
"""

import itertools
import json
import os
import sys
import time

import fineweb
from openai_gpt2 import OPENAI_MODELS, load_hf_model
from common import (DTYPES, NONNEG_INT, POSITIVE_INT, OneLineParser, UsageError, atomic_write,
                    autocast_for, hub_unreachable, one_line, resolve_device, run_cli, torch_dtype,
                    tune_for_device)
from scorer import Row, max_positions, progress_bar, score_groups

# ---------------------------------------------------------------------------
# data

DEFAULT_DATA_DIR = (os.environ.get("HELLASWAG_DIR")
                    or os.path.join(os.path.dirname(os.path.abspath(__file__)), "hellaswag"))

SPLITS = ("train", "val", "test")
HF_DATASET = "Rowan/hellaswag"
# the repository's loading script no longer runs under recent `datasets`; the hub's
# automatic parquet conversion of it does, and is the source that works today
HF_REVISION = "refs/convert/parquet"
HF_SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}
# number of examples per split (HellaSwag paper / HF dataset card); a freshly
# downloaded file with a different count is rejected
EXPECTED_COUNTS = {"train": 39905, "val": 10042, "test": 10003}
# key order of the original jsonl records
RECORD_KEYS = ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split",
               "split_type", "label", "endings", "source_id")
NUM_ENDINGS = 4


class HellaSwagUnavailable(UsageError):
    """The HellaSwag data can't be had (offline and no local copy, wrong example count, a file that
    is not valid HellaSwag data). The message is a single line."""


class HellaSwagBadData(HellaSwagUnavailable):
    """A HellaSwag record can't be scored; the message names the file and line. A subclass, so that
    training turns the evaluation off for it as for data that can't be had."""


def _resolve_data_dir(data_dir=None):
    # the env var is read at call time (not only at import) so it can be set late
    return data_dir or os.environ.get("HELLASWAG_DIR") or DEFAULT_DATA_DIR


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"unknown HellaSwag split {split!r}; expected one of {', '.join(SPLITS)}")


def _load_hf_rows(split):
    """Rows of ``Rowan/hellaswag`` (parquet conversion) for ``split`` through HF ``datasets``
    (which only reads its cache under ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``)."""
    import logging

    import datasets

    # keep the hub client's retry warnings out of the one-line error / training log
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return datasets.load_dataset(HF_DATASET, split=HF_SPLIT_NAMES[split], revision=HF_REVISION)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def hf_to_record(row, split=None):
    """A ``Rowan/hellaswag`` row in the original jsonl schema: HF's string ``label`` ("" in the
    unlabelled test split) becomes an int, or no ``label`` key for test, as in the original."""
    rec = {}
    for key in RECORD_KEYS:
        if key not in row:
            continue
        val = row[key]
        if key == "label":
            if val is None or (isinstance(val, str) and val.strip() == ""):
                continue
            val = int(val)
        elif key == "ind":
            val = int(val)
        elif key == "endings":
            val = [str(e) for e in val]
        rec[key] = val
    if "ctx" not in rec and "ctx_a" in rec:
        rec["ctx"] = (rec["ctx_a"] + " " + rec.get("ctx_b", "")).strip()
    if "split" not in rec and split is not None:
        rec["split"] = split
    return rec


def manual_step(split, path):
    """The one command that fetches ``split`` by hand today (on any machine with internet)."""
    return (f"python -c \"from datasets import load_dataset; load_dataset('{HF_DATASET}', "
            f"split='{HF_SPLIT_NAMES[split]}', revision='{HF_REVISION}').to_json('{path}')\"")


def _unavailable_message(split, path, why):
    return one_line(f"HellaSwag data unavailable: {path} is missing and fetching it from HF "
                    f"{HF_DATASET} (revision {HF_REVISION}) failed ({why}); fetch it by hand with "
                    f"{manual_step(split, path)} (or place hellaswag_{split}.jsonl in "
                    f"--hellaswag_dir / $HELLASWAG_DIR)", limit=10_000)


def _write_rows(rows, split, path, f):
    """Write HF rows as jsonl records into ``f``, checking the example count before the rename."""
    bar = progress_bar(total=len(rows) if hasattr(rows, "__len__") else None, unit="ex",
                        desc=os.path.basename(path))
    n = 0
    try:
        for row in rows:
            try:
                line = json.dumps(hf_to_record(row, split)) + "\n"
            except (KeyError, TypeError, ValueError) as e:
                why = f"row {n}: {type(e).__name__}: {one_line(e, 60)}"
                raise HellaSwagUnavailable(_unavailable_message(split, path, why)) from None
            f.write(line.encode("utf-8"))
            n += 1
            bar.update(1)
    finally:
        bar.close()
    expected = EXPECTED_COUNTS.get(split)
    if expected is not None and n != expected:
        why = f"{n} examples, expected {expected}"
        raise HellaSwagUnavailable(_unavailable_message(split, path, why))


def download(split, data_dir=None):
    """The path of ``hellaswag_{split}.jsonl``, used as is if it exists, else loaded from
    ``Rowan/hellaswag`` (``refs/convert/parquet``) through HF ``datasets``, its count checked and
    written with ``common.atomic_write`` (a unique temp file renamed into place: DDP ranks may
    download at once, no partial file is left). Raises :class:`HellaSwagUnavailable`."""
    _check_split(split)
    data_dir = _resolve_data_dir(data_dir)
    path = os.path.join(data_dir, f"hellaswag_{split}.jsonl")
    if os.path.isfile(path):
        return path
    if os.environ.get("HELLASWAG_OFFLINE", "") not in ("", "0"):
        raise HellaSwagUnavailable(_unavailable_message(split, path, "HELLASWAG_OFFLINE is set"))
    if hub_unreachable():  # datasets' client would retry for half a minute before saying so
        why = "the hub is unreachable; HF_HUB_OFFLINE=1 reads a copy in the datasets cache"
        raise HellaSwagUnavailable(_unavailable_message(split, path, why))
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
        why = f"cannot create {data_dir}: {one_line(e, 100)}"
        raise HellaSwagUnavailable(_unavailable_message(split, path, why)) from None
    print(f"hellaswag: fetching the {split} split from HF {HF_DATASET} (revision {HF_REVISION}) "
          f"into {path}", file=sys.stderr)
    try:
        rows = _load_hf_rows(split)
    except Exception as e:  # offline with no cache, hub down, datasets missing, ...
        why = f"{type(e).__name__}: {one_line(e, 120)}" if str(e).strip() else type(e).__name__
        raise HellaSwagUnavailable(_unavailable_message(split, path, why)) from None

    try:
        atomic_write(path, lambda f: _write_rows(rows, split, path, f))
    except OSError as e:  # a full disk (DiskFullError), a read-only folder: nothing left under path
        raise HellaSwagUnavailable(_unavailable_message(split, path, one_line(e, 300))) from None
    return path


def ready_on_every_rank(proc, split="val"):
    """Training's first use: the master downloads the split, then the other ranks find its file.
    True when every rank has it; else False after a warning from each rank that has not (HellaSwag
    is then off). proc: the process's place in the run (common.Proc)."""
    ok = True
    for masters_turn in (True, False):
        if proc.master == masters_turn:
            try:
                download(split)
            except HellaSwagUnavailable as e:
                print(f"warning: HellaSwag evaluation turned off: {e}", flush=True)
                ok = False
        ok = proc.agree(ok)
    return ok


def _label(value, where):
    """A label as its int 0..3; HF stores it as a string ("3")."""
    number = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < NUM_ENDINGS:
        shown = one_line(repr(value), 40)
        raise HellaSwagBadData(f"{where}: label {shown} is not one of 0, 1, 2, 3")
    return number


def _checked_record(rec, where, labelled):
    """``rec`` with an int label, or HellaSwagBadData naming ``where``."""
    if not isinstance(rec, dict):
        raise HellaSwagBadData(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in ("ctx", "endings") + (("label",) if labelled else ()) if k not in rec]
    if missing:
        raise HellaSwagBadData(f"{where}: missing field {', '.join(repr(k) for k in missing)}")
    if not isinstance(rec["ctx"], str) or not rec["ctx"].strip():
        raise HellaSwagBadData(f"{where}: 'ctx' must be a non-empty string")
    endings = rec["endings"]
    strings = isinstance(endings, list) and all(isinstance(e, str) for e in endings)
    if not strings or len(endings) != NUM_ENDINGS:
        got = f"{len(endings)} items" if isinstance(endings, list) else type(endings).__name__
        raise HellaSwagBadData(f"{where}: 'endings' must be a list of exactly {NUM_ENDINGS} "
                               f"strings, got {got}")
    if "label" in rec:
        if not labelled and rec["label"] in ("", None):  # HF's unlabelled test split
            rec = {k: v for k, v in rec.items() if k != "label"}
        else:
            rec["label"] = _label(rec["label"], where)
    return rec


def iterate_examples(split, data_dir=None):
    """Yield the records of ``hellaswag_{split}.jsonl`` (downloading it if needed), each checked: a
    bad JSON line, a missing field, not exactly four endings or a label outside 0-3 raises
    HellaSwagBadData naming the file and line; "3" (HF's labels) is 3."""
    path = download(split, data_dir)
    n = 0
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise HellaSwagBadData(f"{path}:{lineno}: not valid JSON ({e.msg} at column "
                                       f"{e.colno})") from None
            yield _checked_record(rec, f"{path}:{lineno}", labelled=split != "test")
            n += 1
    if n == 0:
        raise HellaSwagBadData(f"{path}: the file is empty (no HellaSwag examples)")


# ---------------------------------------------------------------------------
# rendering

def get_encoding():
    """The GPT-2 BPE: fineweb.get_encoding(), built once from gpt2_bpe/ (no network, no cache)."""
    return fineweb.get_encoding()


def _render_lists(example, enc):
    """(context token list, list of 4 ending token lists, label or None)."""
    ctx_tokens = enc.encode(example["ctx"])
    ending_tokens = [enc.encode(" " + e) for e in example["endings"]]
    label = example.get("label")
    return ctx_tokens, ending_tokens, (None if label is None else int(label))


def render_example(example, enc=None):
    """One example as ``(data, tokens, mask, label)``: ``tokens`` ``(4, N)`` long, row ``i`` the
    context's tokens then those of ``" " + endings[i]``, right-padded with 0; ``mask`` 1 exactly on
    the ending tokens; ``label`` the correct index (None for the unlabelled test split)."""
    import torch

    enc = enc or get_encoding()
    ctx_tokens, ending_tokens, label = _render_lists(example, enc)
    rows = [ctx_tokens + end for end in ending_tokens]
    n = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), n), dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (row, end) in enumerate(zip(rows, ending_tokens)):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, len(ctx_tokens): len(row)] = 1
    data = {"label": label, "ctx_tokens": ctx_tokens, "ending_tokens": ending_tokens}
    return data, tokens, mask, label


# ---------------------------------------------------------------------------
# scoring: scorer.py's, on each example's four rows

def _fit(rendered, max_len):
    """Drop the oldest context tokens of an example whose rows exceed the model's context (never
    happens for GPT-2's 1024 positions; guards small models)."""
    ctx, ends, label = rendered
    longest = max(len(e) for e in ends)
    if len(ctx) + longest <= max_len:
        return rendered
    keep = max(max_len - longest, 1)
    if longest + keep > max_len:
        raise UsageError(f"a HellaSwag ending of {longest} tokens does not fit the model's "
                         f"{max_len} positions")
    return ctx[-keep:], ends, label


def _group(rendered):
    """An example's rows for the scorer: the context, then each ending, which is scored."""
    ctx, ends, _ = rendered
    return [Row(ctx + end, len(ctx), len(ctx) + len(end)) for end in ends]


def score_examples(model, examples, device, *, batch_tokens=8192, autocast_dtype=None,
                   device_type=None, progress=False, enc=None, rendered=None, proc=None):
    """A dict per example (in input order): ``pred`` (lowest summed loss), ``pred_norm`` (lowest
    mean), ``label``, ``sum_loss``, ``avg_loss`` (lists of 4 floats), scored by
    :func:`scorer.score_groups` (``batch_tokens=0``: one example per forward pass, every
    position's logits). ``rendered``: the examples as ``_render_lists`` gives them."""
    if rendered is None:
        enc = enc or get_encoding()
        rendered = [_render_lists(ex, enc) for ex in examples]
    max_len = max_positions(model)
    if max_len:
        rendered = [_fit(r, max_len) for r in rendered]
    scored = score_groups(model, [_group(r) for r in rendered], device,
                          batch_tokens=batch_tokens, autocast_dtype=autocast_dtype,
                          device_type=device_type, desc="hellaswag" if progress else None,
                          proc=proc)
    out = []
    for (_, _, label), rows in zip(rendered, scored):
        s = [r.sum_loss for r in rows]
        a = [r.mean_loss for r in rows]
        out.append({"pred": min(range(len(s)), key=s.__getitem__),
                    "pred_norm": min(range(len(a)), key=a.__getitem__),
                    "label": label, "sum_loss": s, "avg_loss": a})
    return out


_RENDER_CACHE = {}


def _rendered_subset(split, limit, rank, world_size, data_dir, enc=None):
    """Rendered token lists of this rank's examples, cached across calls (training evaluates the
    same examples every few hundred steps); keyed by the file's path, size and mtime, and the
    encoding's name (a tokenizer's fingerprint is in it: tokenizer.Tokenizer.name)."""
    enc = enc or get_encoding()
    path = download(split, data_dir)
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, limit, rank, world_size, enc.name)
    rendered = _RENDER_CACHE.get(key)
    if rendered is None:
        examples = _load_split_subset(split, limit, rank, world_size, data_dir)
        rendered = [_render_lists(ex, enc) for ex in examples]
        if any(label is None for _, _, label in rendered):
            raise ValueError(f"the HellaSwag {split} split has examples without a label")
        _RENDER_CACHE.clear()  # one entry is enough
        _RENDER_CACHE[key] = rendered
    return rendered


def _load_split_subset(split, limit, rank, world_size, data_dir):
    examples = []
    for i, ex in enumerate(iterate_examples(split, data_dir)):
        if limit is not None and i >= limit:
            break
        if i % world_size == rank:
            examples.append(ex)
    return examples


def evaluate(model, device, *, split="val", limit=None, batch_tokens=8192, proc=None,
             autocast_dtype=None, data_dir=None, progress=False, device_type=None, enc=None):
    """HellaSwag accuracy of ``model`` on ``split``: ``{"n", "correct", "correct_norm", "acc",
    "acc_norm"}``. Example ``i`` (after ``limit``) is scored on rank ``i % world_size``; with an
    initialized process group the counts are summed (all_reduce) so every rank returns the global
    figures, and all ranks run as many forward passes (tiny dummy ones), as FSDP needs. The model
    returns ``(logits, ...)`` (our GPT) or ``.logits`` (HF; see scorer.model_logits); its mode is
    restored afterwards; enc: its tokenizer's tiktoken Encoding (None: GPT-2's). Raises
    HellaSwagUnavailable (HellaSwagBadData for an invalid record)."""
    import torch

    if split == "test":
        raise ValueError("the HellaSwag test split has no public labels; use split='val'")
    rank, world_size = 0, 1
    if proc is not None:
        rank, world_size = proc.rank, max(int(proc.world_size), 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    rendered = _rendered_subset(split, limit, rank, world_size, data_dir, enc)
    dist = torch.distributed
    distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
    results = score_examples(model, None, device, batch_tokens=batch_tokens,
                             autocast_dtype=autocast_dtype, device_type=device_type,
                             progress=progress, rendered=rendered, proc=proc)
    n = len(results)
    correct = sum(int(r["pred"] == r["label"]) for r in results)
    correct_norm = sum(int(r["pred_norm"] == r["label"]) for r in results)
    if distributed:
        counts = torch.tensor([n, correct, correct_norm], dtype=torch.long, device=device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
        n, correct, correct_norm = (int(v) for v in counts.tolist())
    return {"n": n, "correct": correct, "correct_norm": correct_norm,
            "acc": correct / n if n else 0.0, "acc_norm": correct_norm / n if n else 0.0}


def summary(name, device, dtype, split, res, seconds):
    """The line both CLIs (this one and `train_gpt2.py eval`) print for an evaluation."""
    return (f"{name} on {device} ({dtype}), hellaswag {split}: {res['n']} examples, "
            f"acc {res['acc']:.4f} ({res['correct']}/{res['n']}), "
            f"acc_norm {res['acc_norm']:.4f} ({res['correct_norm']}/{res['n']}) [{seconds:.1f} s]")


# ---------------------------------------------------------------------------
# CLI: OpenAI's GPT-2 through transformers

CHECKPOINT_HINT = "our checkpoints: python train_gpt2.py eval --checkpoint log/model_19072.pt"


def build_parser():
    p = OneLineParser(description="HellaSwag evaluation of OpenAI's GPT-2 through transformers' "
                                  "GPT2LMHeadModel (completion style: acc = lowest summed loss, "
                                  "acc_norm = lowest mean loss of the ending tokens)",
                      epilog=f"To score {CHECKPOINT_HINT}.")
    p.add_argument("-m", "--model", required=True,
                   help=f"{', '.join(OPENAI_MODELS)} (openai-community/<name> on the hub), another "
                        "hub name, or a local save_pretrained directory")
    p.add_argument("-d", "--device", default="auto",
                   help="cuda, cuda:1, mps, cpu or auto (cuda > mps > cpu)")
    p.add_argument("--split", default="val", choices=["train", "val"],
                   help="split to evaluate (default val)")
    p.add_argument("--limit", type=POSITIVE_INT, default=None, help="only the first N examples")
    p.add_argument("--batch_tokens", type=NONNEG_INT, default=8192,
                   help="token budget of one forward pass (0 = one example per forward)")
    p.add_argument("--hellaswag_dir", default=None,
                   help="folder of hellaswag_*.jsonl (default $HELLASWAG_DIR or ./hellaswag next "
                        "to this script)")
    p.add_old_spelling("--data_dir", "--hellaswag_dir", dest="hellaswag_dir")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="autocast dtype; auto: bf16 on GPUs that have it, fp16 on older ones, "
                        "fp32 on the CPU")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--checkpoint" or a.startswith("--checkpoint=") for a in argv):
        print(f"error: --checkpoint moved out of hellaswag.py; to score {CHECKPOINT_HINT}",
              file=sys.stderr)
        return 1
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (1, already printed)
        return e.code if isinstance(e.code, int) else 1
    return run_cli(score, args)  # what a user can fix is one line; a bug keeps its traceback


def score(args):
    # fail early on missing or bad data, before importing torch or loading a model
    for _ in itertools.islice(iterate_examples(args.split, args.hellaswag_dir), args.limit):
        pass
    device = resolve_device(args.device)
    tune_for_device(device)
    _, dtype = autocast_for(args.dtype, device)  # a UsageError where the dtype is not honoured
    model = load_hf_model(args.model).to(device)
    t0 = time.perf_counter()
    res = evaluate(model, device, split=args.split, limit=args.limit,
                   batch_tokens=args.batch_tokens, data_dir=args.hellaswag_dir, progress=True,
                   autocast_dtype=torch_dtype(dtype))
    print(summary(args.model, device, dtype, args.split, res, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
