"""A layout for any number of ranks, built on this one CPU process.

    python recipes/train.py --model llama-8B --dp 8 --tp 8 --sp --zero 3 --seq-len 8192 --dry-run 64

Each rank in turn joins torch's fake process group (it hands out ranks and
groups and communicates nothing) as that rank of a world of N, builds the mesh,
and runs the trainer's own set-up on the meta device: the layout checks, the
pipeline split, the spec's TP plan, recompute and FSDP. What the rank then
holds is read off its parameters (the local shard of each DTensor), so a wrong
plan shows here as it would on the cluster, without one. Gradients have the
shape and dtype of the parameters they belong to; AdamW adds two moments of
that size and a 0-d fp32 step per parameter. Next to each rank the planner's
prediction (meshtron.plan) is printed.
"""
from __future__ import annotations

import dataclasses
import sys

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron import plan
from meshtron.distributed.mesh import init_mesh
from meshtron.layout import build_model, resolve_layout

GiB = 2 ** 30


def _local_bytes(p) -> int:
    t = p.to_local() if isinstance(p, DTensor) else p
    return t.numel() * t.element_size()


def rank_state(config, world: int, rank: int) -> dict[str, int]:
    """{params, grads, optim} bytes that `rank` of `world` holds under `config`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        spec, mc, degrees, microbatches, _ = resolve_layout(config, world)
        mesh = init_mesh(**degrees, device_type="cpu")
        parts, _ = build_model(spec, mc, mesh, config.parallel, microbatches)
        params = {id(p): p for m in parts for p in m.parameters()}.values()
        held = sum(_local_bytes(p) for p in params)
        return {"params": held, "grads": held, "optim": 2 * held + 4 * len(params)}
    finally:
        dist.destroy_process_group()


def dry_run(config, world: int, ranks: list[int] | None = None, out=sys.stdout) -> list[dict[str, int]]:
    """Build `config`'s layout as each of `ranks` (all of them by default) of a
    world of `world`, print its bytes against the planner's, and return them."""
    if dist.is_initialized():
        raise RuntimeError("--dry-run runs on one process, outside torchrun")
    config.validate(world)    # a bad layout stops here, as it would on the cluster
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
    states = []
    for rank in range(world) if ranks is None else ranks:
        s = rank_state(config, world, rank)
        predicted = plan.state_bytes(spec, mc, par, rank)
        states.append(s)
        print(f"{rank:>5} {s['params'] / GiB:11.4f} {s['grads'] / GiB:10.4f} {s['optim'] / GiB:10.4f}   "
              + ("equal" if s == predicted else f"differs: {predicted}"), file=out)
    return states
