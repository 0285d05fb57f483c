"""Pipeline parallelism on the pp axis: stage splitting and schedules.

The GPT is cut by layer into S = pp x v stages (v virtual stages per rank for
interleaving); the embedding goes to the first stage, the final norm and the
output head (and so the loss) to the last. Stages keep their module names, so
checkpoints do not depend on the split. Rank r of the pp axis holds stages
r, r + pp, ... (looped, interleaved 1F1B) or r and 2pp-1-r (V shape, ZBV).

Communication: one send/recv of a (micro-batch, T, d) activation per stage
boundary and micro-batch, forward and backward (T/tp under SP).

Bubble (idle fraction of a step, m micro-batches, equal stage times):

    gpipe, 1f1b          (p - 1) / (m + p - 1)
    interleaved-1f1b     (p - 1) / (v m + p - 1)
    zero-bubble          (p - 1) / (3 v m + p - 1)   backward split into input-grad
                                                     and weight-grad halves fills ~2/3
                                                     of the 1F1B bubble (ZB-H1)

1F1B keeps at most p micro-batches of activations alive on the first stage
(GPipe keeps all m); a test measures it.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from torch.distributed.tensor import DTensor

from meshtron.mesh import degree
from meshtron.train import mean_over

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
MULTI_STAGE = {"interleaved-1f1b", "zero-bubble", "zbv"}


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """Predicted idle fraction of a step (equal stage times, no communication cost)."""
    p, m, v = pp, microbatches, virtual
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule in ("zero-bubble", "zbv"):
        return (p - 1) / (3 * v * m + p - 1)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {sorted(SCHEDULES)}")


def check_pipeline(schedule: str, pp: int, virtual: int, microbatches: int, n_layers: int) -> None:
    """Every bad combination raises here, before any stage talks to another."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {sorted(SCHEDULES)}")
    if virtual < 1:
        raise ValueError(f"--pp-virtual must be >= 1, not {virtual}")
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank; use interleaved-1f1b or zero-bubble for v={virtual}")
    if schedule == "zbv" and virtual != 2:
        raise ValueError(f"the V-shaped zero-bubble schedule needs exactly 2 stages per rank, not v={virtual}")
    if schedule != "gpipe" and microbatches < pp:
        raise ValueError(f"schedule {schedule} needs at least pp={pp} micro-batches, got {microbatches}")
    if schedule in MULTI_STAGE and microbatches % pp:
        raise ValueError(f"schedule {schedule} needs the micro-batch count {microbatches} to be a multiple of pp={pp}")
    if n_layers < pp * virtual:
        raise ValueError(f"{n_layers} layers cannot be split into pp*v = {pp}*{virtual} = {pp * virtual} stages "
                         "of at least one layer each")


