"""A mixture of experts' experts (models/common/moe.py): n_experts MLPs as one 3-D
weight per projection, run as grouped GEMMs over tokens sorted by expert."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.distributed.counts import host_counts
from meshtron.models.common.moe_config import MoEConfig


class Experts(nn.Module):
    """n_experts MLPs as one 3-D weight per projection; forward takes the tokens
    sorted by expert and each expert's row count (a tensor on their device).
    Rows past the last expert's (a padded dispatch's) are padding: their outputs
    are unspecified and they add nothing to any gradient. SwiGLU's w1 holds the
    gate and up projections side by side, [E, dim, 2h]: one grouped GEMM for both
    (Megatron's fused fc1), whose fixed cost per call dominates small groups."""

    def __init__(self, dim: int, cfg: MoEConfig, n_experts: int | None = None):
        super().__init__()
        e, h = n_experts or cfg.n_experts, cfg.hidden
        self.swiglu = cfg.activation == "swiglu"
        self.w1 = nn.Parameter(torch.empty(e, dim, 2 * h if self.swiglu else h))
        self.w2 = nn.Parameter(torch.empty(e, h, dim))
        if not self.swiglu:
            self.b1, self.b2 = nn.Parameter(torch.zeros(e, h)), nn.Parameter(torch.zeros(e, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = grouped_mm(x, self.w1, counts).chunk(2, dim=-1)
            return grouped_mm(F.silu(gate) * up, self.w2, counts)
        h = grouped_mm(x, self.w1, counts)
        h = F.gelu(h + per_row(self.b1.to(h.dtype), counts, h.shape[0]), approximate="tanh")   # fp32 under autocast
        y = grouped_mm(h, self.w2, counts)
        return y + per_row(self.b2.to(y.dtype), counts, y.shape[0])


def per_row(b: torch.Tensor, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """(E, n) -> (rows, n): expert g's row counts[g] times, zeros for the rows past them."""
    padding = (rows - counts.sum()).view(1)
    return torch.cat([b, b.new_zeros(1, b.shape[1])]).repeat_interleave(torch.cat([counts, padding]), 0,
                                                                          output_size=rows)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x (sorted by group) times their group's w[g]: (M, K) x (G, K, N) -> (M, N).
    torch._grouped_mm on Hopper in bf16 (one kernel, offsets on the GPU: no host
    sync); elsewhere one matmul per group. Rows past the last group are padding:
    torch._grouped_mm leaves their output unwritten, the loop writes zeros. Empty
    groups still multiply (0 rows), so w and x get gradients, zero ones, on a rank
    that received no tokens: its backward then runs the same collectives as its peers'.
    w is cast to x's dtype: autocast does not cover torch._grouped_mm, and leaves the
    weights fp32 (under FSDP's bf16 weights the cast does nothing)."""
    w = w.to(x.dtype)
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and x.shape[0] > 0 and \
            torch.cuda.get_device_capability(x.device)[0] == 9:
        return torch._grouped_mm(x, w, offs=counts.cumsum(0, dtype=torch.int32))
    sizes = host_counts(counts, x.shape[0])
    parts = x.split(sizes + [x.shape[0] - sum(sizes)])
    return torch.cat([xi @ w[g] for g, xi in enumerate(parts[:-1])] + [x.new_zeros(parts[-1].shape[0], w.shape[2])])
