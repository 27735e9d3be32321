"""The GPU estimate's child process: a GPT's training step on one simulated H100, eager (peak
tensor memory, FLOPs, per-op roofline) and compiled by inductor (every kernel one micro-step
launches). tools/gpu_estimate.py starts it and turns its results into the estimate.

    python tools/simcuda/estimate.py LIB eager:PRESET:B,B,...:T:ARCH [compiled:...]
    python tools/simcuda/estimate.py LIB core:PRESET:EXAMPLES_PER_TASK:ARCH

ARCH: a key of settings.ARCHITECTURES (gpt2 if left out). core: the memory of training's CORE
evaluation (the model, its gradients and AdamW state, and what scoring adds); LIB, for a command
line: python -c "from tools import simcuda; print(simcuda.build('/tmp/simcuda'))".

LIB is the preload library (harness.build), loaded before torch is imported: one process for the
whole run. It prints one line `RESULT {json}` per spec: {"spec", "ok", "result"} or, for one that
raised, {"spec", "ok": false, "error": traceback}.
"""
import collections
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

if __name__ == "__main__":
    # the project and tools/ to import from, not this folder
    sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    from tools import simcuda

    simcuda.preload(sys.argv[1])
else:
    from tools import simcuda

import torch  # noqa: E402

import common  # noqa: E402
import metrics  # noqa: E402
import settings  # noqa: E402
import train_gpt2 as tg  # noqa: E402
from tools.simcuda import inductor  # noqa: E402

PEAK_FLOPS = metrics.peak_flops(simcuda.H100)
BYTES_PER_S = simcuda.H100_BYTES_PER_S


class Roofline:
    """Per aten op: FLOPs (torch's FLOP formulas) and bytes read and written; the op's time on an
    H100 is at least max(FLOPs / peak, bytes / bandwidth). Summed over a step with no overlap and
    no fusion between ops: a lower bound for eager, which runs them one by one."""

    def __init__(self):
        self.ops = collections.defaultdict(lambda: [0, 0, 0.0, 0])  # flops, bytes, seconds, calls

    def __enter__(self):
        aten = torch.ops.aten
        # ops that move no data (_unsafe_view: a view the schema does not mark as one; a Linear
        # without bias ends with it on a 3-D input)
        self.metadata = {aten.detach, aten.alias, aten.lift_fresh, aten._local_scalar_dense,
                         aten.empty_like, aten.empty, aten.empty_strided, aten.new_empty,
                         aten.new_empty_strided, aten._unsafe_view}
        self._mode = inductor.op_observer(self.record)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def record(self, func, args, kwargs, out):
        from torch.utils._pytree import tree_leaves
        from torch.utils.flop_counter import flop_registry

        if func.is_view or func.namespace != "aten" or func._overloadpacket in self.metadata:
            return

        def nbytes(values):
            return sum(t.numel() * t.element_size() for t in tree_leaves(values)
                       if isinstance(t, torch.Tensor))

        schema = func._schema
        written = sum(nbytes(v) for a, v in zip(schema.arguments, args)
                      if a.alias_info and a.alias_info.is_write)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        written += sum(nbytes(v) for r, v in zip(schema.returns, outs) if not r.alias_info)
        moved = nbytes((args, kwargs)) + written
        packet = func._overloadpacket
        flops = 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        row = self.ops[str(packet)]
        row[0] += flops
        row[1] += moved
        row[2] += max(flops / PEAK_FLOPS, moved / BYTES_PER_S)
        row[3] += 1

    def by_op(self):
        return {name: {"flops": f, "bytes": b, "seconds": t, "calls": n}
                for name, (f, b, t, n) in self.ops.items()}


class LiveMemory:
    """Peak bytes of live CUDA tensor storage: the storages of `given` tensors (what exists before:
    parameters, optimizer state, the batch), and every storage an op makes while inside, each
    counted until it is freed (a weakref on the storage). A plain dispatch mode with no module
    hooks, so it also sees the storages compiled code allocates (inductor's buffers, its saved
    activations) without making dynamo trace the model again, as MemTracker's hooks do. Storages
    only: no allocator rounding, no CUDA context or workspaces."""

    def __init__(self, given=()):
        self.live = weakref.WeakKeyDictionary()  # storage -> bytes; a storage's hash is its id
        self.now = self.peak = 0
        for t in given:
            self.add(t)

    def add(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            return
        storage = t.untyped_storage()
        if storage in self.live:
            return
        nbytes = storage.nbytes()
        self.live[storage] = nbytes
        weakref.finalize(storage, self._freed, nbytes)
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def _freed(self, nbytes):
        self.now -= nbytes

    def _made(self, func, args, kwargs, out):
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            self.add(t)

    def __enter__(self):
        self._mode = inductor.op_observer(self._made, in_compiled_code=True)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def held(model, optimizer):
    """The tensors a training step starts with: parameters, their gradients, optimizer state."""
    from torch.utils._pytree import tree_leaves

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *grads, *tree_leaves(optimizer.state_dict()["state"])]


