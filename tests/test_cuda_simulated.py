"""The CUDA paths on every CI run, without a GPU: simulated CUDA (tools/simcuda/).

Tensors on "cuda" are torch FakeTensors: a shape, a dtype and a device, no data. So devices, dtypes
under bf16 autocast, fused AdamW, gradient accumulation and clipping, torch.compile's tracing, the
CLI's CUDA branch, checkpoints of a cuda model, HellaSwag and sampling on cuda, DDP and FSDP wiring
are checked here, and a CPU tensor mixed into a cuda computation fails as on a GPU. Nothing
numerical: every value read back is a placeholder (1), so losses, accuracies and samples mean
nothing; what only a GPU can show (numerics, kernel choice, speed, NCCL) stays with
tests/test_cuda.py.

Each check runs in a child process (tests/simcuda/checks.py), because the library that lets a
CPU-only torch run autograd on cuda FakeTensors (tools/simcuda/fake_cuda_preload.cpp, built here
with g++) must be loaded before torch is imported. The checks drive the project through main() and
its public units and watch it through torch only (global hooks, stand-ins for torch.cuda.*,
torch.save/load, torch.compile's backend, the process group), so they hold while train_gpt2.py's
insides change. Skipped, with the reason, on a real GPU, on a torch other than the one the harness
was written against (its internals), or without g++.
"""
import json
import os
import re
import sys

import pytest
import torch

import common
from helpers import REPO
from simcuda.children import ChildFailed, Children  # tests/simcuda: the checks' side
from simcuda.seeds import DEVICE_BUG, SEEDS, seeded_copies
from tools import simcuda  # the harness
from tools.simcuda import harness, inductor

pytestmark = pytest.mark.slow  # child processes that build the harness and run every check

# The architectures the training, inference and compile checks run: GPT-2's, and --arch modern's
# (AdamW's groups: the decayed matrices, the x0 scalars, and on the tiny preset the token embedding
# at its own --embed_lr; an untied lm_head); spec: what a check's name gets
# softcap: a forward with targets returns the loss only (logits None: the chunked head)
ARCHS = {"gpt2": dict(spec="", groups=2, tied=True, softcap=False),
         "modern": dict(spec=":--arch:modern", groups=3, tied=False, softcap=True)}


def with_targets(arch, dtype):
    """The logits' dtype a forward with targets reports: None for the soft-capped head."""
    return None if arch["softcap"] else dtype


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    reason = simcuda.unsupported()
    if reason:
        pytest.skip(reason)
    return simcuda.build(str(tmp_path_factory.mktemp("simcuda")))


@pytest.fixture(scope="module")
def children(lib, tmp_path_factory):
    """Every check of this file, in four processes started at once: the training-side checks and
    the seeded copies; compile, distributed and inference; bench.py's estimate of each
    architecture. Training, inference and compile for each architecture (ARCHS)."""
    seeds = {}
    for what, filename, find, change, check in SEEDS:
        seeds[what] = seeded_copies(tmp_path_factory.mktemp("seeds"), what, filename, find, change)
    seeded = [f"{check}@{folder}" for what, *_, check in SEEDS if isinstance(seeds[what], list)
              for folder, _, _ in seeds[what]]
    modern = ARCHS["modern"]["spec"]
    runs = Children(str(tmp_path_factory.mktemp("children")))
    runs.start_checks(lib, ["train", "inference", "fp16", *seeded, f"train{modern}",
                            f"fp16{modern}"])
    runs.start_checks(lib, ["compile", "distributed:fsdp", "distributed:ddp", "auto_batch",
                            f"compile{modern}", f"inference{modern}", "sft:h100", "sft:t4"])
    for arch in ("gpt2", "modern"):  # bench.py's estimate of each architecture
        runs.start([sys.executable, os.path.join(REPO, "bench.py"), "--suite", "gpu-estimate",
                    "--arch", arch, "--estimate_batch_sizes", "64", "--sim_lib", lib, "--json"],
                   [f"estimate:{arch}"])
    runs.seeds = seeds
    yield runs
    runs.stop()


def result(children, spec):
    try:
        return children.result(spec)
    except ChildFailed as e:
        pytest.fail(str(e))


def passed(children, spec):
    entry = result(children, spec)
    assert entry["ok"], f"{spec} failed:\n{entry['error'][-4000:]}"
    return entry["result"]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return ARCHS[request.param]


@pytest.fixture(scope="module")
def train(children, arch):
    return passed(children, "train" + arch["spec"])


@pytest.fixture(scope="module")
def inference(children, arch):
    return passed(children, "inference" + arch["spec"])


