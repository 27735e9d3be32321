"""The checks behind tests/test_cuda_simulated.py, on simulated CUDA (tools/simcuda/).

    python tests/simcuda/checks.py LIB CHECK[:ARG...][@DIR] ...

runs the checks one after the other in this process (the preload library LIB must be loaded before
torch is imported: one process for all of them) and prints one line `RESULT {json}` per check:
{"spec", "ok", "result"} or, for a check that raised, {"spec", "ok": false, "error": traceback}.
@DIR runs the check against the scorer.py / hellaswag.py / train_gpt2.py in DIR instead of the
project's: the negative controls run these same checks on copies of them with a device bug seeded
in.

Each check drives the project through its stable entry points (train_gpt2.main, GPT, generate,
hellaswag.evaluate, ...) and watches it from outside, through torch: global module and optimizer
hooks, and stand-ins for torch functions (torch.cuda.*, torch.save/load, torch.compile, the process
group).
"""
import collections
import contextlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
REPO = os.path.dirname(TESTS)

if __name__ == "__main__":
    # the project (tools/ with it) and tests/ (helpers) to import from, not this folder
    sys.path[:] = [REPO, TESTS] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    from tools import simcuda

    simcuda.preload(sys.argv[1])
    # never a download: the checks write their own HellaSwag file
    os.environ["HELLASWAG_OFFLINE"] = "1"
else:
    from tools import simcuda

import torch  # noqa: E402

import common  # noqa: E402
import hellaswag  # noqa: E402
import settings  # noqa: E402
import train_gpt2 as tg  # noqa: E402
from helpers import TINY, write_hellaswag, write_shards  # noqa: E402
from tools.simcuda import inductor  # noqa: E402


_SCRATCH = []  # one TemporaryDirectory for the process: removed when it exits


