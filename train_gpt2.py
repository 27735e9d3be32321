"""
GPT-2 pretraining on FineWeb-Edu token shards, in one flat, importable file.

    python train_gpt2.py                                        # GPT-2 124M recipe, one GPU (or CPU)
    torchrun --standalone --nproc_per_node=8 train_gpt2.py      # the same recipe on a node of 8 GPUs
    python train_gpt2.py --preset tiny                          # a few-M-parameter model, laptop CPU

Importing this file defines the model, data loader, LR schedule and helpers; it trains nothing.
`python train_gpt2.py --help` lists every flag. The run writes `<log_dir>/log.txt` (see `read_log`)
and checkpoints `<log_dir>/model_{step:05d}.pt`; `--resume latest` continues exactly where a run stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import fineweb
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


# -----------------------------------------------------------------------------
# The model

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
        # 0 for real tokens, -inf for the padding ids: added inside the lm_head matmul, so padding gets zero
        # probability (never sampled, never an argmax, no share of any softmax) at no extra pass over the
        # logits or their gradient; a buffer, not a parameter, so the state dict stays GPT-2's
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
        logits = F.linear(x, self.lm_head.weight, self.vocab_mask)  # (B, T, vocab_size)
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

    def configure_optimizers(self, weight_decay, learning_rate, device_type, verbose=True):
        """AdamW with decay on matmul weights and embeddings (dim >= 2) only, never biases or LayerNorm."""
        params = [p for p in self.parameters() if p.requires_grad]
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
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)

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


def read_checkpoint(path, map_location="cpu", keys=("model", "config")):
    """The dict in one of our checkpoints, or a UsageError saying why it cannot be used."""
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # truncated or not a torch file at all
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UsageError(f"{path} is not a train_gpt2.py checkpoint (no {', '.join(missing)})")
    return ckpt


def load_checkpoint_model(path, map_location="cpu"):
    """The GPT stored in one of our checkpoints (model_*.pt), in fp32."""
    ckpt = read_checkpoint(path, map_location)
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model


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


# -----------------------------------------------------------------------------
# Data: uint16 token shards written by fineweb.py

class DataLoaderLite:
    """Batches (x, y) of shape (B, T) from the `*_{split}_NNNNNN.npy` shards in data_root.

    A split is read as one endless stream of tokens: its shards in order, then (train only) the shards
    again in a new order drawn from a seeded RNG at each epoch boundary. Rank r of num_processes reads
    window r of every group of num_processes windows of B*T tokens (+1 for the shifted targets), so a
    window that reaches the end of a shard continues into the next one and nothing is dropped. Because
    the position is one number in that stream, the same batches come out for any number of processes,
    and `state_dict()` resumes exactly. Shards are memory-mapped: each batch copies only its B*T+1 tokens.
    """

    def __init__(self, B, T, process_rank=0, num_processes=1, split="train", data_root=fineweb.DEFAULT_DATA_ROOT, seed=1337):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        self.B, self.T = B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.split, self.seed = split, seed
        self.shards = list_shards(data_root, split)
        if not self.shards:
            raise UsageError(f"no {split} shards (*_{split}_NNNNNN.npy) in {data_root}: "
                             f"prepare them with `python fineweb.py` (see --help there)", rank_specific=True)
        self.tokens = [np.load(path, mmap_mode="r") for path in self.shards]
        for path, arr in zip(self.shards, self.tokens):
            if arr.dtype != np.uint16 or arr.ndim != 1:
                raise UsageError(f"{path}: expected a 1-D uint16 array of token ids, got {arr.dtype} {arr.shape}")
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


# -----------------------------------------------------------------------------
# Learning rate schedule

def get_lr(step, max_lr, min_lr, warmup_steps, max_steps):
    """Linear warmup to max_lr over warmup_steps, cosine decay to min_lr at max_steps, constant after."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    ratio = (step - warmup_steps) / (max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


# -----------------------------------------------------------------------------
# log.txt: written and parsed only here

LOG_FORMATS = {"train": "{:.6f}", "val": "{:.4f}", "hella": "{:.4f}"}