def step_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("step ")]


def run_config(stdout):
    """The run config block as {group title: its "name=value" words}, wrapped lines joined (the
    model's shape comes twice under "model": its flags, then the config built)."""
    groups, title = {}, None
    for line in stdout[stdout.index("run config:"):].splitlines()[1:]:
        if line.startswith("    ") and title is not None:
            groups[title] |= set(line.split())
        elif line.startswith("  ") and ": " in line:
            title, _, values = line.strip().partition(": ")
            groups[title] = groups.get(title, set()) | set(values.split())
        else:
            break
    return groups


def configured(stdout, setting):
    """Whether any group of the run config block shows setting ("name=value")."""
    return any(setting in words for words in run_config(stdout).values())


# ------------------------------------------------------------------------------ training on cuda

def test_training_step_is_bf16_with_fused_adamw_clipping_and_accumulation(train, arch):
    """--dtype auto on cuda: bf16 logits and fp32 loss in every training forward; two micro-steps
    (forward and backward each) per optimizer step, then clipping to --grad_clip, then fused
    AdamW, with fp32 gradients and fp32 AdamW state on cuda:0 and wte/lm_head one tensor (GPT-2;
    modern: two; its 1-D parameter, the x0 scalars, AdamW's second group; no logits from a
    forward with targets); from the first micro-step to the
    update, one read back to the host (a GPU sync): loss, gradient norm and the go-on flag
    together, which the divergence check needs before the update; and no other in a step without
    an evaluation around it (step 0 to step 1). For both architectures."""
    training = [f for f in train["forwards"] if f["training"] and f["grad"]]
    assert len(training) == 6, train["forwards"]
    for f in training:
        assert (f["idx"], f["logits"], f["loss"], f["autocast"]) == \
            ("cuda:0", with_targets(arch, "torch.bfloat16"), "torch.float32", True), f
    assert len(train["steps"]) == 3
    for i, s in enumerate(train["steps"]):
        assert (s["forwards"], s["backwards"], s["clipped"], s["max_norm"]) == (2, 2, True, 1.0), s
        assert s["reads"] == 1, s  # one read-back between the first forward and the update
        assert s["grads"] == s["params"] == ["torch.float32"] and s["missing_grads"] == 0, s
        assert s["grad_devices"] == s["param_devices"] == ["cuda:0"], s
        assert s["fused"] == [True] * arch["groups"] and s["tied"] == arch["tied"], s
        if i > 0:  # AdamW makes its state on its first step
            assert s["state"] == ["torch.float32"] and s["state_devices"] == ["cuda:0"], s
    assert train["steps"][0]["reads_since_last_update"] is None
    assert train["steps"][1]["reads_since_last_update"] == 0, train["steps"][1]
    assert all(c["norm_device"] == "cuda:0" for c in train["clips"])


def test_a_gpu_without_bf16_trains_in_fp16_with_the_loss_scaler(children, arch):
    """--dtype auto on a GPU without bf16 (a simulated T4): fp16 logits (also in val, HellaSwag
    and samples), fp32 loss; per step the scaler's calls in order: the scaled loss's backward per
    micro-step, unscale_ before clipping, then the scaler's step and update; its state in the
    checkpoint; --fsdp refuses fp16 in one line."""
    r = passed(children, "fp16" + arch["spec"])
    assert configured(r["stdout"], "precision=fp16"), r["stdout"]
    training = [f for f in r["forwards"] if f["training"] and f["grad"]]
    assert training and all((f["logits"], f["loss"]) ==
                            (with_targets(arch, "torch.float16"), "torch.float32")
                            for f in training), training
    evaluation = [f for f in r["forwards"] if not f["training"]]  # val, HellaSwag, samples
    assert len({tuple(f["shape"]) for f in evaluation}) >= 3, evaluation
    assert all(f["logits"] == with_targets(arch, "torch.float16") and f["autocast"]
               for f in evaluation if f["loss"] is not None), evaluation
    assert all(f["logits"] == "torch.float16" and f["autocast"]
               for f in evaluation if f["loss"] is None), evaluation
    per_step = " ".join(r["events"]).split(" update")
    assert per_step[-1] == "" and len(per_step) == 4, r["events"]  # three steps
    for events in per_step[:-1]:
        assert events.split() == ["scale", "backward"] * 2 + ["unscale_", "clip_grad_norm_",
                                                              "step"], r["events"]
    assert all("scaler" in c["keys"] for c in r["saved"]) and r["saved"], r["saved"]
    assert r["fsdp"] is not None and "--fsdp does not train in fp16" in r["fsdp"], r["fsdp"]


