"""
GPT-2 (124M) pretraining on FineWeb-Edu token shards, in one flat, importable file.

    python train_gpt2.py --preset tiny                          # a ~7M-parameter demo on a laptop CPU
    python train_gpt2.py                                        # the GPT-2 124M recipe on one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py      # the same recipe on a node of 8 GPUs
    python train_gpt2.py sample|export|eval --help              # use a checkpoint

Read top to bottom: the config, the model, the data loader, optimizers and schedules, distributed set-up,
evaluation, then `train()`, the whole run in one function; after it, under a banner, the machinery a first
reading can skip (checkpoint files, log.txt, flag checks, reporting, the CLI). Importing it runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fineweb
import hellaswag
from fineweb import (EOT, GPT2_VOCAB_SIZE, NONNEG, NONNEG_INT, POSITIVE, POSITIVE_INT, HelpFormatter,
                     OneLineParser, UsageError, atomic_write, bounded, list_shards, one_line)
from hellaswag import autocast_for, resolve_device  # --device and --dtype, shared with hellaswag.py's CLI

# ===== Config and presets ===================================================================================
@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the position embedding covers
    vocab_size: int = 50304  # embedding rows: 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    real_vocab_size: int = GPT2_VOCAB_SIZE  # ids >= this are padding and are never predicted
    n_kv_head: int | None = None  # key/value heads: n_head (None) is GPT-2's MHA, fewer is GQA, 1 is MQA
    dropout: float = 0.0  # attention, residual and embedding dropout, in training only
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2

    def __post_init__(self):
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        if min(self.block_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError("block_size, n_layer, n_head and n_embd must be positive")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout ({self.dropout}) must be in [0, 1)")
        if not 0 < self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"real_vocab_size ({self.real_vocab_size}) must be in 1..{self.vocab_size}")

# Named model shapes (GPT-2 paper, Table 2) plus a CPU-sized one for tests and demos.
MODEL_PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),  # ~7M, mostly the embedding
}
SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "n_kv_head", "bias")

# Run settings a preset changes; everything else keeps the parser's defaults. The larger GPT-2 shapes take
# the GPT-3 paper's (Table 2.1) learning rate for the nearest size and a micro batch that fits 80 GB.
RUN_PRESETS = {
    "gpt2": {},
    "gpt2-medium": dict(max_lr=3e-4, micro_batch_size=32),
    "gpt2-large": dict(max_lr=2.5e-4, micro_batch_size=16),
    "gpt2-xl": dict(max_lr=2e-4, micro_batch_size=8),
    # the CPU demo: ~300k tokens, about 5 minutes at ~1k tokens/s (2 cores); val and samples every 50 steps
    "tiny": dict(max_lr=2e-3, warmup_steps=15, max_steps=150, total_batch_size=2048, micro_batch_size=8,
                 sequence_length=256, eval_every=50, val_tokens=16384, sample_every=50, hellaswag_every=0,
                 save_every=0, data_root=os.path.join(fineweb.REPO_DIR, "edu_fineweb_tiny")),
}

# ===== The model ============================================================================================
class KVCache:
    """Keys and values (n_layer, B, n_kv_head, max_len, hs) of the tokens so far; `pos` of them are filled."""

    def __init__(self, config: GPTConfig, batch_size, max_len, device, dtype):
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, hs)
        self.k, self.v = (torch.zeros(shape, device=device, dtype=dtype) for _ in range(2))
        self.pos = 0

    def update(self, layer, k, v):
        """Store k, v (B, nkv, T, hs) after the filled positions; returns all keys and values so far."""
        T = k.size(2)
        self.k[layer, :, :, self.pos: self.pos + T] = k
        self.v[layer, :, :, self.pos: self.pos + T] = v
        return self.k[layer, :, :, : self.pos + T], self.v[layer, :, :, : self.pos + T]

class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx=0):
        super().__init__()
        self.n_head, self.n_kv_head, self.hs = config.n_head, config.n_kv_head, config.n_embd // config.n_head
        self.layer_idx, self.dropout = layer_idx, config.dropout
        # q for all heads and k, v for the n_kv_head key/value heads, in one matmul
        qkv = (config.n_head + 2 * config.n_kv_head) * self.hs
        self.c_attn = nn.Linear(config.n_embd, qkv, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # writes into the residual stream
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
                    mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        extra = {"enable_gqa": True} if nkv != nh else {}  # groups of nh/nkv query heads share a k, v head
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           dropout_p=self.dropout if self.training else 0.0, **extra)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
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
        # 0 for real tokens, -inf for padding ids, added in the lm_head matmul: padding is never sampled,
        # never an argmax, never in a softmax's share. A buffer, not a parameter: the state dict stays GPT-2's
        vocab_mask = torch.where(torch.arange(config.vocab_size) < config.real_vocab_size, 0.0, float("-inf"))
        self.register_buffer("vocab_mask", vocab_mask, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            # each block adds two projections to the residual stream: scaled down, its variance stays put
            scale = (2 * self.config.n_layer) ** -0.5 if getattr(module, "RESIDUAL_SCALE_INIT", 0) else 1.0
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02 * scale)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=False):
        """Parameter count (the tied wte/lm_head once); non_embedding=True also leaves out wpe."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, kv_cache=None, logits_to_keep=0):
        """idx (B, T) token ids -> logits (B, T, vocab_size) and the mean cross-entropy vs targets (or None).
        With a kv_cache, idx continues the cached sequence. logits_to_keep as transformers' GPT2LMHeadModel: 0
        keeps every position, k > 0 the last k, a 1-D tensor those positions (scoring and generation need few,
        and the vocab matmul is most of a small model's work)."""
        B, T = idx.size()
        past = kv_cache.pos if kv_cache is not None else 0
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(past, past + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        if not isinstance(logits_to_keep, int) or logits_to_keep > 0:
            if targets is not None:
                raise ValueError("targets need the logits of every position: leave logits_to_keep at 0")
            x = x[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else x[:, logits_to_keep]
        x = self.transformer.ln_f(x)
        if torch.is_grad_enabled():
            # -inf inside the matmul: no in-place write, whose backward would copy the logits' gradient
            logits = F.linear(x, self.lm_head.weight, self.vocab_mask)  # (B, T, vocab_size)
        else:  # no autograd: writing the padding columns in place is cheaper than adding a bias everywhere
            logits = self.lm_head(x)
            logits[..., self.config.real_vocab_size:] = float("-inf")
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """OpenAI GPT-2 weights through transformers: a hub name (gpt2 .. gpt2-xl) or a save_pretrained dir,
        the vocab padded to a multiple of 64 (50257 -> 50304) with zero (and masked) rows."""
        from transformers import GPT2LMHeadModel
        try:
            hf = GPT2LMHeadModel.from_pretrained(name_or_dir)
        except OSError as e:  # offline, unknown name, or not a model directory
            raise UsageError(f"could not load GPT-2 weights {name_or_dir!r} ({one_line(e, 160)}); offline, "
                             f"pass a local directory written by GPT2LMHeadModel.save_pretrained") from None
        hc = hf.config
        odd = [k for k in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn") if getattr(hc, k, 0)]
        if odd or hc.activation_function != "gelu_new" or hc.layer_norm_epsilon != 1e-5 \
                or hc.n_inner not in (None, 4 * hc.n_embd):
            raise ValueError(f"{name_or_dir}: not a standard GPT-2 architecture "
                             f"(activation, MLP width or attention options differ)")
        padded_vocab = -(-hc.vocab_size // 64) * 64
        config = GPTConfig(block_size=hc.n_positions, vocab_size=padded_vocab, n_layer=hc.n_layer,
                           n_head=hc.n_head, n_embd=hc.n_embd, real_vocab_size=hc.vocab_size, dropout=dropout)
        sd = {}
        for k, v in hf.state_dict().items():
            if k.endswith(CONV1D_WEIGHTS):
                v = v.t()  # HF's Conv1D is (in, out); nn.Linear wants (out, in)
            if k in ("transformer.wte.weight", "lm_head.weight"):  # zero padding rows: they are masked anyway
                v = F.pad(v, (0, 0, 0, padded_vocab - hc.vocab_size))
            sd[k] = v
        model = cls(config)
        try:
            model.load_state_dict(sd)  # strict: GPT-2's names and shapes, one to one
        except RuntimeError as e:
            raise ValueError(f"{name_or_dir}: not GPT-2's parameters ({one_line(e, 200)})") from None
        return model

    def configure_optimizers(self, weight_decay, learning_rate, device_type, verbose=True, muon=None):
        """AdamW with decay on matmul weights and embeddings (dim >= 2) only, never biases or LayerNorm. muon
        (make_muon's keyword arguments, or None): the blocks' 2-D weights go to torch.optim.Muon instead, and
        the two come back as one CombinedOptimizer."""
        # Muon's share: the 2-D weights inside the transformer blocks (attention and MLP matmuls)
        matrices = [p for p in self.transformer.h.parameters() if p.requires_grad and p.dim() == 2] \
            if muon is not None else []
        taken = {id(p) for p in matrices}
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in taken]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if verbose:
            for what, ps in (("decayed parameter tensors", decay), ("non-decayed parameter tensors",
                             no_decay), ("Muon matrices", matrices))[: 2 if muon is None else 3]:
                print(f"{what}: {len(ps)}, with {sum(p.numel() for p in ps):,} parameters")
        fused = device_type == "cuda"  # one kernel for the whole update instead of one per tensor
        adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        if muon is None:
            return adamw
        return CombinedOptimizer({"adamw": adamw,
                                  "muon": make_muon(matrices, weight_decay, learning_rate, **muon)})

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None, use_cache=True):
        """The prompt idx (B, T0) and max_new_tokens tokens sampled after it (greedy if top_k=1 or T=0), in
        eval mode. The KV cache runs the prompt once, then one token a step; without it the whole sequence
        is recomputed every step (the reference the cache is tested against)."""
        B, T0 = idx.size()
        if T0 + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"block_size {self.config.block_size}")
        was_training = self.training
        self.eval()
        dtype = torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type) \
            else self.lm_head.weight.dtype
        cache = KVCache(self.config, B, T0 + max_new_tokens, idx.device, dtype) if use_cache else None
        logits, _ = self(idx, kv_cache=cache, logits_to_keep=1)  # prefill
        for i in range(max_new_tokens):
            nxt = sample_next(logits[:, -1, : self.config.real_vocab_size], temperature, top_k, generator)
            idx = torch.cat((idx, nxt), dim=1)
            if i < max_new_tokens - 1:
                logits, _ = self(nxt, kv_cache=cache, logits_to_keep=1) if use_cache else \
                    self(idx, logits_to_keep=1)
        self.train(was_training)
        return idx

