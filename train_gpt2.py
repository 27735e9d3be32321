"""
GPT-2 (124M) pretraining on FineWeb-Edu token shards, in one flat, importable file.

    python train_gpt2.py --preset tiny                       # a ~7M-parameter demo on a laptop CPU
    python train_gpt2.py                                     # the GPT-2 124M recipe on one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the same recipe on a node of 8 GPUs
    python train_gpt2.py sample|export|eval --help           # use a checkpoint

Read top to bottom: the run settings, the model, the data loader, optimizers and schedules, the
distributed set-up, evaluation, `train()` (the whole run in one function), the commands. rundir.py
keeps a run safe (checkpoint files, the log dir, log.txt, signals); common.py holds what the three
command lines share (one-line errors, device and dtype).
"""

import argparse
import datetime
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fineweb
import hellaswag
import rundir
from common import (DTYPES, LEARNING_RATE, NONNEG, NONNEG_INT, POSITIVE, POSITIVE_INT, SEED,
                    OneLineParser, UsageError, add_flags, auto_or, autocast_for, bounded,
                    device_type_of, enable_tf32, exit_process, flag_dest, one_line, print0, rank,
                    resolve_device, resolve_dtype, run_cli, torch_dtype, write_new_dir)
from fineweb import EOT, GPT2_VOCAB_SIZE

# ===== Run settings =====
# Every training flag once: (flags, default, type, meaning), made argparse arguments by add_flags.
# A --preset, then a resumed checkpoint, change the defaults (parse_args); --help shows them.
FRACTION = bounded(float, 0, 1, high_open=True, what="in [0, 1)")
SHARED = [  # the flags that the sample and eval commands take too
    ("--init_from", None, {"metavar": "gpt2|...|gpt2-xl|DIR"}, "OpenAI's GPT-2 weights"),
    ("--device", "auto", str, "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps"),
    ("--dtype", "auto", list(DTYPES), "auto: bf16, or fp16 on GPUs without it, fp32 on a CPU"),
]
THIS_INVOCATION = "this invocation (never taken from a resumed checkpoint)"
RUN_SETTINGS = {
    "model": [
        ("--preset", "gpt2", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"],
         "a model shape with its run settings"),
        ("--n_layer", None, POSITIVE_INT, "transformer blocks"),
        ("--n_head", None, POSITIVE_INT, "attention heads"),
        ("--n_embd", None, POSITIVE_INT, "embedding width"),
        ("--block_size", None, POSITIVE_INT, "context length"),
        ("--n_kv_head", None, POSITIVE_INT, "key/value heads (GQA; 1: MQA)"),
        ("--dropout", 0.0, FRACTION, "dropout in training"),
        ("--bias", True, bool, "biases in Linear and LayerNorm"),
    ],
    "optimisation": [
        ("--optimizer", "adamw", ["adamw", "muon"], "muon: Muon for the blocks' matrices"),
        ("--muon_lr", None, LEARNING_RATE, "Muon's peak LR (default: --max_lr)"),
        ("--muon_momentum", 0.95, FRACTION, "Muon's Nesterov momentum"),
        ("--muon_ns_steps", 5, bounded(int, 1, 99, what="in 1..99"), "Newton-Schulz steps"),
        ("--muon_adjust_lr", "match_rms_adamw", ["match_rms_adamw", "original"],
         "match_rms_adamw: Muon's LR on AdamW's scale; original: ~10-50x larger --muon_lr"),
        ("--max_lr", 6e-4, LEARNING_RATE, "peak learning rate"),
        ("--min_lr_ratio", 0.1, bounded(float, 0, 1, what="in [0, 1]"), "final LR / max_lr"),
        ("--warmup_steps", 715, NONNEG_INT, "linear warmup steps"),
        ("--max_steps", 19073, POSITIVE_INT, "optimizer steps (19073 x 2^19 = 10B tokens)"),
        ("--weight_decay", 0.1, NONNEG, "AdamW's weight decay (matmuls, embeddings)"),
        ("--grad_clip", 1.0, NONNEG, "clip the gradient norm to this (0: off)"),
        ("--total_batch_size", 524288, POSITIVE_INT, "tokens per step, a multiple of B*T*ranks"),
        ("--batch_ramp_tokens", 0, NONNEG_INT, "GPT-3's batch ramp over the first N tokens"),
        ("--batch_ramp_start", 32768, POSITIVE_INT, "first batch of the ramp, in tokens"),
        ("-B --micro_batch_size", 64, auto_or(POSITIVE_INT),
         "sequences a forward pass, per process; auto: most that fit"),
        ("-T --sequence_length", 1024, POSITIVE_INT, "tokens per sequence"),
    ],
    "evaluation, sampling, checkpoints (every 0: off)": [
        ("--eval_every", 250, NONNEG_INT, "val loss every N steps and at the end"),
        ("--val_tokens", 10_485_760, POSITIVE_INT, "val loss over the first N val tokens"),
        ("--val_steps", None, POSITIVE_INT, "instead: N batches of B*T tokens per process"),
        ("--sample_every", 250, NONNEG_INT, "samples every N steps (not 0) and at the end"),
        ("--sample_prompt", "Hello, I'm a language model,", str, "prompt for the samples"),
        ("--num_samples", 4, POSITIVE_INT, "samples per sampling block"),
        ("--sample_tokens", 32, POSITIVE_INT, "new tokens per sample"),
        ("--hellaswag_every", 250, NONNEG_INT, "HellaSwag every N steps and at the end"),
        ("--hellaswag_limit", None, POSITIVE_INT, "only the first N HellaSwag val examples"),
        ("--save_every", 5000, NONNEG_INT, "checkpoint every N steps; the last is saved"),
        ("--keep_last", 0, NONNEG_INT, "keep only the newest N model_*.pt (0: all)"),
    ],
    "data": [
        ("--seed", 1337, SEED, "seed for init, data order and sampling"),
        ("--data_root", fineweb.DEFAULT_DATA_ROOT, str, "shard folder; rank 0 prepares it"),
        ("--fineweb_name", "sample-10BT", list(fineweb.NAMES), "FineWeb-Edu sample to prepare"),
        ("--input", None, {"nargs": "+", "metavar": "PATH"}, "prepare it from these files"),
        ("--text_column", "text", str, "text field of --input .jsonl/.parquet files"),
    ],
    THIS_INVOCATION: [
        ("--log_dir", "log", str, "where log.txt, run_config.json and model_*.pt go"),
        ("--resume", None, {"metavar": "latest|PATH"}, "continue from a checkpoint"),
        ("--overwrite", False, bool, "start afresh: delete log.txt and model_*.pt"),
        ("--stop_step", None, POSITIVE_INT, "leave after N steps, saved, on --max_steps' schedule"),
        *SHARED,
        ("--compile", None, bool, "torch.compile (default: on CUDA only)"),
        ("--fsdp", False, bool, "shard the model across torchrun processes (FSDP2)"),
        ("--peak_flops", None, POSITIVE, "peak bf16 FLOP/s of one GPU, for the MFU"),
        ("--profile", None, {"nargs": "?", "const": "continue", "choices": ["continue", "exit"]},
         "torch.profiler over a few steps: a trace in <log_dir>/profile/"),
        ("--profile_schedule", "1,1,3", rundir.profile_schedule, "WAIT,WARMUP,ACTIVE steps"),
        ("--wandb_project", None, str, "also log to this Weights & Biases project"),
        ("--wandb_run_name", None, str, "W&B run name"),
    ],
}
DEFAULTS = {flag_dest(f): default for group in RUN_SETTINGS.values() for f, default, *_ in group}
SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "n_kv_head", "bias")

