"""torch.compile's inductor backend on simulated CUDA: Triton kernels built for an H100 (sm_90) on a
machine without a GPU, and the kernels a compiled step launches, recorded.

    problem = inductor.unsupported()           # None, or why not (no Triton, another Triton)
    with simcuda.SimulatedCUDA(), inductor.for_h100(cache_dir):
        compiled = torch.compile(model)        # inductor: Triton kernels compiled to sm_90 cubins
        ...                                    # a first step compiles
        with inductor.KernelLog() as log:      # a second step: every kernel it launches
            ...
    log.kernels                                # [{"name", "kind", "read", "written", "flops", ...}]

What is faked: Triton's CUDA driver (no libcuda: the device is an H100 by its properties, ptxas
still builds every kernel, and a "launch" runs nothing, so output buffers keep their shapes
only), the C++ helpers a CPU-only torch lacks, and autotuning (no GPU to time configurations on:
the first one is taken). Nothing about the kernels' speed is measured; KernelLog records what each
kernel is given (buffers, shapes) so that an estimate can be made from it.

Written against torch 2.13 and the Triton its CUDA build pins (TRITON below); other versions are
refused by unsupported() (these are internals on both sides).
"""
import collections
import contextlib
import importlib.metadata
import os
import re

# torch 2.13.0's CUDA wheels require exactly this Triton (their requires_dist)
TRITON = "3.7.1"
INSTALL = f"pip install triton=={TRITON}"

# An H100 SXM as Triton's driver describes it (shared memory per block with opt-in, clocks in kHz)
H100_PROPS = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
              "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
              "mem_bus_width": 5120, "max_threads_per_sm": 2048}


def unsupported():
    """None, or why inductor cannot compile for the simulated H100 here (one line)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return f"Triton is not installed (`{INSTALL}`: the version torch 2.13's CUDA build pins)"
    if version != TRITON:
        return (f"the inductor harness is written against Triton {TRITON} (what torch 2.13 pins), "
                f"this is Triton {version} (`{INSTALL}`)")
    return None


class TooMuchSharedMemory(RuntimeError):
    """A kernel that an H100 could not load."""


def fake_driver():
    """Triton's CUDA driver for a machine with no GPU: targets sm_90, loads no module."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver, CudaLauncher

    class Utils:
        # CudaUtils is a C module built against libcuda: these are what Triton asks of it
        @staticmethod
        def get_device_properties(device):
            return dict(H100_PROPS)

        @staticmethod
        def load_binary(name, kernel, shared, device):
            # ptxas has built the cubin; "loading" it returns a handle that launches nothing
            if shared > H100_PROPS["max_shared_mem"]:
                raise TooMuchSharedMemory(f"{name}: {shared} bytes of shared memory, more than "
                                          f"an H100's {H100_PROPS['max_shared_mem']}")
            return 0, 0, 32, 0, 1024  # module, function, registers, spills, threads per block

        @staticmethod
        def unload_module(module):
            pass

        @staticmethod
        def build_signature_metadata(signature):
            return None  # what the launcher would pass to launch, which does nothing

        @staticmethod
        def launch(*args, **kwargs):
            pass  # nothing runs: fake output buffers keep their shapes only

    class Driver(CudaDriver):
        def __init__(self):
            self.utils = Utils()
            self.launcher_cls = CudaLauncher

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_capability(self, device=None):
            return (9, 0)

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    return Driver()


class Patches:
    """setattr with its undo on exit."""

    def __init__(self):
        self._undo = contextlib.ExitStack()

    def set(self, owner, name, value):
        had = hasattr(owner, name)
        old = getattr(owner, name, None)
        if isinstance(owner, type) and name in vars(owner):
            old = vars(owner)[name]  # a staticmethod stays one when put back
        self._undo.callback(lambda: setattr(owner, name, old) if had else delattr(owner, name))
        setattr(owner, name, value)

    def close(self):
        self._undo.close()