@pytest.mark.parametrize("gpu, dtype", [("h100", "torch.bfloat16"), ("t4", "torch.float16")])
def test_sft_fine_tunes_on_cuda_in_bf16_and_in_fp16(children, gpu, dtype):
    """The sft command on a simulated H100 (bf16) and T4 (fp16, with the loss scaler): every
    training forward on cuda:0 in autocast with its logits in the GPU's half type and the loss in
    fp32; two micro-steps a step; the val loss of the conversations; fp32 gradients."""
    r = passed(children, f"sft:{gpu}")
    precision = {"h100": "bf16", "t4": "fp16"}[gpu]
    assert configured(r["stdout"], f"precision={precision}"), r["stdout"]
    training = [f for f in r["forwards"] if f["training"] and f["grad"]]
    assert len(training) == 4, r["forwards"]
    for f in training:
        assert (f["idx"], f["logits"], f["loss"], f["autocast"]) == \
            ("cuda:0", dtype, "torch.float32", True), f
    assert [s["forwards"] for s in r["steps"]] == [2, 2], r["steps"]
    assert all(s["grads"] == ["torch.float32"] for s in r["steps"]), r["steps"]
    assert r["stdout"].count("validation loss:") == 3, r["stdout"]


def test_auto_micro_batch_grows_with_the_gpu_and_each_choice_fits(children):
    """-B auto at GPT-2's width, T=1024, bf16, 524,288-token steps on 16, 24, 40 and 80 GiB GPUs:
    the largest divisor of the step's 512 sequences whose estimated step fits in 80% of the GPU
    (the next larger one does not), so B grows with memory; a tiny run records its choice."""
    r = passed(children, "auto_batch")
    chosen = {int(gib): c for gib, c in r["chosen"].items()}
    sizes = [chosen[g]["B"] for g in (16, 24, 40, 80)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1], chosen
    for gib, c in chosen.items():
        assert c["estimate"] <= c["budget"] == 0.8 * gib * 2**30 < c["larger"], (gib, c)
        assert c["micro_batch_estimate_gib"] == round(c["estimate"] / 2**30, 2)
    assert configured(r["stdout"], "micro_batch_size=4"), r["stdout"]  # 128 tokens / T=32
    assert "-B auto: 4 (a step's estimated peak" in r["stdout"]


def test_plan_works_out_the_recipe_on_an_h100_and_writes_nothing(children):
    """`plan` with GPT-2 124M's recipe (one of its layers, to be quick) on a simulated H100: the
    size, tokens, batch, the same memory estimate -B auto uses, the time from the peak FLOP/s."""
    r = passed(children, "auto_batch")
    plan = r["plan"].split("\nplan: ", 1)[1]
    assert plan.startswith(f"{r['n_params']:,} parameters on 1 x cuda in bf16"), plan
    assert "19,073 steps x 524,288 = 9,999,745,024" in plan
    assert "-B 64 x -T 1024 x 1 process(es), 8 micro-step(s) a step" in plan
    assert f"estimated peak {r['peak_64'] / 2**30:.1f} GiB per process" in plan, plan
    assert "of 64.0 GiB usable" in plan
    assert re.search(r"time: \d+:\d\d:\d\d to \d+:\d\d:\d\d \(the steps and CORE at 50% to 30% "
                     r"MFU of 989 TFLOP/s\)", plan), plan  # CORE every 2000 steps, as nanochat
    assert not r["plan_wrote"]


def test_cli_on_cuda_prints_the_bf16_config_and_the_mfu_and_memory_columns(train):
    """The run config block: --device cuda in this invocation's flags, bf16 in what the run
    worked out, eager (--no-compile), the peak FLOP/s settled from the simulated GPU's name (an
    H100 SXM's); every step line has the MFU column (by that peak) and the memory column."""
    out = train["stdout"]
    config = run_config(out)
    assert "device=cuda" in config["this invocation"], config
    assert {"precision=bf16", "world_size=1"} <= config["this run"], config
    peaks = [w.partition("=")[2] for words in config.values() for w in words
             if w.startswith("peak_flops=")]
    assert [float(p) for p in peaks] == [989e12], config
    assert not configured(out, "compile=True"), config
    steps = step_lines(out)
    assert len(steps) == 3 and all("| mfu " in s and "| mem " in s for s in steps), steps


