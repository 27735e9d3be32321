"""
GPT-2 pretraining on FineWeb-Edu token shards, in one flat, importable file.

    python train_gpt2.py                                        # GPT-2 124M recipe, one GPU (or CPU)
    torchrun --standalone --nproc_per_node=8 train_gpt2.py      # the same recipe on a node of 8 GPUs
    python train_gpt2.py --preset tiny                          # a few-M-parameter model, laptop CPU
    python train_gpt2.py sample|export|eval --help              # use a checkpoint

Importing this file defines everything below and runs nothing. The sections follow a run: config and
presets, the model, the data loader, schedules, distributed setup, checkpoints and the run log,
evaluation, the training loop, the command line. A run writes `<log_dir>/log.txt` (see `read_log`) and
checkpoints `<log_dir>/model_{step:05d}.pt`; `--resume latest` continues exactly where a run stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import fineweb
import hellaswag
from fineweb import EOT, atomic_write, list_shards

SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
GPT2_VOCAB_SIZE = EOT + 1  # real GPT-2 BPE tokens, <|endoftext|> last; ids >= this in a padded vocab are padding


class UsageError(Exception):
    """A problem with the user's input (flags, data, files): reported as one line, exit status 1.

    Under torchrun every rank meets the same problem, so only rank 0 reports it, unless the problem is
    this rank's own (rank_specific=True).
    """

    def __init__(self, message, rank_specific=False):
        super().__init__(message)
        self.rank_specific = rank_specific


# =============================================================================
# Config and presets
# =============================================================================

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
            raise ValueError(f"real_vocab_size ({self.real_vocab_size}) must be in 1..vocab_size ({self.vocab_size})")


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
    # the CPU demo: ~300k tokens, about 5 minutes at ~1k tokens/s (a 2-core VM); val and samples every 50 steps
    "tiny": dict(max_lr=2e-3, warmup_steps=15, max_steps=150, total_batch_size=2048, micro_batch_size=8,
                 sequence_length=256, eval_every=50, val_tokens=16384, sample_every=50, hellaswag_every=0,
                 save_every=0, data_root=os.path.join(SCRIPT_DIR, "edu_fineweb_tiny")),
}


# =============================================================================
# The model
# =============================================================================

class KVCache:
    """Keys and values of the tokens seen so far, for every layer: generation feeds one token at a time.

    Preallocated for `max_len` positions: k, v are (n_layer, B, n_kv_head, max_len, hs) and `pos` is how
    many positions are filled.
    """

    def __init__(self, config: GPTConfig, batch_size, max_len, device, dtype):
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
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
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.hs = config.n_embd // config.n_head
        self.layer_idx = layer_idx
        self.dropout = config.dropout
        # q for all heads and k, v for the n_kv_head key/value heads, in one matmul
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * self.hs, bias=config.bias)
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
        extra = {"enable_gqa": True} if nkv != nh else {}  # each group of nh/nkv query heads shares a k, v head
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
        x = x + self.mlp(self.ln_2(x))
        return x


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
        # 0 for real tokens, -inf for the padding ids, added inside the lm_head matmul while training: padding
        # gets zero probability (never sampled, never an argmax, no share of any softmax); on GPUs the bias is
        # the matmul's epilogue, and compile fuses it. A buffer, not a parameter: the state dict stays GPT-2's
        vocab_mask = torch.zeros(config.vocab_size)
        vocab_mask[config.real_vocab_size:] = float("-inf")
        self.register_buffer("vocab_mask", vocab_mask, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                # each block adds two projections to the residual stream: keep its variance from growing
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=False):
        """Parameter count (the tied wte/lm_head once); non_embedding=True also leaves out wpe."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None, kv_cache=None, logits_to_keep=0):
        """idx (B, T) token ids -> logits (B, T, vocab_size) and the mean cross-entropy vs targets (or None).

        logits_to_keep follows transformers' GPT2LMHeadModel: 0 projects every position onto the vocab; an
        int k > 0 only the last k positions; a 1-D tensor of positions only those, giving (B, len, vocab).
        The vocab projection is most of a small model's work and scoring or generation needs few positions.
        With a kv_cache, idx continues the cached sequence (positions past .. past + T - 1).
        """
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
        """OpenAI GPT-2 weights through transformers: a hub name (gpt2 .. gpt2-xl) or a save_pretrained dir.

        The vocab is padded to a multiple of 64 (50257 -> 50304); the padding rows are zero and masked.
        """
        from transformers import GPT2LMHeadModel

        try:
            hf = GPT2LMHeadModel.from_pretrained(name_or_dir)
        except OSError as e:  # offline, unknown name, or not a model directory
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"could not load GPT-2 weights {name_or_dir!r} ({first}); offline, pass a local "
                             f"directory written by GPT2LMHeadModel.save_pretrained") from None
        hc = hf.config
        n_inner = hc.n_inner if hc.n_inner is not None else 4 * hc.n_embd
        if hc.activation_function != "gelu_new" or n_inner != 4 * hc.n_embd or hc.layer_norm_epsilon != 1e-5 \
                or getattr(hc, "scale_attn_by_inverse_layer_idx", False) or getattr(hc, "reorder_and_upcast_attn", False):
            raise ValueError(f"{name_or_dir}: not a standard GPT-2 architecture (activation, MLP width or attention options differ)")
        padded_vocab = -(-hc.vocab_size // 64) * 64
        config = GPTConfig(block_size=hc.n_positions, vocab_size=padded_vocab, n_layer=hc.n_layer,
                           n_head=hc.n_head, n_embd=hc.n_embd, real_vocab_size=hc.vocab_size, dropout=dropout)
        model = cls(config)
        sd = model.state_dict()
        sd_hf = hf.state_dict()
        if set(sd_hf) - set(sd) or set(sd) - set(sd_hf):
            raise ValueError(f"{name_or_dir}: parameter names differ from GPT-2's: {sorted(set(sd_hf) ^ set(sd))[:4]}")
        # HF keeps these as Conv1D, i.e. (in, out); nn.Linear wants (out, in)
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        with torch.no_grad():
            for k, v in sd_hf.items():
                if k.endswith(conv1d):
                    v = v.t()
                if k in ("transformer.wte.weight", "lm_head.weight"):
                    sd[k][: hc.vocab_size].copy_(v)  # padding rows stay zero: they are masked anyway
                    sd[k][hc.vocab_size:].zero_()
                    continue
                if v.shape != sd[k].shape:
                    raise ValueError(f"{name_or_dir}: shape mismatch for {k}: {tuple(v.shape)} vs {tuple(sd[k].shape)}")
                sd[k].copy_(v)
        return model

    def configure_optimizers(self, weight_decay, learning_rate, device_type, verbose=True, muon=None):
        """AdamW with decay on matmul weights and embeddings (dim >= 2) only, never biases or LayerNorm.

        muon: None, or make_muon's keyword arguments (muon_settings(args)): the 2-D weights inside the blocks
        then go to torch.optim.Muon instead, AdamW keeps the rest, and the two come back as one CombinedOptimizer.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        matrices = self.block_matrices() if muon is not None else []
        taken = {id(p) for p in matrices}
        params = [p for p in params if id(p) not in taken]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if verbose:
            print(f"decayed parameter tensors: {len(decay)}, with {sum(p.numel() for p in decay):,} parameters")
            print(f"non-decayed parameter tensors: {len(no_decay)}, with {sum(p.numel() for p in no_decay):,} parameters")
        fused = device_type == "cuda"  # one kernel for the whole update instead of one per tensor
        adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        if muon is None:
            return adamw
        if verbose:
            print(f"Muon matrices: {len(matrices)}, with {sum(p.numel() for p in matrices):,} parameters")
        return CombinedOptimizer({"adamw": adamw, "muon": make_muon(matrices, weight_decay, learning_rate, **muon)})

    def block_matrices(self):
        """The 2-D weights inside the transformer blocks (attention and MLP matmuls): Muon's share."""
        return [p for p in self.transformer.h.parameters() if p.requires_grad and p.dim() == 2]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None, use_cache=True):
        """The prompt idx (B, T0) followed by max_new_tokens sampled tokens: (B, T0 + max_new_tokens).

        With the KV cache the prompt is run once and then one token per step; without it the whole
        sequence is recomputed every step (the reference the cache is tested against). top_k=1 or
        temperature=0 is greedy. Padding ids are never produced. Runs in eval mode (no dropout).
        """
        B, T0 = idx.size()
        if T0 + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"block_size {self.config.block_size}")
        was_training = self.training
        self.eval()
        cache = None
        if use_cache:
            dtype = torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type) \
                else self.lm_head.weight.dtype
            cache = KVCache(self.config, B, T0 + max_new_tokens, idx.device, dtype)
        logits, _ = self(idx, kv_cache=cache, logits_to_keep=1)  # prefill
        for i in range(max_new_tokens):
            nxt = sample_next(logits[:, -1, : self.config.real_vocab_size], temperature, top_k, generator)
            idx = torch.cat((idx, nxt), dim=1)
            if i < max_new_tokens - 1:
                logits, _ = self(nxt, kv_cache=cache, logits_to_keep=1) if use_cache else self(idx, logits_to_keep=1)
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




