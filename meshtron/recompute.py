"""Activation recomputation (Megatron's "full" and "selective").

full: each transformer block keeps only its input; the whole block is
recomputed in backward (one extra forward, ~33% more FLOPs, activation
memory per layer ~ one (B, T, d) tensor).

selective: matmul outputs are saved, everything cheap is recomputed: the
element-wise ops (LayerNorm, GeLU, dropout, residual adds) and attention's
softmax/score path (sdpa), which is where the O(T^2) memory is. The policy
saves the outputs of aten.mm/addmm/bmm and recomputes the rest.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")

_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, not {mode!r}")
    if mode == "none":
        return model
    kwargs = {"preserve_rng_state": True}   # checkpoint_wrapper picks the non-reentrant form
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
    for name, block in model.layers.items():
        model.layers[name] = checkpoint_wrapper(block, **kwargs)
    return model
