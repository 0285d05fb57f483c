"""One DeviceMesh for every parallelism, and every process group derived from it.

The mesh has five named axes, outermost to innermost: (dp, pp, cp, tp, ep).
tp and ep are innermost so that on a real cluster they map to GPUs of one node
(their collectives are per-layer and latency bound); dp is outermost because its
gradient reduction happens once per step and overlaps with compute.

Nothing in meshtron builds a process group by hand: each module asks this file
for a named sub-mesh. The table (also in the README):

    name        axes          used for
    ----------  ------------  ---------------------------------------------------
    dp, pp, cp, tp, ep        one axis each (stage ranks, ring, tensor shards...)
    batch       dp x ep       ranks that read different samples of the batch
    dense_dp    dp x cp x ep  grad reduction / FSDP sharding of dense parameters
    expert_dp   dp x cp       grad reduction of expert parameters (Shard(0) on ep)
    loss        dp x cp x ep  ranks whose token losses are averaged together

cp ranks hold different tokens of the same samples, so for dense weights they
are data parallel too (Megatron's "data parallel group with context parallel").
Size-1 axes are kept in the mesh (so code never special-cases a layout) but no
module issues a collective on a sub-mesh of size 1.
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


def resolve_degrees(world_size: int, dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """Check the five degrees against the world size; dp=-1 takes what is left."""
    degrees = dict(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
    for name, d in degrees.items():
        if not isinstance(d, int) or (d < 1 and not (name == "dp" and d == -1)):
            raise ValueError(f"parallel degree {name}={d} must be a positive integer" + (" (or -1 for dp)" if name == "dp" else ""))
    rest = pp * cp * tp * ep
    if dp == -1:
        if world_size % rest:
            raise ValueError(f"pp*cp*tp*ep = {pp}*{cp}*{tp}*{ep} = {rest} does not divide the world size {world_size}")
        degrees["dp"] = world_size // rest
    if degrees["dp"] * rest != world_size:
        raise ValueError(
            f"mesh dp*pp*cp*tp*ep = {degrees['dp']}*{pp}*{cp}*{tp}*{ep} = {degrees['dp'] * rest} "
            f"does not equal the world size {world_size}"
        )
    return degrees


def check_model_fits(degrees: dict[str, int], config=None, seq_len: int | None = None) -> None:
    """Raise ValueError if the layout cannot split this model or sequence.

    Pure arithmetic on the config, so every rank raises the same error before
    anything communicates.
    """
    tp, cp, pp, ep = degrees["tp"], degrees["cp"], degrees["pp"], degrees["ep"]
    if config is not None:
        if config.n_heads % tp:
            raise ValueError(f"tp={tp} does not divide the number of attention heads {config.n_heads}")
        if config.dim % tp:
            raise ValueError(f"tp={tp} does not divide the hidden size {config.dim}")
        if config.vocab_size % tp:
            raise ValueError(f"tp={tp} does not divide the vocabulary size {config.vocab_size} (pad it)")
        if pp > config.n_layers:
            raise ValueError(f"pp={pp} is greater than the number of layers {config.n_layers}")
        n_experts = getattr(config, "n_experts", 0)
        if ep > 1 and (n_experts == 0 or n_experts % ep):
            raise ValueError(f"ep={ep} does not divide the number of experts {n_experts}")
    if seq_len is not None:
        # load-balanced causal CP cuts the sequence into 2*cp chunks
        chunks = 2 * cp if cp > 1 else 1
        if seq_len % chunks:
            raise ValueError(f"cp={cp} needs the sequence length {seq_len} to be divisible by 2*cp={chunks}")


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_mesh(dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, device_type: str | None = None,
              *, config=None, seq_len: int | None = None) -> DeviceMesh:
    """Build THE mesh with axes ("dp", "pp", "cp", "tp", "ep").

    Validation runs first and uses only the world size (from the process group
    or torchrun's WORLD_SIZE), so a bad layout raises on every rank before the
    first collective.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    degrees = resolve_degrees(world_size, dp, pp, cp, tp, ep)
    check_model_fits(degrees, config, seq_len)
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
    # torch wants flattened meshes kept by their creator (slicing them back out
    # of the root is deprecated), so the mesh carries its own small cache.
    cache = mesh.__dict__.setdefault("_meshtron_flat", {})
    if name not in cache:
        axes = SUBMESHES[name]
        cache[name] = mesh[axes]._flatten("_".join(axes))  # no public flatten in torch 2.11-2.13
    return cache[name]


def degree(mesh: DeviceMesh, name: str) -> int:
    """Size of an axis or named sub-mesh of the one mesh (no groups created)."""
    axes = (name,) if name in AXES else SUBMESHES[name]
    return math.prod(mesh.size(mesh.mesh_dim_names.index(a)) for a in axes)
