"""A run's settings: every training flag once (default, type, meaning), the presets, and how the
command line, a --preset and a resumed checkpoint become one frozen Run before any work: the flag
checks (one line each), what is derived (device, precision, micro-batch, accumulation, the end
step), the micro-batch that fits (-B auto, estimated on fake tensors), the printed run config, and
the plan command's report.

train_gpt2.py's settle() builds the Run with these parts; nothing changes it afterwards.
"""

import argparse
import contextlib
import functools
import glob
import math
import os
import time
from dataclasses import asdict, fields, make_dataclass

import torch

import core_eval
import fineweb
import openai_gpt2
import rundir
from common import (DTYPES, LEARNING_RATE, LEARNING_RATE_OR_OFF, NONNEG, POSITIVE, SEED,
                    OneLineParser, UsageError, add_flags, auto_or, bounded, count, device_type_of,
                    flag_dest, one_line, print0)
from metrics import flops_per_token, format_eta, peak_flops, profile_schedule

# ===== The flags, once ============================================================================
# Every training flag once: (flags, default, type, meaning), made argparse arguments by add_flags.
# A --preset, then a resumed checkpoint, change the defaults (read_flags); --help shows them.
FRACTION = bounded(float, 0, 1, high_open=True, what="in [0, 1)")
# the most that a flag can mean: beyond these a model cannot be built or a run never ends
LAYERS, WIDTH, CONTEXT, SEQUENCES = 1024, 65_536, 1_048_576, 65_536
STEPS, TOKENS, SAMPLES = 1_000_000_000, 2**50, 1024
# the most micro-steps a step takes before the run is refused as a likely typo: GPT-2's batch
# (2^19 tokens) in micro-steps of one sequence of 32 tokens; --max_micro_steps insists
MICRO_STEPS = 16_384
SHARED = [  # the flags that the sample and eval commands take too
    ("--init_from", None, {"metavar": "gpt2|...|gpt2-xl|DIR|PATH.pt"},
     "start from OpenAI's GPT-2 weights (or a transformers folder), or a model_*.pt of yours"),
    ("--device", "auto", str, "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps"),
    ("--dtype", "auto", list(DTYPES), "auto: bf16, or fp16 on GPUs without it, fp32 on a CPU"),
]
THIS_INVOCATION = "this invocation (never taken from a resumed checkpoint)"
RUN_SETTINGS = {
    "model": [
        ("--preset", "gpt2", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"],
         "a model shape with its run settings"),
        ("--n_layer", None, count(1, LAYERS), "transformer blocks"),
        ("--n_head", None, count(1, WIDTH), "attention heads"),
        ("--n_embd", None, count(1, WIDTH), "embedding width"),
        ("--block_size", None, count(1, CONTEXT), "context length"),
        ("--n_kv_head", None, count(1, WIDTH), "key/value heads (GQA; 1: MQA)"),
        ("--dropout", 0.0, FRACTION, "dropout in training"),
        ("--arch", "gpt2", ["gpt2", "modern"],
         "gpt2: GPT-2's; modern: every part below changed (docs/operations.md)"),
        ("--bias", None, bool, "biases in Linear and LayerNorm"),
        ("--pos_emb", None, ["learned", "rope"], "positions: a learned wpe, or rotary"),
        ("--norm", None, ["layernorm", "rmsnorm"], "the blocks' and final norm"),
        ("--embed_norm", None, bool, "normalize the token embedding"),
        ("--qk_norm", None, bool, "RMS-normalize each head's queries and keys"),
        ("--activation", None, ["gelu", "relu2"], "the MLP's activation (relu2: ReLU squared)"),
        ("--tie_embeddings", None, bool, "lm_head shares wte's weight"),
        ("--zero_init", None, bool, "the blocks' output projections start at 0"),
        ("--zero_head", None, bool, "an untied lm_head starts at 0"),
        ("--head_bias", None, bool, "a learned bias on each token's logit"),
        ("--logit_softcap", None, NONNEG, "logits to cap * tanh(logits / cap) (0: off)"),
        ("--value_embeds", None, bool, "every other block's values add a vector of each token"),
        ("--x0_skip", None, bool, "each block's input adds the embedding, by a learned scalar"),
        ("--unet_skip", None, bool, "the second half's blocks add the first half's outputs"),
    ],
    "optimisation": [
        ("--optimizer", "adamw", ["adamw", "muon"], "muon: Muon for the blocks' matrices"),
        ("--muon_lr", None, LEARNING_RATE, "Muon's peak LR (default: --max_lr)"),
        ("--muon_momentum", 0.95, FRACTION, "Muon's Nesterov momentum"),
        ("--muon_ns_steps", 5, bounded(int, 1, 99, what="in 1..99"), "Newton-Schulz steps"),
        ("--muon_adjust_lr", "match_rms_adamw", ["match_rms_adamw", "original"],
         "match_rms_adamw: Muon's LR on AdamW's scale; original: ~10-50x larger --muon_lr"),
        ("--max_lr", 6e-4, LEARNING_RATE, "peak learning rate"),
        ("--embed_lr", None, LEARNING_RATE_OR_OFF,
         "AdamW's peak LR for the token embedding wte, in a group of its own (0 or unset: none, "
         "wte in --max_lr's decayed group)"),
        ("--min_lr_ratio", 0.1, bounded(float, 0, 1, what="in [0, 1]"), "final LR / max_lr"),
        ("--warmup_steps", 715, count(0, STEPS), "linear warmup steps"),
        ("--wsd_decay", 0.0, bounded(float, 0, 1, what="in [0, 1]"),
         "0: cosine decay (GPT-2's); f: constant, then linear decay over the last f of the steps"),
        ("--max_steps", 19073, count(1, STEPS), "optimizer steps (19073 x 2^19 = 10B tokens)"),
        ("--weight_decay", 0.1, NONNEG, "AdamW's weight decay (matmuls, embeddings)"),
        ("--grad_clip", 1.0, NONNEG, "clip the gradient norm to this (0: off)"),
        ("--total_batch_size", 524288, count(1, TOKENS),
         "tokens per step, a multiple of B*T*ranks"),
        ("--batch_ramp_tokens", 0, count(0, TOKENS), "GPT-3's batch ramp over the first N tokens"),
        ("--batch_ramp_start", 32768, count(1, TOKENS), "first batch of the ramp, in tokens"),
        ("-B --micro_batch_size", 64, auto_or(count(1, SEQUENCES)),
         "sequences a forward pass, per process; auto: most that fit"),
        ("-T --sequence_length", 1024, count(1, CONTEXT), "tokens per sequence"),
        ("--max_micro_steps", MICRO_STEPS, count(1, STEPS),
         "refuse a step of more micro-steps (forward and backward passes) than this"),
    ],
    "evaluation, sampling, checkpoints (every 0: off)": [
        ("--eval_every", 250, count(0, STEPS), "val loss every N steps and at the end"),
        ("--val_tokens", 10_485_760, count(1, TOKENS), "val loss over the first N val tokens"),
        ("--val_steps", None, count(1, STEPS), "instead: N batches of B*T tokens per process"),
        ("--sample_every", 250, count(0, STEPS), "samples every N steps (not 0) and at the end"),
        ("--sample_prompt", "Hello, I'm a language model,", str, "prompt for the samples"),
        ("--num_samples", 4, count(1, SAMPLES), "samples per sampling block"),
        ("--sample_tokens", 32, count(1, CONTEXT), "new tokens per sample"),
        ("--hellaswag_every", 250, count(0, STEPS), "HellaSwag every N steps and at the end"),
        ("--hellaswag_limit", None, count(1, STEPS), "only the first N HellaSwag val examples"),
        ("--core_every", 2000, count(0, STEPS), "CORE's 22 tasks every N steps and at the end"),
        ("--core_max_per_task", 500, count(1, STEPS),
         "CORE in training: N examples of each task (nanochat's subsample)"),
        ("--chat_every", 0, count(0, STEPS),
         "sft: ARC and MMLU in the chat format (eval --tasks chat) every N steps and at the end"),
        ("--chat_max_per_task", 500, count(1, STEPS),
         "the chat tasks in training: the first N questions of each after nanochat's shuffle"),
        ("--save_every", 5000, count(0, STEPS), "checkpoint every N steps; the last is saved"),
    ],
    "data": [
        ("--seed", 1337, SEED, "seed for init, data order and sampling"),
        ("--data_root", fineweb.DEFAULT_DATA_ROOT, str, "shard folder; rank 0 prepares it"),
        ("--fineweb_name", "sample-10BT", list(fineweb.NAMES), "FineWeb-Edu sample to prepare"),
        ("--input", None, {"nargs": "+", "metavar": "PATH"}, "prepare it from these files"),
        ("--text_column", "text", str, "text field of --input .jsonl/.parquet files"),
        ("--tokenizer", None, {"metavar": "DIR"},
         "a tokenizer folder (fineweb.py --train_tokenizer): the shards' and the model's; "
         "default: GPT-2's BPE (docs/tokenizer.md)"),
        ("--sft", False, bool,
         "fine-tune on conversations (the sft command): chat.py's format, the assistant's "
         "tokens trained"),
        ("--chat_data", None, {"nargs": "+", "metavar": "PATH|DATASET"},
         "sft: conversation .jsonl/.parquet files, or an HF dataset (default: "
         "HuggingFaceTB/smol-smoltalk)"),
        ("--chat_dir", None, str,
         "sft: the folder the conversations are prepared in (default: chat_data/ beside the "
         "scripts)"),
    ],
    THIS_INVOCATION: [
        ("--log_dir", "log", str, "where log.txt, run_config.json and model_*.pt go"),
        ("--resume", None, {"metavar": "latest|PATH"}, "continue from a checkpoint"),
        ("--overwrite", False, bool, "start afresh: delete log.txt and model_*.pt"),
        ("--keep_last", 0, count(0, STEPS), "keep only the newest N model_*.pt (0: all)"),
        ("--stop_step", None, count(1, STEPS),
         "leave after N steps, saved, on --max_steps' schedule"),
        *SHARED,
        ("--compile", None, bool, "torch.compile (default: on CUDA only)"),
        ("--fsdp", False, bool, "shard the model across torchrun processes (FSDP2)"),
        ("--peak_flops", None, POSITIVE, "peak bf16 FLOP/s of one GPU, for the MFU"),
        ("--profile", None, {"nargs": "?", "const": "continue", "choices": ["continue", "exit"]},
         "torch.profiler over a few steps: a trace in <log_dir>/profile/"),
        ("--profile_schedule", "1,1,3", profile_schedule, "WAIT,WARMUP,ACTIVE steps"),
        ("--wandb_project", None, str, "also log to this Weights & Biases project"),
        ("--wandb_run_name", None, str, "W&B run name"),
    ],
}
DEFAULTS = {flag_dest(f): default for group in RUN_SETTINGS.values() for f, default, *_ in group}
# ===== Architectures: GPTConfig's parts, each a flag ==============================================
# gpt2: the 2019 model (GPTConfig's defaults). modern: the plain-PyTorch changes behind most of the
# GPT-2 speedruns' gain in tokens (rotary positions, RMSNorm, QK-norm, ReLU², an untied head,
# zero-initialised projections, tanh soft-capping of the logits, the embedding mixed into every
# block's input) and a bias on the logits; measured in docs/performance.md, where value embeddings,
# U-net skips, a normalized embedding and a zero head did not win on the tiny preset (each a flag)
ARCHITECTURES = {
    "gpt2": dict(bias=True, pos_emb="learned", norm="layernorm", embed_norm=False, qk_norm=False,
                 activation="gelu", tie_embeddings=True, zero_init=False, zero_head=False,
                 head_bias=False, logit_softcap=0.0, value_embeds=False, x0_skip=False,
                 unet_skip=False),
    "modern": dict(bias=False, pos_emb="rope", norm="rmsnorm", embed_norm=False, qk_norm=True,
                   activation="relu2", tie_embeddings=False, zero_init=True, zero_head=False,
                   head_bias=True, logit_softcap=15.0, value_embeds=False, x0_skip=True,
                   unet_skip=False),
}
ARCH_PARTS = tuple(ARCHITECTURES["gpt2"])
SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "n_kv_head", *ARCH_PARTS)