def format_log_line(step, kind, value):
    return f"{step} {kind} {LOG_FORMATS[kind].format(value)}\n"


def append_log(path, step, kind, value):
    with open(path, "a") as f:
        f.write(format_log_line(step, kind, value))


def read_log(path):
    """{kind: (steps, values)} for the kinds present in a log.txt ('train', 'val', 'hella')."""
    series = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 3:
                continue
            steps, values = series.setdefault(parts[1], ([], []))
            steps.append(int(parts[0]))
            values.append(float(parts[2]))
    return series


def truncate_log(path, last_step):
    """Drop the lines a run wrote after its checkpoint at last_step, so a resumed run continues cleanly."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.split() and int(line.split()[0]) <= last_step]
    atomic_write(path, lambda f: f.writelines(line.encode() for line in kept))


# -----------------------------------------------------------------------------
# Checkpoints

CKPT_RE = re.compile(r"model_(\d+)\.pt$")


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
    return get_model_state_dict(raw_model, options=opts), get_optimizer_state_dict(raw_model, optimizer, options=opts)


def load_full_state_dicts(raw_model, optimizer, model_sd, optim_sd):
    """Inverse of full_state_dicts; under FSDP each rank keeps its own shard of what it is given."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(raw_model, model_sd, options=opts)
    if optimizer is not None:
        # the kernel choice belongs to this machine, not to the one that wrote the checkpoint
        impl = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
        set_optimizer_state_dict(raw_model, optimizer, optim_sd, options=opts)
        for group, keep in zip(optimizer.param_groups, impl):
            group.update(keep)


def save_checkpoint(path, raw_model, optimizer, step, train_loader, val_loss, args, tokens_seen, master=True):
    """Write model_{step}.pt atomically. Every rank calls it (FSDP gathers), only the master writes."""
    model_sd, optim_sd = full_state_dicts(raw_model, optimizer)
    if not master:
        return
    ckpt = {
        "model": model_sd,
        "config": asdict(raw_model.config),
        "optimizer": optim_sd,
        "step": step,  # the last optimizer step this checkpoint includes
        "loader": train_loader.state_dict(),
        "rng": rng_state(),
        "val_loss": val_loss,
        "args": vars(args),
        "tokens_seen": tokens_seen,  # train tokens consumed so far (the batch-size ramp depends on it)
    }
    atomic_write(path, lambda f: torch.save(ckpt, f))


# -----------------------------------------------------------------------------
# Run configuration

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


def build_parser():
    p = argparse.ArgumentParser(
        description="Pretrain GPT-2 on FineWeb-Edu shards. One process: python train_gpt2.py; "
                    "several: torchrun --standalone --nproc_per_node=8 train_gpt2.py.",
        epilog="Other commands: `train_gpt2.py sample --help` (text from a checkpoint or GPT-2), "
               "`train_gpt2.py export --help` (a checkpoint as a transformers model directory).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
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
                        "a random init; the shape flags above are then taken from those weights")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_lr", type=float, default=6e-4, help="peak learning rate")
    g.add_argument("--min_lr_ratio", type=float, default=0.1, help="final learning rate as a fraction of max_lr")
    g.add_argument("--warmup_steps", type=int, default=715, help="linear warmup steps")
    g.add_argument("--max_steps", type=int, default=19073, help="optimizer steps (19073 x 2^19 tokens = 10B)")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay on matmul weights and embeddings")
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--total_batch_size", type=int, default=524288, help="tokens per optimizer step, all processes together")
    g.add_argument("--batch_ramp_tokens", type=int, default=0,
                   help="GPT-3's batch-size ramp: grow the batch linearly from --batch_ramp_start tokens to "
                        "--total_batch_size over the first N train tokens, by changing gradient accumulation; "
                        "the LR schedule is unchanged (0: off)")
    g.add_argument("--batch_ramp_start", type=int, default=32768, help="first batch of the ramp, in tokens")
    g.add_argument("-B", "--micro_batch_size", type=int, default=64, help="sequences per forward pass per process")
    g.add_argument("-T", "--sequence_length", type=int, default=1024, help="tokens per sequence")
    g = p.add_argument_group("evaluation, sampling, checkpoints (0 turns a block off)")
    g.add_argument("--eval_every", type=int, default=250, help="val loss every N steps and at the last step")
    g.add_argument("--val_tokens", type=int, default=10_485_760,
                   help="val loss over the first N val tokens, split across processes: the same number for any "
                        "world size and micro batch (the default is build-nanogpt's 20 x 64 x 1024 x 8)")
    g.add_argument("--val_steps", type=int, default=None,
                   help="instead of --val_tokens: N batches of B*T tokens per process (build-nanogpt's 20); "
                        "the number of tokens then depends on B and the process count")
    g.add_argument("--sample_every", type=int, default=250, help="print samples every N steps (not at step 0) and at the last step")
    g.add_argument("--sample_prompt", default="Hello, I'm a language model,", help="prompt for the samples")
    g.add_argument("--num_samples", type=int, default=4, help="samples per sampling block")
    g.add_argument("--sample_tokens", type=int, default=32, help="new tokens per sample")
    g.add_argument("--hellaswag_every", type=int, default=250, help="HellaSwag acc_norm every N steps and at the last step")
    g.add_argument("--hellaswag_limit", type=int, default=None, help="evaluate only the first N HellaSwag val examples")
    g.add_argument("--save_every", type=int, default=5000, help="checkpoint every N steps; the last step is always saved")
    g = p.add_argument_group("run")
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
                   help="continue from the newest checkpoint in log_dir, or from PATH")
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
    return p


