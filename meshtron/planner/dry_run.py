"""A layout for any number of ranks, built on this one CPU process.

    python recipes/train.py --model llama-8B --dp 8 --tp 8 --sp --zero 3 --seq-len 8192 --dry-run 64

Each rank in turn joins torch's fake process group (it hands out ranks and
groups and communicates nothing) as that rank of a world of N, builds the mesh,
and runs the trainer's own set-up on the meta device: the layout checks, the
pipeline split and schedule, the spec's TP plan, recompute and FSDP. Then it
runs the trainer's own step on fake tensors (shapes without data) and counts
the collectives it issues (meshtron.distributed.collectives). What the rank then
holds is read off its parameters (the local shard of each DTensor), so a wrong
plan shows here as it would on the cluster, without one. Gradients have the
shape and dtype of the parameters they belong to; AdamW adds two moments of
that size and a 0-d fp32 step per parameter. Next to each rank the planner's
prediction (meshtron.planner.state) is printed.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron.distributed.collectives import CollectiveCounter
from meshtron.distributed.mesh import init_mesh
from meshtron.distributed.tied import materialize
from meshtron.planner.comm_model import step_collectives
from meshtron.planner.state import state_bytes
from meshtron.train.layout import build_model, pipeline_io, resolve_layout
from meshtron.train.loss import forward_kwargs
from meshtron.train.step import gradients, layout_loss, moe_end_step

GiB = 2 ** 30


def _local_bytes(p) -> int:
    t = p.to_local() if isinstance(p, DTensor) else p
    return t.numel() * t.element_size()


def _fake_pg(world: int, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _forked(fn, *args):
    """fn(*args) in a forked child: torch keeps meshes that FSDP derives (its
    dp x tp mesh) past the process group that made them, and the next rank's
    identical layout would find the old one, whose groups are gone."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(fn, args)


def dry_run_rank(config, world: int, rank: int) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """What `rank` of `world` holds under `config`, {params, grads, optim} bytes,
    and the {(kind, mesh axes): bytes} of the collectives it issues in one training
    step (its gradients, their norm and the MoE statistics: meshtron.train.step), counted
    while the step runs on fake tensors: shapes flow, nothing is computed or sent
    (FSDP's lazy initialization communicates nothing, and the pipeline's stages
    are given their shapes; a pipelined step is counted after one uncounted step,
    as the real one is, with the gradients cleared between them as the optimizer
    clears them). MoE all-to-alls assume the tokens spread evenly over the experts."""
    return _forked(_dry_run_rank, config, world, rank)


def _dry_run_rank(config, world: int, rank: int):
    from torch._subclasses.fake_tensor import FakeTensorMode
    config = config.on_device("cuda")   # the run it stands for is a GPU one: bf16 unless --dtype says otherwise
    _fake_pg(world, rank)
    try:
        spec, mc, degrees, microbatches, global_batch = resolve_layout(config, world)
        mesh = init_mesh(**degrees, device_type="cpu")
        parts, pipeline = build_model(spec, mc, mesh, config.parallel, microbatches)
        params = {id(p): p for m in parts for p in m.parameters()}.values()
        held = sum(_local_bytes(p) for p in params)
        state = {"params": held, "grads": held, "optim": 2 * held + 4 * len(params)}
        with FakeTensorMode(allow_non_fake_inputs=True):
            for m in parts:
                materialize(m, "cpu")
            loss_fn = layout_loss(mesh, config.parallel, torch.device("cpu"), parts)
            tokens = torch.zeros(global_batch // (degrees["dp"] * degrees["ep"]), config.training.seq_len,
                                 dtype=torch.long)
            if pipeline is not None:   # torch 2.11's first step also warms each pipeline link (4 bytes)
                pipeline.build_schedule(loss_fn, pipeline_io(mc, config, mesh), forward_kwargs(loss_fn))
                _answer_the_vote(pipeline.schedule)
                gradients(parts, tokens, tokens, mesh, pipeline, config, microbatches, loss_fn)
                # as the optimizer's zero_grad does: a gradient left from this step would take
                # the next one's Partial sums (SP's norms) in, and their all-reduce would not run
                for m in parts:
                    m.zero_grad(set_to_none=True)
            with CollectiveCounter(mesh) as count:
                gradients(parts, tokens, tokens, mesh, pipeline, config, microbatches, loss_fn)
                if getattr(mc, "moe", None) is not None:
                    moe_end_step(parts, mesh)
        return state, dict(count.bytes)
    finally:
        dist.destroy_process_group()