def scratch_dir():
    """A new temp dir, removed when the process exits."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="simcuda-"))
    return tempfile.mkdtemp(dir=_SCRATCH[0].name)


def scratch(batch=0):
    """A data root with tiny shards (each split at least one batch of `batch` tokens: the run
    checks) and a HellaSwag file (HELLASWAG_DIR), and a log dir, in a new temp dir."""
    root = scratch_dir()
    data = os.path.join(root, "data")
    write_shards(data, "val", [max(5000, batch + 1)], seed=1)
    write_shards(data, "train", [7000, 6000, max(6500, batch + 1)], seed=2)
    write_hellaswag(os.path.join(root, "hellaswag"), 8)
    os.environ["HELLASWAG_DIR"] = os.path.join(root, "hellaswag")
    return data, os.path.join(root, "log")


def tiny_args(data, log, *extra):
    """A tiny run on cuda: 2 micro-steps per step, val, samples, HellaSwag and a checkpoint along
    the way."""
    return ["--preset", "tiny", "--n_layer", "2", "--n_head", "2", "--n_embd", "64",
            "--block_size", "64", "--device", "cuda", "-B", "2", "-T", "32",
            "--total_batch_size", "128", "--max_steps", "3", "--warmup_steps", "1",
            "--eval_every", "2", "--val_tokens", "128", "--sample_every", "2",
            "--num_samples", "2", "--sample_tokens", "4", "--hellaswag_every", "2",
            "--hellaswag_limit", "4", "--save_every", "0", "--data_root", data, "--log_dir", log,
            *extra]


class MainFailed(Exception):
    """main() exited non-zero or raised; the message ends with what it wrote to stderr."""


def run_main(args):
    """train_gpt2.main(args): (stdout, stderr). MainFailed if it exits non-zero (a one-line
    error: what a user can fix) or raises (a bug, such as a device mismatch: once a step has
    started, main() first names the failed step and the checkpoint of the last finished one on
    stderr, then raises; its traceback stays as MainFailed's cause)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = tg.main(args)
    except Exception as e:
        raise MainFailed(f"main() raised {type(e).__name__}; its stderr:\n"
                         f"{err.getvalue()[-2000:]}") from e
    if code != 0:
        raise MainFailed(f"main() exited {code}; its stderr:\n{err.getvalue()[-2000:]}")
    return out.getvalue(), err.getvalue()


def names(values):
    return sorted({str(v) for v in values})


# ------------------------------------------------------------------- watching a run from outside

def fake_mode():
    """The FakeTensorMode torch is in now: the simulation's, or inside it another one of the
    run's own (settings.step_memory counts a step's memory on a model of its own that never
    trains: not the run's training, which the checks watch)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


class Watch:
    """What a run does on its device, seen through torch: global module and optimizer hooks, and
    wrappers around the torch functions that every way of clipping or of calling backward goes
    through.

    forwards: one entry per GPT forward (mode, device of the input, dtypes of logits and loss,
    autocast); steps: one entry per optimizer step (the training forwards and backwards since the
    previous step, the reads back from the device since the first of those forwards and between
    the previous update and that forward, clipping, gradient dtypes and devices, fused or not,
    optimizer state, weight tying). What happens in another fake mode than the one it was entered
    in (the run's memory estimate) is not the run's.
    """

    def __init__(self, reads=lambda: 0):
        self.forwards, self.steps, self.clips = [], [], []
        self.models = []
        # reads back from the device so far (SimulatedCUDA.reads)
        self.reads, self._reads_at = reads, 0
        self._update_at, self._gap = None, None  # reads at the last update; since it, at a forward
        self._since = collections.Counter()
        self._undo = contextlib.ExitStack()

    def __enter__(self):
        import torch.nn.utils.clip_grad as clip_grad
        from torch.nn.modules.module import register_module_forward_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._mode = fake_mode()
        self._undo.callback(register_module_forward_hook(self._forward).remove)
        self._undo.callback(register_optimizer_step_pre_hook(self._step).remove)
        clip, backward = clip_grad._clip_grads_with_norm_, torch.autograd.backward

        def clip_grads_with_norm_(parameters, max_norm, total_norm, *args, **kwargs):
            parameters = ([parameters] if isinstance(parameters, torch.Tensor)
                          else list(parameters))
            if fake_mode() is not self._mode:
                return clip(parameters, max_norm, total_norm, *args, **kwargs)
            self.clips.append({"max_norm": float(max_norm), "params": len(parameters),
                               "norm_device": str(total_norm.device),
                               "after_backwards": self._since["backward"]})
            return clip(parameters, max_norm, total_norm, *args, **kwargs)

        def autograd_backward(*args, **kwargs):
            self._since["backward"] += fake_mode() is self._mode
            return backward(*args, **kwargs)

        clip_grad._clip_grads_with_norm_ = clip_grads_with_norm_
        torch.autograd.backward = autograd_backward
        self._undo.callback(setattr, clip_grad, "_clip_grads_with_norm_", clip)
        self._undo.callback(setattr, torch.autograd, "backward", backward)
        return self

    def __exit__(self, *exc):
        return self._undo.__exit__(*exc)

    def micro_steps(self):
        """Training forwards since the last optimizer step."""
        return self._since["forward"]

    def _forward(self, module, args, out):
        if not isinstance(module, tg.GPT) or fake_mode() is not self._mode:
            return
        if all(m is not module for m in self.models):
            self.models.append(module)
        logits, loss = out
        self.forwards.append({"training": module.training, "grad": torch.is_grad_enabled(),
                              "idx": str(args[0].device), "shape": list(args[0].shape),
                              "logits": None if logits is None else str(logits.dtype),
                              "loss": None if loss is None else str(loss.dtype),
                              "autocast": torch.is_autocast_enabled("cuda")})
        if module.training and torch.is_grad_enabled():
            if not self._since["forward"]:
                self._reads_at = self.reads()
                if self._update_at is not None:
                    self._gap = self._reads_at - self._update_at
            self._since["forward"] += 1

    def _step(self, optimizer, args, kwargs):
        if fake_mode() is not self._mode:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim()]
        model = self.models[-1] if self.models else None
        tied = (model is not None and model.transformer.wte.weight is model.lm_head.weight
                and sum(p is model.lm_head.weight for p in params) == 1)
        grads = [p.grad for p in params if p.grad is not None]
        backwards = self._since["backward"]
        self.steps.append({
            "forwards": self._since["forward"], "backwards": backwards,
            "reads": self.reads() - self._reads_at if self._since["forward"] else None,
            "reads_since_last_update": self._gap,
            "clipped": bool(self.clips) and self.clips[-1]["after_backwards"] == backwards > 0,
            "max_norm": self.clips[-1]["max_norm"] if self.clips else None,
            "grads": names(g.dtype for g in grads), "grad_devices": names(g.device for g in grads),
            "missing_grads": sum(p.grad is None for p in params),
            "params": names(p.dtype for p in params),
            "param_devices": names(p.device for p in params),
            "fused": [g.get("fused") for g in optimizer.param_groups],
            "state": names(v.dtype for v in state), "state_devices": names(v.device for v in state),
            "tied": tied})
        self._since.clear()
        self._update_at, self._gap = self.reads(), None


class CheckpointsInMemory:
    """torch.save / torch.load for objects that hold fake tensors, which cannot be written: the
    object stays here and the file gets a line naming it, so the project's own file handling (temp
    file, rename, lock, finding the newest checkpoint) runs for real. What a checkpoint's bytes
    would be is not simulated."""

    def __init__(self):
        self.saved = {}
        self._undo = contextlib.ExitStack()

    def __enter__(self):
        save, load = torch.save, torch.load

        def fake_save(obj, f, *args, **kwargs):
            token = f"simcuda checkpoint {len(self.saved)}\n".encode()
            self.saved[token] = obj
            if isinstance(f, (str, os.PathLike)):
                with open(f, "wb") as fh:
                    fh.write(token)
            else:
                f.write(token)

        def fake_load(f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)):
                with open(f, "rb") as fh:
                    head = fh.read(64)
            else:
                pos = f.tell()
                head = f.read(64)
                f.seek(pos)
            if head in self.saved:
                return self.saved[head]
            return load(f, *args, **kwargs)

        torch.save, torch.load = fake_save, fake_load
        self._undo.callback(setattr, torch, "save", save)
        self._undo.callback(setattr, torch, "load", load)
        return self

    def __exit__(self, *exc):
        return self._undo.__exit__(*exc)

    def describe(self, obj):
        """Devices, dtypes and keys of the tensors a checkpoint holds."""
        tensors = {}

        def walk(prefix, v):
            if isinstance(v, torch.Tensor):
                tensors[prefix] = v
            elif isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), x)
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    walk(f"{prefix}.{i}", x)

        walk("", obj)
        model = {k: t for k, t in tensors.items() if k.startswith("model.")}
        optim = {k: t for k, t in tensors.items() if k.startswith("optimizer.")}
        return {"keys": sorted(obj), "model_devices": names(t.device for t in model.values()),
                "model_dtypes": names(t.dtype for t in model.values()),
                "optimizer_devices": names(t.device for t in optim.values()),
                "optimizer_dtypes": names(t.dtype for t in optim.values() if t.dim()),
                "tied_keys": ("model.transformer.wte.weight" in model
                              and "model.lm_head.weight" in model)}


@contextlib.contextmanager
def compile_for_cuda(graphs):
    """torch.compile as the project calls it, but fullgraph=True (a graph break is an error) and
    the aot_eager backend (autograd's joint graph traced, no Triton kernels built); graphs counts
    each graph compiled (a recompile is one more)."""
    original = torch.compile

    def backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        graphs.append({"nodes": len(gm.graph.nodes), "grad": torch.is_grad_enabled()})
        return aot_eager(gm, example_inputs)

    def compile_(model=None, **kwargs):
        kwargs.update(fullgraph=True, backend=backend)
        return original(model, **kwargs)

    torch.compile = compile_
    try:
        yield
    finally:
        torch.compile = original


# ------------------------------------------------------------------------------------- checks

def check_train(*flags):
    """main() on --device cuda (eager, --dtype auto): three steps of two micro-steps with val,
    samples, HellaSwag and the final checkpoint; then --resume latest for a fourth step. flags:
    more of main()'s (the spec's `train:--arch:modern`)."""
    data, log = scratch()
    args = tiny_args(data, log, "--no-compile", *flags)
    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA() as sim, \
            CheckpointsInMemory() as ckpts:
        reads = lambda: sum(sim.reads.values())  # noqa: E731
        with Watch(reads) as first:
            out, err = run_main(args)
        saved = [ckpts.describe(obj) for obj in ckpts.saved.values()]
        with Watch(reads) as resumed:  # the last --max_steps wins
            out2, err2 = run_main(args + ["--max_steps", "4", "--resume", "latest"])
    return {"stdout": out, "stderr": err, "forwards": first.forwards, "steps": first.steps,
            "clips": first.clips, "saved": saved, "cuda_calls": sim.project_cuda_calls(),
            "reads": dict(sim.reads),
            "resume": {"stdout": out2, "stderr": err2, "steps": resumed.steps}}


def check_fp16(*flags):
    """main() on a simulated GPU without bf16 (a T4), --dtype auto: fp16 autocast in training, val,
    HellaSwag and samples; the gradient scaler's calls in order each step (scale and backward per
    micro-step, unscale_, clip, step, update); --fsdp with fp16 refused in one line. flags: more
    of main()'s."""
    data, log = scratch()
    events, simulated = [], []  # the simulation's fake mode, once entered

    def recorded(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if fake_mode() is simulated[0]:  # not the run's memory estimate
                events.append(name)
            return original(*args, **kwargs)

        return original, wrapper

    patches = [(torch.amp.GradScaler, n) for n in ("scale", "unscale_", "step", "update")]
    patches += [(torch.nn.utils, "clip_grad_norm_"), (torch.autograd, "backward")]
    t4 = dict(device_name="Tesla T4", total_memory=15 * 2**30, bf16=False)
    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA(**t4), \
            CheckpointsInMemory() as ckpts, contextlib.ExitStack() as undo:
        simulated.append(fake_mode())
        for owner, name in patches:
            original, wrapper = recorded(owner, name)
            setattr(owner, name, wrapper)
            undo.callback(setattr, owner, name, original)
        with Watch() as watch:
            out, err = run_main(tiny_args(data, log, "--no-compile", *flags))
        saved = [ckpts.describe(obj) for obj in ckpts.saved.values()]
    with simcuda.SimulatedCUDA(**t4), simcuda.FakeProcessGroup(0, 8):
        try:
            run_main(tiny_args(data, log + "_fsdp", "--no-compile", "--fsdp",
                               "--total_batch_size", "1024", *flags))
            fsdp = None
        except MainFailed as e:
            fsdp = str(e)
    return {"stdout": out, "stderr": err, "events": events, "forwards": watch.forwards,
            "steps": watch.steps, "saved": saved, "fsdp": fsdp}


def check_sft(gpu="h100", *flags):
    """main()'s sft command on --device cuda (eager, --dtype auto): a base checkpoint fine-tuned
    two steps of two micro-steps on conversations, with its val loss; on an H100 in bf16, on a
    simulated T4 in fp16 with the loss scaler. flags: more of main()'s."""
    from dataclasses import asdict

    from helpers import write_jsonl

    root = scratch_dir()
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(**TINY))
    base = os.path.join(root, "base.pt")
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, base)
    talk = os.path.join(root, "talk.jsonl")
    write_jsonl(talk, [{"messages": [{"role": "user", "content": f"Say {i}."},
                                     {"role": "assistant", "content": f"{i}."}]}
                       for i in range(40)])
    args = ["sft", "--init_from", base, "--chat_data", talk, "--chat_dir",
            os.path.join(root, "chat"), "--log_dir", os.path.join(root, "log"), "--device",
            "cuda", "-B", "2", "-T", "32", "--total_batch_size", "128", "--max_steps", "2",
            "--eval_every", "1", "--val_tokens", "32", "--no-compile", *flags]
    gpus = {"h100": {}, "t4": dict(device_name="Tesla T4", total_memory=15 * 2**30, bf16=False)}
    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA(**gpus[gpu]), \
            CheckpointsInMemory():
        with Watch() as watch:
            out, err = run_main(args)
    return {"stdout": out, "stderr": err, "forwards": watch.forwards, "steps": watch.steps}