def parse_args(argv=None):
    """Parse flags, applying the preset's run settings as defaults so that explicit flags still win."""
    parser = build_parser()
    args = parser.parse_args(argv)
    parser.set_defaults(**RUN_PRESETS[args.preset])
    return parser.parse_args(argv)


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


def autocast_for(dtype, device_type):
    """(autocast context, uses bf16) for --dtype auto|fp32|bf16: auto is bf16 on CUDA and fp32 elsewhere."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device_type == "cuda")
    ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    return ctx, use_bf16


def resolve_device(name):
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    return name


def check_batch(args, world_size, block_size):
    """grad_accum_steps, or a UsageError naming what does not fit."""
    B, T = args.micro_batch_size, args.sequence_length
    if B < 1 or T < 1:
        raise UsageError("-B and -T must be positive")
    if T > block_size:
        raise UsageError(f"-T {T} is longer than the model's block_size {block_size}")
    per_step = B * T * world_size
    if args.total_batch_size % per_step != 0:
        raise UsageError(f"--total_batch_size {args.total_batch_size} is not divisible by B*T*world_size = "
                         f"{B}*{T}*{world_size} = {per_step}")
    return args.total_batch_size // per_step


# -----------------------------------------------------------------------------
# Pieces of a training step, shared by the loop and the tests

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


def all_reduce_sum(t, world_size):
    import torch.distributed as dist

    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t, world_size):
    all_reduce_sum(t, world_size)  # gloo has no AVG: sum, then divide
    return t / world_size


def batch_size_at(tokens_seen, ramp_tokens, total_batch_size, unit, start=32768):
    """GPT-3's ramp: tokens in the next step, linear from `start` to total over the first ramp_tokens.

    Rounded down to a multiple of unit = B*T*world_size (one micro-step on every rank), at least one unit.
    """
    if ramp_tokens <= 0 or tokens_seen >= ramp_tokens:
        return total_batch_size
    start = min(start, total_batch_size)
    size = start + (total_batch_size - start) * tokens_seen / ramp_tokens
    return max(unit, int(size) // unit * unit)


# -----------------------------------------------------------------------------
# Training

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


def start_profiler(args, device_type, rank):
    """A torch.profiler session over the next wait+warmup+active steps; returns (profiler, steps)."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    wait, warmup, active = parse_profile_schedule(args.profile_schedule)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    out = os.path.join(args.log_dir, "profile")
    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{rank}"), record_shapes=True)
    prof.start()
    return prof, wait + warmup + active


