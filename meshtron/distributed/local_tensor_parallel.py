"""Tensor and sequence parallelism computed on local tensors (Megatron's way).

The parameters are placed as under the DTensor styles (tensor_parallel.py):
column-parallel weights Shard(0), row-parallel Shard(1), norms Replicate(), so
FSDP, the optimizer, clipping, checkpoints and the planner see the same model.
Only the forward differs: each parameter is read once per call as its local
shard (`to_local`, naming the placement its gradient comes back in), matmuls
and norms run on plain tensors, and the communication is Megatron's four
conjugate operators on the tp group:

  gather_seq      all-gather over the sequence; reduce-scatter back   (SP, before column-parallel)
  copy_to_tp      identity; all-reduce back                           (no SP, before column-parallel)
  scatter_seq     reduce-scatter over the sequence; all-gather back   (SP, after row-parallel)
  reduce_from_tp  all-reduce; identity back                           (no SP, after row-parallel)

With `overlap` (--tp-overlap), the gather and the column-parallel linears that read
its output are one autograd function (`GatherLinears`) whose backward is Megatron's:
the input's gradient first, its reduce-scatter (all-reduce without SP) started, the
weights' gradients computed while it runs, the wait last. Otherwise autograd sums the
input's gradient only after every one of those linears' whole backward, and the
collective runs with nothing beside it. NCCL's kernels take SMs from the matmuls beside
them, which then slow by about what is hidden; with `comm="copy-engine"`
(--tp-overlap-comm copy-engine, CUDA only) that reduce-scatter moves its bytes with the
GPUs' copy engines over symmetric memory (`ce_reduce_scatter`), the matmuls keep their
SMs, and the hidden time is gained (docs/performance.md).

Under SP a norm's weight gradient is a partial sum (each rank saw 1/tp of the
tokens) and is reduced once per step, as under the DTensor styles. Same
collectives, same bytes (the dry run and a test count them).

Why: every DTensor op costs tens of microseconds of host Python; a Llama block
under the DTensor styles issues over a hundred of them per micro-batch, forward
and backward. At the small micro-batches that pipelines cut a batch into, that
host time exceeds the block's GPU time (docs/parallelism.md). Here a block costs
a few dozen plain calls.

A module takes these styles only where its forward is known: nn.Linear, and a
norm exposing `norm(x, weight)` (the Llama's RMSNorm).
"""
from __future__ import annotations

import types

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def _group(mesh: DeviceMesh) -> str:
    return mesh.get_group().group_name


class _AllReduce(torch.autograd.Function):
    """Sum over the group; the gradient passes through (reduce_from_tp)."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    """Identity; the gradient is summed over the group (copy_to_tp)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


# torch 2.13 renames funcol's *_tensor_autograd collectives *_single_autograd (the old names warn on
# every call); torch 2.11, the GPU machines', has only the old: the same op under either name
_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_scatter_autograd = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd


def gather_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """(B, T/tp, ...) -> (B, T, ...); the backward reduce-scatters."""
    return _gather_autograd(x.contiguous(), gather_dim=1, group=group)


def scatter_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """(B, T, ...) partial sums -> (B, T/tp, ...) summed; the backward all-gathers."""
    return _scatter_autograd(x.contiguous(), "sum", scatter_dim=1, group=group)


def _local(p: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local shard, its gradient returning in the parameter's placements."""
    if p is None or not isinstance(p, DTensor):
        return p
    return p.to_local(grad_placements=p.placements)


def _replicated(p: torch.Tensor | None, partial: bool) -> torch.Tensor | None:
    """A Replicate() parameter's local copy. `partial`: its input held 1/tp of the
    tokens, so each rank's gradient is a partial sum; it returns Partial, and
    reduce_partial_grads (or FSDP) sums all of them in one bucket per step, as for the
    DTensor styles' norms."""
    if not partial or p is None or not isinstance(p, DTensor):
        return _local(p)
    return p.to_local(grad_placements=[Partial() if pl.is_replicate() else pl for pl in p.placements])


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict) -> None:
    for name, placement in placements.items():
        p = getattr(module, name, None)
        if p is not None and not isinstance(p, DTensor):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p, mesh, [placement], src_data_rank=None), p.requires_grad))


