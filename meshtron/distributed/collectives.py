"""Count the collectives a rank issues: calls and bytes per (kind, mesh axes).

    with CollectiveCounter(mesh) as count:
        step()
    count.bytes   # {("all_gather", "dp+cp"): 1179648, ("all_reduce", "tp"): 8192, ...}

A TorchDispatchMode sees every collective, whoever issues it: FSDP's all-gathers
and reduce-scatters (c10d ops), DTensor's redistributions (functional
collectives), the pipeline's sends and receives and the MoE all-to-alls. Bytes
are those of this rank's input: the shard an all-gather sends, the whole tensor
a reduce-scatter or all-reduce reduces, what an all-to-all or send sends, what a
receive receives. Groups are named by the mesh axes they span. The dry run
(meshtron.planner.dry_run) counts one step this way on a fake process group and fake
tensors, where nothing moves and nothing is computed.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.distributed.mesh import AXES, SUBMESHES, degree

_c10d, _funcol = torch.ops.c10d, torch.ops._c10d_functional

# op -> (kind, index of the argument whose bytes count, index of the group argument)
_OPS = {
    _c10d._allgather_base_: ("all_gather", 1, 2),
    _c10d.allgather_: ("all_gather", 1, 2),                 # dist.all_gather's list form
    _c10d.allgather_into_tensor_coalesced_: ("all_gather", 1, 2),
    _c10d._reduce_scatter_base_: ("reduce_scatter", 1, 2),
    _c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1, 2),
    _c10d.allreduce_: ("all_reduce", 0, 1),
    _c10d.allreduce_coalesced_: ("all_reduce", 0, 1),
    _c10d.alltoall_base_: ("all_to_all", 1, 2),
    _c10d.broadcast_: ("broadcast", 0, 1),
    _c10d.send: ("send", 0, 1),
    _c10d.recv_: ("recv", 0, 1),
    _funcol.all_gather_into_tensor: ("all_gather", 0, 2),
    _funcol.all_gather_into_tensor_coalesced: ("all_gather", 0, 2),
    _funcol.reduce_scatter_tensor: ("reduce_scatter", 0, 3),
    _funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", 0, 3),
    _funcol.all_reduce: ("all_reduce", 0, 2),
    _funcol.all_reduce_coalesced: ("all_reduce", 0, 2),
    _funcol.all_to_all_single: ("all_to_all", 0, 3),
    _funcol.broadcast: ("broadcast", 0, 2),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _ranks_over(mesh: DeviceMesh, axes: tuple[str, ...]) -> list[int]:
    """This rank's group over `axes` of the mesh, in the order _flatten gives its ranks
    (row-major): read off the mesh's layout, no group made or looked up."""
    index = tuple(slice(None) if a in axes else c for a, c in zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    with unset_fake_temporarily():   # the dry run counts under FakeTensorMode; the layout is real
        return mesh.mesh[index].flatten().tolist()


def group_names(mesh: DeviceMesh) -> dict[frozenset[int], str]:
    """The ranks of this rank's group over each axis and named sub-mesh -> the mesh
    axes it spans, the size-1 ones left out ("dp+cp"). Keyed by ranks, not by group:
    DTensor's caches compare meshes by layout, so a collective may run on the group
    of an equal mesh built earlier."""
    names = {}
    for name in (*SUBMESHES, *AXES):   # a group one axis spans takes that axis' name
        axes = SUBMESHES.get(name, (name,))
        ranks = _ranks_over(mesh, axes)
        if len(ranks) > 1:
            names[frozenset(ranks)] = "+".join(a for a in axes if degree(mesh, a) > 1)
    return names


def _hsdp_name(ranks: frozenset[int], dense: list[int]) -> str | None:
    """The name, "dp_shard" or "dp_replicate", of a group of data_parallel.dp_mesh_for's 2-D
    split of the dense data-parallel group `dense` (in its order) into replicas x
    shards: a shard group is an aligned run of consecutive ranks of it, a replica
    group every (n / size)-th rank. None for any other group."""
    n, size = len(dense), len(ranks)
    if size in (1, n) or n % size or not ranks <= set(dense):
        return None
    pos = sorted(dense.index(r) for r in ranks)
    if pos[0] % size == 0 and pos == list(range(pos[0], pos[0] + size)):
        return "dp_shard"
    stride = n // size
    return "dp_replicate" if pos[0] < stride and pos == list(range(pos[0], n, stride)) else None


class CollectiveCounter(TorchDispatchMode):
    """`calls` and `bytes`: {(kind, mesh axes): n} of what ran inside it."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.names = group_names(mesh)
        self.dense = _ranks_over(mesh, SUBMESHES["dense_dp"])
        self.calls: dict[tuple[str, str], int] = collections.Counter()
        self.bytes: dict[tuple[str, str], int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        spec = _OPS.get(func._overloadpacket)
        if spec is not None:
            kind, data, group = spec
            group = args[group]
            # functional collectives name the group; c10d ops carry it boxed as a TorchScript object
            pg = dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) \
                else dist.ProcessGroup.unbox(group)
            ranks = frozenset(_ranks(pg))
            key = (kind, self.names.get(ranks) or _hsdp_name(ranks, self.dense) or pg.group_name)
            self.calls[key] += 1
            self.bytes[key] += _nbytes(args[data])
        return func(*args, **(kwargs or {}))