def split_layers(n_layers: int, n_stages: int, embed_cost: float = 1.0, head_cost: float = 1.0) -> list[list[int]]:
    """Contiguous layer ranges per stage, balancing cost where the embedding and
    the head (with the loss) weigh like `embed_cost` / `head_cost` layers."""
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot be split into {n_stages} stages")
    total = embed_cost + n_layers + head_cost
    stages = [[] for _ in range(n_stages)]
    for i in range(n_layers):
        mid = embed_cost + i + 0.5          # the layer's centre on the cumulative cost axis
        stages[min(n_stages - 1, int(mid * n_stages / total))].append(i)
    # every stage needs a layer: where the embedding or head alone filled a
    # stage's share, take a layer from the fullest stage (ranges stay contiguous)
    counts = [len(s) for s in stages]
    while 0 in counts:
        counts[counts.index(0)] += 1
        counts[counts.index(max(counts))] -= 1
    bounds = [sum(counts[:s]) for s in range(n_stages + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]


def stage_ids_of(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def build_stage(model: nn.Module, stage: int, layers: list[int], n_stages: int) -> nn.Module:
    """A copy of the model holding only this stage's modules, under their own names."""
    m = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for name in list(m.layers.keys()):
        if name not in keep:
            del m.layers[name]
    if stage != 0:
        m.tok_embeddings, m.pos_embeddings = None, None
    if stage != n_stages - 1:
        m.norm, m.output = None, None
    elif getattr(m.config, "tie_embeddings", False) and stage != 0:
        # the head keeps its own copy of the tied weight (same values, see init_weights)
        m.output.weight = nn.Parameter(m.output.weight.detach().clone())
    return m


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""
    stages: list[nn.Module]          # the stage modules, parallelized (TP/FSDP) by the caller
    stage_ids: list[int]
    n_stages: int
    schedule_name: str
    microbatches: int
    mesh: DeviceMesh
    schedule: object = None          # built on first use, once the stages are parallelized

    def parameters(self):
        for m in self.stages:
            yield from m.parameters()

    def named_parameters(self):
        for m in self.stages:
            yield from m.named_parameters()

    def norm_parameters(self) -> list:
        """Parameters counted once in the global gradient norm: a tied head is a
        copy of the embedding (same gradient after the sync), so it is left out."""
        tied = getattr(self.stages[0].config, "tie_embeddings", False)
        skip = {id(m.output.weight) for m in self.stages if tied and m.output is not None and m.tok_embeddings is None}
        return [p for p in self.parameters() if id(p) not in skip]

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def make_schedule(self, loss_fn):
        device = next(self.stages[0].parameters()).device
        group = self.mesh["pp"].get_group()
        pstages = [PipelineStage(m, i, self.n_stages, device, group=group) for m, i in zip(self.stages, self.stage_ids)]
        cls = SCHEDULES[self.schedule_name]
        if self.schedule_name in MULTI_STAGE:
            return cls(pstages, self.microbatches, loss_fn=loss_fn)
        return cls(pstages[0], self.microbatches, loss_fn=loss_fn)


def split_model(model: nn.Module, mesh: DeviceMesh, schedule: str, virtual: int, microbatches: int,
                split: list[list[int]] | None = None) -> Pipeline:
    """Cut the (unparallelized) GPT into this pp rank's stages."""
    pp = degree(mesh, "pp")
    check_pipeline(schedule, pp, virtual, microbatches, len(model.layers))
    n_stages = pp * virtual
    split = split or split_layers(len(model.layers), n_stages)
    if len(split) != n_stages:
        raise ValueError(f"an explicit split must list {n_stages} stages, got {len(split)}")
    ids = stage_ids_of(mesh["pp"].get_local_rank(), pp, virtual, schedule)
    stages = [build_stage(model, s, split[s], n_stages) for s in ids]
    return Pipeline(stages, ids, n_stages, schedule, microbatches, mesh)


def sync_tied_embedding_grads(pipe: Pipeline, mesh: DeviceMesh) -> None:
    """Megatron's embedding group: with tied input/output embeddings the first
    stage's embedding and the last stage's head are two copies of one weight,
    so each must receive the sum of both gradients. The two holders sit at the
    same coordinates on every other axis, so their local shards match and one
    exchange over the pp axis (or a local add, if one rank holds both) does it."""
    emb = [m.tok_embeddings.weight for m in pipe.stages if m.tok_embeddings is not None]
    head = [m.output.weight for m in pipe.stages if m.output is not None]
    local = lambda g: g.to_local() if isinstance(g, DTensor) else g  # noqa: E731  grads, no autograd here
    if emb and head:
        total = local(emb[0].grad) + local(head[0].grad)
        local(emb[0].grad).copy_(total)
        local(head[0].grad).copy_(total)
        return
    if not (emb or head):
        return
    pp_ranks = mesh["pp"].mesh.tolist()
    pp = len(pp_ranks)
    virtual = pipe.n_stages // pp
    owner = lambda stage: stage_ids_owner(stage, pp, virtual, pipe.schedule_name)  # noqa: E731
    mine = local((emb or head)[0].grad)
    peer = pp_ranks[owner(pipe.n_stages - 1) if emb else owner(0)]
    other = torch.empty_like(mine)
    group = mesh["pp"].get_group()
    ops = [dist.P2POp(dist.isend, mine, peer, group), dist.P2POp(dist.irecv, other, peer, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    mine.add_(other)


def stage_ids_owner(stage: int, pp: int, virtual: int, schedule: str) -> int:
    """The pp rank holding `stage` (inverse of stage_ids_of)."""
    for r in range(pp):
        if stage in stage_ids_of(r, pp, virtual, schedule):
            return r
    raise ValueError(f"no pp rank holds stage {stage}")


def pipeline_forward_backward(pipe: Pipeline, micro_batches, mesh: DeviceMesh, *, loss_fn,
                              loss_context=None) -> torch.Tensor:
    """One optimizer step's forward and backward through the schedule. Returns the
    mean loss over micro-batches, computed on the last stage and summed over pp so
    every rank logs it (then averaged over the loss sub-mesh like any loss)."""
    x = torch.cat([mb[0] for mb in micro_batches])
    y = torch.cat([mb[1] for mb in micro_batches])
    device = next(pipe.parameters()).device
    x, y = x.to(device), y.to(device)
    if pipe.schedule is None:
        pipe.schedule = pipe.make_schedule(loss_fn)
    losses = []
    with (loss_context or contextlib.nullcontext)():
        args = (x,) if pipe.has_first else ()
        kwargs = {"target": y, "losses": losses} if pipe.has_last else {}
        pipe.schedule.step(*args, **kwargs)
    if getattr(pipe.stages[0].config, "tie_embeddings", False):
        sync_tied_embedding_grads(pipe, mesh)
    losses = [(l.full_tensor() if isinstance(l, DTensor) else l).detach().float() for l in losses]
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    dist.all_reduce(loss, group=mesh["pp"].get_group())
    return mean_over(loss, mesh, "loss")