def export_hf(model, out_dir):
    """Write model as a transformers GPT2LMHeadModel directory (config.json + safetensors), vocab unpadded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    if not c.bias or c.n_kv_head != c.n_head:
        raise UsageError("only GPT-2's architecture exports to GPT2LMHeadModel: this model has "
                         + ("no biases" if not c.bias else f"n_kv_head {c.n_kv_head} != n_head {c.n_head}"))
    hc = GPT2Config(vocab_size=c.real_vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                    n_head=c.n_head, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                    resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
                    bos_token_id=EOT, eos_token_id=EOT, tie_word_embeddings=True)
    hf = GPT2LMHeadModel(hc)
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        if k.endswith(conv1d):
            v = v.t()  # nn.Linear (out, in) -> HF Conv1D (in, out)
        if k in ("transformer.wte.weight", "lm_head.weight"):
            v = v[: c.real_vocab_size]
        sd[k] = v.contiguous()
    hf.load_state_dict(sd, strict=True)
    hf.save_pretrained(out_dir)
    return hf


def flops_per_token(config: GPTConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: 6N + 12·L·H·Q·T (PaLM, appendix B).

    n_params excludes the position embedding (it is a lookup, not a matmul); the tied wte/lm_head counts
    once, as the lm_head matmul. 12·L·H·Q·T is the attention score and value matmuls (Q = head size).
    """
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, seq_len
    return 6 * n_params + 12 * L * H * Q * T


# Peak dense (no sparsity) bf16 tensor-core FLOP/s per GPU, from NVIDIA's datasheets, which print the
# with-sparsity figure: half of it is the dense peak. H100 SXM 1,979 -> 989 TF, H100 NVL 1,671 -> 835,
# H100 PCIe 1,513 -> 756 (H100 datasheet); H200 SXM 1,979 -> 989, H200 NVL 1,671 -> 835 (H200 datasheet);
# A100 624 -> 312 for all of 40/80GB, SXM4/PCIe (A100 datasheet). Matched as substrings of
# torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 NVL", "NVIDIA H100 PCIe",
# "NVIDIA H200", "NVIDIA A100-SXM4-80GB"; the first match wins, so the form factors come before the plain
# name (the SXM parts carry no form factor in their name). Other GPUs get no MFU unless --peak_flops is given.
PEAK_BF16_FLOPS = [
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("A100", 312e12),
]


def peak_flops(device_name: str):
    """Peak dense bf16 FLOP/s of a GPU named like torch.cuda.get_device_name(), or None if unknown."""
    name = device_name.casefold()
    for key, flops in PEAK_BF16_FLOPS:
        if key.casefold() in name:
            return flops
    return None




# =============================================================================
# Data loader: uint16 token shards written by fineweb.py
# =============================================================================

class DataLoaderLite:
    """Batches (x, y) of shape (B, T) from the `*_{split}_NNNNNN.npy` shards in data_root.

    A split is read as one endless stream of tokens: its shards in order, then (train only) the shards
    again in a new order drawn from a seeded RNG at each epoch boundary. Rank r of num_processes reads
    window r of every group of num_processes windows of B*T tokens (+1 for the shifted targets), so a
    window that reaches the end of a shard continues into the next one and nothing is dropped. Because
    the position is one number in that stream, the same batches come out for any number of processes,
    and `state_dict()` resumes exactly. Shards are memory-mapped: each batch copies only its B*T+1 tokens.
    """

    def __init__(self, B, T, process_rank=0, num_processes=1, split="train", data_root=fineweb.DEFAULT_DATA_ROOT, seed=1337,
                 vocab_size=GPT2_VOCAB_SIZE):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        self.B, self.T = B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.split, self.seed = split, seed
        self.shards = list_shards(data_root, split)
        if not self.shards:
            raise UsageError(f"no {split} shards (*_{split}_NNNNNN.npy) in {data_root}: "
                             f"prepare them with `python fineweb.py` (see --help there)", rank_specific=True)
        try:  # header, size, dtype and every token id < vocab_size, checked once here: one line naming the file
            self.tokens = [fineweb.open_shard(path, vocab_size) for path in self.shards]
        except fineweb.ShardError as e:
            raise UsageError(str(e), rank_specific=True) from None
        self.lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)
        self.epoch_tokens = int(self.lengths.sum())
        if self.epoch_tokens < B * T + 1:
            raise UsageError(f"the {split} shards in {data_root} hold {self.epoch_tokens} tokens, "
                             f"fewer than one batch of B*T+1 = {B * T + 1}")
        self._order_cache = {}
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
        self.seed = state["seed"]
        self.position = state["position"]

    def _order(self, epoch):
        """Shard order of an epoch and the cumulative token offsets of that order."""
        if epoch not in self._order_cache:
            n = len(self.shards)
            if self.split == "train" and epoch > 0:
                order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                order = np.arange(n)
            starts = np.concatenate([[0], np.cumsum(self.lengths[order])])
            self._order_cache = {epoch: (order, starts)}  # keep one epoch: the stream only moves forward
        return self._order_cache[epoch]

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
        x = buf[:-1].view(B, T)  # inputs
        y = buf[1:].view(B, T)  # targets: the next token of each input
        self.position += B * T * self.num_processes
        return x, y



# approximate GPT-2 token counts of the FineWeb-Edu samples: a run needing most of one takes it whole
FINEWEB_SAMPLE_TOKENS = {"sample-10BT": 10e9, "sample-100BT": 100e9, "sample-350BT": 350e9}
MIN_PREP_TOKENS = 10_000_000


def ensure_data(args, train_tokens, val_tokens, dist):
    """Make sure data_root has shards: if it has none, the master prepares them while the others wait.

    With several nodes, data_root must be on a shared filesystem for this (or prepared on each node first).
    """
    have = bool(list_shards(args.data_root, "train")) and bool(list_shards(args.data_root, "val"))
    if dist.agree(have and unfinished_prep(args.data_root) is None):  # every rank takes the same branch
        if dist.master:
            if "input" in getattr(args, "given", ()):  # prep reads --input only into an empty data_root
                dist.print0(f"warning: --input has no effect: {args.data_root} already holds shards (use another "
                            f"--data_root to prepare one from it)")
            warn_if_data_short(args.data_root, train_tokens, dist.print0)
        return
    message = prepare_data(args, train_tokens, val_tokens, dist.print0) if dist.master else None
    # preparing 10B tokens takes hours, far past NCCL's collective timeout: wait on a long-timeout gloo group
    if not dist.agree(message is None, long_wait=True):
        raise UsageError(message or "data preparation failed on rank 0 (see its message)")


def unfinished_prep(data_root):
    """fineweb.prep_status of data_root when its manifest says the prep stopped before the end, else None."""
    try:
        status = fineweb.prep_status(data_root)
    except fineweb.DataPrepError as e:  # a damaged manifest.json
        raise UsageError(str(e)) from None
    return status if status.has_manifest and not status.complete else None


def warn_if_data_short(data_root, train_tokens, print0):
    manifest = os.path.join(data_root, fineweb.MANIFEST)
    if os.path.exists(manifest):
        import json
        with open(manifest) as f:
            info = json.load(f)
        if info.get("complete") and info.get("total_tokens", float("inf")) < train_tokens:
            print0(f"note: {data_root} holds {info['total_tokens']:,} tokens and the run reads {train_tokens:,}: "
                   f"it will go over the data more than once")


def prepare_data(args, train_tokens, val_tokens, print0):
    """fineweb.prepare just the tokens the run needs (at least 10M), or the whole source; None or an error.

    A prep that was interrupted (manifest.json says incomplete) is finished with the arguments it recorded.
    """
    status = unfinished_prep(args.data_root)
    if status is not None:
        print0(f"{args.data_root}: an earlier prep stopped after {status.shards} shards; finishing it")
        try:
            fineweb.prepare(args.data_root, **status.prepare_kwargs)
        except fineweb.DataPrepError as e:
            return f"{args.data_root} is an unfinished prep and finishing it failed ({e}); finish it with: " \
                   f"{status.resume_command}"
        return None
    needed = max(train_tokens + val_tokens, MIN_PREP_TOKENS)
    full = args.input is not None or needed >= 0.9 * FINEWEB_SAMPLE_TOKENS[args.fineweb_name]
    max_tokens = None if full else needed
    what = " ".join(args.input) if args.input else f"FineWeb-Edu {args.fineweb_name}"
    print0(f"no shards in {args.data_root}: preparing them from {what}" + (f" ({max_tokens:,} tokens)" if max_tokens else ""))
    try:
        fineweb.prepare(args.data_root, name=args.fineweb_name, inputs=args.input, text_column=args.text_column,
                        max_tokens=max_tokens, val_tokens=None if full else min(max(val_tokens, 1), max_tokens // 2))
    except fineweb.DataPrepError as e:
        return f"preparing {args.data_root} failed: {e}"
    return None


# =============================================================================
# Optimizers: AdamW alone (GPT-2's recipe), or Muon for the block matrices and AdamW for the rest
# =============================================================================

def make_muon(matrices, weight_decay, max_lr, lr=None, momentum=0.95, ns_steps=5, adjust_lr_fn="match_rms_adamw"):
    """torch.optim.Muon over `matrices` with decoupled weight decay, as AdamW's.

    match_rms_adamw scales each update to AdamW's RMS, so Muon's lr is on AdamW's scale and the same schedule
    drives both. The group's lr_scale (lr / max_lr) is what train_step multiplies the scheduled LR by.
    """
    lr = max_lr if lr is None else lr
    return torch.optim.Muon([{"params": matrices, "lr_scale": lr / max_lr}], lr=lr, weight_decay=weight_decay,
                            momentum=momentum, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)


def muon_settings(args):
    """configure_optimizers' muon argument for these flags: None for --optimizer adamw."""
    if args.optimizer != "muon":
        return None
    return dict(lr=args.muon_lr, momentum=args.muon_momentum, ns_steps=args.muon_ns_steps,
                adjust_lr_fn=args.muon_adjust_lr)


class CombinedOptimizer:
    """Optimizers over disjoint parameters, used as one by the training loop and the checkpoints.

    param_groups lists every part's groups (train_step sets the scheduled LR on each); zero_grad and step
    go to every part; `parts` names them, and a checkpoint stores each part's state under its name.
    """

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

    def state_dict(self):
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state):
        for name, opt in self.parts.items():
            opt.load_state_dict(state[name])


def set_lr(optimizer, lr):
    """The scheduled LR on every param group, times the group's lr_scale (Muon's: --muon_lr / --max_lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def per_part(optimizer, fn, *states):
    """fn(optimizer, *states) for a lone optimizer; {name: fn(part, *states[name])} for a CombinedOptimizer.

    This is the checkpoint format: "optimizer" holds AdamW's state dict as it always has, or with Muon
    {"adamw": ..., "muon": ...}, one state dict per part.
    """
    if isinstance(optimizer, CombinedOptimizer):
        return {name: fn(opt, *(s[name] for s in states)) for name, opt in optimizer.parts.items()}
    return fn(optimizer, *states)


# =============================================================================
# Schedules: learning rate and batch size, both functions of where the run is
# =============================================================================

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
    """GPT-3's ramp: tokens in the next step, linear from `start` to total over the first ramp_tokens.

    Rounded down to a multiple of unit = B*T*world_size (one micro-step on every rank), at least one unit.
    """
    if ramp_tokens <= 0 or tokens_seen >= ramp_tokens:
        return total_batch_size
    start = min(start, total_batch_size)
    size = start + (total_batch_size - start) * tokens_seen / ramp_tokens
    return max(unit, int(size) // unit * unit)




# =============================================================================
# Distributed: processes, wrapping the model in FSDP / DDP, all-reduce helpers
# =============================================================================

def resolve_device(name):
    """hellaswag.resolve_device (auto = cuda > mps > cpu, checked to exist) with our one-line UsageError."""
    try:
        return hellaswag.resolve_device(name)
    except ValueError as e:
        raise UsageError(f"--device: {e}") from None


def autocast_for(dtype, device_type):
    """(autocast context, uses bf16) for --dtype auto|fp32|bf16: auto is bf16 on CUDA and fp32 elsewhere."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device_type == "cuda")
    try:
        return hellaswag.autocast(device_type, torch.bfloat16 if use_bf16 else None), use_bf16
    except ValueError as e:  # torch would have run fp32 in silence
        raise UsageError(f"--dtype {dtype}: {e}; use --dtype fp32") from None


@dataclass
class Dist:
    """This process's place in the run (torchrun's RANK, LOCAL_RANK, WORLD_SIZE) and its device."""
    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    device: str
    _long_wait_group: object = None

    @property
    def master(self):
        return self.rank == 0

    @property
    def device_type(self):
        return self.device.split(":")[0]  # autocast, fused AdamW and synchronize want 'cuda', never 'cuda:3'

    def print0(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs, flush=True)

    def agree(self, ok, long_wait=False):
        """True when ok is true on every rank; also a barrier. long_wait: on a gloo group that waits 48 h."""
        flag = torch.tensor(1.0 if ok else 0.0, device="cpu" if long_wait else self.device)
        if self.world_size > 1:
            import datetime
            import torch.distributed as dist

            group = None
            if long_wait:
                if self._long_wait_group is None:
                    self._long_wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=48))
                group = self._long_wait_group
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return flag.item() == 1.0