# the torch.cuda functions a single-process training run calls, and why: checking and picking the
# device, --dtype auto's choice of bf16 where the GPU has it, the step time (synchronize), the
# GPU's name (settle looks its peak FLOP/s up for the MFU column; the provenance names it), its
# memory (settle refuses a step that cannot fit it, before any work), the memory column, the CUDA
# generators in checkpoints. A new one is a new CUDA-only path: check it here, then add it.
EXPECTED_CUDA_CALLS = {"is_available", "device_count", "is_bf16_supported", "synchronize",
                       "get_device_name", "get_device_properties", "max_memory_allocated",
                       "get_rng_state_all", "set_rng_state_all"}


def test_cli_makes_only_the_expected_cuda_only_calls(train):
    # by function, not by file:line (the callers move with every refactor)
    called = set(train["cuda_calls"])
    assert called == EXPECTED_CUDA_CALLS, (
        f"unexpected: {sorted(called - EXPECTED_CUDA_CALLS)}, "
        f"missing: {sorted(EXPECTED_CUDA_CALLS - called)}", train["cuda_calls"])


def test_val_loss_checkpoint_and_resume_on_cuda(train, arch):
    """Val loss: eval-mode no-grad forwards on cuda under bf16 with an fp32 loss. The checkpoint of
    a cuda model holds fp32 CPU tensors (loads anywhere), wte's and lm_head's names; resuming
    puts the weights and AdamW state back on cuda:0 and trains on. Not simulated: the bytes
    written (fake tensors have no values: the file holds a token naming the object kept in
    memory) and a bit-exact continuation (no values to compare)."""
    out = train["stdout"]
    assert out.count("validation loss:") == 3
    evals = [f for f in train["forwards"] if not f["training"] and f["loss"] is not None]
    assert evals, train["forwards"]
    for f in evals:
        assert (f["idx"], f["grad"], f["logits"], f["loss"]) == \
            ("cuda:0", False, with_targets(arch, "torch.bfloat16"), "torch.float32"), f
    (saved,) = train["saved"]
    assert {"model", "optimizer", "step", "rng"} <= set(saved["keys"]) and saved["tied_keys"]
    assert saved["model_devices"] == saved["optimizer_devices"] == ["cpu"], saved
    assert saved["model_dtypes"] == saved["optimizer_dtypes"] == ["torch.float32"], saved
    resumed = train["resume"]
    assert "resumed from" in resumed["stdout"] and len(step_lines(resumed["stdout"])) == 1
    last = resumed["steps"][-1]
    assert last["forwards"] == 2 and last["param_devices"] == last["state_devices"] == ["cuda:0"]
    assert last["state"] == ["torch.float32"] and last["tied"] == arch["tied"], last


def test_samples_and_hellaswag_during_training_run_on_cuda(train):
    out = train["stdout"]
    assert out.count("HellaSwag accuracy:") == 3 and "rank 0 sample 1:" in out
    sampled = [f for f in train["forwards"] if f["loss"] is None]
    assert sampled and all(f["idx"] == "cuda:0" and f["logits"] == "torch.bfloat16"
                           for f in sampled)


# ------------------------------------------------------------- compile, inference, distributed

def test_compile_traces_for_cuda_in_one_graph_per_mode_without_recompiles(children, arch):
    """torch.compile as main() calls it, with fullgraph=True (a graph break fails) and the
    aot_eager backend (autograd's graphs traced, no kernels built: inductor needs Triton). Val
    evaluations and train steps alternate four and three times: exactly one graph for training
    and one for evaluation means no recompile."""
    r = passed(children, "compile" + arch["spec"])
    assert configured(r["stdout"], "compile=True"), run_config(r["stdout"])
    assert r["stdout"].count("validation loss:") == 4 and len(step_lines(r["stdout"])) == 3
    assert sorted(g["grad"] for g in r["graphs"]) == [False, True], r["graphs"]
    assert not r["graph_breaks"], r["graph_breaks"]


def test_generate_with_and_without_the_kv_cache_on_cuda(inference):
    for key in ("cache", "recompute"):
        g = inference[key]
        assert (g["shape"], g["device"], g["dtype"]) == ([2, 12], "cuda:0", "torch.int64"), g
        assert g["forwards"] and all(f["idx"] == "cuda:0" and f["logits"] == "torch.bfloat16"
                                     for f in g["forwards"])
    # with the cache: the prompt once, then one token per forward; without: the whole sequence
    # each time
    assert [f["shape"] for f in inference["cache"]["forwards"]] == \
        [[2, 8], [2, 1], [2, 1], [2, 1]]
    assert [f["shape"] for f in inference["recompute"]["forwards"]] == \
        [[2, 8], [2, 9], [2, 10], [2, 11]]
    # the second chunk attends to the cache through a mask (the cached path)
    chunks = inference["chunks"]
    assert chunks["cached"] == 8 and chunks["shapes"] == [[2, 5, 50304], [2, 3, 50304]]