# ===== Presets: a model shape with its run settings =============================================
# The GPT-2 paper's shapes (Table 2), and one for CPUs
MODEL_PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),  # ~7M, mostly the embedding
}

# Run settings a preset changes: the GPT-3 paper's LR (Table 2.1), a micro-batch that fits 80 GB
RUN_PRESETS = {
    "gpt2": {},
    "gpt2-medium": dict(max_lr=3e-4, micro_batch_size=32),
    "gpt2-large": dict(max_lr=2.5e-4, micro_batch_size=16),
    "gpt2-xl": dict(max_lr=2e-4, micro_batch_size=8),
    # the CPU demo: ~300k tokens, ~5 minutes at ~1k tokens/s
    "tiny": dict(max_lr=2e-3, warmup_steps=15, max_steps=150, total_batch_size=2048,
                 micro_batch_size=8, sequence_length=256, eval_every=50, val_tokens=16384,
                 sample_every=50, hellaswag_every=0, core_every=0, save_every=0,
                 data_root=os.path.join(fineweb.REPO_DIR, "edu_fineweb_tiny")),
}
# Run settings an architecture changes, per preset: its LRs and schedule where they differ from
# GPT-2's. The modern model's on the tiny preset are measured (docs/lab_record.md, "The modern
# architecture": its embedding and untied zero head want twice the AdamW LR of GPT-2 with Muon;
# on the warmup-stable-decay schedule, which reaches the GPT-2 recipe's loss in fewer tokens than
# the cosine, Muon's best is 6e-3, and the token embedding's own AdamW LR 3e-2); GPT-2 124M's
# apply the AdamW ratio to GPT-2's LR and keep Muon's LR of the cosine runs and the embedding in
# AdamW's group (none measured at that size). The larger presets keep GPT-2's
ARCH_RUN_PRESETS = {
    "modern": {"tiny": dict(max_lr=8e-3, muon_lr=6e-3, embed_lr=3e-2, wsd_decay=0.4),
               "gpt2": dict(max_lr=1.2e-3, muon_lr=4e-3, wsd_decay=0.4)},
}


def preset_defaults(preset, arch, sft=False):
    """The flags' defaults under --preset and --arch (RUN_SETTINGS, then the two overlays), and
    under --sft the fine-tuning's (sft_defaults)."""
    out = {**DEFAULTS, **RUN_PRESETS[preset], **ARCH_RUN_PRESETS.get(arch, {}).get(preset, {})}
    if sft:
        out.update(sft_defaults(out))
    return out


# Fine-tuning on conversations takes nanochat's SFT recipe (scripts/chat_sft.py): the pretraining
# run's batch and peak LRs, each LR at 0.8 of it (its init_lr_frac), no warmup, constant for half
# of the steps then linear to 0 (its warmdown_ratio 0.5, final_lr_frac 0), no weight decay, one
# epoch of the data (the sft command counts its steps when --max_steps is not given). What it
# evaluates is the val loss on the assistant's tokens; HellaSwag, CORE and text samples are off.
SFT_LR_FRACTION = 0.8


def sft_defaults(pretraining):
    """The defaults an sft run changes, from the pretraining ones of its preset and arch."""
    out = dict(warmup_steps=0, wsd_decay=0.5, min_lr_ratio=0.0, weight_decay=0.0,
               hellaswag_every=0, core_every=0, sample_every=0, log_dir="log_sft")
    for key in ("max_lr", "muon_lr", "embed_lr"):
        if pretraining.get(key):
            out[key] = pretraining[key] * SFT_LR_FRACTION
    return out

