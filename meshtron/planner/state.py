"""Each rank's exact parameter, gradient and optimizer bytes under a layout, from
the model spec on the meta device (what the planner and the dry run print).

Parameter, gradient and optimizer bytes per rank are exact, parameter by
parameter: the dim the TP plan splits, the experts' Shard(0) over ep, the
pipeline stages a pp rank holds (a tied weight has a copy on each stage that
names it), then FSDP's torch.chunk of dim 0 over the ranks it shards across
(dp x cp x ep for dense weights, or n/hsdp of them, none at zero 0; dp x cp for
experts). AdamW keeps two fp32 moments and a step counter per parameter.
"""
from __future__ import annotations

import collections
import functools
import math

import torch

from meshtron import models
from meshtron.config import ParallelConfig
from meshtron.distributed.mesh import AXES, SUBMESHES
from meshtron.distributed.pipeline_parallel import stage_ids_of
from meshtron.distributed.tensor_parallel import matches, split_dims
from meshtron.models.common.experts import Experts


def coordinate(rank: int, degrees: dict[str, int]) -> dict[str, int]:
    """The mesh coordinate of a rank (row-major over AXES, as init_mesh lays it out)."""
    out = {}
    for a in reversed(AXES):
        rank, out[a] = divmod(rank, degrees[a])
    return out


def _chunk(n: int, k: int, i: int) -> int:
    """Size of torch.chunk(n, k)[i] (empty past the last chunk), as FSDP2 and Shard cut."""
    size = -(-n // k)
    return max(0, min(size, n - i * size))


@functools.cache
def _meta_model(spec_name: str, cfg) -> torch.nn.Module:
    with torch.device("meta"):
        return models.MODELS[spec_name].model_cls(cfg, seed=None)


@functools.cache
def _param_table(spec_name: str, cfg, tp: int, sp: bool, loss_parallel: bool) -> dict:
    """{parameter name (every name of a tied one): (id, TP-local shape, is an expert weight)}."""
    spec, model = models.MODELS[spec_name], _meta_model(spec_name, cfg)
    modules = dict(model.named_modules())
    moe = any(isinstance(m, Experts) for m in modules.values())
    styles = {}
    for pattern, style in (spec.tp_plan(model, sp, loss_parallel, moe) if tp > 1 else {}).items():
        for n in modules:   # later entries win, as in parallelize_module
            if matches(pattern, n):
                styles[n] = style
    table = {}
    for name, p in model.named_parameters(remove_duplicate=False):   # every name of a tied one
        mname, _, pname = name.rpartition(".")
        mod = modules[mname]
        shape = list(p.shape)
        d = split_dims(mname, mod, styles[mname]).get(pname) if mname in styles else None
        if d is not None:
            shape[d] //= tp
        table[name] = (id(p), tuple(shape), isinstance(mod, Experts))
    return table


@functools.cache
def _stage_shapes(spec_name: str, cfg, tp: int, sp: bool, loss_parallel: bool, pp_stages: int):
    """Per pipeline stage: [((TP-local shape, is an expert weight), how many)] of the unique parameters it holds."""
    table = _param_table(spec_name, cfg, tp, sp, loss_parallel)
    stages = models.MODELS[spec_name].pipeline_split(cfg, pp_stages) if pp_stages > 1 else [[""]]
    owner = {m: s for s, names in enumerate(stages) for m in names}
    held = [dict() for _ in stages]
    for name, (pid, shape, expert) in table.items():
        parts = name.split(".")
        for k in range(len(parts)):   # the module prefix a stage names
            s = owner.get(".".join(parts[:k]))
            if s is not None:
                held[s][pid] = (shape, expert)
                break
    return [list(collections.Counter(h.values()).items()) for h in held]


def _flat(c: dict[str, int], d: dict[str, int], axes: tuple[str, ...]) -> tuple[int, int]:
    """(size, this rank's index) of a flattened sub-mesh, row-major as _flatten lays it out."""
    size, index = 1, 0
    for a in axes:
        size, index = size * d[a], index * d[a] + c[a]
    return size, index


def state_bytes(spec, cfg, par: ParallelConfig, rank: int) -> dict[str, int]:
    """{params, grads, optim} bytes that `rank` holds under the layout `par` (explicit degrees)."""
    d = par.degrees()
    c = coordinate(rank, d)
    pp_stages = d["pp"] * par.pp_virtual
    shapes = _stage_shapes(spec.name, cfg, d["tp"], par.sp, par.loss_parallel, pp_stages)
    stages = stage_ids_of(c["pp"], d["pp"], par.pp_virtual, par.pp_schedule) if d["pp"] > 1 else [0]
    n_dense, flat = _flat(c, d, SUBMESHES["dense_dp"])
    fsdp = n_dense > 1 or par.dtype != "fp32"
    zero = par.zero if n_dense > 1 else 1
    replicate = n_dense if zero == 0 else par.hsdp
    dense_shards, dense_index = n_dense // replicate, flat % (n_dense // replicate)
    expert_shards, expert_index = _flat(c, d, SUBMESHES["expert_dp"])
    numel = count = 0
    for s in stages:
        for (shape, expert), times in shapes[s]:
            shape = list(shape)
            if expert:
                shape[0] = _chunk(shape[0], d["ep"], c["ep"])
            if fsdp:
                k, i = (expert_shards, expert_index) if expert else (dense_shards, dense_index)
                shape[0] = _chunk(shape[0], k, i)
            numel += math.prod(shape) * times
            count += times
    # fp32 master weights and gradients; AdamW: two fp32 moments and a 0-d fp32 step each
    return {"params": 4 * numel, "grads": 4 * numel, "optim": 8 * numel + 4 * count}


def pp_rank_share(spec, cfg, par: ParallelConfig, pp_rank: int) -> tuple[int, bool, int]:
    """(layers, whether it holds the output head, TP-local parameter elements before FSDP) of the
    stages pipeline rank `pp_rank` holds: the spec's split, which gives the head's stage fewer
    layers (llama-1B at pp2: 10 and 6), so the ranks' activations differ as their state does."""
    d = par.degrees()
    pp_stages = d["pp"] * par.pp_virtual
    if d["pp"] == 1:
        names, held = [[""]], [0]
    else:
        names = models.MODELS[spec.name].pipeline_split(cfg, pp_stages)
        held = stage_ids_of(pp_rank, d["pp"], par.pp_virtual, par.pp_schedule)
    shapes = _stage_shapes(spec.name, cfg, d["tp"], par.sp, par.loss_parallel, pp_stages)
    numel = sum(math.prod(shape) * times for s in held for (shape, _), times in shapes[s])
    if d["pp"] == 1:
        return cfg.n_layers, True, numel
    layers = sum(1 for s in held for n in names[s] if n.rpartition(".")[2].isdigit())
    return layers, pp_stages - 1 in held, numel


def pp_rank_states(spec, cfg, par: ParallelConfig) -> list[int]:
    """The most state bytes a rank of each pipeline rank's stages holds (FSDP's first chunks
    are the largest)."""
    stride_pp = math.prod(par.degrees()[a] for a in AXES[AXES.index("pp") + 1:])
    return [sum(state_bytes(spec, cfg, par, r * stride_pp).values()) for r in range(par.pp)]
