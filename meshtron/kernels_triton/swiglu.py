"""SwiGLU's product (Llama's feed-forward), forward and backward in Triton.

    y = silu(gate) * up,    silu(g) = g * sigmoid(g)      (computed in fp32)

Backward, with s = sigmoid(gate):
    dup   = dy * gate * s
    dgate = dy * up * s * (1 + gate * (1 - s))

Elementwise: a program takes a BLOCK of the flattened tensors. Forward reads gate
and up and writes y (3 x elements x itemsize bytes); backward recomputes s from
the saved gate and up (y is not saved), reads dy, gate and up and writes dgate
and dup (5 x elements x itemsize). gate and up are the activations autograd keeps
for w1 and w3's own backward anyway, so the recompute costs no extra memory.

Communication: none. gate and up carry the same placements (w1 and w3 are
sharded alike), so any sharding works and y comes back with those placements.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import HAVE_TRITON, as_rows, dtensor_locals, interpreting, is_dtensor, new_empty, tl, triton, use_triton

# --------------------------------------------------------------------------- kernels
if HAVE_TRITON:

    @triton.jit
    def _swiglu_fwd_kernel(G, U, Y, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(ACC)
        u = tl.load(U + offs, mask=mask, other=0.0).to(ACC)
        # exp(-g) overflows to inf for g << 0: g / inf = -0, the limit, not NaN
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
        g = tl.load(G + offs, mask=mask, other=0.0).to(ACC)
        u = tl.load(U + offs, mask=mask, other=0.0).to(ACC)
        s = 1.0 / (1.0 + tl.exp(-g))    # s -> 0 for g << 0, and silu' -> 0 with it
        silu = g * s
        tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + offs, (dy * u * (s + silu * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- configs
def fwd_config(numel: int) -> tuple[int, int]:
    """(BLOCK elements a program, num_warps) of the forward.

    GPU: 16 elements a thread (two 16-byte loads of bf16 per input), a common
    choice for bandwidth-bound elementwise kernels; not swept on a GPU yet
    (``benchmarks/bench_kernels.py --sweep --only swiglu`` times the alternatives).
    """
    if interpreting():  # few large programs: the interpreter pays per program and per op
        return min(65536, triton.next_power_of_2(max(numel, 1))), 4
    return 2048, 4


def bwd_config(numel: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the backward (three inputs, two outputs: as the forward)."""
    return fwd_config(numel)


def _acc(*dtypes) -> tl.dtype:
    return tl.float64 if torch.float64 in dtypes else tl.float32


def swiglu_fwd_flat(g: Tensor, u: Tensor, out_dtype: torch.dtype,
                    block: int | None = None, num_warps: int | None = None) -> Tensor:
    """Triton forward on contiguous tensors of the same shape: y of that shape."""
    y = new_empty(g.shape, out_dtype, g.device)
    n = g.numel()
    if n == 0:
        return y
    bl, nw = fwd_config(n)
    bl, nw = block or bl, num_warps or nw
    _swiglu_fwd_kernel[(triton.cdiv(n, bl),)](g, u, y, n, ACC=_acc(g.dtype, u.dtype, out_dtype),
                                              BLOCK=bl, num_warps=nw)
    return y


def swiglu_bwd_flat(dy: Tensor, g: Tensor, u: Tensor,
                    block: int | None = None, num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """Triton backward on contiguous tensors of the same shape: dgate, dup in gate's and up's dtypes."""
    dg = new_empty(g.shape, g.dtype, g.device)
    du = new_empty(u.shape, u.dtype, u.device)
    n = g.numel()
    if n == 0:
        return dg, du
    bl, nw = bwd_config(n)
    bl, nw = block or bl, num_warps or nw
    _swiglu_bwd_kernel[(triton.cdiv(n, bl),)](dy, g, u, dg, du, n, ACC=_acc(dy.dtype, g.dtype, u.dtype),
                                              BLOCK=bl, num_warps=nw)
    return dg, du


# --------------------------------------------------------------------------- autograd
# Eager calls use a plain autograd.Function (little Python); torch.compile sees the
# custom ops below instead and keeps them whole.
def _fwd(gate: Tensor, up: Tensor) -> Tensor:
    y = swiglu_fwd_flat(as_rows(gate), as_rows(up), torch.result_type(gate, up))
    return y.view(gate.shape)


def _bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    dg, du = swiglu_bwd_flat(as_rows(dy), as_rows(gate), as_rows(up))
    return dg.view(gate.shape), du.view(up.shape)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = _bwd(dy, gate, up)
        return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None)


@torch.library.custom_op("meshtron::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return _fwd(gate, up)


@_swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty(gate.shape, dtype=torch.result_type(gate, up), device=gate.device)


@torch.library.custom_op("meshtron::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return _bwd(dy, gate, up)


@_swiglu_bwd.register_fake
def _(dy, gate, up):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


def _sw_setup_context(ctx, inputs, output):
    gate, up = inputs
    ctx.save_for_backward(gate, up)


def _sw_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.meshtron.swiglu_bwd(dy, gate, up)
    return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None)


_swiglu_fwd.register_autograd(_sw_backward, setup_context=_sw_setup_context)


# --------------------------------------------------------------------------- public API
def _locals(gate, up):
    """Local shards of a DTensor pair (same mesh, placements and shape), and the wrap for y."""
    if is_dtensor(gate) != is_dtensor(up):
        raise ValueError("swiglu: gate and up must both be DTensors or both plain tensors, got "
                         f"{type(gate).__name__} and {type(up).__name__}")
    if not is_dtensor(gate):
        return gate, up, lambda y: y
    if gate.device_mesh != up.device_mesh or tuple(gate.placements) != tuple(up.placements):
        raise ValueError("swiglu: gate and up must have the same mesh and placements, got "
                         f"{tuple(gate.placements)} and {tuple(up.placements)}")
    # Elementwise: every placement but Partial works, so treat gate's last dim like
    # bias-GeLU's (shardable); dtensor_locals rejects Partial.
    g_l, _, wrap = dtensor_locals(gate, (), param_follows_hidden=True)
    u_l = up.to_local(grad_placements=tuple(up.placements))
    return g_l, u_l, wrap


def swiglu(gate: Tensor, up: Tensor, impl: str = "auto") -> Tensor:
    """``silu(gate) * up``, elementwise; gate and up of the same shape (no broadcasting).

    ``impl``: "auto" (Triton on CUDA, else ``F.silu(gate) * up``), "triton", "torch".
    DTensor: gate and up with the same placements (any but Partial); y has them too.
    """
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    g_l, u_l, wrap = _locals(gate, up)
    if use_triton(g_l, impl) and g_l.dim() > 0:
        if torch.compiler.is_compiling():
            y = torch.ops.meshtron.swiglu_fwd(g_l, u_l)
        else:
            y = _SwiGLUFunction.apply(g_l, u_l)
    else:
        y = F.silu(g_l) * u_l
    return wrap(y)