CHECKPOINT = ("--checkpoint", None, str, "a model_*.pt written by training")
COMMAND_FLAGS = {  # the commands' meaning, then their flags
    "sample": ["text from a checkpoint or from OpenAI's GPT-2", *SHARED, CHECKPOINT,
               ("--prompt", "Hello, I'm a language model,", str, "text to continue"),
               ("--num_samples", 4, count(1, SAMPLES), "independent samples"),
               ("--max_new_tokens", 64, count(1, CONTEXT), "new tokens per sample"),
               ("--top_k", 50, count(1, WIDTH * 16), "the k likeliest tokens (1: greedy)"),
               ("--temperature", 1.0, NONNEG, "softmax temperature (0: greedy)"),
               ("--seed", 1337, SEED, "sampling seed"),
               ("--no_kv_cache", False, {"action": "store_true"}, "recompute it all each token")],
    "export": ["a checkpoint as a transformers GPT2LMHeadModel directory",
               ("--checkpoint", None, {"required": True}, CHECKPOINT[3]),
               ("--out", None, {"required": True}, "a new (or empty) directory to write")],
    "eval": ["HellaSwag, CORE's tasks, a chat model's tasks, or the val loss in bits per byte, "
             "of a checkpoint or of OpenAI's GPT-2", *SHARED, CHECKPOINT,
             ("--tasks", "hellaswag", str,
              "hellaswag (acc, acc_norm of its val split), core (CORE: every task of the eval "
              "bundle's core.yaml), or a comma list of the bundle's task labels (core:LABEL "
              "for one that is also a word here, e.g. core:hellaswag, its 10-shot task); chat "
              "(a chat model asked ARC-Easy, ARC-Challenge and MMLU as nanochat's chat_eval "
              "asks them), or a comma list of chat:arc_easy, chat:arc_challenge, chat:mmlu; "
              "val (the val loss and bits per byte on the val shards of --data_root)"),
             ("--limit", None, count(1, STEPS), "HellaSwag: only the first N examples"),
             ("--max_per_task", None, count(1, STEPS),
              "CORE: the first N of each task's examples after nanochat's shuffle (seed 1337); "
              "chat: the first N questions after nanochat's shuffle (seed 42)"),
             ("--batch_tokens", 8192, count(0, CONTEXT * 16), "tokens a pass (0: one example)"),
             ("--hellaswag_dir", None, str,
              "folder of hellaswag_val.jsonl, if not hellaswag.py's"),
             ("--eval_bundle", None, {"metavar": "URL|ZIP|DIR"},
              "CORE's eval bundle to install if --eval_dir has none: a URL, a .zip or the folder "
              "it unpacks to (default: nanochat's eval_bundle.zip, core_eval.BUNDLE_URL)"),
             ("--eval_dir", None, str,
              "the folder the eval bundle is installed in (default: $EVAL_BUNDLE_DIR, or "
              "eval_bundle/ beside the scripts)"),
             ("--download_timeout", core_eval.DOWNLOAD_TIMEOUT, POSITIVE,
              "seconds the eval bundle's download may take in all"),
             ("--max_bundle_mb", core_eval.MAX_BUNDLE_MB, count(1, 1 << 20),
              "MiB the eval bundle's download may send, and its files unpack to"),
             ("--chat_eval_dir", None, str,
              "the chat tasks' data folder, downloaded into once (default: $CHAT_EVAL_DIR, or "
              "chat_eval_data/ beside the scripts)"),
             ("--data_root", None, str,
              "val: the shards' folder (default: the checkpoint's run's), made by the model's "
              "tokenizer"),
             ("--val_tokens", None, count(1, TOKENS),
              "val: the val targets scored (default: the checkpoint's run's; at most all)"),
             ("--results", None, str, "CORE, chat or val: write the scores to this JSON file"),
             ("--examples", None, str,
              "CORE or chat: write every example's result to this JSONL file"),
             ("--overwrite", False, {"action": "store_true"},
              "replace an existing --results or --examples file (refused without it)")],
    "chat": ["talk to a chat model (a checkpoint of an sft run) in the terminal, or answer "
             "--prompt", *(f for f in SHARED if f[0] != "--init_from"), CHECKPOINT,
             ("--init_from", None, {"metavar": "gpt2|...|gpt2-xl|DIR"},
              "refused: OpenAI's GPT-2 is a base model (fine-tune it with sft first)"),
             ("--prompt", None, str, "answer this one message on stdout and exit"),
             ("--system", None, str, "a system message that opens the conversation"),
             # nanochat's chat command samples at 0.6 with the top 50
             ("--temperature", 0.6, NONNEG, "softmax temperature (0: greedy)"),
             ("--top_k", 50, count(1, WIDTH * 16), "the k likeliest tokens (1: greedy)"),
             ("--seed", 1337, SEED, "sampling seed"),
             ("--max_new_tokens", None, count(1, CONTEXT),
              "the longest answer in tokens (default: a quarter of the model's context, 256 at "
              "GPT-2's 1024). Room for it is kept: a turn that would leave less drops the "
              "conversation's oldest turns (the system message stays), saying so")],
    "serve": ["serve a chat model: OpenAI's chat API at /v1 and a web page at / (docs/chat.md)",
              *(f for f in SHARED if f[0] != "--init_from"), CHECKPOINT,
              ("--init_from", None, {"metavar": "gpt2|...|gpt2-xl|DIR"},
               "refused: OpenAI's GPT-2 is a base model (fine-tune it with sft first)"),
              ("--host", "127.0.0.1", str,
               "the address to listen on (0.0.0.0: every interface; the server has no "
               "authentication: docs/operations.md puts it behind a proxy)"),
              ("--port", 8000, count(0, 65535), "the port to listen on (0: a free one)"),
              ("--model_name", None, str,
               "the model's name in the API (default: the checkpoint's file name, without .pt)"),
              ("--temperature", 0.6, NONNEG, "a request's temperature when it gives none"),
              ("--top_k", 50, count(1, WIDTH * 16), "a request's top_k when it gives none"),
              ("--seed", None, SEED,
               "the seed of a request that gives none (default: a random one each)"),
              ("--max_new_tokens", None, count(1, CONTEXT),
               "the longest reply in tokens, and a request's max_tokens when it gives none "
               "(default: the rest of the model's context)"),
              ("--max_requests", 64, count(1, 1 << 16),
               "requests answered at once (their generations share the model, a step each in "
               "turn); more are refused with 429")],
}

def build_parser(shown=DEFAULTS, command=None):
    """The parser of the training flags (RUN_SETTINGS group by group, --help showing `shown`'s
    defaults: a preset's), or of a command's."""
    if command is not None:
        meaning, *flags = COMMAND_FLAGS[command]
        p = OneLineParser(prog=f"train_gpt2.py {command}", description=f"{command}: {meaning}")
        add_flags(p, flags)
        if command == "eval":
            p.add_old_spelling("--data_dir", "--hellaswag_dir", dest="hellaswag_dir")
        return p
    commands = "\n".join(f"  {c:8} {flags[0]}" for c, flags in COMMAND_FLAGS.items())
    commands += "\n  plan     the run these flags make (memory, compute, time); nothing written"
    commands += ("\n  sft      fine-tune on conversations: these flags with --sft (docs/chat.md)")
    usage = f"%(prog)s [plan|sft] [flags]  |  %(prog)s {{{','.join(COMMAND_FLAGS)}}} [flags]"
    p = OneLineParser(prog="train_gpt2.py", formatter_class=argparse.RawDescriptionHelpFormatter,
                      usage=usage,
                      description="Pretrain GPT-2 on FineWeb-Edu shards, on one GPU or under "
                                  f"torchrun.\n\ncommands (COMMAND --help):\n{commands}")
    for title, entries in RUN_SETTINGS.items():
        add_flags(p.add_argument_group(title), entries, shown)
    return p


