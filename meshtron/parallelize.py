"""`parallelize`: apply a layout to a model, in torchtitan's order.

1. tensor / sequence parallelism (tp axis): changes what each rank computes,
   so it must see the plain modules;
2. activation recomputation: wraps blocks that already hold their TP shards;
3. torch.compile per block: compiles the TP-partitioned, checkpointed block;
4. FSDP (dense dp x cp x ep): last, because it shards whatever parameters
   the earlier steps left (DTensors on tp become 2-D dp x tp DTensors).

Every step is skipped when its axis has size 1, so an unused axis costs nothing;
except that bf16 (or fp16) training always goes through FSDP2's mixed precision,
at dp = 1 too: bf16 weights and activations, the residual stream included, with
fp32 master weights, as Megatron's mixed precision, and the same numerics at
every dp degree. On a size-1 mesh its gathers are local copies. (autocast on fp32
weights instead keeps an fp32 residual stream and recasts every weight each
forward: 1.3B on one H200 ran at 52.5% MFU that way, 57.2% this way.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.data_parallel import apply_fsdp
from meshtron.mesh import check_model_fits, degree
from meshtron.recompute import apply_recompute
from meshtron.tensor_parallel import apply_gpt_tp
from meshtron.train import cross_entropy


@dataclass
class ParallelConfig:
    zero_stage: int = 1
    hsdp: int = 1                 # replicas of HSDP (1 = plain FSDP over all dp ranks)
    param_dtype: str = "fp32"     # compute dtype; master weights stay fp32
    reduce_dtype: str = "fp32"    # gradient reduction dtype
    sp: bool = False              # sequence parallelism (with tp > 1)
    loss_parallel: bool = True    # cross-entropy on vocab-sharded logits (with tp > 1)
    recompute: str = "none"       # none | full | selective
    compile: bool = False


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig = ParallelConfig()) -> nn.Module:
    check_model_fits({a: degree(mesh, a) for a in ("dp", "pp", "cp", "tp", "ep")}, getattr(model, "config", None))
    if degree(mesh, "tp") > 1:
        apply_gpt_tp(model, mesh, cfg.sp, cfg.loss_parallel)
    if cfg.recompute != "none":
        apply_recompute(model, cfg.recompute)
    if cfg.compile:
        for block in model.layers.values():
            # inductor fuses LayerNorm and bias-GeLU into the neighbouring ops
            # itself; our Triton custom ops are opaque to it and cost more than
            # they save (H200, 1.3B: 148 ms/step without them, 253 ms with them;
            # benchmarks/RESULTS.md), so compiled blocks use the plain ops
            for m in block.modules():
                if hasattr(m, "fused"):
                    m.fused = False
            block.compile()   # in place: parameter names (and so checkpoints) stay as they are
    if degree(mesh, "dense_dp") > 1 or cfg.param_dtype != "fp32":
        zero_stage = cfg.zero_stage if degree(mesh, "dense_dp") > 1 else 1   # nothing to shard over
        apply_fsdp(model, mesh, zero_stage, cfg.hsdp, cfg.param_dtype, cfg.reduce_dtype)
    return model


def loss_function(mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    """Cross-entropy, compiled on a GPU: inductor fuses the fp32 upcast, the
    log-softmax and its backward over the (tokens x vocabulary) logits into a few
    passes instead of ~8 full fp32 passes (1.3B, micro-batch 16 on an H200: 14 ms
    of a 521 ms step, benchmarks/RESULTS.md). Eager where the logits are
    vocab-sharded DTensors (loss parallel) and on the CPU, where inductor's
    compile time outweighs the gain."""
    if device.type == "cuda" and not (degree(mesh, "tp") > 1 and cfg.loss_parallel):
        return torch.compile(cross_entropy)
    return cross_entropy


def loss_context(mesh: DeviceMesh, cfg: ParallelConfig):
    """The context the loss must run in: loss_parallel when logits stay vocab-sharded."""
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel if degree(mesh, "tp") > 1 and cfg.loss_parallel else contextlib.nullcontext
