"""Reductions over the mesh that every layout needs: a value's mean over a named
sub-mesh (the logged loss), gradients left Partial (sequence parallelism's
replicated norm weights), and the global gradient norm with clipping.

Communication per step: the loss mean is one all-reduce of a scalar over
dp x cp x ep; the Partial gradients one all-reduce of one flat bucket per
(mesh, placements) group; the norm one all-reduce of a scalar per mesh axis that
shards some gradient, plus one over pp. Nothing runs over an axis of size 1.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtron.distributed.mesh import degree, submesh


def mean_over(value: torch.Tensor, mesh: DeviceMesh | None, name: str) -> torch.Tensor:
    """The mean of `value` over the ranks of sub-mesh `name` (a copy; `value` is kept)."""
    if mesh is not None and degree(mesh, name) > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=submesh(mesh, name).get_group())
        value /= degree(mesh, name)
    return value


def sum_over(value: torch.Tensor, mesh: DeviceMesh | None, name: str) -> torch.Tensor:
    """The sum of `value` over the ranks of sub-mesh `name` (a copy; `value` is kept)."""
    value = value.clone()
    if mesh is not None and degree(mesh, name) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=submesh(mesh, name).get_group())
    return value


@torch.no_grad()
def reduce_partial_grads(parameters) -> None:
    """Give every DTensor gradient its parameter's placements. Under SP a replicated
    LayerNorm weight or bias gets a Partial(sum) gradient (each tp rank summed over
    its slice of the sequence); left so, DTensor all-reduces each one lazily in the
    norm and again in the optimizer. Here: one all-reduce per group, on a flat bucket."""
    groups = defaultdict(list)
    for p in parameters:
        g = p.grad
        if isinstance(g, DTensor) and g.placements != p.placements:
            groups[(g.device_mesh, g.placements, p.placements, g.dtype)].append(p)   # equal meshes: one bucket
    for (_, src, dst, _), ps in groups.items():
        mesh = ps[0].device_mesh
        if not all(s == d or (s.is_partial() and d.is_replicate()) for s, d in zip(src, dst)):
            for p in ps:   # a layout change other than reducing partial sums: one by one
                p.grad = p.grad.redistribute(mesh, dst)
            continue
        # Partial -> Replicate keeps every local shape, so the shards concatenate
        shards = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in shards])
        flat = DTensor.from_local(flat, mesh, src, run_check=False).redistribute(mesh, dst).to_local()
        for p, t, part in zip(ps, shards, flat.split([t.numel() for t in shards])):
            p.grad = DTensor.from_local(part.view_as(t), mesh, dst, run_check=False, shape=p.shape, stride=p.stride())


@torch.no_grad()
def grad_norm(parameters, mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients, each parameter counted once (pass tied
    copies once).

    Each gradient's local shard contributes its sum of squares; the sums of
    gradients sharded over the same mesh axes are added locally and then summed
    over those axes, one scalar all-reduce per axis (Replicate axes hold copies
    and are not summed). Pipeline stages hold disjoint parameters, so the total
    is summed over pp. Gradients must have their parameters' placements
    (`reduce_partial_grads`); a Partial one is refused rather than miscounted.
    """
    shards: dict[tuple, list[torch.Tensor]] = defaultdict(list)   # (mesh, sharded axes) -> local shards
    meshes: dict[tuple, DeviceMesh | None] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        key, m = ((None, ()), None)
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise ValueError("grad_norm needs reduced gradients: call reduce_partial_grads first")
            # sharded: Shard, and FSDP-over-TP's _StridedShard, which is no Shard in torch 2.13
            sharded = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            # meshes compare by their ranks and axes: gradients on equal meshes made by
            # different ops share one all-reduce
            key, m = (g.device_mesh, sharded), g.device_mesh
            g = g.to_local()
        shards[key].append(g)
        meshes[key] = m
    total_sq = None
    for key, grads in shards.items():
        sq = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).float() ** 2
        for axis in key[1]:
            if meshes[key].size(axis) > 1:
                dist.all_reduce(sq, group=meshes[key].get_group(axis))
        total_sq = sq if total_sq is None else total_sq + sq.to(total_sq.device)
    if total_sq is None:
        total_sq = torch.zeros(())
    if mesh is not None and degree(mesh, "pp") > 1:
        dist.all_reduce(total_sq, group=mesh["pp"].get_group())
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float | None, mesh: DeviceMesh | None = None,
                    norm_parameters=None) -> torch.Tensor:
    """Scale all grads so their global norm is at most max_norm; return the norm.
    `norm_parameters` (default: all) are the ones the norm counts: a pipeline
    passes each tied weight once, though both stages holding a copy get scaled."""
    parameters = [p for p in parameters if p.grad is not None]
    reduce_partial_grads(parameters)
    norm = grad_norm(parameters if norm_parameters is None else norm_parameters, mesh)
    if max_norm is not None and max_norm > 0:
        # a device tensor, not a Python float: no host sync, the CPU keeps queueing
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        # scaling each local shard scales the whole (sharded or replicated) gradient
        by_device = defaultdict(list)
        for p in parameters:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_device[g.device].append(g)
        for device, gs in by_device.items():
            torch._foreach_mul_(gs, coef.to(device))
    return norm
