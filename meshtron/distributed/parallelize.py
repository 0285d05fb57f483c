"""Apply a layout to a model, in torchtitan's order:

0. FP8 (--fp8): nn.Linear layers become torchao Float8Linear before TP, so the
   plan shards their weights and uses the float8 TP styles (meshtron.distributed.float8);
1. tensor / sequence parallelism (tp axis): changes what each rank computes,
   so it must see the plain modules;
2. activation recomputation: wraps blocks that already hold their TP shards;
3. torch.compile per block: compiles the TP-partitioned, checkpointed block
   (--cuda-graphs: replayed as CUDA graphs, meshtron.distributed.cuda_graphs);
4. FSDP (dense dp x cp x ep): last, because it shards whatever parameters the
   earlier steps left (DTensors on tp become 2-D dp x tp DTensors).

A model spec's parallelize function (meshtron.models.*) applies its own TP plan
and calls `apply_recompute`, `apply_compile` and `apply_dp` on its blocks; any
other model goes through `parallelize(model, mesh, config, plan=, blocks=)`.

Every step is skipped when its axis has size 1, so an unused axis costs nothing.
bf16 (or fp16) training on more than one rank goes through FSDP2's mixed
precision, at dp = 1 too (tp, cp or pp > 1): bf16 weights and activations, the
residual stream included, with fp32 master weights, as Megatron's mixed
precision. One process (--mixed-precision autocast, the default) skips FSDP:
torch.autocast on its fp32 weights, the embeddings' outputs cast to bf16 so that
the residual stream is bf16 as under FSDP (data_parallel.cast_embeddings); FSDP on
a one-rank mesh only adds copies into and out of buffers that move nothing
(docs/parallelism.md, Mixed precision). --mixed-precision fsdp keeps FSDP there.
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Protocol

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.distributed import cuda_graphs, float8
from meshtron.distributed.choices import default_dtype
from meshtron.distributed.data_parallel import apply_fsdp, autocast_dtype, cast_embeddings, dp_mesh_for
from meshtron.distributed.mesh import degree
from meshtron.distributed.recompute import apply_recompute
from meshtron.distributed.tensor_parallel import STYLES, matches, parallelize_module
from meshtron.distributed.user_pipeline import is_stub

log = logging.getLogger(__name__)


class LayoutOptions(Protocol):
    """What these functions read of a layout's options (meshtron.config.ParallelConfig
    has them all; distributed/ imports no config)."""
    zero: int               # ZeRO stage 0-3
    hsdp: int               # replicas of HSDP
    dtype: str              # compute dtype: "fp32", "bf16", "fp16"
    reduce_dtype: str       # gradient reduction dtype
    recompute: str          # "none", "selective", "full"
    compile: bool           # torch.compile each block
    fp8: str                # "none", "tensorwise", "rowwise"
    mixed_precision: str    # one process's bf16: "autocast" or "fsdp"
    cuda_graphs: bool       # CUDA graphs of the compiled blocks, FSDP's gathered weights kept in place


def apply_compile(blocks: list[nn.Module], options: dict | None = None) -> None:
    """torch.compile each block in place: parameter names, and so checkpoints, stay
    as they are; repeated blocks share one compiled graph. `options`: inductor's,
    for these compiles only."""
    for block in blocks:
        block.compile(options=options)


def apply_fp8(model: nn.Module, mesh: DeviceMesh, config: LayoutOptions, skip=float8.DEFAULT_SKIP) -> None:
    """--fp8: the model's convertible linears to Float8Linear (first: TP then shards
    their weights). Tensorwise weights are gathered in fp8 where FSDP shards them over
    dp > 1 ranks; on one dp rank its gather is a local copy, and casting there to bf16
    and to fp8 inside the compiled block was the faster of the two (docs/parallelism.md, FP8 matmuls)."""
    fsdp = degree(mesh, "dense_dp") > 1
    names = float8.convert(model, config.fp8, mesh.device_type, skip=skip, tp=degree(mesh, "tp"),
                           fsdp_all_gather=fsdp)
    if names:
        log.info("fp8 (%s): %d linears, fp8 all-gather %s", config.fp8, len(names), fsdp)


def fp8_tp_plan(plan: dict, model: nn.Module, mesh: DeviceMesh, config: LayoutOptions) -> dict:
    """The TP plan with torchao's float8 styles where --fp8 tensorwise converted the modules."""
    return float8.tp_plan(plan, model, config.fp8, matches, mesh.device_type)