def setup_distributed(args):
    """A Dist from torchrun's environment (one process without it), with the process group started."""
    import torch.distributed as dist

    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.fsdp and not ddp:
        raise UsageError("--fsdp shards the model across processes: launch with torchrun")
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(args.device)
    if ddp and device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) on this node: "
                             f"ask torchrun for at most that many processes per node", rank_specific=True)
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return Dist(ddp, rank, local_rank, world_size, device)


def shard_model(raw_model, use_bf16):
    """FSDP2 on every block and then the root (embeddings, tied lm_head, ln_f); in place."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16 compute and all-gathers, fp32 gradient reduction and master weights
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16 else MixedPrecisionPolicy()
    for block in raw_model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(raw_model, mp_policy=mp)


def wrap_for_training(raw_model, use_compile, dist, fsdp):
    """(the model the training step calls, whether DDP should sync gradients only on the last micro-step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.compile(raw_model) if use_compile else raw_model
    if dist.ddp and not fsdp:
        model = DDP(model, device_ids=[dist.local_rank] if dist.device_type == "cuda" else None)
        return model, True
    return model, False  # FSDP reduce-scatters every micro-step to keep gradients sharded



def all_reduce_sum(t, world_size):
    import torch.distributed as dist

    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t, world_size):
    all_reduce_sum(t, world_size)  # gloo has no AVG: sum, then divide
    return t / world_size



# =============================================================================
# Checkpoints and the run log
# =============================================================================

@dataclass
class TrainState:
    """Where a run stands: everything a checkpoint holds besides the weights and the optimizer state.

    save_checkpoint writes these fields as the checkpoint's top-level keys and resuming reads them back,
    so a run continues bit-exactly: same batches, same random numbers, same schedule position.
    """
    step: int = -1  # the last optimizer step taken (and included in a checkpoint); -1 before the first
    tokens_seen: int = 0  # train tokens consumed so far (the batch-size ramp depends on it)
    val_loss: float | None = None  # the latest val loss
    loader: dict | None = None  # the train loader's position, DataLoaderLite.state_dict()
    rng: dict | None = None  # python, numpy, torch (and CUDA) generator states
    args: dict | None = None  # the run's flags

    @classmethod
    def from_checkpoint(cls, ckpt):
        fields = {k: ckpt[k] for k in ("step", "val_loss", "loader", "rng", "args")}
        # checkpoints written before the batch ramp existed have no tokens_seen: every step was a full batch
        fields["tokens_seen"] = ckpt.get("tokens_seen", (ckpt["step"] + 1) * ckpt["args"]["total_batch_size"])
        return cls(**fields)


CKPT_RE = re.compile(r"model_(\d+)\.pt$")
CKPT_KEYS = ("model", "config", "optimizer") + tuple(TrainState.__dataclass_fields__)


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"model_{step:05d}.pt")


def checkpoint_step(path):
    return int(CKPT_RE.search(os.path.basename(path)).group(1))


