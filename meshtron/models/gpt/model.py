"""A Megatron-style GPT in plain PyTorch: no parallel code in here.

Pre-LayerNorm blocks, fused QKV, scaled_dot_product_attention, MLP with bias +
tanh-GeLU, learned or rotary positions, tied or untied output.

Two layout choices make it easy to parallelize from outside:
- layers live in a ModuleDict keyed "0".."L-1": a pipeline stage deletes the
  layers it does not own and the rest keep their names, so checkpoints do not
  depend on the layout (torchtitan does the same);
- the fused QKV projection is laid out head by head, [q_0 k_0 v_0 q_1 k_1 v_1 ...],
  so a column split of its weight hands each tensor-parallel rank whole heads of
  q, k and v, and the forward infers the number of local heads from the shape.

Initialisation draws every parameter from its own generator seeded by (seed,
parameter name), so the values do not depend on how the model is sharded.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.models.common.documents import DocumentMask, masked_attention
from meshtron.models.common.init import fill, normal
from meshtron.models.common.moe import MoE, init_moe
from meshtron.models.gpt.config import PRESETS, GPTConfig, gpt_config  # noqa: F401 - imported from here too


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameter names) that uses the Triton kernel on GPU."""

    def __init__(self, dim: int, eps: float, bias: bool, fused: bool):
        super().__init__(dim, eps=eps, bias=bias)
        self.fused = fused

    def forward(self, x):
        if self.fused and x.is_cuda:
            from meshtron.kernels_triton import layer_norm
            return layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)


class LinearGeLU(nn.Linear):
    """y = gelu_tanh(x W^T + b). The bias add is fused into the GeLU kernel on GPU
    (Megatron's bias_gelu); it stays an nn.Linear so column-parallel plans apply,
    and names its activation so FP8 training can keep it (distributed/float8.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fused: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.fused = fused

    def forward(self, x):
        if self.fused and x.is_cuda and self.bias is not None:
            from meshtron.kernels_triton import bias_gelu
            h = F.linear(x, self.weight)
            # autocast leaves the bias fp32, which would make the GeLU's output fp32 too
            return bias_gelu(h, self.bias.to(h.dtype))
        return self.activation(F.linear(x, self.weight, self.bias))

    @staticmethod
    def activation(y: torch.Tensor) -> torch.Tensor:
        """What follows the linear: kept when FP8 training replaces this class."""
        return F.gelu(y, approximate="tanh")


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float().unsqueeze(-1) * inv_freq      # (T, hd/2), or (B, T, hd/2) per sample
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)                            # over the heads
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); rotate pairs (x[2i], x[2i+1])
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v, with attention dropout. A module of
    its own (no parameters) so that layouts can give it its own RNG region."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, mask=None):
        dropout = self.dropout if self.training else 0.0
        if mask is not None:   # packed documents that do not see each other (models/common/documents.py)
            return masked_attention(q, k, v, mask, dropout)
        # causal over the whole sequence, or one new token attending to every cached one
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, dropout_p=dropout)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.core = CoreAttention(cfg.dropout)
        self.rope_theta = cfg.rope_theta if cfg.pos_emb == "rope" else None
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                mask=None) -> torch.Tensor:
        B, T = x.shape[0], x.shape[1]      # the full sequence: under SP the input was all-gathered
        if positions is None:
            positions = torch.arange(T, device=x.device)
        qkv_bthd = self.qkv(x).view(B, T, -1, 3, self.head_dim)      # -1: local heads under TP
        q, k, v = (t.transpose(1, 2) for t in qkv_bthd.unbind(3))     # (B, H, T, hd)
        if self.rope_theta is not None:
            cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:    # generation: a whole prompt first, then one token at a time
            k, v = cache.update(k, v)
        y = self.core(q, k, v, mask)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = LinearGeLU(cfg.dim, cfg.ffn_mult * cfg.dim, bias=cfg.bias, fused=cfg.fused_kernels)
        self.fc2 = nn.Linear(cfg.ffn_mult * cfg.dim, cfg.dim, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.fc2(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = LayerNorm(cfg.dim, cfg.norm_eps, cfg.bias, cfg.fused_kernels)
        self.attn = Attention(cfg)
        self.mlp_norm = LayerNorm(cfg.dim, cfg.norm_eps, cfg.bias, cfg.fused_kernels)
        self.mlp = MoE(cfg.dim, cfg.moe) if cfg.moe else MLP(cfg)

    def forward(self, h, positions=None, cache=None, mask=None):
        h = h + self.attn(self.attn_norm(h), positions, cache=cache, mask=mask)
        return h + self.mlp(self.mlp_norm(h))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int | None = 0):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos_emb == "learned" else None
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = LayerNorm(cfg.dim, cfg.norm_eps, cfg.bias, cfg.fused_kernels)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.document_mask = DocumentMask(cfg.head_dim, cfg.dropout)   # FlexAttention has no dropout
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if seed is not None and self.output.weight.device.type != "meta":
            self.init_weights(seed)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                return_hidden: bool = False, documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab), or with `return_hidden` the
        final (normed) hidden states, for a loss that runs the head itself
        (meshtron.train.loss.FusedLoss). A pipeline stage that lost
        its embedding takes hidden states (B, T, dim) instead (T may be a sequence-
        parallel slice, so positions default to 0..T-1 where the full T is known);
        one that lost its output returns hidden states. `cache` (a KVCache) keeps
        keys and values for generation; `positions` are then the new tokens'.
        `documents` (B, T): each token's document in a packed sample, which it attends
        within (models/common/documents.py); `positions` may then be (B, T), per document."""
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                pos = positions if positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
                h = h + self.pos_embeddings(pos)
            h = self.emb_dropout(h)
        mask = self.document_mask(documents) if documents is not None else None   # once, for every layer
        for i, layer in self.layers.items():
            h = layer(h, positions, cache=cache.layer(int(i)) if cache is not None else None, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and not return_hidden:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Megatron's init: N(0, 0.02), output projections of each residual branch
        scaled by 1/sqrt(2L); biases 0; norms 1; each drawn by parameter name."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        moe = {f"{n}.": m for n, m in self.named_modules() if isinstance(m, MoE)}
        for prefix, m in moe.items():
            init_moe(m, seed, prefix[:-1], std, out_std, normal, fill)
        for name, p in self.named_parameters():
            if any(name.startswith(prefix) for prefix in moe):
                continue
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape)
            elif name.endswith(".bias"):
                full = torch.zeros(p.shape)
            else:
                # a pipeline stage's untied copy of a tied output head draws the embedding's values
                key = "tok_embeddings.weight" if name == "output.weight" and self.config.tie_embeddings else name
                full = normal(p.shape, out_std if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else std,
                              seed, key)
            fill(p, full)
