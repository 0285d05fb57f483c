"""Activation recomputation (Megatron's "full" and "selective").

full: each transformer block keeps only its input; the whole block is
recomputed in backward (one extra forward, ~33% more FLOPs, activation
memory per layer ~ one (B, T, d) tensor).

selective: matmul outputs are saved, everything cheap is recomputed: the
element-wise ops (LayerNorm, GeLU, dropout, residual adds) and attention's
softmax/score path (sdpa), which is where the O(T^2) memory is. The policy
saves the outputs of aten.mm/addmm/bmm/_scaled_mm (and of tensor-parallel reductions, so
recomputing a block does not communicate again) and recomputes the rest.

Each block's class is swapped for a subclass whose forward runs the original
one under torch.utils.checkpoint (FSDP2's own trick for FSDPModule): the
module tree, and so the parameter names, stay as they are. meshtron's models
seed each parameter by its name and checkpoints are keyed by it; a wrapper
module (checkpoint_wrapper) would rename every block parameter. Hooks on the
block (torch's composable checkpoint) are not an option either: recomputation
would re-run FSDP's hooks inside the selective-recompute region, which then
refuses ops it did not see in forward.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from meshtron.distributed.choices import RECOMPUTE_MODES as MODES

# FP8 (meshtron.distributed.float8): its matmuls are _scaled_mm, and saving the absolute maxima its
# scales come from keeps a recomputed block from reducing them again (torchtitan saves them too)
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten._scaled_mm.default, torch.ops.aten.max.default,
         torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed(cls: type, context_fn) -> type:
    """A subclass of cls whose forward keeps only its inputs and recomputes in backward."""
    # torch.compile (2.11-2.13) fails on any context_fn argument it has not yet looked
    # at, even noop_context_fn: full recompute passes none
    options = {} if context_fn is noop_context_fn else {"context_fn": context_fn}

    def forward(self, *args, **kwargs):
        return checkpoint(cls.forward, self, *args, use_reentrant=False, preserve_rng_state=True, **options, **kwargs)
    return type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward})


def apply_recompute(blocks: list[nn.Module], mode: str) -> None:
    """Recompute each block (a transformer layer) in backward, as `mode` says."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, not {mode!r}")
    if mode == "none":
        return
    context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) if mode == "selective" \
        else noop_context_fn
    swap_classes(blocks, lambda cls: _recomputed(cls, context_fn))


def swap_classes(blocks: list[nn.Module], subclass) -> None:
    """Each block's class swapped for subclass(its class), made once per class: the
    module tree, and so the parameter names, stay as they are."""
    classes = {}
    for block in blocks:
        cls = type(block)
        if cls not in classes:
            classes[cls] = subclass(cls)
        block.__class__ = classes[cls]