def find_checkpoints(log_dir):
    """Checkpoint paths in log_dir, oldest step first."""
    found = []
    for path in glob.glob(os.path.join(log_dir, "model_*.pt")):
        m = CKPT_RE.search(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def full_state_dicts(raw_model, optimizer):
    """Unsharded model and optimizer state, keyed by parameter name, on CPU.

    The same format comes out of a plain, DDP or FSDP model, so a checkpoint moves freely between them.
    Under FSDP this gathers the shards: every rank must call it (rank 0 gets the tensors).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim_sd = per_part(optimizer, lambda opt: get_optimizer_state_dict(raw_model, opt, options=opts))
    return get_model_state_dict(raw_model, options=opts), optim_sd


def load_full_state_dicts(raw_model, optimizer, model_sd, optim_sd):
    """Inverse of full_state_dicts; under FSDP each rank keeps its own shard of what it is given."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(raw_model, model_sd, options=opts)

    def load(opt, sd):
        # the kernel choice belongs to this machine, and Muon's LR ratio to this invocation's flags,
        # not to the run that wrote the checkpoint
        keep = [{k: g[k] for k in ("fused", "foreach", "lr_scale") if k in g} for g in opt.param_groups]
        set_optimizer_state_dict(raw_model, opt, sd, options=opts)
        for group, kept in zip(opt.param_groups, keep):
            group.update(kept)

    if optimizer is not None:
        per_part(optimizer, load, optim_sd)




def save_checkpoint(path, raw_model, optimizer, state, train_loader, master=True):
    """Write the model, optimizer and TrainState to path atomically. Every rank calls it (FSDP gathers)."""
    model_sd, optim_sd = full_state_dicts(raw_model, optimizer)
    if not master:
        return
    state.loader, state.rng = train_loader.state_dict(), rng_state()
    ckpt = {"model": model_sd, "config": asdict(raw_model.config), "optimizer": optim_sd, **asdict(state)}
    atomic_write(path, lambda f: torch.save(ckpt, f))  # a crash mid-write never leaves a truncated model_*.pt


def restore_checkpoint(ckpt, raw_model, optimizer, train_loader):
    """Load a checkpoint dict into the model, optimizer, loader and RNGs; returns its TrainState."""
    state = TrainState.from_checkpoint(ckpt)
    load_full_state_dicts(raw_model, optimizer, ckpt["model"], ckpt["optimizer"])
    train_loader.load_state_dict(state.loader)
    set_rng_state(state.rng)
    return state


def read_checkpoint(path, map_location="cpu", keys=("model", "config")):
    """The dict in one of our checkpoints, or a UsageError saying why it cannot be used."""
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # truncated, or not a torch file at all
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UsageError(f"{path} is not a train_gpt2.py checkpoint (no {', '.join(missing)})")
    return ckpt


def find_resume_checkpoint(resume, log_dir, print0):
    """(path, checkpoint dict) for --resume latest|PATH; latest skips unreadable newer files with a warning."""
    if resume != "latest":
        if not os.path.isfile(resume):
            raise UsageError(f"--resume {resume}: no such checkpoint")
        return resume, read_checkpoint(resume, keys=CKPT_KEYS[:-1])
    found = find_checkpoints(log_dir)
    if not found:
        raise UsageError(f"--resume latest: no model_*.pt checkpoint in {log_dir}")
    for path in reversed(found):
        try:
            return path, read_checkpoint(path, keys=CKPT_KEYS[:-1])  # tokens_seen: optional in old files
        except UsageError as e:
            print0(f"warning: skipping {e}")
    raise UsageError(f"--resume latest: none of the {len(found)} checkpoints in {log_dir} is readable")


def load_checkpoint_model(path, map_location="cpu"):
    """The GPT stored in one of our checkpoints (model_*.pt), in fp32."""
    ckpt = read_checkpoint(path, map_location)
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model


def prune_checkpoints(log_dir, keep_last):
    """Delete all but the newest keep_last model_*.pt (0 keeps all); returns the deleted paths.

    The newest is the one just saved: a resumed run set any of later steps aside when it started
    (set_aside_later_checkpoints).
    """
    if keep_last <= 0:
        return []
    old = find_checkpoints(log_dir)[:-keep_last]
    for path in old:
        os.remove(path)
    return old


class LogDirLock:
    """One run per log dir: an exclusive lock on <log_dir>/.lock, held for the life of the run.

    flock is released by the OS when the process dies, kill -9 included, so a crash never leaves a stale
    lock. The file holds the owner's pid and host for the message a second run prints.
    """

    def __init__(self, log_dir):
        self.path = os.path.join(log_dir, ".lock")
        self.file = None

    def acquire(self, wait_for_owner=10.0):
        """Take the lock, or raise a UsageError naming the live process that holds it.

        The owner writes its line just after it takes the lock, over whatever a killed run left there, so a
        second run can find the file empty or naming a dead process for a moment: it re-reads (and re-tries
        the lock, in case the owner has ended) for up to wait_for_owner seconds until the line names a live one.
        """
        import fcntl
        import socket

        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            f = open(self.path, "a+")
        except OSError as e:  # a file in the way, no permission, a read-only filesystem
            raise UsageError(f"--log_dir {os.path.dirname(self.path)}: cannot write there ({e.strerror or e})") from None
        deadline = time.monotonic() + wait_for_owner
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                owner = self._live_owner(f)
            if owner is not None or time.monotonic() > deadline:
                f.close()
                raise UsageError(f"{os.path.dirname(self.path)} is in use by a live run ({owner or 'another process'}): "
                                 f"wait for it to end, or choose another --log_dir") from None
            time.sleep(0.02)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self.file = f

    @staticmethod
    def _live_owner(f):
        """'pid N on HOST' from the lock file when it is a whole line naming a live process (as far as this
        host can tell), else None."""
        import socket

        f.seek(0)
        text = f.read()
        m = re.fullmatch(r"pid (\d+) on (.+)\n", text)
        if m is None:
            return None
        if m.group(2) == socket.gethostname():
            try:
                os.kill(int(m.group(1)), 0)
            except (ProcessLookupError, OverflowError):
                return None  # a killed run's line, not yet replaced by the owner's
            except PermissionError:
                pass  # alive, another user's
        return text.strip()

    def release(self):
        if self.file is not None:
            self.file.close()  # closing the file releases the lock
            self.file = None


def clear_log_dir(log_dir, resume_step, overwrite):
    """Get log_dir ready for this run (the lock is held): never clobber an earlier run by accident.

    Removes temp files a crash left; a resumed run sets later checkpoints aside and drops the log lines
    written after its checkpoint; --overwrite deletes an earlier run's log and checkpoints; anything else
    with an earlier run is refused. Returns the warnings to print.
    """
    for tmp in glob.glob(os.path.join(log_dir, "*.tmp")):
        os.remove(tmp)
    log_file = os.path.join(log_dir, "log.txt")
    if resume_step is not None:
        moved = set_aside_later_checkpoints(log_dir, resume_step)
        damaged = truncate_log(log_file, resume_step)
        return [w for w in (moved, damaged and f"dropped {damaged} damaged line(s) from {log_file}") if w]
    earlier = (os.path.exists(log_file) and os.path.getsize(log_file) > 0) or find_checkpoints(log_dir)
    if earlier and not overwrite:
        raise UsageError(f"{log_dir} holds an earlier run (log.txt or model_*.pt): pass --resume latest "
                         f"to continue it, --overwrite to start afresh, or another --log_dir")
    for path in find_checkpoints(log_dir):
        os.remove(path)
    open(log_file, "w").close()
    return []


def set_aside_later_checkpoints(log_dir, resume_step):
    """Move checkpoints of steps after the resumed one, and a copy of log.txt, into a new folder in log_dir.

    They come from a rollback (--resume PATH to an earlier step) or are newer files too damaged to resume.
    Left in place, the run would replace them one by one and --resume latest could pick up one of the
    abandoned steps. Returns a warning naming the folder, or None when there are none.
    """
    later = [p for p in find_checkpoints(log_dir) if checkpoint_step(p) > resume_step]
    if not later:
        return None
    base = dest = os.path.join(log_dir, f"after_step_{resume_step:05d}")
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = f"{base}_{n}"
    os.makedirs(dest)
    log_file = os.path.join(log_dir, "log.txt")
    if os.path.exists(log_file):
        shutil.copy2(log_file, os.path.join(dest, "log.txt"))
    for path in later:
        os.replace(path, os.path.join(dest, os.path.basename(path)))
    return (f"resuming at step {resume_step}: {len(later)} later checkpoint(s) and a copy of log.txt "
            f"moved to {dest}")


# log.txt: one `step kind value` line per number, written and parsed only here

LOG_FORMATS = {"train": "{:.6f}", "val": "{:.4f}", "hella": "{:.4f}"}


def format_log_line(step, kind, value):
    return f"{step} {kind} {LOG_FORMATS[kind].format(value)}\n"


def append_log(path, step, kind, value):
    with open(path, "a") as f:
        f.write(format_log_line(step, kind, value))


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
    """{kind: (steps, values)} for the kinds present in a log.txt ('train', 'val', 'hella'); bad lines skipped."""
    series = {}
    with open(path, errors="replace") as f:
        for line in f:
            parsed = parse_log_line(line)
            if parsed is not None:
                steps, values = series.setdefault(parsed[1], ([], []))
                steps.append(parsed[0])
                values.append(parsed[2])
    return series


def truncate_log(path, last_step):
    """Keep the lines up to last_step, so a resumed run continues cleanly; returns how many damaged lines
    were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, errors="replace") as f:
        lines = [(line, parse_log_line(line)) for line in f if line.strip()]
    kept = [line for line, parsed in lines if parsed is not None and parsed[0] <= last_step]
    atomic_write(path, lambda f: f.writelines(line.encode() for line in kept))
    return sum(parsed is None for _, parsed in lines)


# =============================================================================
# Evaluation: val loss, the HellaSwag hand-off, samples
# =============================================================================


@torch.no_grad()
def evaluate_loss(model, loader, n_tokens, device, autocast_ctx, world_size=1):
    """Mean loss over the first n_tokens targets of the loader's split, all ranks together.

    The loader's windows tile the stream the same way for any B and process count, so this is the same
    set of tokens everywhere; targets past n_tokens are ignored (-100). Every rank runs the same number
    of forward passes, as FSDP needs.
    """
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
    all_reduce_sum(total, world_size)
    return (total[0] / total[1]).item()


def hellaswag_ready(every, dist):
    """True when HellaSwag's val data can be had on every rank; else False after one warning."""
    if every <= 0:
        return False
    ok = True
    for turn in ("master", "others"):  # the master downloads first, the other ranks then find the file
        if dist.master == (turn == "master"):
            try:
                hellaswag.download("val")
            except hellaswag.HellaSwagUnavailable as e:
                print(f"warning: HellaSwag evaluation turned off: {e}", flush=True)
                ok = False
        ok = dist.agree(ok)  # also the barrier between the turns
    return ok


def print_samples(raw_model, enc, args, dist, autocast_ctx):
    """num_samples continuations of the sample prompt from each rank (its own seed), printed."""
    gen = torch.Generator(device=dist.device).manual_seed(args.seed + dist.rank)
    prompt = torch.tensor(encode_prompt(enc, args.sample_prompt), dtype=torch.long, device=dist.device)
    prompt = prompt.unsqueeze(0).repeat(args.num_samples, 1)
    with autocast_ctx:
        out = raw_model.generate(prompt, args.sample_tokens, top_k=50, generator=gen)
    for i in range(args.num_samples):
        print(f"rank {dist.rank} sample {i}: {enc.decode(out[i].tolist())}", flush=True)


# =============================================================================
# The training loop
# =============================================================================

# ---- phase 1: run settings, every flag checked before any work

@dataclass
class Settings:
    """What the flags (and a checkpoint being resumed) decide, worked out once before anything is written."""
    config: GPTConfig
    grad_accum: int  # micro-steps per optimizer step at the full batch (check_batch's result)
    unit: int  # tokens of one micro-step over all ranks: B * T * world_size
    val_tokens: int
    autocast_ctx: object
    use_bf16: bool
    use_compile: bool
    enc: object = None  # the GPT-2 tokenizer, when samples are on
    resume_path: str | None = None
    ckpt: dict | None = None  # the checkpoint being resumed; dropped once it is restored
    pretrained: GPT | None = None  # --init_from's model


# flags that belong to one invocation: a resumed run takes every other flag it is not given from its checkpoint
PER_INVOCATION = {"resume", "overwrite", "stop_step", "device", "dtype", "compile", "profile", "profile_schedule",
                  "wandb_project", "wandb_run_name", "log_dir", "init_from", "keep_last", "peak_flops", "fsdp"}
SCHEDULE_FLAGS = ("max_steps", "max_lr", "warmup_steps", "total_batch_size", "batch_ramp_tokens",
                  "batch_ramp_start", "seed")


def run_flags(args):
    """The flags as a plain dict, as logged and stored in checkpoints."""
    return {k: v for k, v in vars(args).items() if k != "given"}


def check_flags(args):
    """One-line UsageErrors for values and flag pairs that cannot work; returns warnings for dubious ones."""
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    for key in ("max_steps", "total_batch_size", "micro_batch_size", "sequence_length", "batch_ramp_start"):
        need(getattr(args, key) > 0, f"--{key} must be positive, not {getattr(args, key)}")
    need(args.max_lr > 0 and math.isfinite(args.max_lr), f"--max_lr must be a positive number, not {args.max_lr}")
    need(0 <= args.min_lr_ratio <= 1, f"--min_lr_ratio must be in [0, 1], not {args.min_lr_ratio}")
    need(math.isfinite(args.weight_decay), f"--weight_decay must be a finite number, not {args.weight_decay}")
    for key in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "sample_every", "hellaswag_every",
                "save_every", "keep_last", "batch_ramp_tokens"):
        need(getattr(args, key) >= 0, f"--{key} must be >= 0, not {getattr(args, key)}")
    for key in ("val_steps", "hellaswag_limit", "stop_step", "peak_flops"):
        need(getattr(args, key) is None or getattr(args, key) > 0, f"--{key} must be positive, not {getattr(args, key)}")
    if args.eval_every > 0:
        need(args.val_tokens > 0, f"--val_tokens must be positive while val is on (--eval_every {args.eval_every})")
    if args.sample_every > 0:
        need(args.num_samples > 0 and args.sample_tokens > 0,
             "--num_samples and --sample_tokens must be positive while samples are on (--sample_every 0 turns them off)")
    need(not ({"val_steps", "val_tokens"} <= args.given), "--val_steps and --val_tokens both set the val size: give one")
    need(not (args.resume and args.overwrite), "--resume continues the run in log_dir, --overwrite deletes it: give one")
    need(not (args.resume and args.init_from), "--resume continues a checkpoint, --init_from starts from OpenAI's "
                                               "weights: give one")
    shape = sorted(f"--{k}" if k != "bias" else "--[no-]bias" for k in SHAPE_FLAGS if k in args.given)
    need(not (args.init_from and shape), f"--init_from takes the model's shape from the weights: drop {', '.join(shape)}")
    for key in ("log_dir", "data_root"):  # a file where a folder goes: found now, not once the run has started
        path = getattr(args, key)
        need(not os.path.exists(path) or os.path.isdir(path), f"--{key} {path} is a file, not a folder")
    need(args.muon_lr is None or (args.muon_lr > 0 and math.isfinite(args.muon_lr)),
         f"--muon_lr must be a positive number, not {args.muon_lr}")
    need(0 <= args.muon_momentum < 1, f"--muon_momentum must be in [0, 1), not {args.muon_momentum}")
    need(0 < args.muon_ns_steps < 100, f"--muon_ns_steps must be in 1..99, not {args.muon_ns_steps}")
    if args.profile:
        parse_profile_schedule(args.profile_schedule)
    warnings = []
    if args.warmup_steps >= args.max_steps:
        warnings.append(f"--warmup_steps {args.warmup_steps} >= --max_steps {args.max_steps}: the LR never leaves warmup")
    if args.init_from and "preset" in args.given:
        warnings.append(f"--init_from {args.init_from}: --preset {args.preset} gives only run settings, not the shape")
    # flags given for a part of the run that is off: stated, not dropped in silence
    off = {"--eval_every 0": ("val_tokens", "val_steps") if args.eval_every <= 0 else (),
           "--sample_every 0": ("sample_prompt", "num_samples", "sample_tokens") if args.sample_every <= 0 else (),
           "--hellaswag_every 0": ("hellaswag_limit",) if args.hellaswag_every <= 0 else (),
           "no --batch_ramp_tokens": ("batch_ramp_start",) if args.batch_ramp_tokens <= 0 else (),
           "no --profile": ("profile_schedule",) if not args.profile else (),
           "no --wandb_project": ("wandb_run_name",) if not args.wandb_project else ()}
    for why, keys in off.items():
        unused = [f"--{k}" for k in keys if k in args.given]
        if unused:
            warnings.append(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with {why}")
    return warnings


def adopt_checkpoint_flags(args, saved, print0):
    """Resuming: flags not given now take the checkpoint's values; given schedule flags that differ warn."""
    # --val_steps and --val_tokens are two ways to give one number: the one given now wins over the other's
    # saved value (else a --val_tokens given now would be dropped in silence for a saved --val_steps)
    replaced = {"val_tokens": "val_steps", "val_steps": "val_tokens"}
    for key, value in saved.items():
        if key in PER_INVOCATION or not hasattr(args, key) or replaced.get(key) in args.given:
            continue
        if key not in args.given:
            setattr(args, key, value)
        elif key in SCHEDULE_FLAGS and getattr(args, key) != value:
            print0(f"warning: --{key} is {getattr(args, key)} now but was {value} in the checkpoint")


def check_optimizer(args, ckpt, path):
    """Resuming: the checkpoint's optimizer state must be of the kind --optimizer asks for; returns warnings."""
    if ckpt is not None:
        saved = ckpt["args"].get("optimizer", "adamw")  # checkpoints from before --optimizer hold AdamW's state
        if args.optimizer != saved:
            raise UsageError(f"{path} holds {saved} optimizer state but --optimizer {args.optimizer} was given: "
                             f"resume with --optimizer {saved} (or without the flag), or start a new run")
    ignored = sorted(f"--{k}" for k in args.given if k.startswith("muon_"))
    if args.optimizer != "muon" and ignored:
        return [f"{', '.join(ignored)}: Muon's flags, ignored without --optimizer muon"]
    return []


def model_config_from_args(args):
    shape = dict(MODEL_PRESETS[args.preset])
    for key in ("n_layer", "n_head", "n_embd", "block_size", "n_kv_head"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    shape.update(dropout=args.dropout, bias=args.bias)
    try:
        return GPTConfig(**shape)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resumed_config(args, ckpt, path):
    """The checkpoint's model shape; shape flags given now must agree with it."""
    config = GPTConfig(**ckpt["config"])
    asked = asdict(model_config_from_args(args))
    keys = set(SHAPE_FLAGS + ("dropout",)) & args.given
    if "preset" in args.given:
        keys |= set(MODEL_PRESETS[args.preset])
    differ = sorted(k for k in keys if asked[k] != getattr(config, k))
    if differ:
        raise UsageError(f"{path} holds a model with {', '.join(f'{k}={getattr(config, k)}' for k in differ)}; the flags "
                         f"ask for {', '.join(f'{k}={asked[k]}' for k in differ)} (a resumed run needs no shape flags)")
    return config


def check_batch(args, world_size, block_size):
    """grad_accum_steps, or a UsageError naming what does not fit."""
    B, T = args.micro_batch_size, args.sequence_length
    if T > block_size:
        raise UsageError(f"-T {T} is longer than the model's block_size {block_size}")
    per_step = B * T * world_size
    if args.total_batch_size % per_step != 0:
        raise UsageError(f"--total_batch_size {args.total_batch_size} is not divisible by B*T*world_size = "
                         f"{B}*{T}*{world_size} = {per_step}")
    return args.total_batch_size // per_step


def encode_prompt(enc, text):
    """Token ids of a prompt; an empty prompt starts from <|endoftext|>, as a new document would."""
    return enc.encode(text, allowed_special={"<|endoftext|>"}) or [EOT]


def sample_tokenizer(args, block_size):
    """The GPT-2 tokenizer when samples are on, once the prompt and sample length are known to fit."""
    if args.sample_every <= 0:
        return None
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    n = len(encode_prompt(enc, args.sample_prompt))
    if n + args.sample_tokens > block_size:
        raise UsageError(f"--sample_prompt ({n} tokens) + --sample_tokens ({args.sample_tokens}) exceeds the model's "
                         f"block_size {block_size}: shorten them, or turn samples off with --sample_every 0")
    return enc


def open_resumed_run(args, print0):
    """--resume: (path, checkpoint, model config), the checkpoint's flags taken where none is given now."""
    path, ckpt = find_resume_checkpoint(args.resume, args.log_dir, print0)
    adopt_checkpoint_flags(args, ckpt["args"], print0)
    end_step = args.max_steps if args.stop_step is None else min(args.max_steps, args.stop_step)
    # nothing left but the final evaluation (ckpt at max_steps - 1) is fine; nothing at all is a mistake
    if ckpt["step"] + 1 >= end_step and ckpt["step"] + 1 != args.max_steps:
        raise UsageError(f"{path} is at step {ckpt['step']}: --max_steps {args.max_steps}"
                         + (f" / --stop_step {args.stop_step}" if args.stop_step is not None else "")
                         + " leave nothing to train")
    return path, ckpt, resumed_config(args, ckpt, path)


def resolve_settings(args, dist):
    """Phase 1: check every flag, find the checkpoint to resume, and work out the run's settings."""
    check_flags(args)  # the flags as given, before anything is read
    resume_path, ckpt, pretrained = None, None, None
    if args.resume:
        resume_path, ckpt, config = open_resumed_run(args, dist.print0)
    elif args.init_from:
        pretrained = GPT.from_pretrained(args.init_from, dropout=args.dropout)
        config = pretrained.config
    else:
        config = model_config_from_args(args)
    warnings = check_flags(args)  # on the values the run will have (a resumed run's come from its checkpoint)
    for warning in warnings + check_optimizer(args, ckpt, resume_path):  # after a resume adopted --optimizer
        dist.print0(f"warning: {warning}")
    grad_accum = check_batch(args, dist.world_size, config.block_size)
    unit = args.micro_batch_size * args.sequence_length * dist.world_size
    autocast_ctx, use_bf16 = autocast_for(args.dtype, dist.device_type)
    hellaswag.enable_tf32(dist.device_type)  # TF32 for the fp32 matmuls that remain
    return Settings(config=config, grad_accum=grad_accum, unit=unit,
                    val_tokens=args.val_steps * unit if args.val_steps is not None else args.val_tokens,
                    autocast_ctx=autocast_ctx, use_bf16=use_bf16,
                    use_compile=args.compile if args.compile is not None else dist.device_type == "cuda",
                    enc=sample_tokenizer(args, config.block_size), resume_path=resume_path, ckpt=ckpt,
                    pretrained=pretrained)


# ---- phase 2: one run per log dir

@contextlib.contextmanager
def claim_log_dir(args, settings, dist):
    """Rank 0 locks log_dir for the whole run and readies it; every rank stops if it cannot."""
    lock, error = LogDirLock(args.log_dir), None
    if dist.master:
        try:
            lock.acquire()
            for warning in clear_log_dir(args.log_dir, settings.ckpt["step"] if settings.ckpt else None, args.overwrite):
                print(f"warning: {warning}", flush=True)
        except UsageError as e:
            error = e
    if not dist.agree(error is None):
        lock.release()
        raise error or UsageError("rank 0 could not claim the log dir (see its message)")
    try:
        yield
    finally:
        lock.release()


# ---- phases 3-5: data, model and optimizer, restored state

def open_data(args, settings, dist):
    """Train and val loaders, the shards prepared first if data_root has none."""
    ensure_data(args, args.max_steps * args.total_batch_size, settings.val_tokens, dist)
    return [DataLoaderLite(args.micro_batch_size, args.sequence_length, dist.rank, dist.world_size, split,
                           args.data_root, args.seed, settings.config.real_vocab_size) for split in ("train", "val")]


def build_model(args, settings, dist):
    """The raw model (a seeded init or OpenAI's weights) on its device, sharded under --fsdp, and its optimizer."""
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    raw_model = settings.pretrained if settings.pretrained is not None else GPT(settings.config)
    raw_model = raw_model.to(dist.device)
    settings.pretrained = None
    dist.print0(f"model: {raw_model.get_num_params():,} parameters")
    if args.fsdp:
        shard_model(raw_model, settings.use_bf16)
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, dist.device_type, verbose=dist.master,
                                               muon=muon_settings(args))
    return raw_model, optimizer


def restore_state(args, settings, raw_model, optimizer, train_loader, dist):
    """The checkpoint's TrainState loaded into model, optimizer, loader and RNGs; a fresh one otherwise."""
    state = TrainState()
    if settings.ckpt is not None:
        state = restore_checkpoint(settings.ckpt, raw_model, optimizer, train_loader)
        dist.print0(f"resumed from {settings.resume_path} at step {state.step + 1}")
        settings.ckpt = None  # the weights live in the model now
    state.args = run_flags(args)
    return state


# ---- phase 6: the loop

@dataclass
class Run:
    """What the loop works with, built by train()'s phases."""
    args: argparse.Namespace
    dist: Dist
    settings: Settings
    raw_model: GPT  # unwrapped, uncompiled: saved, evaluated on HellaSwag, sampled
    model: nn.Module  # what the training step calls: compiled and/or DDP-wrapped
    sync_once: bool  # DDP: all-reduce gradients on the last micro-step only
    optimizer: torch.optim.Optimizer
    train_loader: DataLoaderLite
    val_loader: DataLoaderLite
    metrics: Metrics
    hellaswag_on: bool
    last_saved: int = -1  # the step of the newest checkpoint this run has (or resumed from)


def start_run(args, settings, dist, raw_model, optimizer, loaders, state):
    """The compiled / DDP-wrapped model and the run's outputs (log.txt, W&B, HellaSwag) around the raw one."""
    model, sync_once = wrap_for_training(raw_model, settings.use_compile, dist, args.fsdp)
    run_config = {**run_flags(args), "world_size": dist.world_size, "model": asdict(settings.config)}
    wandb_run = init_wandb(args, run_config) if args.wandb_project and dist.master else None
    metrics = Metrics(os.path.join(args.log_dir, "log.txt"), dist.master, wandb_run)
    return Run(args, dist, settings, raw_model, model, sync_once, optimizer, *loaders, metrics,
               hellaswag_on=hellaswag_ready(args.hellaswag_every, dist), last_saved=state.step)


def forward_backward(model, loader, grad_accum_steps, device, autocast_ctx, ddp=False):
    """Accumulate the gradients of one optimizer step; returns the mean micro-batch loss (detached)."""
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if ddp:
            # all-reduce the gradients only once, on the last micro-step
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        with autocast_ctx:
            _, loss = model(x, y)
        # each micro-step's loss is a mean over B*T tokens: scale so the sum over steps is the mean
        loss = loss / grad_accum_steps
        loss_accum += loss.detach()
        loss.backward()
    return loss_accum



@dataclass
class StepStats:
    loss: float  # mean over the step's tokens, all ranks
    norm: float  # global gradient norm before clipping
    lr: float
    dt: float  # seconds, the GPU's work included
    batch_size: int  # tokens in this step, all ranks


def train_step(run, state, step):
    """One optimizer step: accumulate the batch's gradients, clip, set the scheduled LR, update."""
    args, s, dist = run.args, run.settings, run.dist
    t0 = time.time()
    batch_size = batch_size_at(state.tokens_seen, args.batch_ramp_tokens, args.total_batch_size, s.unit,
                               args.batch_ramp_start)
    run.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(run.model, run.train_loader, batch_size // s.unit, dist.device, s.autocast_ctx, run.sync_once)
    loss = all_reduce_mean(loss, dist.world_size)
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.grad_clip if args.grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
        norm = norm.full_tensor()
    lr = get_lr(step, args.max_lr, args.max_lr * args.min_lr_ratio, args.warmup_steps, args.max_steps)
    set_lr(run.optimizer, lr)
    run.optimizer.step()
    if dist.device_type == "cuda":
        torch.cuda.synchronize()  # so dt measures the GPU work, not just the launches
    dt = time.time() - t0
    state.step, state.tokens_seen = step, state.tokens_seen + batch_size
    return StepStats(loss.item(), norm.item(), lr, dt, batch_size)


def evaluate_due(run, state, step, final=False):
    """The every-N actions due at `step`, side by side: val loss, HellaSwag, samples (all of them when final)."""
    args, dist, s = run.args, run.dist, run.settings

    def due(every):
        return every > 0 and (final or step % every == 0)

    if due(args.eval_every):
        state.val_loss = evaluate_loss(run.model, run.val_loader, s.val_tokens, dist.device, s.autocast_ctx, dist.world_size)
        dist.print0(f"validation loss: {state.val_loss:.4f}")
        run.metrics.log(step, "val", state.val_loss)
    if run.hellaswag_on and due(args.hellaswag_every):
        run_hellaswag(run, step)
    if due(args.sample_every) and step > 0:
        print_samples(run.raw_model, s.enc, args, dist, s.autocast_ctx)


def run_hellaswag(run, step):
    """HellaSwag acc_norm of the raw model, split over the ranks; logged as `hella`."""
    dist = run.dist
    try:
        res = hellaswag.evaluate(run.raw_model, dist.device, limit=run.args.hellaswag_limit, rank=dist.rank,
                                 world_size=dist.world_size, device_type=dist.device_type,
                                 autocast_dtype=torch.bfloat16 if run.settings.use_bf16 else None)
    except hellaswag.HellaSwagUnavailable as e:  # e.g. the file went away mid-run
        dist.print0(f"warning: HellaSwag evaluation turned off: {e}")
        run.hellaswag_on = False
        return
    dist.print0(f"HellaSwag accuracy: {res['correct_norm']}/{res['n']}={res['acc_norm']:.4f}")
    run.metrics.log(step, "hella", res["acc_norm"])


def save(run, state):
    """Checkpoint the model after step state.step, then prune old ones (--keep_last)."""
    path = checkpoint_path(run.args.log_dir, state.step)
    save_checkpoint(path, run.raw_model, run.optimizer, state, run.train_loader, run.dist.master)
    run.last_saved = state.step
    if run.dist.master:
        prune_checkpoints(run.args.log_dir, run.args.keep_last)
    run.dist.print0(f"saved {path}")
    return path


def guarded(run, state, what, step, action):
    """Run an every-N action; if it fails, keep what was trained: checkpoint the last step, then stop."""
    try:
        action()
    except UsageError:
        raise
    except Exception as e:
        saved = None
        if state.step >= 0:
            saved = checkpoint_path(run.args.log_dir, state.step) if run.last_saved == state.step else save(run, state)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"{what} at step {step} failed ({type(e).__name__}: {first})"
                         + (f"; {saved} holds step {state.step}: continue with --resume latest" if saved else "")) from None


def training_loop(run, state):
    args = run.args
    end_step = args.max_steps if args.stop_step is None else min(args.max_steps, args.stop_step)
    reporter = StepReporter(run, state.step + 1, end_step)
    profiler = Profiler(args, run.dist) if args.profile else None
    if state.step == args.max_steps - 1:
        # resumed from the last step's checkpoint: the final evaluation failed or died after it was saved (and
        # the resume dropped its log lines), so running it is all that is left to do
        guarded(run, state, "final evaluation", args.max_steps,
                lambda: evaluate_due(run, state, args.max_steps, final=True))
    for step in range(state.step + 1, end_step):
        last_step = step == args.max_steps - 1
        guarded(run, state, "evaluation", step, lambda: evaluate_due(run, state, step))  # the model after `step` updates

        # ==================== training step ====================
        stats = train_step(run, state, step)
        guarded(run, state, "logging", step, lambda: reporter.report(step, stats))
        if profiler is not None and profiler.step():
            break  # --profile exit
        if last_step or step == end_step - 1 or (args.save_every > 0 and step > 0 and step % args.save_every == 0):
            save(run, state)  # model_{step}.pt includes step `step`
        if last_step:  # the final model, evaluated once its checkpoint is safe
            guarded(run, state, "final evaluation", args.max_steps,
                    lambda: evaluate_due(run, state, args.max_steps, final=True))


def train(args):
    """A training run, phase by phase."""
    dist = setup_distributed(args)  # processes: torchrun's ranks, this rank's device
    settings = resolve_settings(args, dist)  # every flag checked; the checkpoint to resume read
    dist.print0("run config:", {**run_flags(args), "device": dist.device, "world_size": dist.world_size,
                                "grad_accum_steps": settings.grad_accum, "bf16": settings.use_bf16,
                                "compile": settings.use_compile, "val_tokens": settings.val_tokens,
                                "model": asdict(settings.config)})
    with claim_log_dir(args, settings, dist):  # one run per log dir, locked until the end
        loaders = open_data(args, settings, dist)  # shards, prepared on first use
        raw_model, optimizer = build_model(args, settings, dist)
        state = restore_state(args, settings, raw_model, optimizer, loaders[0], dist)
        run = start_run(args, settings, dist, raw_model, optimizer, loaders, state)
        training_loop(run, state)
        guarded(run, state, "finishing W&B", state.step, run.metrics.finish)  # uploads: can fail after all
        if args.fsdp:
            raw_model.reshard()  # FSDP leaves the root's gathered parameters after an eval forward: free them
        dist.agree(True)  # every rank done with its collectives before the process group goes away


# ---- what a run reports: the step line, log.txt, W&B, the profiler

class Metrics:
    """Where a run's numbers go: log.txt on the master process, and W&B when --wandb_project is set."""

    def __init__(self, log_file, master, wandb_run=None):
        self.log_file, self.master, self.wandb_run = log_file, master, wandb_run

    def log(self, step, kind, value, **extra):
        """kind is a log.txt series (train/val/hella); extra numbers (lr, norm, ...) go to W&B only."""
        if not self.master:
            return
        append_log(self.log_file, step, kind, value)
        if self.wandb_run is not None:
            self.wandb_run.log({kind: value, **{f"{kind}/{k}": v for k, v in extra.items()}}, step=step)

    def finish(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()


def init_wandb(args, config):
    try:
        import wandb
    except ImportError:
        raise UsageError("--wandb_project needs the wandb package: pip install wandb") from None
    return wandb.init(project=args.wandb_project, name=args.wandb_run_name, config=config)


def parse_profile_schedule(text):
    try:
        wait, warmup, active = (int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--profile_schedule {text!r}: expected three integers WAIT,WARMUP,ACTIVE") from None
    if min(wait, warmup) < 0 or active < 1:
        raise UsageError(f"--profile_schedule {text!r}: WAIT and WARMUP must be >= 0 and ACTIVE >= 1")
    return wait, warmup, active


class Profiler:
    """torch.profiler over a few training steps (--profile_schedule): a trace, then the top ops."""

    def __init__(self, args, dist):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        wait, warmup, active = parse_profile_schedule(args.profile_schedule)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dist.device_type == "cuda" else [])
        self.out = os.path.join(args.log_dir, "profile")
        self.prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                            on_trace_ready=tensorboard_trace_handler(self.out, worker_name=f"rank{dist.rank}"),
                            record_shapes=True)
        self.prof.start()
        self.steps_left, self.exit_after, self.dist = wait + warmup + active, args.profile == "exit", dist

    def step(self):
        """Call after each training step; True when the run should stop here (--profile exit)."""
        if self.prof is None:
            return False
        self.prof.step()
        self.steps_left -= 1
        if self.steps_left > 0:
            return False
        self.prof.stop()  # the trace handler has written <log_dir>/profile/rank{r}.*.pt.trace.json
        sort = "self_cuda_time_total" if self.dist.device_type == "cuda" else "self_cpu_time_total"
        self.dist.print0(self.prof.key_averages().table(sort_by=sort, row_limit=20))
        self.dist.print0(f"profiler trace in {self.out} (open in ui.perfetto.dev or TensorBoard)")
        self.prof = None
        return self.exit_after


class StepReporter:
    """The line printed after each step (loss, lr, norm, speed, MFU, memory, ETA) and the train series."""

    def __init__(self, run, first_step, end_step):
        self.run, self.first_step, self.end_step = run, first_step, end_step
        config, device = run.settings.config, run.dist.device
        self.flops_tok = flops_per_token(config, run.raw_model.get_num_params(non_embedding=True), run.args.sequence_length)
        self.peak = run.args.peak_flops or (peak_flops(torch.cuda.get_device_name(device))
                                            if run.dist.device_type == "cuda" else None)
        self.dt_avg = None  # smoothed step time, for the ETA

    def report(self, step, s):
        run = self.run
        tokens_per_sec = s.batch_size / s.dt
        if step > self.first_step:  # the first step compiles and warms up: keep it out of the ETA
            self.dt_avg = s.dt if self.dt_avg is None else 0.9 * self.dt_avg + 0.1 * s.dt
        extra = {"lr": s.lr, "norm": s.norm, "tok_per_sec": tokens_per_sec}
        line = (f"step {step:5d} | loss {s.loss:.6f} | lr {s.lr:.4e} | norm {s.norm:.4f} | "
                f"dt {s.dt * 1000:.2f}ms | tok/sec {tokens_per_sec:.0f}")
        if run.args.batch_ramp_tokens > 0:
            line += f" | batch {s.batch_size}"
        if self.peak:
            extra["mfu"] = self.flops_tok * tokens_per_sec / (self.peak * run.dist.world_size)
            line += f" | mfu {100 * extra['mfu']:.1f}%"
        if run.dist.device_type == "cuda":
            extra["mem_gib"] = torch.cuda.max_memory_allocated(run.dist.device) / 2**30
            line += f" | mem {extra['mem_gib']:.1f}GiB"
        if self.dt_avg is not None:
            line += f" | eta {format_eta((self.end_step - step - 1) * self.dt_avg)}"
        run.dist.print0(line)
        run.metrics.log(step, "train", s.loss, **extra)


def format_eta(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"




# =============================================================================
# Command line: the training flags, main, and the sample / export / eval commands
# =============================================================================

def build_parser():
    p = argparse.ArgumentParser(
        description="Pretrain GPT-2 on FineWeb-Edu shards. One process: python train_gpt2.py; "
                    "several: torchrun --standalone --nproc_per_node=8 train_gpt2.py.",
        epilog="Other commands: `train_gpt2.py sample --help` (text from a checkpoint or GPT-2), "
               "`train_gpt2.py export --help` (a checkpoint as a transformers model directory), "
               "`train_gpt2.py eval --help` (HellaSwag accuracy of a checkpoint).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_flags(p.add_argument_group("model"))
    add_optimisation_flags(p.add_argument_group("optimisation"))
    add_evaluation_flags(p.add_argument_group("evaluation, sampling, checkpoints (0 turns a block off)"))
    add_run_flags(p.add_argument_group("run"))
    return p


def add_model_flags(g):
    g.add_argument("--preset", default="gpt2", choices=sorted(MODEL_PRESETS),
                   help="model shape and matching run settings; explicit flags override it")
    g.add_argument("--n_layer", type=int, default=None, help="override the preset's number of blocks")
    g.add_argument("--n_head", type=int, default=None, help="override the preset's attention heads")
    g.add_argument("--n_embd", type=int, default=None, help="override the preset's embedding width")
    g.add_argument("--block_size", type=int, default=None, help="override the preset's context length (default 1024)")
    g.add_argument("--n_kv_head", type=int, default=None,
                   help="key/value heads for grouped-query attention (must divide n_head; 1 = MQA; default n_head)")
    g.add_argument("--dropout", type=float, default=0.0, help="attention, residual and embedding dropout while training")
    g.add_argument("--bias", default=True, action=argparse.BooleanOptionalAction,
                   help="biases in Linear and LayerNorm layers (GPT-2 has them)")
    g.add_argument("--init_from", default=None, metavar="gpt2|gpt2-medium|gpt2-large|gpt2-xl|DIR",
                   help="start from OpenAI's GPT-2 weights (hub name, or a save_pretrained directory) instead of "
                        "a random init; the shape comes from those weights, so the shape flags above are refused")


def add_optimisation_flags(g):
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="adamw: GPT-2's recipe. muon: torch.optim.Muon for the 2-D weights inside the blocks, "
                        "AdamW for embeddings, lm_head, biases and LayerNorms; same schedule, clipping and decay")
    g.add_argument("--muon_lr", type=float, default=None,
                   help="Muon's peak LR (default: --max_lr; with --muon_adjust_lr match_rms_adamw it is on "
                        "AdamW's scale); the schedule scales it as it scales --max_lr")
    g.add_argument("--muon_momentum", type=float, default=0.95, help="Muon's (Nesterov) momentum")
    g.add_argument("--muon_ns_steps", type=int, default=5, help="Newton-Schulz iterations per Muon update")
    g.add_argument("--muon_adjust_lr", default="match_rms_adamw", choices=["match_rms_adamw", "original"],
                   help="Muon's per-matrix LR scaling: match_rms_adamw (Moonshot: AdamW's LR and decay carry "
                        "over) or original (Keller Jordan's: needs a ~10-50x larger --muon_lr, e.g. 0.02)")
    g.add_argument("--max_lr", type=float, default=6e-4, help="peak learning rate")
    g.add_argument("--min_lr_ratio", type=float, default=0.1, help="final learning rate as a fraction of max_lr")
    g.add_argument("--warmup_steps", type=int, default=715, help="linear warmup steps")
    g.add_argument("--max_steps", type=int, default=19073, help="optimizer steps (19073 x 2^19 tokens = 10B)")
    g.add_argument("--weight_decay", type=float, default=0.1,
                   help="decoupled weight decay on matmul weights and embeddings (AdamW's and Muon's)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--total_batch_size", type=int, default=524288, help="tokens per optimizer step, all processes together")
    g.add_argument("--batch_ramp_tokens", type=int, default=0,
                   help="GPT-3's batch-size ramp: grow the batch linearly from --batch_ramp_start tokens to "
                        "--total_batch_size over the first N train tokens, by changing gradient accumulation; "
                        "the LR schedule is unchanged (0: off)")
    g.add_argument("--batch_ramp_start", type=int, default=32768, help="first batch of the ramp, in tokens")
    g.add_argument("-B", "--micro_batch_size", type=int, default=64, help="sequences per forward pass per process")
    g.add_argument("-T", "--sequence_length", type=int, default=1024, help="tokens per sequence")


def add_evaluation_flags(g):
    g.add_argument("--eval_every", type=int, default=250, help="val loss every N steps and of the final model")
    g.add_argument("--val_tokens", type=int, default=10_485_760,
                   help="val loss over the first N val tokens, split across processes: the same number for any "
                        "world size and micro batch (the default is build-nanogpt's 20 x 64 x 1024 x 8)")
    g.add_argument("--val_steps", type=int, default=None,
                   help="instead of --val_tokens (give one of the two): N batches of B*T tokens per process "
                        "(build-nanogpt's 20); the number of tokens then depends on B and the process count")
    g.add_argument("--sample_every", type=int, default=250, help="print samples every N steps (not at step 0) and from the final model")
    g.add_argument("--sample_prompt", default="Hello, I'm a language model,", help="prompt for the samples")
    g.add_argument("--num_samples", type=int, default=4, help="samples per sampling block")
    g.add_argument("--sample_tokens", type=int, default=32, help="new tokens per sample")
    g.add_argument("--hellaswag_every", type=int, default=250, help="HellaSwag acc_norm every N steps and of the final model")
    g.add_argument("--hellaswag_limit", type=int, default=None, help="evaluate only the first N HellaSwag val examples")
    g.add_argument("--save_every", type=int, default=5000, help="checkpoint every N steps; the last step is always saved")
    g.add_argument("--keep_last", type=int, default=0,
                   help="after each checkpoint, delete all but the newest N model_*.pt in log_dir (0 keeps all)")


def add_run_flags(g):
    g.add_argument("--seed", type=int, default=1337, help="seed for init, data order and sampling")
    g.add_argument("--data_root", default=fineweb.DEFAULT_DATA_ROOT,
                   help="folder of *_train_*.npy / *_val_*.npy shards; when it has none, rank 0 prepares them "
                        "with fineweb.py (just the tokens the run needs, at least 10M)")
    g.add_argument("--fineweb_name", default="sample-10BT", choices=["sample-10BT", "sample-100BT", "sample-350BT"],
                   help="FineWeb-Edu sample to prepare when data_root is empty")
    g.add_argument("--input", nargs="+", default=None, metavar="PATH",
                   help="prepare data_root from these local .txt/.jsonl/.parquet files (or globs) instead of "
                        "downloading FineWeb-Edu")
    g.add_argument("--text_column", default="text", help="text field of --input .jsonl/.parquet files")
    g.add_argument("--log_dir", default="log", help="where log.txt and model_*.pt go")
    g.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="autocast dtype; auto is bf16 on CUDA, fp32 elsewhere")
    g.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                   help="torch.compile the model (default: on for CUDA, off elsewhere)")
    g.add_argument("--peak_flops", type=float, default=None,
                   help="peak bf16 FLOP/s of one accelerator for the MFU figure (default: looked up for A100/H100/H200; no MFU elsewhere)")
    g.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer state across processes with FSDP2 "
                        "(under torchrun; for models that do not fit one GPU with DDP, e.g. gpt2-xl)")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in log_dir, deleting its log.txt and model_*.pt")
    g.add_argument("--resume", default=None, metavar="latest|PATH",
                   help="continue from the newest readable checkpoint in log_dir, or from PATH: the model shape and "
                        "every flag not given now come from the checkpoint; checkpoints of later steps move to "
                        "log_dir/after_step_N")
    g.add_argument("--profile", default=None, choices=["continue", "exit"],
                   help="run torch.profiler over a few training steps (--profile_schedule), write a trace to "
                        "<log_dir>/profile/ (Perfetto / TensorBoard) and print the top ops, then continue or exit")
    g.add_argument("--profile_schedule", default="1,1,3", metavar="WAIT,WARMUP,ACTIVE",
                   help="profiler schedule in steps: skipped, warmed up (not recorded), recorded")
    g.add_argument("--wandb_project", default=None,
                   help="also log metrics to this Weights & Biases project (needs `pip install wandb`)")
    g.add_argument("--wandb_run_name", default=None, help="W&B run name (default: W&B picks one)")
    g.add_argument("--stop_step", type=int, default=None,
                   help="leave after this many steps with a checkpoint, keeping the schedule of --max_steps "
                        "(for jobs with a time limit; continue with --resume latest)")