def test_hellaswag_scoring_on_cuda_batched_and_one_example_per_forward(inference):
    batched, single = inference["hellaswag_512"], inference["hellaswag_0"]
    assert batched["n"] == single["n"] == 8
    assert len(single["forwards"]) == 8 and all(f["shape"][0] == 4 for f in single["forwards"])
    # batched: rows of several examples share a forward; every ending (8 x 4 rows) scored once
    # either way, and batched, each example's context (the prefix its endings share) once more in
    # a prefix pass, where one example a forward computes it with each ending
    assert max(f["shape"][0] for f in batched["forwards"]) > 4
    assert sum(f["shape"][0] for f in single["forwards"]) == 32
    assert sum(f["shape"][0] for f in batched["forwards"]) == 32 + 8
    for f in batched["forwards"] + single["forwards"]:
        assert (f["idx"], f["logits"], f["autocast"], f["grad"]) == \
            ("cuda:0", "torch.bfloat16", True, False), f
    # the losses come back to the host once per evaluation, not once (or four times) per forward
    # pass
    assert sum(batched["reads"].values()) == sum(single["reads"].values()) == 1, \
        (batched["reads"], single["reads"])


def test_fsdp_rank_0_of_8_runs_main_to_the_end(children):
    """--fsdp as rank 0 of 8 over torch's fake process group (collectives move no data):
    sharding, bf16 mixed precision, val, HellaSwag, samples and the final (gathered) checkpoint.
    Stubbed besides the group: CUDA streams and events (FSDP2 orders its collectives with them)
    and the device mesh is built outside fake mode (it keeps ranks in real tensors)."""
    r = passed(children, "distributed:fsdp")
    assert r["backends"] == ["nccl"] and not r["ddp"]
    assert len(step_lines(r["stdout"])) == 2 and "saved " in r["stdout"]
    assert configured(r["stdout"], "fsdp=True") and configured(r["stdout"], "world_size=8")
    for s in r["steps"]:
        assert (s["forwards"], s["clipped"], s["grads"], s["grad_devices"]) == \
            (2, True, ["torch.float32"], ["cuda:0"]), s
    assert set(r["cuda_calls"]) == EXPECTED_CUDA_CALLS - {"set_rng_state_all"} | {"set_device"}, \
        r["cuda_calls"]
    (saved,) = r["saved"]
    assert saved["model_devices"] == ["cpu"] and saved["model_dtypes"] == ["torch.float32"]


def test_ddp_rank_0_of_8_wraps_the_model_and_trains(children):
    """Plain torchrun (DDP) as rank 0 of 8: NCCL asked for, DDP on device_ids [0], gradients
    all-reduced on the last of the two micro-steps only. torch's DDP reads parameter data in C++
    in four places, which fake tensors do not have, so these are stubbed:
    _verify_param_shape_across_processes and _sync_module_states (construction),
    Reducer._rebuild_buckets (first forward), Logger.set_runtime_stats_and_log (a CUDA timer only
    CUDA builds register); the all-reduce itself is a comm hook that returns the bucket
    unchanged."""
    r = passed(children, "distributed:ddp")
    assert r["backends"] == ["nccl"] and r["ddp"] == [{"device_ids": "[0]"}]
    assert len(step_lines(r["stdout"])) == 2 and configured(r["stdout"], "world_size=8")
    assert not configured(r["stdout"], "fsdp=True")
    assert r["reduced_at_micro_step"] and set(r["reduced_at_micro_step"]) == {2}, \
        r["reduced_at_micro_step"]
    for s in r["steps"]:
        assert (s["forwards"], s["clipped"], s["grad_devices"]) == (2, True, ["cuda:0"]), s
    assert set(r["cuda_calls"]) == EXPECTED_CUDA_CALLS - {"set_rng_state_all"} | {"set_device"}, \
        r["cuda_calls"]


# ----------------------------------------------------------------------- estimates from the code

def estimate_of(children, arch):
    """bench.py's `--suite gpu-estimate --json` of GPT-2 124M with arch's parts, at B=64."""
    code, stdout, stderr = children.output(children.owner[f"estimate:{arch}"])
    assert code == 0, stderr[-3000:]
    out = json.loads(stdout)
    setting = out["setting"]
    assert (setting["preset"], setting["arch"], setting["T"], setting["dtype"]) == \
        ("gpt2", arch, 1024, "bf16"), setting
    return out