def sample_next(logits, temperature=1.0, top_k=50, generator=None):
    """One token id per row of logits (B, V): top-k sampling at a temperature; greedy for top_k=1 or T=0."""
    logits = logits.float()
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.size(-1):
        v, ix = torch.topk(logits, top_k, dim=-1)
        return torch.gather(ix, -1, torch.multinomial(F.softmax(v, dim=-1), 1, generator=generator))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)

# the matmul weights that transformers' GPT-2 keeps as Conv1D, (in, out): transposed on import and export
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

def export_hf(model, out_dir):
    """Write model as a transformers GPT2LMHeadModel directory (config.json + safetensors), vocab unpadded."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.config
    if not c.bias or c.n_kv_head != c.n_head:
        raise UsageError("only GPT-2's architecture exports to GPT2LMHeadModel: this model has "
                         + ("no biases" if not c.bias else f"n_kv_head {c.n_kv_head} != n_head {c.n_head}"))
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=c.real_vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=c.dropout,
        embd_pdrop=c.dropout, attn_pdrop=c.dropout, bos_token_id=EOT, eos_token_id=EOT,
        tie_word_embeddings=True))
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        if k.endswith(CONV1D_WEIGHTS):
            v = v.t()
        if k in ("transformer.wte.weight", "lm_head.weight"):
            v = v[: c.real_vocab_size]
        sd[k] = v.contiguous()
    hf.load_state_dict(sd, strict=True)
    hf.save_pretrained(out_dir)
    return hf

def flops_per_token(config: GPTConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: 6N + 12·L·H·Q·T (PaLM, appendix B). n_params leaves
    out wpe (a lookup) and counts the tied wte/lm_head once; 12·L·H·Q·T are the attention matmuls."""
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, seq_len
    return 6 * n_params + 12 * L * H * Q * T

# Peak dense bf16 FLOP/s (half NVIDIA's with-sparsity figures), matched in order as substrings of the device
# name: SXM parts have no form factor in theirs, so NVL and PCIe come first. Other GPUs: --peak_flops.
PEAK_BF16_FLOPS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200 NVL", 835e12),
                   ("H200", 989e12), ("A100", 312e12)]

def peak_flops(device_name: str):
    """Peak dense bf16 FLOP/s of a GPU named like torch.cuda.get_device_name(), or None if unknown."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key.casefold() in device_name.casefold()), None)

# ===== Data loader: uint16 token shards written by fineweb.py ===============================================
class DataLoaderLite:
    """Batches (x, y) of shape (B, T) from the `*_{split}_NNNNNN.npy` shards in data_root, memory-mapped.

    A split is one endless stream of tokens: its shards in order, then (train only) again in an order drawn
    from a seeded RNG at each epoch. Rank r reads window r of each group of num_processes windows of B*T
    (+1) tokens; a window that reaches a shard's end goes on into the next. The position is one number, so
    the batches are the same for any number of processes, and `state_dict()` resumes exactly."""

    def __init__(self, B, T, process_rank=0, num_processes=1, split="train",
                 data_root=fineweb.DEFAULT_DATA_ROOT, seed=1337, vocab_size=GPT2_VOCAB_SIZE):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        self.B, self.T, self.split, self.seed = B, T, split, seed
        self.process_rank, self.num_processes = process_rank, num_processes
        self.shards = list_shards(data_root, split)
        if not self.shards:
            raise UsageError(f"no {split} shards (*_{split}_NNNNNN.npy) in {data_root}: "
                             f"prepare them with `python fineweb.py` (see --help there)", rank_specific=True)
        try:  # header, size, dtype and every token id < vocab_size, checked once: one line naming the file
            self.tokens = [fineweb.open_shard(path, vocab_size) for path in self.shards]
        except fineweb.ShardError as e:
            raise UsageError(str(e), rank_specific=True) from None
        self.lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)
        self.epoch_tokens = int(self.lengths.sum())
        if self.epoch_tokens < B * T + 1:
            raise UsageError(f"the {split} shards in {data_root} hold {self.epoch_tokens} tokens, "
                             f"fewer than one batch of B*T+1 = {B * T + 1}")
        self._epoch = (None,)
        self.reset()

    def reset(self):
        self.position = 0  # stream offset of this step's first window (the same on every rank)

    def state_dict(self):
        return {"position": self.position, "split": self.split, "seed": self.seed,
                "num_shards": len(self.shards), "epoch_tokens": self.epoch_tokens}

    def load_state_dict(self, state):
        if (state["num_shards"], state["epoch_tokens"]) != (len(self.shards), self.epoch_tokens):
            raise UsageError(f"the {self.split} shards changed since the checkpoint was written "
                             f"({state['num_shards']} shards / {state['epoch_tokens']} tokens then, "
                             f"{len(self.shards)} / {self.epoch_tokens} now)")
        self.seed, self.position = state["seed"], state["position"]

    def _order(self, epoch):
        """Shard order of an epoch and the cumulative token offsets of that order."""
        if self._epoch[0] != (self.seed, epoch):  # the stream only moves forward: one epoch's order kept
            n, shuffled = len(self.shards), self.split == "train" and epoch > 0
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if shuffled else np.arange(n)
            self._epoch = ((self.seed, epoch), order, np.concatenate([[0], np.cumsum(self.lengths[order])]))
        return self._epoch[1:]

    def _read(self, start, n):
        """n tokens of the stream from offset start, as int64, across shard and epoch boundaries."""
        pieces = []
        while n > 0:
            epoch, offset = divmod(start, self.epoch_tokens)
            order, starts = self._order(epoch)
            i = int(np.searchsorted(starts, offset, side="right")) - 1
            local = offset - int(starts[i])
            take = min(n, int(self.lengths[order[i]]) - local)
            pieces.append(self.tokens[order[i]][local: local + take])
            start, n = start + take, n - take
        window = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return torch.from_numpy(window.astype(np.int64))  # the only copy of a memory-mapped window

    def next_batch(self):
        B, T = self.B, self.T
        buf = self._read(self.position + self.process_rank * B * T, B * T + 1)
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)  # inputs, and targets: the next token of each
        self.position += B * T * self.num_processes
        return x, y

# ===== Optimizers and schedules: AdamW (GPT-2's recipe) or Muon + AdamW; the LR and the batch-size ramp =====
def make_muon(matrices, weight_decay, max_lr, lr=None, momentum=0.95, ns_steps=5,
              adjust_lr_fn="match_rms_adamw"):
    """torch.optim.Muon over `matrices`, decoupled weight decay as AdamW's. match_rms_adamw puts its lr on
    AdamW's scale, so one schedule drives both: a group's LR is the scheduled one times its lr_scale."""
    lr = max_lr if lr is None else lr
    return torch.optim.Muon([{"params": matrices, "lr_scale": lr / max_lr}], lr=lr, weight_decay=weight_decay,
                            momentum=momentum, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)

class CombinedOptimizer:
    """Optimizers over disjoint parameters used as one; a checkpoint keeps each part's state by its name."""

    def __init__(self, parts):
        self.parts = parts

    @property
    def param_groups(self):
        return [group for opt in self.parts.values() for group in opt.param_groups]

    def zero_grad(self, set_to_none=True):
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def step(self):
        for opt in self.parts.values():
            opt.step()

