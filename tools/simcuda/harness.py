"""Simulated CUDA: the project's CUDA code paths run on a machine without a GPU.

torch's FakeTensorMode makes tensors that carry a shape, a dtype and a device but no data, so a
tensor can live on "cuda" without a GPU, and a CPU tensor mixed into a cuda computation fails as it
would on a GPU (FakeTensorDeviceMismatchError). What a CPU-only torch lacks for autograd on them
comes from a small C++ library (fake_cuda_preload.cpp, built here with g++), loaded before torch is
imported: every use runs in a process of its own (tests/simcuda/checks.py, estimate.py).

    lib = simcuda.build(tmp_dir)            # any process
    simcuda.preload(lib); import torch      # a new process, in this order
    with simcuda.SimulatedCUDA() as sim:    # torch.cuda.* answers as one idle H100; new tensors
        ...                                 # are fake
    sim.cuda_calls, sim.reads               # the CUDA-only calls the project made, its reads

Fake tensors hold no values: every value read back (.item(), .tolist(), int()) is 1, and a boolean
mask selects every element. Written against torch 2.13's internals: unsupported() refuses other
versions.
"""
import collections
import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fake_cuda_preload.cpp")
TORCH_SERIES = "2.13."
# frames in these files are the project's: their torch.cuda calls and read-backs are recorded
PROJECT_FILES = ("train_gpt2.py", "settings.py", "rundir.py", "metrics.py", "common.py",
                 "openai_gpt2.py", "hellaswag.py", "scorer.py", "core_eval.py", "fineweb.py",
                 "bench.py")
# what torch.cuda.get_device_name() says: an H100 SXM, the GPU the MFU column and the estimates
# assume (its peak FLOP/s: metrics.peak_flops), and its HBM3 bandwidth from NVIDIA's datasheet
H100 = "NVIDIA H100 80GB HBM3"
H100_BYTES_PER_S = 3.35e12


class SimCUDAError(Exception):
    """Simulated CUDA cannot be set up here (one line)."""


def unsupported():
    """None, or why simulated CUDA cannot run on this machine (one line)."""
    import torch

    if torch.cuda.is_available():
        return "a real GPU is here: tests/test_cuda.py checks CUDA on it"
    if torch.version.cuda or torch.version.hip:
        return "simulated CUDA is written for a CPU-only torch, this one is built for CUDA/ROCm"
    if not torch.__version__.startswith(TORCH_SERIES):
        return (f"simulated CUDA is written against torch {TORCH_SERIES}x internals, this is "
                f"torch {torch.__version__}")
    if shutil.which("g++") is None:
        return "simulated CUDA needs g++ to build its preload library and there is none here"
    return None


def build(out_dir):
    """Compile fake_cuda_preload.cpp against the installed torch (a few seconds); returns the
    library's path."""
    import torch

    root = os.path.dirname(torch.__file__)
    out = os.path.join(out_dir, "libsimcuda.so")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = ["g++", "-shared", "-fPIC", "-O1", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-I{root}/include", SOURCE, f"-L{root}/lib", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{root}/lib", "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        errors = ([line for line in r.stderr.splitlines() if "error" in line]
                  or r.stderr.splitlines() or ["no output"])
        raise SimCUDAError(f"g++ could not build {os.path.basename(SOURCE)}: {errors[0].strip()}")
    return out


def preload(lib):
    """Load the library built by build(); before torch is imported, or torch keeps its CPU-only
    hooks."""
    if "torch" in sys.modules:
        raise SimCUDAError("simcuda.preload() must run before torch is imported")
    handle = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    if handle.simcuda_loaded() != 1:
        raise SimCUDAError(f"{lib} is not the simulated-CUDA library")
    return handle


def project_caller(depth=2, nearest=False):
    """'file:function' of the project frame that called (depth frames up), or of the nearest one
    up the stack with nearest=True; None if it is not the project's."""
    f = sys._getframe(depth)
    while f is not None:
        name = os.path.basename(f.f_code.co_filename)
        if name in PROJECT_FILES:
            return f"{name}:{f.f_code.co_name}"
        if not nearest:
            return None
        f = f.f_back
    return None


def placeholder(dtype):
    """What a value read back from a fake tensor of this dtype is: one."""
    import torch

    return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1


def flash_eligible(q, attn_mask, enable_gqa):
    """Whether CUDA's SDPA dispatcher would give these inputs to the flash kernel (torch 2.13,
    sm90)."""
    import torch

    return (attn_mask is None and not enable_gqa and q.dtype in (torch.float16, torch.bfloat16)
            and q.size(-1) <= 256 and q.size(-1) % 8 == 0)