def _check_linear(style, module: nn.Module) -> None:
    if type(module) is not nn.Linear:
        raise ValueError(f"{type(style).__name__} computes nn.Linear only, not {type(module).__name__}")


class LocalColwise(ColwiseParallel):
    """Column-parallel nn.Linear: the whole input as a local tensor in, this rank's
    output columns out. The input's gradient is partial over tp; GatherInput on the
    enclosing module sums it (once for every linear that shares the input)."""

    def __init__(self):
        super().__init__()

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _check_linear(self, module)
        _distribute(module, mesh, {"weight": Shard(0), "bias": Shard(0)})

        def forward(mod, x):
            return F.linear(x, _local(mod.weight), _local(mod.bias))
        module.forward = types.MethodType(forward, module)
        return module


class LocalRowwise(RowwiseParallel):
    """Row-parallel nn.Linear: this rank's input columns in, the summed output out,
    reduce-scattered over the sequence under SP, else all-reduced."""

    def __init__(self, sp: bool):
        super().__init__()
        self.sp = sp

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _check_linear(self, module)
        _distribute(module, mesh, {"weight": Shard(1), "bias": Replicate()})
        group, sp = _group(mesh), self.sp

        def forward(mod, x):
            y = F.linear(x, _local(mod.weight))
            y = scatter_seq(y, group) if sp else _AllReduce.apply(y, group)
            return y if mod.bias is None else y + _replicated(mod.bias, sp)
        module.forward = types.MethodType(forward, module)
        return module


class LocalNorm(ParallelStyle):
    """A norm on this rank's activations (its 1/tp of the sequence under SP), weights
    Replicate(); their gradients are summed over tp under SP."""

    def __init__(self, sp: bool):
        self.sp = sp

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not callable(getattr(module, "norm", None)):
            raise ValueError(f"LocalNorm needs a norm with a norm(x, weight) method, not {type(module).__name__}")
        _distribute(module, mesh, {"weight": Replicate()})
        sp = self.sp

        def forward(mod, x):
            return mod.norm(x, _replicated(mod.weight, sp))
        module.forward = types.MethodType(forward, module)
        return module


def check_comm(comm: str, device_type: str) -> None:
    """--tp-overlap-comm copy-engine moves bytes with CUDA's copy engines: refuse it elsewhere."""
    if comm == "copy-engine" and device_type != "cuda":
        raise ValueError(f"--tp-overlap-comm copy-engine moves the reduce-scatter with CUDA copy engines over "
                         f"symmetric memory: it needs CUDA, not {device_type}; leave it at nccl")


def enable_copy_engine(group: str, device_type: str) -> None:
    """Let the tp group run ce_reduce_scatter: symmetric memory on, CUDA only."""
    check_comm("copy-engine", device_type)
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    with warnings.catch_warnings():      # 2.13 warns that enabling per group is no longer needed
        warnings.simplefilter("ignore")
        enable_symm_mem_for_group(group)


def ce_copies(rank: int, tp: int, n: int) -> list[tuple[int, int, int]]:
    """ce_reduce_scatter's arithmetic on `rank` of `tp`, blocks of n elements: for each peer, in
    the order their copies are added, (peer, the offset in peer's workspace where this rank's
    block `peer` lands, the offset in this rank's workspace where peer's copy of block `rank`
    lands). Rank r writes n elements at n * r of each peer's workspace: no two copies overlap."""
    return [(peer, n * rank, n * peer) for peer in ((rank + step) % tp for step in range(1, tp))]