def get_lr(step, max_lr, min_lr, warmup_steps, max_steps):
    """Linear warmup to max_lr over warmup_steps, cosine decay to min_lr at max_steps, constant after."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    ratio = (step - warmup_steps) / (max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)

def batch_size_at(tokens_seen, ramp_tokens, total_batch_size, unit, start=32768):
    """GPT-3's ramp: tokens in the next step, linear from `start` to total over the first ramp_tokens,
    rounded down to a multiple of unit = B*T*world_size (one micro-step on every rank), at least one unit."""
    if ramp_tokens <= 0 or tokens_seen >= ramp_tokens:
        return total_batch_size
    start = min(start, total_batch_size)
    size = start + (total_batch_size - start) * tokens_seen / ramp_tokens
    return max(unit, int(size) // unit * unit)

# ===== Distributed: this process's place in the run, FSDP ===================================================
@dataclass
class Proc:
    """This process in the run (torchrun's RANK, LOCAL_RANK, WORLD_SIZE) and its device."""
    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    device: str
    _long_wait_group: object = None

    def __post_init__(self):
        self.master = self.rank == 0
        self.device_type = self.device.split(":")[0]  # for autocast, fused AdamW: 'cuda', never 'cuda:3'

    def print0(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs, flush=True)

    def agree(self, ok, long_wait=False):
        """True when ok is true on every rank; also a barrier. long_wait: on a gloo group that waits 48 h."""
        flag = torch.tensor(1.0 if ok else 0.0, device="cpu" if long_wait else self.device)
        if self.world_size > 1:
            if long_wait and self._long_wait_group is None:  # data prep takes hours, past NCCL's timeout
                self._long_wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=48))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._long_wait_group if long_wait else None)
        return flag.item() == 1.0

def setup_distributed(args):
    """A Proc from torchrun's environment (one process without it), with the process group started."""
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.fsdp and not ddp:
        raise UsageError("--fsdp shards the model across processes: launch with torchrun")
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(args.device)
    if ddp and device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) here: "
                             f"ask torchrun for at most that many processes per node", rank_specific=True)
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return Proc(ddp, rank, local_rank, world_size, device)

def shard_model(raw_model, use_bf16):
    """FSDP2 on every block and then the root (embeddings, tied lm_head, ln_f); in place."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    # bf16 compute and all-gathers, fp32 gradient reduction and master weights
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if use_bf16 else None,
                              reduce_dtype=torch.float32 if use_bf16 else None)
    for block in raw_model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(raw_model, mp_policy=mp)

# ===== Evaluation: val loss, HellaSwag, samples =============================================================
@torch.no_grad()
def evaluate_loss(model, loader, n_tokens, device, autocast_ctx, world_size=1):
    """Mean loss over the first n_tokens targets of the loader's split, all ranks together: the same tokens
    for any B and process count (targets past n_tokens are ignored), the same passes on every rank."""
    was_training = model.training
    model.eval()
    loader.reset()
    per_rank = loader.B * loader.T
    steps = -(-n_tokens // (per_rank * loader.num_processes))
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of token losses, token count)
    for _ in range(steps):
        start = loader.position + loader.process_rank * per_rank
        valid = max(0, min(per_rank, n_tokens - start))
        x, y = loader.next_batch()
        if valid < per_rank:
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
    """Token ids of a prompt; an empty prompt starts from <|endoftext|>, as a new document would."""
    return enc.encode(text, allowed_special={"<|endoftext|>"}) or [EOT]

def decode_sample(enc, tokens, n_prompt):
    """A sample as text: the prompt and what follows up to the first <|endoftext|>, blank lines squeezed."""
    new = tokens[n_prompt:]
    if EOT in new:
        new = new[: new.index(EOT)]
    text = enc.decode([t for t in tokens[:n_prompt] if t != EOT] + new)
    return re.sub(r"\n\s*\n", "\n", text).strip()

def sample_texts(model, enc, prompt, num_samples, max_new_tokens, device, autocast_ctx, seed, **generate):
    """num_samples continuations of the text prompt, as text."""
    tokens = encode_prompt(enc, prompt)
    idx = torch.tensor([tokens] * num_samples, dtype=torch.long, device=device)
    with autocast_ctx:
        out = model.generate(idx, max_new_tokens, generator=torch.Generator(device=device).manual_seed(seed),
                             **generate)
    return [decode_sample(enc, row, len(tokens)) for row in out.tolist()]

# ===== train(): the whole run, from the flags to the last checkpoint ========================================
def train(args):
    """One training run, start to end; returns the exit status (0, or 128 + the signal that stopped it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    proc = setup_distributed(args)
    # the checkpoint resumed (parse_args found it, and checked its weights)
    ckpt = read_checkpoint(args.resume, keys=CKPT_KEYS, check_weights=False) if args.resume else None
    for warning in check_flags(args, ckpt):
        proc.print0(f"warning: {warning}")
    pretrained = GPT.from_pretrained(args.init_from, dropout=args.dropout) if args.init_from else None
    config = GPTConfig(**ckpt["config"]) if ckpt is not None else \
        pretrained.config if pretrained is not None else model_config_from_args(args)
    # each rank runs micro-steps of B*T tokens, accumulated into optimizer steps of total_batch_size tokens
    B, T = args.micro_batch_size, args.sequence_length
    unit = B * T * proc.world_size  # tokens of one micro-step, all ranks together
    grad_accum_steps = check_batch(args, proc.world_size, config.block_size)
    val_tokens = args.val_steps * unit if args.val_steps is not None else args.val_tokens
    end = end_step(args)  # the run stops before this step: --max_steps, or --stop_step if sooner
    autocast_ctx, use_bf16 = autocast_for(args.dtype, proc.device_type)
    use_compile = args.compile if args.compile is not None else proc.device_type == "cuda"
    hellaswag.enable_tf32(proc.device_type)  # TF32 for the fp32 matmuls that remain
    enc = sample_tokenizer(args, config.block_size)
    run_config = {**run_flags(args), "device": proc.device, "world_size": proc.world_size,
                  "grad_accum_steps": grad_accum_steps, "bf16": use_bf16, "compile": use_compile,
                  "val_tokens": val_tokens, "model": asdict(config)}
    proc.print0(format_run_config(run_config))

    with claim_log_dir(args, ckpt["step"] if ckpt else None, proc, run_config):  # one run per dir, locked
        # ---- data: shards prepared on first use (by rank 0; the others wait), one loader per split
        fineweb.ensure_prepared(args.data_root, train_tokens=args.max_steps * args.total_batch_size,
                                val_tokens=val_tokens, name=args.fineweb_name, inputs=args.input,
                                text_column=args.text_column, inputs_given="input" in args.given,
                                master=proc.master, agree=proc.agree, print0=proc.print0,
                                vocab_size=config.real_vocab_size)
        train_loader, val_loader = (DataLoaderLite(B, T, proc.rank, proc.world_size, split, args.data_root,
                                                   args.seed, config.real_vocab_size)
                                    for split in ("train", "val"))
        val_tokens = check_data_size(args, train_loader, val_loader, val_tokens, proc.print0)

        # ---- the model (raw: unwrapped and uncompiled, for saving, HellaSwag and samples) and its optimizer
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)
        random.seed(args.seed)
        raw_model = (pretrained if pretrained is not None else GPT(config)).to(proc.device)
        proc.print0(f"model: {raw_model.get_num_params():,} parameters")
        if args.fsdp:
            shard_model(raw_model, use_bf16)
        muon = dict(lr=args.muon_lr, momentum=args.muon_momentum, ns_steps=args.muon_ns_steps,
                    adjust_lr_fn=args.muon_adjust_lr) if args.optimizer == "muon" else None
        optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, proc.device_type,
                                                   verbose=proc.master, muon=muon)
        state = TrainState()  # where the run stands: what a checkpoint holds besides the weights
        if ckpt is not None:
            state = restore_checkpoint(ckpt, raw_model, optimizer, train_loader)
            proc.print0(f"resumed from {args.resume} at step {state.step + 1}")
            ckpt = None  # the weights live in the model now
        state.args = run_flags(args)
        model = torch.compile(raw_model) if use_compile else raw_model
        ddp = proc.ddp and not args.fsdp  # FSDP reduce-scatters every micro-step to keep gradients sharded
        if ddp:
            model = DDP(model, device_ids=[proc.local_rank] if proc.device_type == "cuda" else None)

        metrics = Metrics(args, proc, raw_model, run_config, state.step + 1, end)  # step line, log.txt, W&B
        profiler = Profiler(args, proc) if args.profile else None
        hellaswag_on = args.hellaswag_every > 0 and hellaswag.ready_on_every_rank(proc.master, proc.agree)
        last_saved = state.step

        def save():  # every rank calls it: FSDP gathers the shards
            nonlocal last_saved
            path = checkpoint_path(args.log_dir, state.step)
            save_checkpoint(path, raw_model, optimizer, state, train_loader, proc, args.keep_last)
            last_saved = state.step
            proc.print0(f"saved {path}")

        def keep_last_step():  # after a failure, maybe this rank's alone: no collective (FSDP cannot save)
            if last_saved == state.step or (args.fsdp and proc.world_size > 1):
                return checkpoint_path(args.log_dir, last_saved) if last_saved >= 0 else None
            path = checkpoint_path(args.log_dir, state.step)
            save_checkpoint(path, raw_model, optimizer, state, train_loader, proc, args.keep_last, False)
            return path

        # ============================== training ==============================
        stopped_by = None
        with StopSignals() as stop:
            for step in range(state.step + 1, args.max_steps + 1):
                last_step = step == args.max_steps  # not trained: the final model is only evaluated
                if step == end and not last_step:
                    break

                # the model after `step` updates: val loss, HellaSwag, samples; all of them at the end
                def due(every):
                    return every > 0 and (last_step or step % every == 0)

                with saving_on_error("final evaluation" if last_step else "evaluation", step, keep_last_step):
                    if due(args.eval_every):
                        state.val_loss = evaluate_loss(model, val_loader, val_tokens, proc.device,
                                                       autocast_ctx, proc.world_size)
                        proc.print0(f"validation loss: {state.val_loss:.4f}")
                        metrics.log(step, "val", state.val_loss)
                    if hellaswag_on and due(args.hellaswag_every):
                        try:  # the raw model, its examples split over the ranks
                            res = hellaswag.evaluate(raw_model, proc.device, limit=args.hellaswag_limit,
                                                     rank=proc.rank, world_size=proc.world_size,
                                                     device_type=proc.device_type,
                                                     autocast_dtype=torch.bfloat16 if use_bf16 else None)
                            proc.print0(f"HellaSwag accuracy: {res['correct_norm']}/{res['n']}"
                                        f"={res['acc_norm']:.4f}")
                            metrics.log(step, "hella", res["acc_norm"])
                        except hellaswag.HellaSwagUnavailable as e:  # the data went away: off from now on
                            proc.print0(f"warning: HellaSwag evaluation turned off: {e}")
                            hellaswag_on = False
                    if step > 0 and due(args.sample_every):  # from each rank, with its own seed
                        texts = sample_texts(raw_model, enc, args.sample_prompt, args.num_samples,
                                             args.sample_tokens, proc.device, autocast_ctx,
                                             args.seed + proc.rank, top_k=50)
                        for i, text in enumerate(texts):
                            print(f"rank {proc.rank} sample {i}: {' '.join(text.split())}", flush=True)
                if last_step:
                    break

                # one optimizer step: gradients accumulated over the micro-steps, clipped, applied at the LR
                t0 = time.time()
                batch_size = batch_size_at(state.tokens_seen, args.batch_ramp_tokens, args.total_batch_size,
                                           unit, args.batch_ramp_start)
                micro_steps = batch_size // unit  # grad_accum_steps, or fewer during a batch ramp
                optimizer.zero_grad(set_to_none=True)
                loss_accum = torch.zeros((), device=proc.device)
                for micro_step in range(micro_steps):
                    x, y = train_loader.next_batch()
                    x, y = x.to(proc.device, non_blocking=True), y.to(proc.device, non_blocking=True)
                    if ddp:  # all-reduce the gradients once, on the last micro-step
                        model.require_backward_grad_sync = micro_step == micro_steps - 1
                    with autocast_ctx:
                        _, loss = model(x, y)
                    loss = loss / micro_steps  # a mean over B*T tokens each: their sum is the step's mean
                    loss_accum += loss.detach()
                    loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
                if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
                    norm = norm.full_tensor()
                # one read-back a step: the loss (mean over ranks), the norm, and whether every rank goes on
                going = torch.full((), float(stop.signum is None), device=proc.device)
                if proc.world_size > 1:
                    dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # gloo has no AVG: sum, then divide
                    loss_accum /= proc.world_size
                    dist.all_reduce(going, op=dist.ReduceOp.MIN)  # a signal on one rank stops them all here
                loss_value, norm_value, going = torch.stack([loss_accum, norm.float(), going]).tolist()
                if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                    raise diverged(step, loss_value, norm_value, last_saved, args.log_dir)
                lr = get_lr(step, args.max_lr, args.max_lr * args.min_lr_ratio, args.warmup_steps,
                            args.max_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group: --muon_lr / --max_lr
                optimizer.step()
                if proc.device_type == "cuda":
                    torch.cuda.synchronize()  # so dt measures the GPU's work, not just the launches
                dt = time.time() - t0
                state.step, state.tokens_seen = step, state.tokens_seen + batch_size

                with saving_on_error("logging", step, keep_last_step):
                    metrics.report_step(step, loss_value, lr, norm_value, dt, batch_size)
                if profiler is not None and profiler.step():
                    break  # --profile exit
                if step == end - 1 or not going or (args.save_every and step and step % args.save_every == 0):
                    save()  # model_{step}.pt includes this step's update
                if not going:
                    stopped_by = stop.signum or signal.SIGTERM  # another rank's signal: the same exit status
                    proc.print0(f"stopped by {signal.Signals(stopped_by).name} after step {step}: continue "
                                f"with python train_gpt2.py --resume latest --log_dir {args.log_dir}")
                    break
        with saving_on_error("finishing W&B", state.step, keep_last_step):  # uploads: can fail after all
            metrics.finish()
        if args.fsdp:
            raw_model.reshard()  # FSDP leaves the root's gathered parameters after an eval forward: free them
        proc.agree(True)  # every rank done with its collectives before the process group goes away
    return 0 if stopped_by is None else 128 + stopped_by

# ===== The machinery ========================================================================================
# A first reading can stop here: what follows keeps runs safe and usable (checkpoint files and log.txt, the
# log-dir lock, flag checks, reporting, the command line), not how GPT-2 trains.

# ---- checkpoints: model_{step:05d}.pt in the log dir, written after that step's update
@dataclass
class TrainState:
    """Where a run stands: what a checkpoint holds besides the weights and the optimizer state, as its
    top-level keys. With them a resumed run gets the same batches, random numbers and schedule."""
    step: int = -1  # the last optimizer step taken (and included in a checkpoint); -1 before the first
    tokens_seen: int = 0  # train tokens consumed so far (the batch-size ramp depends on it)
    val_loss: float | None = None  # the latest val loss
    loader: dict | None = None  # the train loader's position, DataLoaderLite.state_dict()
    rng: dict | None = None  # python, numpy, torch (and CUDA) generator states
    args: dict | None = None  # the run's flags

CKPT_RE = re.compile(r"model_(\d+)\.pt$")
# what resuming needs (tokens_seen may be missing in older files); sample, export and eval need the first two
CKPT_KEYS = ("model", "config", "optimizer", "step", "val_loss", "loader", "rng", "args")

def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"model_{step:05d}.pt")

