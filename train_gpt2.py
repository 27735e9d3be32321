"""
GPT-2 (124M) pretraining on FineWeb-Edu token shards, in one flat, importable file.

    python train_gpt2.py --preset tiny                       # a ~7M-parameter demo on a laptop CPU
    python train_gpt2.py                                     # the GPT-2 124M recipe on one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the same recipe on a node of 8 GPUs
    python train_gpt2.py sample|export|eval --help           # use a checkpoint

Read top to bottom: the model config, the model, the data loader, optimizers and schedules, the
distributed set-up, evaluation, checkpoints, `train()` (the whole run in one loop), and the command
line, whose settle() turns the flags into one frozen Run before any work. Beside this file:
settings.py (the flags, presets, checks and the settled Run), rundir.py (the run directory:
checkpoint files, the log dir, log.txt, stop signals), metrics.py (the step line, MFU, W&B, the
profiler), openai_gpt2.py (OpenAI's weights in, transformers out) and common.py (what the three
command lines share).
"""

import bisect
import contextlib
import copy
import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import chat
import chat_eval
import core_eval
import fineweb
import hellaswag
import openai_gpt2
import rundir
import serve
import settings
import tokenizer
from common import (Precision, Proc, UsageError, atomic_write, check_new_dir, check_outputs,
                    exit_process, new_dir, one_line, print0, resolve_device, run_cli,
                    tune_for_device)
from fineweb import EOT, GPT2_VOCAB_SIZE  # noqa: F401 (EOT: tests read train_gpt2.EOT)
from metrics import Metrics, Profiler

# ===== Model config =====
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
    # The architecture's parts: GPT-2's by default; --arch modern changes them all
    # (settings.ARCHITECTURES), and each part's own flag changes one
    bias: bool = True  # biases in Linear and LayerNorm
    pos_emb: str = "learned"  # learned: a wpe table added to the input; rope: rotary, in attention
    norm: str = "layernorm"  # the blocks' and the final norm: layernorm, or rmsnorm (no weights)
    embed_norm: bool = False  # the token embedding normalized before the first block
    qk_norm: bool = False  # each head's queries and keys RMS-normalized before attention
    activation: str = "gelu"  # the MLP's: gelu (tanh approximation), or relu2 (ReLU squared)
    tie_embeddings: bool = True  # lm_head shares wte's weight
    zero_init: bool = False  # the blocks' output projections start at zero
    zero_head: bool = False  # an untied lm_head starts at zero (else N(0, 0.02), as GPT-2's)
    head_bias: bool = False  # each token's logit adds a learned bias: its frequency, learned fast
    logit_softcap: float = 0.0  # logits squashed to (-cap, cap) by cap * tanh(logits / cap); 0: off
    value_embeds: bool = False  # every other block's values add a learned vector of each token
    x0_skip: bool = False  # each block's input adds the embedding x0, by a learned scalar
    unet_skip: bool = False  # the second half's blocks add the first half's outputs, mirrored

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
        for part, kinds in (("pos_emb", ("learned", "rope")), ("norm", ("layernorm", "rmsnorm")),
                            ("activation", ("gelu", "relu2"))):
            if getattr(self, part) not in kinds:
                raise ValueError(f"{part} must be one of {', '.join(kinds)}")
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"rotary embeddings turn pairs: the head size "
                             f"({self.n_embd // self.n_head}) must be even")
        if self.logit_softcap < 0:
            raise ValueError(f"logit_softcap ({self.logit_softcap}) must be >= 0 (0: off)")

    def gpt2_differences(self):
        """The parts (as name=value) in which this model is not GPT-2's architecture."""
        gpt2 = {**settings.ARCHITECTURES["gpt2"], "n_kv_head": self.n_head}
        return [f"{k}={getattr(self, k)}" for k, v in gpt2.items() if getattr(self, k) != v]

def run_tokenizer(args, given, ckpt=None):
    """The run's tokenizer: a resumed checkpoint's, --init_from's (a model_*.pt's; OpenAI's
    GPT-2's is GPT-2's BPE), else --tokenizer's (GPT-2's BPE by default). A --tokenizer given that
    is not the checkpoint's or --init_from's is refused in one line, before any work."""
    gpt2 = fineweb.gpt2_tokenizer()
    asked = None
    if "tokenizer" in given:  # on a resume, args.tokenizer is the checkpoint's flag otherwise
        asked = tokenizer.load(args.tokenizer)
    if ckpt is not None:
        had, source = tokenizer.from_record(ckpt.get("tokenizer"), gpt2), f"--resume {args.resume}"
    elif args.init_from and os.path.isfile(args.init_from):
        record = rundir.read_checkpoint(args.init_from, check_weights=False).get("tokenizer")
        had, source = tokenizer.from_record(record, gpt2), f"--init_from {args.init_from}"
    elif args.init_from:
        had, source = gpt2, f"--init_from {args.init_from}"
    else:
        return asked or gpt2
    if asked is not None and asked.fingerprint != had.fingerprint:
        raise UsageError(f"--tokenizer {args.tokenizer} ({asked.name}) is not the tokenizer of "
                         f"{source} ({had.describe()}): a model reads only its own tokenizer's "
                         f"ids; drop --tokenizer")
    return had

def model_config(args, ckpt=None, tok=None):
    """The GPTConfig a run trains: a resumed checkpoint's, --init_from's (a model_*.pt's, or
    OpenAI's GPT-2's config.json; fine-tuning on conversations lets the chat tokens be predicted),
    or the preset's shape with --arch's parts, changed by any shape flag given; its vocabulary
    tok's (None: GPT-2's BPE), padded to a multiple of 64."""
    if ckpt is not None:
        return GPTConfig(**ckpt["config"])
    if args.init_from:
        if os.path.isfile(args.init_from):  # a checkpoint of ours
            config = rundir.read_checkpoint(args.init_from, check_weights=False)["config"]
        else:
            config = openai_gpt2.pretrained_config(args.init_from)
        config = GPTConfig(**{**config, "dropout": args.dropout})
        if args.sft:  # tok's chat tokens, in the padding rows (GPT-2's) or after <|endoftext|>
            tokens = chat.GPT2_TOKENS if tok is None else chat.tokens_of(tok.encoding())
            config = replace(config, real_vocab_size=tokens.vocab)
        return config
    shape = {**settings.MODEL_PRESETS[args.preset], **settings.ARCHITECTURES[args.arch],
             "dropout": args.dropout}
    if tok is not None and not tok.gpt2:  # GPT-2's: GPTConfig's defaults
        shape.update(vocab_size=tok.padded_vocab, real_vocab_size=tok.eot + 1)
    for k in settings.SHAPE_FLAGS:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    try:
        return GPTConfig(**shape)
    except ValueError as e:
        raise UsageError(str(e)) from None

# ===== The model =====
class KVCache:
    """Keys and values (n_layer, B, n_kv_head, max_len, hs) of the first `pos` tokens. A cache
    made by `continue_rows` is ragged: row b's own tokens are its first lengths[b] (the rest of
    the first `pos` is padding it never sees), and the new tokens sit at positions lengths[b]..."""

    def __init__(self, config: GPTConfig, batch_size, max_len, device, dtype):
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, hs)
        self.k, self.v = (torch.zeros(shape, device=device, dtype=dtype) for _ in range(2))
        self.pos = 0
        self.lengths, self.longest = None, 0  # ragged rows: (B,) long, and its largest value
        self.mask = None  # ((pos, T), attention_mask(T)): the forward's layers share one

    def update(self, layer, k, v):
        """Store k, v (B, nkv, T, hs) after the filled positions; returns all keys and values."""
        T = k.size(2)
        self.k[layer, :, :, self.pos: self.pos + T] = k
        self.v[layer, :, :, self.pos: self.pos + T] = v
        return self.k[layer, :, :, : self.pos + T], self.v[layer, :, :, : self.pos + T]

    def continue_rows(self, rows, lengths, max_new):
        """A ragged cache for one more forward: its row i continues the first lengths[i] tokens
        of this cache's row rows[i], with room for max_new tokens (the prefix that the options of
        a question share, computed once for all of them). The rows are copied once, straight into
        the new cache (the cache a chunk of CORE's rows reads is its largest tensor)."""
        out = copy.copy(self)
        index = torch.tensor(rows, device=self.k.device)
        L, _, nkv, _, hs = self.k.shape
        shape = (L, len(rows), nkv, self.pos + max_new, hs)
        out.k, out.v = (torch.empty(shape, device=self.k.device, dtype=self.k.dtype)
                        for _ in range(2))
        for old, new in ((self.k, out.k), (self.v, out.v)):
            torch.index_select(old[:, :, :, : self.pos], 1, index, out=new[:, :, :, : self.pos])
            new[:, :, :, self.pos:].zero_()  # the new tokens' room
        out.lengths = torch.tensor(lengths, device=self.k.device)
        out.longest = max(lengths)
        out.mask = None
        return out

    def positions(self, T):
        """The positions of T new tokens: (T,) after the cached ones, (B, T) for ragged rows."""
        new = torch.arange(T, device=self.k.device)
        if self.lengths is None:
            return new + self.pos
        return self.lengths[:, None] + new

    def end(self, T):
        """One past the last position of T new tokens (of the longest ragged row)."""
        if self.lengths is None:
            return self.pos + T
        return self.longest + T

    def attention_mask(self, T):
        """What T new tokens see of the cache and of each other, as SDPA's (attn_mask,
        is_causal): the cached keys (a ragged row: its own only) and the new ones up to each.
        Made once for a forward's T tokens: every layer asks before pos moves on."""
        if self.mask is not None and self.mask[0] == (self.pos, T):
            return self.mask[1]
        device = self.k.device
        if self.pos == 0:
            return None, True
        if self.lengths is None and T == 1:  # the one new token sees everything
            return None, False
        own = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
        cached = torch.ones(1, self.pos, dtype=torch.bool, device=device)  # (1 or B, pos)
        if self.lengths is not None:
            cached = torch.arange(self.pos, device=device) < self.lengths[:, None]
        B = cached.size(0)
        mask = torch.cat((cached[:, None].expand(B, T, -1), own.expand(B, T, T)), dim=2)
        self.mask = ((self.pos, T), (mask[:, None], False))  # (1 or B, 1, T, pos + T)
        return self.mask[1]

VE_GATE_CHANNELS = 32  # the input channels a value embedding's gate reads

def value_embed_layers(config: GPTConfig):
    """The blocks with value embeddings: every other one, counted back from the last."""
    if not config.value_embeds:
        return []
    return list(range(config.n_layer - 1, -1, -2))[::-1]

ROPE_BASE = 10000.0  # rotary embeddings: the slowest pair turns by base^(-(hs-2)/hs) a position
RMS_EPS = 1e-6