def check_auto_batch(n_layer="1"):
    """-B auto for GPT-2 124M's width at T=1024 with the 524,288-token batch, bf16 (n_layer of
    its 12 layers: fewer to be quick), on simulated GPUs of 16, 24, 40 and 80 GiB (the estimate of
    a B is shared by the four, and by `plan` for that model on the 80 GiB one: it does not depend
    on the GPU); a tiny run with -B auto on the 16 GiB one. Fake tensors never run out of memory:
    the real step that confirms a choice is left out of the first part (tested on the CPU)."""
    estimates = {}
    step_memory, confirm = settings.step_memory, settings.confirm_micro_batch

    def shared(*args):  # the same model, T and dtype on every GPU
        if "peak" not in estimates:
            estimates["peak"] = step_memory(*args)
        return estimates["peak"]

    config = tg.GPTConfig(**{**settings.MODEL_PRESETS["gpt2"], "n_layer": int(n_layer)})
    data, log = scratch(batch=524288)  # -B auto may take the whole step in one micro-batch
    flags = ["--device", "cuda", "--n_layer", n_layer, "--dtype", "bf16", "-T", "1024",
             "--total_batch_size", "524288", "--data_root", data, "--log_dir", log]
    chosen = {}
    settings.step_memory = shared
    settings.confirm_micro_batch = lambda model, candidates, B, *args: B
    try:
        for gib in (16, 24, 40, 80):
            with simcuda.flash_attention_as_on_h100(), \
                    simcuda.SimulatedCUDA(total_memory=gib * 2**30), \
                    contextlib.redirect_stdout(io.StringIO()):
                run, _, _ = tg.settle(flags + ["-B", "auto"])  # tg.auto_micro_batch, confirmed
            B, fit = run.micro_batch_size, run.micro_batch_fit
            assert (run.model.n_layer, run.model.n_embd, run.precision.name) == \
                (int(n_layer), config.n_embd, "bf16"), run
            larger = [d for d in settings.divisors(512) if d > B]
            chosen[gib] = {"B": B, "estimate": estimates["peak"](B),
                           "larger": estimates["peak"](larger[0]) if larger else None,
                           "budget": settings.USABLE_GPU_MEMORY * gib * 2**30, **fit}
        before = sorted(os.listdir(data))
        with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA():
            plan, _ = run_main(["plan", *flags])
        plan_wrote = os.path.exists(log) or sorted(os.listdir(data)) != before
    finally:
        settings.step_memory, settings.confirm_micro_batch = step_memory, confirm

    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA(total_memory=16 * 2**30), \
            CheckpointsInMemory():
        out, err = run_main(tiny_args(data, log, "--no-compile", "-B", "auto", "--max_steps", "1",
                                      "--eval_every", "0", "--sample_every", "0",
                                      "--hellaswag_every", "0"))
    n_params = tg.GPT(config).get_num_params()
    return {"chosen": chosen, "stdout": out, "stderr": err, "plan": plan,
            "plan_wrote": plan_wrote, "n_params": n_params, "peak_64": estimates["peak"](64)}


