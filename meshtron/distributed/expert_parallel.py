"""Expert parallelism on the ep axis, and mixture-of-experts blocks under every layout.

Expert weights [n_experts, ...] are Shard(0) over ep: ep rank e holds experts
[e E/ep, (e+1) E/ep). A token's copies (one per chosen expert) travel to the
ranks holding their experts and back:

    count exchange   all_to_all_single of the copy counts per expert (the token
                     all-to-alls need their splits first)
    dispatch         all_to_all_single of the copies, sorted by expert
    experts          one grouped GEMM per projection over the received copies,
                     sorted by local expert
    combine          all_to_all_single back, weighted by the router's scores in fp32

Backward mirrors the two token all-to-alls. Each dispatch also runs as `stages`,
a generator that yields once the copies travel out and once they travel back
(--moe-two-batch runs another half of the micro-batch there: two_batch.py).
The exact dispatch (AllToAllDispatch) copies its split sizes to the host, which
waits for the GPU once per layer. The
padded one (PaddedAllToAllDispatch, --moe-dispatch padded) sends every rank a
block of every copy this rank has, T k rows, real ones first: equal splits, no
host sync and static shapes, for ep x the all-to-all bytes, received rows and
expert rows (torch._grouped_mm computes only the real ones).

For the dense parameters ep is one more data-parallel axis (the batch is sharded
over dp x ep; FSDP over dp x cp x ep). Expert weights are FSDP-sharded over expert_dp (dp x cp), and since each
expert sees the tokens of every ep rank, their gradients are divided by
dp x cp x ep like the dense ones: by dp x cp in FSDP's reduction, by ep on
their way out of the experts (dividing by expert_dp alone would scale them by
ep: DeepSpeed #6545).

Routing decides per sequence (models/common/moe.py): a sequence split over cp
ranks is gathered over cp for what needs all of it (per-sequence balancing,
capacity). The step's statistics (tokens per expert, the aux loss) are summed
over every rank holding other tokens of the step, dp x cp x ep, once per step;
the aux loss's mean scores are each rank's part of that sum, its gradient this
rank's own. Tensor parallelism leaves
MoE blocks whole on each tp rank (`tp_style`): with sequence parallelism
their input is all-gathered over tp and their output split again, so the tp
ranks of a group route the same tokens and compute the same gradients.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput
from torch.nn.utils.stateless import _reparametrize_module

from meshtron.distributed.context_parallel import local_positions
from meshtron.distributed.counts import counts, host_counts
from meshtron.distributed.mesh import degree, submesh


class TokenSum(nn.Module):
    """The sum of a tensor over `group` (the ranks holding other tokens of the step),
    with the gradient of this rank's own part."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.size = dist.get_world_size(group)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        total = t.detach().clone()
        dist.all_reduce(total, group=self.group)
        return t + (total - t.detach())

    def gather(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(every rank's t, in group order, concatenated; where this rank's rows
        start). Every rank holds as many tokens (the batch and sequence split evenly)."""
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts), dist.get_rank(self.group) * t.shape[0]


class SequenceParts(TokenSum):
    """TokenSum over the cp ranks, which hold chunks r and 2cp-1-r of each sequence."""

    def positions(self, n: int, device=None) -> torch.Tensor:
        return local_positions(n * self.size, self.size, dist.get_rank(self.group), device)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, scale: float):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def local_experts(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor | None = None, *,
                  grad_scale: float) -> torch.Tensor:
    """The experts module's forward on this rank's shards of its weights (Shard(0)
    over ep), gradients flowing back to the DTensors scaled by `grad_scale`. It
    replaces the module's forward, so FSDP's hooks still gather the weights first."""
    params = {n: _GradScale.apply(p.to_local(grad_placements=p.placements), grad_scale) if isinstance(p, DTensor)
              else p for n, p in experts.named_parameters(recurse=False)}
    with _reparametrize_module(experts, params):
        return type(experts).forward(experts, x, counts)


def by_expert(experts_forward, rows: torch.Tensor, got: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The experts' output for rows received in (source rank, expert) blocks, in that
    order: `got` [source rank, my expert] counts the rows; the experts want them sorted
    (expert, source)."""
    ep, local_e = got.shape
    block = torch.repeat_interleave(torch.arange(ep * local_e, device=rows.device), got.flatten(), output_size=n_rows)
    sort = (block % local_e).argsort(stable=True)
    y = experts_forward(rows[sort], got.sum(0))
    return torch.empty_like(y).index_copy(0, sort, y)


def drain(stages):
    """Run a generator of stages (a dispatch's) to its end: its value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


class AllToAllDispatch(nn.Module):
    """The token copies to the ep rank that holds their expert, and back."""

    def __init__(self, ep_mesh: DeviceMesh):
        super().__init__()
        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        return drain(self.stages(x, weights, experts, mlp, self.exchange(experts, mlp)))

    def exchange_counts(self, experts: torch.Tensor, mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the copies' order sorted by expert, so by destination rank too; the copies sent
        [destination rank, its expert]; received [source rank, my expert]), the counts
        exchanged on the device."""
        ep = self.ep
        n_experts = mlp.w1.shape[0]                  # the global count (a DTensor's shape)
        flat = experts.flatten()
        sent = counts(flat, n_experts)
        got = all_to_all_single(sent, None, None, self.group)
        return flat.argsort(stable=True), sent.view(ep, n_experts // ep), got.view(ep, n_experts // ep)

    def exchange(self, experts: torch.Tensor, mlp: nn.Module) -> tuple:
        """What `stages` needs before moving the copies: exchange_counts' order and
        received counts, and the split sizes (send, receive) read on the host, the one
        sync. Outside `stages`: a compiled block's graph breaks at the sync and resumes
        after it, where a break inside a generator would leave the rest uncompiled."""
        order, sent, got = self.exchange_counts(experts, mlp)
        splits = host_counts(torch.cat([sent.sum(1), got.sum(1)]), 2 * experts.numel())
        return order, got, splits[:self.ep], splits[self.ep:]

    def stages(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, mlp: nn.Module, exchanged, *,
               run=None, a2a=all_to_all_single_autograd):
        """forward as a generator that yields once the copies are on their way to their
        experts and once the experts' rows are on their way back (two_batch.py runs the
        other half meanwhile); its value is forward's. `exchanged`: exchange's; `run(rows,
        counts)` runs the experts (mlp's call by default); `a2a` moves the rows
        (all_to_all_single_autograd's arguments)."""
        k = experts.shape[1]
        order, got, send_splits, recv_splits = exchanged
        rows = a2a(x[order // k], recv_splits, send_splits, self.group)
        yield
        y = by_expert(run or mlp, rows, got, sum(recv_splits))
        back = a2a(y, send_splits, recv_splits, self.group)
        yield
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, order // k, back.float() * weights.flatten()[order, None])
        return out.to(x.dtype)


class PaddedAllToAllDispatch(AllToAllDispatch):
    """The same copies, experts and sums as AllToAllDispatch, over all-to-alls of
    equal splits: nothing waits for the GPU. Every rank sends each ep rank a block
    of C = T k rows (all of its copies, so none is ever dropped): its copies for
    that rank at the start, sorted by expert, zeros after. The counts, exchanged
    on the device as before, say which received rows are real; those go to the
    experts sorted by (local expert, source) as the exact dispatch sorts them, the
    padding after the last expert's rows, and come back the same way. Costs ep x
    the exact dispatch's all-to-all bytes and buffers."""

    def exchange(self, experts: torch.Tensor, mlp: nn.Module) -> tuple:
        return self.exchange_counts(experts, mlp)     # no split sizes: every block is C rows

    def stages(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, mlp: nn.Module, exchanged, *,
               run=None, a2a=all_to_all_single_autograd):
        k, ep = experts.shape[1], self.ep
        order, sent, got = exchanged
        local_e = got.shape[1]
        c = experts.numel()                          # the block: every copy of this rank
        # sorted copy i goes to rank d (its expert's), row i - (copies for ranks before d) of block d
        per_rank = sent.sum(1)
        dest = experts.flatten()[order] // local_e
        slot = torch.arange(c, device=x.device)
        pos = dest * c + slot - (per_rank.cumsum(0) - per_rank)[dest]
        send = x.new_zeros(ep * c, x.shape[1]).index_copy(0, pos, x[order // k])
        rows = a2a(send, None, None, self.group)      # block s: rank s's copies for me
        yield
        # each received row's local expert (local_e past block s's real rows): the key
        # (expert, source) sorts the real rows as the exact dispatch does, the padding last
        expert_of = torch.searchsorted(got.cumsum(1), slot.expand(ep, c).contiguous(), right=True)
        by_expert = (expert_of * ep + torch.arange(ep, device=x.device)[:, None]).flatten().argsort(stable=True)
        y = (run or mlp)(rows[by_expert], got.sum(0))
        # rows past the last expert's: torch._grouped_mm leaves them unwritten (anything, NaN too)
        y = torch.where((torch.arange(ep * c, device=x.device) < got.sum())[:, None], y, 0)
        y = torch.empty_like(y).index_copy(0, by_expert, y)
        back = a2a(y, None, None, self.group)        # block d: my copies' rows from rank d
        yield
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, order // k, back[pos].float() * weights.flatten()[order, None])
        return out.to(x.dtype)


DISPATCHES = {"exact": AllToAllDispatch, "padded": PaddedAllToAllDispatch}


def dispatch_of(name: str, ep: int) -> str:
    """The dispatch `name` (--moe-dispatch) runs at expert-parallel degree ep: auto is
    padded at ep 2, where its twice the exact bytes cost less than a host sync per
    layer (docs/parallelism.md, Mixture of experts), and exact above, where the padding grows with ep."""
    return ("padded" if ep == 2 else "exact") if name == "auto" else name


def apply_moe(moe_blocks: list[nn.Module], mesh: DeviceMesh, dispatch: str = "auto") -> None:
    """Lay out MoE blocks on the mesh: expert weights Shard(0) over ep and an
    all-to-all dispatch (`dispatch`: dispatch_of's) when ep > 1; routing statistics
    summed over the ranks with other tokens, each sequence's parts gathered over
    cp. Call before tensor parallelism, which then leaves them as they are."""
    ep = degree(mesh, "ep")
    n_token_ranks = degree(mesh, "loss")
    group = submesh(mesh, "loss").get_group() if n_token_ranks > 1 else None
    for moe in moe_blocks:
        if moe.experts.w1.shape[0] % ep:
            raise ValueError(f"ep={ep} does not divide the {moe.experts.w1.shape[0]} experts")
        if ep > 1:
            for pname, p in list(moe.experts.named_parameters(recurse=False)):
                moe.experts.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p, mesh["ep"], [Shard(0)], src_data_rank=None), p.requires_grad))
            moe.dispatch = DISPATCHES[dispatch_of(dispatch, ep)](mesh["ep"])
            # the loss carries the dp x cp x ep factor that FSDP divides out; FSDP over
            # expert_dp divides expert gradients by dp x cp: the rest, 1/ep, here
            moe.experts.forward = functools.partial(local_experts, moe.experts, grad_scale=1.0 / ep)
        if group is not None:
            moe.step_sum = TokenSum(group)
        if degree(mesh, "cp") > 1:
            moe.seq_parts = SequenceParts(mesh["cp"].get_group())


def tp_style(sp: bool) -> PrepareModuleInputOutput:
    """The TP plan entry of an MoE block: the whole sequence in, on local tensors
    (its parameters are not tp DTensors), and the residual stream's layout out."""
    seq = Shard(1) if sp else Replicate()
    return PrepareModuleInputOutput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                                    output_layouts=(Replicate(),), desired_output_layouts=(seq,),
                                    use_local_output=True)
