"""LayerNorm over the last dim, forward and backward in Triton.

    y = (x - mean) * rstd * w + b,    rstd = 1 / sqrt(var + eps)      (fp32 statistics)

Forward: one pass, reads x once and writes y once (+ 8 bytes a row of saved mean
and rstd). A program takes BLOCK_M rows of BLOCK_N >= H columns.

Backward, with xhat = (x - mean) * rstd and g = w * dy:
    dx = rstd * (g - mean_H(g * xhat) * xhat - mean_H(g))
    dw = sum_rows(dy * xhat),  db = sum_rows(dy)
One persistent kernel of about (SMs x k) programs walks the rows, writes dx and
keeps its dw/db partial sums in fp32 registers; each program then writes one
partial row, and a small second kernel sums the (programs x H) partials. No
atomics, so results are deterministic, and the partials stay (programs x H)
whatever the row count. Bytes: x and dy read, dx written, plus (programs x H x 8)
of partials written and read again.

Communication: none. Under sequence parallelism the weight gradient of a
local shard is a partial sum (``Partial()``), reduced later by its placements.
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

# Widest row the Triton kernels hold in registers; wider rows take the PyTorch path.
MAX_TRITON_H = 16384


# --------------------------------------------------------------------------- kernels
if HAVE_TRITON:

    @triton.jit
    def _add_pair(a1, b1, a2, b2):
        return a1 + a2, b1 + b2

    @triton.jit
    def _ln_fwd_kernel(X, Y, W, B, Mean, Rstd, n_rows, N, eps,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, EVEN: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # EVEN: H == BLOCK_N and BLOCK_M divides the rows, so no element is masked.
        ACC = Mean.dtype.element_ty    # fp32, or fp64 for fp64 inputs (gradcheck)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask = rows < n_rows
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if EVEN:
            x = tl.load(X + offs).to(ACC)
        else:
            x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
        # Two passes over the registers (mean, then centred squares): no cancellation.
        # (One reduction of both moments measured no faster on an H200.)
        mean = tl.sum(x, axis=1) / N
        if EVEN:
            xc = x - mean[:, None]
        else:
            xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / N
        if ACC == tl.float64:
            rstd = 1.0 / tl.sqrt(var + eps)
        else:
            rstd = tl.math.rsqrt(var + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        if EVEN:
            tl.store(Y + offs, y.to(Y.dtype.element_ty))
            tl.store(Mean + rows, mean)
            tl.store(Rstd + rows, rstd)
        else:
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
            tl.store(Mean + rows, mean, mask=rmask)
            tl.store(Rstd + rows, rstd, mask=rmask)

    @triton.jit
    def _ln_bwd_load(X, DY, Mean, Rstd, rows, cols, cmask, n_rows, N):
        # one block of rows for the backward (inlined): x and dy in their dtype, the
        # saved statistics; rows past the end read as zeros
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        return (tl.load(X + offs, mask=mask, other=0.0), tl.load(DY + offs, mask=mask, other=0.0),
                tl.load(Mean + rows, mask=rmask, other=0.0), tl.load(Rstd + rows, mask=rmask, other=0.0))

    @triton.jit
    def _ln_bwd_kernel(X, DY, DX, W, Mean, Rstd, DW_part, DB_part, n_rows, N,
                       HAS_W: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                       PREFETCH: tl.constexpr, PAIR_SUM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Persistent: program p takes row blocks p, p + P, p + 2P, ... With PREFETCH the
        # loads of the next block are issued before the current block's reductions, so
        # twice the bytes are in flight.
        ACC = Mean.dtype.element_ty
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_M
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        if PREFETCH:
            x_nx, dy_nx, mean_nx, rstd_nx = _ln_bwd_load(X, DY, Mean, Rstd, rows, cols, cmask, n_rows, N)
        for _ in range(pid * BLOCK_M, n_rows, step):
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            if PREFETCH:
                x, dy, mean, rstd = x_nx, dy_nx, mean_nx, rstd_nx
                x_nx, dy_nx, mean_nx, rstd_nx = _ln_bwd_load(X, DY, Mean, Rstd, rows + step, cols, cmask, n_rows, N)
            else:
                x, dy, mean, rstd = _ln_bwd_load(X, DY, Mean, Rstd, rows, cols, cmask, n_rows, N)
            x, dy = x.to(ACC), dy.to(ACC)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            if HAS_W:
                g = dy * w
            else:
                g = dy
            if PAIR_SUM:   # both row sums in one reduction (the interpreter runs it slowly)
                s1, s2 = tl.reduce((xhat * g, g), 1, _add_pair)
            else:
                s1 = tl.sum(xhat * g, axis=1)
                s2 = tl.sum(g, axis=1)
            dx = (g - (xhat * (s1 / N)[:, None] + (s2 / N)[:, None])) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            if NEED_DW:
                dw_acc += dy * xhat
            if NEED_DB:
                db_acc += dy
            rows += step
        if NEED_DW:
            tl.store(DW_part + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
        if NEED_DB:
            tl.store(DB_part + pid * N + cols, tl.sum(db_acc, axis=0), mask=cmask)


# --------------------------------------------------------------------------- configs
def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and accumulators: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fwd_config(n: int) -> tuple[int, int]:
    """(BLOCK_M rows a program, num_warps) for the forward, by hidden size.

    Measured on an H200 (benchmarks/bench_kernels.py --sweep): two rows a program,
    about 16-32 elements a thread.
    """
    block_n = triton.next_power_of_2(n)
    if interpreting():  # the interpreter pays per program and per op, not per element
        return max(1, min(64, 65536 // block_n)), 4
    if block_n <= 2048:
        return 2, max(1, block_n // 256)
    if block_n <= 8192:
        return 2, 8
    return 1, 16


def bwd_config(n: int) -> tuple[int, int, int, bool, bool]:
    """(BLOCK_M, num_warps, programs per SM, prefetch, pair_sum) for the backward.

    Measured on an H200 (benchmarks/bench_kernels.py --sweep). Small rows want
    several rows a step and many programs; large rows one or two rows, 16 warps,
    one program an SM, and the next rows' loads in flight (prefetch).
    """
    block_n = triton.next_power_of_2(n)
    if interpreting():
        return max(1, min(64, 65536 // block_n)), 4, 2, True, False
    if block_n <= 2048:
        return max(1, 2048 // block_n), 4, 4, True, False
    if block_n <= 4096:
        return 1, 8, 2, True, True
    if block_n <= 8192:
        return 1, 16, 1, True, False
    # H = 16384: a whole row per thread block spills registers; prefetching the next
    # row spilled far more (408 GB/s against 2192 without, 8 warps, on an H200).
    return 1, 8, 1, False, False


def ln_fwd_rows(x2d: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                block_m: int | None = None, num_warps: int | None = None,
                even: bool | None = None):
    """Triton forward on a contiguous (rows, H) tensor: returns y, mean, rstd (fp32)."""
    m, n = x2d.shape
    y = new_empty((m, n), x2d.dtype, x2d.device)
    mean = new_empty(m, stat_dtype(x2d.dtype), x2d.device)
    rstd = new_empty(m, stat_dtype(x2d.dtype), x2d.device)
    if m == 0:
        return y, mean, rstd
    bm, nw = fwd_config(n)
    bm, nw = block_m or bm, num_warps or nw
    block_n = triton.next_power_of_2(n)
    if even is None:
        even = n == block_n and m % bm == 0
    _ln_fwd_kernel[(triton.cdiv(m, bm),)](
        x2d, y, weight if weight is not None else x2d, bias if bias is not None else x2d,
        mean, rstd, m, n, eps, HAS_W=weight is not None, HAS_B=bias is not None,
        EVEN=even, BLOCK_M=bm, BLOCK_N=block_n, num_warps=nw)
    return y, mean, rstd


def ln_bwd_rows(dy2d: Tensor, x2d: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor,
                need_dw: bool, need_db: bool, w_dtype: torch.dtype, b_dtype: torch.dtype,
                block_m: int | None = None, num_warps: int | None = None,
                per_sm: int | None = None, prefetch: bool | None = None,
                pair_sum: bool | None = None, reduce_partials: bool = True):
    """Triton backward on contiguous (rows, H) tensors: returns dx, dw or None, db or None."""
    m, n = x2d.shape
    dx = new_empty((m, n), x2d.dtype, x2d.device)
    bm, nw, k, pf, ps = bwd_config(n)
    bm, nw, k = block_m or bm, num_warps or nw, per_sm or k
    pf = pf if prefetch is None else prefetch
    ps = ps if pair_sum is None else pair_sum
    n_prog = max(1, min(triton.cdiv(m, bm), num_sms(x2d.device) * k))
    part = new_empty((2 if need_db else 1, n_prog, n), mean.dtype, x2d.device)
    _ln_bwd_kernel[(n_prog,)](
        x2d, dy2d, dx, weight if weight is not None else x2d, mean, rstd, part[0], part[-1],
        m, n, HAS_W=weight is not None, NEED_DW=need_dw, NEED_DB=need_db, PREFETCH=pf,
        PAIR_SUM=ps,
        BLOCK_M=bm, BLOCK_N=triton.next_power_of_2(n), num_warps=nw)
    dw = db = None
    if not reduce_partials:   # benchmarks: the main kernel alone
        return dx, part, None
    if need_dw and need_db:
        dw, db = sum_partials(part[0], w_dtype, part[1], b_dtype)
    elif need_dw:
        dw, _ = sum_partials(part[0], w_dtype)
    elif need_db:
        db, _ = sum_partials(part[-1], b_dtype)
    return dx, dw, db


# --------------------------------------------------------------------------- autograd
# Eager calls go through a plain autograd.Function (about a third of the Python time of
# calling the custom ops eagerly); under torch.compile the same math runs as the custom
# ops below, which compile keeps whole (their fake impls give shapes, register_autograd
# gives the backward).
def _fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float):
    y, mean, rstd = ln_fwd_rows(as_rows(x), weight, bias, eps)
    return y.view(x.shape), mean, rstd


def _bwd(dy, x, weight, mean, rstd, need_dw, need_db, b_dtype):
    w_dtype = weight.dtype if weight is not None else torch.float32
    dx, dw, db = ln_bwd_rows(as_rows(dy), as_rows(x), weight, mean, rstd,
                             need_dw, need_db, w_dtype, b_dtype)
    return dx.view(x.shape), dw, db


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _fwd(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_w, ctx.has_b = weight is not None, bias is not None
        ctx.b_dtype = bias.dtype if bias is not None else x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        need_dw = ctx.has_w and ctx.needs_input_grad[1]
        need_db = ctx.has_b and ctx.needs_input_grad[2]
        dx, dw, db = _bwd(dy, x, weight, mean, rstd, need_dw, need_db, ctx.b_dtype)
        return dx, dw, db, None


@torch.library.custom_op("meshtron::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _fwd(x, weight, bias, eps)


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(m, dtype=stat_dtype(x.dtype)), x.new_empty(m, dtype=stat_dtype(x.dtype)))


@torch.library.custom_op("meshtron::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor,
                    need_dw: bool, need_db: bool, b_dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _bwd(dy, x, weight, mean, rstd, need_dw, need_db, b_dtype)
    # A custom op returns tensors: empty ones stand for "not asked for".
    return (dx, dw if dw is not None else x.new_empty(0),
            db if db is not None else x.new_empty(0))


@_layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, need_dw, need_db, b_dtype):
    n = x.shape[-1]
    dw = x.new_empty(n if need_dw else 0, dtype=weight.dtype if need_dw else x.dtype)
    db = x.new_empty(n if need_db else 0, dtype=b_dtype if need_db else x.dtype)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dw, db


def _ln_setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_w, ctx.has_b = weight is not None, bias is not None
    ctx.b_dtype = bias.dtype if bias is not None else x.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_dw = ctx.has_w and ctx.needs_input_grad[1]
    need_db = ctx.has_b and ctx.needs_input_grad[2]
    dx, dw, db = torch.ops.meshtron.layer_norm_bwd(dy, x, weight, mean, rstd,
                                                   need_dw, need_db, ctx.b_dtype)
    return dx, (dw if need_dw else None), (db if need_db else None), None


_layer_norm_fwd.register_autograd(_ln_backward, setup_context=_ln_setup_context)


# --------------------------------------------------------------------------- public API
def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5,
               impl: str = "auto") -> Tensor:
    """LayerNorm over the last dim of ``x``; ``weight``/``bias`` of shape (H,) or None.

    ``impl``: "auto" (Triton on CUDA, else ``F.layer_norm``), "triton", "torch".
    DTensor inputs are computed on local shards; x must not be sharded on its last dim.
    """
    x_l, (w_l, b_l), wrap = dtensor_locals(x, (weight, bias), param_follows_hidden=False)
    h = x_l.shape[-1]
    if use_triton(x_l, impl) and 0 < h <= MAX_TRITON_H:
        if torch.compiler.is_compiling():
            y = torch.ops.meshtron.layer_norm_fwd(x_l, w_l, b_l, float(eps))[0]
        else:
            y = _LayerNormFunction.apply(x_l, w_l, b_l, float(eps))
    else:
        y = F.layer_norm(x_l, (h,), w_l, b_l, eps)
    return wrap(y)


class LayerNorm(nn.Module):
    """Drop-in ``nn.LayerNorm`` over the last dim (same parameter names and state dict)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, bias: bool = True,
                 impl: str = "auto", device=None, dtype=None):
        super().__init__()
        if not isinstance(normalized_shape, int):
            (normalized_shape,) = tuple(normalized_shape)
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}, impl={self.impl}"