def test_gpu_estimate_of_gpt2_memory_and_flops(children):
    """`bench.py --suite gpu-estimate`: GPT-2 124M's eager bf16 step at T=1024 on a simulated
    H100. Peak tensor memory in the ranges a real H100 run of this configuration would have to
    land in; FLOPs counted op by op against 6N from the parameter count (every parameter in one
    matmul: forward, and twice in backward) and against flops_per_token (flash's backward
    recomputes Q·Kᵀ: a little more attention than 12·L·H·Q·T)."""
    est = estimate_of(children, "gpt2")["estimate"]
    assert 50 < est["64"]["peak_mem_gib"] < 68, est  # B's growth: the -B auto test above
    for B, row in est.items():
        assert abs(row["matmul_flops_over_6n"] - 1) < 0.002, (B, row)
        assert 1.00 <= row["flops_over_formula"] <= 1.03, (B, row)
        assert row["all_at_peak_ms"] < row["roofline_ms"] and 0 < row["mfu_ceiling"] < 1, (B, row)


def test_gpu_estimate_of_the_modern_architecture_against_gpt2(children):
    """`--arch modern`, GPT-2 124M's shape, B=64. Its non-embedding parameters counted by hand:
    no biases but the head's and no norm weights, the untied lm_head in, wte (a lookup) out;
    each but the head's bias and the scalars is a matmul's (6N of matmul FLOPs, GPT-2 has biases
    besides). The same matrices as GPT-2 (its own head where GPT-2's is wte) and the same
    attention: the same FLOPs. Parameters and AdamW's two states in fp32, wte's and the head's
    both. Peak memory below GPT-2's by more than the fp32
    (B, T, vocab) softmax GPT-2's cross-entropy keeps for its backward, less the head's parameter
    and AdamW state: the chunked soft-capped head keeps none. The eager step's roofline within
    1.2x GPT-2's (an estimate computed from the ops' bytes and FLOPs, not a timing)."""
    L, C, V = 12, 768, 50304  # GPT-2 124M, its vocabulary padded to a multiple of 64
    B, T = 64, 1024
    gpt2, modern = estimate_of(children, "gpt2"), estimate_of(children, "modern")
    head = V * C
    n = modern["setting"]["non_embedding_params"]
    # per block: qkv 3C², proj C², MLP 8C²; the head's bias; x0's scalar a block
    assert n == L * 12 * C**2 + head + V + L, n
    g, m = gpt2["estimate"][str(B)], modern["estimate"][str(B)]
    # the scalars and the bias: no matmul's
    assert abs(m["matmul_flops_over_6n"] * n / (n - L - V) - 1) < 1e-9, m
    assert m["flops"] == g["flops"] and 1.00 <= m["flops_over_formula"] <= 1.03, (m, g)
    matrices = n - L - V + head
    # AdamW's step counters: a scalar per tensor (4 matrices a block, wte, lm_head, its bias, the
    # x0 scalars), and the x0 scalars (48 bytes) and their two states: each in one 512-byte block
    # of the caching allocator; the bias (4V bytes, a multiple of 512) and its states
    steps = 512 * (4 * L + 4)
    assert (m["peak_by_kind_gib"]["Parameter"], m["peak_by_kind_gib"]["Optstate"]) == \
        ((4 * matrices + 4 * V + 512) * 2**-30,
         (8 * matrices + 8 * V + 2 * 512 + steps) * 2**-30), m  # GiB
    softmax = B * T * V * 4
    assert g["peak_mem_gib"] - m["peak_mem_gib"] > (softmax - 12 * head) * 2**-30, (m, g)
    assert m["roofline_ms"] <= 1.2 * g["roofline_ms"], (m, g)
    assert all(r["all_at_peak_ms"] < r["roofline_ms"] and 0 < r["mfu_ceiling"] < 1
               for r in (g, m)), (g, m)


def test_the_compiled_steps_memory_counter_agrees_with_memtracker_on_eager(children):
    """The compiled step's peak memory is counted by estimate.LiveMemory (a dispatch mode that
    follows each storage until it is freed; MemTracker's module hooks make dynamo trace the
    compiled model again). On the eager step both count: the same peak within 4 MiB (of about
    30 and 60 GiB) for each architecture. (MemTracker rounds each storage up to the caching
    allocator's 512-byte blocks, and its own bookkeeping may place the peak at another op.)"""
    for arch in ("gpt2", "modern"):
        row = estimate_of(children, arch)["estimate"]["64"]
        tracker, live = row["peak_mem_gib"] * 2**30, row["peak_mem_gib_live_storages"] * 2**30
        assert abs(tracker - live) < 4 * 2**20, (arch, tracker, live)


