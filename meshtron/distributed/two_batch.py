"""Two-batch overlap of mixture-of-experts blocks (--moe-two-batch): SGLang's and
DeepSeek's two-batch overlap, brought to training.

Under expert parallelism a block's dispatch and combine all-to-alls have nothing
beside them: each waits for the network. Here each block splits its micro-batch
into two halves of whole sequences, A and B (routing decides per sequence, so a
half routes as it would in the whole), runs each half as stages that end where
an all-to-all has been started (MoE.route and MoE.finish around the dispatch's
`stages`), and alternates them:

    A: attention, route, dispatch started    B: attention, route, dispatch started
    A: experts, combine started              B: experts, combine started
    A: shared experts, weighted sum          B: shared experts, weighted sum

What overlaps is what the host issues between an all-to-all's start and its
wait: a functional all-to-all returns at once and is waited on where its result
is first read (on a GPU the compute stream waits for the collective's; the host
runs on).

Forward: A's dispatch travels behind B's attention and routing, B's dispatch
behind A's experts, A's combine behind B's experts, B's combine behind the
shared experts (where the block has them; else behind A's weighted sum alone).
The count exchanges do not overlap, and the exact dispatch's split sizes,
copied to the host, make it wait for the device once per half; the padded
dispatch never does. The halves join at the block's end: the block stays one
unit for FSDP, recompute and the pipeline.

Backward: torch's all-to-all backward waits at once, and autograd on one device
runs the ready node of the highest sequence number, the latest made in forward:
the mirror of the forward's order, where each all-to-all's gradient is read by
the very next node. The halves' all-to-alls are _AllToAll here: its backward
starts the reverse all-to-all and returns without waiting, and its node has the
highest sequence number, so it starts as soon as its gradient is complete and
the work made after it in forward, the other half's, runs before its result is
read: B's combine gradient travels behind the shared experts' gradients, A's
behind B's experts', B's dispatch gradient behind A's experts', A's behind B's
routing and attention.

FSDP gathers each block's unit once for both halves, as before; the experts, a
unit of their own where expert_dp shards them, too: the halves run inside one
call of that unit (_one_call), and call the experts' forward directly. The
aux loss is normalised by the whole micro-batch and each half counts half a
call (MoE.finish's `share`): the statistics are the unsplit step's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.fsdp import FSDPModule

from meshtron.distributed.expert_parallel import drain
from meshtron.distributed.recompute import swap_classes

# autograd runs the ready node of the highest sequence number first (AccumulateGrad's is the largest)
FIRST = 2 ** 63


class _AllToAll(torch.autograd.Function):
    """all_to_all_single_autograd, whose backward is waited on where its result is
    first read, and runs as soon as it is ready (FIRST)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        ctx._set_sequence_nr(FIRST)
        return all_to_all_single(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return all_to_all_single(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def _a2a(x, output_splits, input_splits, group):
    return _AllToAll.apply(x, output_splits, input_splits, group)


def moe_stages(moe: nn.Module, h: torch.Tensor):
    """MoE.forward on half of a micro-batch, as stages: yields once its copies are on
    their way to their experts and once their rows are on their way back."""
    r = moe.route(h)
    steps = moe.dispatch.stages(r.x, r.weights, r.experts, moe.experts, moe.dispatch.exchange(r.experts, moe.experts),
                                run=moe.experts.forward, a2a=_a2a)
    next(steps)
    yield
    next(steps)
    yield
    shared = moe.shared_out(r.x)      # while the combine travels
    return moe.finish(h, r, drain(steps), shared, share=0.5)


def block_stages(parts, h: torch.Tensor, positions, mask):
    """A pre-norm block, h + attention(norm(h)), then + moe(norm(h)), as stages;
    `parts`: its (attention norm, attention, MoE norm, MoE)."""
    attention_norm, attention, moe_norm, moe = parts
    h = h + attention(attention_norm(h), positions, mask=mask)
    return h + (yield from moe_stages(moe, moe_norm(h)))


def interleave(*halves) -> list:
    """Run generators in turn, each to its next yield, until all have ended: their values."""
    out, live = [None] * len(halves), dict(enumerate(halves))
    while live:
        for i in list(live):
            try:
                next(live[i])
            except StopIteration as done:
                out[i] = done.value
                del live[i]
    return out


def _one_call(module: nn.Module, fn, *args):
    """fn(*args) as one call of `module`, an FSDP unit or not: gathered before, freed
    after (zero 3), its gradients reduced once those of args are complete (as
    register_fsdp_forward_method runs a method)."""
    if not isinstance(module, FSDPModule):
        return fn(*args)
    state = module._get_fsdp_state()
    args, _ = state._pre_forward(module, args, {})
    return state._post_forward(module, args, fn(*args))


def _two_batch(cls: type, parts_of) -> type:
    def halves(self, h, positions, mask):
        n = h.shape[0] // 2
        per_sample = positions is not None and positions.dim() == 2     # packed documents' own positions
        steps = [block_stages(parts_of(self), h[s], positions[s] if per_sample else positions,
                              None if mask is None else mask[s]) for s in (slice(0, n), slice(n, None))]
        return torch.cat(interleave(*steps))

    def forward(self, h, positions=None, cache=None, mask=None):
        if cache is not None or h.is_meta or h.shape[0] % 2:   # generation, shape inference, an odd batch
            return cls.forward(self, h, positions, cache=cache, mask=mask)
        return _one_call(parts_of(self)[3].experts, halves, self, h, positions, mask)
    return type(f"TwoBatch{cls.__name__}", (cls,), {"forward": forward})


def apply_two_batch(blocks: list[nn.Module], parts_of) -> None:
    """Run each block's halves interleaved (the module docstring). `parts_of(block)`:
    its (attention norm, attention, MoE norm, MoE); a block's forward(h, positions,
    cache, mask) must be h + attention(attention norm(h)), then + MoE(MoE norm(h)).
    Before recompute and FSDP, which then take the interleaved block as the block."""
    swap_classes(blocks, lambda cls: _two_batch(cls, parts_of))