# ===== Model config and presets =====
@dataclass
class GPTConfig:
    block_size: int = 1024  # the longest sequence
    vocab_size: int = 50304  # 50257 tokens, padded to a multiple of 64: faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    real_vocab_size: int = GPT2_VOCAB_SIZE  # ids >= this: padding, never predicted
    n_kv_head: int | None = None  # key/value heads: n_head (None) is GPT-2's, fewer GQA, 1 MQA
    dropout: float = 0.0  # attention, residual and embedding dropout in training
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if min(self.block_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError("block_size, n_layer, n_head and n_embd must be positive")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout ({self.dropout}) must be in [0, 1)")
        if not 0 < self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"real_vocab_size ({self.real_vocab_size}) must be in "
                             f"1..{self.vocab_size}")

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
                 sample_every=50, hellaswag_every=0, save_every=0,
                 data_root=os.path.join(fineweb.REPO_DIR, "edu_fineweb_tiny")),
}

def model_config_from_args(args):
    """The GPTConfig the flags ask for: the preset's shape, changed by any shape flag given."""
    shape = {**MODEL_PRESETS[args.preset], "dropout": args.dropout}
    for k in SHAPE_FLAGS:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    try:
        return GPTConfig(**shape)
    except ValueError as e:
        raise UsageError(str(e)) from None

# ===== The model =====
class KVCache:
    """Keys and values (n_layer, B, n_kv_head, max_len, hs) of the first `pos` tokens."""

    def __init__(self, config: GPTConfig, batch_size, max_len, device, dtype):
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, hs)
        self.k, self.v = (torch.zeros(shape, device=device, dtype=dtype) for _ in range(2))
        self.pos = 0

    def update(self, layer, k, v):
        """Store k, v (B, nkv, T, hs) after the filled positions; returns all keys and values."""
        T = k.size(2)
        self.k[layer, :, :, self.pos: self.pos + T] = k
        self.v[layer, :, :, self.pos: self.pos + T] = v
        return self.k[layer, :, :, : self.pos + T], self.v[layer, :, :, : self.pos + T]

