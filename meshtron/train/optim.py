"""The optimizer and the learning-rate schedule: torch's AdamW stepping on local
shards, Megatron's parameter groups, linear warmup then cosine decay."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as _adamw

from meshtron.distributed.reduce import reduce_partial_grads


class AdamW(torch.optim.AdamW):
    """torch's AdamW (same hyper-parameters, state and state_dict, so DCP and
    resharding see DTensor state as before) whose step runs on the local shards.

    Every tensor of the update is elementwise and every parameter, gradient and
    state tensor shares its placements, so the update of the local shards is the
    update of the whole. Stepping on DTensors instead costs a DTensor dispatch
    per tensor per op, host time the GPU waits for under tp. Gradients left
    Partial are reduced first (`reduce_partial_grads`)."""

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


def build_optimizer(parts, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8):
    """AdamW over the model parts (one model, or a pipeline rank's stages), no weight
    decay on biases and norms (Megatron); fused on CUDA."""
    parts = [parts] if isinstance(parts, nn.Module) else parts
    decay, no_decay = [], []
    for p in (p for m in parts for p in m.parameters()):
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


def replanned(start: int, start_ratio: float, warmup_to: int, total: int, min_ratio: float):
    """lr multiplier of a schedule planned again at step `start`: `start_ratio` there, linearly up to 1 at
    `warmup_to` where a warmup goes on (else it starts the decay), cosine down to min_ratio at `total`."""
    peak = 1.0 if warmup_to > start else start_ratio

    def f(step: int) -> float:
        if step < warmup_to:
            return start_ratio + (1 - start_ratio) * (step - start) / (warmup_to - start)
        t = min(1.0, (step - warmup_to) / max(1, total - warmup_to))
        return min_ratio + (peak - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def plan_again(optimizer: torch.optim.Optimizer, scheduler, plan: dict, lr: float, total: int, min_ratio: float,
               weight_decay: float) -> None:
    """A resumed optimizer and LambdaLR on a schedule planned again (`plan`: from_step, from_lr, warmup_to)
    for peak `lr`; the learning rate stays the checkpoint's for the next step. The weight decay becomes
    `weight_decay` on build_optimizer's first group (the one that decays)."""
    f = replanned(plan["from_step"], plan["from_lr"] / lr, plan["warmup_to"], total, min_ratio)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    scheduler.lr_lambdas = [f] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
    optimizer.param_groups[0]["weight_decay"] = weight_decay