def compile_options(config: LayoutOptions) -> dict | None:
    """Each block's inductor options: FP8 rowwise's cast rounding, and CUDA graphs (--cuda-graphs)."""
    return cuda_graphs.compile_options(float8.compile_options(config), config.cuda_graphs)


def _zero(mesh: DeviceMesh, config: LayoutOptions) -> int | None:
    """The ZeRO stage FSDP runs, or None when FSDP is not applied (fp32 on one dense
    dp rank; one process under autocast)."""
    n = degree(mesh, "dense_dp")
    if autocast_dtype(mesh, config.dtype, config.mixed_precision) is not None:
        return None
    if n > 1 or (config.dtype or default_dtype(mesh.device_type)) != "fp32":
        return config.zero if n > 1 else 1   # nothing to shard over
    return None


def dp_mesh_of(mesh: DeviceMesh, config: LayoutOptions) -> DeviceMesh | None:
    """The mesh FSDP runs on under `config` (None without FSDP): build it once for
    a model cut into parts and give it to each part's apply_dp."""
    zero = _zero(mesh, config)
    return None if zero is None else dp_mesh_for(mesh, zero, config.hsdp)


def apply_dp(model: nn.Module, mesh: DeviceMesh, config: LayoutOptions, blocks: list[nn.Module],
             experts: list[nn.Module] = (), dp_mesh: DeviceMesh | None = None) -> None:
    """FSDP over the dense data-parallel sub-mesh, one unit per block plus the root
    (and one per experts module, over expert_dp); on one process under autocast,
    only the cast of the embeddings' outputs. `dp_mesh`: dp_mesh_of's, when built
    already; else this call builds it."""
    if autocast_dtype(mesh, config.dtype, config.mixed_precision) is not None:
        cast_embeddings(model)   # and no FSDP: _zero is None under autocast
        return
    zero = _zero(mesh, config)
    if zero is not None:
        dtype = config.dtype or default_dtype(mesh.device_type)
        apply_fsdp(model, mesh, blocks, zero, config.hsdp, dtype, config.reduce_dtype, experts, dp_mesh)
        if config.cuda_graphs:   # the graphs read the gathered weights where they recorded them
            cuda_graphs.keep_gathered(model)


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


def parallelize(model: nn.Module, mesh: DeviceMesh, config: LayoutOptions, *, plan: dict | None = None,
                blocks=None, dp_mesh: DeviceMesh | None = None, fp8_skip=float8.DEFAULT_SKIP) -> nn.Module:
    """Apply a layout to any model: FP8 linears (config.fp8; `fp8_skip`: glob patterns
    of linears that stay in the compute dtype, the output head's name among them),
    the TP `plan` (string styles of parallelize_module), then recomputation and
    compile of each block, then FSDP with one unit per block (on `dp_mesh`, as
    apply_dp). Tied weights stay tied through every step."""
    what, blocks = find_blocks(model, blocks)
    log.info("parallelize: %s", what)
    apply_fp8(model, mesh, config, fp8_skip)
    if degree(mesh, "tp") > 1 and plan:
        styles = {k: STYLES[v]() if isinstance(v, str) and v in STYLES else v for k, v in plan.items()}
        parallelize_module(model, mesh, fp8_tp_plan(styles, model, mesh, config))
    apply_recompute(blocks, config.recompute)
    if config.compile:
        apply_compile(blocks, compile_options(config))
    apply_dp(model, mesh, config, blocks, dp_mesh=dp_mesh)
    return model
