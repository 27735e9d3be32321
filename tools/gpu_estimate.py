"""A GPT's training step on one simulated H100 (tools/simcuda/), estimated from the code, not
measured, for any preset and either architecture (settings.ARCHITECTURES): peak tensor memory,
FLOPs against the MFU formula, a roofline lower bound on the step time and the MFU ceiling it
allows, eager and (with Triton) compiled by inductor.
`python bench.py --suite gpu-estimate [--arch modern] [--compile]` runs it; docs/performance.md
gives the method and the figures. The simulation runs in a child process
(tools/simcuda/estimate.py): its library must be loaded before torch is imported."""
import json
import os
import subprocess
import sys
import tempfile

import common
from tools import simcuda
from tools.simcuda import inductor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tools", "simcuda", "estimate.py")
# the two attention calls one block's kernels lie between (one_block)
ATTENTION = {"forward": "_scaled_dot_product_flash_attention",
             "backward": "_scaled_dot_product_flash_attention_backward"}


class EstimateError(Exception):
    """The estimate could not be made (one line)."""


def unsupported(compiled=False):
    """None, or why the estimate (compiled: with inductor's kernels) cannot run here."""
    problem = simcuda.unsupported()
    if problem:
        return f"runs on simulated CUDA, and {problem}"
    problem = inductor.unsupported() if compiled else None
    if problem:
        return f"builds inductor's kernels, and {problem}"
    return None


def batch_sizes(text):
    """[16, 32, 64] for "16,32,64"; a UsageError naming the flag for anything else."""
    try:
        sizes = [int(b) for b in text.split(",")]
        if min(sizes) >= 1:
            return sizes
    except ValueError:
        pass
    raise common.UsageError(f"--estimate_batch_sizes {text!r}: expected positive integers, "
                            f"e.g. 16,32,64")


def run_child(lib, specs):
    """The child's results, by the name of each spec; EstimateError if one failed."""
    r = subprocess.run([sys.executable, CHILD, lib, *specs], capture_output=True, text=True,
                       cwd=REPO)
    found = {}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            entry = json.loads(line[len("RESULT "):])
            found[entry["spec"].split(":")[0]] = entry
    failed = [e for e in found.values() if not e["ok"]]
    if r.returncode != 0 or len(found) < len(specs) or failed:
        why = (failed[0]["error"] if failed else r.stderr).strip().splitlines() or ["no output"]
        raise EstimateError(f"the estimate failed: {why[-1]}")
    return {name: entry["result"] for name, entry in found.items()}


def estimate(preset, T, sizes, compiled=False, sim_lib=None, arch="gpt2"):
    """{"setting", "estimate": per B, "compiled": per B (with compiled)} for preset with arch's
    parts (a key of settings.ARCHITECTURES) at T tokens per sequence and each micro-batch size;
    sim_lib: a library harness.build() made (default: built here, a few seconds)."""
    import torch

    shape = f"{preset}:{','.join(map(str, sizes))}:{T}:{arch}"
    specs = [f"eager:{shape}"] + ([f"compiled:{shape}"] if compiled else [])
    with tempfile.TemporaryDirectory() as tmp:
        try:
            lib = sim_lib or simcuda.build(tmp)
        except simcuda.SimCUDAError as e:
            raise EstimateError(str(e)) from None
        found = run_child(lib, specs)
    est = found["eager"]
    setting = {"preset": preset, "arch": arch, "T": T, "dtype": est["dtype"], "compile": compiled,
               "gpu": simcuda.H100, "peak_flops": est["peak_flops"],
               "bytes_per_s": est["bytes_per_s"],
               "non_embedding_params": est["non_embedding_params"], "torch": torch.__version__}
    results = {"setting": setting, "estimate": eager_rows(est)}
    if compiled:
        setting["triton"] = inductor.TRITON
        results["compiled"] = compiled_rows(found["compiled"])
    return results


def memory_bound(flops, nbytes, est):
    return nbytes / est["bytes_per_s"] > flops / est["peak_flops"]