def format_eta(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# approximate GPT-2 token counts of the FineWeb-Edu samples: a run needing most of one takes it whole
FINEWEB_SAMPLE_TOKENS = {"sample-10BT": 10e9, "sample-100BT": 100e9, "sample-350BT": 350e9}
MIN_PREP_TOKENS = 10_000_000


def ensure_data(args, train_tokens, val_tokens, master_process, world_size, device, print0):
    """Make sure data_root has shards: if it has none, the master prepares them while the others wait.

    With several nodes, data_root must be on a shared filesystem for this (or prepared on each node first).
    """
    have = torch.tensor(float(bool(list_shards(args.data_root, "train")) and bool(list_shards(args.data_root, "val"))),
                        device=device)
    if world_size > 1:
        import torch.distributed as dist
        dist.all_reduce(have, op=dist.ReduceOp.MIN)  # every rank takes the same branch below
    if have.item() == 1.0:
        manifest = os.path.join(args.data_root, "manifest.json")
        if master_process and os.path.exists(manifest):
            import json
            with open(manifest) as f:
                info = json.load(f)
            if info.get("complete") and info.get("total_tokens", float("inf")) < train_tokens:
                print0(f"note: {args.data_root} holds {info['total_tokens']:,} tokens and the run reads {train_tokens:,}: "
                       f"it will go over the data more than once")
        return
    message = None
    if master_process:

        needed = max(train_tokens + val_tokens, MIN_PREP_TOKENS)
        full = args.input is not None or needed >= 0.9 * FINEWEB_SAMPLE_TOKENS[args.fineweb_name]
        max_tokens = None if full else needed
        what = " ".join(args.input) if args.input else f"FineWeb-Edu {args.fineweb_name}"
        print0(f"no shards in {args.data_root}: preparing them from {what}"
               + (f" ({max_tokens:,} tokens)" if max_tokens else ""))
        try:
            fineweb.prepare(args.data_root, name=args.fineweb_name, inputs=args.input, text_column=args.text_column,
                            max_tokens=max_tokens, val_tokens=None if full else min(max(val_tokens, 1), max_tokens // 2))
        except fineweb.DataPrepError as e:
            message = f"preparing {args.data_root} failed: {e}"
    ok = torch.tensor(0.0 if message else 1.0)
    if world_size > 1:
        import datetime
        import torch.distributed as dist
        # preparing 10B tokens takes hours, far past NCCL's collective timeout: wait on a gloo group of our own
        waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=48))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=waiting)
    if ok.item() != 1.0:
        raise UsageError(message or "data preparation failed on rank 0 (see its message)")


def hellaswag_module(every, master_process, world_size, device):
    """hellaswag.py when its val data can be had on every rank, else None after one warning."""
    if every <= 0:
        return None
    import hellaswag

    ok = torch.ones((), device=device)
    for turn in ("master", "others"):  # the master downloads first, the other ranks then find the file
        if master_process == (turn == "master"):
            try:
                hellaswag.download("val")
            except hellaswag.HellaSwagUnavailable as e:
                print(f"warning: HellaSwag evaluation turned off: {e}", flush=True)
                ok.zero_()
        if world_size > 1:
            import torch.distributed as dist
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # also the barrier between the turns
    return hellaswag if ok.item() == 1 else None


def find_resume_path(args):
    if args.resume is None:
        return None
    if args.resume == "latest":
        found = find_checkpoints(args.log_dir)
        if not found:
            raise UsageError(f"--resume latest: no model_*.pt checkpoint in {args.log_dir}")
        return found[-1]
    if os.path.isfile(args.resume):
        return args.resume
    raise UsageError(f"--resume {args.resume}: no such checkpoint")


def setup_distributed(device_arg):
    """(ddp, rank, local_rank, world_size, device) from torchrun's environment; one process without it."""
    import torch.distributed as dist

    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(device_arg)
    if ddp and device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) on this node: "
                             f"ask torchrun for at most that many processes per node", rank_specific=True)
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return ddp, rank, local_rank, world_size, device