def make_norm(config: GPTConfig, dim):
    """The norm of the residual stream: GPT-2's LayerNorm, or an RMSNorm without weights."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=RMS_EPS, elementwise_affine=False)
    return nn.LayerNorm(dim, bias=config.bias)

def head_rms_norm(x):
    """Each head's vector x (..., hs) RMS-normalized in x's own dtype: autocast would return it in
    fp32 (its copy kept for the backward), and the cast back costs more passes than the norm."""
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)

def rotary_tables(config: GPTConfig):
    """cos and sin (block_size, hs/2) of the angle pos * base^(-2i/hs) by which rotary embeddings
    turn pair i of a head at position pos: the dot product of a query and a key then depends on
    their positions only through their distance."""
    hs = config.n_embd // config.n_head
    inv_freq = ROPE_BASE ** (-torch.arange(0, hs, 2, dtype=torch.float32) / hs)  # (hs/2,)
    angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()

def rotate(x, cos, sin):
    """x (..., hs) with each pair (x[..., i], x[..., i + hs/2]) turned by the angle whose cos and
    sin are given (..., hs/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((torch.addcmul(x1 * cos, x2, sin, value=-1),  # x1 cos - x2 sin
                      torch.addcmul(x2 * cos, x1, sin)), dim=-1)  # x2 cos + x1 sin

class Rotary(torch.autograd.Function):
    """rotate() with its gradient: the turn by the opposite angle, nothing kept but the tables
    (autograd's own would keep and sum more, in three times the passes)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin), None, None

def apply_rotary(x, cos, sin):
    """x (B, nh, T, hs) with each pair (x[..., i], x[..., i + hs/2]) turned by its position's
    angle (cos, sin: (T, hs/2)); the halves' pairing is Llama's."""
    return Rotary.apply(x, cos.to(x.dtype), sin.to(x.dtype))

class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx=0):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.hs = config.n_embd // config.n_head
        self.layer_idx, self.dropout = layer_idx, config.dropout
        self.qk_norm = config.qk_norm
        # q for all heads and k, v for the n_kv_head key/value heads, in one matmul
        qkv = (config.n_head + 2 * config.n_kv_head) * self.hs
        self.c_attn = nn.Linear(config.n_embd, qkv, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # adds to the residual stream
        self.c_proj.ZERO_INIT = config.zero_init
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ve_gate = None
        if layer_idx in value_embed_layers(config):  # each kv head's gate from a few channels
            self.ve_gate = nn.Linear(min(VE_GATE_CHANNELS, config.n_embd), self.n_kv_head,
                                     bias=False)
            self.ve_gate.ZERO_INIT = True  # 2 sigmoid(0) = 1: the values add ve at init

    def forward(self, x, kv_cache=None, rotary=None, ve=None):
        """x (B, T, C); rotary: the (cos, sin) of these T positions, or None (positions in wpe);
        ve: the tokens' value embeddings (B, T, n_kv_head * hs), or None."""
        B, T, C = x.size()
        hs, nh, nkv = self.hs, self.n_head, self.n_kv_head
        q, k, v = self.c_attn(x).split([nh * hs, nkv * hs, nkv * hs], dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if ve is not None:  # autocast: the sum in v's dtype
            v = v + self.value_embedding(x, ve).to(v.dtype)
        if self.qk_norm:  # bounded logits q.k / sqrt(hs): no head's softmax saturates
            q, k = head_rms_norm(q), head_rms_norm(k)
        if rotary is not None:  # before the cache: cached keys keep their own positions
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        mask, causal = None, True
        if kv_cache is not None:
            mask, causal = kv_cache.attention_mask(T)
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, nkv, past + T, hs)
        extra = {"enable_gqa": True} if nkv != nh else {}  # nh/nkv query heads share k,v
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                           is_causal=causal and mask is None, **extra)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def value_embedding(self, x, ve):
        """(B, nkv, T, hs): each token's own value vector ve (B, T, nkv * hs), for each kv head
        scaled by a gate in (0, 2) read from the input (a token's vector is not always wanted)."""
        B, T, _ = x.size()
        gate = 2 * torch.sigmoid(self.ve_gate(x[..., : self.ve_gate.in_features]))  # (B, T, nkv)
        return (gate[..., None] * ve.view(B, T, self.n_kv_head, self.hs)).transpose(1, 2)

class ReLUSquared(torch.autograd.Function):
    """relu(h)^2, keeping relu(h) for the backward (as much as GELU keeps) and taking its
    gradient 2 relu(h) grad in one pass (autograd's h * h takes four)."""

    @staticmethod
    def forward(ctx, h):
        r = F.relu(h)
        ctx.save_for_backward(r)
        return r * r  # not .square(): autocast runs pow in fp32, a (B, T, 4C) fp32 copy kept

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return torch.addcmul(torch.zeros((), dtype=r.dtype, device=r.device), grad, r, value=2)

class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.relu_squared = config.activation == "relu2"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.c_proj.ZERO_INIT = config.zero_init
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = self.c_fc(x)  # (B, T, 4C)
        if self.relu_squared:  # ReLU(h)^2: as cheap as ReLU, learns faster than GELU (Primer)
            h = ReLUSquared.apply(h)
        else:
            h = self.gelu(h)
        return self.dropout(self.c_proj(h))

class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx=0):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, rotary=None, ve=None):
        # pre-norm: the residual stream itself is never normalized
        x = x + self.attn(self.ln_1(x), kv_cache, rotary, ve)
        return x + self.mlp(self.ln_2(x))

class X0Mix(torch.autograd.Function):
    """x + lam * x0 in one pass, and its gradients in three (autograd's own takes five): lam's a
    dot product, x0's a scaled copy, x's the gradient itself."""

    @staticmethod
    def forward(ctx, x, lam, x0):
        ctx.save_for_backward(lam, x0)
        return torch.addcmul(x, lam, x0)

    @staticmethod
    def backward(ctx, grad):
        lam, x0 = ctx.saved_tensors
        grad_lam = torch.dot(grad.reshape(-1), x0.reshape(-1).to(grad.dtype))
        return grad, grad_lam.reshape(lam.shape).to(lam.dtype), (grad * lam).to(x0.dtype)

class Skips(nn.Module):
    """The blocks run with connections around them, each weighted by learned scalars that start at
    0 (the model starts as the one without them). x0_skip: block i's input adds x0_lambdas[i] *
    x0, the embedding the blocks start from. unet_skip: as in a U-net, the second half's blocks
    add the first half's outputs in mirror order (block n-1-j adds block j's, by
    unet_lambdas[j])."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        n = config.n_layer
        self.x0_lambdas = nn.Parameter(torch.zeros(n)) if config.x0_skip else None
        self.unet_lambdas = nn.Parameter(torch.zeros(n // 2)) if config.unet_skip else None

    def forward(self, blocks, x, kv_cache, rotary, ve):
        x0, outputs, n = x, [], len(blocks)
        for i, block in enumerate(blocks):
            if self.x0_lambdas is not None and torch.compiler.is_compiling():
                x = torch.addcmul(x, self.x0_lambdas[i], x0)  # inductor fuses it (and block 0's
            elif self.x0_lambdas is not None:  # x is x0, which dynamo refuses to pass twice)
                x = X0Mix.apply(x, self.x0_lambdas[i], x0)
            mirror = n - 1 - i
            if self.unet_lambdas is not None and mirror < n // 2:
                x = x + self.unet_lambdas[mirror] * outputs[mirror]
            x = block(x, kv_cache, rotary, ve.get(i))
            if self.unet_lambdas is not None and i < n // 2:  # kept for the mirror block
                outputs.append(x)
        return x

# the head's bias enters the logits times this: the unigram log-frequencies it learns are ~10 from
# the start at 0, and AdamW moves each parameter by about its LR a step (docs/lab_record.md)
HEAD_BIAS_SCALE = 30.0

# elements of one chunk's (rows, vocab) logits in the soft-capped head: enough rows for fast
# matmuls and few re-reads of the head's gradient, a few fp32 copies of a chunk at once
HEAD_CHUNK = {"cpu": 1 << 25, "other": 1 << 28}

class SoftcapHeadLoss(torch.autograd.Function):
    """The mean cross-entropy of the logits cap * tanh((x @ w.T + b) / cap) against targets (b:
    the head's bias (vocab,), or None), a chunk of rows at a time, with the gradients of x, w and
    b computed in the forward: nothing of size (N, vocab) is kept for the backward (the plain
    formula keeps the tanh's output and the softmax), no logits are returned (training never reads
    them), and each chunk takes a few elementwise passes (the plain formula's autograd takes twice
    as many over the whole tensor).
    The tanh is 2 * sigmoid(2u) - 1, whose derivative 1 - tanh^2 is 4s(1 - s): sigmoid is the
    cheaper op. The passes run in the matmul's dtype (autocast's, as the plain formula's tanh);
    the sums and the gradients' scale in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, cap, n_real, grads):
        # x (N, C), weight (V, C), targets (N,); ids >= n_real (padding) are never predicted
        N, V = x.size(0), weight.size(0)
        rows = max(1, HEAD_CHUNK.get(x.device.type, HEAD_CHUNK["other"]) // V)
        losses = []  # each chunk's summed loss
        valid = targets != -100  # F.cross_entropy's ignore_index
        wide = torch.promote_types(x.dtype, torch.float32)
        grad_x, grad_w, grad_b = None, None, None
        if grads:
            grad_x = torch.empty_like(x)
            grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, wide))
        bz = None  # the bias on the sigmoid's scale, 2 b / cap
        if bias is not None:
            bz = bias.to(wide) * (2 / cap)
            if grads:
                grad_b = torch.zeros_like(bz)
        shift = torch.full((), -2 * cap, device=x.device)  # 0-dim: added in the same pass
        w = weight  # the matmuls' copy: autocast's dtype, cast once, not once a chunk
        if torch.is_autocast_enabled(x.device.type):
            w = weight.to(torch.get_autocast_dtype(x.device.type))
        for i in range(0, N, rows):
            xc, tc, vc = x[i: i + rows], targets[i: i + rows].clamp(min=0), valid[i: i + rows]
            xw, wt = xc.to(wide), weight[tc].to(wide)  # (r, C): the rows, the targets' weights
            xs = xw * (2 / cap)  # then z = 2u, u = logits / cap
            s = F.linear(xs, w, bz).sigmoid_()  # (r, V) in autocast's dtype; tanh(u) = 2s - 1
            # exp(logit - cap) = exp(2 cap s - 2 cap) <= 1: a softmax with no max to find
            e = torch.add(shift, s, alpha=2 * cap).exp_()
            e[:, n_real:] = 0  # padding ids: never predicted
            total = e.sum(dim=1, dtype=wide)  # (r,)
            # the targets' own logits in `wide` from their rows of the head (r,)
            z_t = (xs * wt).sum(dim=1)
            if bz is not None:
                z_t = z_t + bz[tc]
            s_t = torch.sigmoid(z_t)
            losses.append(((total.log() + cap - (2 * cap * s_t - cap)) * vc).sum())
            if not grads:
                continue
            # d loss / d logit_true = (softmax - onehot) * 4s(1 - s), by rows: softmax = e / total
            g = e.mul_(s.addcmul_(s, s, value=-1))  # e * s(1 - s), in the matmul's dtype
            scale = (4 * vc / total)[:, None]  # (r, 1) fp32: the softmax's and the slope's 4
            hit = (4 * vc * s_t * (1 - s_t))[:, None]  # (r, 1): the onehot's part
            grad_x[i: i + rows] = (g @ w).to(wide) * scale - hit * wt
            if g.dtype == grad_w.dtype:
                grad_w.addmm_(g.t(), xc * scale)  # accumulated in place
            else:  # autocast: the product in its dtype, summed in fp32
                grad_w += g.t() @ (xw * scale)
            grad_w.index_add_(0, tc, (-hit * xw).to(grad_w.dtype))
            if grad_b is not None:  # the same sums with x a column of ones
                grad_b += g.t() @ scale[:, 0].to(g.dtype)
                grad_b.index_add_(0, tc, -hit[:, 0])
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(grad_x, grad_w, grad_b, count)
        ctx.weight_dtype = weight.dtype
        return torch.stack(losses).sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, grad_b, count = ctx.saved_tensors
        scale = grad_loss / count
        if grad_b is not None:
            grad_b = (grad_b * scale).to(ctx.weight_dtype)
        return ((grad_x * scale).to(grad_x.dtype), (grad_w * scale).to(ctx.weight_dtype),
                grad_b, None, None, None, None)

