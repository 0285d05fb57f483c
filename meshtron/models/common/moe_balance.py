"""Balancing the experts' load within each sequence, as models/common/moe.py's router
uses it with batch_balance = r rounds: a bias for each sequence alone (batch_bias) that
gives every expert about the mean number of its copies, the weights faded to 0 where
that choice flips (sequence_balance). A function of each sequence, so of no layout: a
sequence split over context-parallel ranks is gathered through its StepSum first.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn


class StepSum(nn.Module):
    """Sums a tensor over a group of ranks that hold other tokens (of the same step,
    or of the same sequences), the gradient flowing to this rank's own part only:
    the identity in one process; layouts replace it (expert_parallel.TokenSum)."""

    size = 1

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(every rank's t concatenated in token order, where this rank's rows start)."""
        return t, 0

    def positions(self, n: int, device=None) -> torch.Tensor:
        """Where this rank's n tokens of each sequence sit in it (context parallelism's
        split is not in rank order)."""
        return torch.arange(n, device=device)


def gather_seq(parts: StepSum, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t (B, T_local, ...) -> (B, T, ...) with the tokens of the same sequences that the
    ranks of `parts` hold, and where this rank's start along dim 1."""
    whole, start = parts.gather(t.transpose(0, 1).contiguous())
    return whole.transpose(0, 1), start


# Batch balancing's two scales, in logits: far above the fp32 rounding by which the layouts'
# logits differ, far below the differences the router learns
TIE_SPREAD = 1e-4   # a fixed pattern over positions and experts that parts near-identical tokens
FADE = 1e-3         # an expert's weight falls to 0 as its lead over the first unchosen one does


@torch.no_grad()
def sequence_balance(select: torch.Tensor, k: int, rounds: int, parts: StepSum) -> tuple[torch.Tensor, torch.Tensor]:
    """select (B, T_local, E), the selection logits of B sequences -> the experts
    (B T_local, k) that even each whole sequence (batch_bias over its tokens, of
    which the ranks of `parts` hold the others), and each one's fade in [0, 1].
    A function of each sequence alone, so of no layout or micro-batch cut; and a
    continuous one, so that the layouts' fp32 rounding of the weights moves the
    losses by no more than its change of the logits over FADE: the top-k of logits
    + a per-sequence bias is a discrete choice, and balancing sends tokens to within
    rounding of its ties (a sequence routes much alike, and the bias splits it),
    where the chosen set flips. The fade, the chosen expert's lead over the first unchosen one over FADE
    capped at 1, takes an expert's weight to 0 before it leaves the set, the next one
    comes in at 0, and the weights' normalization (the router's own top-k's) does
    not jump. TIE_SPREAD parts tokens the router sees alike, whom no bias could split."""
    E = select.shape[-1]
    i = parts.positions(select.shape[1], select.device)[:, None] * E + torch.arange(E, device=select.device)
    select = select + ((i * 40503 % 65536).to(select.dtype) / 65536 - 0.5) * TIE_SPREAD   # a multiplicative hash
    whole, _ = gather_seq(parts, select)    # in any order: batch_bias reads order statistics only
    s = select + batch_bias(whole, k, rounds).unsqueeze(1)
    top = s.flatten(0, 1).topk(k + 1, dim=-1)
    return top.indices[:, :k], ((top.values[:, :k] - top.values[:, k:]) / FADE).clamp(max=1.0)


@torch.no_grad()
def batch_bias(select: torch.Tensor, k: int, rounds: int) -> torch.Tensor:
    """select (..., N, E) -> a bias (..., E) under which the top-k of select + bias gives
    each expert about the mean k N / E of the N tokens' copies. Each round moves every
    expert's bias towards where, the others' held, it would take exactly that many:
    halfway between its target-th and next token, ranked by how far the expert is
    above (chosen) or below (not chosen) the token's cut-off (the next-best
    expert's logit, or the k-th one's). Experts move at once, and tokens rank
    them much alike, so after the first round (from a collapsed router a long way,
    taken whole) full moves overshoot and oscillate; 70% of one settles
    within the rounds the presets take. Every step is a continuous
    function of select (order statistics, and margins that meet at 0 where a token's
    choice changes), so the bias is too."""
    n, n_experts = select.shape[-2:]
    bias = select.new_zeros(*select.shape[:-2], n_experts)
    if k >= n_experts or n < 2:
        return bias
    target = min(math.ceil(k * n / n_experts), n - 1)
    for r in range(rounds):
        s = select + bias.unsqueeze(-2)
        top = s.topk(k + 1, dim=-1).values                      # (..., N, k+1)
        chosen = s >= top[..., k - 1:k]
        cutoff = torch.where(chosen, top[..., k:], top[..., k - 1:k])
        ranked = (s - cutoff).topk(target + 1, dim=-2).values          # (..., target + 1, E), descending
        move = torch.lerp(ranked[..., -2, :], ranked[..., -1, :], 0.5).nan_to_num(0.0, 0.0, 0.0)   # -inf stays off
        bias -= (1.0 if r == 0 else 0.7) * move
    return bias
