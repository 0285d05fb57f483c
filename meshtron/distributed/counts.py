"""Tokens per expert, counted on the device, and the one copy of them to the host
(shared by the model's MoE block and expert parallelism's dispatch).

`torch.bincount` sizes its output from the largest id, so on a GPU it waits for
the device, and fake tensors (the dry run: meshtron.planner.dry_run) cannot run it at
all; an index_add into `n` zeros counts the same without either. Fake tensors
hold no counts to copy to the host: there `host_counts` assumes the tokens
spread evenly, which is what the dry run reports."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `ids` (int64), as bincount(minlength=n)."""
    ids = ids.flatten()
    return torch.zeros(n, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def host_counts(c: torch.Tensor, total: int) -> list[int]:
    """c.tolist(); for a fake tensor, `total` spread evenly over its entries."""
    # is_compiling first: dynamo does not trace is_fake, and would break the graph once more
    if not torch.compiler.is_compiling() and is_fake(c):
        n = c.numel()
        return [total // n + (i < total % n) for i in range(n)]
    return c.tolist()