def parse_args(argv=None):
    """Parse flags, applying the preset's run settings as defaults so that explicit flags still win.

    args.given names the flags that are on the command line (not defaults): flag pairs are checked on it,
    and a resumed run takes every other flag from its checkpoint.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    parser.set_defaults(**RUN_PRESETS[args.preset])
    args = parser.parse_args(argv)
    probe = build_parser()
    for action in probe._actions:  # a parser without defaults: its namespace holds only what argv sets
        action.default = argparse.SUPPRESS
    args.given = set(vars(probe.parse_args(argv)))
    return args


def add_model_source(p):
    """--checkpoint | --init_from, --device and --dtype, shared by the sample and eval commands."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a model_*.pt written by training")
    src.add_argument("--init_from", metavar="gpt2|...|DIR", help="OpenAI GPT-2 weights (hub name or save_pretrained dir)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="bf16 on CUDA for auto")


def load_model(args):
    """(raw GPT in eval mode on its device, device, autocast context, uses bf16) for add_model_source's flags."""
    device = resolve_device(args.device)
    model = load_checkpoint_model(args.checkpoint) if args.checkpoint else GPT.from_pretrained(args.init_from)
    ctx, use_bf16 = autocast_for(args.dtype, device.split(":")[0])
    return model.to(device).eval(), device, ctx, use_bf16


def sample_main(argv):
    import tiktoken

    p = argparse.ArgumentParser(prog="train_gpt2.py sample", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Sample text from one of our checkpoints or from OpenAI's GPT-2.")
    add_model_source(p)
    p.add_argument("--prompt", default="Hello, I'm a language model,", help="text to continue")
    p.add_argument("--num_samples", type=int, default=4, help="independent samples")
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate per sample")
    p.add_argument("--top_k", type=int, default=50, help="sample from the k most likely tokens (1 = greedy, 0 = all)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0 = greedy)")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed")
    p.add_argument("--no_kv_cache", action="store_true", help="recompute the whole sequence every token (slow; for comparison)")
    args = p.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        raise UsageError("--num_samples and --max_new_tokens must be positive, --temperature non-negative")
    model, device, ctx, _ = load_model(args)
    enc = tiktoken.get_encoding("gpt2")
    tokens = encode_prompt(enc, args.prompt)
    if len(tokens) + args.max_new_tokens > model.config.block_size:
        raise UsageError(f"prompt ({len(tokens)} tokens) + --max_new_tokens ({args.max_new_tokens}) exceeds the "
                         f"model's block_size {model.config.block_size}")
    idx = torch.tensor([tokens] * args.num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with ctx:
        out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             generator=gen, use_cache=not args.no_kv_cache)
    for i in range(args.num_samples):
        print(f"--- sample {i}\n{enc.decode(out[i].tolist())}")
    return 0


def export_main(argv):
    p = argparse.ArgumentParser(prog="train_gpt2.py export",
                                description="Write a checkpoint as a transformers GPT2LMHeadModel directory "
                                            "(config.json + model.safetensors) for GPT2LMHeadModel.from_pretrained.")
    p.add_argument("--checkpoint", required=True, help="a model_*.pt written by training")
    p.add_argument("--out", required=True, help="new (or empty) directory to write")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise UsageError(f"--out {args.out} exists and is not an empty directory: choose a new one")
    model = load_checkpoint_model(args.checkpoint)
    export_hf(model, args.out)
    print(f"wrote {args.out}: GPT2LMHeadModel.from_pretrained({args.out!r}) loads it")
    return 0


def eval_main(argv):
    p = argparse.ArgumentParser(prog="train_gpt2.py eval", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="HellaSwag val accuracy (acc: lowest summed loss of the ending, acc_norm: "
                                            "lowest mean loss) of one of our checkpoints, or of OpenAI's GPT-2 run "
                                            "through our GPT. `python hellaswag.py -m gpt2` scores GPT-2 through "
                                            "transformers instead.")
    add_model_source(p)
    p.add_argument("--limit", type=int, default=None, help="only the first N examples")
    p.add_argument("--batch_tokens", type=int, default=8192, help="tokens per forward pass (0: one example each)")
    p.add_argument("--data_dir", default=None, help="folder of hellaswag_val.jsonl (default: hellaswag.py's)")
    args = p.parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.batch_tokens < 0:
        raise UsageError("--limit must be positive and --batch_tokens >= 0")
    try:
        hellaswag.download("val", args.data_dir)  # before loading a model: a missing file fails in seconds
        model, device, _, use_bf16 = load_model(args)
        t0 = time.perf_counter()
        res = hellaswag.evaluate(model, device, limit=args.limit, batch_tokens=args.batch_tokens, data_dir=args.data_dir,
                                 autocast_dtype=torch.bfloat16 if use_bf16 else None, progress=True)
    except hellaswag.HellaSwagUnavailable as e:
        raise UsageError(str(e)) from None
    print(f"{args.checkpoint or args.init_from} on {device} ({'bf16' if use_bf16 else 'fp32'}), hellaswag val: "
          f"{res['n']} examples, acc {res['acc']:.4f} ({res['correct']}/{res['n']}), "
          f"acc_norm {res['acc_norm']:.4f} ({res['correct_norm']}/{res['n']}) [{time.perf_counter() - t0:.1f} s]")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"sample": sample_main, "export": export_main, "eval": eval_main}
    try:
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        train(parse_args(argv))
    except UsageError as e:
        if int(os.environ.get("RANK", 0)) == 0 or e.rank_specific:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def exit_process(code):
    """sys.exit(code); under torchrun, leave without Python's interpreter shutdown.

    torch keeps process groups alive past destroy_process_group (torch.distributed.nn's functions hold the
    default group as a default argument; under FSDP, DTensor's caches hold the device mesh), so their gloo
    worker threads outlive main(). One that frees a finished collective's tensor while Python shuts down
    needs the GIL, cannot get it, and aborts the process ("terminate called without an active exception")
    after a run that went well. By now everything is written and closed (checkpoints and log.txt, W&B) and
    the groups are destroyed: only the output buffers are left to flush.
    """
    if "WORLD_SIZE" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
