"""A Llama-family decoder in plain PyTorch: no parallel code in here.

Pre-RMSNorm blocks, grouped-query attention (n_kv_heads <= n_heads) with rotary
positions (theta configurable, Llama 3's frequency scaling), a SwiGLU MLP
w2(silu(w1 x) * w3 x), no biases, tied or untied output. Module names are
torchtitan's (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3); the rotary
embedding rotates the two halves of each head (Hugging Face's layout), so
Hugging Face weights load without a permutation.

Layers live in a ModuleDict keyed "0".."L-1" and every part outside them may be
None (a pipeline stage); q, k and v are separate projections whose column split
hands each tensor-parallel rank whole heads, and the forward infers the local
head counts from the shapes.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.models.common.documents import DocumentMask, masked_attention
from meshtron.models.common.init import fill, normal
from meshtron.models.common.moe import MoE, init_moe
from meshtron.models.llama.config import LLAMA3_SCALING, PRESETS, LlamaConfig  # noqa: F401 - imported from here too


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Rotary frequencies theta^(-2i/d), with Llama 3's scaling: wavelengths longer
    than the original context / low_freq_factor are stretched by `factor`, shorter
    than context / high_freq_factor kept, and the band between interpolated."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    if cfg.rope_scaling is not None:
        factor, low, high, context = cfg.rope_scaling
        wavelen = 2 * math.pi / inv_freq
        smooth = ((context / wavelen - low) / (high - low)).clamp(0, 1)
        inv_freq = torch.where(wavelen > context / low, inv_freq / factor,
                               torch.where(wavelen < context / high, inv_freq,
                                           (1 - smooth) * inv_freq / factor + smooth * inv_freq))
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, hd): rotate (x[:hd/2], x[hd/2:]) pairs by the angles of cos, sin (T, hd/2),
    in x's dtype as Hugging Face does (an fp32 upcast doubles the bytes of every pass)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, statistics in fp32; the Triton kernel on GPU."""

    def __init__(self, dim: int, eps: float, fused: bool):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.norm(x, self.weight)

    def norm(self, x, weight):
        """The computation, for a layout that hands in another view of the weight (its local shard)."""
        if self.fused and x.is_cuda:
            from meshtron.kernels_triton import rms_norm
            return rms_norm(x, weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v with grouped-query heads: a module
    of its own so that layouts can replace it (context parallelism)."""

    def forward(self, q, k, v, mask=None):
        if mask is not None:   # packed documents that do not see each other (models/common/documents.py)
            return masked_attention(q, k, v, mask)
        groups = q.shape[1] // k.shape[1]   # each KV head serves `groups` query heads
        # SDPA reads shared K/V heads itself in its flash kernels (CUDA bf16/fp16, and
        # the CPU); CUDA's fp32 path would fall back to the math kernel: repeat there
        shared = groups > 1 and not (q.is_cuda and q.dtype == torch.float32)
        if groups > 1 and not shared:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # causal over the whole sequence, or one new token attending to every cached one
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=shared)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.core = CoreAttention()
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def in_proj(self, x):
        """q, k, v of x, (B, T, width) each; a layout may compute the three as one."""
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                mask=None) -> torch.Tensor:
        q, k, v = self.in_proj(x)
        B, T = q.shape[0], q.shape[1]      # the full sequence, also where a layout hands in a shard of x
        if positions is None:
            positions = torch.arange(T, device=x.device)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)    # (B, local heads, T, hd)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)    # (B, local KV heads, T, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        angles = positions.float().unsqueeze(-1) * self.inv_freq     # (T, hd/2), or (B, T, hd/2) per sample
        if angles.dim() == 3:
            angles = angles.unsqueeze(1)                               # over the heads
        cos, sin = angles.cos(), angles.sin()
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:    # generation: a whole prompt first, then one token at a time
            k, v = cache.update(k, v)
        y = self.core(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x): SwiGLU, the product fused in Triton on GPU."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.fused = cfg.fused_kernels
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def in_proj(self, x):
        """The gate and the up projection of x; a layout may compute the two as one."""
        return self.w1(x), self.w3(x)

    def forward(self, x):
        gate, up = self.in_proj(x)
        if self.fused and gate.is_cuda:
            from meshtron.kernels_triton import swiglu
            return self.w2(swiglu(gate, up))
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_kernels)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_kernels)
        self.feed_forward = MoE(cfg.dim, cfg.moe) if cfg.moe else FeedForward(cfg)

    def forward(self, h, positions=None, cache=None, mask=None):
        h = h + self.attention(self.attention_norm(h), positions, cache=cache, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, seed: int | None = 0):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_kernels)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.document_mask = DocumentMask(cfg.head_dim)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if seed is not None and self.output.weight.device.type != "meta":
            self.init_weights(seed)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                return_hidden: bool = False, documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab); a pipeline stage without the
        embedding takes hidden states, one without the head returns them. `cache`
        (a KVCache) keeps keys and values for generation; `positions` are then
        the new tokens'. `return_hidden`: the final (normed) hidden states instead
        of the logits, for a loss that runs the head itself (meshtron.train.loss.FusedLoss).
        `documents` (B, T): each token's document in a packed sample, which it attends
        within (models/common/documents.py); `positions` may then be (B, T), per document."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = self.document_mask(documents) if documents is not None else None   # once, for every layer
        for i, layer in self.layers.items():
            h = layer(h, positions, cache=cache.layer(int(i)) if cache is not None else None, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None and not return_hidden else h

    def _init_std(self, name: str) -> float:
        if name == "tok_embeddings.weight":
            return 0.02 if self.config.tie_embeddings else 1.0
        if name == "output.weight":
            return self.config.dim ** -0.5
        if name.endswith(("wo.weight", "w2.weight", "w3.weight")) and name.startswith("layers."):
            return 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1))
        return 0.02

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Llama's init as torchtitan trains it: an untied token embedding N(0, 1) (tied:
        N(0, 0.02), as it is also the head), an untied head N(0, dim^-1/2), every other
        matrix N(0, 0.02) but the residual branches' last ones and w3 (wo, w2, w3),
        N(0, 0.02 / sqrt(2 (layer + 1))); norms 1. Each drawn by parameter name; the
        rotary frequencies recomputed (a buffer, left empty by building on meta). The
        earlier 0.02 embeddings and one depth scale for every layer trained llama-1B
        markedly slower than torchtitan on the same tokens."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        moe = {f"{n}.": m for n, m in self.named_modules() if isinstance(m, MoE)}
        for prefix, m in moe.items():
            init_moe(m, seed, prefix[:-1], std, out_std, normal, fill)
        for name, p in self.named_parameters():
            if any(name.startswith(prefix) for prefix in moe):
                continue
            if name.endswith("norm.weight"):
                fill(p, torch.ones(p.shape))
                continue
            # a pipeline stage's untied copy of a tied output head draws the embedding's values
            key = "tok_embeddings.weight" if name == "output.weight" and self.config.tie_embeddings else name
            fill(p, normal(p.shape, self._init_std(key), seed, key))
        for m in self.modules():
            if isinstance(m, Attention):
                m.inv_freq.copy_(rope_inv_freq(self.config))