def check_saved_flags(saved, path):
    """A UsageError naming path and the flag, for a checkpoint's flags (its "args") that the flag
    table would not have given: each of the table's flags it holds of the flag's type and within
    its bounds (or None where the flag may be unset)."""
    entries = [e for group in RUN_SETTINGS.values() for e in group]
    for flags, default, kind, _ in entries:
        k = flag_dest(flags)
        if k not in saved or (saved[k] is None and default is None):
            continue
        value, ok = saved[k], True
        if kind is bool or isinstance(kind, dict) and kind.get("action") == "store_true":
            ok = isinstance(value, bool)
        elif isinstance(kind, list):
            ok = value in kind
        elif isinstance(kind, dict) and "nargs" in kind and kind["nargs"] == "+":
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        elif isinstance(kind, dict):
            ok = isinstance(value, str) and value in kind.get("choices", [value])
        elif kind is str:
            ok = isinstance(value, str)
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                kind(str(value))
            except argparse.ArgumentTypeError:
                ok = False
            ok = ok and (isinstance(value, float) or kind(str(value)) == value)
        else:
            ok = False
        if not ok:
            raise UsageError(f"{path} is not a usable checkpoint: its flag {k} is "
                             f"{one_line(repr(value), 40)}, which --{k} cannot be")


def resume_checkpoint(resume, log_dir):
    """(path, checkpoint) for --resume latest|PATH, read (rundir.read_checkpoint) and its flags
    checked; latest skips unusable newer files with a warning, falling back to the newest that
    works."""
    if resume != "latest":
        ckpt = rundir.read_checkpoint(resume, keys=rundir.RESUME_KEYS)
        check_saved_flags(ckpt["args"], resume)
        return resume, ckpt
    found = rundir.find_checkpoints(log_dir)
    for path in reversed(found):
        try:
            ckpt = rundir.read_checkpoint(path, keys=rundir.RESUME_KEYS)
            check_saved_flags(ckpt["args"], path)
            return path, ckpt
        except UsageError as e:
            print0(f"warning: skipping {e}")
    if found:
        raise UsageError(f"--resume latest: none of the {len(found)} checkpoints in {log_dir} "
                         f"is usable")
    raise UsageError(f"--resume latest: no model_*.pt checkpoint in {log_dir}")


def base_flags(ran):
    """The flags of a run (a checkpoint's args) that an sft run from its model takes as its own
    defaults: what export records in the folder too."""
    return {k: ran[k] for k in ("preset", "arch", "optimizer") if k in ran}


def base_run(init_from):
    """base_flags of the run that trained --init_from, checked against the flag table: of a
    model_*.pt's args, or the record in a folder that export wrote (openai_gpt2.run_record); {}
    for OpenAI's GPT-2 and a folder without the record."""
    if os.path.isfile(init_from):
        ran = rundir.read_checkpoint(init_from, check_weights=False).get("args", {})
    elif os.path.isdir(init_from):
        ran = openai_gpt2.run_record(init_from)
    else:
        return {}
    base = base_flags(ran)
    check_saved_flags(base, init_from)
    return base


def read_flags(argv=None):
    """(the flags as a Namespace, the names of those given on the command line, the checkpoint
    resumed or None). A flag's value is the first of: the command line, the checkpoint (but not
    for THIS_INVOCATION), the preset, RUN_SETTINGS."""
    # a pre-pass for --preset and --arch alone: --help shows their defaults
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    pre.add_argument("--arch")
    pre.add_argument("--sft", action="store_true")
    pre_args = pre.parse_known_args(argv)[0]
    shown_preset, shown_arch = pre_args.preset, pre_args.arch
    if shown_preset not in MODEL_PRESETS:
        shown_preset = "gpt2"  # the real parse names a bad --preset
    if shown_arch not in ARCHITECTURES:
        shown_arch = "gpt2"
    shown = {**preset_defaults(shown_preset, shown_arch, pre_args.sft),
             **MODEL_PRESETS[shown_preset],
             **ARCHITECTURES[shown_arch], "preset": shown_preset, "arch": shown_arch}
    given = vars(build_parser(shown).parse_args(argv))
    given = {k: v for k, v in given.items() if v is not None}

    preset, arch = given.get("preset", "gpt2"), given.get("arch", "gpt2")
    base = {}  # fine-tuning a model of ours: its preset's run settings and its arch's, as trained
    if given.get("sft") and given.get("init_from") and "resume" not in given:
        base = base_run(given["init_from"])
        preset, arch = given.get("preset", base.get("preset", preset)), base.get("arch", arch)
    settings = preset_defaults(preset, arch, given.get("sft", False))
    settings.update(base)
    if "input" in given:  # local text is not FineWeb-Edu: it gets a folder of its own
        settings["data_root"] = fineweb.LOCAL_DATA_ROOT
    check_pairs(given)
    ckpt = None
    if "resume" in given:  # every flag not given again comes from the checkpoint
        log_dir = given.get("log_dir", settings["log_dir"])
        given["resume"], ckpt = resume_checkpoint(given["resume"], log_dir)
        this_invocation = {flag_dest(entry[0]) for entry in RUN_SETTINGS[THIS_INVOCATION]}
        for k, v in ckpt["args"].items():
            if k in settings and k not in this_invocation:
                settings[k] = v
        if "val_tokens" in given:  # the same number two ways: the one given now wins
            settings["val_steps"] = None
    settings.update(given)
    return argparse.Namespace(**settings), set(given), ckpt


# ===== The run, settled: the flags and everything derived from them, frozen ======================
# What settle() works out before any work, beside the flags (some of which it resolves in place:
# --device to this process's, -B auto, --compile, --val_tokens from --val_steps, --peak_flops from
# the GPU's name).
DERIVED = {
    "device_type": "cpu, cuda or mps: what autocast, fused AdamW and synchronize take",
    "world_size": "processes in the run",
    "local_world_size": "processes on this host (on a CPU they share its memory)",
    "precision": "--dtype resolved: its name, torch dtype, autocast and loss scaler",
    "grad_accum_steps": "micro-steps per optimizer step (fewer during a batch ramp)",
    "end_step": "the step this invocation stops before (--max_steps, or --stop_step)",
    "micro_batch_fit": "-B auto's estimated peak and memory budget (GiB), or None",
    "model": "the GPTConfig",
    "tok": "the tokenizer (GPT-2's BPE, --tokenizer's, or the resumed or --init_from checkpoint's)",
    "schedule": "the LR and batch-size schedule",
    "provenance": "the code, torch, Python and device behind the run's numbers",
}


def as_dict(run):
    """The run as run_config.json keeps it: every flag, then what was derived (the schedule is the
    flags'; the precision by its name; the model config and provenance as dicts)."""
    d = {}
    for f in fields(run):
        value = getattr(run, f.name)
        if f.name == "schedule":
            continue
        if f.name == "micro_batch_fit":
            d.update(value or {})
            continue
        if f.name == "precision":
            value = value.name
        elif f.name == "model":
            value = asdict(value)
        elif f.name == "tok":
            value = {"name": value.name, "fingerprint": value.fingerprint}
        d[f.name] = value
    return d


def describe(run):
    """The run config as a run prints it at its start, and plan before its report."""
    return format_run_config(as_dict(run), RUN_SETTINGS)


Run = make_dataclass("Run", [*DEFAULTS, *DERIVED], frozen=True,
                     namespace={"as_dict": as_dict, "describe": describe})
Run.__doc__ = "A run's settings, settled: every flag of RUN_SETTINGS, then DERIVED; frozen."


def flags_of(run):
    """The run's flags ({dest: value}, -B resolved): what a checkpoint keeps for a resume."""
    return {k: getattr(run, k) for k in DEFAULTS}