def ce_reduce_scatter(x: torch.Tensor, group: str):
    """Start a sum-reduce-scatter of `x` (B, T, ...) over dim 1 (rank r keeps the sum of
    every rank's x[:, r*T/tp:(r+1)*T/tp]) on a high-priority side stream: each rank pushes
    its block for every peer into that peer's symmetric-memory workspace, one cudaMemcpy
    (the copy engines, no SMs) per row of dim 0, then adds what arrived to its own block
    (one elementwise kernel). Returns (result, stream): the result is valid once the
    caller's stream has waited on `stream`; `x` must stay alive until then."""
    from torch.distributed._symmetric_memory import get_symm_mem_workspace
    if not x.is_contiguous():
        raise ValueError("ce_reduce_scatter needs a contiguous input")
    ws = get_symm_mem_workspace(group, x.numel() * x.element_size())
    rank, tp = ws.rank, ws.world_size
    blocks = x.chunk(tp, dim=1)
    shape, n = blocks[0].shape, blocks[0].numel()
    copies = ce_copies(rank, tp, n)
    stream = torch.cuda.Stream(x.device, priority=-1)   # the next of torch's pool of high-priority streams
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        ws.barrier()                     # every rank done reading its workspace from the last call
        for peer, there, _ in copies:
            dst = ws.get_buffer(peer, shape, x.dtype, there)
            for b in range(shape[0]):
                dst[b].copy_(blocks[peer][b])
        ws.barrier()                     # every peer's block has landed here
        arrived = [ws.get_buffer(rank, shape, x.dtype, here) for _, _, here in copies]
        out = blocks[rank] + arrived[0]
        for block in arrived[1:]:
            out += block
    return out, stream


def _column_backward(grads: list[torch.Tensor], x_all: torch.Tensor, weights: list[torch.Tensor],
                     group: str, tp: int, copy_engine: bool = False) -> list[torch.Tensor]:
    """[dx, dW_1, ...] of the column-parallel linears y_i = x_all W_i^T, in Megatron's order
    (LinearWithGradAccumulationAndAsyncCommunication): dx_all = sum_i g_i W_i; its
    reduce-scatter over the sequence (tp > 1) or all-reduce (tp == 1: no SP) starts;
    dW_i = g_i^T x_all run while it travels; the wait comes last. funcol's raw ops, since
    funcol's wrappers wait at once when traced. `copy_engine`: the reduce-scatter is
    ce_reduce_scatter's (SP, CUDA)."""
    g2 = [g.flatten(0, -2) for g in grads]
    dx = g2[0] @ weights[0]
    for g, w in zip(g2[1:], weights[1:]):
        dx.addmm_(g, w)
    dx = dx.view_as(x_all)
    if tp > 1 and copy_engine:
        out, stream = ce_reduce_scatter(dx, group)
        x2 = x_all.flatten(0, -2)
        dws = [g.t() @ x2 for g in g2]
        main = torch.cuda.current_stream(out.device)
        main.wait_stream(stream)
        out.record_stream(main)
        return [out, *dws]
    if tp > 1:   # each rank's sequence chunk first: the reduce-scatter splits dim 0
        chunks = dx.unflatten(1, (tp, -1)).transpose(0, 1).flatten(0, 1).contiguous()
        pending = torch.ops._c10d_functional.reduce_scatter_tensor(chunks, "sum", tp, group)
    else:
        pending = torch.ops._c10d_functional.all_reduce(dx, "sum", group)
    x2 = x_all.flatten(0, -2)
    dws = [g.t() @ x2 for g in g2]
    return [torch.ops._c10d_functional.wait_tensor(pending), *dws]


# Compiled, the same function as one opaque op: inductor's scheduler otherwise places the
# wait wherever a fusion elsewhere in the block pulls the consumers of dx, before the
# weight gradients (seen on the CPU). Eager, the plain function, whose collectives the
# dry run's dispatch mode counts.
@torch.library.custom_op("meshtron::column_backward", mutates_args=(), schema=(
    "(Tensor[] grads, Tensor x_all, Tensor[] weights, str group, int tp, bool copy_engine) -> Tensor[]"))
def _column_backward_op(grads: list[torch.Tensor], x_all: torch.Tensor, weights: list[torch.Tensor],
                        group: str, tp: int, copy_engine: bool) -> list[torch.Tensor]:
    return _column_backward(grads, x_all, weights, group, tp, copy_engine)