def check_compile(*flags):
    """main() with torch.compile on cuda (fullgraph, aot_eager): val evaluations and train steps
    alternate, eval -> train -> eval -> ... -> train -> final eval. flags: more of main()'s."""
    data, log = scratch()
    args = tiny_args(data, log, "--compile", "--eval_every", "1", "--hellaswag_every", "0",
                     "--sample_every", "0", *flags)
    graphs = []
    import torch._dynamo

    torch._dynamo.reset()
    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA(), CheckpointsInMemory(), \
            compile_for_cuda(graphs):
        out, err = run_main(args)
    from torch._dynamo.utils import counters

    return {"stdout": out, "stderr": err, "graphs": graphs,
            "graph_breaks": dict(counters["graph_break"]),
            "recompiles": dict(counters["recompiles"])}


def check_inference(*flags):
    """On cuda under bf16 autocast: generate() with and without the KV cache; a prefill in two
    chunks through the cache (the second chunk sees the cached keys through an attention mask);
    hellaswag.evaluate batched (several examples per forward) and one example per forward. flags:
    main()'s, of which the architecture's (--arch) counts."""
    scratch()
    out = {}
    arch = settings.ARCHITECTURES[settings.read_flags(list(flags))[0].arch]
    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA() as sim:
        config = tg.GPTConfig(**TINY, **arch)
        model = tg.GPT(config).to("cuda")
        ctx, out["dtype"] = common.autocast_for("auto", "cuda")
        prompt = torch.randint(0, config.real_vocab_size, (2, 8), device="cuda")
        for use_cache in (True, False):
            with Watch() as watch, ctx:
                gen = torch.Generator(device="cuda").manual_seed(0)
                ids = model.generate(prompt, 4, generator=gen, use_cache=use_cache)
            out["cache" if use_cache else "recompute"] = {
                "shape": list(ids.shape), "device": str(ids.device), "dtype": str(ids.dtype),
                "forwards": watch.forwards}
        cache = tg.KVCache(config, 2, 16, "cuda", torch.bfloat16)
        model.eval()
        with Watch() as watch, ctx, torch.no_grad():
            first, _ = model(prompt[:, :5], kv_cache=cache)
            second, _ = model(prompt[:, 5:], kv_cache=cache)
        out["chunks"] = {"shapes": [list(first.shape), list(second.shape)], "cached": cache.pos,
                         "forwards": watch.forwards}
        for batch_tokens in (512, 0):
            before = collections.Counter(sim.reads)
            with Watch() as watch:
                r = hellaswag.evaluate(model, "cuda", batch_tokens=batch_tokens,
                                       autocast_dtype=torch.bfloat16)
            out[f"hellaswag_{batch_tokens}"] = {"n": r["n"], "forwards": watch.forwards,
                                                "reads": dict(sim.reads - before)}
    return {**out, "reads": dict(sim.reads)}


