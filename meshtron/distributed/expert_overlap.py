"""Expert parallelism's token all-to-alls overlapped with the experts' GEMMs
(--moe-dispatch overlap): the exact dispatch (expert_parallel.AllToAllDispatch)
over two chunks of this rank's tokens, A and B, one all-to-all of the counts and
one host sync for both. Each all-to-all is started, and waited for only where its
result is first needed, so NCCL runs beside the other chunk's matmuls:

    forward    start dispatch A, wait; start dispatch B
               experts A                      (beside dispatch B)
               start combine A; wait dispatch B
               experts B                      (beside combine A)
               wait combine A; start combine B, wait
    backward   the mirror: combine B's gradient exposed, combine A's beside
               experts B's backward, dispatch B's beside experts A's, dispatch A's exposed

About half the all-to-all time can hide, none of it where a chunk's GEMMs are
shorter than the other chunk's transfer. The backward order is autograd's: it runs
the ready node created last first, so each _Finish's backward (which starts the
gradient's all-to-all) runs before the GEMMs created between it and its _Start,
and each _Start's backward (which waits) after them.

torch.compile would trace the collectives as functional ones that wait at once
(and inductor moves no wait unless its reorder passes are on), so this dispatch
runs eagerly inside a compiled block (torch._dynamo.disable): the exact dispatch
breaks the graph at its host sync there anyway. Tokens are chunked whole (all k
copies of a token in one chunk): each token's copies are summed in the exact
dispatch's order, so the output equals it up to the GEMMs' rounding."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.device_mesh import DeviceMesh

from meshtron.distributed.counts import counts, host_counts


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


class OverlappedAllToAllDispatch(nn.Module):
    """AllToAllDispatch's copies, experts and sums in two chunks of tokens, each
    chunk's all-to-alls beside the other chunk's experts (the module's docstring)."""

    def __init__(self, ep_mesh: DeviceMesh):
        super().__init__()
        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        # both chunks inside one call of the experts module: FSDP gathers (and reduces) its weights once
        n_experts = mlp.w1.shape[0]                  # the global count (a DTensor's shape)
        return mlp(x, schedule=functools.partial(self.chunks, weights, experts, n_experts))

    def chunks(self, weights: torch.Tensor, experts: torch.Tensor, n_experts: int, x: torch.Tensor,
               experts_forward) -> torch.Tensor:
        k, ep = experts.shape[1], self.ep
        local_e = n_experts // ep
        half = (x.shape[0] + 1) // 2
        flats = experts[:half].flatten(), experts[half:].flatten()
        orders = [f.argsort(stable=True) for f in flats]   # each chunk's copies grouped by expert
        sent = torch.stack([counts(f, n_experts) for f in flats]).view(2, ep, local_e)
        # one exchange for both chunks: rank d gets [chunk, my expert] blocks of its experts
        got = all_to_all_single(sent.transpose(0, 1).flatten(), None, None, self.group)
        got = got.view(ep, 2, local_e).transpose(0, 1)   # [chunk, source rank, my expert]
        splits = host_counts(torch.cat([sent.sum(2).flatten(), got.sum(2).flatten()]), 2 * experts.numel())
        send = [splits[c * ep:(c + 1) * ep] for c in (0, 1)]          # one sync for both chunks
        recv = [splits[(2 + c) * ep:(3 + c) * ep] for c in (0, 1)]
        tokens = [orders[0] // k, orders[1] // k + half]

        def by_expert(c):   # received blocks are (source, expert); the experts want them (expert, source)
            block = torch.repeat_interleave(torch.arange(ep * local_e, device=x.device), got[c].flatten(),
                                            output_size=sum(recv[c]))
            return (block % local_e).argsort(stable=True)

        def run_experts(c, rows):
            sort = by_expert(c)
            y = experts_forward(rows[sort], got[c].sum(0))
            return torch.empty_like(y).index_copy(0, sort, y)

        rows_a = finish(*start(x[tokens[0]], recv[0], send[0], self.group))
        rows_b, dispatch_b = start(x[tokens[1]], recv[1], send[1], self.group)
        back_a, combine_a = start(run_experts(0, rows_a), send[0], recv[0], self.group)
        y_b = run_experts(1, finish(rows_b, dispatch_b))
        back = [finish(back_a, combine_a), finish(*start(y_b, send[1], recv[1], self.group))]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for c, (w, order) in enumerate(zip((weights[:half], weights[half:]), orders)):
            out.index_add_(0, tokens[c], back[c].float() * w.flatten()[order, None])
        return out.to(x.dtype)