def config_buffers(config: GPTConfig):
    """GPT's buffers, which its config determines (none is in the state dict, which stays
    GPT-2's): with rotary embeddings, rotary_cos and rotary_sin, the angles of every position
    turned into q and k in each attention; vocab_mask, 0 for real tokens and -inf for padding
    ids, added in the lm_head matmul: padding is never predicted."""
    buffers = {}
    if config.pos_emb == "rope":
        buffers["rotary_cos"], buffers["rotary_sin"] = rotary_tables(config)
    real = torch.arange(config.vocab_size) < config.real_vocab_size
    buffers["vocab_mask"] = torch.where(real, 0.0, float("-inf"))
    return buffers

class GPT(nn.Module):
    masked_logits_to_keep = True  # forward takes a (B, T) bool mask as logits_to_keep

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        # GPT-2's order (the order of init and of the optimizer's parameters) with wpe or ln_e
        # where the architecture has them
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(config.vocab_size, config.n_embd)))
        if config.pos_emb == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        for name, value in config_buffers(config).items():  # rotary tables, vocab_mask
            self.register_buffer(name, value, persistent=False)
        if config.embed_norm:
            self.transformer.ln_e = make_norm(config, config.n_embd)
        self.transformer.drop = nn.Dropout(config.dropout)
        self.transformer.h = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.transformer.ln_f = make_norm(config, config.n_embd)
        if config.value_embeds:  # a table per block that has them: (vocab, n_kv_head * hs)
            kv = config.n_kv_head * (config.n_embd // config.n_head)
            self.transformer.ve = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv)
                                                 for i in value_embed_layers(config)})
        if config.x0_skip or config.unet_skip:
            self.transformer.skips = Skips(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.head_bias)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        else:  # untied: a zero head would start every logit at 0, the loss at ln(vocab)
            self.lm_head.ZERO_INIT = config.zero_head
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):  # the residual stream's variance
                std *= (2 * self.config.n_layer) ** -0.5  # kept over 2 adds a block
            if getattr(module, "ZERO_INIT", False):  # each block starts as the identity
                torch.nn.init.zeros_(module.weight)
            else:
                torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=False):
        """Parameters (a tied wte/lm_head once); non_embedding=True leaves out the lookup tables
        that no matmul uses: wpe, and wte when it is not also the head."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        if non_embedding and not self.config.tie_embeddings:
            n -= self.transformer.wte.weight.numel()
        if non_embedding and "ve" in self.transformer:
            n -= sum(p.numel() for p in self.transformer.ve.parameters())
        return n

    def forward(self, idx, targets=None, kv_cache=None, logits_to_keep=0):
        """idx (B, T) -> logits (B, T, vocab_size) and the mean cross-entropy vs targets (or None).
        With a kv_cache, idx continues the cached sequences. logits_to_keep: the last N positions'
        logits only (sampling needs one), or a (B, T) bool mask: logits (K, vocab_size) at its K
        True positions (an evaluation's scored tokens: the vocab matmul is costly)."""
        B, T = idx.size()
        pos, end = torch.arange(T, device=idx.device), T  # the positions (T,), one past the last
        if kv_cache is not None:  # after the cache's: (T,), or (B, T) for its ragged rows
            pos, end = kv_cache.positions(T), kv_cache.end(T)
        if end > self.config.block_size:
            raise ValueError(f"{end} tokens exceed block_size {self.config.block_size}")

        x = self.transformer.wte(idx)  # (B, T, C)
        rotary = None
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        else:  # the angles of these positions: (T, hs/2) each, or (B, 1, T, hs/2) when ragged
            rotary = (self.rotary_cos[pos], self.rotary_sin[pos])
            if pos.dim() == 2:
                rotary = tuple(r.unsqueeze(1) for r in rotary)
        if "ln_e" in self.transformer:
            x = self.transformer.ln_e(x)
        x = self.transformer.drop(x)
        ve = self.value_embeddings(idx)  # {block: (B, T, n_kv_head * hs)}; none in GPT-2
        if "skips" in self.transformer:  # x0 and U-net connections around the blocks
            x = self.transformer.skips(self.transformer.h, x, kv_cache, rotary, ve)
        else:
            for i, block in enumerate(self.transformer.h):
                x = block(x, kv_cache, rotary, ve.get(i))
        if kv_cache is not None:
            kv_cache.pos += T

        if isinstance(logits_to_keep, torch.Tensor):
            if logits_to_keep.dtype != torch.bool or logits_to_keep.shape != (B, T):
                raise ValueError(f"logits_to_keep: an int or a ({B}, {T}) bool mask, not "
                                 f"{tuple(logits_to_keep.shape)} {logits_to_keep.dtype}")
            x = x[logits_to_keep]  # (K, C)
        elif logits_to_keep > 0:
            x = x[:, -logits_to_keep:]  # (B, logits_to_keep, C)
        if targets is not None and x.shape[:2] != (B, T):
            raise ValueError("targets need every position's logits: leave logits_to_keep 0")
        return self.head(self.transformer.ln_f(x), targets)

    def value_embeddings(self, idx):
        """The tokens' value embeddings for each block that has them: {block: (B, T, kv)}."""
        if "ve" not in self.transformer:
            return {}
        return {int(i): table(idx) for i, table in self.transformer.ve.items()}

    def head(self, x, targets=None):
        """x (..., C) -> logits (..., vocab_size) and their mean cross-entropy vs targets; with
        a soft-cap and targets, the loss only (logits None: a (B, T, vocab) tensor saved)."""
        cap, weight, bias = self.config.logit_softcap, self.lm_head.weight, None
        if self.lm_head.bias is not None:  # scaled up: AdamW moves a parameter by about its LR
            bias = HEAD_BIAS_SCALE * self.lm_head.bias  # a step, a log-frequency is ~10 away
        if cap > 0 and targets is not None:  # the loss's gradients computed as it goes
            grads = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (x, weight, bias))
            loss = SoftcapHeadLoss.apply(x.flatten(0, -2), weight, bias, targets.reshape(-1),
                                         cap, self.config.real_vocab_size, grads)
            return None, loss
        # -inf added to the padding ids' logits in the matmul itself: they are never predicted
        if cap > 0:  # squashed into (-cap, cap) first: the -inf stays -inf
            logits = F.linear(x, weight, bias)  # (B, T, vocab_size), autocast's dtype
            # the mask cast to it: an fp32 mask would make the (B, T, vocab_size) logits fp32
            logits = cap * torch.tanh(logits / cap) + self.vocab_mask.to(logits.dtype)
        else:
            mask = self.vocab_mask
            if bias is not None:
                mask = mask + bias
            logits = F.linear(x, weight, mask)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """OpenAI's GPT-2 through transformers (gpt2 .. gpt2-xl, or a save_pretrained dir), the
        vocab padded to 50304 with zero, masked rows (openai_gpt2.py)."""
        config, sd = openai_gpt2.pretrained_state_dict(name_or_dir)
        model = cls(GPTConfig(**config, dropout=dropout))
        try:
            model.load_state_dict(sd)  # strict: GPT-2's names and shapes, one to one
        except RuntimeError as e:
            raise UsageError(f"{name_or_dir}: not GPT-2's parameters ({one_line(e)})") from None
        return model

    def configure_optimizers(self, weight_decay, learning_rate, device_type, verbose=True,
                             muon=None, embed_lr=None):
        """AdamW, weight decay on matmuls and embeddings only. muon (make_muon's keywords): the
        blocks' 2-D weights go to torch.optim.Muon instead, both in one CombinedOptimizer.
        embed_lr: wte in an AdamW group of its own, at embed_lr where the rest is at
        learning_rate (its lr_scale; tied, the head with it); None or 0: none."""
        matrices = []  # Muon's share: the 2-D weights inside the blocks (attention and MLP)
        if muon is not None:
            matrices = [p for p in self.transformer.h.parameters() if p.dim() == 2]
        embedding = []
        if embed_lr:
            embedding = [self.transformer.wte.weight]
        taken = {id(p) for p in matrices + embedding}
        params = [p for p in self.parameters() if p.requires_grad and id(p) not in taken]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:  # none without biases and norm weights (torch's state-dict helpers refuse
            groups.append({"params": no_decay, "weight_decay": 0.0})  # an empty group)
        parts = {"decayed": decay, "non-decayed": no_decay}
        if embedding:  # last: the groups before keep their places in older checkpoints' order
            groups.append({"params": embedding, "weight_decay": weight_decay,
                           "lr_scale": embed_lr / learning_rate})
            parts["embedding (--embed_lr)"] = embedding
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

    def make_kv_cache(self, batch_size, max_len, device, dtype):
        """An empty KVCache for batch_size sequences of up to max_len tokens (generate, and the
        evaluations' scorer, which computes a question's shared prefix once)."""
        return KVCache(self.config, batch_size, max_len, device, dtype)

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
        cache = self.make_kv_cache(B, T1, idx.device, dtype) if use_cache else None
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
            raise UsageError(short_of_a_batch(f"the {split} shards in {data_root} hold",
                                              self.epoch_tokens, B, T, split))
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

    def divisor(self, micro_step, micro_steps):
        """What a micro-step's mean loss is divided by: every micro-step's mean is over B*T
        tokens, so their sum over micro_steps is the step's mean (ChatLoader's differ)."""
        return micro_steps

