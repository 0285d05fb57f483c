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

from meshtron.distributed.choices import AXES, resolve_degrees  # the command line checks both before torch loads

SUBMESHES = {
    "batch": ("dp", "ep"),
    "dense_dp": ("dp", "cp", "ep"),
    "expert_dp": ("dp", "cp"),
    "loss": ("dp", "cp", "ep"),
}


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
