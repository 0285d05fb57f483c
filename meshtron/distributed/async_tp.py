"""Async tensor parallelism: SP's collectives overlapped with the matmuls next to them.

Under sequence parallelism each column-parallel linear waits for an all-gather
of its (B, T/p, d) input and each row-parallel linear's output waits for a
reduce-scatter; backward mirrors both. Megatron hides them by decomposing the
collective into p - 1 ring steps and computing on the chunk already here while
the next one travels:

  all-gather-matmul      y[:, chunk k] = x_k W^T, k = r, r-1, ..., while x_{k-1} arrives
  matmul-reduce-scatter  the partial sum of chunk k travels r -> r+1 and each rank
                         adds its own x[:, k] W^T, computed while the previous hop moves

Compiled (CUDA): inductor's micro-pipeline TP pass finds the same patterns in
each block's graph and swaps in torch's symmetric-memory fused ops
(fused_all_gather_matmul / fused_matmul_reduce_scatter). They copy over NVLink
peer-to-peer, not multicast, so they run where multicast is disabled.

Eager (any backend, the CPU's gloo included): the two ring decompositions below,
as autograd Functions on the tp group's send/recv, plugged into the model by
two styles: `GatherMatmul` on the module that receives the sequence-sharded
input (it gathers once and runs every column-parallel child's matmul in the
same ring) and `MatmulScatter` on each row-parallel linear.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.overrides import TorchFunctionMode


def compile_options(parallel) -> dict | None:
    """The inductor options of each block's torch.compile: with --async-tp, the
    micro-pipeline TP pass. Per compile, not inductor's process-wide config: set
    there it would reach every later compile in the process, the plain layouts' too."""
    return {"_micro_pipeline_tp": True} if parallel.async_tp and parallel.compile else None


def enable_compiled(tp_mesh: DeviceMesh) -> None:
    """Let the tp group run torch's symmetric-memory fused ops (the blocks' compile
    options turn on the pass that uses them)."""
    if tp_mesh.device_type != "cuda":
        raise ValueError("--async-tp with --compile uses torch's symmetric-memory ops, which need CUDA; "
                         "leave out --compile for the decomposed eager path")
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    with warnings.catch_warnings():      # 2.13 warns that enabling per group is no longer needed
        warnings.simplefilter("ignore")
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


# ---- the ring decompositions (eager) ---------------------------------------------

def _ring(group) -> tuple[int, int, int, int]:
    """(rank in the group, group size, global rank of the next rank, of the previous one)."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    return r, p, dist.get_global_rank(group, (r + 1) % p), dist.get_global_rank(group, (r - 1) % p)


def _pass_on(send: torch.Tensor, group, nxt: int, prev: int):
    """Start sending `send` to the next rank and receiving the previous rank's like it."""
    recv = torch.empty_like(send)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                    dist.P2POp(dist.irecv, recv, prev, group)])
    return recv, works


def gather_compute(shard: torch.Tensor, group, compute) -> tuple[list, list]:
    """All-gather `shard` over the group in p - 1 ring steps, calling compute(chunk)
    on each chunk while the next one travels. Returns the chunks and compute's
    results, both in rank order."""
    r, p, nxt, prev = _ring(group)
    chunks, outs = [None] * p, [None] * p
    cur, k = shard.contiguous(), r
    for step in range(p):
        if step < p - 1:
            recv, works = _pass_on(cur, group, nxt, prev)
        chunks[k], outs[k] = cur, compute(cur)
        if step < p - 1:
            for w in works:
                w.wait()
            cur, k = recv, (k - 1) % p
    return chunks, outs


def compute_scatter(partial_of, group) -> torch.Tensor:
    """Reduce-scatter in p - 1 ring steps: rank r ends with the sum over ranks of
    partial_of(r). The running sum of chunk k travels r -> r+1, and each rank
    computes its own partial_of(k) while the sum is on its way."""
    r, p, nxt, prev = _ring(group)
    acc = partial_of((r - 1) % p).contiguous()
    for step in range(1, p):
        recv, works = _pass_on(acc, group, nxt, prev)
        mine = partial_of((r - step - 1) % p)
        for w in works:
            w.wait()
        acc = recv + mine
    return acc


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _GatherMatmul(torch.autograd.Function):
    """(x_full, x_full W_1^T, ...) from x sharded on the sequence (dim 1); backward
    reduce-scatters dx the same way, chunk by chunk."""

    @staticmethod
    def forward(ctx, group, x_shard, *weights):
        chunks, outs = gather_compute(x_shard, group, lambda c: [F.linear(c, w) for w in weights])
        x_full = torch.cat(chunks, 1)
        ctx.group, ctx.chunk = group, x_shard.shape[1]
        ctx.save_for_backward(x_full, *weights)
        return (x_full, *(torch.cat([o[i] for o in outs], 1) for i in range(len(weights))))

    @staticmethod
    def backward(ctx, g_x_full, *g_ys):
        x_full, *weights = ctx.saved_tensors
        c = ctx.chunk

        def partial_of(k):
            part = sum(g.narrow(1, k * c, c) @ w for g, w in zip(g_ys, weights))
            return part if g_x_full is None else part + g_x_full.narrow(1, k * c, c)
        g_x = compute_scatter(partial_of, ctx.group)
        g_ws = [_rows(g).t() @ _rows(x_full) for g in g_ys]
        return None, g_x, *g_ws