def chat_spans(ids, mask, starts, capacity, assistant_end=chat.END["assistant"]):
    """(start, length, supervised tokens) of each conversation that fits capacity tokens once cut
    after its last whole assistant turn (its assistant_end id) that fits (chat.crop's rule), and a
    line saying how many were cut or dropped and the supervised tokens that costs."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.diff(starts)
    begin = starts[:-1]
    supervised = np.add.reduceat(np.asarray(mask), begin, dtype=np.int64) if len(begin) else \
        np.zeros(0, dtype=np.int64)
    total = int(supervised.sum())
    keep = np.ones(len(begin), dtype=bool)
    long = np.flatnonzero(lengths > capacity)
    if len(long):
        ends = np.flatnonzero(np.asarray(ids) == assistant_end)  # each reply's last token
        for i in long:
            j = int(np.searchsorted(ends, begin[i] + capacity)) - 1  # the last end that fits
            if j < 0 or ends[j] < begin[i]:
                keep[i] = False
                continue
            lengths[i] = ends[j] + 1 - begin[i]
            supervised[i] = int(mask[begin[i]: begin[i] + lengths[i]].sum())
    spans = np.stack([begin, lengths, supervised], axis=1)[keep]
    lost = total - int(spans[:, 2].sum())
    note = None
    if len(long):
        dropped = int((~keep).sum())
        note = (f"{len(long) - dropped} of {len(begin)} conversations cut to the context of "
                f"{capacity - 1} tokens, {dropped} dropped: {lost:,} of {total:,} supervised "
                f"tokens ({100 * lost / max(total, 1):.1f}%) not trained")
        if lost > 0.05 * total:  # more than a few percent of what the data teaches
            note = f"warning: {note}; a larger -T keeps more"
    return spans, note


def pack_rows(lengths, order, capacity, window):
    """Conversations (indices into lengths, taken in `order`) packed into rows of at most
    capacity tokens: each row takes, while one fits, the longest of the next `window` waiting
    conversations that fits what is left of it (the earliest among equals). Returns the rows,
    lists of indices."""
    waiting, rows, k, arrived = [], [], 0, 0  # waiting: sorted (length, -arrival, index)
    while k < len(order) or waiting:
        while len(waiting) < window and k < len(order):
            bisect.insort(waiting, (int(lengths[order[k]]), -arrived, int(order[k])))
            k, arrived = k + 1, arrived + 1
        row, room = [], capacity
        while waiting:
            at = bisect.bisect_right(waiting, (room, 1)) - 1  # the longest that fits
            if at < 0:
                break
            length, _, index = waiting.pop(at)
            row.append(index)
            room -= length
            if len(waiting) < window and k < len(order):  # the window stays full
                bisect.insort(waiting, (int(lengths[order[k]]), -arrived, int(order[k])))
                k, arrived = k + 1, arrived + 1
        rows.append(row)
    return rows


class ChatLoader:
    """Batches (x, y) of shape (B, T) for fine-tuning on conversations (chat.py's format): rows of
    T + 1 tokens, each of whole conversations packed best-fit (pack_rows), the rest of a row
    padding; y is -100 (F.cross_entropy's ignore_index) where a token is not trained: the user's
    and system's turns and the padding. The rows are one stream for any number of processes: a
    micro-step takes B * num_processes rows, rank r the r-th B of them, so 2 ranks see the rows
    1 does. Train conversations come in a seeded order each epoch, val ones in file order.

    divisor() makes each micro-step's mean loss its share of the step's mean over all the step's
    supervised tokens, of every micro-step and rank: a micro-step with few weighs little.
    tokens: the conversations' tokenizer's chat.ChatTokens (GPT-2's by default)."""

    def __init__(self, B, T, data, process_rank=0, num_processes=1, split="train", seed=1337,
                 window=100, tokens=chat.GPT2_TOKENS):
        self.B, self.T, self.split, self.seed, self.window = B, T, split, seed, window
        self.process_rank, self.num_processes = process_rank, num_processes
        self.ids, self.mask, starts = data  # chat's prepared arrays: uint16, uint8, int64
        self.eot = tokens.eot
        self.spans, self.note = chat_spans(self.ids, self.mask, starts, T + 1,
                                           tokens.end["assistant"])
        if len(self.spans) == 0:
            raise UsageError(f"not one {split} conversation's first reply fits -T {T} + 1 "
                             f"tokens: a larger -T")
        self.packed = {}  # epoch: its rows (one kept: an epoch is packed once)
        self.epoch_tokens = len(self.epoch_rows(0)) * T + 1  # positions, as DataLoaderLite's
        self.reset()

    def epoch_rows(self, epoch):
        if self.split != "train":
            epoch = 0
        if epoch not in self.packed:
            order = np.arange(len(self.spans))
            if self.split == "train":  # val: in file order, the same rows every time
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.spans))
            self.packed = {epoch: pack_rows(self.spans[:, 1], order, self.T + 1, self.window)}
        return self.packed[epoch]

    def reset(self):
        self.epoch, self.row = 0, 0  # the next row of the stream
        self.position = 0  # rows drawn x T: where evaluate_loss is, in positions
        self.queue, self.step_supervised = [], None

    def state_dict(self):
        return {"epoch": self.epoch, "row": self.row, "position": self.position,
                "split": self.split, "seed": self.seed, "conversations": len(self.spans),
                "tokens": int(self.spans[:, 1].sum())}

    def load_state_dict(self, state):
        now = (len(self.spans), int(self.spans[:, 1].sum()))
        then = (state["conversations"], state["tokens"])
        if then != now:
            raise UsageError(f"the {self.split} conversations changed since the checkpoint "
                             f"({then[0]} conversations / {then[1]} tokens then, {now[0]} / "
                             f"{now[1]} now)")
        self.reset()
        self.seed, self.epoch, self.row = state["seed"], state["epoch"], state["row"]
        self.position = state["position"]

    def _draw(self):
        """The next micro-step's rows of every rank, each a list of conversation indices."""
        rows = []
        while len(rows) < self.B * self.num_processes:
            epoch_rows = self.epoch_rows(self.epoch)
            take = epoch_rows[self.row: self.row + self.B * self.num_processes - len(rows)]
            rows += take
            self.row += len(take)
            if self.row == len(epoch_rows):
                self.epoch, self.row = self.epoch + 1, 0
        self.position += len(rows) * self.T
        return rows

    def _supervised(self, rows):
        return sum(int(self.spans[i, 2]) for row in rows for i in row)

    def next_batch(self):
        rows = self.queue.pop(0) if self.queue else self._draw()
        mine = rows[self.process_rank * self.B: (self.process_rank + 1) * self.B]
        self.mine_supervised = self._supervised(mine)
        buf = np.full((self.B, self.T + 1), self.eot, dtype=np.int64)  # padding: never a target
        trained = np.zeros((self.B, self.T + 1), dtype=bool)
        for b, row in enumerate(mine):
            at = 0
            for i in row:
                start, length = int(self.spans[i, 0]), int(self.spans[i, 1])
                buf[b, at: at + length] = self.ids[start: start + length]
                trained[b, at: at + length] = self.mask[start: start + length]
                at += length
        x = torch.from_numpy(buf[:, :-1].copy())
        y = torch.from_numpy(np.where(trained[:, 1:], buf[:, 1:], -100))
        self.last_rows = rows
        return x, y

    def divisor(self, micro_step, micro_steps):
        """What this micro-step's mean loss is divided by so that the step's micro-steps add up
        to the mean over all its supervised tokens, ranks included (DDP averages the ranks'
        gradients, hence the world size): N / (n * world size), N the step's, n this micro-step's
        on this rank. At the first micro-step the step's other micro-batches are drawn (to count
        them) and kept for the next_batch calls that follow."""
        if micro_step == 0:
            self.queue = [self._draw() for _ in range(micro_steps - 1)]
            self.step_supervised = self._supervised(self.last_rows) + sum(
                self._supervised(rows) for rows in self.queue)
        return self.step_supervised / (self.mine_supervised * self.num_processes)

def short_of_a_batch(what, tokens, B, T, split):
    """The refusal of a split of `tokens` tokens that cannot fill one batch of B x T (+1)."""
    return (f"{what} {tokens:,} {split} tokens, fewer than one batch of -B {B} x -T {T} + 1 = "
            f"{B * T + 1:,}: a smaller -B or -T, or more data")

def data_needs(run):
    """(train, val) tokens the run reads, what a first-use prep writes for it (so that a loader
    always fills a batch of it): its steps' batches; its val loss's targets or one batch of
    -B x -T, the more of the two; each with the last target (+1)."""
    B, T = run.micro_batch_size, run.sequence_length
    return run.max_steps * run.total_batch_size + 1, max(run.val_tokens, B * T) + 1

def check_data(run):
    """Before any work: the run's shards (their headers) against -B, -T and --val_tokens: a
    UsageError where a loader could not fill one batch; the notes to print where the data falls
    short of the run. Before a first-use prep, its --input files are checked; the prep is sized
    for the run (data_needs), or takes a source whole (--input files, most of a FineWeb-Edu
    sample), whose size only tokenizing tells: make_loaders checks it right after the prep,
    before the model is built."""
    if run.sft:  # conversations: checked as they are prepared (make_loaders)
        return []
    sizes = fineweb.split_sizes(run.data_root)
    if sizes is None:
        if run.input is not None:
            fineweb.check_inputs(run.input)
        return []
    notes = []
    status = fineweb.prep_status(run.data_root)
    if status.has_manifest:  # shards of another tokenizer: refused before any work
        fineweb.check_tokenizer(run.data_root, {"args": status.args}, run.tok)
    else:
        notes.append(f"warning: {run.data_root} has no manifest.json: its shards were not written "
                     f"by fineweb.py (or lost their record), so they are not checked against a "
                     f"prep")
    for split in ("train", "val"):
        if sizes[split] < run.micro_batch_size * run.sequence_length + 1:
            raise UsageError(short_of_a_batch(f"the shards in {run.data_root} hold", sizes[split],
                                              run.micro_batch_size, run.sequence_length, split))
    reads, held = run.max_steps * run.total_batch_size, sizes["train"]
    if reads > held:
        notes.append(f"note: the run reads {reads:,} train tokens and {run.data_root} holds "
                     f"{held:,}: it passes over them {reads / held:.1f} times")
    # the val loss is over at most what the val split holds; asked for more than the preset's
    # default (or --val_steps), the run says so
    targets = sizes["val"] - 1
    default = settings.preset_defaults(run.preset, run.arch)["val_tokens"]
    if run.eval_every > 0 and run.val_tokens > targets + 1 and run.val_tokens != default:
        notes.append(f"warning: the val loss is asked over {run.val_tokens:,} tokens but the val "
                     f"shards hold {targets:,} targets: it is taken over those")
    return notes

def make_loaders(run, proc):
    """The run's train and val DataLoaderLites, their shards prepared on first use (rank 0
    prepares, the others wait); a prep's shards checked (check_data) as settle() checked shards
    that were there. Fine-tuning: ChatLoaders of the conversations, prepared on first use."""
    if run.sft:
        return tuple(chat_loader(run, proc, split) for split in ("train", "val"))
    first_use = fineweb.split_sizes(run.data_root) is None
    train_tokens, val_tokens = data_needs(run)
    fineweb.ensure_prepared(
        run.data_root, train_tokens=train_tokens, val_tokens=val_tokens, name=run.fineweb_name,
        inputs=run.input, text_column=run.text_column, proc=proc,
        vocab_size=run.model.real_vocab_size, tok=run.tok)
    if first_use:
        for note in check_data(run):
            print0(note)
    return tuple(DataLoaderLite(run.micro_batch_size, run.sequence_length, proc.rank,
                                proc.world_size, split, run.data_root, run.seed,
                                run.model.real_vocab_size) for split in ("train", "val"))

CHAT_DIR = os.path.join(fineweb.REPO_DIR, "chat_data")  # or --chat_dir

def chat_loader(run, proc, split):
    """A ChatLoader of the run's conversations (--chat_data, prepared into --chat_dir on first
    use by rank 0), saying what cutting them to the context costs."""
    folder = chat.ready(run.chat_data, run.chat_dir or CHAT_DIR, proc=proc, print0=print0,
                        tok=run.tok)
    loader = ChatLoader(run.micro_batch_size, run.sequence_length, chat.open_split(folder, split),
                        proc.rank, proc.world_size, split, run.seed,
                        tokens=chat.tokens_of(run.tok.encoding()))
    if loader.note:
        print0(f"{split} conversations: {loader.note}")
    return loader

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

def make_optimizer(model, run, verbose=False):
    """The run's optimizer: AdamW, or (--optimizer muon) Muon for the blocks' matrices."""
    muon = None
    if run.optimizer == "muon":
        muon = dict(lr=run.muon_lr, momentum=run.muon_momentum, ns_steps=run.muon_ns_steps,
                    adjust_lr_fn=run.muon_adjust_lr)
    return model.configure_optimizers(run.weight_decay, run.max_lr, run.device_type, verbose,
                                      muon, run.embed_lr)

def get_lr(step, max_lr, min_lr, warmup_steps, max_steps, wsd_decay=0.0):
    """Linear warmup to max_lr, then cosine decay to min_lr at max_steps (GPT-2's); or, with
    wsd_decay f > 0, warmup-stable-decay: max_lr until the last f of the steps, then linear to
    min_lr at max_steps. After max_steps: min_lr."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    if wsd_decay > 0:
        decay_start = max(warmup_steps, max_steps - round(wsd_decay * max_steps))
        if step < decay_start:
            return max_lr
        return max_lr + (min_lr - max_lr) * (step - decay_start) / (max_steps - decay_start)
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

@dataclass(frozen=True)
class Schedule:
    """The run's LR and batch size by step, from its flags; unit: the tokens of one micro-step on
    all ranks (B * T * world size), which every batch is a multiple of."""
    max_lr: float
    min_lr: float
    warmup_steps: int
    max_steps: int
    wsd_decay: float
    total_batch_size: int
    ramp_tokens: int
    ramp_start: int
    unit: int

    @classmethod
    def of(cls, run):
        unit = run.micro_batch_size * run.sequence_length * run.world_size
        return cls(run.max_lr, run.max_lr * run.min_lr_ratio, run.warmup_steps, run.max_steps,
                   run.wsd_decay, run.total_batch_size, run.batch_ramp_tokens,
                   run.batch_ramp_start, unit)

    def lr(self, step):
        return get_lr(step, self.max_lr, self.min_lr, self.warmup_steps, self.max_steps,
                      self.wsd_decay)

    def batch_size(self, tokens_seen):
        return batch_size_at(tokens_seen, self.ramp_tokens, self.total_batch_size, self.unit,
                             self.ramp_start)

# ===== Distributed: this process in the run, FSDP =====
def setup_distributed(device="auto", fsdp=False):
    """This process's Proc (torchrun's environment, or one process), on the device (--device's
    value: "auto", "cpu", "cuda", ...), with its process group up and the device's settings made
    (common.tune_for_device). fsdp: --fsdp, which needs torchrun."""
    proc = Proc()
    if fsdp and not proc.distributed:
        raise UsageError("--fsdp shards the model across processes: launch with torchrun")
    device = resolve_device(device)
    if proc.distributed and device.startswith("cuda"):
        if proc.local_rank >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK {proc.local_rank} but only {torch.cuda.device_count()} "
                             f"GPU(s) here: ask torchrun for at most that many processes per node",
                             rank_specific=True)
        device = f"cuda:{proc.local_rank}"
        torch.cuda.set_device(device)
    if proc.distributed:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    tune_for_device(device)
    proc.device = device
    return proc

def shard_model(raw_model, precision):
    """FSDP2 on every block, then on the root (embeddings, tied lm_head, ln_f); in place."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy()
    if precision.name == "bf16":  # bf16 compute and all-gathers; fp32 reductions and master weights
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in raw_model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(raw_model, mp_policy=mp)

