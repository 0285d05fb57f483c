"""Fused output projection and cross-entropy: the (tokens x vocabulary) logits are
never held whole (the idea of Liger's fused linear cross-entropy and Apple's Cut
Cross-Entropy; this is our own, in plain PyTorch).

For each chunk c of the N = B*T tokens (hidden h_c, C x D; head W, V x D):
    z = h_c W^T                     C x V in the compute dtype, upcast to fp32
    lse = logsumexp(z)              loss_c = sum over counted tokens of lse - z[target]
    dz = softmax(z) - onehot        rows of ignored targets (-100) zero
    grad_h_c = dz W,   dW += dz^T h_c   (dW accumulated in fp32)
The gradients are computed in forward (Liger's design) and kept; backward only
scales them by the incoming gradient. Memory: one chunk of logits (C x V fp32)
at a time, plus grad_h (N x D) and dW (V x D) until backward; no N x V tensor.
The logits are rounded to the compute dtype before the fp32 softmax, as the
unfused head's matmul does, so the loss is the same function of the weights.

Vocabulary-parallel (W split Shard(0) over one mesh axis of size t: Megatron's
column-parallel head under loss parallelism): rank r computes its columns z_r.
Per chunk ONE all-gather over that axis of (2, C) fp32 [logsumexp(z_r), z_r[target]
or 0] gives lse = logsumexp over ranks and the target logit = sum over ranks.
grad_h is then partial over the axis (each rank's columns' share): for a
replicated hidden it is summed by one all-reduce of N x D in backward; for a
sequence-parallel hidden (Shard(1)) the hidden is all-gathered first and grad_h
reduce-scattered, as the unfused column-parallel head does.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

CHUNK_ELEMENTS = 1 << 29    # logits of one chunk: C x V/t elements (2 GiB in fp32, eager)


def default_chunk(width: int) -> int:
    """Tokens per chunk for a head of `width` rows on this rank: the largest power of
    two whose fp32 logits fit CHUNK_ELEMENTS (few distinct chunk shapes to compile)."""
    return 1 << max(0, (CHUNK_ELEMENTS // max(1, width)).bit_length() - 1)


def _stats(z: torch.Tensor, local: torch.Tensor, mine: torch.Tensor):
    """z (C, V) in the compute dtype -> fp32 logsumexp and target logit (0 where
    the target is not in this rank's columns)."""
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    lse = torch.logsumexp(z, -1)
    return lse, torch.where(mine, z.gather(1, local[:, None]).squeeze(1), 0.0)


def _dlogits(z: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, mine: torch.Tensor,
             valid: torch.Tensor) -> torch.Tensor:
    """softmax(z) - onehot(target), zero rows where the target is ignored, in z's dtype."""
    p = z.to(lse.dtype).sub_(lse[:, None]).exp_()     # in place: one fp32 chunk in eager
    p[torch.arange(p.shape[0], device=p.device), local] -= mine.to(p.dtype)
    return p.mul_(valid[:, None]).to(z.dtype)


@functools.cache
def _compiled():
    """The per-chunk work through torch.compile, made on first use: torch.compile at import
    pulls in inductor, a second or more of every process's start."""
    return torch.compile(_stats, dynamic=False), torch.compile(_dlogits, dynamic=False)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, group, start, chunk, ignore_index, need_grad, compiled):
        stats, dlogits = _compiled() if compiled else (_stats, _dlogits)
        n, width = h.shape[0], weight.shape[0]
        acc = torch.promote_types(h.dtype, torch.float32)
        loss = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_grad else None
        for i in range(0, n, chunk):
            hc, tc = h[i:i + chunk], targets[i:i + chunk]
            mine = (tc >= start) & (tc < start + width)
            local = torch.where(mine, tc - start, 0)
            valid = tc != ignore_index
            z = hc @ weight.t()
            lse, target_logit = stats(z, local, mine)
            if group is not None:   # one collective per chunk: every rank's lse and target logit
                mine_both = torch.stack([lse, target_logit])
                both = mine_both.new_empty((dist.get_world_size(group) * 2, mine_both.shape[1]))
                dist.all_gather_into_tensor(both, mine_both, group=group)
                both = both.view(-1, 2, mine_both.shape[1])
                lse, target_logit = torch.logsumexp(both[:, 0], 0), both[:, 1].sum(0)
            loss += torch.where(valid, lse - target_logit, 0.0).sum()
            if need_grad:
                dz = dlogits(z, lse, local, mine, valid)
                del z
                grad_h[i:i + chunk] = dz @ weight
                if grad_w.dtype == dz.dtype:
                    grad_w.addmm_(dz.t(), hc)
                else:
                    grad_w += dz.t() @ hc
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * g.to(grad_h.dtype), grad_w * g.to(grad_w.dtype), None, None, None, None, None, None, None