class _MatmulScatter(torch.autograd.Function):
    """x W^T (x: (B, T, in/p), W: (d, in/p)) reduce-scattered onto the sequence;
    backward all-gathers the output gradient the same way, chunk by chunk."""

    @staticmethod
    def forward(ctx, group, x, weight):
        c = x.shape[1] // dist.get_world_size(group)
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return compute_scatter(lambda k: F.linear(x.narrow(1, k * c, c), weight), group)

    @staticmethod
    def backward(ctx, g_y):
        x, weight = ctx.saved_tensors
        chunks, g_xs = gather_compute(g_y, ctx.group, lambda g: g @ weight)
        return None, torch.cat(g_xs, 1), _rows(torch.cat(chunks, 1)).t() @ _rows(x)


def all_gather_matmul(x_shard: torch.Tensor, weights: list[torch.Tensor], group) -> tuple:
    """Local tensors: (x gathered over the group on dim 1, then x_full W^T for each W)."""
    return _GatherMatmul.apply(group, x_shard, *weights)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """Local tensors: x W^T summed over the group and split on dim 1."""
    return _MatmulScatter.apply(group, x, weight)


# ---- the styles that put them in a model (eager) -----------------------------------

_COLWISE = {"weight": (Shard(0),), "bias": (Shard(0),)}
_ROWWISE = {"weight": (Shard(1),), "bias": (Partial(),)}   # the bias is added to each rank's tokens


class _Linears(TorchFunctionMode):
    """Hands the module's F.linear calls on its own weight to module._linear."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) > 1 and args[1] is self.module.weight:
            return self.module._linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
        return func(*args, **kwargs)


def _run_locally(cls: type, grad_placements: dict, linear) -> type:
    """A subclass of the linear's class whose forward runs on the local shards of its
    parameters (their gradients go back as `grad_placements` say), with its matmul
    done by linear(module, x, w, b)."""
    def forward(self, *args, **kwargs):
        params = dict(self._parameters)
        for name, p in params.items():
            if isinstance(p, DTensor):
                self._parameters[name] = p.to_local(grad_placements=grad_placements[name])
        try:
            with _Linears(self):
                return cls.forward(self, *args, **kwargs)
        finally:
            self._parameters.update(params)
    return type(f"Async{cls.__name__}", (cls,), {"forward": forward, "_linear": linear})


def _stashed_or_plain(module, x, w, b):
    """The matmul the parent's ring already did on this input, or a plain one."""
    stash, module._async_tp_stash = getattr(module, "_async_tp_stash", None), None
    y = stash[1] if stash is not None and x is stash[0] else F.linear(x, w)
    return y if b is None else y + b


class GatherMatmul(ParallelStyle):
    """On a module whose input x is sharded on the sequence (dim 1) and whose
    `children` are column-parallel linears of it (q, k, v; the MLP's up
    projections): one ring all-gathers x while every child's matmul runs on the
    chunks already here; the module then sees the gathered x, and each child
    returns its share of the ring's result."""

    def __init__(self, children: list[str]):
        super().__init__()
        self.children = list(children)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        colwise = ColwiseParallel()
        colwise.src_data_rank = getattr(self, "src_data_rank", None)
        linears = [module.get_submodule(c) for c in self.children]
        for lin in linears:
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"--async-tp: {type(lin).__name__} is not an nn.Linear")
            distribute_module(lin, mesh, colwise._partition_linear_fn)
            lin.__class__ = _run_locally(type(lin), _COLWISE, _stashed_or_plain)
        group = mesh.get_group()

        def pre(mod, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.to_local(grad_placements=x.placements)
            ws = [lin.weight.to_local(grad_placements=_COLWISE["weight"]) for lin in linears]
            x_full, *ys = all_gather_matmul(x, ws, group)
            for lin, y in zip(linears, ys):
                lin._async_tp_stash = (x_full, y)
            return (x_full, *args[1:])
        module.register_forward_pre_hook(pre)
        return module


class MatmulScatter(RowwiseParallel):
    """A row-parallel linear whose output is reduce-scattered onto the sequence
    (dim 1), each chunk's partial sum on its way while the next is computed."""

    def __init__(self):
        super().__init__(output_layouts=Shard(1))

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"--async-tp: {type(module).__name__} is not an nn.Linear")
        distribute_module(module, mesh, self._partition_linear_fn)
        group = mesh.get_group()

        def linear(mod, x, w, b):
            y = matmul_reduce_scatter(x, w, group)
            return y if b is None else y + b
        module.__class__ = _run_locally(type(module), _ROWWISE, linear)
        return module


def _gathers(style) -> bool:
    return isinstance(style, PrepareModuleInput) and style.input_layouts[:1] == (Shard(1),) \
        and style.desired_input_layouts[:1] == (Replicate(),)


def apply(plan: dict, tp_mesh: DeviceMesh, parallel) -> dict:
    """The TP plan with SP's collectives overlapped when --async-tp asks for it:
    compiled, by inductor; eager, each sequence all-gather feeding column-parallel
    linears becomes a GatherMatmul and each row-parallel linear reduce-scattering
    onto the sequence a MatmulScatter. Everything else is left as it is."""
    if not parallel.async_tp:
        return plan
    if parallel.compile:
        enable_compiled(tp_mesh)
        return plan
    parents = {k for k, s in plan.items() if _gathers(s)}
    out = {}
    for key, style in plan.items():
        parent, _, child = key.rpartition(".")
        if parent in parents and type(style) is ColwiseParallel:
            continue
        if key in parents:
            out[key] = GatherMatmul([k.rpartition(".")[2] for k, s in plan.items()
                                     if k.rpartition(".")[0] == key and type(s) is ColwiseParallel])
        elif type(style) is RowwiseParallel and style.input_layouts == (Shard(-1),) \
                and style.output_layouts == (Shard(1),):
            out[key] = MatmulScatter()
        else:
            out[key] = style
    return out