class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx=0):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.hs = config.n_embd // config.n_head
        self.layer_idx, self.dropout = layer_idx, config.dropout
        # q for all heads and k, v for the n_kv_head key/value heads, in one matmul
        qkv = (config.n_head + 2 * config.n_kv_head) * self.hs
        self.c_attn = nn.Linear(config.n_embd, qkv, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # adds to the residual stream
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        hs, nh, nkv = self.hs, self.n_head, self.n_kv_head
        q, k, v = self.c_attn(x).split([nh * hs, nkv * hs, nkv * hs], dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        mask, causal = None, True
        if kv_cache is not None:
            past = kv_cache.pos
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, nkv, past + T, hs)
            if past > 0:
                causal = False
                if T > 1:  # query i sits at position past + i and sees keys 0 .. past + i
                    mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device)
                    mask = mask.tril(diagonal=past)
        extra = {"enable_gqa": True} if nkv != nh else {}  # nh/nkv query heads share k,v
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                           is_causal=causal and mask is None, **extra)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx=0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None):
        # pre-LayerNorm: the residual stream itself is never normalized
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    masked_logits_to_keep = True  # see forward

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        # 0 for real tokens, -inf for padding ids, added in the lm_head matmul: padding is never
        # sampled. A buffer, not a parameter: the state dict stays GPT-2's
        real = torch.arange(config.vocab_size) < config.real_vocab_size
        self.register_buffer("vocab_mask", torch.where(real, 0.0, float("-inf")), persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):  # the residual stream's variance
                std *= (2 * self.config.n_layer) ** -0.5  # kept over 2 adds a block
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=False):
        """Parameters (the tied wte/lm_head once); non_embedding=True leaves out wpe."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, kv_cache=None, logits_to_keep=0):
        """idx (B, T) -> logits (B, T, vocab_size) and the mean cross-entropy vs targets (or None).
        With a kv_cache, idx continues the cached sequence. logits_to_keep as in transformers, or
        a (B, T) bool mask: logits (K, vocab_size) at its K True positions."""
        B, T = idx.size()
        past = kv_cache.pos if kv_cache is not None else 0
        if past + T > self.config.block_size:
            raise ValueError(f"{past + T} tokens exceed block_size {self.config.block_size}")

        pos = torch.arange(past, past + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B,T,C)
        for block in self.transformer.h:
            x = block(x, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T

        if not isinstance(logits_to_keep, int) or logits_to_keep > 0:  # the vocab matmul is most
            if targets is not None:  # of a small model's work: scoring and sampling need few
                raise ValueError("targets need every position's logits: leave logits_to_keep 0")
            if isinstance(logits_to_keep, int):
                x = x[:, -logits_to_keep:]
            elif logits_to_keep.dim() == 2:  # (K, C): the mask's K positions
                x = x[logits_to_keep]
            else:
                x = x[:, logits_to_keep]
        x = self.transformer.ln_f(x)
        if torch.is_grad_enabled():
            # -inf in the matmul: an in-place write's backward would copy the gradient
            logits = F.linear(x, self.lm_head.weight, self.vocab_mask)  # (B, T, vocab_size)
        else:  # no autograd: writing the padding columns in place is cheaper
            logits = self.lm_head(x)
            logits[..., self.config.real_vocab_size:] = float("-inf")
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """OpenAI's GPT-2 through transformers (gpt2 .. gpt2-xl, or a save_pretrained dir), the
        vocab padded to 50304 with zero, masked rows."""
        hf = hellaswag.load_hf_model(name_or_dir)  # transformers' own; one line if it fails
        hc = hf.config
        standard = (hc.activation_function == "gelu_new" and hc.layer_norm_epsilon == 1e-5
                    and hc.n_inner in (None, 4 * hc.n_embd)
                    and not getattr(hc, "scale_attn_by_inverse_layer_idx", False)
                    and not getattr(hc, "reorder_and_upcast_attn", False))
        if hc.model_type != "gpt2" or not standard:
            raise UsageError(f"{name_or_dir}: not a standard GPT-2 architecture")

        padded_vocab = math.ceil(hc.vocab_size / 64) * 64
        config = GPTConfig(block_size=hc.n_positions, vocab_size=padded_vocab, n_layer=hc.n_layer,
                           n_head=hc.n_head, n_embd=hc.n_embd, real_vocab_size=hc.vocab_size,
                           dropout=dropout)
        sd = {}
        for k, v in hf.state_dict().items():
            if k.endswith(rundir.CONV1D_WEIGHTS):
                v = v.t()  # HF's Conv1D is (in, out); nn.Linear wants (out, in)
            if k in ("transformer.wte.weight", "lm_head.weight"):  # zero padding rows: masked
                v = F.pad(v, (0, 0, 0, padded_vocab - hc.vocab_size))
            sd[k] = v
        model = cls(config)
        try:
            model.load_state_dict(sd)  # strict: GPT-2's names and shapes, one to one
        except RuntimeError as e:
            raise UsageError(f"{name_or_dir}: not GPT-2's parameters ({one_line(e)})") from None
        return model

    def configure_optimizers(self, weight_decay, learning_rate, device_type, verbose=True,
                             muon=None):
        """AdamW, weight decay on matmuls and embeddings only. muon (make_muon's keywords): the
        blocks' 2-D weights go to torch.optim.Muon instead, both in one CombinedOptimizer."""
        matrices = []  # Muon's share: the 2-D weights inside the blocks (attention and MLP)
        if muon is not None:
            matrices = [p for p in self.transformer.h.parameters() if p.dim() == 2]
        taken = {id(p) for p in matrices}
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in taken]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        parts = {"decayed": decay, "non-decayed": no_decay}
        if muon is not None:
            parts["Muon"] = matrices
        for what, ps in parts.items():
            if verbose:
                print(f"{what} parameter tensors: {len(ps)}, {sum(p.numel() for p in ps):,} params")
        adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8,
                                  fused=device_type == "cuda")  # one kernel for the update
        if muon is None:
            return adamw
        return CombinedOptimizer(adamw, make_muon(matrices, weight_decay, learning_rate, **muon))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None,
                 use_cache=True):
        """The prompt idx (B, T0) and max_new_tokens sampled after. The KV cache runs the prompt
        once, then a token a step; without it (the tests' reference) all is recomputed."""
        B, T0 = idx.size()
        T1 = T0 + max_new_tokens
        if T1 > self.config.block_size:
            raise ValueError(f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the model's block_size {self.config.block_size}")
        was_training = self.training
        self.eval()
        dtype = self.lm_head.weight.dtype
        if torch.is_autocast_enabled(idx.device.type):
            dtype = torch.get_autocast_dtype(idx.device.type)
        cache = KVCache(self.config, B, T1, idx.device, dtype) if use_cache else None
        logits, _ = self(idx, kv_cache=cache, logits_to_keep=1)  # prefill
        for i in range(max_new_tokens):
            last = logits[:, -1, : self.config.real_vocab_size]
            nxt = sample_next(last, temperature, top_k, generator)
            idx = torch.cat((idx, nxt), dim=1)
            if i == max_new_tokens - 1:
                break
            if use_cache:
                logits, _ = self(nxt, kv_cache=cache, logits_to_keep=1)
            else:
                logits, _ = self(idx, logits_to_keep=1)
        self.train(was_training)
        return idx

def sample_next(logits, temperature=1.0, top_k=50, generator=None):
    """A token id per row of logits (B, V): top-k sampling; greedy for top_k=1 or temperature 0."""
    logits = logits.float()
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.size(-1):
        v, ix = torch.topk(logits, top_k, dim=-1)
        return torch.gather(ix, -1, torch.multinomial(F.softmax(v, dim=-1), 1, generator=generator))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)