def check_distributed(kind):
    """main() as rank 0 of 8 (torchrun's environment, a fake process group): --fsdp, or DDP by
    default."""
    data, log = scratch()
    args = tiny_args(data, log, "--no-compile", "--total_batch_size", "1024", "--max_steps", "2",
                     *(["--fsdp"] if kind == "fsdp" else []))
    with simcuda.flash_attention_as_on_h100(), simcuda.SimulatedCUDA() as sim, \
            CheckpointsInMemory() as ckpts, simcuda.FakeProcessGroup(0, 8) as pg, \
            Watch() as watch:
        # DDP should all-reduce on the last micro-step only
        pg.on_reduce = lambda: watch.micro_steps()
        out, err = run_main(args)
    return {"stdout": out, "stderr": err, "backends": pg.backends, "ddp": pg.ddp,
            "reduced_at_micro_step": pg.reduced, "steps": watch.steps,
            "saved": [ckpts.describe(o) for o in ckpts.saved.values()],
            "cuda_calls": sim.project_cuda_calls()}


# ------------------------------------------------------------- inductor's kernels (needs Triton)

def check_mlp_kernels():
    """The forward of a one-block tiny GPT on cuda under bf16 autocast, eager and compiled by
    inductor: every kernel each launches (inductor.KernelLog), and the MLP's shape."""
    problem = inductor.unsupported()
    if problem:
        raise RuntimeError(problem)
    config = tg.GPTConfig(**{**TINY, "n_layer": 1})
    B, T = 2, 24  # tokens x 4C must not be the size of a weight (C x 4C): 48 tokens, not 64
    out = {"tokens": B * T, "hidden": 4 * config.n_embd}
    with simcuda.flash_attention_as_on_h100(strict=True), simcuda.SimulatedCUDA(), \
            inductor.for_h100(scratch_dir()):
        model = tg.GPT(config).to("cuda")
        autocast_ctx, _ = common.autocast_for("auto", "cuda")
        x = torch.randint(0, config.real_vocab_size, (B, T), device="cuda")
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        with autocast_ctx:
            compiled(x, x)  # compiles the training forward (the backward compiles lazily)
        for name, fn in (("eager", model), ("compiled", compiled)):
            with inductor.KernelLog() as log, autocast_ctx:
                fn(x, x)
            out[name] = log.kernels
    return out


