"""Sequence parallelism's collectives cut into one piece per tp rank, each piece moving
while a matmul runs (--tp-overlap-comm chunked): the decomposition of torch's
fused_all_gather_matmul and fused_matmul_reduce_scatter, on funcol's collectives.

On p = tp ranks, x_r rank r's 1/p of the sequence, forward:

  gather + column-parallel  Y_i = [x_0; ...; x_{p-1}] W_i^T, for the linears i sharing x:
                            this rank's own piece first; x_{r+s+1}'s transfer starts before
                            x_{r+s}'s matmuls and is waited after them (`gather_each`)
  row-parallel + scatter    y_r = sum_q X^q[r] W^q^T (X^q[r]: rank q's input, rank r's rows):
                            the partial sum for rank r-s is computed and sent, the next one
                            computed while it travels, this rank's own last, then the sum
                            (`scatter_each`)

Backward, each is the other (the conjugates): the column-parallel input gradient is a
matmul + scatter, with the weights' gradients (from the saved gathered input) computed
beside its last transfers; the row-parallel output gradient a gather + matmul, the input
gradient piece by piece, the weight's from the gathered gradient. A piece moves in one
all_to_all_single over tp in which each rank sends one block to one peer (`_shift`):
p - 1 of them replace an all-gather or a reduce-scatter and move its bytes
(meshtron.planner.comm_model counts them).

FP8 (torchao's Float8Linear, tensorwise scales): each operand is cast with the scale of
the whole tensor it is a piece of (its absolute maximum over the tp ranks: one all-reduce
of the stacked maxima per call and direction), so every piece rounds as the unchunked
operand does; pieces move in the compute dtype. Rowwise scales are refused (config.py).

Compiled blocks call these eagerly (a graph break each): no compiler pass can then move a
wait ahead of the matmul it hides behind.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from meshtron.distributed.local_tensor_parallel import _distribute, _group, _local, _replicated

_funcol = torch.ops._c10d_functional


def chunked(parallel) -> bool:
    """--tp-overlap-comm chunked is on for a ParallelConfig (config.py refuses it without
    --tp-overlap and --sp)."""
    return parallel.tp_overlap and parallel.tp_overlap_comm == "chunked"


def _shift(t: torch.Tensor, s: int, rank: int, tp: int, group: str) -> torch.Tensor:
    """Start sending t to rank - s and receiving its like from rank + s (mod tp); returns
    the pending receive (flat)."""
    n = t.numel()
    send = [n if q == (rank - s) % tp else 0 for q in range(tp)]
    recv = [n if q == (rank + s) % tp else 0 for q in range(tp)]
    return _funcol.all_to_all_single(t.contiguous().view(-1), recv, send, group)


def _wait(pending: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return _funcol.wait_tensor(pending).view(like.shape)


def gather_each(x: torch.Tensor, consume, rank: int, tp: int, group: str) -> None:
    """consume(q, x_q) for every rank q's x_q (x: this rank's), this rank's first; each
    next piece's transfer starts before consume runs on the current one and is waited after."""
    pending = _shift(x, 1, rank, tp, group) if tp > 1 else None
    consume(rank, x)
    for s in range(1, tp):
        got = _wait(pending, x)
        pending = _shift(x, s + 1, rank, tp, group) if s + 1 < tp else None
        consume((rank + s) % tp, got)


def scatter_each(produce, rank: int, tp: int, group: str, beside=lambda: None):
    """(sum over ranks q of q's produce(rank), beside()): produce(q) for each other rank q
    is sent to q once computed and travels while the next is computed; this rank's own
    comes last, then beside(), then the waits."""
    pending = [_shift(produce((rank - s) % tp), s, rank, tp, group) for s in range(1, tp)]
    out, extra = produce(rank), beside()
    for p in pending:
        out = out + _wait(p, out)
    return out, extra


# ---- FP8: torchao's operands, each scaled as the whole tensor it is a piece of ---------------------------

def fp8_of(module: nn.Module):
    """A Float8Linear with tensorwise scales, or None for an nn.Linear; anything else is refused."""
    if type(module) is nn.Linear:
        return None
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear
    if type(module) is not Float8Linear:
        raise ValueError(f"the chunked TP styles compute nn.Linear and Float8Linear, not {type(module).__name__}")
    c = module.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
    if any(k.scaling_type is not ScalingType.DYNAMIC or k.scaling_granularity is not ScalingGranularity.TENSORWISE
           for k in casts) or (c.cast_config_input_for_grad_weight, c.cast_config_weight_for_grad_input,
                               c.cast_config_grad_output_for_grad_weight) != casts:
        raise ValueError("--tp-overlap-comm chunked takes FP8's tensorwise scales only (--fp8 tensorwise)")
    return module