# ===== Data loader: uint16 token shards written by fineweb.py =====
class DataLoaderLite:
    """Batches (x, y) of shape (B, T) from the memory-mapped `*_{split}_NNNNNN.npy` shards: one
    endless stream, its shards in order, then (train) in a seeded order each epoch. Rank r reads
    window r of each num_processes windows of B*T (+1) tokens: the same batches for any number of
    processes, and a position that resumes exactly."""

    def __init__(self, B, T, process_rank=0, num_processes=1, split="train",
                 data_root=fineweb.DEFAULT_DATA_ROOT, seed=1337, vocab_size=GPT2_VOCAB_SIZE):
        self.B, self.T, self.split, self.seed, self.vocab = B, T, split, seed, vocab_size
        self.process_rank, self.num_processes = process_rank, num_processes
        self.shards, self.tokens = fineweb.open_split(data_root, split, None)  # headers only
        self.lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)
        self.epoch_tokens = int(self.lengths.sum())
        if self.epoch_tokens < B * T + 1:
            raise UsageError(f"the {split} shards in {data_root} hold {self.epoch_tokens} tokens, "
                             f"fewer than one batch of B*T+1 = {B * T + 1}")
        self.order_key = None  # (seed, epoch) of self.order, self.starts
        self.reset()

    def reset(self):
        self.position = 0  # where this step's windows start (the same on every rank)

    def state_dict(self):
        return {"position": self.position, "split": self.split, "seed": self.seed,
                "num_shards": len(self.shards), "epoch_tokens": self.epoch_tokens}

    def load_state_dict(self, state):
        then = (state["num_shards"], state["epoch_tokens"])
        if then != (len(self.shards), self.epoch_tokens):
            raise UsageError(f"the {self.split} shards changed since the checkpoint ({then[0]} "
                             f"shards / {then[1]} tokens then, {len(self.shards)} / "
                             f"{self.epoch_tokens} now)")
        self.seed, self.position = state["seed"], state["position"]

    def _use_epoch(self, epoch):
        """self.order (the epoch's shard order) and self.starts (its offsets), kept per epoch."""
        if self.order_key == (self.seed, epoch):
            return
        self.order = np.arange(len(self.shards))
        if self.split == "train" and epoch > 0:
            self.order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        self.starts = np.concatenate([[0], np.cumsum(self.lengths[self.order])])
        self.order_key = (self.seed, epoch)

    def _read(self, start, n):
        """n tokens of the stream from offset start, as int64, across shard and epoch ends."""
        pieces = []
        while n > 0:
            epoch, offset = divmod(start, self.epoch_tokens)
            self._use_epoch(epoch)
            i = int(np.searchsorted(self.starts, offset, side="right")) - 1
            shard, local = self.order[i], offset - int(self.starts[i])
            take = min(n, int(self.lengths[shard]) - local)
            pieces.append(self.tokens[shard][local: local + take])
            fineweb.check_window(pieces[-1], self.vocab, self.shards[shard], local)
            start, n = start + take, n - take
        window = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        return torch.from_numpy(window.astype(np.int64))  # the only copy of a memory-mapped window

    def next_batch(self):
        B, T = self.B, self.T
        buf = self._read(self.position + self.process_rank * B * T, B * T + 1)
        x = buf[:-1].view(B, T)  # inputs
        y = buf[1:].view(B, T)  # targets: the next token of each
        self.position += B * T * self.num_processes
        return x, y

# ===== Optimizers (AdamW, or Muon + AdamW) and schedules (the LR, the batch ramp) =====
def make_muon(matrices, weight_decay, max_lr, lr=None, momentum=0.95, ns_steps=5,
              adjust_lr_fn="match_rms_adamw"):
    """torch.optim.Muon over `matrices`, at the schedule's LR x lr_scale (on AdamW's scale)."""
    lr = max_lr if lr is None else lr
    return torch.optim.Muon([{"params": matrices, "lr_scale": lr / max_lr}], lr=lr,
                            weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                            adjust_lr_fn=adjust_lr_fn)

class CombinedOptimizer:
    """Optimizers over disjoint parameters as one (iterable, for torch's state-dict helpers)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        for opt, state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            opt.load_state_dict(state)

def make_optimizer(model, args, device_type, verbose=False):
    """The run's optimizer: AdamW, or (--optimizer muon) Muon for the blocks' matrices."""
    muon = None
    if args.optimizer == "muon":
        muon = dict(lr=args.muon_lr, momentum=args.muon_momentum, ns_steps=args.muon_ns_steps,
                    adjust_lr_fn=args.muon_adjust_lr)
    return model.configure_optimizers(args.weight_decay, args.max_lr, device_type, verbose, muon)

def get_lr(step, max_lr, min_lr, warmup_steps, max_steps):
    """Linear warmup to max_lr, cosine decay to min_lr at max_steps, then constant."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    ratio = (step - warmup_steps) / (max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)

def batch_size_at(tokens_seen, ramp_tokens, total_batch_size, unit, start=32768):
    """GPT-3's ramp: the next step's tokens, `start` to the total linearly over ramp_tokens, in
    B*T*world_size units."""
    if ramp_tokens <= 0 or tokens_seen >= ramp_tokens:
        return total_batch_size
    start = min(start, total_batch_size)
    size = start + (total_batch_size - start) * tokens_seen / ramp_tokens
    return max(unit, int(size) // unit * unit)

# ===== Distributed: this process in the run, FSDP =====
@dataclass
class Proc:
    """This process in the run (torchrun's RANK, LOCAL_RANK, WORLD_SIZE) and its device."""
    distributed: bool  # launched by torchrun, with a process group
    rank: int
    local_rank: int
    world_size: int
    device: str
    long_wait_group: object = None

    def __post_init__(self):
        self.master = self.rank == 0
        self.device_type = device_type_of(self.device)  # 'cuda', not 'cuda:3': for autocast

    def agree(self, ok, long_wait=False):
        """ok on every rank (a barrier too); long_wait: a gloo group waits 48 h (data prep)."""
        flag = torch.tensor(float(ok), device="cpu" if long_wait else self.device)
        if self.world_size > 1 and long_wait and self.long_wait_group is None:
            hours48 = datetime.timedelta(hours=48)
            self.long_wait_group = dist.new_group(backend="gloo", timeout=hours48)
        if self.world_size > 1:
            group = self.long_wait_group if long_wait else None
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return flag.item() == 1.0

def setup_distributed(args):
    """A Proc from torchrun's environment (or one process), its process group up."""
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.fsdp and not distributed:
        raise UsageError("--fsdp shards the model across processes: launch with torchrun")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(args.device)
    if args.fsdp and resolve_dtype(args.dtype, device) == "fp16":
        raise UsageError("--fsdp does not train in fp16: use --dtype bf16 or fp32")
    if distributed and device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s)"
                             f" here: ask torchrun for at most that many processes per node",
                             rank_specific=True)
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return Proc(distributed, rank(), local_rank, world_size, device)

