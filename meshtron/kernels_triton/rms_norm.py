"""RMSNorm over the last dim (Llama), forward and backward in Triton.

    y = x * rstd * w,    rstd = 1 / sqrt(mean_H(x^2) + eps)      (fp32 statistics)

The product is formed in fp32 and rounded once to x's dtype (HF's Llama rounds
x * rstd to x's dtype before the weight; both are within bf16's rounding of
the float64 result).

Forward: one pass, reads x once and writes y once (+ 4 bytes a row of saved
rstd). A program takes BLOCK_M rows of BLOCK_N >= H columns.

Backward, with xhat = x * rstd and g = w * dy:
    dx = rstd * (g - mean_H(g * xhat) * xhat)
    dw = sum_rows(dy * xhat)
As in layer_norm.py: one persistent kernel of about (SMs x k) programs walks the
rows, writes dx and keeps its dw partial sums in fp32 registers; each program
writes one partial row, and ``_common.sum_partials`` sums the (programs x H)
partials. No atomics, so results are deterministic. Bytes: x and dy read, dx
written, plus (programs x H x 4) of partials written and read again.

Communication: none. Under sequence parallelism the weight gradient of a
local shard is a partial sum (``Partial()``), reduced later by its placements.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import (
    HAVE_TRITON,
    _norm_dim,
    as_rows,
    dtensor_locals,
    interpreting,
    is_dtensor,
    new_empty,
    num_sms,
    sum_partials,
    tl,
    triton,
    use_triton,
)

# Widest row the Triton kernels hold in registers; wider rows take the PyTorch path.
MAX_TRITON_H = 16384


# --------------------------------------------------------------------------- kernels
if HAVE_TRITON:

    @triton.jit
    def _rms_fwd_kernel(X, Y, W, Rstd, n_rows, N, eps,
                        HAS_W: tl.constexpr, EVEN: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # EVEN: H == BLOCK_N and BLOCK_M divides the rows, so no element is masked.
        ACC = Rstd.dtype.element_ty    # fp32, or fp64 for fp64 inputs (gradcheck)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask = rows < n_rows
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if EVEN:
            x = tl.load(X + offs).to(ACC)
        else:
            x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)   # zeros add nothing to sum(x^2)
        ms = tl.sum(x * x, axis=1) / N
        if ACC == tl.float64:
            rstd = 1.0 / tl.sqrt(ms + eps)
        else:
            rstd = tl.math.rsqrt(ms + eps)
        y = x * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        if EVEN:
            tl.store(Y + offs, y.to(Y.dtype.element_ty))
            tl.store(Rstd + rows, rstd)
        else:
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
            tl.store(Rstd + rows, rstd, mask=rmask)

    @triton.jit
    def _rms_bwd_load(X, DY, Rstd, rows, cols, cmask, n_rows, N):
        # one block of rows for the backward (inlined); rows past the end read as
        # zeros, so they contribute nothing to dw
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        return (tl.load(X + offs, mask=mask, other=0.0), tl.load(DY + offs, mask=mask, other=0.0),
                tl.load(Rstd + rows, mask=rmask, other=0.0))

    @triton.jit
    def _rms_bwd_kernel(X, DY, DX, W, Rstd, DW_part, n_rows, N,
                        HAS_W: tl.constexpr, NEED_DW: tl.constexpr, PREFETCH: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Persistent: program p takes row blocks p, p + P, p + 2P, ... With PREFETCH the
        # loads of the next block are issued before the current block's reduction, so
        # twice the bytes are in flight.
        ACC = Rstd.dtype.element_ty
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_M
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        if PREFETCH:
            x_nx, dy_nx, rstd_nx = _rms_bwd_load(X, DY, Rstd, rows, cols, cmask, n_rows, N)
        for _ in range(pid * BLOCK_M, n_rows, step):
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            if PREFETCH:
                x, dy, rstd = x_nx, dy_nx, rstd_nx
                x_nx, dy_nx, rstd_nx = _rms_bwd_load(X, DY, Rstd, rows + step, cols, cmask, n_rows, N)
            else:
                x, dy, rstd = _rms_bwd_load(X, DY, Rstd, rows, cols, cmask, n_rows, N)
            x, dy = x.to(ACC), dy.to(ACC)
            xhat = x * rstd[:, None]      # 0 wherever masked: x loaded as 0
            if HAS_W:
                g = dy * w
            else:
                g = dy
            s = tl.sum(xhat * g, axis=1) / N
            dx = (g - xhat * s[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            if NEED_DW:
                dw_acc += dy * xhat
            rows += step
        if NEED_DW:
            tl.store(DW_part + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)


# --------------------------------------------------------------------------- configs
def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and accumulators: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fwd_config(n: int) -> tuple[int, int]:
    """(BLOCK_M rows a program, num_warps) for the forward, by hidden size.

    Taken from layer_norm.py's H200 sweep: these kernels make the same loads and
    stores with one reduction fewer. Not re-measured for RMSNorm yet
    (``benchmarks/bench_kernels.py --sweep --only rms_norm`` times the alternatives).
    """
    block_n = triton.next_power_of_2(n)
    if interpreting():  # the interpreter pays per program and per op, not per element
        return max(1, min(64, 65536 // block_n)), 4
    if block_n <= 2048:
        return 2, max(1, block_n // 256)
    if block_n <= 8192:
        return 2, 8
    return 1, 16


def bwd_config(n: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, num_warps, programs per SM, prefetch) for the backward.

    As layer_norm.py's (H200 sweep), without its pair-sum variant: RMSNorm has a
    single row reduction.
    """
    block_n = triton.next_power_of_2(n)
    if interpreting():
        return max(1, min(64, 65536 // block_n)), 4, 2, True
    if block_n <= 2048:
        return max(1, 2048 // block_n), 4, 4, True
    if block_n <= 4096:
        return 1, 8, 2, True
    if block_n <= 8192:
        return 1, 16, 1, True
    # H = 16384: prefetching the next row spilled registers in LayerNorm's sweep.
    return 1, 8, 1, False


def rms_fwd_rows(x2d: Tensor, weight: Tensor | None, eps: float,
                 block_m: int | None = None, num_warps: int | None = None,
                 even: bool | None = None):
    """Triton forward on a contiguous (rows, H) tensor: returns y, rstd (fp32)."""
    m, n = x2d.shape
    y = new_empty((m, n), x2d.dtype, x2d.device)
    rstd = new_empty(m, stat_dtype(x2d.dtype), x2d.device)
    if m == 0:
        return y, rstd
    bm, nw = fwd_config(n)
    bm, nw = block_m or bm, num_warps or nw
    block_n = triton.next_power_of_2(n)
    if even is None:
        even = n == block_n and m % bm == 0
    _rms_fwd_kernel[(triton.cdiv(m, bm),)](
        x2d, y, weight if weight is not None else x2d, rstd, m, n, eps,
        HAS_W=weight is not None, EVEN=even, BLOCK_M=bm, BLOCK_N=block_n, num_warps=nw)
    return y, rstd


def rms_bwd_rows(dy2d: Tensor, x2d: Tensor, weight: Tensor | None, rstd: Tensor, need_dw: bool,
                 block_m: int | None = None, num_warps: int | None = None,
                 per_sm: int | None = None, prefetch: bool | None = None,
                 reduce_partials: bool = True):
    """Triton backward on contiguous (rows, H) tensors: returns dx, dw or None."""
    m, n = x2d.shape
    dx = new_empty((m, n), x2d.dtype, x2d.device)
    bm, nw, k, pf = bwd_config(n)
    bm, nw, k = block_m or bm, num_warps or nw, per_sm or k
    pf = pf if prefetch is None else prefetch
    n_prog = max(1, min(triton.cdiv(m, bm), num_sms(x2d.device) * k))
    part = new_empty((n_prog, n), rstd.dtype, x2d.device) if need_dw else None
    _rms_bwd_kernel[(n_prog,)](
        x2d, dy2d, dx, weight if weight is not None else x2d, rstd, part if need_dw else rstd,
        m, n, HAS_W=weight is not None, NEED_DW=need_dw, PREFETCH=pf,
        BLOCK_M=bm, BLOCK_N=triton.next_power_of_2(n), num_warps=nw)
    if not reduce_partials:   # benchmarks: the main kernel alone
        return dx, part
    dw = sum_partials(part, weight.dtype)[0] if need_dw else None
    return dx, dw


# --------------------------------------------------------------------------- autograd
# Eager calls go through a plain autograd.Function (less Python than calling the
# custom ops eagerly); under torch.compile the same math runs as the custom ops
# below, which compile keeps whole.
def _fwd(x: Tensor, weight: Tensor | None, eps: float):
    y, rstd = rms_fwd_rows(as_rows(x), weight, eps)
    return y.view(x.shape), rstd


def _bwd(dy, x, weight, rstd, need_dw):
    dx, dw = rms_bwd_rows(as_rows(dy), as_rows(x), weight, rstd, need_dw)
    return dx.view(x.shape), dw


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.has_w = weight is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_dw = ctx.has_w and ctx.needs_input_grad[1]
        dx, dw = _bwd(dy, x, weight, rstd, need_dw)
        return dx, dw, None


@torch.library.custom_op("meshtron::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    return _fwd(x, weight, eps)


@_rms_norm_fwd.register_fake
def _(x, weight, eps):
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(m, dtype=stat_dtype(x.dtype)))


@torch.library.custom_op("meshtron::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor,
                  need_dw: bool) -> tuple[Tensor, Tensor]:
    dx, dw = _bwd(dy, x, weight, rstd, need_dw)
    # A custom op returns tensors: an empty one stands for "not asked for".
    return dx, dw if dw is not None else x.new_empty(0)


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, need_dw):
    dw = x.new_empty(x.shape[-1] if need_dw else 0, dtype=weight.dtype if need_dw else x.dtype)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dw


def _rms_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.has_w = weight is not None
    ctx.mark_non_differentiable(rstd)


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dw = ctx.has_w and ctx.needs_input_grad[1]
    dx, dw = torch.ops.meshtron.rms_norm_bwd(dy, x, weight, rstd, need_dw)
    return dx, (dw if need_dw else None), None


_rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup_context)


# --------------------------------------------------------------------------- public API
def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6, impl: str = "auto") -> Tensor:
    """RMSNorm over the last dim of ``x``; ``weight`` of shape (H,) or None. Output in x's dtype.

    ``impl``: "auto" (Triton on CUDA, else ``F.rms_norm``), "triton", "torch".
    DTensor inputs are computed on local shards; x must not be sharded on its last dim.
    """
    if is_dtensor(x) and any(p.is_shard() and _norm_dim(p.dim, x.ndim) == x.ndim - 1 for p in x.placements):
        # (checked here too so the message names RMSNorm, not _common's LayerNorm)
        raise ValueError("RMSNorm needs whole rows: x must not be sharded on its last dim")
    x_l, (w_l,), wrap = dtensor_locals(x, (weight,), param_follows_hidden=False)
    h = x_l.shape[-1]
    if use_triton(x_l, impl) and 0 < h <= MAX_TRITON_H:
        if torch.compiler.is_compiling():
            y = torch.ops.meshtron.rms_norm_fwd(x_l, w_l, float(eps))[0]
        else:
            y = _RMSNormFunction.apply(x_l, w_l, float(eps))
    else:
        y = F.rms_norm(x_l, (h,), w_l, eps)
        if y.dtype != x_l.dtype:   # a wider weight promotes in F.rms_norm; keep the kernels' contract
            y = y.to(x_l.dtype)
    return wrap(y)


class RMSNorm(nn.Module):
    """Drop-in ``nn.RMSNorm`` over the last dim (same parameter name and state dict)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-6, elementwise_affine: bool = True,
                 impl: str = "auto", device=None, dtype=None):
        super().__init__()
        if not isinstance(normalized_shape, int):
            (normalized_shape,) = tuple(normalized_shape)
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.impl = impl
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, impl={self.impl}")