def derive(args, proc, precision, config, micro_batch_size, micro_batch_fit=None, tok=None):
    """The Run of the flags (args) on this process (proc): its device, the precision and model
    config settle() resolved, and every count that follows. With micro_batch_size "auto" the
    counts that need it (accumulation steps, --val_steps' tokens) are None: settle() fits -B with
    the model, then derives again. The schedule is settle()'s to add. tok: the run's tokenizer
    (None: GPT-2's BPE)."""
    device_type = device_type_of(proc.device)
    flags = {**vars(args), "device": proc.device, "micro_batch_size": micro_batch_size}
    if args.compile is None:  # compiled where it pays: CUDA
        flags["compile"] = device_type == "cuda"
    if args.peak_flops is None and device_type == "cuda":
        flags["peak_flops"] = peak_flops(torch.cuda.get_device_name(proc.device))
    grad_accum_steps = None
    if micro_batch_size != "auto":
        grad_accum_steps = accumulation_steps(argparse.Namespace(**flags), proc.world_size,
                                              config.block_size)
        if args.val_steps is not None:  # the same number two ways: kept as tokens
            unit = micro_batch_size * args.sequence_length * proc.world_size
            flags["val_tokens"] = args.val_steps * unit
    return Run(**flags, device_type=device_type, world_size=proc.world_size,
               local_world_size=proc.local_world_size,
               precision=precision, grad_accum_steps=grad_accum_steps, end_step=end_step(args),
               micro_batch_fit=micro_batch_fit, model=config, tok=tok or fineweb.gpt2_tokenizer(),
               schedule=None,
               provenance=rundir.provenance(proc.device))


# ===== The printed run config ====================================================================
# The parts of a run that can be off: (what turns it off, whether it is off given the run's
# settings, the settings that matter only while it is on). The printed run config leaves those out
# while their part is off; check_flags warns of any given on the command line then.
OFF_PARTS = [
    ("--eval_every 0", lambda c: c["eval_every"] <= 0, ("val_tokens", "val_steps")),
    ("--sample_every 0", lambda c: c["sample_every"] <= 0,
     ("sample_prompt", "num_samples", "sample_tokens")),
    ("--hellaswag_every 0", lambda c: c["hellaswag_every"] <= 0, ("hellaswag_limit",)),
    ("--chat_every 0", lambda c: c["chat_every"] <= 0, ("chat_max_per_task",)),
    ("no --batch_ramp_tokens", lambda c: c["batch_ramp_tokens"] <= 0, ("batch_ramp_start",)),
    ("no --profile", lambda c: not c["profile"], ("profile_schedule",)),
    ("no --wandb_project", lambda c: not c["wandb_project"], ("wandb_run_name",)),
    ("no --optimizer muon", lambda c: c["optimizer"] != "muon",
     ("muon_lr", "muon_momentum", "muon_ns_steps", "muon_adjust_lr")),
]
CONFIG_WIDTH = 100
CONFIG_INDENT = "    "  # a group's lines after its first


def format_run_config(run_config, settings):
    """The run config in short, in lines of at most CONFIG_WIDTH columns: each group of flags in
    settings ({title: [(flags, ...)]}) with the values this run uses (not None or False, nor the
    settings of a part that is off: OFF_PARTS), then what the run worked out, then each dict in it
    (the model's config, the provenance). save_run_config keeps all of it."""
    groups = {title.split(" (")[0]: [flag_dest(e[0]) for e in entries]
              for title, entries in settings.items()}
    shown = {k for names in groups.values() for k in names}
    groups["this run"] = [k for k, v in run_config.items()
                          if k not in shown and not isinstance(v, dict)]
    unused = set()
    for _, is_off, keys in OFF_PARTS:
        if is_off(run_config):
            unused.update(keys)

    lines = ["run config:"]
    for title, names in groups.items():
        items = [f"{k}={run_config[k]}" for k in names if k not in unused
                 and run_config[k] is not None and run_config[k] is not False]
        if items:  # a group with nothing set is left out
            lines += wrap_items(f"  {title}:", items)
    for key, value in run_config.items():
        if isinstance(value, dict):
            title = DICT_TITLES.get(key, key)
            lines += wrap_items(f"  {title}:", [f"{k}={v}" for k, v in value.items()])
    return "\n".join(lines)


DICT_TITLES = {"model": "GPTConfig", "tok": "tokenizer"}  # the run config's dict-valued fields


def wrap_items(head, items):
    """head, then the items space-separated, in lines of CONFIG_WIDTH at most: an item that does
    not fit moves whole to a line of its own, one longer than that is broken (break_text). The
    head's line keeps at least the first piece of its first item (a reader finds "title: k=v")."""
    lines, line = [], head
    for item in items:
        if len(line) + 1 + len(item) > CONFIG_WIDTH and line != head:
            lines.append(line)
            line = ""
        start = line + " " if line else CONFIG_INDENT
        pieces = break_text(item, CONFIG_WIDTH - len(start), CONFIG_WIDTH - len(CONFIG_INDENT))
        for piece in pieces[:-1]:
            lines.append(start + piece)
            start = CONFIG_INDENT
        line = start + pieces[-1]
    lines.append(line)
    return lines


def break_text(text, first, width):
    """text in pieces, the first of at most `first` characters and the others of `width`, each
    broken after the last space, '/' or ',' in its second half (a long path stays readable), or
    else at the limit."""
    pieces, limit = [], first
    while len(text) > limit:
        cut = max(text.rfind(c, 0, limit) for c in " /,") + 1
        if cut <= limit // 2:
            cut = limit
        pieces.append(text[:cut].rstrip(" "))
        text, limit = text[cut:].lstrip(" "), width
    return pieces + [text]


# ===== Flag checks: what argparse cannot check alone, all before any work ========================
# the flags that decide which tokens each step sees and at which LR: a change on resume is stated
SCHEDULE_FLAGS = ("max_steps", "max_lr", "min_lr_ratio", "warmup_steps", "wsd_decay",
                  "total_batch_size", "batch_ramp_tokens", "batch_ramp_start", "seed")


def check_prompt_fits(n_prompt, n_new, block_size, flags, hint=""):
    """A UsageError when a prompt of n_prompt tokens and n_new more do not fit the model."""
    if n_prompt + n_new > block_size:
        raise UsageError(f"{flags[0]} ({n_prompt} tokens) + {flags[1]} ({n_new}) exceeds the "
                         f"model's block_size {block_size}{hint}")


def accumulation_steps(args, world_size, block_size):
    """Micro-steps per optimizer step, or a UsageError saying what does not fit."""
    B, T = args.micro_batch_size, args.sequence_length
    if T > block_size:
        raise UsageError(f"-T {T} is longer than the model's block_size {block_size}")
    unit = B * T * world_size
    if args.total_batch_size % unit != 0:
        raise UsageError(f"--total_batch_size {args.total_batch_size} is not divisible by "
                         f"B*T*world_size = {B}*{T}*{world_size} = {unit}: make it a multiple, "
                         f"or change -B")
    steps = args.total_batch_size // unit
    if steps > args.max_micro_steps:
        raise UsageError(f"a step of --total_batch_size {args.total_batch_size:,} tokens is "
                         f"{steps:,} micro-steps of -B {B} x -T {T} x {world_size} process(es), "
                         f"more than --max_micro_steps {args.max_micro_steps:,}: a smaller "
                         f"--total_batch_size or a larger -B (to run it as it is: "
                         f"--max_micro_steps {steps})")
    return steps


def end_step(args):
    """The step the run stops before: --max_steps, or --stop_step when that comes first."""
    if args.stop_step is None:
        return args.max_steps
    return min(args.max_steps, args.stop_step)