@_column_backward_op.register_fake
def _(grads, x_all, weights, group, tp, copy_engine):
    dx = x_all.new_empty(x_all.shape[0], x_all.shape[1] // tp, *x_all.shape[2:])
    return [dx, *(w.new_empty(w.shape) for w in weights)]


class _GatherLinears(torch.autograd.Function):
    """x -> [F.linear(x_all, W_i, b_i)], x_all all-gathered over the sequence (SP) or x
    itself; the backward is _column_backward's. x_all is saved, as the separate linears
    saved it (re-gathering it in backward would add an all-gather to the step)."""

    @staticmethod
    def forward(ctx, x, group, sp, copy_engine, *params):
        weights, biases = params[:len(params) // 2], params[len(params) // 2:]
        x_all = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 1, group)) if sp else x
        ctx.save_for_backward(x_all, *weights)
        ctx.group, ctx.tp, ctx.copy_engine = group, x_all.shape[1] // x.shape[1], copy_engine
        ctx.biases = [b is not None for b in biases]
        return tuple(F.linear(x_all, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x_all, *weights = ctx.saved_tensors
        column_backward = _column_backward_op if torch.compiler.is_compiling() else _column_backward
        dx, *dws = column_backward([g.contiguous() for g in grads], x_all, weights, ctx.group, ctx.tp,
                                   ctx.copy_engine)
        dbs = [g.flatten(0, -2).sum(0) if has else None for g, has in zip(grads, ctx.biases)]
        dws = [dw if need else None for dw, need in zip(dws, ctx.needs_input_grad[4:])]
        return (dx, None, None, None, *dws, *dbs)


class GatherLinears(ParallelStyle):
    """On a module whose `in_proj(x)` returns its column-parallel linears `names` applied
    to x, in that order: in_proj becomes one _GatherLinears call on the module's input
    (this rank's 1/tp of the sequence under SP), which all-gathers it once for all of
    them and hides the backward's reduce-scatter (all-reduce without SP) behind their
    weight gradients. The linears keep LocalColwise's placements; their weights and
    biases are read through `to_local` as there, so their gradients return as DTensors.
    `comm`: "nccl" (funcol's collective) or "copy-engine" (ce_reduce_scatter; SP on CUDA)."""

    def __init__(self, sp: bool, names: tuple[str, ...], comm: str = "nccl"):
        if comm not in ("nccl", "copy-engine"):
            raise ValueError(f"GatherLinears: comm is nccl or copy-engine, not {comm!r}")
        if comm == "copy-engine" and not sp:
            raise ValueError("--tp-overlap-comm copy-engine replaces sequence parallelism's reduce-scatter: "
                             "it needs --sp")
        self.sp, self.names, self.comm = sp, names, comm

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not callable(getattr(module, "in_proj", None)):
            raise ValueError(f"GatherLinears needs a module with an in_proj(x) method, not {type(module).__name__}")
        linears = [getattr(module, n) for n in self.names]
        for linear in linears:
            _check_linear(self, linear)
        group, sp, copy_engine = _group(mesh), self.sp, self.comm == "copy-engine"
        if copy_engine:
            enable_copy_engine(group, mesh.device_type)

        def in_proj(mod, x):
            params = [_local(m.weight) for m in linears] + [_local(m.bias) for m in linears]
            return _GatherLinears.apply(x, group, sp, copy_engine, *params)
        module.in_proj = types.MethodType(in_proj, module)
        return module


class GatherInput(ParallelStyle):
    """On a module whose column-parallel linears share its first input: all-gather
    that input over the sequence (SP), or only sum its gradient over tp (no SP)."""

    def __init__(self, sp: bool):
        self.sp = sp

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group, sp = _group(mesh), self.sp

        def pre(mod, args):
            x = gather_seq(args[0], group) if sp else _AllReduceBackward.apply(args[0], group)
            return (x, *args[1:])
        module.register_forward_pre_hook(pre)
        return module