@contextlib.contextmanager
def for_h100(cache_dir):
    """Inductor and Triton set up to compile for one H100 with no GPU here, inside SimulatedCUDA:
    caches in cache_dir (not the user's), one compile thread (the checks' cores are shared)."""
    import torch
    import torch._dynamo.device_interface as device_interface
    import torch._inductor.config as config
    import triton.backends.nvidia.driver as nvidia
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.runtime.driver import driver

    patches = Patches()
    env = {"TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # constant folding would run the folded ops for real, on data fake tensors do not have
        patches.set(config, "joint_graph_constant_folding", False)
        # its launcher is a C++ class that only CUDA builds of torch have
        patches.set(config, "use_static_cuda_launcher", False)
        patches.set(config, "compile_threads", 1)
        # a fresh compile each time: a cached kernel would skip what is being looked at
        patches.set(config, "force_disable_caches", True)
        # inductor's own estimate of each kernel's memory traffic, in its metadata
        patches.set(config, "benchmark_kernel", True)
        # stand-ins for what Triton's libcuda-built C module would define
        patches.set(nvidia, "PyKernelArg",
                    lambda nested_tuple=None, type=None: (type, nested_tuple))
        patches.set(nvidia, "ARG_CONSTEXPR", 0)
        patches.set(nvidia, "ARG_KERNEL", 1)
        patches.set(nvidia, "ARG_TUPLE", 2)
        # C++ helpers the generated code imports: CUDA builds only, or they drop the fake tensor
        patches.set(torch._C, "_cuda_getCurrentRawStream", lambda index: 0)
        guards = torch._C._dynamo.guards
        patches.set(guards, "_reinterpret_tensor",
                    lambda t, size, stride, offset=0:
                    torch.as_strided(t, size, stride, t.storage_offset() + offset))
        patches.set(guards, "_empty_strided_cuda",
                    lambda size, stride, dtype:
                    torch.empty_strided(size, stride, dtype=dtype, device="cuda"))
        # no GPU to time the configurations on: the first is taken
        patches.set(CachingAutotuner, "benchmark_all_configs",
                    lambda self, *a, **k: {c: float(i) for i, c in enumerate(self.launchers)})
        # torch.cuda.device(i), which inductor enters around its work: one GPU, always current
        patches.set(torch.cuda, "_exchange_device", lambda device: 0)
        patches.set(torch.cuda, "_maybe_exchange_device", lambda device: 0)
        props = torch.cuda.get_device_properties(0)  # SimulatedCUDA's H100
        patches.set(torch.cuda, "_get_device_properties", lambda *a, **k: props)
        cuda = device_interface.CudaInterface
        patches.set(cuda, "exchange_device", staticmethod(lambda device: 0))
        patches.set(cuda, "maybe_exchange_device", staticmethod(lambda device: 0))
        patches.set(cuda, "current_device", staticmethod(lambda: 0))
        patches.set(cuda, "get_raw_stream", staticmethod(lambda index: 0))
        patches.set(cuda, "set_device", staticmethod(lambda device: None))
        patches.set(cuda, "synchronize", staticmethod(lambda *a: None))
        # driver.set_active, undone to whatever was active (None: chosen at first use)
        patches.set(driver, "_active", fake_driver())
        yield
    finally:
        patches.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# aten ops the compiled code calls that launch no kernel: allocations and views of buffers
NOT_KERNELS = {"empty", "empty_strided", "empty_like", "as_strided", "detach", "alias",
               "lift_fresh", "_local_scalar_dense", "new_empty", "new_empty_strided",
               "_unsafe_view"}

# a pointer argument's accesses in a Triton kernel's source: tl.load(in_ptr0 + (x0 + 64*tmp3), ...)
ACCESS = re.compile(r"tl\.(?:load|store|atomic_\w+)\((\w+) \+ \(([^)]*)\)")


def gathered_args(source):
    """The pointer arguments a Triton kernel only reaches through an index it loaded (inductor
    names loaded values tmpN): an embedding lookup, the loss's pick of the target logit, a
    scatter-add. Such a kernel touches at most one element per element of its iteration space,
    not the whole buffer."""
    indices = collections.defaultdict(list)
    for name, index in ACCESS.findall(source):
        indices[name].append(index)
    return {name for name, found in indices.items()
            if all(re.search(r"\btmp\d+\b", index) for index in found)}


def op_observer(record, in_compiled_code=False):
    """A dispatch mode (enter it as a context) that calls record(func, args, kwargs, out) after
    each op it runs. in_compiled_code: it is on while compiled code runs and off while
    torch.compile traces and compiles (a mode that is not would keep dynamo from running the
    compiled code at all); otherwise compiled code runs as one op it does not see inside."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls):
            return in_compiled_code

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            record(func, args, kwargs, out)
            return out

    return Mode()


def tensor_bytes(t):
    return t.numel() * t.element_size()


class KernelLog:
    """Every kernel the compiled code launches, in order: Triton kernels (their launches through
    inductor's CachingAutotuner) and extern calls (the aten ops the generated code calls: cuBLAS
    matmuls, flash attention, fallbacks).

    Each kernel: name, kind ("triton" / "extern"), read and written (bytes), flops (extern:
    torch's FLOP formulas from the shapes; Triton: 0), inductor_bytes (Triton: inductor's own
    estimate_kernel_num_bytes, which counts only the slices a kernel reads of a larger buffer),
    buffers ([role, shape, dtype] per tensor argument).

    Triton's read and written come from the launch's tensor arguments by inductor's names for
    them (in_ptr: read, out_ptr: written, in_out_ptr: both), each counted whole, once, except a
    buffer reached only through a loaded index (gathered_args), counted at most once per element
    of the kernel's iteration space: a buffer read twice (a two-pass reduction) counts once, and
    one read in part through plain indexing counts whole. Extern: inputs read once, outputs
    written once.
    """

    def __init__(self):
        self.kernels = []
        self._gathered = {}
        self._patches = Patches()
        self._mode = None

    def _triton(self, autotuner, args):
        names = autotuner.fn.arg_names
        if autotuner not in self._gathered:
            self._gathered[autotuner] = gathered_args(autotuner.fn.src)
        gathered = self._gathered[autotuner]
        # the iteration space: xnumel x r0_numel ... (the launch passes them)
        space = 1
        for name, value in zip(names, args):
            if name.endswith("numel") and isinstance(value, int):
                space *= value
        read = written = 0
        buffers = []
        for name, value in zip(names, args):
            if not hasattr(value, "numel"):
                continue
            role = "inout" if name.startswith("in_out_ptr") else \
                "out" if name.startswith("out_ptr") else "in"
            n = tensor_bytes(value)
            if name in gathered:
                n = min(n, space * value.element_size())
            read += n if role in ("in", "inout") else 0
            written += n if role in ("out", "inout") else 0
            buffers.append([role, list(value.shape), str(value.dtype).replace("torch.", "")])
        meta = autotuner.inductor_meta
        gb = meta.get("kernel_num_gb")
        self.kernels.append({
            "name": meta.get("kernel_name") or autotuner.fn.__name__, "kind": "triton",
            "read": read, "written": written, "flops": 0,
            "inductor_bytes": None if gb is None else gb * 1e9, "buffers": buffers})

    def _extern(self, func, args, kwargs, out):
        import torch
        from torch.utils._pytree import tree_leaves
        from torch.utils.flop_counter import flop_registry

        schema = func._schema
        given = list(zip(schema.arguments, args)) + \
            [(a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
        read = written = 0
        buffers = []
        for arg, value in given:
            writes = bool(arg.alias_info and arg.alias_info.is_write)
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    # an out= buffer is written, not read
                    written += tensor_bytes(t) if writes else 0
                    read += 0 if writes else tensor_bytes(t)
                    buffers.append(["out" if writes else "in", list(t.shape),
                                    str(t.dtype).replace("torch.", "")])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, value in zip(schema.returns, outs):
            if not ret.alias_info and isinstance(value, torch.Tensor):
                written += tensor_bytes(value)
                buffers.append(["out", list(value.shape),
                                str(value.dtype).replace("torch.", "")])
        packet = func._overloadpacket
        flops = 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        self.kernels.append({"name": str(packet).replace("aten.", ""), "kind": "extern",
                             "read": read, "written": written, "flops": flops,
                             "inductor_bytes": None, "buffers": buffers})

    def _op(self, func, args, kwargs, out):
        name = func._overloadpacket.__name__
        if func.namespace == "aten" and not func.is_view and name not in NOT_KERNELS:
            self._extern(func, args, kwargs, out)

    def __enter__(self):
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        run = CachingAutotuner.run
        log = self

        def logged_run(autotuner, *args, **kwargs):
            log._triton(autotuner, args)
            return run(autotuner, *args, **kwargs)

        self._patches.set(CachingAutotuner, "run", logged_run)
        self._mode = op_observer(self._op, in_compiled_code=True)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._patches.close()
        return False


def roofline_seconds(kernel, peak_flops, bytes_per_s):
    """A kernel's time on the roofline: at least its FLOPs at peak, at least its bytes at full
    bandwidth."""
    return max(kernel["flops"] / peak_flops, (kernel["read"] + kernel["written"]) / bytes_per_s)


def summarize(kernels, peak_flops, bytes_per_s):
    """Counts, bytes, FLOPs and roofline seconds, Triton and extern apart."""
    out = collections.defaultdict(float)
    for k in kernels:
        kind = k["kind"]
        out[f"{kind}_kernels"] += 1
        out[f"{kind}_bytes"] += k["read"] + k["written"]
        out[f"{kind}_flops"] += k["flops"]
        out[f"{kind}_seconds"] += roofline_seconds(k, peak_flops, bytes_per_s)
        if k["inductor_bytes"] is not None:
            out["triton_inductor_bytes"] += k["inductor_bytes"]
    return dict(out)
