"""Apply a layout to a model, in torchtitan's order:

1. tensor / sequence parallelism (tp axis): changes what each rank computes,
   so it must see the plain modules;
2. activation recomputation: wraps blocks that already hold their TP shards;
3. torch.compile per block: compiles the TP-partitioned, checkpointed block;
4. FSDP (dense dp x cp x ep): last, because it shards whatever parameters the
   earlier steps left (DTensors on tp become 2-D dp x tp DTensors).

A model spec's parallelize function (meshtron.models.*) applies its own TP plan
and calls `apply_recompute`, `apply_compile` and `apply_dp` on its blocks; any
other model goes through `parallelize(model, mesh, config, plan=, blocks=)`.

Every step is skipped when its axis has size 1, so an unused axis costs nothing;
except that bf16 (or fp16) training always goes through FSDP2's mixed precision,
at dp = 1 too: bf16 weights and activations, the residual stream included, with
fp32 master weights, as Megatron's mixed precision, and the same numerics at
every dp degree (on a size-1 mesh its gathers are local copies). Autocast on
fp32 weights instead keeps an fp32 residual stream and recasts every weight each
forward, which is slower (benchmarks/HISTORY.md, second session).
"""
from __future__ import annotations

import fnmatch
import logging

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.config import ParallelConfig
from meshtron.distributed.data_parallel import apply_fsdp
from meshtron.distributed.mesh import degree
from meshtron.distributed.pipeline_parallel import is_stub
from meshtron.distributed.recompute import apply_recompute
from meshtron.distributed.tensor_parallel import parallelize_module

log = logging.getLogger(__name__)


def apply_compile(blocks: list[nn.Module], options: dict | None = None) -> None:
    """torch.compile each block in place: parameter names, and so checkpoints, stay
    as they are; repeated blocks share one compiled graph. `options`: inductor's,
    for these compiles only."""
    for block in blocks:
        block.compile(options=options)


def apply_dp(model: nn.Module, mesh: DeviceMesh, config: ParallelConfig, blocks: list[nn.Module],
             experts: list[nn.Module] = ()) -> None:
    """FSDP over the dense data-parallel sub-mesh, one unit per block plus the root
    (and one per experts module, over expert_dp)."""
    n = degree(mesh, "dense_dp")
    if n > 1 or config.dtype != "fp32":
        zero = config.zero if n > 1 else 1   # nothing to shard over
        apply_fsdp(model, mesh, blocks, zero, config.hsdp, config.dtype, config.reduce_dtype, experts)


def find_blocks(model: nn.Module, blocks=None) -> tuple[str, list[nn.Module]]:
    """The transformer blocks: `blocks` as modules or a glob of module names, or by
    default the children of the largest ModuleList / ModuleDict whose entries are
    all of one class. Returns (a description for the log, the blocks)."""
    if blocks is not None and not isinstance(blocks, str):
        return f"{len(blocks)} given blocks", list(blocks)
    named = dict(model.named_modules())
    if isinstance(blocks, str):
        found = [m for n, m in named.items() if fnmatch.fnmatchcase(n, blocks)]
        if not found:
            raise ValueError(f"blocks pattern {blocks!r} matches no module of {type(model).__name__}")
        return f"{len(found)} modules matching {blocks!r}", found
    best, best_name = [], ""
    for name, m in named.items():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            children = [c for c in m.children() if not is_stub(c)]   # a pipeline stage's own blocks
            if len(children) > len(best) and len({type(c) for c in children}) == 1:
                best, best_name = children, name
    if not best:
        raise ValueError(f"{type(model).__name__} has no ModuleList or ModuleDict of repeated blocks: pass blocks=")
    return f"{len(best)} blocks of {best_name} ({type(best[0]).__name__})", best


def parallelize(model: nn.Module, mesh: DeviceMesh, config: ParallelConfig, *, plan: dict | None = None,
                blocks=None) -> nn.Module:
    """Apply a layout to any model: the TP `plan` (string styles of
    parallelize_module), then recomputation and compile of each block, then FSDP
    with one unit per block. Tied weights stay tied through every step."""
    what, blocks = find_blocks(model, blocks)
    log.info("parallelize: %s", what)
    if degree(mesh, "tp") > 1 and plan:
        parallelize_module(model, mesh, plan)
    apply_recompute(blocks, config.recompute)
    if config.compile:
        apply_compile(blocks)
    apply_dp(model, mesh, config, blocks)
    return model