# ===== Evaluation: val loss, HellaSwag, CORE, samples =====
@torch.no_grad()
def evaluate_loss(model, loader, n_tokens, device, autocast_ctx, world_size=1, token_bytes=None):
    """Mean loss over the first n_tokens targets of the split (at most all it holds), all ranks
    together: the same tokens for any B and process count. token_bytes (each id's length in
    bytes, a tensor on device, or None): (that loss, bits per byte: the targets' summed loss in
    bits over their bytes, <|endoftext|> costing bits and no bytes, which compares across
    tokenizers; None without token_bytes)."""
    n_tokens = min(n_tokens, loader.epoch_tokens - 1)
    was_training = model.training
    model.eval()
    loader.reset()
    per_rank = loader.B * loader.T
    steps = math.ceil(n_tokens / (per_rank * loader.num_processes))
    # (sum of token losses, tokens, their bytes)
    total = torch.zeros(3, device=device, dtype=torch.float64)
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
        if valid > 0:  # loss: the mean over the targets not ignored (fine-tuning: the trained)
            counted = (y != -100).sum()
            total[0] += torch.where(counted > 0, loss.double() * counted, 0.0)
            total[1] += counted
            if token_bytes is not None:
                total[2] += token_bytes[torch.where(y != -100, y, 0)][y != -100].sum()
    model.train(was_training)
    if world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    loss = (total[0] / total[1]).item()
    if token_bytes is None:
        return loss, None
    return loss, (total[0] / (math.log(2) * total[2])).item()

def val_token_bytes(run):
    """Each id's length in bytes (vocab,) on the run's device, for the val loss in bits per byte;
    None when fine-tuning (its val loss is of the supervised tokens, not of a text's bytes)."""
    if run.sft:
        return None
    return torch.from_numpy(run.tok.token_bytes()).to(run.device)

def encode_prompt(enc, text):
    """Token ids of a prompt; an empty prompt starts from <|endoftext|>, as a new document."""
    return enc.encode(text, allowed_special={"<|endoftext|>"}) or [enc.eot_token]

def decode_sample(enc, tokens, n_prompt):
    """The prompt and what follows up to <|endoftext|>, as text, blank lines squeezed."""
    eot = enc.eot_token
    new = tokens[n_prompt:]
    if eot in new:
        new = new[: new.index(eot)]
    text = enc.decode([t for t in tokens[:n_prompt] if t != eot] + new)
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

def hellaswag_accuracy(raw_model, run, proc):
    """HellaSwag's acc_norm of the model, its examples split over the ranks; None (with a warning)
    when the data went away since the run started: the run goes on without it."""
    try:
        res = hellaswag.evaluate(raw_model, run.device, limit=run.hellaswag_limit, proc=proc,
                                 device_type=run.device_type, autocast_dtype=run.precision.dtype,
                                 enc=run.tok.encoding())
    except hellaswag.HellaSwagUnavailable as e:
        print0(f"warning: HellaSwag evaluation turned off: {e}")
        return None
    print0(f"HellaSwag accuracy: {res['correct_norm']}/{res['n']}={res['acc_norm']:.4f}")
    return res["acc_norm"]

def core_tasks(run, proc):
    """CORE's tasks for the run's evaluations (--core_max_per_task examples of each), the eval
    bundle installed by the master on first use; None (with a warning) when it can't be had: the
    run goes on without CORE."""
    if run.core_every == 0:
        return None
    try:
        folder = core_eval.ready_on_every_rank(proc)
        return core_eval.load_tasks(folder, max_per_task=run.core_max_per_task)
    except core_eval.BundleError as e:
        print0(f"warning: CORE evaluation turned off: {e}")
        return None

def core_score(raw_model, tasks, run, proc):
    """(log kind, value) of CORE and each task's centred accuracy, the examples split over the
    ranks."""
    res = core_eval.evaluate(raw_model, run.device, tasks, proc=proc, device_type=run.device_type,
                             autocast_dtype=run.precision.dtype, enc=run.tok.encoding())
    print0(f"CORE: {res['core']:.4f} (se {res['core_se']:.4f}, {len(tasks)} tasks)")
    return [("core", res["core"])] + [(f"core/{label}", task["centered"])
                                      for label, task in res["tasks"].items()]

def chat_eval_tasks(run, proc):
    """The chat tasks for a fine-tuning run's evaluations (--chat_max_per_task questions of each),
    downloaded by the master on first use; None (with a warning) when they can't be had."""
    if run.chat_every == 0:
        return None
    try:
        folder = chat_eval.ready_on_every_rank(proc, list(chat_eval.TASKS))
        return chat_eval.load_tasks(folder, list(chat_eval.TASKS), run.chat_max_per_task,
                                    enc=run.tok.encoding())
    except chat_eval.ChatEvalError as e:
        print0(f"warning: the chat evaluation turned off: {e}")
        return None

def chat_score(raw_model, tasks, run, proc):
    """(log kind, value) of the chat tasks' centred mean and each task's centred accuracy."""
    res = chat_eval.evaluate(raw_model, run.device, tasks, proc=proc, device_type=run.device_type,
                             autocast_dtype=run.precision.dtype, enc=run.tok.encoding())
    print0(f"chat tasks: centred mean {res['centered_mean']:.4f} (se "
           f"{res['centered_mean_se']:.4f}, {len(tasks)} tasks)")
    return [("chat", res["centered_mean"])] + [(f"chat/{label}", task["centered"])
                                               for label, task in res["tasks"].items()]

# ===== Keeping a run safe: checkpoints (rundir.py handles the files), the step's read-back =====
@dataclass
class TrainState:
    """Where a run stands, besides the weights, optimizer, loader and random generators."""
    step: int = -1  # the last optimizer step taken (and checkpointed); -1: none yet
    tokens_seen: int = 0  # train tokens consumed so far (for the batch-size ramp)
    val_loss: float | None = None  # the latest val loss
    args: dict | None = None  # the run's flags: a resume takes those not given again