def shard_model(raw_model, dtype):
    """FSDP2 on every block, then on the root (embeddings, tied lm_head, ln_f); in place."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy()
    if dtype == "bf16":  # bf16 compute and all-gathers, fp32 gradient reduction and master weights
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in raw_model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(raw_model, mp_policy=mp)

# ===== Evaluation: val loss, samples =====
@torch.no_grad()
def evaluate_loss(model, loader, n_tokens, device, autocast_ctx, world_size=1):
    """Mean loss over the first n_tokens targets of the split, all ranks together: the same tokens
    for any B and process count."""
    was_training = model.training
    model.eval()
    loader.reset()
    per_rank = loader.B * loader.T
    steps = math.ceil(n_tokens / (per_rank * loader.num_processes))
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of token losses, tokens)
    for _ in range(steps):
        start = loader.position + loader.process_rank * per_rank
        valid = max(0, min(per_rank, n_tokens - start))
        x, y = loader.next_batch()
        if valid < per_rank:  # targets past n_tokens: ignored
            y = y.clone()  # x and y are views of one buffer: masking y in place would corrupt x
            y.view(-1)[valid:] = -100  # F.cross_entropy's ignore_index
        x, y = x.to(device), y.to(device)
        with autocast_ctx:
            _, loss = model(x, y)
        if valid > 0:
            total[0] += loss.double() * valid
            total[1] += valid
    model.train(was_training)
    if world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total[0] / total[1]).item()

def encode_prompt(enc, text):
    """Token ids of a prompt; an empty prompt starts from <|endoftext|>, as a new document."""
    return enc.encode(text, allowed_special={"<|endoftext|>"}) or [EOT]

def decode_sample(enc, tokens, n_prompt):
    """The prompt and what follows up to <|endoftext|>, as text, blank lines squeezed."""
    new = tokens[n_prompt:]
    if EOT in new:
        new = new[: new.index(EOT)]
    text = enc.decode([t for t in tokens[:n_prompt] if t != EOT] + new)
    return re.sub(r"\n\s*\n", "\n", text).strip()

def sample_texts(model, enc, prompt, num_samples, max_new_tokens, device, autocast_ctx, seed,
                 **generate):
    """num_samples continuations of the text prompt, as text."""
    tokens = encode_prompt(enc, prompt)
    idx = torch.tensor([tokens] * num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with autocast_ctx:
        out = model.generate(idx, max_new_tokens, generator=generator, **generate)
    return [decode_sample(enc, row, len(tokens)) for row in out.tolist()]

def due(every, step, last_step=False):
    """Whether an every-N block (val, HellaSwag, samples, checkpoint) runs now."""
    return every > 0 and (last_step or step % every == 0)

# ===== Checkpoints: what one holds (rundir.py handles the files) =====
@dataclass
class TrainState:
    """Where a run stands, besides the weights, optimizer, loader and random generators."""
    step: int = -1  # the last optimizer step taken (and checkpointed); -1: none yet
    tokens_seen: int = 0  # train tokens consumed so far (for the batch-size ramp)
    val_loss: float | None = None  # the latest val loss
    args: dict | None = None  # the run's flags: a resume takes those not given again

def save_checkpoint(path, raw_model, optimizer, scaler, state, train_loader, keep_last, proc,
                    collective=True):
    """model_{step}.pt, all an exact resume needs. Every rank calls it (FSDP gathers), rank 0
    writes. collective=False, after a failure that may be this rank's alone: False if not saved."""
    from torch.distributed.checkpoint import state_dict as dcp
    # unsharded, on the CPU, keyed by parameter name: the same from a plain, DDP or FSDP model
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    checkpoint = {
        "model": dcp.get_model_state_dict(raw_model, options=options),
        "optimizer": dcp.get_optimizer_state_dict(raw_model, optimizer, options=options),
        "scaler": scaler.state_dict(),  # fp16's loss scale ({} in bf16 and fp32)
        "config": asdict(raw_model.config),
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "val_loss": state.val_loss,
        "loader": train_loader.state_dict(),  # where the next batch starts
        "rng": rundir.rng_state(),  # python, numpy, torch (and CUDA) generators
        "args": state.args,
        "provenance": rundir.provenance(proc.device),  # the code and machine
    }
    return rundir.write_checkpoint(path, checkpoint, keep_last, proc.master,
                                   proc.agree if collective else None)

def restore_checkpoint(ckpt, raw_model, optimizer, scaler, train_loader):
    """Load a checkpoint into the model (FSDP: each rank its shard), optimizer, loss scaler, loader
    and random generators; returns its TrainState."""
    from torch.distributed.checkpoint import state_dict as dcp
    options = dcp.StateDictOptions(full_state_dict=True)
    dcp.set_model_state_dict(raw_model, ckpt["model"], options=options)
    # the kernel choice belongs to this machine, and Muon's LR ratio to this invocation's flags
    kept = [{k: g[k] for k in ("fused", "foreach", "lr_scale") if k in g}
            for g in optimizer.param_groups]
    dcp.set_optimizer_state_dict(raw_model, optimizer, ckpt["optimizer"], options=options)
    for group, values in zip(optimizer.param_groups, kept):
        group.update(values)
    if ckpt.get("scaler"):  # saved in fp16 (from bf16: a new scale)
        scaler.load_state_dict(ckpt["scaler"])
    train_loader.load_state_dict(ckpt["loader"])
    rundir.set_rng_state(ckpt["rng"])
    return TrainState(ckpt["step"], ckpt["tokens_seen"], ckpt["val_loss"], ckpt["args"])

