"""One DeviceMesh for every parallelism, and every process group derived from it.

The mesh has five named axes, outermost to innermost: (dp, pp, cp, tp, ep).
tp and ep are innermost so that on a real cluster they map to GPUs of one node
(their collectives are per-layer and latency bound); dp is outermost because its
gradient reduction happens once per step and overlaps with compute.

Nothing in meshtron builds a process group by hand: each module asks this file
for a named sub-mesh (`submesh(mesh, name)`); docs/parallelism.md's mesh table says what
each is for. cp ranks hold different tokens of the same samples, so for dense
weights they are data parallel too (Megatron's "data parallel group with context
parallel"). Size-1 axes are kept in the mesh (so code never special-cases a
layout) but no module issues a collective on a sub-mesh of size 1.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("dp", "pp", "cp", "tp", "ep")
SUBMESHES = {
    "batch": ("dp", "ep"),
    "dense_dp": ("dp", "cp", "ep"),
    "expert_dp": ("dp", "cp"),
    "loss": ("dp", "cp", "ep"),
}


def resolve_degrees(world_size: int, dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1,
                    ep: int = 1) -> dict[str, int]:
    """Check the five degrees against the world size; dp=-1 takes what is left."""
    degrees = dict(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
    for name, d in degrees.items():
        if not isinstance(d, int) or (d < 1 and not (name == "dp" and d == -1)):
            raise ValueError(f"parallel degree {name}={d} must be a positive integer"
                             + (" (or -1 for dp)" if name == "dp" else ""))
    rest = pp * cp * tp * ep
    if dp == -1:
        if world_size % rest:
            # a world of one is most often a script started without the launcher
            alone = (f": this is one process; start {rest} ranks (or a multiple) with the launcher in front of the "
                     f"same command, meshtron-run --nproc-per-node {rest} SCRIPT FLAGS") if world_size == 1 else ""
            raise ValueError(f"pp*cp*tp*ep = {pp}*{cp}*{tp}*{ep} = {rest} does not divide the world size "
                             f"{world_size}{alone}")
        degrees["dp"] = world_size // rest
    if degrees["dp"] * rest != world_size:
        hint = ""
        if world_size % rest == 0:
            hint = f": with the other degrees as given, --dp {world_size // rest} fits"
            if ep > 1 and dp > 1:   # torchtitan and Megatron carve ep out of the data-parallel ranks
                hint += (f" (ep is an axis of its own here, not a part of dp: the batch is split over dp x ep, so "
                         f"their --dp {world_size // rest * ep} --ep {ep} is --dp {world_size // rest} "
                         f"--ep {ep})")
        raise ValueError(
            f"mesh dp*pp*cp*tp*ep = {degrees['dp']}*{pp}*{cp}*{tp}*{ep} = {degrees['dp'] * rest} "
            f"does not equal the world size {world_size}{hint}"
        )
    return degrees


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def init_mesh(dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1,
              device_type: str | None = None) -> DeviceMesh:
    """Build THE mesh with axes ("dp", "pp", "cp", "tp", "ep").

    Validation runs first and uses only the world size (from the process group
    or torchrun's WORLD_SIZE), so a bad layout raises on every rank before the
    first collective. What a model needs of the layout (heads divisible by tp,
    ...) its spec checks before this is called (meshtron.models).
    """
    degrees = resolve_degrees(world_size(), dp, pp, cp, tp, ep)
    device_type = device_type or default_device_type()
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shape = tuple(degrees[a] for a in AXES)
    return init_device_mesh(device_type, shape, mesh_dim_names=AXES)


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The named sub-mesh of the one mesh: a single axis or a flattened group."""
    if name in AXES:
        return mesh[name]
    if name not in SUBMESHES:
        raise ValueError(f"unknown sub-mesh {name!r}; known: {AXES + tuple(SUBMESHES)}")
    # torch keeps each flattened mesh with the root mesh under its name: flattening
    # again returns that mesh and makes no new process group (no public flatten in
    # torch 2.11-2.13)
    axes = SUBMESHES[name]
    return mesh[axes]._flatten("_".join(axes))


def degree(mesh: DeviceMesh, name: str) -> int:
    """Size of an axis or named sub-mesh of the one mesh (no groups created)."""
    axes = (name,) if name in AXES else SUBMESHES[name]
    return math.prod(mesh.size(mesh.mesh_dim_names.index(a)) for a in axes)


def batch_slice(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank's slice of the global batch: ranks on the same
    batch coordinate (pp, cp, tp peers) read the same samples."""
    n = degree(mesh, "batch")
    return (submesh(mesh, "batch").get_local_rank() if n > 1 else 0), n