class Checkpointer:
    """A run's checkpoints, built once from the parts an exact resume needs (the raw model, the
    optimizer, the loss scaler, the train loader, the TrainState): it restores them from a
    checkpoint, notes where each finished step leaves the run, saves model_{step}.pt every
    --save_every steps, at this invocation's last step and when a stop signal says so, and after a
    failure or a dropped step keeps the last finished step."""

    def __init__(self, run, proc, raw_model, optimizer, scaler, train_loader):
        self.run, self.proc, self.raw_model = run, proc, raw_model
        self.optimizer, self.scaler, self.train_loader = optimizer, scaler, train_loader
        self.state = TrainState(args=settings.flags_of(run))  # a new run's
        self.last_saved = -1  # the step of the newest checkpoint this run has, -1: none
        # the loader's position and the random generators as the last finished step left them: a
        # step that is dropped or fails has moved them on, its checkpoint must not
        self.after_step = self.position()

    def restore(self, ckpt):
        """Load ckpt (or nothing, for None) into the parts (FSDP: each rank its shard); returns
        the TrainState the run goes on from."""
        if ckpt is None:
            return self.state
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True)
        dcp.set_model_state_dict(self.raw_model, ckpt["model"], options=options)
        # the kernel choice belongs to this machine, and Muon's LR ratio to this invocation's flags
        groups = self.optimizer.param_groups
        kept = [{k: g[k] for k in ("fused", "foreach", "lr_scale") if k in g} for g in groups]
        dcp.set_optimizer_state_dict(self.raw_model, self.optimizer, ckpt["optimizer"],
                                     options=options)
        for group, values in zip(self.optimizer.param_groups, kept):
            group.update(values)
        if ckpt.get("scaler"):  # saved in fp16 (from bf16: a new scale)
            self.scaler.load_state_dict(ckpt["scaler"])
        self.train_loader.load_state_dict(ckpt["loader"])
        rundir.set_rng_state(ckpt["rng"])
        self.state.step, self.state.tokens_seen = ckpt["step"], ckpt["tokens_seen"]
        self.state.val_loss = ckpt["val_loss"]
        self.last_saved = self.state.step
        self.after_step = self.position()
        print0(f"resumed from {self.run.resume} at step {self.state.step + 1}")
        return self.state

    def position(self):
        """Where the train loader and the random generators stand now."""
        return {"loader": self.train_loader.state_dict(), "rng": rundir.rng_state()}

    def finished(self, step, batch_size):
        """Step `step` (batch_size tokens) is applied: where the run stands after it."""
        self.state.step, self.state.tokens_seen = step, self.state.tokens_seen + batch_size
        self.after_step = self.position()

    def save(self, step, stopping=False):
        """model_{step}.pt if one is due: every --save_every steps, at this invocation's last
        step, or when the run is stopping. Every rank calls it (FSDP gathers), rank 0 writes."""
        last = step == self.run.end_step - 1
        if last or stopping or (step > 0 and due(self.run.save_every, step)):
            self.write(step)
            print0(f"saved {self.path(step)}")

    def keep_last_step(self, together=False):
        """After a failure or a dropped step: the last finished step saved if it is not yet.
        together: every rank is here (a stop they agreed on between micro-steps), so they save
        as at any step; else without a collective (the failure may be this rank's alone), and
        FSDP, which must gather its shards to save, keeps its newest checkpoint."""
        if self.state.step <= self.last_saved:
            return
        if together:
            self.write(self.state.step)
        elif not (self.run.fsdp and self.proc.world_size > 1):
            self.write(self.state.step, collective=False)

    def path(self, step):
        return rundir.checkpoint_path(self.run.log_dir, step)

    def newest(self):
        """The path of the run's newest checkpoint, or None."""
        return self.path(self.last_saved) if self.last_saved >= 0 else None

    def write(self, step, collective=True):
        """model_{step}.pt, all an exact resume needs. collective=False: False if not saved."""
        from torch.distributed.checkpoint import state_dict as dcp
        # unsharded, on the CPU, keyed by parameter name: the same from a plain, DDP or FSDP model
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = self.state
        checkpoint = {
            "model": dcp.get_model_state_dict(self.raw_model, options=options),
            "optimizer": dcp.get_optimizer_state_dict(self.raw_model, self.optimizer,
                                                      options=options),
            "scaler": self.scaler.state_dict(),  # fp16's loss scale ({} in bf16 and fp32)
            "config": asdict(self.raw_model.config),
            "tokenizer": self.run.tok.record(),  # its fingerprint, and a trained one's files
            "step": step,
            "tokens_seen": state.tokens_seen,
            "val_loss": state.val_loss,
            # where the next step's batches start; python, numpy, torch (and CUDA) generators
            "loader": self.after_step["loader"],
            "rng": self.after_step["rng"],
            "args": state.args,
            "provenance": self.run.provenance,  # the code and machine
        }
        saved = rundir.write_checkpoint(self.path(step), checkpoint, self.run.keep_last,
                                        self.proc, collective)
        if saved:
            self.last_saved = step
        return saved

def model_from_checkpoint(ckpt, path, device="cpu"):
    """The GPT a checkpoint holds, in fp32; a UsageError if its config and weights disagree. On
    device "meta" only that check, which allocates nothing."""
    try:
        with torch.device(device):
            model = GPT(GPTConfig(**ckpt["config"]))
        model.load_state_dict(ckpt["model"], assign=device == "meta")
    except (TypeError, ValueError, RuntimeError) as e:  # an unknown key, a shape the weights lack
        raise UsageError(f"{path}: its config and weights disagree ({one_line(e, 200)})") from None
    return model

def initial_model(run):
    """--init_from's weights in the run's model config: a model_*.pt of ours, or OpenAI's GPT-2 (a
    name or a transformers folder). The config can differ only in the tokens it predicts (a
    fine-tuning run's), which the weights do not hold."""
    if os.path.isfile(run.init_from):
        weights = rundir.read_checkpoint(run.init_from)["model"]
    else:
        pretrained = GPT.from_pretrained(run.init_from, dropout=run.dropout)
        if pretrained.config == run.model:
            return pretrained
        weights = pretrained.state_dict()
    model = GPT(run.model)
    model.load_state_dict(weights)
    return model

def check_step(loss_accum, norm, scaler, stop, proc):
    """The step's one read-back, before its update is applied: (loss, gradient norm, whether every
    rank goes on, whether the fp16 scaler skips this update). The loss is the mean over ranks; a
    stop signal on any rank stops them all after this step. A loss or norm that is not finite
    stops the run here, so a diverged step never reaches the weights (an fp16 overflow is not
    that: the scaler skips the update and halves its scale, until below 1)."""
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
        norm = norm.full_tensor()
    go_on = torch.tensor(float(stop.signum is None), device=loss_accum.device)
    if proc.world_size > 1:
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # gloo has no AVG: sum, then divide
        loss_accum /= proc.world_size
        dist.all_reduce(go_on, op=dist.ReduceOp.MIN)
    loss, norm, go_on = torch.stack([loss_accum, norm.float(), go_on]).tolist()
    skipped = scaler.is_enabled() and not math.isfinite(norm) and scaler.get_scale() >= 1
    if not (math.isfinite(loss) and (math.isfinite(norm) or skipped)):
        raise UsageError(f"the loss is {loss} and the gradient norm {norm}: the run diverged and "
                         f"stopped before this update (lower --max_lr or raise --warmup_steps, "
                         f"and resume)")
    return loss, norm, go_on == 1.0, skipped

