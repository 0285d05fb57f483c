"""Tied weights: one Parameter under several names (an output head that is the
input embedding, `head.weight = emb.weight`).

Every step that replaces parameters would silently untie them, and the model
would then train two weights where there is one:
- `module.to_empty(device)` from the meta device makes a new Parameter per name;
- tensor parallelism distributes each module's parameters separately;
- a pipeline puts the embedding and the head on different stages.
So each of those steps goes through here: `materialize` and `retie` put the one
Parameter back under every name (tensor parallelism first checks that the names
got the same placements: one DTensor cannot have two), and a pipeline keeps a
copy on each stage that holds a name, sums the copies' gradients after the
backward (Megatron's embedding group), counts the weight once in the gradient
norm and stores it under its first name in checkpoints (`TiedCopies`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Names that share one Parameter, in registration order; groups of 2 or more."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def get_param(module: nn.Module, name: str) -> nn.Parameter:
    owner, attr = _owner(module, name)
    return owner._parameters[attr]


def retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group the group's first parameter again. Refuses
    names whose parameters were given different placements (one DTensor cannot
    be sharded two ways)."""
    for names in groups:
        params = [get_param(module, n) for n in names]
        first = params[0]
        placements = [tuple(p.placements) if isinstance(p, DTensor) else None for p in params]
        meshes = [p.device_mesh if isinstance(p, DTensor) else None for p in params]
        if len(set(placements)) > 1 or any(m != meshes[0] for m in meshes):
            got = ", ".join(f"{n} {pl if pl is not None else '(a plain tensor)'}" for n, pl in zip(names, placements))
            raise ValueError(f"tied parameters would be split differently: {got}. Tied weights are one tensor: "
                             "give their modules styles that place the weight alike (e.g. 'vocab_parallel' for the "
                             "embedding with 'colwise' or 'colwise_rep' for the head, both Shard(0))")
        for n, p in zip(names[1:], params[1:]):
            if p is not first:
                owner, attr = _owner(module, n)
                owner._parameters[attr] = first


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)` that keeps tied parameters tied (to_empty
    from the meta device makes a new Parameter for every name)."""
    groups = tied_groups(module)
    module.to_empty(device=device)
    retie(module, groups)
    return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TiedCopies:
    """Tied weights whose names a pipeline split put on different stages.

    `groups` lists, per tied weight, the (stage, name) pairs that hold a copy;
    the first pair is the weight's canonical name (its first name in the whole
    model: checkpoints store it, and one process reads it back).
    """

    def __init__(self, groups: list[list[tuple[int, str]]], stage_owner, pp_mesh):
        self.groups = groups
        self.stage_owner = stage_owner      # stage id -> pp rank that holds it
        self.pp_mesh = pp_mesh

    @staticmethod
    def find(model: nn.Module, stage_names: list[set[str]], stage_owner, pp_mesh) -> TiedCopies:
        """stage_names[s]: the parameter names stage s keeps."""
        groups = []
        for names in tied_groups(model):
            holders = [(s, n) for n in names for s, kept in enumerate(stage_names) if n in kept]
            if len({s for s, _ in holders}) > 1:
                if len({stage_owner(s) for s, _ in holders}) > 2:
                    raise ValueError(f"tied weight {names} would have copies on more than two pipeline ranks")
                groups.append(sorted(holders))
        return TiedCopies(groups, stage_owner, pp_mesh)

    def _mine(self, parts: dict[int, nn.Module]):
        for group in self.groups:
            yield group, [(s, n, get_param(parts[s], n)) for s, n in group if s in parts]

    def names(self, parts: dict[int, nn.Module]) -> dict[int, str]:
        """id(parameter) -> canonical name, for every copy this rank holds."""
        return {id(p): group[0][1] for group, mine in self._mine(parts) for _, _, p in mine}

    def duplicates(self, parts: dict[int, nn.Module]) -> set[int]:
        """ids of copies beyond the first one in the whole pipeline: left out of the norm."""
        return {id(p) for group, mine in self._mine(parts) for s, n, p in mine if (s, n) != group[0]}

    @torch.no_grad()
    def sum_grads(self, parts: dict[int, nn.Module], reduce_partial_grads) -> None:
        """Give every copy the sum of all copies' gradients. The holders sit at the
        same coordinates on every other axis, so their local shards match once each
        gradient has its parameter's placements."""
        for group, mine in self._mine(parts):
            if not mine:
                continue
            params = [p for _, _, p in mine]
            reduce_partial_grads(params)
            grads = [_local(p.grad) for p in params]
            total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
            ranks = {self.stage_owner(s) for s, _ in group}
            if len(ranks) > 1:
                me, group_pg = self.pp_mesh.get_local_rank(), self.pp_mesh.get_group()
                # the group's rank table, not the mesh tensor: a dry run holds no real tensors
                peer = dist.get_global_rank(group_pg, next(r for r in ranks if r != me))
                mine_sum, other = total, torch.empty_like(total)
                ops = [dist.P2POp(dist.isend, mine_sum, peer, group_pg), dist.P2POp(dist.irecv, other, peer, group_pg)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                total = mine_sum + other
            for g in grads:
                g.copy_(total)