def eager_step(model, optimizer, autocast_ctx, B, T, vocab):
    """One steady-state training step of B x T tokens (AdamW state already there), as the
    project's step: forward under autocast, backward, clip to 1.0, fused AdamW; its peak tensor
    memory (MemTracker), FLOPs of forward + backward (FlopCounterMode) and roofline time
    (Roofline)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randint(0, vocab, (B, T), device="cuda")
    y = torch.randint(0, vocab, (B, T), device="cuda")
    # FlopCounterMode decomposes each op it has no formula for (keyed by overload) into ops that
    # Roofline and MemTracker would then see one by one: a fused RMSNorm, which a GPU runs as one
    # kernel (simcuda.fused_rms_norm_as_on_cuda), gets a formula (none of its FLOPs is a matmul's)
    whole = {torch.ops.aten._fused_rms_norm.default: lambda *args, **kwargs: 0}
    flops = FlopCounterMode(display=False, custom_mapping=whole)
    tracker, roofline = MemTracker(), Roofline()
    tracker.track_external(model, optimizer)
    live = LiveMemory([*held(model, optimizer), x, y])
    with tracker, roofline, live:
        settings.estimated_step(model, optimizer, x, y, autocast_ctx, counted=flops)
    peak = tracker.get_tracker_snapshot("peak")
    device = next(d for d in peak if str(d).startswith("cuda"))
    by_op = {str(k): v for k, v in flops.get_flop_counts()["Global"].items()}
    by_kind = {str(getattr(k, "value", k)): v for k, v in peak[device].items()}
    return {"peak_bytes": peak[device]["Total"], "live_peak_bytes": live.peak,
            "peak_by_kind": {k: v for k, v in by_kind.items() if k != "Total"},
            "flops": flops.get_total_flops(), "flops_by_op": by_op, "roofline": roofline.by_op()}


def compiled_step(model, optimizer, autocast_ctx, B, T, vocab):
    """The project's compiled training step (torch.compile of the model, inductor's default
    mode, static shapes) for B x T tokens: a first micro-step compiles the forward and backward
    graphs, then one micro-step logs every kernel they launch (inductor.KernelLog); clipping and
    the fused AdamW step, which the project runs outside the compiled model, go through Roofline
    op by op as in eager. Its peak tensor memory is LiveMemory's over that second step, as eager's
    is MemTracker's (on an eager step the two agree within 4 MiB at B 64)."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    x = torch.randint(0, vocab, (B, T), device="cuda")
    y = torch.randint(0, vocab, (B, T), device="cuda")

    def forward():
        with autocast_ctx:
            return compiled(x, y)[1]

    start = time.perf_counter()
    forward().backward()
    compile_seconds = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    live = LiveMemory([*held(model, optimizer), x, y])
    with live:
        with inductor.KernelLog() as fwd:
            loss = forward()
        with inductor.KernelLog() as bwd:
            loss.backward()
        roofline = Roofline()
        with roofline:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    return {"compile_seconds": compile_seconds, "forward": fwd.kernels, "backward": bwd.kernels,
            "optimizer": roofline.by_op(), "peak_bytes": live.peak}


