"""What a rank of each pipeline stage holds, for the collective model: every
parameter's shape after TP and how it is placed, the stage's FSDP units (a
block, an MoE block's experts, the rest) and their shard sizes, and the weights
tied across stages. Read from a meta model and the model's TP plan, never from
a live mesh.
"""
from __future__ import annotations

import collections
import functools
import math

from torch.distributed.tensor.parallel import PrepareModuleInputOutput, SequenceParallel

from meshtron import models
from meshtron.distributed.tensor_parallel import matches
from meshtron.models.common.experts import Experts
from meshtron.planner.state import _meta_model, _param_table


@functools.cache
def layout_of(spec_name: str, cfg, tp: int, sp: bool, loss_parallel: bool):
    """Per parameter id: (TP-local shape, is an expert weight, is a TP DTensor, is
    split over tp, has a Partial gradient under SP), and every name of it."""
    spec, model = models.MODELS[spec_name], _meta_model(spec_name, cfg)
    table = _param_table(spec_name, cfg, tp, sp, loss_parallel)
    modules = dict(model.named_modules())
    moe = any(isinstance(m, Experts) for m in modules.values())
    plan = spec.tp_plan(model, sp, loss_parallel, moe) if tp > 1 else {}
    styles = {}
    for pattern, style in plan.items():
        for n in modules:
            if matches(pattern, n):
                styles[n] = style
    whole = [n for n, s in styles.items() if isinstance(s, PrepareModuleInputOutput)]   # MoE blocks stay local
    params, names = {}, collections.defaultdict(list)
    whole_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    for name, (pid, shape, expert) in table.items():
        mname = name.rpartition(".")[0]
        full = whole_shapes[name]
        local = any(mname == w or mname.startswith(w + ".") for w in whole)
        style = styles.get(mname)
        partial = sp and isinstance(style, SequenceParallel)
        params[pid] = (shape, expert, tp > 1 and not local and not expert, shape != full, partial)
        names[pid].append(name)
    return params, dict(names)


@functools.cache
def stage_units(spec_name: str, cfg, tp: int, sp: bool, loss_parallel: bool, n_stages: int, stage: int):
    """A stage's FSDP units, [(kind, [parameter ids])] with kind "block", "experts"
    (an MoE block's) or "root" (the rest of the stage), and its block names."""
    spec = models.MODELS[spec_name]
    params, names = layout_of(spec_name, cfg, tp, sp, loss_parallel)
    held = spec.pipeline_split(cfg, n_stages)[stage]
    blocks = [n for n in held if n.startswith("layers.")]   # the split names the blocks FSDP wraps one by one
    units = {b: [] for b in blocks} | {b + ".experts": [] for b in blocks} | {"": []}
    for pid, ns in names.items():
        for n in ns:
            owner = next((h for h in held if n.startswith(h + ".")), None)
            if owner is None:
                continue
            unit = owner + ".experts" if owner in blocks and params[pid][1] else (owner if owner in blocks else "")
            if pid not in units[unit]:
                units[unit].append(pid)
    out = [("experts" if u.endswith(".experts") else "block" if u else "root", ids) for u, ids in units.items() if ids]
    return out, blocks


def padded(shape, k: int) -> int:
    """Elements of FSDP's shard of a parameter: dim 0 padded to a multiple of the k shards."""
    return -(-shape[0] // k) * math.prod(shape[1:])


@functools.cache
def stage_shards(spec_name: str, cfg, tp: int, sp: bool, loss_parallel: bool, n_stages: int, stage: int, ep: int,
           k_dense: int, k_expert: int):
    """A stage's FSDP units as {(kind, shard elements): how many}, the sizes of its
    parameters with Partial gradients, its parameters' kinds for the gradient norm
    (expert, TP DTensor, split over tp), its number of blocks."""
    params, _ = layout_of(spec_name, cfg, tp, sp, loss_parallel)
    units, blocks = stage_units(spec_name, cfg, tp, sp, loss_parallel, n_stages, stage)
    sizes, partial, kinds = collections.Counter(), [], set()
    for kind, ids in units:
        numel = 0
        for p in ids:
            shape, expert, tp_dtensor, tp_split, has_partial = params[p]
            numel += padded((shape[0] // ep,) + shape[1:], k_expert) if expert else padded(shape, k_dense)
            if has_partial:
                partial.append(math.prod(shape))
            kinds.add((expert, tp_dtensor, tp_split))
        sizes[(kind, numel)] += 1
    return dict(sizes), tuple(partial), frozenset(kinds), len(blocks)


@functools.cache
def tied(spec_name: str, cfg, tp: int, sp: bool, loss_parallel: bool, n_stages: int) -> list[tuple[int, set[int]]]:
    """[(parameter id, the stages holding a copy)] of the weights with several names."""
    split = models.MODELS[spec_name].pipeline_split(cfg, n_stages)
    _, names = layout_of(spec_name, cfg, tp, sp, loss_parallel)
    return [(pid, {s for s, held in enumerate(split) for n in ns if any(n.startswith(h + ".") for h in held)})
            for pid, ns in names.items() if len(ns) > 1]
