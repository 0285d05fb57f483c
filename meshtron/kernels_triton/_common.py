"""Shared pieces of the Triton kernels: dispatch, DTensor handling, partial-sum reduction.

Dispatch: ``impl="auto"`` runs the Triton kernels on CUDA tensors and the plain
PyTorch call on anything else; ``impl="triton"`` forces the kernels (on CPU this
needs ``TRITON_INTERPRET=1`` set before this package is imported: tests use it);
``impl="torch"`` forces the PyTorch call.

DTensor: the ops are row-local (LayerNorm) or element-local (bias-GeLU), so a
DTensor activation is computed on its local shard with no communication in the
forward. The parameter gradient of a local shard is a partial sum over every
mesh axis that shards the rows of x, so parameters enter through
``to_local(grad_placements=...)`` with ``Partial()`` on those axes; the
reduction then happens wherever the gradient is next redistributed (FSDP's
reduce-scatter, ``full_tensor()``, the optimizer).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

try:  # Triton is optional: without it only the PyTorch path exists.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - a CPU install (triton is the gpu and test extras')
    triton = None
    tl = None
    HAVE_TRITON = False

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None

IMPLS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor, impl: str) -> bool:
    """Decide the path for a (local, plain) tensor ``x``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch" or not HAVE_TRITON:
        if impl == "triton":
            raise RuntimeError("impl='triton' asked for, but triton is not installed (the gpu extra: "
                               "pip install -e '.[gpu]')")
        return False
    if impl == "triton":
        if x.device.type != "cuda" and not interpreting():
            raise RuntimeError("impl='triton' on a CPU tensor needs TRITON_INTERPRET=1 "
                               "set before meshtron.kernels_triton is imported")
        return True
    return x.device.type == "cuda"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count (a small number under the interpreter, to keep grids cheap)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Tests set this to fill every buffer the kernels allocate with NaN, so that an
# element a kernel forgets to write shows up instead of passing as stale memory.
POISON = False


def new_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``, or a NaN-filled buffer when ``POISON`` is set."""
    if isinstance(shape, int):
        shape = (shape,)
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as (rows, H) contiguous. A gradient arriving from a DTensor
    collective (e.g. sequence parallelism's all-gather backward) can be an
    AsyncCollectiveTensor still in flight: wait for it, or the kernel reads the
    wrapper's pointer (an illegal memory access on the GPU)."""
    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    return t.contiguous().view(-1, t.shape[-1])