def steps(step, preset, batch_sizes, T, arch, context=None):
    """step (eager_step or compiled_step) of preset with arch's parts at each micro-batch size on
    one simulated H100: GPT on cuda with its fused AdamW, the state already made (a steady-state
    step), the autocast the project picks on cuda, flash attention (strict: any other kernel is
    an error, as the estimate assumes flash) and a CUDA build's fused RMSNorm."""
    T = int(T)
    config = tg.GPTConfig(**settings.MODEL_PRESETS[preset], **settings.ARCHITECTURES[arch])
    rows = {}
    with simcuda.flash_attention_as_on_h100(strict=True), simcuda.fused_rms_norm_as_on_cuda(), \
            simcuda.SimulatedCUDA(), context or contextlib.nullcontext():
        model = tg.GPT(config).to("cuda")
        optimizer = model.configure_optimizers(0.1, 6e-4, "cuda", verbose=False)
        autocast_ctx, dtype = common.autocast_for("auto", "cuda")
        settings.with_optimizer_state(model, optimizer)
        n_params = model.get_num_params(non_embedding=True)
        for B in (int(b) for b in batch_sizes.split(",")):
            rows[B] = step(model, optimizer, autocast_ctx, B, T, config.real_vocab_size)
            rows[B]["tokens"] = B * T
            rows[B]["six_n"] = 6 * n_params * B * T
            rows[B]["formula"] = metrics.flops_per_token(config, n_params, T) * B * T
    return {"preset": preset, "arch": arch, "T": T, "dtype": dtype,
            "non_embedding_params": n_params, "peak_flops": PEAK_FLOPS,
            "bytes_per_s": BYTES_PER_S, "rows": rows}


def eager(preset="gpt2", batch_sizes="16,32,64", T="1024", arch="gpt2"):
    out = steps(eager_step, preset, batch_sizes, T, arch)
    matmul = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul")
    for r in out["rows"].values():
        r["matmul_flops"] = sum(v for k, v in r["flops_by_op"].items() if k in matmul)
    return out


def compiled(preset="gpt2", batch_sizes="16,32,64", T="1024", arch="gpt2"):
    problem = inductor.unsupported()
    if problem:
        raise RuntimeError(problem)
    with tempfile.TemporaryDirectory(prefix="simcuda-") as cache:
        return steps(compiled_step, preset, batch_sizes, T, arch, inductor.for_h100(cache))


def core(preset="gpt2-xl", per_task="12", arch="gpt2"):
    """Training's CORE evaluation on one simulated H100: the model of preset with its gradients
    and AdamW state (what a run holds when it evaluates, between two steps), scoring bench.py's
    synthetic stand-in for CORE's 22 tasks (per_task examples each) as core_score does (bf16
    autocast, batch_tokens 8192). Peak live tensor memory (LiveMemory) against what the run held
    before, and the largest ragged KV cache that a chunk of rows read (KVCache.continue_rows)."""
    import bench
    import core_eval

    config = tg.GPTConfig(**settings.MODEL_PRESETS[preset], **settings.ARCHITECTURES[arch])
    with tempfile.TemporaryDirectory() as tmp:
        bench.synthetic_core_bundle(tmp, int(per_task))
        tasks = core_eval.read_bundle(tmp)
    caches, continue_rows = [], tg.KVCache.continue_rows

    def recorded(cache, *args, **kwargs):
        out = continue_rows(cache, *args, **kwargs)
        caches.append({"bytes": out.k.nbytes + out.v.nbytes, "rows": out.k.shape[1],
                       "tokens": out.k.shape[1] * out.k.shape[3]})
        return out

    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA():
        model = tg.GPT(config).to("cuda")
        optimizer = model.configure_optimizers(0.1, 6e-4, "cuda", verbose=False)
        settings.with_optimizer_state(model, optimizer)  # the gradients stay, as between steps
        _, dtype = common.autocast_for("auto", "cuda")
        live = LiveMemory(held(model, optimizer))
        before = live.now
        tg.KVCache.continue_rows = recorded
        try:
            with live:
                core_eval.evaluate(model, "cuda", tasks, device_type="cuda",
                                   autocast_dtype=common.torch_dtype(dtype))
        finally:
            tg.KVCache.continue_rows = continue_rows
    largest = max(caches, key=lambda c: c["bytes"])
    return {"preset": preset, "arch": arch, "per_task": int(per_task), "dtype": dtype,
            "held_bytes": before, "peak_bytes": live.peak, "core_bytes": live.peak - before,
            "largest_ragged_cache": largest, "ragged_caches": len(caches)}


def run(spec):
    """One spec, as {"spec", "ok", "result" | "error"}."""
    name, *args = spec.split(":")
    try:
        result = {"eager": eager, "compiled": compiled, "core": core}[name](*args)
        return {"spec": spec, "ok": True, "result": result}
    except Exception:
        return {"spec": spec, "ok": False, "error": traceback.format_exc()}


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    for spec in sys.argv[2:]:
        print("RESULT " + json.dumps(run(spec)), flush=True)