def test_gpu_estimate_refuses_bad_sizes_in_one_line(capsys):
    import bench

    assert bench.main(["--suite", "gpu-estimate", "--estimate_batch_sizes", "16,x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


def test_gpu_estimate_compile_without_triton_says_so_in_one_line(monkeypatch, capsys):
    import bench

    if simcuda.unsupported():
        pytest.skip(simcuda.unsupported())
    monkeypatch.setattr(inductor, "unsupported", lambda: "Triton is not installed (pip ...)")
    assert bench.main(["--suite", "gpu-estimate", "--compile"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --suite gpu-estimate --compile") and "Triton" in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------- inductor's kernels (needs Triton)

@pytest.fixture(scope="module")
def mlp_kernels(lib, tmp_path_factory):
    """The kernels of a one-block tiny GPT's training forward, eager and compiled by inductor
    for the simulated H100 (checks.check_mlp_kernels)."""
    reason = inductor.unsupported()
    if reason:
        # about a minute of compiling on 2 cores and a large install: not in CI's budget
        pytest.skip(f"{reason}; CI leaves it out. To run: {inductor.INSTALL}, then "
                    f"python -m pytest -q tests/test_cuda_simulated.py -k inductor")
    runs = Children(str(tmp_path_factory.mktemp("inductor")))
    runs.start_checks(lib, ["mlp_kernels"])
    try:
        yield passed(runs, "mlp_kernels")
    finally:
        runs.stop()


MATMULS = ("mm", "addmm")


def mlp_passes(kernels, numel):
    """c_fc's matmul (the first matmul that writes an MLP-sized activation) and the kernels
    between it and c_proj's matmul (the next matmul that reads one) that touch such an
    activation."""
    def activations(k, roles):
        return [b for b in k["buffers"] if b[0] in roles and prod(b[1]) == numel]

    fc = next(i for i, k in enumerate(kernels)
              if k["name"] in MATMULS and activations(k, ("out",)))
    proj = next(i for i in range(fc + 1, len(kernels))
                if kernels[i]["name"] in MATMULS and activations(kernels[i], ("in",)))
    passes = [{"name": k["name"], "kind": k["kind"], "buffers": k["buffers"],
               "reads": len(activations(k, ("in", "inout"))),
               "writes": len(activations(k, ("out", "inout")))}
              for k in kernels[fc + 1:proj] if activations(k, ("in", "out", "inout"))]
    return kernels[fc], passes


def prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_inductor_adds_c_fc_bias_and_gelu_in_one_pass_over_the_activation(mlp_kernels):
    """In the compiled training forward, c_fc's bias does not make a pass of its own over the
    (tokens, 4C) activation: it is in the matmul's epilogue (addmm) or loaded by the GELU kernel
    (mm, then bias + GELU in one Triton kernel); the GELU is one Triton kernel that reads the
    activation once and writes it once. Eager on CUDA runs the same matmul (addmm, bias in
    cuBLAS's epilogue) and then aten.gelu as an op of its own: the same passes over the
    activation, so compiling wins nothing here, and this test guards that inductor does not
    split them further."""
    numel = mlp_kernels["tokens"] * mlp_kernels["hidden"]
    fc, passes = mlp_passes(mlp_kernels["eager"], numel)
    assert fc["name"] == "addmm", fc
    assert [(p["name"], p["reads"], p["writes"]) for p in passes] == [("gelu", 1, 1)], passes

    fc, passes = mlp_passes(mlp_kernels["compiled"], numel)
    assert len(passes) == 1, passes  # no bias pass before or after the GELU
    (gelu,) = passes
    assert gelu["kind"] == "triton" and "gelu" in gelu["name"], gelu
    assert (gelu["reads"], gelu["writes"]) == (1, 1), gelu
    bias = ["in", [mlp_kernels["hidden"]]]
    if fc["name"] == "mm":  # the bias is added in the GELU kernel
        assert any(b[:2] == bias for b in gelu["buffers"]), gelu
    else:  # in the matmul's epilogue
        assert fc["name"] == "addmm" and any(b[:2] == bias for b in fc["buffers"]), fc


@pytest.fixture(scope="module")
def compiled_estimates(lib, tmp_path_factory):
    """bench.py's `--suite gpu-estimate --compile --json` of GPT-2 124M at B=64, each
    architecture, two processes at once (each compiles its step for about a minute on 2 cores)."""
    reason = inductor.unsupported()
    if reason:
        pytest.skip(f"{reason}; CI leaves it out. To run: {inductor.INSTALL}, then "
                    f"python -m pytest -q tests/test_cuda_simulated.py -k inductor")
    # a hang's limit: the two compiles take about 4 minutes here, side by side
    runs = Children(str(tmp_path_factory.mktemp("compiled")), timeout=3600)
    for arch in ("gpt2", "modern"):
        runs.start([sys.executable, os.path.join(REPO, "bench.py"), "--suite", "gpu-estimate",
                    "--arch", arch, "--estimate_batch_sizes", "64", "--compile",
                    "--sim_lib", lib, "--json"], [arch])
    try:
        out = {}
        for arch in ("gpt2", "modern"):
            code, stdout, stderr = runs.output(runs.owner[arch])
            assert code == 0, stderr[-3000:]
            out[arch] = json.loads(stdout)
        yield out
    finally:
        runs.stop()


def test_inductor_compiled_modern_step_within_gpt2s_memory_and_time(compiled_estimates):
    """Compiled by inductor for the simulated H100, at B=64: the modern model's step holds at
    most GPT-2's peak tensor memory, and its roofline is within 1.05x GPT-2's. The peak counts
    what the compiled code allocates: above the parameters, AdamW's state and the gradients by
    at least one bf16 (B, T, C) activation a layer kept for the backward."""
    B, T, C, L = 64, 1024, 768, 12
    rows = {}
    for arch, out in compiled_estimates.items():
        eager, compiled = out["estimate"]["64"], out["compiled"]["64"]
        kinds = eager["peak_by_kind_gib"]
        held = kinds["Parameter"] + kinds["Optstate"] + kinds.get("Gradient", kinds["Parameter"])
        assert compiled["peak_mem_gib"] > held + L * B * T * C * 2 * 2**-30, (arch, compiled)
        rows[arch] = compiled
    g, m = rows["gpt2"], rows["modern"]
    assert m["peak_mem_gib"] <= g["peak_mem_gib"], (m["peak_mem_gib"], g["peak_mem_gib"])
    assert m["roofline_ms"] <= 1.05 * g["roofline_ms"], (m["roofline_ms"], g["roofline_ms"])


# ---------------------------------------------------------------------------- negative controls

@pytest.mark.parametrize("what, check", [(s[0], s[4]) for s in SEEDS], ids=[s[0] for s in SEEDS])
def test_a_seeded_device_bug_fails_the_suite(children, what, check):
    """A tensor left on the CPU (a device= dropped, a .to(device) dropped) at each of these places
    makes the check that covers it fail with the device mismatch a GPU would raise. In a training
    run it is a bug, not a user's error: main() names the failed step on stderr, then raises it
    with its traceback."""
    copies = children.seeds[what]
    if isinstance(copies, str):  # a control that seeds nothing would pass unseen
        pytest.fail(copies)
    filename = next(s[1] for s in SEEDS if s[0] == what)
    for folder, line, function in copies:
        entry = result(children, f"{check}@{folder}")
        assert not entry["ok"], \
            f"{what} ({filename}:{line}, in {function}) seeded, and {check} still passed"
        assert DEVICE_BUG.search(entry["error"]), \
            f"{check} failed on {what}, not for the device:\n{entry['error'][-3000:]}"
        if check == "train":
            assert re.search(r"main\(\) raised \w+; its stderr:\nerror at step \d+",
                             entry["error"]), entry["error"][-3000:]
    if check == "train" and not any(function and "eval" not in function
                                    for _, _, function in copies):
        pytest.fail(f"seed '{what}': only {[f for _, _, f in copies]} matched, not the training "
                    f"step's own batch transfer (caught above); update transfer_lines")


# --------------------------------------------------------------------- what the simulation found

def test_an_autocast_torch_turns_off_is_refused_in_one_line():
    """torch.autocast('cuda', bfloat16) without CUDA (and an unsupported dtype anywhere) turns
    itself off with a warning only, and the run would be fp32 while bf16 was asked for."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: autocast on cuda is honoured")
    with pytest.raises(ValueError, match=r"^autocast to bfloat16 on cuda is not available here "
                                         r"\(CUDA is not available"):
        common.autocast("cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="float64 on cpu"):
        common.autocast("cpu", torch.float64)
    with pytest.raises(common.UsageError) as e:
        common.autocast_for("bf16", "cuda")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("--dtype bf16: autocast to bfloat16 on cuda")
    with common.autocast("cpu", torch.bfloat16):  # an honoured one still works
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_the_simulation_says_in_one_line_why_it_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(harness.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert simcuda.unsupported() is None
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    assert "g++" in simcuda.unsupported()
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    assert "torch 2.13.x" in simcuda.unsupported() and "2.14.0" in simcuda.unsupported()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "CPU-only" in simcuda.unsupported()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "real GPU" in simcuda.unsupported()