def train(args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    # ---- processes and devices: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
    if args.fsdp and "WORLD_SIZE" not in os.environ:
        raise UsageError("--fsdp shards the model across processes: launch with torchrun")
    ddp, rank, local_rank, world_size, device = setup_distributed(args.device)
    master_process = rank == 0
    device_type = device.split(":")[0]  # autocast, fused AdamW and synchronize want 'cuda', never 'cuda:3'

    def print0(*a, **kw):
        if master_process:
            print(*a, **kw, flush=True)

    # ---- the model's shape: a checkpoint's when resuming, OpenAI's with --init_from, else the flags'
    ckpt, pretrained = None, None
    resume_path = find_resume_path(args)
    if resume_path is not None:
        ckpt = read_checkpoint(resume_path, keys=("model", "config", "optimizer", "step", "loader", "rng", "val_loss", "args"))
        config = GPTConfig(**ckpt["config"])
        if args.init_from is None and asdict(model_config_from_args(args)) != asdict(config):
            raise UsageError(f"{resume_path} holds a model of config {asdict(config)}, "
                             f"the flags ask for {asdict(model_config_from_args(args))}")
    elif args.init_from is not None:
        if args.n_kv_head is not None or not args.bias:
            raise UsageError("--init_from loads GPT-2's architecture: drop --n_kv_head / --no-bias")
        pretrained = GPT.from_pretrained(args.init_from, dropout=args.dropout)
        config = pretrained.config
    else:
        config = model_config_from_args(args)
    unit = args.micro_batch_size * args.sequence_length * world_size  # tokens of one micro-step, all ranks
    check_batch(args, world_size, config.block_size)
    autocast_ctx, use_bf16 = autocast_for(args.dtype, device_type)
    use_compile = args.compile if args.compile is not None else device_type == "cuda"
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls that remain
    val_tokens = args.val_steps * unit if args.val_steps is not None else args.val_tokens

    # ---- log dir: never clobber an earlier run by accident
    log_file = os.path.join(args.log_dir, "log.txt")
    if resume_path is None and not args.overwrite and ((os.path.exists(log_file) and os.path.getsize(log_file) > 0)
                                 or find_checkpoints(args.log_dir)):
        raise UsageError(f"{args.log_dir} holds an earlier run (log.txt or model_*.pt): pass --resume latest "
                         f"to continue it, --overwrite to start afresh, or another --log_dir")

    print0("run config:", {**vars(args), "device": device, "world_size": world_size,
                           "grad_accum_steps": args.total_batch_size // unit, "bf16": use_bf16,
                           "compile": use_compile, "val_tokens": val_tokens, "model": asdict(config)})

    # ---- data: prepared here on first use
    ensure_data(args, args.max_steps * args.total_batch_size, val_tokens, master_process, world_size, device, print0)
    train_loader = DataLoaderLite(args.micro_batch_size, args.sequence_length, rank, world_size, "train", args.data_root, args.seed)
    val_loader = DataLoaderLite(args.micro_batch_size, args.sequence_length, rank, world_size, "val", args.data_root, args.seed)

    # ---- model and optimizer
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    # unwrapped, uncompiled: saved, evaluated on HellaSwag, sampled
    raw_model = (pretrained if pretrained is not None else GPT(config)).to(device)
    print0(f"model: {raw_model.get_num_params():,} parameters")
    if args.fsdp:
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch 2.5 kept FSDP2 under _composable
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 compute and all-gathers, fp32 gradient reduction and master weights
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16 else MixedPrecisionPolicy()
        for block in raw_model.transformer.h:
            fully_shard(block, mp_policy=mp)
        fully_shard(raw_model, mp_policy=mp)  # the root: embeddings, tied lm_head, ln_f
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, device_type, verbose=master_process)

    start_step, val_loss, tokens_seen = 0, None, 0
    if ckpt is not None:
        load_full_state_dicts(raw_model, optimizer, ckpt["model"], ckpt["optimizer"])
        train_loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"])
        start_step, val_loss = ckpt["step"] + 1, ckpt["val_loss"]
        tokens_seen = ckpt.get("tokens_seen", start_step * args.total_batch_size)
        for key in ("max_steps", "max_lr", "warmup_steps", "total_batch_size", "batch_ramp_tokens", "batch_ramp_start", "seed"):
            if ckpt["args"].get(key) != getattr(args, key):
                print0(f"warning: --{key} is {getattr(args, key)} now but was {ckpt['args'].get(key)} in {resume_path}")
        print0(f"resumed from {resume_path} at step {start_step}")
        del ckpt

    model = raw_model
    if use_compile:
        model = torch.compile(model)
    if ddp and not args.fsdp:
        model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)
    sync_once = ddp and not args.fsdp  # FSDP reduce-scatters every micro-step to keep gradients sharded

    if master_process:
        os.makedirs(args.log_dir, exist_ok=True)
        if resume_path is not None:
            truncate_log(log_file, start_step - 1)
        else:
            for path in find_checkpoints(args.log_dir):  # only non-empty with --overwrite
                os.remove(path)
            open(log_file, "w").close()

    run_config = {**vars(args), "world_size": world_size, "model": asdict(config)}
    metrics = Metrics(log_file, master_process, init_wandb(args, run_config) if args.wandb_project and master_process else None)
    if args.profile:
        parse_profile_schedule(args.profile_schedule)  # a bad schedule fails now, not after the first evals

    hella = hellaswag_module(args.hellaswag_every, master_process, world_size, device)

    enc = None
    if args.sample_every > 0:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")

    flops_tok = flops_per_token(config, raw_model.get_num_params(non_embedding=True), args.sequence_length)
    peak = args.peak_flops or (peak_flops(torch.cuda.get_device_name(device)) if device_type == "cuda" else None)

    def due(every, step):
        return every > 0 and (step % every == 0 or step == args.max_steps - 1)

    min_lr = args.max_lr * args.min_lr_ratio
    end_step = args.max_steps if args.stop_step is None else min(args.max_steps, args.stop_step)
    prof, prof_steps_left = start_profiler(args, device_type, rank) if args.profile else (None, 0)
    dt_avg = None  # smoothed step time, for the ETA
    for step in range(start_step, end_step):
        last_step = step == args.max_steps - 1

        # ---- val loss: the model after `step` updates
        if due(args.eval_every, step):
            val_loss = evaluate_loss(model, val_loader, val_tokens, device, autocast_ctx, world_size)
            print0(f"validation loss: {val_loss:.4f}")
            metrics.log(step, "val", val_loss)

        # ---- HellaSwag acc_norm of the raw model: any shape works, compiled or not
        if hella is not None and due(args.hellaswag_every, step):
            try:
                res = hella.evaluate(raw_model, device, limit=args.hellaswag_limit, rank=rank, world_size=world_size,
                                     autocast_dtype=torch.bfloat16 if use_bf16 else None, device_type=device_type)
            except hella.HellaSwagUnavailable as e:  # e.g. the file went away mid-run
                print0(f"warning: HellaSwag evaluation turned off: {e}")
                hella = None
            else:
                print0(f"HellaSwag accuracy: {res['correct_norm']}/{res['n']}={res['acc_norm']:.4f}")
                metrics.log(step, "hella", res["acc_norm"])

        # ---- samples from the raw model (any prompt length works, compiled or not)
        if args.sample_every > 0 and ((step > 0 and step % args.sample_every == 0) or last_step):
            raw_model.eval()
            gen = torch.Generator(device=device).manual_seed(args.seed + rank)
            prompt = torch.tensor(enc.encode(args.sample_prompt), dtype=torch.long, device=device)
            prompt = prompt.unsqueeze(0).repeat(args.num_samples, 1)
            with autocast_ctx:
                out = raw_model.generate(prompt, args.sample_tokens, top_k=50, generator=gen)
            for i in range(args.num_samples):
                print(f"rank {rank} sample {i}: {enc.decode(out[i].tolist())}", flush=True)
            raw_model.train()

        # ==================== training step ====================
        t0 = time.time()
        batch_size = batch_size_at(tokens_seen, args.batch_ramp_tokens, args.total_batch_size, unit, args.batch_ramp_start)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, train_loader, batch_size // unit, device, autocast_ctx, sync_once)
        loss = all_reduce_mean(loss, world_size)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip if args.grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        lr = get_lr(step, args.max_lr, min_lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize()  # so dt measures the GPU work, not just the launches
        tokens_seen += batch_size
        dt = time.time() - t0
        tokens_per_sec = batch_size / dt
        if step > start_step:  # the first step compiles and warms up: keep it out of the ETA
            dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
        loss, norm = loss.item(), norm.item()
        extra = {"lr": lr, "norm": norm, "tok_per_sec": tokens_per_sec}
        line = (f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | "
                f"dt {dt * 1000:.2f}ms | tok/sec {tokens_per_sec:.0f}")
        if args.batch_ramp_tokens > 0:
            line += f" | batch {batch_size}"
        if peak:
            extra["mfu"] = flops_tok * tokens_per_sec / (peak * world_size)
            line += f" | mfu {100 * extra['mfu']:.1f}%"
        if device_type == "cuda":
            extra["mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            line += f" | mem {extra['mem_gib']:.1f}GiB"
        if dt_avg is not None:
            line += f" | eta {format_eta((end_step - step - 1) * dt_avg)}"
        print0(line)
        metrics.log(step, "train", loss, **extra)

        if prof is not None:
            prof.step()
            prof_steps_left -= 1
            if prof_steps_left == 0:
                prof.stop()  # the trace handler has written <log_dir>/profile/rank{r}.*.pt.trace.json
                sort = "self_cuda_time_total" if device_type == "cuda" else "self_cpu_time_total"
                print0(prof.key_averages().table(sort_by=sort, row_limit=20))
                print0(f"profiler trace in {os.path.join(args.log_dir, 'profile')} (open in ui.perfetto.dev or TensorBoard)")
                prof = None
                if args.profile == "exit":
                    break

        # ---- checkpoint after the update, so model_{step}.pt includes step `step`
        stopping = step == end_step - 1
        if last_step or stopping or (args.save_every > 0 and step > 0 and step % args.save_every == 0):
            path = os.path.join(args.log_dir, f"model_{step:05d}.pt")
            save_checkpoint(path, raw_model, optimizer, step, train_loader, val_loss, args, tokens_seen, master_process)
            print0(f"saved {path}")

    metrics.finish()
    if ddp:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Subcommands: sample, export

def build_sample_parser():
    p = argparse.ArgumentParser(prog="train_gpt2.py sample", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Sample text from one of our checkpoints or from OpenAI's GPT-2.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a model_*.pt written by training")
    src.add_argument("--init_from", metavar="gpt2|...|DIR", help="OpenAI GPT-2 weights (hub name or save_pretrained dir)")
    p.add_argument("--prompt", default="Hello, I'm a language model,", help="text to continue")
    p.add_argument("--num_samples", type=int, default=4, help="independent samples")
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate per sample")
    p.add_argument("--top_k", type=int, default=50, help="sample from the k most likely tokens (1 = greedy, 0 = all)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0 = greedy)")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="bf16 on CUDA for auto")
    p.add_argument("--no_kv_cache", action="store_true", help="recompute the whole sequence every token (slow; for comparison)")
    return p


def load_model(checkpoint=None, init_from=None, device="cpu"):
    """A raw GPT in eval mode from our checkpoint or from OpenAI's weights."""
    model = load_checkpoint_model(checkpoint) if checkpoint else GPT.from_pretrained(init_from)
    return model.to(device).eval()


def sample_main(argv):
    import tiktoken

    args = build_sample_parser().parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        raise UsageError("--num_samples and --max_new_tokens must be positive, --temperature non-negative")
    device = resolve_device(args.device)
    device_type = device.split(":")[0]
    model = load_model(args.checkpoint, args.init_from, device)
    enc = tiktoken.get_encoding("gpt2")
    tokens = enc.encode(args.prompt, allowed_special={"<|endoftext|>"}) or [EOT]
    if len(tokens) + args.max_new_tokens > model.config.block_size:
        raise UsageError(f"prompt ({len(tokens)} tokens) + --max_new_tokens ({args.max_new_tokens}) exceeds the "
                         f"model's block_size {model.config.block_size}")
    idx = torch.tensor([tokens] * args.num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ctx, _ = autocast_for(args.dtype, device_type)
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"sample": sample_main, "export": export_main}
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


if __name__ == "__main__":
    sys.exit(main())