def eager_rows(est):
    """Per micro-batch size: the eager step's figures, from the child's per-op results."""
    rows = {}
    for B, r in est["rows"].items():
        roof = r["roofline"]
        seconds = sum(op["seconds"] for op in roof.values())
        bound = {name: op["seconds"] for name, op in roof.items()
                 if memory_bound(op["flops"], op["bytes"], est)}
        slowest = sorted(bound.items(), key=lambda kv: -kv[1])[:4]
        rows[int(B)] = {
            "tokens": r["tokens"], "peak_mem_gib": r["peak_bytes"] / 2**30,
            # the same peak counted as the compiled step's is (estimate.LiveMemory)
            "peak_mem_gib_live_storages": r["live_peak_bytes"] / 2**30,
            "peak_by_kind_gib": {k: v / 2**30 for k, v in r["peak_by_kind"].items() if v},
            "flops": r["flops"], "flops_over_formula": r["flops"] / r["formula"],
            "matmul_flops_over_6n": r["matmul_flops"] / r["six_n"],
            "roofline_ms": seconds * 1e3, "all_at_peak_ms": r["flops"] / est["peak_flops"] * 1e3,
            "memory_bound_ms": sum(bound.values()) * 1e3,
            "top_memory_bound_ms": {k: v * 1e3 for k, v in slowest},
            "mfu_ceiling": r["formula"] / (seconds * est["peak_flops"]),
            "tokens_per_sec_ceiling": r["tokens"] / seconds}
    return rows


def kernel_seconds(k, est):
    return inductor.roofline_seconds(k, est["peak_flops"], est["bytes_per_s"])


def listed(kernels, est):
    """Each kernel with its roofline time in ms."""
    return [{"name": k["name"], "kind": k["kind"], "read": k["read"], "written": k["written"],
             "flops": k["flops"], "ms": kernel_seconds(k, est) * 1e3} for k in kernels]


def one_block(kernels, attention):
    """The kernels from the first call of attention to the second: one block's worth (the rest of
    block 0, then block 1 up to its attention)."""
    at = [i for i, k in enumerate(kernels) if k["name"] == attention]
    return kernels[at[0]:at[1]] if len(at) > 1 else []


def compiled_rows(est):
    """Per micro-batch size: the compiled step's figures, from the kernels the child logged."""
    rows = {}
    for B, r in est["rows"].items():
        kernels = r["forward"] + r["backward"]
        sums = inductor.summarize(kernels, est["peak_flops"], est["bytes_per_s"])
        ms = {phase: sum(kernel_seconds(k, est) for k in r[phase]) * 1e3 for phase in ATTENTION}
        ms["optimizer"] = sum(op["seconds"] for op in r["optimizer"].values()) * 1e3
        seconds = sum(ms.values()) / 1e3
        bound = [k for k in kernels if memory_bound(k["flops"], k["read"] + k["written"], est)]
        flops = sums.get("triton_flops", 0) + sums.get("extern_flops", 0)
        row = {"tokens": r["tokens"], "peak_mem_gib": r["peak_bytes"] / 2**30,
               "roofline_ms": seconds * 1e3,
               **{f"{phase}_ms": v for phase, v in ms.items()},
               "memory_bound_ms": sum(kernel_seconds(k, est) for k in bound) * 1e3,
               "triton_gb_inductor_estimate": sums.get("triton_inductor_bytes", 0) / 1e9,
               "flops": flops, "flops_over_formula": flops / r["formula"],
               "mfu_ceiling": r["formula"] / (seconds * est["peak_flops"]),
               "tokens_per_sec_ceiling": r["tokens"] / seconds,
               "compile_seconds_here": r["compile_seconds"],
               "kernels": {phase: listed(r[phase], est) for phase in ATTENTION},
               "one_block": {phase: listed(one_block(r[phase], name), est)
                             for phase, name in ATTENTION.items()}}
        for kind in ("triton", "extern"):
            row[f"{kind}_launches"] = int(sums.get(f"{kind}_kernels", 0))
            row[f"{kind}_gb"] = sums.get(f"{kind}_bytes", 0) / 1e9
            row[f"{kind}_ms"] = sums.get(f"{kind}_seconds", 0) * 1e3
        rows[int(B)] = row
    return rows