def checkpoint_step(path):
    return int(CKPT_RE.search(os.path.basename(path)).group(1))

def find_checkpoints(log_dir):
    """Checkpoint paths in log_dir, oldest step first."""
    found = [p for p in glob.glob(os.path.join(log_dir, "model_*.pt")) if CKPT_RE.search(os.path.basename(p))]
    return sorted(found, key=checkpoint_step)

def per_part(optimizer, fn, *states):
    """fn(optimizer, *states), or {name: fn(part, *states[name])} for a CombinedOptimizer: a checkpoint's
    "optimizer" is AdamW's state dict, or with Muon {"adamw": ..., "muon": ...}."""
    if isinstance(optimizer, CombinedOptimizer):
        return {name: fn(opt, *(s[name] for s in states)) for name, opt in optimizer.parts.items()}
    return fn(optimizer, *states)

def non_finite(model_sd):
    """The name of the first weight holding a NaN or inf, or None."""
    return next((k for k, v in model_sd.items() if v.is_floating_point() and not v.isfinite().all()), None)

def save_checkpoint(path, raw_model, optimizer, state, train_loader, proc, keep_last=0, agree=True):
    """Write model, optimizer and TrainState to path atomically, then keep the newest keep_last (0: all).
    Every rank calls it (FSDP gathers), and every rank stops if rank 0 cannot write (e.g. a full disk);
    agree=False: after a failure that may be one rank's alone, no collective."""
    from torch.distributed.checkpoint import state_dict as sd
    # unsharded, on the CPU, keyed by parameter name: the same from a plain, DDP or FSDP model (which gathers)
    opts = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = sd.get_model_state_dict(raw_model, options=opts)
    optim_sd = per_part(optimizer, lambda opt: sd.get_optimizer_state_dict(raw_model, opt, options=opts))
    error = None
    if proc.master:
        try:
            if bad := non_finite(model_sd):
                raise UsageError(f"{bad} holds NaN or inf")
            state.loader = train_loader.state_dict()
            state.rng = {"python": random.getstate(), "numpy": np.random.get_state(),
                         "torch": torch.get_rng_state(),
                         **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})}
            ckpt = {"model": model_sd, "config": asdict(raw_model.config), "optimizer": optim_sd,
                    **asdict(state)}
            atomic_write(path, lambda f: torch.save(ckpt, f))  # never a truncated model_*.pt, even on a crash
            for old in find_checkpoints(os.path.dirname(path))[:-keep_last] if keep_last > 0 else []:
                os.remove(old)  # the newest is this one: a resumed run set later ones aside when it started
        except (UsageError, OSError) as e:
            error = e
    if not (proc.agree(error is None) if agree else error is None):
        raise UsageError(f"saving {path} failed: {one_line(error)}" if error else "saving failed on rank 0")