def _vocab_axis(weight: torch.Tensor) -> int | None:
    """The mesh axis the head's rows (the vocabulary) are split over, or None."""
    if not isinstance(weight, DTensor):
        return None
    shards = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    others = [p for i, p in enumerate(weight.placements) if i not in shards and not isinstance(p, Replicate)]
    if len(shards) > 1 or others:
        raise ValueError(f"fused cross-entropy needs the head weight Shard(0) over at most one mesh axis and "
                         f"Replicate elsewhere, not {weight.placements}")
    return shards[0] if shards else None


def _local_hidden(hidden: torch.Tensor, weight: torch.Tensor, axis: int | None) -> torch.Tensor:
    """This rank's whole hidden states as a local tensor whose gradient is summed
    over the vocabulary axis: a DTensor (sequence-sharded or replicated) is gathered,
    a plain tensor (replicated over tp) wrapped so its gradient is all-reduced."""
    if axis is None:
        if isinstance(hidden, DTensor):
            return hidden.full_tensor()
        return hidden
    mesh = weight.device_mesh
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
    elif hidden.device_mesh != mesh:
        raise ValueError(f"fused cross-entropy: the hidden states live on mesh {hidden.device_mesh}, "
                         f"the head on {mesh}")
    whole = hidden.redistribute(mesh, [Replicate()] * mesh.ndim)
    return whole.to_local(grad_placements=[Partial() if i == axis else Replicate() for i in range(mesh.ndim)])


def fused_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = -100, chunk: int | None = None,
                                   compiled: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight^T, targets), targets equal to
    `ignore_index` not counted. hidden (..., D), weight (V, D), targets (...): the
    hidden's leading shape (a sequence-sharded DTensor's global shape). `weight` may
    be a DTensor split over the vocabulary on one mesh axis (the value is then the
    same on every rank of it). `chunk`: tokens per chunk (default_chunk).
    `compiled`: the per-chunk softmax work through torch.compile (GPU). `dtype`: the
    head's compute dtype where the loss runs outside the forward's autocast (one
    process's bf16 on fp32 weights), as the unfused head's matmul computes under it;
    else the hidden states'."""
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[1]:   # before any collective
        raise ValueError(f"fused cross-entropy: hidden states {tuple(hidden.shape)} do not match targets "
                         f"{tuple(targets.shape)} and a head of {tuple(weight.shape)}")
    axis = _vocab_axis(weight)
    group, start = None, 0
    if axis is not None:
        mesh = weight.device_mesh
        vocab, t = weight.shape[0], mesh.size(axis)
        if vocab % t:
            raise ValueError(f"the vocabulary {vocab} does not divide over {t} ranks")
        group, start = mesh.get_group(axis), mesh.get_local_rank(axis) * (vocab // t)
    h = _local_hidden(hidden, weight, axis)
    w = weight.to_local(grad_placements=weight.placements) if isinstance(weight, DTensor) else weight
    # one process under autocast keeps an fp32 head, and a LayerNorm's output is fp32 there:
    # compute in the dtype autocast's F.linear would (each cast's backward returns fp32)
    dtype = dtype or (h.dtype if h.dtype in (torch.bfloat16, torch.float16) else w.dtype)
    h, w = h.to(dtype), w.to(dtype)
    chunk = chunk or default_chunk(w.shape[0])
    need_grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    return _FusedLinearCrossEntropy.apply(h.flatten(0, -2), w, targets.flatten(), group, start, chunk,
                                          ignore_index, need_grad, compiled)