# ===== train(): the whole run =====
def train(run, proc, ckpt=None):
    """One run, start to end; returns the exit status (0, or 128 + the signal that stopped it)."""
    # one run per log dir (a lock, released however the run ends); stop signals caught
    claim = rundir.claim_log_dir(run, ckpt, proc)
    stop = rundir.StopSignals(proc)  # SIGTERM, SIGINT, SIGUSR1: save the last step, exit
    step, stopped_by = None, None
    try:
        print0(run.describe())
        # ---- the data, prepared on first use (by rank 0; the others wait)
        train_loader, val_loader = make_loaders(run, proc)

        # ---- the model (raw: unwrapped, uncompiled: for saving, HellaSwag, samples)
        torch.manual_seed(run.seed)
        np.random.seed(run.seed)
        random.seed(run.seed)
        raw_model = initial_model(run) if run.init_from else GPT(run.model)
        raw_model.to(run.device)
        print0(f"model: {raw_model.get_num_params():,} parameters")
        if run.fsdp:
            shard_model(raw_model, run.precision)
        optimizer = make_optimizer(raw_model, run, verbose=proc.master)
        # fp16: the loss scaled up so that small gradients do not underflow
        scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision.scaler)
        checkpointer = Checkpointer(run, proc, raw_model, optimizer, scaler, train_loader)
        state = checkpointer.restore(ckpt)
        ckpt = None  # free its tensors
        model = torch.compile(raw_model) if run.compile else raw_model
        ddp = proc.distributed and not run.fsdp  # FSDP reduce-scatters every micro-step
        if ddp:
            model = DDP(model, device_ids=[proc.local_rank] if run.device_type == "cuda" else None)
        meter = Metrics(run, proc, state.step + 1, raw_model.get_num_params(non_embedding=True))
        profiler = Profiler(run, proc)
        hellaswag_on = run.hellaswag_every > 0 and hellaswag.ready_on_every_rank(proc)
        core = core_tasks(run, proc)  # None: CORE off
        chat_tasks = chat_eval_tasks(run, proc)  # None: off
        token_bytes = val_token_bytes(run)  # None: fine-tuning

        # ============================== training ==============================
        for step in range(state.step + 1, run.max_steps + 1):
            stop.allow_interrupts(True)  # a stop signal from here on: at once
            last_step = step == run.max_steps  # the final model: evaluated, not trained
            if step == run.end_step and not last_step:
                break

            # once in a while: the val loss of the model after `step` updates
            if due(run.eval_every, step, last_step):
                state.val_loss, bpb = evaluate_loss(model, val_loader, run.val_tokens, run.device,
                                                    run.precision.autocast, proc.world_size,
                                                    token_bytes)
                meter.report_val(step, state.val_loss, bpb)  # and its bits per byte, if any

            # once in a while: HellaSwag, on the raw model, split over the ranks
            if hellaswag_on and due(run.hellaswag_every, step, last_step):
                acc_norm = hellaswag_accuracy(raw_model, run, proc)
                hellaswag_on = acc_norm is not None  # None: the data went away
                if hellaswag_on:
                    meter.log(step, "hella", acc_norm)

            # once in a while: CORE (nanochat's subsample of its 22 tasks), like HellaSwag
            if core is not None and due(run.core_every, step, last_step):
                for kind, value in core_score(raw_model, core, run, proc):
                    meter.log(step, kind, value)
            # once in a while, fine-tuning: ARC and MMLU asked in the chat format, like CORE
            if chat_tasks is not None and due(run.chat_every, step, last_step):
                for kind, value in chat_score(raw_model, chat_tasks, run, proc):
                    meter.log(step, kind, value)

            # once in a while: samples, each rank with its own seed
            if step > 0 and due(run.sample_every, step, last_step):
                texts = sample_texts(raw_model, run.tok.encoding(), run.sample_prompt,
                                     run.num_samples, run.sample_tokens, run.device,
                                     run.precision.autocast, run.seed + proc.rank, top_k=50)
                for i, text in enumerate(texts):
                    print(f"rank {proc.rank} sample {i}: {' '.join(text.split())}", flush=True)
            if last_step:
                break

            # one optimizer step: gradients accumulated over the micro-steps, clipped, applied
            stop.allow_interrupts(False)  # from here on: at the next micro-step (poll)
            t0 = time.time()
            batch_size = run.schedule.batch_size(state.tokens_seen)  # tokens, all ranks
            micro_steps = batch_size // run.schedule.unit  # grad_accum_steps, fewer in a ramp
            optimizer.zero_grad(set_to_none=True)
            loss_accum = torch.zeros((), device=run.device)
            for micro_step in range(micro_steps):
                if micro_step > 0:  # a stop signal on any rank: this step dropped, not applied
                    stop.poll()  # (after the last micro-step, check_step's vote finishes it)
                x, y = train_loader.next_batch()
                x, y = x.to(run.device), y.to(run.device)
                if ddp:  # all-reduce the gradients once, on the last micro-step
                    model.require_backward_grad_sync = micro_step == micro_steps - 1
                with run.precision.autocast:
                    _, loss = model(x, y)
                # each a mean over its targets: divided so that they add up to the step's mean
                loss = loss / train_loader.divisor(micro_step, micro_steps)
                loss_accum += loss.detach()
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip or math.inf)
            # the one read-back: loss and norm (diverged: stop), whether every rank goes on
            loss, norm, go_on, skipped = check_step(loss_accum, norm, scaler, stop, proc)
            lr = run.schedule.lr(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # --muon_lr, --embed_lr / --max_lr
            scaler.step(optimizer)  # optimizer.step(), unless fp16 overflowed
            scaler.update()
            if run.device_type == "cuda":
                torch.cuda.synchronize()  # dt: the GPU's work, not just the launches
            dt = time.time() - t0
            checkpointer.finished(step, batch_size)
            meter.report_step(step, loss, lr, norm, dt, batch_size, skipped=skipped)
            if profiler.step():
                break  # --profile exit

            # a checkpoint every --save_every steps, at the end, and when a signal says stop
            checkpointer.save(step, stopping=not go_on)
            if not go_on:
                stopped_by = stop.signum or signal.SIGTERM  # another rank's signal: the same exit
                print0(f"stopped by {signal.Signals(stopped_by).name} after step {step}: continue"
                       f" with python train_gpt2.py --resume latest --log_dir {run.log_dir}")
                break

        meter.finish()  # W&B uploads: can fail after all
        print0(meter.summary(checkpointer.newest()))
        if run.fsdp:
            raw_model.reshard()  # FSDP keeps the root's parameters gathered after an eval
        proc.agree(True)  # all ranks done with collectives before the process group goes
    except (Exception, rundir.Stopped) as e:
        if step is None:  # before the first step: nothing trained to keep, nor left behind
            claim.abandon()
            raise
        stop.end()  # a signal from here on waits for the line that says why the run ended
        checkpointer.keep_last_step(together=isinstance(e, rundir.Stopped) and e.agreed)
        return rundir.report_failure(e, step, run.log_dir, checkpointer.last_saved, proc)
    finally:
        stop.restore()
        claim.close()
    if stopped_by is not None:
        return 128 + stopped_by
    return 0

# ===== The command line: the run settled from its flags; plan, sample, export, eval =====
def settle(argv, planning=False):
    """The Run the training flags ask for, worked out once, before any work, and frozen: the flags
    with the preset and a resumed checkpoint as overlays, checked (settings.py); this process's
    place, device and precision; the model config; -B auto fitted (on CUDA confirmed by a real
    step); the counts that follow and the schedule; a step that cannot fit refused (planning: plan,
    which allocates nothing and reports it). Returns (run, proc, the checkpoint or None)."""
    args, given, ckpt = settings.read_flags(argv)
    tok = run_tokenizer(args, given, ckpt)
    asked_shape = lrs = None
    if ckpt is not None:  # what the flags ask of the model and the schedule, against what it has
        model_from_checkpoint(ckpt, args.resume, "meta")  # its config and weights agree
        asked_shape = asdict(model_config(args, tok=tok))
        lrs = tuple(get_lr(ckpt["step"] + 1, f["max_lr"], f["max_lr"] * f["min_lr_ratio"],
                           f["warmup_steps"], f["max_steps"], f.get("wsd_decay", 0.0))
                    for f in ({**vars(args), **ckpt["args"]}, vars(args)))  # then, now
    for warning in settings.check_flags(args, given, ckpt, asked_shape, lrs):
        print0(f"warning: {warning}")
    config = model_config(args, ckpt, tok)
    if args.sample_every > 0:
        n_prompt = len(encode_prompt(tok.encoding(), args.sample_prompt))
        settings.check_prompt_fits(n_prompt, args.sample_tokens, config.block_size,
                                   ("--sample_prompt", "--sample_tokens"),
                                   ": shorten them, or turn samples off with --sample_every 0")

    proc = setup_distributed(args.device, args.fsdp)
    if args.sft and "max_steps" not in given and ckpt is None:  # nanochat's SFT: one epoch
        args.max_steps = sft_epoch_steps(args, proc, planning, tok)
    precision = Precision(args.dtype, proc.device)
    if args.fsdp and precision.scaler:
        raise UsageError("--fsdp does not train in fp16: use --dtype bf16 or fp32")
    run = settings.derive(args, proc, precision, config, args.micro_batch_size, tok=tok)
    peak, n_params, n_params_non_embedding = estimate_step(run)
    if run.micro_batch_size == "auto":
        B, fit = auto_micro_batch(run, proc, peak, confirm=not planning)
        run = settings.derive(args, proc, precision, config, B, fit, tok=tok)
    first_step = 0 if ckpt is None else ckpt["step"] + 1
    for warning in settings.check_machine(run, peak, n_params, n_params_non_embedding,
                                          first_step, planning):
        print0(f"warning: {warning}")
    if not planning:  # what the data and the log dir would refuse, found now
        for note in check_data(run):
            print0(note)
        rundir.check_log_dir(run.log_dir, None if ckpt is None else ckpt["step"], run.overwrite)
    return replace(run, schedule=Schedule.of(run)), proc, ckpt

def sft_epoch_steps(args, proc, planning, tok):
    """The steps of one epoch of the train conversations packed at -T (the length of nanochat's
    SFT), prepared first on first use (rendered with tok, the run's tokenizer); plan, which writes
    nothing, needs them prepared."""
    folder = args.chat_dir or CHAT_DIR
    if planning:
        try:
            data = chat.open_split(folder, "train", tok=tok)
        except UsageError as e:
            raise UsageError(f"plan --sft: {e}; give --max_steps, or prepare them first") \
                from None
    else:
        data = chat.open_split(chat.ready(args.chat_data, folder, proc=proc, print0=print0,
                                          tok=tok), "train")
    rows = len(ChatLoader(1, args.sequence_length, data, seed=args.seed,
                          tokens=chat.tokens_of(tok.encoding())).epoch_rows(0))
    steps = max(1, math.ceil(rows * args.sequence_length / args.total_batch_size))
    print0(f"sft: one epoch of the train conversations is {rows:,} rows of -T "
           f"{args.sequence_length}: --max_steps {steps}")
    return steps

# estimate_step's results by all they depend on: bench.py's rows and the tests run main() many
# times in one process, and each count on fake tensors takes about a second even for a tiny model
STEP_ESTIMATES = {}

def estimate_step(run):
    """(peak: B -> a training step's bytes, parameters, parameters without wpe) of the run's
    model, worked out on fake tensors (settings.step_memory): nothing is allocated. Worked out
    once a process for each model, device, T, precision and optimizer."""
    key = (repr(run.model), str(run.device), run.sequence_length, run.precision.name,
           run.optimizer, run.muon_lr, run.muon_momentum, run.muon_ns_steps, run.muon_adjust_lr,
           run.weight_decay, run.max_lr)
    if key not in STEP_ESTIMATES:
        STEP_ESTIMATES[key] = count_step(run)
    return STEP_ESTIMATES[key]

def count_step(run):
    """estimate_step's figures, counted."""
    depths = settings.counted_layers(run.model.n_layer)
    with settings.fake_tensors(run.device) as mode:
        models = [GPT(replace(run.model, n_layer=n)) for n in depths]
        optimizers = [make_optimizer(model, run) for model in models]
    peak = settings.step_memory(models, optimizers, mode, run)
    n_params = settings.at_depth([m.get_num_params() for m in models], run.model.n_layer)
    n_params_non_embedding = settings.at_depth([m.get_num_params(non_embedding=True)
                                                for m in models], run.model.n_layer)
    return peak, n_params, n_params_non_embedding

def auto_micro_batch(run, proc, peak, confirm=True):
    """-B auto: the largest micro-batch whose training step, counted on fake tensors (peak: B ->
    bytes), fits this device's memory; on CUDA (confirm) a real step must fit too. Returns it and
    the run config's record of the choice."""
    B, fit = settings.fit_micro_batch(peak, run)
    if confirm and run.device_type == "cuda":
        candidates = settings.micro_batch_candidates(run, run.world_size)
        B = settings.confirm_micro_batch(GPT(run.model).to(run.device), candidates, B, run, proc)
        fit["micro_batch_estimate_gib"] = round(peak(B) / 2**30, 2)
    budget, of_what = settings.memory_budget(run.device, run.local_world_size)
    micro_steps = run.total_batch_size // (B * run.sequence_length * run.world_size)
    print0(f"-B auto: {B} (a step's estimated peak {settings.gib(peak(B))} of the "
           f"{settings.gib(budget)} usable of {of_what}); micro-steps a step: {micro_steps}")
    return B, fit

def plan_main(argv):
    """What a run with these flags would take, worked out without writing anything: the run
    config it prints, then its size, memory, compute and time (a resumed run: the steps left)."""
    run, proc, ckpt = settle(argv, planning=True)
    first_step = 0 if ckpt is None else ckpt["step"] + 1
    peak, n_params, n_params_non_embedding = estimate_step(run)
    seconds = rate = None
    if not run.peak_flops:  # measured once: the report's every figure comes from it
        rate = settings.matmul_flops(run.device)
        if settings.worth_timing(run, peak, n_params_non_embedding, rate):
            model = GPT(run.model).to(run.device)  # the run's own micro-step, timed here
            seconds = settings.measure_micro_step(model, make_optimizer(model, run),
                                                  run.micro_batch_size, run)
    print0(run.describe())
    print0(settings.plan_report(run, peak, n_params, n_params_non_embedding, seconds, first_step,
                                rate))
    return 0

def checkpoint_tokenizer(ckpt):
    """The tokenizer a checkpoint records (GPT-2's BPE for one that records none)."""
    return tokenizer.from_record(ckpt.get("tokenizer"), fineweb.gpt2_tokenizer())

def model_and_tokenizer(args):
    """(GPT in eval mode, device, precision, its tokenizer) of --checkpoint or --init_from: the
    tokenizer the checkpoint records; GPT-2's BPE for OpenAI's GPT-2."""
    if (args.checkpoint is None) == (args.init_from is None):
        raise UsageError("give one of --checkpoint (a model_*.pt) or --init_from (OpenAI's GPT-2)")
    device = resolve_device(args.device)
    tok = fineweb.gpt2_tokenizer()
    if args.checkpoint:
        ckpt = rundir.open_checkpoint(args.checkpoint)
        tok = checkpoint_tokenizer(ckpt)
        model = model_from_checkpoint(ckpt, args.checkpoint)
    else:
        model = GPT.from_pretrained(args.init_from)
    return model.to(device).eval(), device, Precision(args.dtype, device), tok

def sample_main(args):
    model, device, precision, tok = model_and_tokenizer(args)
    enc = tok.encoding()
    settings.check_prompt_fits(len(encode_prompt(enc, args.prompt)), args.max_new_tokens,
                             model.config.block_size, ("--prompt", "--max_new_tokens"))
    texts = sample_texts(model, enc, args.prompt, args.num_samples, args.max_new_tokens, device,
                         precision.autocast, args.seed, temperature=args.temperature,
                         top_k=args.top_k, use_cache=not args.no_kv_cache)
    for i, text in enumerate(texts):
        print(f"--- sample {i}\n{text}")
    return 0

def export_main(args):
    check_new_dir(args.out, "--out")  # before the checkpoint is read
    ckpt = rundir.open_checkpoint(args.checkpoint)
    model = model_from_checkpoint(ckpt, args.checkpoint)
    tok = checkpoint_tokenizer(ckpt)
    run = settings.base_flags(ckpt.get("args") or {})  # for `sft --init_from` the folder
    with new_dir(args.out, "--out") as tmp:
        openai_gpt2.export_hf(model, tmp, tok, run)
    loads = f"GPT2LMHeadModel.from_pretrained({args.out!r})"
    if model.config.gpt2_differences():  # the folder has its own modeling code
        loads = f"AutoModelForCausalLM.from_pretrained({args.out!r}, trust_remote_code=True)"
    print(f"wrote {args.out}: {loads} loads it")
    return 0

def val_main(args, proc):
    """eval --tasks val: the model's val loss and bits per byte on the val split of --data_root
    (default: the checkpoint's run's), over its first --val_tokens targets (default: the run's; at
    most all the split holds) in windows of the run's -T (the model's context for --init_from):
    the run's last val line again, for a checkpoint. Shards of another tokenizer are refused."""
    model, device, precision, tok = model_and_tokenizer(args)
    ran = {}  # the checkpoint's run's flags
    if args.checkpoint:
        ran = rundir.read_checkpoint(args.checkpoint, keys=("args",),
                                     check_weights=False).get("args") or {}
    data_root = args.data_root or ran.get("data_root") or fineweb.DEFAULT_DATA_ROOT
    sizes = fineweb.split_sizes(data_root)
    if sizes is None:
        raise UsageError(f"--tasks val: {data_root} holds no finished prep with a val split: give "
                         f"--data_root the folder of the shards (fineweb.py --data_root)")
    status = fineweb.prep_status(data_root)
    if status.has_manifest:  # shards of another tokenizer: refused before any work
        fineweb.check_tokenizer(data_root, {"args": status.args}, tok)
    targets = sizes["val"] - 1
    T = min(ran.get("sequence_length") or model.config.block_size, targets)
    B = max(1, min(args.batch_tokens // T, targets // T))
    loader = DataLoaderLite(B, T, proc.rank, proc.world_size, "val", data_root,
                            vocab_size=model.config.real_vocab_size)
    n_tokens = min(args.val_tokens or ran.get("val_tokens") or targets, targets)
    token_bytes = torch.from_numpy(tok.token_bytes()).to(device)
    t0 = time.perf_counter()
    loss, bpb = evaluate_loss(model, loader, n_tokens, device, precision.autocast,
                              proc.world_size, token_bytes)
    print0(f"{args.checkpoint or args.init_from} on {device} ({precision.name}), val of "
           f"{data_root}: {n_tokens:,} tokens, loss {loss:.4f}, {bpb:.4f} bits per byte "
           f"[{time.perf_counter() - t0:.1f} s]")
    if proc.master and args.results:
        data = json.dumps({"val_loss": loss, "val_bpb": bpb, "tokens": n_tokens,
                           "data_root": os.path.abspath(data_root), "tokenizer": tok.name},
                          indent=1) + "\n"
        atomic_write(args.results, lambda f: f.write(data.encode()))
    return 0

def eval_main(args):
    """HellaSwag (--tasks hellaswag), CORE's tasks, the chat tasks (--tasks chat or chat:LABEL,
    chat_eval.py), or the val loss (--tasks val); under torchrun the examples (the val windows)
    split over the ranks and rank 0 reports."""
    val = args.tasks == "val"
    core = args.tasks != "hellaswag" and not val  # CORE's tasks or the chat tasks
    chat_labels = chat_eval.select(args.tasks) if chat_eval.wanted(args.tasks) else None
    misplaced = ("limit",) if core else ("max_per_task", "results", "examples")
    if val:
        misplaced = ("limit", "max_per_task", "examples")
    else:
        misplaced += ("data_root", "val_tokens")
    for flag in misplaced:
        if getattr(args, flag) is not None:
            goes_with = "CORE's tasks (--tasks core or labels) or the chat tasks (--tasks chat)"
            if flag == "limit":
                goes_with = "--tasks hellaswag"
            elif flag in ("data_root", "val_tokens"):
                goes_with = "--tasks val"
            elif flag == "results":
                goes_with += " or --tasks val"
            raise UsageError(f"--{flag} goes with {goes_with}")
    # "" would quietly be the default
    for flag in ("eval_bundle", "eval_dir", "hellaswag_dir", "chat_eval_dir", "data_root"):
        if getattr(args, flag) == "":
            raise UsageError(f"--{flag} is empty: give a path, or leave the flag out")
    # written at the end, after minutes of work: a bad path is refused now, not then
    check_outputs({"--results": args.results, "--examples": args.examples}, args.overwrite,
                  inputs={"--checkpoint": args.checkpoint, "--eval_bundle": args.eval_bundle})
    proc = setup_distributed(args.device)
    if val:
        return val_main(args, proc)
    # a bad checkpoint: before a download
    model, device, precision, tok = model_and_tokenizer(args)
    if chat_labels is not None:
        return chat_eval.run(args, chat_labels, model, device, precision, proc, tok.encoding())
    if not core:
        hellaswag.download("val", args.hellaswag_dir)
        t0 = time.perf_counter()
        res = hellaswag.evaluate(model, device, limit=args.limit, batch_tokens=args.batch_tokens,
                                 data_dir=args.hellaswag_dir, progress=proc.master, proc=proc,
                                 autocast_dtype=precision.dtype, enc=tok.encoding())
        print0(hellaswag.summary(args.checkpoint or args.init_from, device, precision.name, "val",
                                 res, time.perf_counter() - t0))
        return 0
    folder = core_eval.ready_on_every_rank(proc, args.eval_bundle, args.eval_dir,
                                           args.download_timeout, args.max_bundle_mb)
    labels = core_eval.select(args.tasks, core_eval.task_labels(folder))
    tasks = core_eval.load_tasks(folder, labels, args.max_per_task)
    t0 = time.perf_counter()
    res = core_eval.evaluate(model, device, tasks, batch_tokens=args.batch_tokens, proc=proc,
                             autocast_dtype=precision.dtype, progress=True, enc=tok.encoding())
    if proc.master:
        print(core_eval.report(tasks, res, time.perf_counter() - t0), flush=True)
        if args.results:
            core_eval.write_results(args.results, res)
        if args.examples:
            core_eval.write_examples(args.examples, res)
    return 0

def chat_model_for_command(args, command, quiet=False):
    """model_and_tokenizer's (model, device, precision, tokenizer) of a chat model's --checkpoint:
    a base model (or --init_from, OpenAI's GPT-2) refused in one line that says to fine-tune it
    first. quiet: no line on what wrote the model."""
    if args.init_from is not None:  # refused before any download
        raise UsageError(f"--init_from {args.init_from}: OpenAI's GPT-2 is a base model, not a "
                         f"chat model: fine-tune it first (train_gpt2.py sft --init_from "
                         f"{args.init_from}), then {command} --checkpoint of that run")
    if args.checkpoint is None:
        raise UsageError("give --checkpoint: a model_*.pt of an sft run")
    # print() to a None sys.stdout writes nothing
    with contextlib.redirect_stdout(None) if quiet else contextlib.nullcontext():
        model, device, precision, tok = model_and_tokenizer(args)
    if not chat.is_chat_model(model.config, chat.tokens_of(tok.encoding())):
        raise UsageError(f"{args.checkpoint} is a base model, not a chat model: fine-tune it "
                         f"first (train_gpt2.py sft --init_from {args.checkpoint}), then "
                         f"{command} --checkpoint of that run")
    return model, device, precision, tok

def chat_main(args):
    """A terminal chat with a chat model, or its answer to --prompt (chat.Talk: the conversation's
    KV cache kept across turns)."""
    # --prompt: its stdout is the answer alone
    model, device, precision, tok = chat_model_for_command(args, "chat with",
                                                           quiet=args.prompt is not None)
    generator = torch.Generator(device=device).manual_seed(args.seed)

    def sample(logits):
        return sample_next(logits, args.temperature, args.top_k, generator)

    talk = chat.Talk(model, tok.encoding(), sample, system=args.system,
                     max_new_tokens=args.max_new_tokens, device=device,
                     dtype=precision.dtype or model.lm_head.weight.dtype,
                     autocast=precision.autocast)
    if args.prompt is not None:
        return chat.answer_once(talk, args.prompt)
    print(f"a chat model with a context of {model.config.block_size} tokens, {precision.name} on "
          f"{device}. Ctrl-C stops an answer; Ctrl-D, or Ctrl-C at the prompt, quits.")
    return chat.converse(talk)

def serve_main(args):
    """OpenAI's chat API and a web page for a chat model (serve.py), until SIGTERM or Ctrl-C."""
    sock = serve.listen(args.host, args.port)  # a port in use: refused before the model loads
    try:
        model, device, precision, tok = chat_model_for_command(args, "serve")
        engine = serve.Engine(model, tok.encoding(), device=device,
                              dtype=precision.dtype or model.lm_head.weight.dtype,
                              autocast=precision.autocast, max_jobs=args.max_requests)
        name = args.model_name or os.path.splitext(os.path.basename(args.checkpoint))[0]
        defaults = serve.Defaults(temperature=args.temperature, top_k=args.top_k,
                                  max_tokens=args.max_new_tokens, seed=args.seed)
        return serve.serve(engine, name, sock, defaults, os.path.getmtime(args.checkpoint),
                           f" ({model.config.block_size}-token context, {precision.name} on "
                           f"{device})")
    finally:
        sock.close()

COMMANDS = {"sample": sample_main, "export": export_main, "eval": eval_main, "chat": chat_main,
            "serve": serve_main}

def run(argv):
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](settings.build_parser(command=argv[0]).parse_args(argv[1:]))
    if argv and argv[0] == "plan":  # the training flags
        return plan_main(argv[1:])
    if argv and argv[0] == "sft":  # the training flags, fine-tuning on conversations
        return train(*settle(["--sft", *argv[1:]]))
    return train(*settle(argv))

def main(argv=None):
    """The exit status of a command or a run; what a user can fix is one error line."""
    try:
        return run_cli(run, sys.argv[1:] if argv is None else list(argv))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

if __name__ == "__main__":
    exit_process(main())