def check_pairs(given):
    """Flags that cannot be given together, given ({dest: value}): checked before a resume reads its
    checkpoint."""
    for a, b in (("val_tokens", "val_steps"), ("resume", "overwrite"), ("resume", "init_from")):
        if given.get(a) and given.get(b):
            raise UsageError(f"--{a} and --{b} do not go together: give one")


def check_flags(args, given, ckpt=None, asked_shape=None, lrs=None):
    """One-line UsageErrors for flags that cannot work together, or (ckpt) with the checkpoint
    resumed; returns warnings for settings that work but look like mistakes. given: the flags on
    the command line; asked_shape: the model config the flags describe; lrs: the LR of the next
    step on the checkpoint's schedule and on the one asked now."""
    shape = sorted(f"--{k}" for k in (*SHAPE_FLAGS, "arch") if k in given)
    if args.init_from and shape:
        raise UsageError(f"--init_from loads a model with its shape and architecture: drop "
                         f"{', '.join(shape)}")
    if args.sft and not args.init_from and ckpt is None:
        raise UsageError("sft fine-tunes a model: give --init_from a model_*.pt of yours, gpt2 "
                         "(.. gpt2-xl) or a transformers folder")
    for flag in ("chat_data", "chat_dir", "chat_every"):
        if flag in given and not args.sft:
            raise UsageError(f"--{flag} goes with the sft command (python train_gpt2.py sft ...)")
    for key in ("log_dir", "data_root"):  # found now, not mid-run
        path = getattr(args, key)
        if not path:
            raise UsageError(f"--{key} is empty: give a folder")
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--{key} {path} is a file, not a folder")

    warnings = []
    if args.warmup_steps >= args.max_steps:
        warnings.append(f"--warmup_steps {args.warmup_steps} >= --max_steps {args.max_steps}: "
                        f"the LR never leaves warmup")
    if args.init_from and "preset" in given:
        warnings.append(f"--init_from {args.init_from}: --preset {args.preset} gives only run "
                        f"settings, not the shape")
    if ("input" in given and glob.glob(os.path.join(args.data_root, "*.npy"))
            and not fineweb.prepared_from(args.data_root, args.input)):
        warnings.append(f"--input has no effect: {args.data_root} already holds shards (use "
                        f"another --data_root to prepare one from it)")

    # flags given for a part of the run that is off: stated, not dropped in silence
    for why, is_off, keys in OFF_PARTS:
        unused = sorted(f"--{k}" for k in keys if k in given)
        if unused and is_off(vars(args)):
            verb = "has" if len(unused) == 1 else "have"
            warnings.append(f"{', '.join(unused)} {verb} no effect with {why}")

    if ckpt is None:
        return warnings
    return warnings + check_resumed_flags(args, given, ckpt, asked_shape, lrs)


def check_resumed_flags(args, given, ckpt, asked_shape, lrs):
    """check_flags' part for a resumed run: the flags against the checkpoint they continue (its
    own flags were checked against the flag table as it was read: resume_checkpoint)."""
    # the model's shape is the checkpoint's: shape flags (and -T, --preset) given now must agree
    saved, step = ckpt["args"], ckpt["step"]
    asked = {**asked_shape, "sequence_length": args.sequence_length, "preset": args.preset}
    had = {**ARCHITECTURES["gpt2"], **ckpt["config"],  # a part a checkpoint lacks: GPT-2's
           "sequence_length": saved.get("sequence_length"), "preset": saved.get("preset")}
    checked = set(SHAPE_FLAGS) | {"dropout", "sequence_length", "preset"}
    asked_now = set(given)
    if "arch" in given:  # --arch asks for each of its parts
        asked_now |= set(ARCH_PARTS)
    differ = sorted(k for k in checked & asked_now if asked[k] != had[k])
    if differ:
        had_s = ", ".join(f"{k}={had[k]}" for k in differ)
        asked_s = ", ".join(f"{k}={asked[k]}" for k in differ)
        raise UsageError(f"{args.resume} holds a model trained with {had_s}; the flags ask for "
                         f"{asked_s} (a resumed run needs no shape flags)")
    # --embed_lr puts wte in an AdamW group of its own: the checkpoint's groups must be this
    # run's (a checkpoint's own --embed_lr comes with it when the flag is not given; 0 or None:
    # no group of its own)
    if args.embed_lr and not saved["embed_lr"]:
        raise UsageError(f"{args.resume} was trained without --embed_lr (wte in AdamW's decayed "
                         f"group), and --embed_lr {args.embed_lr} is given: resume without the "
                         f"flag, or start a new run")
    if saved["embed_lr"] and args.embed_lr == 0:
        raise UsageError(f"{args.resume} was trained with --embed_lr {saved['embed_lr']} (wte in "
                         f"an AdamW group of its own), and --embed_lr 0 asks for none: resume "
                         f"without the flag, or start a new run")
    if args.optimizer != saved["optimizer"]:
        kind = saved["optimizer"]
        raise UsageError(f"{args.resume} holds {kind} optimizer state but --optimizer "
                         f"{args.optimizer} was given: resume with --optimizer {kind} (or without "
                         f"the flag), or start a new run")

    # nothing left but the final evaluation (a checkpoint of step max_steps - 1) is fine
    if step + 1 >= end_step(args) and step + 1 != args.max_steps:
        stop = f" / --stop_step {args.stop_step}" if args.stop_step else ""
        raise UsageError(f"{args.resume} is at step {step}: --max_steps {args.max_steps}{stop} "
                         f"leave nothing to train")

    warnings = []
    if rundir.rounds_otherwise(ckpt["config"]):
        warnings.append(f"{args.resume} comes from a train_gpt2.py whose rotary embedding and "
                        f"soft-capped head rounded differently (its config has no x0_skip): the "
                        f"run continues closely, not bit for bit")
    for k in SCHEDULE_FLAGS:
        if k in given and k in saved and getattr(args, k) != saved[k]:
            warnings.append(f"--{k} is {getattr(args, k)} now but was {saved[k]} in the "
                            f"checkpoint")
    then, now = lrs
    if not math.isclose(then, now, rel_tol=1e-9):
        warnings.append(f"the schedule changed: step {step + 1} gets LR {now:.4e} (the "
                        f"checkpoint's schedule would give {then:.4e})")
    return warnings


# ===== The micro-batch that fits: -B auto, and the plan command's memory figure ==================
# Tensor memory is what the estimate counts; the CUDA context, cuBLAS's workspaces and the
# allocator's slack come on top: a fifth of a GPU is left for them. On a CPU (or Apple's unified
# memory) half of the machine's memory is left to the system, the data and Python.
USABLE_GPU_MEMORY, USABLE_HOST_MEMORY = 0.8, 0.5


def device_memory(device, processes=1):
    """(bytes of memory one process has on device, what that is of), or None where the system
    does not say: a GPU's own; a host's (CPU, Apple's unified memory) shared by its `processes`."""
    if str(device).startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"{props.name}'s {gib(props.total_memory)}"
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if processes > 1:
            return total / processes, f"1/{processes} of this machine's {gib(total)}"
        return total, f"this machine's {gib(total)}"
    return None


def memory_budget(device, processes=1):
    """(bytes a training step may use on device, what that is of) or a UsageError if unknown."""
    memory = device_memory(device, processes)
    if memory is None:
        raise UsageError("-B auto: this system does not say how much memory it has: give -B N")
    usable = USABLE_GPU_MEMORY if str(device).startswith("cuda") else USABLE_HOST_MEMORY
    return usable * memory[0], memory[1]


def gib(n):
    return f"{n / 2**30:.1f} GiB"


def with_optimizer_state(model, optimizer):
    """The optimizer's state made (AdamW makes it on its first step): a step over zero gradients,
    so that an estimate sees the steady state."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()


def estimated_step(model, optimizer, x, y, autocast_ctx, counted=contextlib.nullcontext()):
    """The training step the estimates measure: forward under autocast and backward (inside
    ``counted``), clipping, the optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    with counted:
        with autocast_ctx:
            _, loss = model(x, y)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


