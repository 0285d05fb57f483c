"""An all-to-all started in one place and finished in another, under autograd: the
piece expert parallelism's overlapped dispatch (expert_parallel.OverlappedAllToAllDispatch,
--moe-dispatch overlap) is made of. `start` begins the exchange and returns the buffer
it fills, `finish` waits for it (the stream waits, not the host, on a GPU); whatever runs
between them runs beside the transfer. Backward mirrors it: `finish`'s backward starts
the gradient's exchange, `start`'s waits for it. Autograd runs the ready node created
last first, so each finish's backward runs before the GEMMs created between it and its
start, and each start's backward after them: the gradient's exchange overlaps them too.

torch.compile would trace these as functional collectives that wait at once (inductor
moves no wait unless its reorder passes are on): a caller runs them eagerly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _InFlight:
    """One all-to-all's state between its _Start and its _Finish: the forward's work,
    then the gradient's buffer and work."""

    def __init__(self, out_splits: list[int], in_splits: list[int], group):
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.work = self.grad = self.grad_work = None


class _Start(torch.autograd.Function):
    """Starts t's all-to-all; what it returns is valid after _Finish. Backward waits
    for the gradient's all-to-all that _Finish's backward started."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, f: _InFlight):
        out = t.new_empty(sum(f.out_splits), *t.shape[1:])
        f.work = dist.all_to_all_single(out, t.contiguous(), f.out_splits, f.in_splits, f.group, async_op=True)
        ctx.f = f
        return out

    @staticmethod
    def backward(ctx, _):
        f = ctx.f
        f.grad_work.wait()
        grad, f.grad, f.grad_work = f.grad, None, None
        return grad, None


class _Finish(torch.autograd.Function):
    """Waits for the all-to-all _Start began (the stream waits, not the host, on a GPU).
    Backward starts the gradient's all-to-all back and returns at once."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, f: _InFlight):
        f.work.wait()
        f.work = None
        ctx.f = f
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        f = ctx.f
        f.grad = grad.new_empty(sum(f.in_splits), *grad.shape[1:])
        f.grad_work = dist.all_to_all_single(f.grad, grad.contiguous(), f.in_splits, f.out_splits, f.group,
                                             async_op=True)
        return grad, None    # a placeholder: _Start's backward returns the real gradient


def start(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> tuple[torch.Tensor, _InFlight]:
    f = _InFlight(out_splits, in_splits, group)
    return _Start.apply(t, f), f


def finish(t: torch.Tensor, f: _InFlight) -> torch.Tensor:
    return _Finish.apply(t, f)
