"""One training step's gradients, shared by the trainer and the dry run: the
forward and backward of every micro-batch (or the pipeline's schedule), then the
gradient norm over every rank's shards and clipping; and the mixture-of-experts
statistics after the optimizer step.

Loss: each micro-batch's summed token loss is divided by the number of target
tokens in the whole global batch (counted over dp x cp x ep), so the loss and
the gradients are the global token mean under every layout, with padding too.
FSDP averages gradients over dp x cp x ep, so the backward loss carries that
factor back.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtron.distributed.context_parallel import shard_sequence
from meshtron.distributed.data_parallel import autocast as amp
from meshtron.distributed.data_parallel import autocast_dtype, set_grad_sync
from meshtron.distributed.mesh import degree
from meshtron.distributed.pipeline_parallel import Pipeline
from meshtron.distributed.reduce import clip_grad_norm_, sum_over
from meshtron.models.common.moe import SUMMED, RoutingStats, end_step, moe_blocks
from meshtron.train.loss import IGNORE_INDEX, cross_entropy_sum, forward_kwargs, logits_of, loss_function, output_head


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def micro_batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn,
                     autocast: torch.dtype | None = None, inputs: dict | None = None) -> torch.Tensor:
    """One micro-batch's summed token loss through the whole model (no pipeline):
    its forward under `autocast`, the loss outside it, as the trainer's step and
    evaluation both run it. Only the loss keeps what its backward needs of the
    logits, so they go once that has run. `inputs`: more per-token keyword inputs
    of the model's forward, (B, T) like x (packed documents: `documents`, `positions`)."""
    with amp(x.device, autocast), warnings.catch_warnings():
        # A root FSDP unit whose output is a tensor-parallel head's local tensor (DTensor.to_local
        # returns a view) warns, on every rank and step, that an in-place op on that view would
        # skip its pre-backward all-gather. Nothing here writes to it: the loss reads the logits
        # out of place (tests/distributed/test_user_models.py: transformers' models at dp2 x tp2
        # ZeRO-3 give one process's gradients).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        out = logits_of(model(x, **forward_kwargs(loss_fn), **(inputs or {})))
    return loss_fn(out, y)


def forward_backward(parts: list[nn.Module], x: torch.Tensor, y: torch.Tensor, mesh: DeviceMesh | None, *,
                     microbatches: int = 1, loss_fn=cross_entropy_sum,
                     zero: int = 1, pipeline: Pipeline | None = None,
                     autocast: torch.dtype | None = None, inputs: dict | None = None) -> torch.Tensor:
    """Forward and backward of one step over this rank's part (x, y) of the global
    batch: `microbatches` in turn, or the pipeline's schedule. Returns the global
    token-mean loss (fp32, detached, the same on every rank); `mesh=None` is one
    process. `zero` is the ZeRO stage FSDP was applied with (what each micro-batch
    communicates); `autocast` runs the forward under torch.autocast (one process's
    bf16: data_parallel.autocast_dtype; more ranks' bf16 is FSDP's policy). `inputs`:
    per-token keyword inputs of the model, (B, T) like x, split and sharded with it."""
    device = next(parts[0].parameters()).device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    inputs = {k: t.to(device, non_blocking=True) for k, t in (inputs or {}).items()}
    if mesh is not None and degree(mesh, "cp") > 1:   # this rank's chunks of every sequence
        x, y = shard_sequence(x, mesh), shard_sequence(y, mesh)
        inputs = {k: shard_sequence(t, mesh) for k, t in inputs.items()}
    n_tokens = sum_over((y != IGNORE_INDEX).sum().float(), mesh, "loss")
    n_dp = degree(mesh, "dense_dp") if mesh is not None else 1
    scale = n_dp / n_tokens.clamp_min(1)        # FSDP divides the summed gradients by n_dp
    if pipeline is not None:
        total = sum_over(pipeline.step(x, y, scale, inputs), mesh, "pp")
    else:
        model, total = parts[0], torch.zeros((), device=device)
        split = [dict(zip(inputs, ts)) for ts in zip(*(t.chunk(microbatches) for t in inputs.values()))] \
            if inputs else [None] * microbatches
        for i, (xs, ys) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
            set_grad_sync(model, zero, i == microbatches - 1)
            loss = micro_batch_loss(model, xs, ys, loss_fn, autocast, split[i]) * scale
            loss.backward()
            total += _value(loss)
    return sum_over(total, mesh, "loss") / n_dp


def layout_loss(mesh: DeviceMesh, par, device: torch.device, parts: list[nn.Module] = ()):
    """The loss function for the layout: with --fused-loss and a model whose `parts`
    hold an output head, the fused head + cross-entropy; else vocab-parallel
    cross-entropy where tp shards the logits, or the plain one."""
    head = output_head(parts) if par.fused_loss else None
    return loss_function(device, degree(mesh, "tp") > 1 and par.loss_parallel, head,
                         autocast_dtype(mesh, par.dtype, par.mixed_precision))


def gradients(parts: list[nn.Module], x: torch.Tensor, y: torch.Tensor, mesh: DeviceMesh, pipeline: Pipeline | None,
              config, microbatches: int, loss_fn, inputs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_backward, then the global gradient norm and clipping to --max-norm:
    (loss, norm) as device tensors."""
    par = config.parallel
    loss = forward_backward(parts, x, y, mesh, microbatches=microbatches, loss_fn=loss_fn, zero=par.zero,
                            pipeline=pipeline, autocast=autocast_dtype(mesh, par.dtype, par.mixed_precision),
                            inputs=inputs)
    norm_params = pipeline.norm_parameters() if pipeline is not None else None
    norm = clip_grad_norm_([p for m in parts for p in m.parameters()], config.training.max_norm or None,
                           mesh, norm_params)
    return loss, norm


def moe_end_step(parts: list[nn.Module], mesh: DeviceMesh) -> RoutingStats:
    """Expert-bias updates and the step's routing statistics, over every stage."""
    s = end_step(moe_blocks(parts))
    if degree(mesh, "pp") > 1:
        group = mesh["pp"].get_group()
        sums, worst = torch.stack(s[:SUMMED]), torch.stack(s[SUMMED:])
        dist.all_reduce(sums, group=group)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        s = RoutingStats(*sums, *worst)
    return s