@contextlib.contextmanager
def fake_tensors(device):
    """Tensors made inside are FakeTensors on `device`: shapes, dtypes and devices, no memory (a
    model of any size is built in an instant). Yields the mode, for step_memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode, torch.device(device):
        yield mode


def counted_layers(n_layer):
    """The depths step_memory counts a model at: its own, or for a deeper one 1 and 2 blocks, from
    which the count at any depth follows exactly (each block adds the same parameters, optimizer
    state and activations; counting every block of a large model on fake tensors takes minutes)."""
    if n_layer <= 2:
        return (n_layer,)
    return (1, 2)


def at_depth(counts, n_layer):
    """A count at n_layer blocks from counts at counted_layers(n_layer): linear in the blocks."""
    if len(counts) == 1:
        return counts[0]
    return counts[0] + (n_layer - 1) * (counts[1] - counts[0])


def step_memory(models, optimizers, mode, run):
    """A function B -> the peak tensor memory of one training step of B sequences of the run's T
    tokens (the forward under autocast, backward, clipping, an optimizer step whose state exists
    already), as torch's MemTracker counts it on the fake tensors of `mode`: nothing is allocated.
    models (and their optimizers, made inside fake_tensors): the run's model at counted_layers'
    depths; the count at the run's depth follows (at_depth)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    known = {}

    def count(model, optimizer, B):
        with mode, torch.device(run.device):
            x = torch.randint(0, run.model.vocab_size, (B, run.sequence_length))
            tracker = MemTracker()
            parts = [optimizer]
            if not isinstance(optimizer, torch.optim.Optimizer):  # Muon + AdamW: each counted
                parts = list(optimizer)
            tracker.track_external(model, *parts)
            with tracker:
                estimated_step(model, optimizer, x, x, run.precision.autocast)
        snapshot = tracker.get_tracker_snapshot("peak")
        return max(v["Total"] for d, v in snapshot.items() if d.type == run.device_type)

    def peak(B):
        if not known:  # the optimizers' state, made once before the first count
            with mode, torch.device(run.device):
                for model, optimizer in zip(models, optimizers):
                    with_optimizer_state(model, optimizer)
        if B not in known:
            counts = [count(m, o, B) for m, o in zip(models, optimizers)]
            known[B] = at_depth(counts, run.model.n_layer)
        return known[B]

    return peak


def step_memory_bound(model, n_params, B, T):
    """Bytes that a training step of B sequences of T tokens stays below, worked out in an
    instant (step_memory counts for about a second even for a tiny model, and at most half of
    this: tests/test_input_checks.py): 24 a parameter (its value, gradient, the optimizer's
    state and a cast), and for each token 4-byte values: 80 per channel and 6 per head and
    position attended in each layer (eager attention keeps its (B, nh, T, T) weights), and 12 per
    vocabulary entry (the logits, their softmax and gradients)."""
    per_layer = 80 * model.n_embd + 6 * model.n_head * T
    return 24 * n_params + 4 * B * T * (model.n_layer * per_layer + 12 * model.vocab_size)