def restore_checkpoint(ckpt, raw_model, optimizer, train_loader):
    """Load a checkpoint into the model (FSDP: each rank its shard), optimizer, loader, RNGs; a TrainState."""
    from torch.distributed.checkpoint import state_dict as sd
    opts = sd.StateDictOptions(full_state_dict=True)
    sd.set_model_state_dict(raw_model, ckpt["model"], options=opts)
    def load(opt, state):
        # the kernel choice belongs to this machine, and Muon's LR ratio to this invocation's flags
        keep = [{k: g[k] for k in ("fused", "foreach", "lr_scale") if k in g} for g in opt.param_groups]
        sd.set_optimizer_state_dict(raw_model, opt, state, options=opts)
        for group, kept in zip(opt.param_groups, keep):
            group.update(kept)
    per_part(optimizer, load, ckpt["optimizer"])
    # checkpoints written before the batch ramp existed have no tokens_seen: every step was a full batch
    tokens_seen = ckpt.get("tokens_seen", (ckpt["step"] + 1) * ckpt["args"]["total_batch_size"])
    state = TrainState(**{k: ckpt[k] for k in ("step", "val_loss", "loader", "rng", "args")},
                       tokens_seen=tokens_seen)
    train_loader.load_state_dict(state.loader)
    random.setstate(state.rng["python"])
    np.random.set_state(state.rng["numpy"])
    torch.set_rng_state(state.rng["torch"])
    if torch.cuda.is_available() and len(state.rng.get("cuda", ())) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state.rng["cuda"])
    return state

def read_checkpoint(path, keys=("model", "config"), check_weights=True):
    """The dict in one of our checkpoints (memory-mapped), or a UsageError saying why it cannot be used;
    check_weights=False skips the scan for NaN/inf (a file already checked)."""
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # truncated, or not a torch file at all
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if missing := [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]:
        raise UsageError(f"{path} is not a train_gpt2.py checkpoint (no {', '.join(missing)})")
    if check_weights and (bad := non_finite(ckpt["model"])):
        raise UsageError(f"{path} holds NaN or inf weights ({bad}): a diverged run's")
    return ckpt

def find_resume_checkpoint(resume, log_dir, print0):
    """(path, checkpoint) for --resume latest|PATH; latest skips unusable newer files with a warning."""
    if resume != "latest":
        return resume, read_checkpoint(resume, keys=CKPT_KEYS)
    found = find_checkpoints(log_dir)
    for path in reversed(found):
        try:
            return path, read_checkpoint(path, keys=CKPT_KEYS)
        except UsageError as e:
            print0(f"warning: skipping {e}")
    raise UsageError(f"--resume latest: none of the {len(found)} checkpoints in {log_dir} is usable" if found
                     else f"--resume latest: no model_*.pt checkpoint in {log_dir}")

def model_from_checkpoint(path):
    """The GPT stored in one of our checkpoints (model_*.pt), in fp32 on the CPU."""
    ckpt = read_checkpoint(path)
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model

def diverged(step, loss, norm, last_saved, log_dir):
    """The error that stops a run whose loss or gradient norm is no longer finite."""
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {norm}"
    newest = f"the newest checkpoint is {checkpoint_path(log_dir, last_saved)}" if last_saved >= 0 \
        else "no checkpoint was written"
    return UsageError(f"step {step}: {what}: the run diverged and stopped before this update; {newest} "
                      f"(lower --max_lr or raise --warmup_steps, and resume from it)")

@contextlib.contextmanager
def saving_on_error(what, step, keep_last_step):
    """Around an every-N action (evaluation, logging): if it fails, keep what was trained, then stop."""
    try:
        yield
    except UsageError:
        raise
    except Exception as e:
        saved = keep_last_step()
        raise UsageError(f"{what} at step {step} failed ({type(e).__name__}: {one_line(e)})"
                         + (f"; {saved} holds step {checkpoint_step(saved)}: continue with --resume latest"
                            if saved else "")) from None

# ---- the log dir: one run at a time (a filelock), an earlier run never overwritten by accident
@contextlib.contextmanager
def claim_log_dir(args, resume_step, proc, run_config):
    """Rank 0 locks log_dir for the run, readies it, saves the run config; every rank stops if it cannot."""
    error = None
    with contextlib.ExitStack() as held:
        if proc.master:
            try:
                os.makedirs(args.log_dir, exist_ok=True)
                held.enter_context(lock_log_dir(args.log_dir))
                for warning in prepare_log_dir(args.log_dir, resume_step, args.overwrite):
                    print(f"warning: {warning}", flush=True)
                save_run_config(args.log_dir, run_config)
            except OSError as e:  # a file in the way, no permission, a read-only or full filesystem
                error = UsageError(f"--log_dir {args.log_dir}: cannot write there ({one_line(e)})")
            except UsageError as e:
                error = e
        if not proc.agree(error is None):
            raise error or UsageError("rank 0 could not claim the log dir (see its message)")
        yield

def lock_log_dir(log_dir):
    """fineweb.dir_lock on log_dir/.lock: a live run there is named, with what to do."""
    return fineweb.dir_lock(log_dir, ".lock", "is in use by a live run ({holder}): wait for it to end, or "
                                              "choose another --log_dir")

def prepare_log_dir(log_dir, resume_step, overwrite):
    """Ready log_dir for this run (the lock is held); returns the warnings to print. Removes a crash's temp
    files. A resumed run moves later checkpoints (a rollback, or newer damaged files) and a copy of log.txt
    to after_step_N/, where --resume latest cannot pick up an abandoned step, and cuts log.txt back to its
    checkpoint. --overwrite deletes an earlier run's log and checkpoints; otherwise such a run is refused."""
    for tmp in glob.glob(os.path.join(log_dir, "*.tmp")):
        os.remove(tmp)
    log_file, warnings = os.path.join(log_dir, "log.txt"), []
    if resume_step is not None:
        if later := [p for p in find_checkpoints(log_dir) if checkpoint_step(p) > resume_step]:
            base, n = os.path.join(log_dir, f"after_step_{resume_step:05d}"), 1
            while os.path.exists(dest := f"{base}_{n}" if n > 1 else base):
                n += 1
            os.makedirs(dest)
            if os.path.exists(log_file):
                shutil.copy2(log_file, os.path.join(dest, "log.txt"))
            for path in later:
                os.replace(path, os.path.join(dest, os.path.basename(path)))
            warnings.append(f"resuming at step {resume_step}: {len(later)} later checkpoint(s) and a copy of "
                            f"log.txt moved to {dest}")
        if damaged := truncate_log(log_file, resume_step):
            warnings.append(f"dropped {damaged} damaged line(s) from {log_file}")
        return warnings
    earlier = (os.path.exists(log_file) and os.path.getsize(log_file) > 0) or find_checkpoints(log_dir)
    if earlier and not overwrite:
        raise UsageError(f"{log_dir} holds an earlier run (log.txt or model_*.pt): pass --resume latest "
                         f"to continue it, --overwrite to start afresh, or another --log_dir")
    for path in find_checkpoints(log_dir):
        os.remove(path)
    open(log_file, "w").close()
    return warnings

def save_run_config(log_dir, run_config):
    """The whole run config, printed in short at the start, as log_dir/run_config.json."""
    data = (json.dumps(run_config, indent=1, default=str) + "\n").encode()
    atomic_write(os.path.join(log_dir, "run_config.json"), lambda f: f.write(data))

# ---- log.txt: one `step kind value` line per number, written and parsed only here
LOG_FORMATS = {"train": "{:.6f}", "val": "{:.4f}", "hella": "{:.4f}"}

def append_log(path, step, kind, value):
    with open(path, "a") as f:
        f.write(f"{step} {kind} {LOG_FORMATS[kind].format(value)}\n")

def parse_log_line(line):
    """(step, kind, value) of a log.txt line, or None for a damaged one (a crash can leave NUL bytes)."""
    parts = line.split()
    if len(parts) != 3 or parts[1] not in LOG_FORMATS:
        return None
    try:
        return int(parts[0]), parts[1], float(parts[2])
    except ValueError:
        return None

def read_log(path):
    """{kind: (steps, values)} for the kinds in a log.txt ('train', 'val', 'hella'); bad lines skipped."""
    series = {}
    with open(path, errors="replace") as f:
        for step, kind, value in filter(None, map(parse_log_line, f)):
            series.setdefault(kind, ([], []))[0].append(step)
            series[kind][1].append(value)
    return series

