"""Cross-entropy on logits split over the vocabulary (Megatron's vocab-parallel
cross-entropy), for the output head's column-parallel matmul under tp.

Each rank holds logits[:, its V/t columns]. Three all-reduces of (N,) floats over
tp give the softmax's row max, its row sum of exponentials and the target's
logit; the loss is logsumexp - target logit, in fp32 (fp64 for fp64 logits). Backward writes
softmax - onehot straight into a gradient of the logits' dtype.

Why not torch's loss_parallel: it runs log-softmax on the DTensor logits in
eager, so it keeps an fp32 copy of the (N, V/t) log-probabilities for backward
and makes more fp32 temporaries there; for llama-1B at tp=2 that is several GiB
a micro-batch more than the one-GPU compiled loss. Here only the logits (held
by their caller anyway) and three (N,) vectors are saved. On a GPU the fp32 work
is one compiled pass over the logits each way (the sum of exponentials forward;
softmax - onehot, scaled and rounded to the logits' dtype, backward), so no fp32
copy of them is ever written: eager, the same arithmetic costs several fp32 passes
over (N, V/t). Eager (the
CPU) it runs over row chunks of at most CHUNK elements.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

CHUNK = 1 << 26    # fp32 elements of one temporary (256 MiB)


def _rows(n: int, width: int):
    step = max(1, CHUNK // max(1, width))
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _sum_exp(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """sum_j exp(logits[:, j] - row_max) in row_max's dtype."""
    return (logits.to(row_max.dtype) - row_max[:, None]).exp().sum(-1)


def _dlogits(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, hit: torch.Tensor,
             scale: torch.Tensor) -> torch.Tensor:
    """(softmax - onehot(target where this rank holds it)) * scale, in the logits' dtype."""
    p = (logits.to(lse.dtype) - lse[:, None]).exp()
    cols = torch.arange(logits.shape[1], device=logits.device)
    p = p - ((cols[None, :] == local[:, None]) & hit[:, None]).to(p.dtype)
    return (p * scale[:, None]).to(logits.dtype)


@functools.cache
def _compiled():
    """Made on first use: torch.compile at import pulls inductor into every process's start."""
    return torch.compile(_sum_exp, dynamic=False), torch.compile(_dlogits, dynamic=False)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, start, ignore_index, compiled):
        n, width = logits.shape
        acc = torch.promote_types(logits.dtype, torch.float32)     # fp32 for bf16 logits, fp64 stays
        mine = (targets >= start) & (targets < start + width)
        local = torch.where(mine, targets - start, 0)
        row_max = logits.amax(-1).to(acc)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        ctx.compiled = compiled
        if compiled:
            sum_exp = _compiled()[0](logits, row_max)
        else:
            sum_exp = torch.empty(n, dtype=acc, device=logits.device)
            for rows in _rows(n, width):
                sum_exp[rows] = _sum_exp(logits[rows], row_max[rows])
        target_logit = logits.gather(1, local[:, None]).squeeze(1).to(acc) * mine
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(target_logit, group=group)
        lse = row_max + sum_exp.log()
        valid = targets != ignore_index
        ctx.save_for_backward(logits, local, mine & valid, lse, valid)
        return ((lse - target_logit) * valid).sum()

    @staticmethod
    def backward(ctx, g):
        logits, local, hit, lse, valid = ctx.saved_tensors
        n, width = logits.shape
        scale = g.to(lse.dtype) * valid
        if ctx.compiled:
            return _compiled()[1](logits, lse, local, hit, scale), None, None, None, None, None
        grad = torch.empty_like(logits)
        for rows in _rows(n, width):
            grad[rows] = _dlogits(logits[rows], lse[rows], local[rows], hit[rows], scale[rows])
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy_sum(logits: DTensor, targets: torch.Tensor, ignore_index: int,
                                     compiled: bool | None = None) -> torch.Tensor:
    """Sum of token cross-entropies of (..., V) logits sharded Shard(-1) over a 1-D
    mesh; the same value on every rank of it. `compiled`: the fp32 passes through
    torch.compile (default: on a GPU)."""
    mesh, (placement,) = logits.device_mesh, logits.placements
    if mesh.ndim != 1 or not (isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1):
        raise ValueError(f"vocab-parallel cross-entropy needs logits Shard(-1) over one mesh axis, "
                         f"not {logits.placements} over {mesh.mesh_dim_names}")
    vocab = logits.shape[-1]
    t = mesh.size()
    if vocab % t:
        raise ValueError(f"the vocabulary {vocab} does not divide over {t} ranks")
    local = logits.to_local(grad_placements=(Shard(logits.ndim - 1),))
    start = mesh.get_local_rank() * (vocab // t)
    compiled = local.is_cuda if compiled is None else compiled
    return _VocabParallelCrossEntropy.apply(local.flatten(0, -2), targets.flatten(), mesh.get_group(), start,
                                            ignore_index, compiled)