# the project's modules a seeded copy may replace, each after the ones it imports
SEEDABLE = ("scorer", "hellaswag", "train_gpt2")


@contextlib.contextmanager
def project_from(folder):
    """scorer, hellaswag and train_gpt2 as the checks see them, taken from folder where it has
    them; once one is, the ones after it are loaded again, so that they import the copy."""
    global tg, hellaswag
    before = {name: sys.modules[name] for name in SEEDABLE}
    seeded = False
    for name in SEEDABLE:
        path = os.path.join(folder, f"{name}.py")
        seeded = seeded or os.path.exists(path)
        if not seeded:
            continue
        if not os.path.exists(path):
            path = os.path.join(REPO, f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there; later ones import it
        spec.loader.exec_module(module)
    tg, hellaswag = sys.modules["train_gpt2"], sys.modules["hellaswag"]
    try:
        yield
    finally:
        sys.modules.update(before)
        tg, hellaswag = before["train_gpt2"], before["hellaswag"]


def run(spec):
    """One check, as {"spec", "ok", "result" | "error"}."""
    name, _, folder = spec.partition("@")
    check, *args = name.split(":")
    fn = globals().get(f"check_{check}")
    if fn is None:
        return {"spec": spec, "ok": False, "error": f"no check {check!r}"}
    try:
        with project_from(folder) if folder else contextlib.nullcontext():
            return {"spec": spec, "ok": True, "result": fn(*args)}
    except Exception:
        return {"spec": spec, "ok": False, "error": traceback.format_exc()}


def main(specs):
    warnings.filterwarnings("ignore")
    for spec in specs:
        print("RESULT " + json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main(sys.argv[2:])
