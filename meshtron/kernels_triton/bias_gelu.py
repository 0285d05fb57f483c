"""Fused bias + GeLU, forward and backward in Triton (Megatron's ``bias_gelu``).

    y = gelu(x + b)
    tanh form:  gelu(z) = 0.5 z (1 + tanh(k (z + 0.044715 z^3))) = z * sigmoid(2k (z + 0.044715 z^3)),
                k = sqrt(2 / pi)
    erf form:   gelu(z) = 0.5 z (1 + erf(z / sqrt(2)))

Forward: reads x and b once, writes y once; a program takes a BLOCK_M x BLOCK_N tile.
Backward: recomputes z = x + b, writes dx = dy * gelu'(z), and the bias gradient
db = sum_rows(dx) comes out of the same pass: each program walks a column block
down a share of the rows, keeps the column sums in fp32 registers and writes one
partial row; a tiny second kernel sums the (splits x H) partials. Bytes: x and
dy read, dx written. Only x and b are saved for the backward, not y.

Communication: none. Under column parallelism (x ``Shard(-1)``, b ``Shard(0)``)
every rank owns its columns; when rows are sharded, db is a partial sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import (
    HAVE_TRITON,
    as_rows,
    dtensor_locals,
    interpreting,
    new_empty,
    num_sms,
    sum_partials,
    tl,
    triton,
    use_triton,
)

APPROXIMATIONS = ("tanh", "none")


# --------------------------------------------------------------------------- kernels
if HAVE_TRITON:

    @triton.jit
    def _gelu(z, TANH: tl.constexpr):
        if TANH:
            # z * sigmoid(2u), 2u = 2k z + 2k 0.044715 z^3: one exp and one divide.
            return z / (1.0 + tl.exp(-z * (1.5957691216057308 + 0.07135481627260025 * z * z)))
        else:
            return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))

    @triton.jit
    def _gelu_grad(z, TANH: tl.constexpr):
        if TANH:
            s = 1.0 / (1.0 + tl.exp(-z * (1.5957691216057308 + 0.07135481627260025 * z * z)))
            return s + z * s * (1.0 - s) * (1.5957691216057308 + 0.21406444881780076 * z * z)
        else:
            return (0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
                    + z * tl.exp(-0.5 * z * z) * 0.3989422804014327)

    @triton.jit
    def _bias_gelu_fwd_kernel(X, B, Y, n_rows, N, n_col_blocks, ACC: tl.constexpr,
                              TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        rb = pid // n_col_blocks
        cb = pid % n_col_blocks
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        mask = (rows < n_rows)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        b = tl.load(B + cols, mask=cmask, other=0.0).to(ACC)
        z = tl.load(X + offs, mask=mask, other=0.0).to(ACC) + b[None, :]
        tl.store(Y + offs, _gelu(z, TANH).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd_kernel(X, B, DY, DX, DB_part, n_rows, N, n_col_blocks,
                              TANH: tl.constexpr, NEED_DB: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        ACC = DB_part.dtype.element_ty    # fp32, or fp64 for fp64 inputs (gradcheck)
        pid = tl.program_id(0)
        split = pid // n_col_blocks
        cb = pid % n_col_blocks
        n_splits = tl.num_programs(0) // n_col_blocks
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        b = tl.load(B + cols, mask=cmask, other=0.0).to(ACC)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for rb in range(split, tl.cdiv(n_rows, BLOCK_M), n_splits):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = (rows < n_rows)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            z = tl.load(X + offs, mask=mask, other=0.0).to(ACC) + b[None, :]
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
            dx = dy * _gelu_grad(z, TANH)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            if NEED_DB:
                acc += dx   # dy is 0 on masked elements, so dx is too
        if NEED_DB:
            tl.store(DB_part + split * N + cols, tl.sum(acc, axis=0), mask=cmask)


# --------------------------------------------------------------------------- configs
def fwd_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the forward, by hidden size."""
    block_n = min(1024, triton.next_power_of_2(n))
    if interpreting():  # few large programs (the interpreter pays per program and per op)
        return max(1, 65536 // block_n), block_n, 4
    block_m = max(1, 4096 // block_n)
    return block_m, block_n, 4


def bwd_config(n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per SM) of the backward, by hidden size."""
    block_n = min(1024, triton.next_power_of_2(n))
    if interpreting():
        return max(1, 16384 // block_n), block_n, 4, 2
    block_m = max(1, 2048 // block_n)
    return block_m, block_n, 4, 8


def bias_gelu_fwd_rows(x2d: Tensor, bias: Tensor, out_dtype: torch.dtype, tanh: bool,
                       block_m=None, block_n=None, num_warps=None) -> Tensor:
    m, n = x2d.shape
    y = new_empty((m, n), out_dtype, x2d.device)
    if m == 0:
        return y
    bm, bn, nw = fwd_config(n)
    bm, bn, nw = block_m or bm, block_n or bn, num_warps or nw
    ncb = triton.cdiv(n, bn)
    _bias_gelu_fwd_kernel[(triton.cdiv(m, bm) * ncb,)](
        x2d, bias, y, m, n, ncb, ACC=tl.float64 if x2d.dtype == torch.float64 else tl.float32,
        TANH=tanh, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
    return y


def bias_gelu_bwd_rows(dy2d: Tensor, x2d: Tensor, bias: Tensor, tanh: bool, need_db: bool,
                       block_m=None, block_n=None, num_warps=None, per_sm=None):
    m, n = x2d.shape
    dx = new_empty((m, n), x2d.dtype, x2d.device)
    bm, bn, nw, k = bwd_config(n)
    bm, bn, nw, k = block_m or bm, block_n or bn, num_warps or nw, per_sm or k
    ncb = triton.cdiv(n, bn)
    n_splits = max(1, min(triton.cdiv(m, bm), triton.cdiv(num_sms(x2d.device) * k, ncb)))
    acc = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    part = new_empty((n_splits, n), acc, x2d.device)
    _bias_gelu_bwd_kernel[(n_splits * ncb,)](
        x2d, bias, dy2d, dx, part, m, n, ncb, TANH=tanh, NEED_DB=need_db,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
    db = sum_partials(part, bias.dtype)[0] if need_db else None
    return dx, db


# --------------------------------------------------------------------------- autograd
# Eager calls use a plain autograd.Function (little Python); torch.compile sees the
# custom ops below instead and keeps them whole.
def _fwd(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    out_dtype = torch.result_type(x, bias)   # as x + bias would promote
    y = bias_gelu_fwd_rows(as_rows(x), bias.contiguous(), out_dtype, approximate == "tanh")
    return y.view(x.shape)


def _bwd(dy, x, bias, approximate, need_db):
    dx, db = bias_gelu_bwd_rows(as_rows(dy), as_rows(x), bias.contiguous(),
                                approximate == "tanh", need_db)
    return dx.view(x.shape), db


class _BiasGeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return _fwd(x, bias, approximate)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, db = _bwd(dy, x, bias, ctx.approximate, ctx.needs_input_grad[1])
        return dx, db, None


@torch.library.custom_op("meshtron::bias_gelu_fwd", mutates_args=())
def _bias_gelu_fwd(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    return _fwd(x, bias, approximate)


@_bias_gelu_fwd.register_fake
def _(x, bias, approximate):
    return torch.empty(x.shape, dtype=torch.result_type(x, bias), device=x.device)


@torch.library.custom_op("meshtron::bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd(dy: Tensor, x: Tensor, bias: Tensor, approximate: str,
                   need_db: bool) -> tuple[Tensor, Tensor]:
    dx, db = _bwd(dy, x, bias, approximate, need_db)
    return dx, db if db is not None else x.new_empty(0)


@_bias_gelu_bwd.register_fake
def _(dy, x, bias, approximate, need_db):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            bias.new_empty(bias.shape if need_db else (0,)))


def _bg_setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _bg_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    need_db = ctx.needs_input_grad[1]
    dx, db = torch.ops.meshtron.bias_gelu_bwd(dy, x, bias, ctx.approximate, need_db)
    return dx, (db if need_db else None), None


_bias_gelu_fwd.register_autograd(_bg_backward, setup_context=_bg_setup_context)


# --------------------------------------------------------------------------- public API
def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "tanh", impl: str = "auto") -> Tensor:
    """``gelu(x + bias)``; x (..., H), bias (H,). ``approximate``: "tanh" (Megatron) or "none" (erf).

    ``impl``: "auto" (Triton on CUDA, else ``F.gelu(x + bias)``), "triton", "torch".
    DTensor: x may be sharded on any dim; on its last dim the bias follows as ``Shard(0)``.
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    x_l, (b_l,), wrap = dtensor_locals(x, (bias,), param_follows_hidden=True)
    if use_triton(x_l, impl) and x_l.shape[-1] > 0:
        if torch.compiler.is_compiling():
            y = torch.ops.meshtron.bias_gelu_fwd(x_l, b_l, approximate)
        else:
            y = _BiasGeLUFunction.apply(x_l, b_l, approximate)
    else:
        y = F.gelu(x_l + b_l, approximate=approximate)
    return wrap(y)


class BiasGeLU(nn.Module):
    """Holds the bias of the preceding bias-free linear layer and applies ``gelu(x + bias)``."""

    def __init__(self, hidden: int, approximate: str = "tanh", impl: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        self.approximate = approximate
        self.impl = impl
        self.bias = nn.Parameter(torch.zeros(hidden, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return bias_gelu(x, self.bias, self.approximate, impl=self.impl)

    def extra_repr(self) -> str:
        return f"{self.bias.shape[0]}, approximate={self.approximate!r}, impl={self.impl}"