@contextlib.contextmanager
def flash_attention_as_on_h100(strict=False):
    """F.scaled_dot_product_attention as an H100 runs it: the flash kernel wherever it is eligible.

    A CPU-only build always decomposes SDPA into the math path (fp32 (B, H, T, T) scores, more
    ops): right devices and dtypes, wrong memory and FLOPs. Ineligible calls (a mask, fp32) keep
    that path, which gives devices and dtypes right; strict=True refuses them instead (a GPU would
    take a slower kernel, so an estimate that assumes flash would be wrong)."""
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    flash = torch.ops.aten._scaled_dot_product_flash_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if q.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            # CUDA's autocast casts SDPA's inputs to its dtype before the dispatcher picks a
            # kernel: fp32 queries and keys (from a norm autocast runs in fp32, QK-norm's) get
            # flash too. This patch runs above autocast and sees them uncast: it casts them
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
        if q.device.type == "cuda" and flash_eligible(q, attn_mask, enable_gqa):
            return flash(q, k, v, dropout_p, is_causal, scale=scale)[0]
        if q.device.type == "cuda" and strict:
            raise RuntimeError(f"attention not flash-eligible (dtype {q.dtype}, head size "
                               f"{q.size(-1)}, mask {attn_mask is not None}, gqa {enable_gqa}): "
                               f"a GPU would take a slower kernel")
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def fused_rms_norm_as_on_cuda():
    """RMSNorm dispatched as a CUDA build of torch does: aten._fused_rms_norm, one op forward and
    _fused_rms_norm_backward one op back (a CUDA kernel each).

    A CPU-only build has no CUDA kernel for it, so the dispatcher decomposes it on a cuda tensor
    too (pow, mean, rsqrt, mul; more ops in backward): right dtypes, but several passes over the
    activation where a GPU makes one, which an estimate would count. A stand-in CUDA kernel makes
    the dispatcher take the op's own autograd formula; fake tensors then answer the op (from its
    decomposition, out of sight of any dispatch mode above them), so the stand-in never runs."""
    import torch

    def never(*args, **kwargs):
        raise RuntimeError("_fused_rms_norm on real tensors: use fake ones (SimulatedCUDA)")

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm", never, "CUDA")
    try:
        yield
    finally:
        lib._destroy()


def h100_properties(name, total_memory):
    """What torch.cuda.get_device_properties() says on an H100 SXM."""
    return types.SimpleNamespace(
        name=name, total_memory=total_memory, major=9, minor=0, multi_processor_count=132,
        is_integrated=False, is_multi_gpu_board=False, gcnArchName="", warp_size=32,
        max_threads_per_multi_processor=2048, max_threads_per_block=1024,
        regs_per_multiprocessor=65536, shared_memory_per_block=49152,
        shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
        L2_cache_size=50 * 2**20, clock_rate=1980000, memory_clock_rate=2619000,
        memory_bus_width=5120, uuid="00000000-0000-0000-0000-000000000000", pci_bus_id=0,
        pci_device_id=0, pci_domain_id=0)