def divisors(n):
    """n's divisors, ascending (in sqrt(n) steps: n may be a huge step's sequences)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def micro_batch_candidates(args, world_size):
    """The micro-batches that divide the step's sequences per process, ascending, up to the most
    that -B can be."""
    T, total = args.sequence_length, args.total_batch_size
    if total % (T * world_size):
        raise UsageError(f"--total_batch_size {total} is not a multiple of T*world_size = "
                         f"{T}*{world_size}: a step must be whole sequences on every process")
    return [B for B in divisors(total // (T * world_size)) if B <= SEQUENCES]


def largest_fitting(peak, candidates, budget, of_what):
    """(B, its estimate): the largest of candidates (ascending) whose step fits in budget bytes,
    by bisection (memory grows with B); a UsageError if none does."""
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if peak(candidates[mid]) <= budget:
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise UsageError(f"-B auto: even -B 1 needs about {gib(peak(candidates[0]))}, more than "
                         f"the {gib(budget)} usable of {of_what}: a smaller model or -T")
    return best, peak(best)


def forked_rng(device):
    """torch.random.fork_rng over the CPU's generator and device's: they are as they were after."""
    dev = torch.device(device)
    return torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev.index or 0],
                                 device_type=dev.type)


def confirm_micro_batch(model, candidates, B, run, proc):
    """B, or the next smaller candidate until one real forward and backward of B x T tokens fits
    on every rank (the estimate leaves out fragmentation and the kernels' workspaces); the model
    is left without gradients. Random generators are left as they were."""
    while True:
        fits = True
        with forked_rng(run.device):
            try:
                x = torch.zeros(B, run.sequence_length, dtype=torch.long, device=run.device)
                with run.precision.autocast:
                    _, loss = model(x, x)
                loss.backward()
            except torch.OutOfMemoryError:
                fits = False
        x = loss = None
        model.zero_grad(set_to_none=True)
        if run.device_type == "cuda":
            torch.cuda.empty_cache()
        if proc.agree(fits):
            return B
        smaller = [c for c in candidates if c <= B // 2]
        if not smaller:
            raise UsageError(f"-B auto: even -B {B} runs out of memory here: a smaller model or -T")
        B = smaller[-1]


def fit_micro_batch(peak, run):
    """-B auto: the largest micro-batch that divides the step's sequences per rank and whose
    estimated step (peak) fits this device's memory; returns it and the run config's record of
    the choice. On CUDA, settle() confirms it with a real step (confirm_micro_batch)."""
    if run.fsdp:
        raise UsageError("-B auto estimates a whole model per GPU, not FSDP's shards: give -B N")
    candidates = micro_batch_candidates(run, run.world_size)
    budget, of_what = memory_budget(run.device, run.local_world_size)
    B, estimate = largest_fitting(peak, candidates, budget, of_what)
    return B, {"micro_batch_estimate_gib": round(estimate / 2**30, 2),
               "memory_budget_gib": round(budget / 2**30, 2)}


def measure_micro_step(model, optimizer, B, run, repeats=3):
    """(fastest, median, slowest) seconds of a few real micro-steps (forward, backward, optimizer
    step) of B x T tokens on the run's device, after one to warm up; random generators are left as
    they were."""
    x = torch.zeros(B, run.sequence_length, dtype=torch.long, device=run.device)
    seconds = []
    with forked_rng(run.device):
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with run.precision.autocast:
                _, loss = model(x, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # waits for the device
            seconds.append(time.perf_counter() - t0)
    timed = sorted(seconds[1:])
    return timed[0], timed[len(timed) // 2], timed[-1]


@functools.cache  # bench.py's rows and the tests run main() many times in one process
def matmul_flops(device, n=512, repeats=8):
    """FLOP/s of an (n, n) fp32 matmul on device, measured once a process: an upper bound on what
    a training step reaches there, for plan's estimate of a run too large to time a step of."""
    a = torch.randn(n, n, device=device)
    (a @ a).sum().item()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        b = a @ a
    b.sum().item()  # waits for the device
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def evaluations(every, run, first_step):
    """How many times an every-N block (val, samples) runs in the run from first_step on: at its
    steps that N divides, and after the final step when this invocation reaches it."""
    if every <= 0:
        return 0
    # the multiples of N in [first_step, end_step), ceil(end / N) - ceil(first / N), worked out:
    # a list of the steps would take minutes for a huge --max_steps
    due = max(0, -(-run.end_step // every) + (-first_step // every))
    return due + int(run.end_step == run.max_steps)


CORE_TASKS = 22  # core.yaml's tasks, what --core_every scores


def core_tokens(run, first_step=0):
    """Forward tokens of the run's CORE evaluations from first_step on, at most: 22 tasks x
    --core_max_per_task examples (fewer where a task has fewer), each at most one context of
    tokens (the prefix its options share once, then their own tokens). The bundle is not read."""
    each = CORE_TASKS * run.core_max_per_task * run.model.block_size
    return evaluations(run.core_every, run, first_step) * each


def plan_time(run, micro_step, first_step=0):
    """Seconds the run's loop takes at `micro_step` seconds a micro-step (forward, backward and an
    optimizer step of B x T tokens): its optimizer steps from first_step on, its val passes and
    its CORE evaluations (core_tokens), their forward passes a third of a micro-step of as many
    tokens. Samples and HellaSwag are not counted."""
    steps = run.end_step - first_step
    train = steps * run.grad_accum_steps * micro_step
    unit = run.micro_batch_size * run.sequence_length * run.world_size
    val = evaluations(run.eval_every, run, first_step) * math.ceil(run.val_tokens / unit)
    core = core_tokens(run, first_step) / unit
    return train + (val + core) * micro_step / 3


def least_seconds(run, n_params_non_embedding, rate, first_step=0):
    """Seconds the run's steps (and CORE evaluations: a forward is a third of a step's work a
    token) from first_step on take at least, at `rate` FLOP/s (a plain matmul's, matmul_flops:
    a training step reaches less)."""
    flops = flops_per_token(run.model, n_params_non_embedding, run.sequence_length)
    tokens = (run.end_step - first_step) * run.total_batch_size + core_tokens(run, first_step) / 3
    return tokens * flops / rate


def tiny_hint(run, seconds):
    """What a CPU user wants told of a run of more than an hour: --preset tiny, unless it is
    already that."""
    if run.device_type != "cpu" or run.preset == "tiny" or seconds <= 3600:
        return ""
    return ": for a run of minutes use --preset tiny"


def core_line(run, first_step, core_flops, steps_flops):
    """plan's words for the CORE evaluations: how many, their FLOPs at most and their share."""
    n = evaluations(run.core_every, run, first_step)
    if n == 0:
        return "CORE off"
    share = ""
    if steps_flops > 0:
        share = f" ({100 * core_flops / steps_flops:.1f}% of the steps')"
    return f"CORE {n} time(s), at most {core_flops / 1e18:,.3f} EFLOP{share}"


def plan_report(run, peak, n_params, n_params_non_embedding, seconds=None, first_step=0,
                rate=None):
    """The plan command's report of a settled run (under torchrun: per process): its size, batch,
    memory, compute and time, worked out before anything is written. peak: step_memory's;
    seconds: measure_micro_step's (fastest, median, slowest) of the run's micro-step, where timed;
    first_step: a resumed run's next step; rate: matmul_flops' on the run's device, where
    measured."""
    T, total, B = run.sequence_length, run.total_batch_size, run.micro_batch_size
    budget, of_what = memory_budget(run.device, run.local_world_size)
    step_flops = flops_per_token(run.model, n_params_non_embedding, T) * total
    steps = run.end_step - first_step
    core_flops = core_tokens(run, first_step) * step_flops / total / 3  # forward passes
    steps_and, and_core = "steps and val passes", ""  # what the time counts
    if core_flops:
        steps_and, and_core = "steps, val passes and CORE", " and CORE"
    if run.peak_flops:  # compiled GPT-2 training runs reach about 30-50% of a GPU's peak
        fast = (steps * step_flops + core_flops) / (run.world_size * run.peak_flops * 0.5)
        time_line = (f"{format_eta(fast)} to {format_eta(fast * 0.5 / 0.3)} (the steps{and_core} "
                     f"at 50% to 30% MFU of {run.peak_flops / 1e12:.0f} TFLOP/s)")
    elif seconds is not None:  # the run's own micro-step, timed here
        fastest, median, slowest = seconds
        total_time = plan_time(run, median, first_step)
        time_line = (f"about {format_eta(total_time)} ({steps_and}, from micro-steps of -B {B} x "
                     f"-T {T} timed on {run.device}: {fastest:.2f} to {slowest:.2f} s, median "
                     f"{median:.2f}){tiny_hint(run, total_time)}")
    else:  # too large to time here: the matmul rate bounds it
        rate = rate or matmul_flops(run.device)
        least = least_seconds(run, n_params_non_embedding, rate, first_step)
        time_line = (f"at least {format_eta(least)} (the FLOPs of the steps{and_core} at the "
                     f"{rate / 1e9:,.0f} GFLOP/s of a matmul measured on {run.device})"
                     f"{tiny_hint(run, least)}")
    fits = ""
    if peak(B) > budget:
        fits = ": it does not fit, -B auto picks one that does"
    return "\n".join([
        f"plan: {n_params:,} parameters on {run.world_size} x {run.device} in {run.precision}",
        f"  tokens: {steps:,} steps x {total:,} = {steps * total:,}",
        f"  batch: -B {B} x -T {T} x {run.world_size} process(es), {run.grad_accum_steps} "
        f"micro-step(s) a step",
        f"  memory: a step's estimated peak {gib(peak(B))} per process,",
        f"    of {gib(budget)} usable of {of_what}{fits}",
        f"  compute: {step_flops / 1e12:,.1f} TFLOP a step (6N + attention), "
        f"{steps * step_flops / 1e18:,.2f} EFLOP in all",
        f"  evaluations: val {evaluations(run.eval_every, run, first_step)} time(s); "
        f"{core_line(run, first_step, core_flops, steps * step_flops)}",
        f"  time: {time_line}"])


def check_machine(run, peak, n_params, n_params_non_embedding, first_step=0, planning=False):
    """Before any work: a UsageError if a step of the run cannot fit this device's memory at all
    (peak: step_memory's, counted only where step_memory_bound leaves it open; planning: plan
    reports it instead); warnings for what works but is not what a user wants: a run a CPU takes
    hours for (at best: a plain matmul's rate; planning: plan's report gives the time), fp16 on a
    CPU."""
    memory = device_memory(run.device, run.local_world_size)
    B, T = run.micro_batch_size, run.sequence_length
    bound = step_memory_bound(run.model, n_params, B, T)
    if memory is not None and bound > memory[0] and not planning:
        need = peak(B)  # counted: the bound alone does not say that the step fits
        if need > memory[0]:
            tiny = ""
            if run.device_type == "cpu" and run.preset != "tiny":
                tiny = " (on a CPU, --preset tiny is a run of minutes)"
            raise UsageError(f"a training step of -B {B} x -T {T} needs about {gib(need)} "
                             f"(estimated), more than {memory[1]}: -B auto, or a smaller -B, -T "
                             f"or model{tiny}")
    warnings = []
    if run.device_type == "cpu" and run.precision.name == "fp16":
        warnings.append("--dtype fp16 on a CPU is emulated, many times slower than fp32 (CPUs "
                        "have no fp16 matmul units): use --dtype fp32 (or bf16)")
    if run.device_type == "cpu" and not planning:
        seconds = least_seconds(run, n_params_non_embedding, matmul_flops(run.device), first_step)
        if seconds > 3600:
            warnings.append(f"on this CPU the run takes at least {format_eta(seconds)} (its "
                            f"FLOPs at a plain matmul's rate){tiny_hint(run, seconds)}")
    return warnings


def worth_timing(run, peak, n_params_non_embedding, rate, limit=10.0):
    """Whether plan times real micro-steps of the run's shape here: the step fits this machine's
    memory, and at the matmul rate (matmul_flops') a micro-step takes under `limit` seconds (a
    full-size model on a CPU would take minutes a step, and the machine's memory)."""
    budget, _ = memory_budget(run.device, run.local_world_size)
    if peak(run.micro_batch_size) > budget:
        return False
    unit = run.micro_batch_size * run.sequence_length
    flops = flops_per_token(run.model, n_params_non_embedding, run.sequence_length) * unit
    return flops / rate < limit