# ===== train(): the whole run =====
def train(args, ckpt=None):
    """One run, start to end; returns the exit status (0, or 128 + the signal that stopped it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    proc = setup_distributed(args)
    pretrained, config = None, model_config_from_args(args)
    if args.init_from:
        pretrained = GPT.from_pretrained(args.init_from, dropout=args.dropout)
        config = pretrained.config
    if ckpt is not None:
        config = GPTConfig(**ckpt["config"])

    autocast_ctx, dtype = autocast_for(args.dtype, proc.device_type)
    fit = {}
    if args.micro_batch_size == "auto":  # the largest B that fits
        args.micro_batch_size, fit = rundir.auto_micro_batch(
            lambda: GPT(config), lambda m: make_optimizer(m, args, proc.device_type), args,
            proc.device, proc.world_size, autocast_ctx, config.vocab_size, proc.agree)

    # each rank runs micro-steps of B*T tokens, accumulated into steps of total_batch_size
    B, T = args.micro_batch_size, args.sequence_length
    grad_accum_steps = rundir.accumulation_steps(args, proc.world_size, config.block_size)
    unit = B * T * proc.world_size  # tokens of a micro-step on all ranks
    val_tokens = args.val_tokens if args.val_steps is None else args.val_steps * unit
    end = rundir.end_step(args)  # the run stops before this step (--stop_step)
    use_compile = proc.device_type == "cuda" if args.compile is None else args.compile
    enable_tf32(proc.device_type)  # TF32 for fp32 matmuls
    enc = fineweb.get_encoding()
    if args.sample_every > 0:
        rundir.check_prompt_fits(len(encode_prompt(enc, args.sample_prompt)), args.sample_tokens,
                                 config.block_size, ("--sample_prompt", "--sample_tokens"),
                                 ": shorten them, or turn samples off with --sample_every 0")
    run_config = {**vars(args), "device": proc.device, "world_size": proc.world_size,
                  "grad_accum_steps": grad_accum_steps, "autocast_dtype": dtype,
                  "compile": use_compile, "val_tokens": val_tokens, **fit, "model": asdict(config),
                  "provenance": rundir.provenance(proc.device)}
    print0(rundir.format_run_config(run_config, RUN_SETTINGS))

    # one run per log dir (a lock, released however the run ends); stop signals caught
    claim = rundir.claim_log_dir(args, ckpt, run_config, proc.master, proc.agree)
    stop = rundir.StopSignals()  # SIGTERM, SIGINT, SIGUSR1: finish the step, save, exit
    state, step, last_saved, stopped_by = TrainState(args=vars(args)), None, -1, None
    try:
        # ---- the data, prepared on first use (by rank 0; the others wait)
        status = fineweb.ensure_prepared(
            args.data_root, train_tokens=args.max_steps * args.total_batch_size,
            val_tokens=val_tokens, name=args.fineweb_name, inputs=args.input,
            text_column=args.text_column, master=proc.master, agree=proc.agree, print0=print0,
            vocab_size=config.real_vocab_size)
        train_loader = DataLoaderLite(B, T, proc.rank, proc.world_size, "train", args.data_root,
                                      args.seed, config.real_vocab_size)
        val_loader = DataLoaderLite(B, T, proc.rank, proc.world_size, "val", args.data_root,
                                    args.seed, config.real_vocab_size)
        val_tokens = rundir.usable_val_tokens(args, status, train_loader.epoch_tokens,
                                              val_loader.epoch_tokens, val_tokens)

        # ---- the model (raw: unwrapped, uncompiled: for saving, HellaSwag, samples)
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)
        random.seed(args.seed)
        raw_model = (GPT(config) if pretrained is None else pretrained).to(proc.device)
        print0(f"model: {raw_model.get_num_params():,} parameters")
        if args.fsdp:
            shard_model(raw_model, dtype)
        optimizer = make_optimizer(raw_model, args, proc.device_type, verbose=proc.master)
        # fp16: the loss scaled up so that small gradients do not underflow
        scaler = torch.amp.GradScaler(proc.device_type, enabled=dtype == "fp16")
        if ckpt is not None:
            state = restore_checkpoint(ckpt, raw_model, optimizer, scaler, train_loader)
            state.args, last_saved, ckpt = vars(args), state.step, None  # free its tensors
            print0(f"resumed from {args.resume} at step {state.step + 1}")
        model = torch.compile(raw_model) if use_compile else raw_model
        ddp = proc.distributed and not args.fsdp  # FSDP reduce-scatters every micro-step
        if ddp:
            model = DDP(model, device_ids=[proc.local_rank] if proc.device_type == "cuda" else None)

        metrics = rundir.Metrics(args, proc.device, proc.world_size, state.step + 1, end, config,
                                 raw_model.get_num_params(non_embedding=True), run_config)
        profiler = rundir.Profiler(args, proc.device_type, proc.rank)
        hellaswag_on = args.hellaswag_every > 0 and hellaswag.ready_on_every_rank(proc.master,
                                                                                  proc.agree)

        # ============================== training ==============================
        for step in range(state.step + 1, args.max_steps + 1):
            stop.allow_interrupts(True)  # a stop signal from here on: at once
            last_step = step == args.max_steps  # the final model: evaluated, not trained
            if step == end and not last_step:
                break

            # once in a while: the val loss of the model after `step` updates
            if due(args.eval_every, step, last_step):
                state.val_loss = evaluate_loss(model, val_loader, val_tokens, proc.device,
                                               autocast_ctx, proc.world_size)
                print0(f"validation loss: {state.val_loss:.4f}")
                metrics.log(step, "val", state.val_loss)

            # once in a while: HellaSwag, on the raw model, split over the ranks
            if hellaswag_on and due(args.hellaswag_every, step, last_step):
                try:
                    res = hellaswag.evaluate(raw_model, proc.device, limit=args.hellaswag_limit,
                                             rank=proc.rank, world_size=proc.world_size,
                                             device_type=proc.device_type,
                                             autocast_dtype=torch_dtype(dtype))
                except hellaswag.HellaSwagUnavailable as e:  # the data went away
                    print0(f"warning: HellaSwag evaluation turned off: {e}")
                    hellaswag_on = False
                else:
                    print0(f"HellaSwag accuracy: {res['correct_norm']}/{res['n']}="
                           f"{res['acc_norm']:.4f}")
                    metrics.log(step, "hella", res["acc_norm"])

            # once in a while: samples, each rank with its own seed
            if step > 0 and due(args.sample_every, step, last_step):
                texts = sample_texts(raw_model, enc, args.sample_prompt, args.num_samples,
                                     args.sample_tokens, proc.device, autocast_ctx,
                                     args.seed + proc.rank, top_k=50)
                for i, text in enumerate(texts):
                    print(f"rank {proc.rank} sample {i}: {' '.join(text.split())}", flush=True)
            if last_step:
                break

            # one optimizer step: gradients accumulated over the micro-steps, clipped, applied
            stop.allow_interrupts(False)  # from here on: after this step, saved
            t0 = time.time()
            batch_size = batch_size_at(state.tokens_seen, args.batch_ramp_tokens,
                                       args.total_batch_size, unit, args.batch_ramp_start)
            micro_steps = batch_size // unit  # grad_accum_steps, fewer in a batch ramp
            optimizer.zero_grad(set_to_none=True)
            loss_accum = torch.zeros((), device=proc.device)
            for micro_step in range(micro_steps):
                x, y = train_loader.next_batch()
                x, y = x.to(proc.device), y.to(proc.device)
                if ddp:  # all-reduce the gradients once, on the last micro-step
                    model.require_backward_grad_sync = micro_step == micro_steps - 1
                with autocast_ctx:
                    _, loss = model(x, y)
                loss = loss / micro_steps  # a mean over B*T tokens each: their sum is the step's
                loss_accum += loss.detach()
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                  args.grad_clip or float("inf"))
            if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
                norm = norm.full_tensor()
            # one read-back a step: the loss (mean over ranks), the norm, whether all ranks go on
            go_on = torch.tensor(float(stop.signum is None), device=proc.device)
            if proc.world_size > 1:
                dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # gloo has no AVG: sum, divide
                loss_accum /= proc.world_size
                dist.all_reduce(go_on, op=dist.ReduceOp.MIN)
            loss_value, norm_value, go_on = torch.stack([loss_accum, norm.float(), go_on]).tolist()
            # fp16: inf or nan gradients skip the update and halve the scale (below 1: diverged)
            overflow = scaler.is_enabled() and not math.isfinite(norm_value)
            skipped = overflow and scaler.get_scale() >= 1
            if not (math.isfinite(loss_value) and (math.isfinite(norm_value) or skipped)):
                raise UsageError(rundir.divergence(loss_value, norm_value))
            lr = get_lr(step, args.max_lr, args.max_lr * args.min_lr_ratio, args.warmup_steps,
                        args.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's: --muon_lr / --max_lr
            scaler.step(optimizer)  # optimizer.step() unless skipped
            scaler.update()
            if proc.device_type == "cuda":
                torch.cuda.synchronize()  # dt: the GPU's work, not just the launches
            dt = time.time() - t0
            state.step, state.tokens_seen = step, state.tokens_seen + batch_size
            metrics.report_step(step, loss_value, lr, norm_value, dt, batch_size, skipped=skipped)
            if profiler.step():
                break  # --profile exit

            # a checkpoint every --save_every steps, at the end, and when a signal says stop
            if step == end - 1 or not go_on or (step > 0 and due(args.save_every, step)):
                path = rundir.checkpoint_path(args.log_dir, step)
                save_checkpoint(path, raw_model, optimizer, scaler, state, train_loader,
                                args.keep_last, proc)
                last_saved = step
                print0(f"saved {path}")
            if not go_on:
                stopped_by = stop.signum or signal.SIGTERM  # another rank's signal: the same exit
                print0(f"stopped by {signal.Signals(stopped_by).name} after step {step}: continue"
                       f" with python train_gpt2.py --resume latest --log_dir {args.log_dir}")
                break

        metrics.finish()  # W&B uploads: can fail after all
        last = rundir.checkpoint_path(args.log_dir, last_saved) if last_saved >= 0 else None
        print0(metrics.summary(last))
        if args.fsdp:
            raw_model.reshard()  # FSDP keeps the root's parameters gathered after an eval
        proc.agree(True)  # all ranks done with collectives before the process group goes
    except (Exception, rundir.Stopped) as e:
        if step is None:  # before the first step: nothing trained to keep
            raise
        # keep the last finished step, without a collective: the failure may be this rank's alone
        # (FSDP must gather its shards to save: its last checkpoint stays the newest)
        if state.step > last_saved and not (args.fsdp and proc.world_size > 1):
            if save_checkpoint(rundir.checkpoint_path(args.log_dir, state.step), raw_model,
                               optimizer, scaler, state, train_loader, args.keep_last, proc,
                               False):
                last_saved = state.step
        return rundir.report_failure(e, step, args.log_dir, last_saved)  # or raised
    finally:
        stop.restore()
        claim.close()
    if stopped_by is not None:
        return 128 + stopped_by
    return 0

# ===== The command line: training's flags, the sample / export / eval commands =====
def parse_args(argv=None):
    """The run's settings and the checkpoint it resumes (or None). A flag's value is the first of:
    the command line, the checkpoint (but not for THIS_INVOCATION), the preset, RUN_SETTINGS."""
    # a pre-pass for --preset alone: --help shows its defaults
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    shown_preset = pre.parse_known_args(argv)[0].preset
    if shown_preset not in MODEL_PRESETS:
        shown_preset = "gpt2"  # the real parse names a bad --preset
    shown = {**DEFAULTS, **RUN_PRESETS[shown_preset], **MODEL_PRESETS[shown_preset],
             "preset": shown_preset}
    given = vars(build_parser(shown).parse_args(argv))
    given = {k: v for k, v in given.items() if v is not None}

    settings = {**DEFAULTS, **RUN_PRESETS[given.get("preset", "gpt2")]}
    if "input" in given:  # local text is not FineWeb-Edu: it gets a folder of its own
        settings["data_root"] = fineweb.LOCAL_DATA_ROOT
    rundir.check_pairs(given)
    ckpt = None
    if "resume" in given:  # every flag not given again comes from the checkpoint
        log_dir = given.get("log_dir", settings["log_dir"])
        given["resume"], ckpt = rundir.find_resume_checkpoint(given["resume"], log_dir, print0)
        this_invocation = {flag_dest(entry[0]) for entry in RUN_SETTINGS[THIS_INVOCATION]}
        for k, v in ckpt["args"].items():
            if k in settings and k not in this_invocation:
                settings[k] = v
        if "val_tokens" in given:  # the same number two ways: the one given now wins
            settings["val_steps"] = None
    settings.update(given)
    args = argparse.Namespace(**settings)

    asked_shape = None
    if ckpt is not None:
        model_from_checkpoint(ckpt, args.resume, "meta")  # its config and weights agree
        asked_shape = asdict(model_config_from_args(args))
    for warning in rundir.check_flags(args, set(given), ckpt, SHAPE_FLAGS, asked_shape, get_lr):
        print0(f"warning: {warning}")
    return args, ckpt

CHECKPOINT = ("--checkpoint", None, str, "a model_*.pt written by training")
COMMAND_FLAGS = {  # the commands' meaning, then their flags
    "sample": ["text from a checkpoint or from OpenAI's GPT-2", *SHARED, CHECKPOINT,
               ("--prompt", "Hello, I'm a language model,", str, "text to continue"),
               ("--num_samples", 4, POSITIVE_INT, "independent samples"),
               ("--max_new_tokens", 64, POSITIVE_INT, "new tokens per sample"),
               ("--top_k", 50, POSITIVE_INT, "the k likeliest tokens (1: greedy)"),
               ("--temperature", 1.0, NONNEG, "softmax temperature (0: greedy)"),
               ("--seed", 1337, SEED, "sampling seed"),
               ("--no_kv_cache", False, {"action": "store_true"}, "recompute it all each token")],
    "export": ["a checkpoint as a transformers GPT2LMHeadModel directory",
               ("--checkpoint", None, {"required": True}, CHECKPOINT[3]),
               ("--out", None, {"required": True}, "a new (or empty) directory to write")],
    "eval": ["HellaSwag acc and acc_norm of a checkpoint or of OpenAI's GPT-2", *SHARED,
             CHECKPOINT,
             ("--limit", None, POSITIVE_INT, "only the first N examples"),
             ("--batch_tokens", 8192, NONNEG_INT, "tokens a pass (0: one example)"),
             ("--hellaswag_dir", None, str, "folder of hellaswag_val.jsonl, if not hellaswag.py's"),
             ("--data_dir", None, {"dest": "hellaswag_dir", "help": argparse.SUPPRESS}, "")],
}

def build_parser(shown=DEFAULTS, command=None):
    """The parser of the training flags (RUN_SETTINGS group by group), or of a command's."""
    if command is not None:
        meaning, *flags = COMMAND_FLAGS[command]
        p = OneLineParser(prog=f"train_gpt2.py {command}", description=f"{command}: {meaning}")
        add_flags(p, flags)
        return p
    commands = "\n".join(f"  {c:8} {flags[0]}" for c, flags in COMMAND_FLAGS.items())
    commands += "\n  plan     the run these flags make (memory, compute, time); nothing written"
    p = OneLineParser(prog="train_gpt2.py", formatter_class=argparse.RawDescriptionHelpFormatter,
                      usage="%(prog)s [plan] [flags]  |  %(prog)s {sample,export,eval} [flags]",
                      description="Pretrain GPT-2 on FineWeb-Edu shards, on one GPU or under "
                                  f"torchrun.\n\ncommands (COMMAND --help):\n{commands}")
    for title, entries in RUN_SETTINGS.items():
        add_flags(p.add_argument_group(title), entries, shown)
    return p