def _dtype(f, role: str) -> torch.dtype:
    c = f.config
    return {"input": c.cast_config_input, "weight": c.cast_config_weight,
            "grad_output": c.cast_config_grad_output}[role].target_dtype


def _precast(t: torch.Tensor) -> bool:
    """A weight FSDP gathered in fp8 (its scale already the whole weight's)."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor
    return isinstance(t, Float8TrainingTensor)


def _scales(items, group: str) -> list:
    """torchao's scale of each (f, role, tensor) whose pieces the tp ranks hold, from the
    maximum over all of them: one all-reduce of the stacked maxima. None where f is None."""
    wanted = [(f, role, t) for f, role, t in items if f is not None and not _precast(t)]
    if not wanted:
        return [None] * len(items)
    from torchao.float8.float8_utils import amax_to_scale
    amax = torch.stack([t.detach().abs().max().float() for _, _, t in wanted])
    amax = _funcol.wait_tensor(_funcol.all_reduce(amax, "max", group))
    found = iter(amax_to_scale(a, _dtype(f, role), f.config.round_scales_to_power_of_2)
                 for a, (f, role, _) in zip(amax, wanted))
    return [next(found) if f is not None and not _precast(t) else None for f, _, t in items]


def _cast(t: torch.Tensor, f, role: str, scale) -> torch.Tensor:
    """t as f's fp8 operand in `role` (input, weight, grad_output); t itself without FP8."""
    if f is None or _precast(t):
        return t
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    return hp_tensor_and_scale_to_float8(t, scale, _dtype(f, role), f.linear_mm_config, GemmInputRole(role))


def _rows(t: torch.Tensor, q: int, tp: int) -> torch.Tensor:
    """Rank q's piece of t's sequence (dim 1), as (tokens, features)."""
    n = t.shape[1] // tp
    return t[:, q * n:(q + 1) * n].reshape(-1, t.shape[-1])


# ---- the two operators ----------------------------------------------------------------------------------