def _answer_the_vote(schedule) -> None:
    """Torch 2.13's schedules open their first step with a vote along the pipeline
    (a 4-byte send and receive per neighbouring stage, the result read on the host):
    may every stage use the shapes it was given? On one process no neighbour
    answers. Every rank gives its stages their shapes (pipeline_io), so the vote
    would say yes: each stage takes that answer without asking. Torch 2.11 has no
    vote (its first step warms each link with a 4-byte send, which needs no answer)."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def agreed(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC
    schedule._warmup_p2p = agreed


def differences(counted: dict, planned: dict, skip=()) -> str:
    """The entries on which the dry run and the planner disagree, each with both
    values ("none" where one has no entry): the whole dicts bury them."""
    def name(key):
        return key if isinstance(key, str) else " over ".join(key)

    def value(v):
        return "none" if v is None else f"{v:,}"
    keys = sorted((counted.keys() | planned.keys()) - set(skip))
    return "; ".join(f"{name(k)}: dry run {value(counted.get(k))}, planner {value(planned.get(k))}"
                     for k in keys if counted.get(k) != planned.get(k))


def dry_run(config, world: int, ranks: list[int] | None = None, out=None) -> list[dict[str, int]]:
    """Build `config`'s layout as each of `ranks` (all of them by default) of a
    world of `world`, print its bytes against the planner's (to `out`, the
    sys.stdout of the moment by default), and return them."""
    out = out or sys.stdout
    if dist.is_initialized():
        raise RuntimeError("--dry-run runs on one process, outside torchrun")
    config = config.on_device("cuda")
    # a bad layout stops here, as it would on the cluster
    spec, mc, degrees, microbatches, global_batch = resolve_layout(config, world)
    bad = [r for r in ranks or () if not 0 <= r < world]
    if bad:
        raise ValueError(f"--dry-run-ranks {bad} are not ranks of a world of {world}")
    par = dataclasses.replace(config.parallel, **degrees)
    tr = config.training
    name = config.checkpoint.init_from_hf or config.model.model
    print(f"dry run: {name} ({mc.num_params() / 1e9:.2f}B params) on {world} ranks, mesh {degrees}, "
          f"global batch {global_batch} x {tr.seq_len}, micro-batches {microbatches} x {tr.micro_batch}", file=out)
    print(f"{'rank':>5} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10}   planner", file=out)
    states, collectives = [], []
    for rank in range(world) if ranks is None else ranks:
        s, count = dry_run_rank(config, world, rank)
        predicted = state_bytes(spec, mc, par, rank)
        states.append(s)
        collectives.append((rank, count))
        print(f"{rank:>5} {s['params'] / GiB:11.4f} {s['grads'] / GiB:10.4f} {s['optim'] / GiB:10.4f}   "
              + ("equal" if s == predicted else f"differs: {differences(s, predicted)}"), file=out)
    moe = " (MoE all-to-alls as if the tokens spread evenly over the experts)" if getattr(mc, "moe", None) else ""
    print(f"collectives of one step, MiB each rank sends (an all-gather its shard, a reduce-scatter or all-reduce "
          f"the whole tensor){moe}, against the planner's (meshtron.planner.comm_model):", file=out)
    for rank, count in collectives:
        _, planned = step_collectives(spec, mc, par, tr.micro_batch, microbatches, tr.seq_len, rank, device="cpu")
        routed = [("all_to_all", "ep")]   # what a rank's all-to-alls send back depends on the routing
        differ = differences(count, planned, routed)
        print(f"  rank {rank}: " + ", ".join(f"{kind} over {axes} {n / 2 ** 20:.2f}"
                                              for (kind, axes), n in sorted(count.items()))
              + (f"   planner differs: {differ}" if differ else "   planner equal"), file=out)
    return states