class SimulatedCUDA:
    """One idle H100 as torch.cuda describes it, and a FakeTensorMode in which new tensors are fake.

    Every public function of torch.cuda is wrapped: a call from a project file is counted in
    cuda_calls ({function: {"file:caller": n}}); the ones a CPU build cannot answer are answered
    here (patched lists them with the reason). Reads back from the device (.item(), int(),
    float(), .tolist(): a sync on a GPU each) are counted in reads, by the project function that
    made them.
    """

    def __init__(self, device_name=H100, total_memory=80 * 2**30, bf16=True):
        self.device_name, self.total_memory, self.bf16 = device_name, total_memory, bf16
        self.cuda_calls = collections.defaultdict(collections.Counter)
        self.reads = collections.Counter()  # "file:caller" -> reads back from the device there
        self.patched = []  # (what, why)
        self._undo = contextlib.ExitStack()
        self.mode = None

    def _set(self, owner, name, value, why=None):
        had = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
        old = vars(owner)[name] if isinstance(owner, type) and had else getattr(owner, name, None)
        self._undo.callback(lambda: setattr(owner, name, old) if had else delattr(owner, name))
        setattr(owner, name, value)
        if why:
            self.patched.append((f"{getattr(owner, '__name__', owner)}.{name}", why))

    def _answers(self):
        """torch.cuda functions a CPU build cannot answer: name -> (stand-in, why)."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        props = h100_properties(self.device_name, self.total_memory)

        def rng():  # a real tensor, as the CPU generator's state is
            with unset_fake_temporarily():
                return torch.zeros(16, dtype=torch.uint8)

        nothing = lambda *a, **k: None  # noqa: E731
        no_allocator = "no allocator here"
        return {
            "is_available": (lambda: True, "the project picks and checks its device with it"),
            "device_count": (lambda: 1, "one GPU"),
            "current_device": (lambda: 0, "autocast and torch internals ask which GPU is current"),
            "set_device": (nothing, "torchrun ranks pin their GPU"),
            "synchronize": (nothing, "nothing runs asynchronously here"),
            "get_device_name": (lambda *a, **k: self.device_name,
                                "settle looks up the GPU's peak FLOP/s"),
            "get_device_properties": (lambda *a, **k: props, "capability and memory queries"),
            "get_device_capability": (lambda *a, **k: (9, 0), "an H100 is sm_90"),
            "is_bf16_supported": (lambda *a, **k: self.bf16,
                                  "torch.autocast('cuda', bfloat16) asks it"),
            "max_memory_allocated": (lambda *a, **k: 0, f"{no_allocator} (tensor memory: "
                                                        f"MemTracker, estimates)"),
            "memory_allocated": (lambda *a, **k: 0, no_allocator),
            "reset_peak_memory_stats": (nothing, no_allocator),
            "empty_cache": (nothing, no_allocator),
            "get_rng_state_all": (lambda: [rng()], "checkpoints save the CUDA generator states"),
            "set_rng_state_all": (nothing, "resuming restores them"),
            "get_rng_state": (lambda *a, **k: rng(),
                              "torch._dynamo saves the CUDA RNG around tracing"),
            "set_rng_state": (nothing, "torch._dynamo restores it"),
            "_lazy_init": (nothing, "there is no CUDA runtime to initialise"),
        }

    def _wrap(self, name, fn):
        calls = self.cuda_calls[name]

        def wrapper(*args, **kwargs):
            where = project_caller()
            if where is not None:
                calls[where] += 1
            return fn(*args, **kwargs)

        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__wrapped__ = fn
        return wrapper

    def _read_back(self, fake_mode, func, arg):
        self.reads[project_caller(nearest=True) or "torch"] += 1
        return placeholder(arg.dtype)

    def _tolist(self, t):
        # one transfer, however many elements
        self.reads[project_caller(nearest=True) or "torch"] += 1

        def fill(shape):
            return [fill(shape[1:]) for _ in range(shape[0])] if shape else placeholder(t.dtype)

        return fill(list(t.shape))

    def __enter__(self):
        import torch
        import torch.cuda.amp.common
        import torch.utils
        from torch._subclasses import fake_impls
        from torch._subclasses.fake_tensor import (FakeTensor, FakeTensorMode,
                                                   unset_fake_temporarily)

        answers = self._answers()
        for name in dir(torch.cuda):
            fn = getattr(torch.cuda, name)
            if isinstance(fn, types.FunctionType) and (name in answers or not name.startswith("_")):
                stand_in, why = answers.get(name, (fn, None))
                self._set(torch.cuda, name, self._wrap(name, stand_in), why)
        self._set(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False,
                  "torch.autocast('cuda') turns itself off (with only a warning) when CUDA is "
                  "unavailable")
        self._set(FakeTensorMode, "avoid_device_init", property(lambda mode: True),
                  "FakeTensorMode would initialise CUDA now that is_available() says True")

        aten = torch.ops.aten
        impls = fake_impls.op_implementations_dict
        for op in (aten._local_scalar_dense.default, aten.item.default):
            self._set_item(impls, op, self._read_back)

        def nonzero(fake_mode, func, arg):
            # a mask selects every element: the largest shape it can give
            return arg.new_empty((arg.numel(), arg.dim()), dtype=torch.int64)

        self._set_item(impls, aten.nonzero.default, nonzero)
        self._set(FakeTensor, "tolist", lambda t: self._tolist(t),
                  "a tensor read back as a list: one read")
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        swap = torch.utils.swap_tensors

        def swap_tensors(t1, t2, mode=self.mode):
            # fake mode's tensor memo holds weak references, and swap_tensors refuses tensors that
            # have them
            mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
            return swap(t1, t2)

        self._set(torch.utils, "swap_tensors", swap_tensors, "Module.to('cuda') of fake parameters")
        deepcopy = torch.Tensor.__deepcopy__

        def tensor_deepcopy(t, memo):
            if isinstance(t, FakeTensor):
                return deepcopy(t, memo)
            # a real tensor's storage cannot be copied under fake mode
            with unset_fake_temporarily():
                return deepcopy(t, memo)

        self._set(torch.Tensor, "__deepcopy__", tensor_deepcopy,
                  "deep copies of real tensors (RNG states) under fake mode")
        self._undo.enter_context(self.mode)
        return self

    def _set_item(self, table, key, value):
        old = table[key]
        self._undo.callback(table.__setitem__, key, old)
        table[key] = value

    def __exit__(self, *exc):
        return self._undo.__exit__(*exc)

    def project_cuda_calls(self):
        """{torch.cuda function: {"file:caller": n}} for the calls made from project files."""
        return {name: dict(c) for name, c in self.cuda_calls.items() if c}


class Stream:
    """torch.cuda.Stream / Event stand-in: FSDP2 orders its all-gathers with streams and events."""

    def __init__(self, *args, **kwargs):
        import torch

        self.device = torch.device("cuda", 0)

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return Stream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, Stream)

    def __hash__(self):
        return 0


class FakeProcessGroup:
    """torchrun's environment for one rank of world_size, run alone: init_process_group gets
    torch's fake backend (collectives return at once, moving no data) whatever backend the project
    asks for, which goes to backends; DDP's constructor keyword arguments go to ddp. Use inside
    SimulatedCUDA. What is stubbed for FSDP2 and DDP, and why, is in patched."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size
        self.backends, self.ddp = [], []
        # called at each DDP bucket all-reduce; its results go to reduced
        self.on_reduce = lambda: None
        self.reduced = []
        self.patched = []
        self._undo = contextlib.ExitStack()

    def _set(self, owner, name, value, why):
        old = getattr(owner, name)
        self._undo.callback(setattr, owner, name, old)
        setattr(owner, name, value)
        self.patched.append((f"{getattr(owner, '__name__', owner)}.{name}", why))

    def __enter__(self):
        import torch
        import torch.distributed as dist
        import torch.distributed.device_mesh as device_mesh
        import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
        import torch.nn.parallel.distributed as ddp_module
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.testing._internal.distributed.fake_pg import FakeStore

        env = {"RANK": str(self.rank), "LOCAL_RANK": str(self.rank % 8),
               "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(min(self.world_size, 8)),
               "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
        for key, value in env.items():
            if key in os.environ:
                self._undo.callback(os.environ.__setitem__, key, os.environ[key])
            else:
                self._undo.callback(os.environ.pop, key, None)
            os.environ[key] = value

        init = dist.init_process_group

        def init_process_group(backend=None, *args, **kwargs):
            self.backends.append(backend)
            return init("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)

        self._set(dist, "init_process_group", init_process_group,
                  "one rank alone: torch's fake backend")
        self._set(dist, "new_group", lambda *args, **kwargs: None,
                  "the run's own groups (gloo votes on the CPU) are the fake world too: the fake "
                  "backend makes no second group")
        mesh = device_mesh.init_device_mesh

        def init_device_mesh(*args, **kwargs):
            with unset_fake_temporarily():  # the mesh keeps its ranks in real integer tensors
                return mesh(*args, **kwargs)

        outside = "FSDP2's device mesh, outside fake mode"
        self._set(device_mesh, "init_device_mesh", init_device_mesh, outside)
        self._set(fsdp_init, "init_device_mesh", init_device_mesh, outside)
        default = Stream()
        streams = (("Stream", Stream), ("Event", Stream),
                   ("current_stream", lambda *a, **k: default),
                   ("default_stream", lambda *a, **k: default),
                   ("stream", lambda s: contextlib.nullcontext()))
        for name, value in streams:
            self._set(torch.cuda, name, value, "FSDP2 orders its collectives on CUDA streams")
        self._set(torch.Tensor, "record_stream", lambda t, s: None,
                  "FSDP2 marks tensors used on another stream")
        # DDP's constructor checks and broadcasts parameter values, which fake tensors do not have
        self._set(ddp_module, "_verify_param_shape_across_processes", lambda *a, **k: None,
                  "DDP reads every parameter's data in C++ to compare shapes across ranks")
        self._set(ddp_module, "_sync_module_states", lambda *a, **k: None,
                  "DDP broadcasts rank 0's parameter values")
        self._set(dist.Reducer, "_rebuild_buckets", lambda reducer: False,
                  "DDP re-buckets its gradients by their order on the first step, reading "
                  "parameter data in C++")
        self._set(dist.Logger, "set_runtime_stats_and_log", lambda logger: None,
                  "DDP's logger times iterations with a CUDA timer that only a CUDA build "
                  "registers")
        ddp_init = ddp_module.DistributedDataParallel.__init__

        def hook(state, bucket):
            # the fake group's all-reduce yields no tensor; the Reducer needs one
            self.reduced.append(self.on_reduce())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        def init_ddp(module_self, module, *args, **kwargs):
            self.ddp.append({k: str(v) for k, v in kwargs.items()})
            ddp_init(module_self, module, *args, **kwargs)
            module_self.register_comm_hook(None, hook)

        self._set(ddp_module.DistributedDataParallel, "__init__", init_ddp,
                  "DDP's all-reduce as a comm hook that counts buckets and returns them unchanged")
        return self

    def __exit__(self, *exc):
        return self._undo.__exit__(*exc)