class _GatherMatmuls(torch.autograd.Function):
    """x (B, T/p, K) -> [F.linear(x_all, W_i, b_i)], x_all (B, T, K) gathered piece by piece."""

    @staticmethod
    def forward(ctx, x, group, rank, tp, fp8s, *params):
        weights, biases = params[:len(fp8s)], params[len(fp8s):]
        scales = _scales([(f, "input", x) for f in fp8s] + [(f, "weight", w) for f, w in zip(fp8s, weights)], group)
        sx, sw = scales[:len(fp8s)], scales[len(fp8s):]
        wts = [_cast(w, f, "weight", s).t() for f, w, s in zip(fp8s, weights, sw)]
        pieces, outs = [None] * tp, [[None] * tp for _ in weights]

        def consume(q, xq):
            pieces[q], x2 = xq, xq.reshape(-1, xq.shape[-1])
            for i, (f, wt, b, s) in enumerate(zip(fp8s, wts, biases, sx)):
                y = torch.mm(_cast(x2, f, "input", s), wt)
                outs[i][q] = (y if b is None else y + b.to(y.dtype)).view(*xq.shape[:-1], -1)
        gather_each(x, consume, rank, tp, group)
        x_all = torch.cat(pieces, dim=1)
        ctx.save_for_backward(x_all, *weights)
        ctx.group, ctx.rank, ctx.tp, ctx.fp8s, ctx.sx, ctx.sw = group, rank, tp, fp8s, sx, sw
        ctx.biases = [b is not None for b in biases]
        return tuple(torch.cat(o, dim=1) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        x_all, *weights = ctx.saved_tensors
        fp8s, tp = ctx.fp8s, ctx.tp
        sg = _scales([(f, "grad_output", g) for f, g in zip(fp8s, grads)], ctx.group)
        ws = [_cast(w, f, "weight", s) for f, w, s in zip(fp8s, weights, ctx.sw)]
        B, T, K = x_all.shape

        def produce(q):   # rank q's rows of this rank's partial input gradient
            parts = [torch.mm(_cast(_rows(g, q, tp), f, "grad_output", s), w)
                     for f, g, s, w in zip(fp8s, grads, sg, ws)]
            return sum(parts[1:], parts[0]).view(B, T // tp, K)

        def weight_grads():
            x2 = x_all.reshape(-1, K)
            return [torch.mm(_cast(g.reshape(-1, g.shape[-1]), f, "grad_output", s).t(), _cast(x2, f, "input", s2))
                    for f, g, s, s2 in zip(fp8s, grads, sg, ctx.sx)]
        dx, dws = scatter_each(produce, ctx.rank, tp, ctx.group, weight_grads)
        dbs = [g.reshape(-1, g.shape[-1]).sum(0) if has else None for g, has in zip(grads, ctx.biases)]
        return (dx, None, None, None, None, *dws, *dbs)


class _MatmulScatter(torch.autograd.Function):
    """x (B, T, K/p) -> the sum over the ranks of x W^T, each rank's T/p rows, scattered piece by piece."""

    @staticmethod
    def forward(ctx, x, weight, group, rank, tp, f):
        sx, sw = _scales([(f, "input", x), (f, "weight", weight)], group)
        wt = _cast(weight, f, "weight", sw).t()
        B, T, _ = x.shape
        y, _ = scatter_each(lambda q: torch.mm(_cast(_rows(x, q, tp), f, "input", sx), wt).view(B, T // tp, -1),
                            rank, tp, group)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.rank, ctx.tp, ctx.f, ctx.sx, ctx.sw = group, rank, tp, f, sx, sw
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        f, tp = ctx.f, ctx.tp
        (sg,) = _scales([(f, "grad_output", g)], ctx.group)
        w = _cast(weight, f, "weight", ctx.sw)
        pieces, dxs = [None] * tp, [None] * tp

        def consume(q, gq):   # rank q's rows of the output gradient: their rows of the input gradient
            pieces[q] = gq
            dxs[q] = torch.mm(_cast(gq.reshape(-1, gq.shape[-1]), f, "grad_output", sg), w).view(*gq.shape[:-1], -1)
        gather_each(g, consume, ctx.rank, tp, ctx.group)
        g_all = torch.cat(pieces, dim=1)
        dw = torch.mm(_cast(g_all.reshape(-1, g.shape[-1]), f, "grad_output", sg).t(),
                      _cast(x.reshape(-1, x.shape[-1]), f, "input", ctx.sx))
        return torch.cat(dxs, dim=1), dw, None, None, None, None


# ---- the styles ------------------------------------------------------------------------------------------

class ChunkedColumn(ParallelStyle):
    """On a module whose `in_proj(x)` returns its column-parallel linears `names` applied to
    x (this rank's 1/tp of the sequence): in_proj becomes one _GatherMatmuls call. The
    linears take LocalColwise's placements (weight and bias Shard(0)) and are read through
    `to_local`, their gradients returning as DTensors."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not callable(getattr(module, "in_proj", None)):
            raise ValueError(f"ChunkedColumn needs a module with an in_proj(x) method, not {type(module).__name__}")
        linears = [getattr(module, n) for n in self.names]
        fp8s = [fp8_of(m) for m in linears]
        for m in linears:
            _distribute(m, mesh, {"weight": Shard(0), "bias": Shard(0)})
        group, rank, tp = _group(mesh), mesh.get_local_rank(), mesh.size()

        @torch.compiler.disable
        def in_proj(mod, x):
            params = [_local(m.weight) for m in linears] + [_local(m.bias) for m in linears]
            return _GatherMatmuls.apply(x, group, rank, tp, fp8s, *params)
        module.in_proj = types.MethodType(in_proj, module)
        return module


class ChunkedRow(ParallelStyle):
    """Row-parallel nn.Linear (or Float8Linear): this rank's input columns of the whole
    sequence in, the summed output's 1/tp of the sequence out (_MatmulScatter); weight
    Shard(1), bias Replicate() added after the sum, its gradient a partial sum as under SP."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        f = fp8_of(module)
        _distribute(module, mesh, {"weight": Shard(1), "bias": Replicate()})
        group, rank, tp = _group(mesh), mesh.get_local_rank(), mesh.size()

        @torch.compiler.disable
        def forward(mod, x):
            y = _MatmulScatter.apply(x, _local(mod.weight), group, rank, tp, f)
            return y if mod.bias is None else y + _replicated(mod.bias, True)
        module.forward = types.MethodType(forward, module)
        return module