# --------------------------------------------------------------------------- partial sums
if HAVE_TRITON:

    @triton.jit
    def _sum_partials_kernel(P1, P2, OUT1, OUT2, n_part, N,
                             HAS_2: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        """OUT[c] = sum_p P[p, c] for one or two fp32 (n_part, N) buffers, cast to OUT's dtype."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc1 = tl.zeros([BLOCK_P, BLOCK_N], dtype=P1.dtype.element_ty)
        acc2 = tl.zeros([BLOCK_P, BLOCK_N], dtype=P1.dtype.element_ty)
        for p0 in range(0, n_part, BLOCK_P):
            rows = p0 + tl.arange(0, BLOCK_P)
            mask = (rows < n_part)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            acc1 += tl.load(P1 + offs, mask=mask, other=0.0)
            if HAS_2:
                acc2 += tl.load(P2 + offs, mask=mask, other=0.0)
        tl.store(OUT1 + cols, tl.sum(acc1, axis=0).to(OUT1.dtype.element_ty), mask=cmask)
        if HAS_2:
            tl.store(OUT2 + cols, tl.sum(acc2, axis=0).to(OUT2.dtype.element_ty), mask=cmask)


def sum_partials(p1: torch.Tensor, dtype1: torch.dtype,
                 p2: torch.Tensor | None = None, dtype2: torch.dtype | None = None):
    """Column sums of one or two fp32 (or fp64) (P, N) partial buffers, in one launch.

    (Two ``torch.sum`` + casts measured slower on an H200: ~11 µs a reduce kernel
    against ~3 µs for this one, and no less host time.)
    """
    n_part, n = p1.shape
    out1 = new_empty(n, dtype1, p1.device)
    out2 = new_empty(n, dtype2, p1.device) if p2 is not None else out1
    # Each program sums a column slab (P x BLOCK_N), all P rows in one load when
    # P <= 512, so the few MB of partials are read in a single latency.
    block_p = min(512, triton.next_power_of_2(n_part))
    block_n = min(128, max(16, 8192 // block_p))
    num_warps = 8
    if interpreting():   # few programs: the interpreter pays per program
        block_n, block_p, num_warps = min(1024, triton.next_power_of_2(n)), 16, 4
    grid = (triton.cdiv(n, block_n),)
    _sum_partials_kernel[grid](p1, p2 if p2 is not None else p1, out1, out2, n_part, n,
                               HAS_2=p2 is not None, BLOCK_P=block_p, BLOCK_N=block_n,
                               num_warps=num_warps)
    return out1, (out2 if p2 is not None else None)


# --------------------------------------------------------------------------- DTensor
def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _check_rows(x, param_follows_hidden: bool) -> None:
    """A row-local op takes no Partial input, and whole rows unless its parameters
    follow the hidden dim."""
    for p in x.placements:
        if p.is_partial():
            raise ValueError("x is Partial: reduce it before a non-linear op")
        if p.is_shard() and _norm_dim(p.dim, x.ndim) == x.ndim - 1 and not param_follows_hidden:
            raise ValueError("LayerNorm needs whole rows: x must not be sharded on its last dim")


def _param_local(prm, x) -> torch.Tensor:
    """A 1-D DTensor parameter as the local tensor a row-local op on x uses, per mesh
    axis: sharded like x's hidden dim, else whole; its gradient Partial on the axes
    that shard x's rows (each rank saw only its rows)."""
    pmesh, want, grad = prm.device_mesh, [], []
    names = x.device_mesh.mesh_dim_names if is_dtensor(x) else None
    for axis in range(pmesh.ndim):
        # x's placement on the same mesh axis: by identity, else by axis name.
        px = Replicate()
        if is_dtensor(x):
            if pmesh == x.device_mesh:
                px = x.placements[axis]
            elif names is not None and pmesh.mesh_dim_names is not None and pmesh.mesh_dim_names[axis] in names:
                px = x.placements[names.index(pmesh.mesh_dim_names[axis])]
        if px.is_shard() and _norm_dim(px.dim, x.ndim) == x.ndim - 1:
            want.append(Shard(0))      # parameter sharded like x's hidden dim
            grad.append(Shard(0))
        elif px.is_shard():
            want.append(Replicate())   # rows sharded: local grad is a partial sum
            grad.append(Partial())
        else:
            want.append(Replicate())
            grad.append(Replicate())
    if tuple(prm.placements) != tuple(want):
        prm = prm.redistribute(pmesh, want)
    return prm.to_local(grad_placements=grad)


def dtensor_locals(x, params: Sequence[torch.Tensor | None], param_follows_hidden: bool):
    """Turn ``x`` and its 1-D parameters into local tensors for a row-local op.

    ``param_follows_hidden``: the parameter is indexed by x's last dim and may be
    sharded with it (bias-GeLU under column parallelism). Otherwise (LayerNorm)
    the last dim must not be sharded and parameters are used whole.

    Returns ``(x_local, param_locals, wrap)``; ``wrap(y_local)`` gives y back
    with x's placements (a plain tensor when x was plain).
    """
    if not is_dtensor(x):
        return x, [_param_local(p, x) if is_dtensor(p) else p for p in params], lambda y_local: y_local
    _check_rows(x, param_follows_hidden)   # before any redistribution: an error, not a hang
    mesh, xpl = x.device_mesh, tuple(x.placements)
    x_local = x.to_local(grad_placements=xpl)

    def wrap(y_local):
        return DTensor.from_local(y_local, mesh, xpl, run_check=False, shape=x.shape, stride=x.stride())
    return x_local, [_param_local(p, x) if is_dtensor(p) else p for p in params], wrap