def model_from_checkpoint(ckpt, path, device="cpu"):
    """The GPT a checkpoint holds, in fp32 (a UsageError if its config and weights disagree)."""
    return rundir.model_from_checkpoint(ckpt, path, lambda c: GPT(GPTConfig(**c)), device)

def model_for_command(args):
    """(GPT in eval mode, device, autocast, dtype name) of --checkpoint or --init_from."""
    if (args.checkpoint is None) == (args.init_from is None):
        raise UsageError("give one of --checkpoint (a model_*.pt) or --init_from (OpenAI's GPT-2)")
    device = resolve_device(args.device)
    if args.checkpoint:
        model = model_from_checkpoint(rundir.open_checkpoint(args.checkpoint), args.checkpoint)
    else:
        model = GPT.from_pretrained(args.init_from)
    ctx, dtype = autocast_for(args.dtype, device)
    return model.to(device).eval(), device, ctx, dtype

def sample_main(args):
    model, device, ctx, _ = model_for_command(args)
    enc = fineweb.get_encoding()
    rundir.check_prompt_fits(len(encode_prompt(enc, args.prompt)), args.max_new_tokens,
                             model.config.block_size, ("--prompt", "--max_new_tokens"))
    texts = sample_texts(model, enc, args.prompt, args.num_samples, args.max_new_tokens, device,
                         ctx, args.seed, temperature=args.temperature, top_k=args.top_k,
                         use_cache=not args.no_kv_cache)
    for i, text in enumerate(texts):
        print(f"--- sample {i}\n{text}")
    return 0

