"""Initialisation by parameter name: each parameter's values are drawn from a
generator seeded by (seed, name), so they do not depend on how the model is
sharded or cut into pipeline stages. Works on plain and DTensor parameters
alike: every rank draws the whole tensor and keeps its own shard, with no
communication."""
from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def normal(shape, std: float, seed: int, key: str) -> torch.Tensor:
    """N(0, std) values of a tensor named `key` (fp32, on the CPU)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)


@torch.no_grad()
def fill(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into parameter `p`, or into its shard."""
    if isinstance(p, DTensor):
        # every rank holds the same `full`, so sharding it needs no communication
        shard = distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(shard.to_local())
    else:
        p.copy_(full)
