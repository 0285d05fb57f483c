"""The training step: micro-batches, loss averaging, global-norm clipping, the
optimizer and the learning-rate schedule. Layout-agnostic: everything
layout-specific comes from the mesh and the parallelized model.

Loss: each rank averages over its own tokens; every rank holds the same number
of tokens (fixed-length packing), so the mean of those means over the loss
sub-mesh dp x cp x ep (and over micro-batches) is the global token mean, and the
loss does not change with the layout. Gradients follow the same rule: FSDP
averages over dp x cp x ep, micro-batch losses are divided by their count.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.adamw import adamw as _adamw
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtron.data_parallel import set_grad_sync
from meshtron.mesh import degree, submesh


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy in fp32 (logits may be bf16 or a vocab-sharded DTensor)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def batch_slice(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank's slice of the global batch: ranks on the same
    batch coordinate (pp, cp, tp peers) read the same samples."""
    n = degree(mesh, "batch")
    return (submesh(mesh, "batch").get_local_rank() if n > 1 else 0), n


def forward_backward(model: nn.Module, micro_batches, mesh: DeviceMesh | None, *, loss_fn=cross_entropy,
                     loss_context=contextlib.nullcontext, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Run all micro-batches; return the global mean loss (fp32, detached, same on every rank)."""
    n = len(micro_batches)
    device = next(model.parameters()).device
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        set_grad_sync(model, i == n - 1)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with loss_context():
            with amp:
                logits = model(x)
            loss = loss_fn(logits, y) / n
            loss.backward()
        loss = loss.detach()
        losses.append(loss.full_tensor() if isinstance(loss, DTensor) else loss)
    return mean_over(torch.stack(losses).sum(), mesh, "loss")


def mean_over(value: torch.Tensor, mesh: DeviceMesh | None, name: str) -> torch.Tensor:
    if mesh is not None and degree(mesh, name) > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=submesh(mesh, name).get_group())
        value /= degree(mesh, name)
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
            groups[(id(g.device_mesh), g.placements, p.placements, g.dtype)].append(p)
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
    """Global L2 norm of all gradients, each parameter counted once.

    DTensor grads are grouped by (mesh, placements) since the stock norm cannot
    stack DTensors of different meshes; each group's norm is made whole with
    full_tensor(). Pipeline stages hold disjoint parameters, so their squared
    norms are summed over pp.
    """
    groups = defaultdict(list)
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ("local", g.device)
        groups[key].append(g)
    total_sq = None
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        n = (n.full_tensor() if isinstance(n, DTensor) else n).float()
        total_sq = n * n if total_sq is None else total_sq + (n * n).to(total_sq.device)
    if total_sq is None:
        total_sq = torch.zeros(())
    if mesh is not None and degree(mesh, "pp") > 1:
        dist.all_reduce(total_sq, group=mesh["pp"].get_group())
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float | None, mesh: DeviceMesh | None = None, norm_parameters=None) -> torch.Tensor:
    """Scale all grads so their global norm is at most max_norm. `norm_parameters`
    (default: all) are the ones the norm counts: a pipeline passes each tied
    weight once, though both stages holding a copy get scaled."""
    parameters = [p for p in parameters if p.grad is not None]
    reduce_partial_grads(parameters)
    norm = grad_norm(parameters if norm_parameters is None else norm_parameters, mesh)
    if max_norm is not None and max_norm > 0:
        # a device tensor, not a Python float: no host sync, the CPU keeps queueing
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        # scaling each local shard scales the whole (sharded, replicated or partial) gradient
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters]
        by_device = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        for device, gs in by_device.items():
            torch._foreach_mul_(gs, coef.to(device))
    return norm


class AdamW(torch.optim.AdamW):
    """torch's AdamW (same hyper-parameters, state and state_dict, so DCP and
    resharding see DTensor state as before) whose step runs on the local shards.

    Every tensor of the update is elementwise and every parameter, gradient and
    state tensor shares its placements, so the update of the local shards is the
    update of the whole. Stepping on DTensors instead costs a DTensor dispatch
    per tensor per op (the fused step alone took 41 ms of host time a step for a
    1.3B GPT at tp=2; benchmarks/RESULTS.md). Gradients left Partial are reduced
    first (`reduce_partial_grads`)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # a no-op after clip_grad_norm_, which reduces them already
        reduce_partial_grads(p for group in self.param_groups for p in group["params"])
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            _adamw(
                *(_locals(ts) for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)), steps,
                foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None), has_complex=has_complex, amsgrad=group["amsgrad"],
                beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        return loss


def _locals(tensors):
    # under no_grad to_local() is the local shard itself, no autograd edge
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8):
    """AdamW, no weight decay on biases and norms (Megatron); fused on CUDA."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay + no_decay)
    return AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None, foreach=None if fused else True)


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1):
    """lr multiplier: linear warmup to 1, cosine down to min_ratio at `total`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def train_step(model, optimizer, scheduler, micro_batches, mesh, *, max_norm=None, forward_backward=forward_backward):
    """One optimizer step. `forward_backward(model, micro_batches, mesh)` is the
    plain one, or the pipeline schedule's for a model split into stages."""
    loss = forward_backward(model, micro_batches, mesh)
    norm = clip_grad_norm_(model.parameters(), max_norm, mesh, getattr(model, "norm_parameters", lambda: None)())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return loss, norm