def export_main(args):
    ckpt = rundir.open_checkpoint(args.checkpoint)
    write_new_dir(args.out, "--out",
                  lambda tmp: rundir.export_hf(model_from_checkpoint(ckpt, args.checkpoint), tmp))
    print(f"wrote {args.out}: GPT2LMHeadModel.from_pretrained({args.out!r}) loads it")
    return 0

def eval_main(args):
    model, device, _, dtype = model_for_command(args)  # a bad checkpoint: before a download
    hellaswag.download("val", args.hellaswag_dir)
    t0 = time.perf_counter()
    res = hellaswag.evaluate(model, device, limit=args.limit, batch_tokens=args.batch_tokens,
                             data_dir=args.hellaswag_dir, progress=True,
                             autocast_dtype=torch_dtype(dtype))
    seconds = time.perf_counter() - t0
    print(hellaswag.summary(args.checkpoint or args.init_from, device, dtype, "val", res, seconds))
    return 0

def plan_main(args, ckpt=None):
    """What a run with these flags would take, worked out without writing anything."""
    config = model_config_from_args(args)
    if args.init_from in MODEL_PRESETS:
        config = GPTConfig(**MODEL_PRESETS[args.init_from])
    if ckpt is not None:
        config = GPTConfig(**ckpt["config"])
    device = resolve_device(args.device)
    autocast_ctx, dtype = autocast_for(args.dtype, device)
    print0(rundir.plan(args, RUN_SETTINGS, config, lambda: GPT(config),
                       lambda m: make_optimizer(m, args, device_type_of(device)), device,
                       autocast_ctx, dtype))
    return 0

COMMANDS = {"sample": sample_main, "export": export_main, "eval": eval_main}

def run(argv):
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](build_parser(command=argv[0]).parse_args(argv[1:]))
    if argv and argv[0] == "plan":  # the training flags
        return plan_main(*parse_args(argv[1:]))
    return train(*parse_args(argv))

def main(argv=None):
    """The exit status of a command or a run; what a user can fix is one error line."""
    try:
        return run_cli(run, sys.argv[1:] if argv is None else list(argv))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

if __name__ == "__main__":
    exit_process(main())