def truncate_log(path, last_step):
    """Keep the lines up to last_step; returns how many damaged lines were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, errors="replace") as f:
        lines = [(line, parse_log_line(line)) for line in f if line.strip()]
    kept = [line for line, parsed in lines if parsed is not None and parsed[0] <= last_step]
    atomic_write(path, lambda f: f.writelines(line.encode() for line in kept))
    return sum(parsed is None for _, parsed in lines)

# ---- flag checks: what argparse cannot check alone, all before any work
# flags of one invocation: a resumed run takes every other flag it is not given from its checkpoint
PER_INVOCATION = {"resume", "overwrite", "stop_step", "device", "dtype", "compile", "profile", "fsdp",
                  "profile_schedule", "wandb_project", "wandb_run_name", "log_dir", "init_from", "peak_flops"}
SCHEDULE_FLAGS = ("max_steps", "max_lr", "min_lr_ratio", "warmup_steps", "total_batch_size",
                  "batch_ramp_tokens", "batch_ramp_start", "seed")

def run_flags(args):
    """The flags as a plain dict, as logged and stored in checkpoints."""
    return {k: v for k, v in vars(args).items() if k != "given"}

def end_step(args):
    """The step the run stops before: --max_steps, or --stop_step when that comes first."""
    return args.max_steps if args.stop_step is None else min(args.max_steps, args.stop_step)

def check_flags(args, ckpt=None):
    """One-line UsageErrors for flags that cannot work together, or (ckpt) with the checkpoint resumed;
    returns warnings for settings that work but look like mistakes."""
    shape = sorted(f"--{k}" if k != "bias" else "--[no-]bias" for k in SHAPE_FLAGS if k in args.given)
    if args.init_from and shape:
        raise UsageError(f"--init_from takes the model's shape from the weights: drop {', '.join(shape)}")
    for key, path in (("log_dir", args.log_dir), ("data_root", args.data_root)):  # found now, not mid-run
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--{key} {path} is a file, not a folder")
    warnings = []
    if args.warmup_steps >= args.max_steps:
        warnings.append(f"--warmup_steps {args.warmup_steps} >= --max_steps {args.max_steps}: "
                        f"the LR never leaves warmup")
    if args.init_from and "preset" in args.given:
        warnings.append(f"--init_from {args.init_from}: --preset {args.preset} gives only run settings, "
                        f"not the shape")
    # flags given for a part of the run that is off: stated, not dropped in silence
    off = {"--eval_every 0": ["val_tokens", "val_steps"] * (args.eval_every <= 0),
           "--sample_every 0": ["sample_prompt", "num_samples", "sample_tokens"] * (args.sample_every <= 0),
           "--hellaswag_every 0": ["hellaswag_limit"] * (args.hellaswag_every <= 0),
           "no --batch_ramp_tokens": ["batch_ramp_start"] * (args.batch_ramp_tokens <= 0),
           "no --profile": ["profile_schedule"] * (not args.profile),
           "no --wandb_project": ["wandb_run_name"] * (not args.wandb_project),
           "no --optimizer muon": [k for k in args.given if k[:5] == "muon_"] * (args.optimizer != "muon")}
    for why, keys in off.items():
        if unused := sorted(f"--{k}" for k in keys if k in args.given):
            verb = "has" if len(unused) == 1 else "have"
            warnings.append(f"{', '.join(unused)} {verb} no effect with {why}")
    if ckpt is None:
        return warnings
    # a block switched on now: its settings, maybe the checkpoint's zeros, must be usable
    for on, keys in ((args.eval_every, ["val_tokens"]),
                     (args.sample_every, ["num_samples", "sample_tokens"])):
        if on and any(getattr(args, k) is not None and getattr(args, k) < 1 for k in keys):
            values = ", ".join(f"--{k} {getattr(args, k)}" for k in keys)
            raise UsageError(f"{args.resume} has {values}: give positive values now that this block is on")
    saved, step = ckpt["args"], ckpt["step"]
    # the model's shape is the checkpoint's: shape flags (and -T, --preset) given now must agree with it
    run_keys = ("sequence_length", "preset")
    asked = {**asdict(model_config_from_args(args)), **{k: getattr(args, k) for k in run_keys}}
    had = {**asdict(GPTConfig(**ckpt["config"])), **{k: saved.get(k, getattr(args, k)) for k in run_keys}}
    if differ := sorted(k for k in set(SHAPE_FLAGS + ("dropout", "sequence_length", "preset")) & args.given
                        if asked[k] != had[k]):
        had_s, asked_s = (", ".join(f"{k}={d[k]}" for k in differ) for d in (had, asked))
        raise UsageError(f"{args.resume} holds a model trained with {had_s}; the flags ask for {asked_s} "
                         f"(a resumed run needs no shape flags)")
    kind = saved.get("optimizer", "adamw")  # checkpoints from before --optimizer hold AdamW's state
    if args.optimizer != kind:
        raise UsageError(f"{args.resume} holds {kind} optimizer state but --optimizer {args.optimizer} was "
                         f"given: resume with --optimizer {kind} (or without the flag), or start a new run")
    # nothing left but the final evaluation (a checkpoint of step max_steps - 1) is fine; nothing is not
    if step + 1 >= end_step(args) and step + 1 != args.max_steps:
        raise UsageError(f"{args.resume} is at step {step}: --max_steps {args.max_steps}"
                         + (f" / --stop_step {args.stop_step}" if args.stop_step else "")
                         + " leave nothing to train")
    changed = [k for k in SCHEDULE_FLAGS if k in args.given and k in saved and getattr(args, k) != saved[k]]
    warnings += [f"--{k} is {getattr(args, k)} now but was {saved[k]} in the checkpoint" for k in changed]
    lrs = [get_lr(step + 1, f["max_lr"], f["max_lr"] * f["min_lr_ratio"], f["warmup_steps"], f["max_steps"])
           for f in ({**run_flags(args), **saved}, run_flags(args))]
    if not math.isclose(*lrs, rel_tol=1e-9):
        warnings.append(f"the schedule changed: step {step + 1} gets LR {lrs[1]:.4e} "
                        f"(the checkpoint's schedule would give {lrs[0]:.4e})")
    return warnings

def model_config_from_args(args):
    shape = {**MODEL_PRESETS[args.preset], "dropout": args.dropout}
    shape.update({k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None})
    try:
        return GPTConfig(**shape)
    except ValueError as e:
        raise UsageError(str(e)) from None

def check_batch(args, world_size, block_size):
    """Gradient-accumulation steps per optimizer step, or a UsageError naming what does not fit."""
    B, T = args.micro_batch_size, args.sequence_length
    if T > block_size:
        raise UsageError(f"-T {T} is longer than the model's block_size {block_size}")
    if args.total_batch_size % (B * T * world_size) != 0:
        raise UsageError(f"--total_batch_size {args.total_batch_size} is not divisible by B*T*world_size = "
                         f"{B}*{T}*{world_size} = {B * T * world_size}: make it a multiple, or change -B")
    return args.total_batch_size // (B * T * world_size)

def check_prompt_fits(n_prompt, n_new, block_size, prompt_flag, new_flag, hint=""):
    if n_prompt + n_new > block_size:
        raise UsageError(f"{prompt_flag} ({n_prompt} tokens) + {new_flag} ({n_new}) exceeds the model's "
                         f"block_size {block_size}{hint}")

def sample_tokenizer(args, block_size):
    """The GPT-2 tokenizer when samples are on, once the prompt and sample length are known to fit."""
    if args.sample_every <= 0:
        return None
    enc = fineweb.get_encoding()
    check_prompt_fits(len(encode_prompt(enc, args.sample_prompt)), args.sample_tokens, block_size,
                      "--sample_prompt", "--sample_tokens",
                      ": shorten them, or turn samples off with --sample_every 0")
    return enc

def check_data_size(args, train_loader, val_loader, val_tokens, print0):
    """Notes a run that reads its train data more than once; returns the val size the val shards can give."""
    reads, have = args.max_steps * args.total_batch_size, train_loader.epoch_tokens
    if reads > have:
        print0(f"note: the run reads {reads:,} train tokens and {args.data_root} holds {have:,}: it passes "
               f"over them {reads / have:.1f} times")
    if args.eval_every > 0 and val_tokens > val_loader.epoch_tokens:  # == is a prep's own val size: fine
        print0(f"warning: the val loss is asked over {val_tokens:,} tokens but the val shards hold "
               f"{val_loader.epoch_tokens - 1:,} targets: it is taken over those")
        return val_loader.epoch_tokens - 1
    return val_tokens

def format_run_config(run_config):
    """The run config in short: a line per flag group, then what the run worked out, then the model."""
    lines, shown = ["run config:"], {"model"}
    for group in build_parser()._action_groups:
        keys = [a.dest for a in group._group_actions if a.dest in run_config]
        shown.update(keys)
        values = " ".join(f"{k}={v}" for k in keys if (v := run_config[k]) is not None and v is not False)
        if values:
            lines.append(f"  {group.title.split(' (')[0]}: {values}")
    lines.append("  this run: " + " ".join(f"{k}={v}" for k, v in run_config.items() if k not in shown))
    lines.append("  model: " + " ".join(f"{k}={v}" for k, v in run_config["model"].items()))
    return "\n".join(lines)

# ---- reporting: the step line, log.txt and W&B, the profiler, stop signals
class Metrics:
    """Where a run's numbers go: the step line (loss, lr, norm, speed, MFU, memory, ETA) on stdout, log.txt
    on the master process, and W&B when --wandb_project is set."""

    def __init__(self, args, proc, raw_model, run_config, first_step, end):
        self.args, self.proc, self.first_step, self.end = args, proc, first_step, end
        self.log_file, self.wandb_run, self.dt_avg = os.path.join(args.log_dir, "log.txt"), None, None
        if args.wandb_project and proc.master:
            try:
                import wandb
            except ImportError:
                raise UsageError("--wandb_project needs the wandb package: pip install wandb") from None
            self.wandb_run = wandb.init(project=args.wandb_project, name=args.wandb_run_name,
                                        config=run_config)
        n_params = raw_model.get_num_params(non_embedding=True)
        self.flops_tok = flops_per_token(raw_model.config, n_params, args.sequence_length)
        self.peak = args.peak_flops or (peak_flops(torch.cuda.get_device_name(proc.device))
                                        if proc.device_type == "cuda" else None)

    def log(self, step, kind, value, **extra):
        """kind is a log.txt series (train/val/hella); extra numbers (lr, norm, ...) go to W&B only."""
        if self.proc.master:
            append_log(self.log_file, step, kind, value)
        if self.wandb_run is not None:
            self.wandb_run.log({kind: value, **{f"{kind}/{k}": v for k, v in extra.items()}}, step=step)

    def report_step(self, step, loss, lr, norm, dt, batch_size):
        tokens_per_sec = batch_size / dt
        if step > self.first_step:  # the first step compiles and warms up: keep it out of the ETA
            self.dt_avg = dt if self.dt_avg is None else 0.9 * self.dt_avg + 0.1 * dt
        extra = {"lr": lr, "norm": norm, "tok_per_sec": tokens_per_sec}
        line = (f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | "
                f"dt {dt * 1000:.2f}ms | tok/sec {tokens_per_sec:.0f}")
        if self.args.batch_ramp_tokens > 0:
            line += f" | batch {batch_size}"
        if self.peak:
            extra["mfu"] = self.flops_tok * tokens_per_sec / (self.peak * self.proc.world_size)
            line += f" | mfu {100 * extra['mfu']:.1f}%"
        if self.proc.device_type == "cuda":
            extra["mem_gib"] = torch.cuda.max_memory_allocated(self.proc.device) / 2**30
            line += f" | mem {extra['mem_gib']:.1f}GiB"
        if self.dt_avg is not None:
            line += f" | eta {format_eta((self.end - step - 1) * self.dt_avg)}"
        self.proc.print0(line)
        self.log(step, "train", loss, **extra)

    def finish(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()

def format_eta(seconds):
    return f"{int(seconds) // 3600}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"

def profile_schedule(text):
    """argparse type of --profile_schedule: WAIT,WARMUP,ACTIVE steps."""
    if not re.fullmatch(r"\d+,\d+,0*[1-9]\d*", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers WAIT,WARMUP,ACTIVE (>= 0, >= 0, >= 1)")
    return text

class Profiler:
    """torch.profiler over a few training steps (--profile_schedule): a trace, then the top ops."""

    def __init__(self, args, proc):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
        wait, warmup, active = (int(v) for v in args.profile_schedule.split(","))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if proc.device_type == "cuda" else [])
        self.out = os.path.join(args.log_dir, "profile")
        self.prof = profile(activities=activities, record_shapes=True,
                            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                            on_trace_ready=tensorboard_trace_handler(self.out, f"rank{proc.rank}"))
        self.prof.start()
        self.steps_left, self.exit_after, self.proc = wait + warmup + active, args.profile == "exit", proc

    def step(self):
        """Call after each training step; True when the run should stop here (--profile exit)."""
        self.steps_left -= 1
        if self.steps_left >= 0:
            self.prof.step()
        if self.steps_left != 0:  # still recording, or long done
            return False
        self.prof.stop()  # the trace handler has written <log_dir>/profile/rank{r}.*.pt.trace.json
        sort = "self_cuda_time_total" if self.proc.device_type == "cuda" else "self_cpu_time_total"
        self.proc.print0(self.prof.key_averages().table(sort_by=sort, row_limit=20))
        self.proc.print0(f"profiler trace in {self.out} (open in ui.perfetto.dev or TensorBoard)")
        return self.exit_after

class StopSignals:
    """SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before a time limit) while training: the run finishes its
    step, saves a checkpoint and exits with 128 + the signal. A second Ctrl-C leaves at once."""

    def __enter__(self):
        self.signum, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
            self.previous = {s: signal.signal(s, self.handle) for s in signals}
        return self

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum is not None and signum == signal.SIGINT:
            os.write(2, f"error: {name} again: leaving now, without saving this step\n".encode())
            os._exit(128 + signum)
        self.signum = self.signum or signum
        if int(os.environ.get("RANK", 0)) == 0:
            os.write(2, f"{name}: finishing this step, then saving a checkpoint (Ctrl-C again: now)\n"
                     .encode())

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

# ---- the command line: the training flags, main, and the sample / export / eval commands
COMMANDS_HELP = {"sample": "text from a checkpoint or from OpenAI's GPT-2",
                 "export": "a checkpoint as a transformers GPT2LMHeadModel directory",
                 "eval": "HellaSwag accuracy of a checkpoint or of OpenAI's GPT-2 (acc: lowest summed loss "
                         "of the ending, acc_norm: lowest mean loss)"}

def build_parser(command=None):
    """The parser of the training flags (command None), or of the sample / export / eval command."""
    shared = OneLineParser(add_help=False)  # defined once for the trainer, sample and eval
    shared.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    shared.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="autocast dtype; auto is bf16 on CUDA, fp32 elsewhere")
    shared.add_argument("--init_from", metavar="gpt2|gpt2-medium|gpt2-large|gpt2-xl|DIR",
                        help="OpenAI's GPT-2 weights (a hub name, or a save_pretrained directory)")
    if command is not None:
        p = OneLineParser(prog=f"train_gpt2.py {command}", parents=[shared] * (command != "export"),
                          formatter_class=HelpFormatter, description=f"{command}: {COMMANDS_HELP[command]}")
        add = p.add_argument
        add("--checkpoint", required=command == "export", help="a model_*.pt written by training")
    if command == "export":
        add("--out", required=True, help="a new (or empty) directory to write")
        return p
    if command == "sample":
        add("--prompt", default="Hello, I'm a language model,", help="text to continue")
        add("--num_samples", type=POSITIVE_INT, default=4, help="independent samples")
        add("--max_new_tokens", type=POSITIVE_INT, default=64, help="new tokens per sample")
        add("--top_k", type=POSITIVE_INT, default=50, help="the k likeliest tokens (1: greedy)")
        add("--temperature", type=NONNEG, default=1.0, help="softmax temperature (0: greedy)")
        add("--seed", type=int, default=1337, help="sampling seed")
        add("--no_kv_cache", action="store_true", help="recompute the sequence each token (slow)")
        return p
    if command == "eval":
        add("--limit", type=POSITIVE_INT, help="only the first N examples")
        add("--batch_tokens", type=NONNEG_INT, default=8192, help="tokens a pass (0: one example)")
        add("--data_dir", help="folder of hellaswag_val.jsonl (default: hellaswag.py's)")
        return p

    p = OneLineParser(prog="train_gpt2.py", parents=[shared], formatter_class=HelpFormatter,
                      usage="%(prog)s [flags]  |  %(prog)s {sample,export,eval} [flags]",
                      description="Pretrain GPT-2 on FineWeb-Edu shards: python train_gpt2.py on one GPU, "
                                  "torchrun --standalone --nproc_per_node=8 train_gpt2.py on a node.\n\n"
                                  "commands (python train_gpt2.py COMMAND --help):\n"
                                  + "\n".join(f"  {c:8} {h}" for c, h in COMMANDS_HELP.items()))
    fraction = bounded(float, 0, 1, high_open=True, what="in [0, 1)")
    add = p.add_argument_group("model").add_argument
    add("--preset", default="gpt2", choices=sorted(MODEL_PRESETS), help="shape and run settings (flags win)")
    add("--n_layer", type=POSITIVE_INT, help="blocks (default: the preset's)")
    add("--n_head", type=POSITIVE_INT, help="attention heads (default: the preset's)")
    add("--n_embd", type=POSITIVE_INT, help="embedding width (default: the preset's)")
    add("--block_size", type=POSITIVE_INT, help="context length (default: the preset's, GPT-2's 1024)")
    add("--n_kv_head", type=POSITIVE_INT, help="key/value heads, dividing n_head: GQA (1: MQA)")
    add("--dropout", type=fraction, default=0.0, help="attention, residual and embedding dropout in training")
    add("--bias", default=True, action=argparse.BooleanOptionalAction, help="biases in Linear and LayerNorm")
    add = p.add_argument_group("optimisation").add_argument
    add("--optimizer", default="adamw", choices=["adamw", "muon"],
        help="adamw (GPT-2's), or muon: torch.optim.Muon for the blocks' 2-D weights, AdamW for the rest")
    add("--muon_lr", type=POSITIVE, help="Muon's peak LR (default: --max_lr), scheduled like it")
    add("--muon_momentum", type=fraction, default=0.95, help="Muon's Nesterov momentum")
    add("--muon_ns_steps", type=bounded(int, 1, 99, what="in 1..99"), default=5, help="Newton-Schulz steps")
    add("--muon_adjust_lr", default="match_rms_adamw", choices=["match_rms_adamw", "original"],
        help="match_rms_adamw: Muon's LR on AdamW's scale; original: ~10-50x larger --muon_lr")
    add("--max_lr", type=POSITIVE, default=6e-4, help="peak learning rate")
    add("--min_lr_ratio", type=bounded(float, 0, 1, what="in [0, 1]"), default=0.1, help="final LR / max_lr")
    add("--warmup_steps", type=NONNEG_INT, default=715, help="linear warmup steps")
    add("--max_steps", type=POSITIVE_INT, default=19073, help="optimizer steps (19073 x 2^19 = 10B tokens)")
    add("--weight_decay", type=NONNEG, default=0.1, help="decoupled weight decay of matmuls and embeddings")
    add("--grad_clip", type=NONNEG, default=1.0, help="clip the global gradient norm to this (0: off)")
    add("--total_batch_size", type=POSITIVE_INT, default=524288,
        help="tokens per optimizer step, all processes together: a multiple of B*T*processes")
    add("--batch_ramp_tokens", type=NONNEG_INT, default=0,
        help="GPT-3's ramp: the batch grows from --batch_ramp_start over the first N tokens (0: off)")
    add("--batch_ramp_start", type=POSITIVE_INT, default=32768, help="first batch of the ramp, in tokens")
    add("-B", "--micro_batch_size", type=POSITIVE_INT, default=64, help="sequences per forward, per process")
    add("-T", "--sequence_length", type=POSITIVE_INT, default=1024, help="tokens per sequence")
    g = p.add_argument_group("evaluation, sampling, checkpoints (0 turns a block off)")
    add = g.add_argument
    add("--eval_every", type=NONNEG_INT, default=250, help="val loss every N steps and at the end")
    val = g.add_mutually_exclusive_group()
    val.add_argument("--val_tokens", type=POSITIVE_INT, default=10_485_760,
                     help="val loss over the first N val tokens, for any world size and -B (build-nanogpt's)")
    val.add_argument("--val_steps", type=POSITIVE_INT, help="instead: N batches of B*T tokens per process")
    add("--sample_every", type=NONNEG_INT, default=250, help="samples every N steps (not 0) and at the end")
    add("--sample_prompt", default="Hello, I'm a language model,", help="prompt for the samples")
    add("--num_samples", type=POSITIVE_INT, default=4, help="samples per sampling block")
    add("--sample_tokens", type=POSITIVE_INT, default=32, help="new tokens per sample")
    add("--hellaswag_every", type=NONNEG_INT, default=250, help="HellaSwag every N steps and at the end")
    add("--hellaswag_limit", type=POSITIVE_INT, help="only the first N HellaSwag val examples")
    add("--save_every", type=NONNEG_INT, default=5000, help="checkpoint every N steps; the last is saved")
    add("--keep_last", type=NONNEG_INT, default=0, help="keep only the newest N model_*.pt (0: all)")
    g = p.add_argument_group("run")
    add = g.add_argument
    add("--seed", type=int, default=1337, help="seed for init, data order and sampling")
    add("--data_root", default=fineweb.DEFAULT_DATA_ROOT,
        help="folder of *_train_*.npy / *_val_*.npy shards; rank 0 prepares missing ones (>= 10M tokens)")
    add("--fineweb_name", default="sample-10BT", choices=fineweb.NAMES, help="FineWeb-Edu sample to prepare")
    add("--input", nargs="+", metavar="PATH",
        help="prepare data_root from these .txt/.md/.jsonl/.parquet files (or globs) instead of FineWeb-Edu")
    add("--text_column", default="text", help="text field of --input .jsonl/.parquet files")
    add("--log_dir", default="log", help="where log.txt, run_config.json and model_*.pt go")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (default: on CUDA only)")
    add("--peak_flops", type=POSITIVE, help="peak bf16 FLOP/s of one GPU for MFU (default: A100/H100/H200)")
    add("--fsdp", action="store_true", help="shard the model across torchrun processes (FSDP2)")
    fresh = g.add_mutually_exclusive_group()
    fresh.add_argument("--overwrite", action="store_true", help="start afresh: delete log.txt and model_*.pt")
    fresh.add_argument("--resume", metavar="latest|PATH",
                       help="continue from the newest usable checkpoint in log_dir, or PATH; the shape and "
                            "every flag not given now come from it; later checkpoints move to after_step_N/")
    add("--stop_step", type=POSITIVE_INT, help="leave after N steps, saved, on --max_steps' schedule")
    add("--profile", nargs="?", const="continue", choices=["continue", "exit"],
        help="torch.profiler over a few steps: a trace in <log_dir>/profile/, the top ops, then go on")
    add("--profile_schedule", type=profile_schedule, default="1,1,3", metavar="WAIT,WARMUP,ACTIVE",
        help="profiler steps: skipped, warmed up, recorded")
    add("--wandb_project", help="also log to this Weights & Biases project (pip install wandb)")
    add("--wandb_run_name", help="W&B run name (default: W&B picks one)")
    return p

def parse_args(argv=None):
    """The training flags. Each takes the first value found on: the command line, the checkpoint resumed
    (--resume), the preset's run settings, the parser's defaults. args.given names the flags given."""
    parser = build_parser()
    parser.parse_args(argv)  # --help, and any malformed flag, before anything is read
    defaults = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv))  # only the flags on the command line
    layers = {**defaults, **RUN_PRESETS[given.get("preset", defaults["preset"])]}
    if "input" in given:  # local text is not FineWeb-Edu: it gets a folder of its own
        layers["data_root"] = fineweb.LOCAL_DATA_ROOT
    if "resume" in given and "init_from" in given:
        raise UsageError("--resume continues a checkpoint, --init_from starts from OpenAI's: give one")
    if "resume" in given:
        print0 = print if int(os.environ.get("RANK", 0)) == 0 else (lambda *a, **k: None)
        log_dir = given.get("log_dir", defaults["log_dir"])
        path, ckpt = find_resume_checkpoint(given["resume"], log_dir, print0)
        saved = {k: v for k, v in ckpt["args"].items() if k in defaults and k not in PER_INVOCATION}
        if "val_tokens" in given:  # two ways to give one number: the one given now replaces the saved one
            saved["val_steps"] = None
        layers.update(saved, resume=path)
    parser.set_defaults(**layers)
    args = parser.parse_args(argv)
    args.resume, args.given = layers["resume"], set(given)  # resume: the checkpoint found for `latest`
    return args

def model_for_command(args):
    """(GPT in eval mode on its device, device, autocast context, uses bf16) of --checkpoint/--init_from."""
    if (args.checkpoint is None) == (args.init_from is None):
        raise UsageError("give one of --checkpoint (a model_*.pt) or --init_from (OpenAI's GPT-2)")
    device = resolve_device(args.device)
    model = model_from_checkpoint(args.checkpoint) if args.checkpoint else GPT.from_pretrained(args.init_from)
    ctx, use_bf16 = autocast_for(args.dtype, device.split(":")[0])
    return model.to(device).eval(), device, ctx, use_bf16

def sample_main(args):
    model, device, ctx, _ = model_for_command(args)
    enc = fineweb.get_encoding()
    check_prompt_fits(len(encode_prompt(enc, args.prompt)), args.max_new_tokens, model.config.block_size,
                      "--prompt", "--max_new_tokens")
    texts = sample_texts(model, enc, args.prompt, args.num_samples, args.max_new_tokens, device, ctx,
                         args.seed, temperature=args.temperature, top_k=args.top_k,
                         use_cache=not args.no_kv_cache)
    for i, text in enumerate(texts):
        print(f"--- sample {i}\n{text}")
    return 0

def export_main(args):
    """Written into a temp folder beside --out, renamed at the end: a failed export leaves nothing behind."""
    out, parent = os.path.abspath(args.out), os.path.dirname(os.path.abspath(args.out))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out {args.out} exists and is not an empty directory: choose a new one")
    if not os.path.isdir(parent):
        raise UsageError(f"--out {args.out}: its parent {parent} is not an existing folder")
    model = model_from_checkpoint(args.checkpoint)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        os.makedirs(tmp)
        export_hf(model, tmp)
        os.replace(tmp, out)
    except OSError as e:  # a read-only parent, a full disk
        raise UsageError(f"--out {args.out}: cannot write there ({one_line(e)})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.out}: GPT2LMHeadModel.from_pretrained({args.out!r}) loads it")
    return 0

def eval_main(args):
    model, device, _, use_bf16 = model_for_command(args)  # a bad checkpoint fails before any download
    hellaswag.download("val", args.data_dir)
    t0 = time.perf_counter()
    res = hellaswag.evaluate(model, device, limit=args.limit, batch_tokens=args.batch_tokens,
                             data_dir=args.data_dir, autocast_dtype=torch.bfloat16 if use_bf16 else None,
                             progress=True)
    seconds, dtype = time.perf_counter() - t0, "bf16" if use_bf16 else "fp32"
    print(hellaswag.summary(args.checkpoint or args.init_from, device, dtype, "val", res, seconds))
    return 0

COMMANDS = {"sample": sample_main, "export": export_main, "eval": eval_main}

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](build_parser(argv[0]).parse_args(argv[1:]))
        return train(parse_args(argv))
    except UsageError as e:  # fineweb's DataPrepError (also a damaged gpt2_bpe/), HellaSwagUnavailable
        if int(os.environ.get("RANK", 0)) == 0 or e.rank_specific:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk under log.txt or an export: nothing partial is left under a final name
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (set-up, data prep, a command)
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

def exit_process(code):
    """sys.exit(code); under torchrun, without Python's interpreter shutdown: torch keeps process groups
    alive past destroy_process_group, and a gloo thread freeing a tensor during shutdown aborts a good run."""
    if "WORLD_SIZE" in os.environ:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)

if __name__ == "__main__":
    exit_process(main())