def print_estimate(results):
    """The estimate as Markdown tables, eager then compiled."""
    s = results["setting"]
    print(f"GPU estimate (from the code, not measured): {s['preset']}, --arch {s['arch']} "
          f"({s['non_embedding_params']:,} non-embedding parameters), T={s['T']}, {s['dtype']} "
          f"autocast, eager, fused AdamW, one {s['gpu']} "
          f"({s['peak_flops'] / 1e12:.0f} TFLOP/s bf16 dense, {s['bytes_per_s'] / 1e12:.2f} TB/s); "
          f"torch {s['torch']}")
    if "command" in s:
        print(f"command: {s['command']}")
    print("| B | tokens/step | peak tensor memory | FLOPs fwd+bwd | / flops_per_token "
          "| matmuls / 6N | roofline step | of which memory-bound ops | MFU ceiling "
          "| tokens/s ceiling |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for B, r in sorted(results["estimate"].items()):
        print(f"| {B} | {r['tokens']:,} | {r['peak_mem_gib']:.1f} GiB | "
              f"{r['flops'] / 1e12:.2f} T | {r['flops_over_formula']:.3f} | "
              f"{r['matmul_flops_over_6n']:.4f} | {r['roofline_ms']:.1f} ms | "
              f"{r['memory_bound_ms']:.1f} ms | "
              f"{100 * r['mfu_ceiling']:.0f}% | {r['tokens_per_sec_ceiling']:,.0f} |")
    for B, r in sorted(results["estimate"].items()):
        kinds = ", ".join(f"{k.lower()} {v:.1f}" for k, v in r["peak_by_kind_gib"].items())
        ops = ", ".join(f"{k.replace('aten.', '')} {v:.1f}"
                        for k, v in r["top_memory_bound_ms"].items())
        print(f"B={B}: peak GiB by kind: {kinds}; slowest memory-bound ops (ms): {ops}")
    if "compiled" in results:
        print_compiled(results)
    print("method and what it leaves out: docs/performance.md")


def print_compiled(results):
    """The compiled step beside eager, and one block's kernels at the largest B."""
    s, eager, compiled = results["setting"], results["estimate"], results["compiled"]
    print(f"\ncompiled (torch.compile, inductor, Triton {s['triton']} kernels for sm_90): "
          f"one micro-step's kernels + clipping and fused AdamW")
    print("| B | peak tensor memory compiled | roofline step eager | compiled "
          "| compiled fwd / bwd / clip+AdamW "
          "| Triton kernels (GB moved; inductor's estimate) | extern calls (GB) "
          "| MFU ceiling eager | compiled | tokens/s ceiling compiled |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for B, c in sorted(compiled.items()):
        e = eager[B]
        print(f"| {B} | {c['peak_mem_gib']:.1f} GiB | {e['roofline_ms']:.1f} ms | "
              f"{c['roofline_ms']:.1f} ms | "
              f"{c['forward_ms']:.1f} / {c['backward_ms']:.1f} / {c['optimizer_ms']:.1f} ms | "
              f"{c['triton_launches']} ({c['triton_gb']:.1f}; "
              f"{c['triton_gb_inductor_estimate']:.1f}) | "
              f"{c['extern_launches']} ({c['extern_gb']:.1f}) | "
              f"{100 * e['mfu_ceiling']:.0f}% | {100 * c['mfu_ceiling']:.0f}% | "
              f"{c['tokens_per_sec_ceiling']:,.0f} |")
    B = max(compiled)
    block = compiled[B]["one_block"]
    print(f"\none block's kernels, B={B} (from one attention call to the next: the rest of a "
          f"block, then the next up to its attention; --json lists every kernel):")
    print("| pass | kernel | kind | read | written | GFLOP | roofline |")
    print("|---|---|---|---:|---:|---:|---:|")
    for phase in ATTENTION:
        for k in block[phase]:
            print(f"| {phase} | {k['name']} | {k['kind']} | {k['read'] / 2**20:,.1f} MiB | "
                  f"{k['written'] / 2**20:,.1f} MiB | {k['flops'] / 1e9:,.1f} | "
                  f"{k['ms'] * 1e3:,.0f} µs |")
        total = sum(k["ms"] for k in block[phase])
        print(f"| {phase} | **{len(block[phase])} kernels** | | | | | **{total * 1e3:,.0f} µs** |")
