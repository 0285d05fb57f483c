"""Tests of meshtron.kernels_triton: the Triton kernels against float64 references.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1,
set here before anything imports triton; conftest sets it too). With a GPU the
same tests run the compiled kernels on CUDA tensors.

Tolerances are relative norm errors ||out - ref|| / ||ref|| against float64:
fp32 arithmetic lands near 1e-7, so fp32 must be under 1e-5; bf16 rounds every
stored element (2^-9 relative), so bf16 must be under 1e-2.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib

import torch.nn.functional as F
from torch import nn

import meshtron.kernels_triton as kt
from meshtron.kernels_triton import BiasGeLU, LayerNorm, RMSNorm, _common, bias_gelu, layer_norm, rms_norm, swiglu

ln_mod = importlib.import_module("meshtron.kernels_triton.layer_norm")  # the module, not the function
rms_mod = importlib.import_module("meshtron.kernels_triton.rms_norm")
sw_mod = importlib.import_module("meshtron.kernels_triton.swiglu")

# Interpreter on (conftest sets it when there is no GPU): CPU tensors; otherwise CUDA.
DEV = "cpu" if _common.interpreting() or not torch.cuda.is_available() else "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = [(1, 3), (3, 77), (130, 1000), (257, 4099)]
# The tanh-GeLU kernel lets exp(-2u) overflow to inf on purpose (sigmoid -> 0); numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture(autouse=True)
def _poison():
    """Every buffer the kernels allocate starts as NaN: unwritten elements fail the test."""
    if DEV == "cpu" and type(ln_mod._ln_fwd_kernel).__name__ != "InterpretedFunction":
        pytest.fail("meshtron.kernels_triton was imported before TRITON_INTERPRET=1 was set "
                    "(set it in conftest.py before anything imports triton)")
    _common.POISON = True
    yield
    _common.POISON = False


def rel_err(out, ref):
    out = out.double()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


# ----------------------------------------------------------------------------- LayerNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.fast_cases(shape=((1, 3), (3, 77), (130, 1000)))
def test_layer_norm_vs_float64(shape, dtype):
    m, n = shape
    g = torch.Generator().manual_seed(m * 7919 + n)
    x = (torch.randn(m, n, generator=g) * 3 + 1).to(DEV, dtype)
    w = (torch.randn(n, generator=g) * 0.5 + 1).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)

    x1, w1, b1 = leaves(x, w, b)
    y = layer_norm(x1, w1, b1, 1e-5, impl="triton")
    assert y.dtype == dtype and y.shape == x.shape
    grads = torch.autograd.grad(y, (x1, w1, b1), dy)

    x2, w2, b2 = leaves(x.double(), w.double(), b.double())
    y_ref = F.layer_norm(x2, (n,), w2, b2, 1e-5)
    refs = torch.autograd.grad(y_ref, (x2, w2, b2), dy.double())
    for name, out, ref in zip(("y", "dx", "dw", "db"), (y, *grads), (y_ref, *refs)):
        assert out.dtype == dtype
        assert rel_err(out, ref) < TOL[dtype], name


def test_layer_norm_no_bias_3d_and_mixed_dtype():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 96, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(96, generator=g).to(DEV)                      # fp32 weight, bf16 x
    dy = torch.randn(2, 5, 96, generator=g).to(DEV, torch.bfloat16)
    x1, w1 = leaves(x, w)
    y = layer_norm(x1, w1, None, 1e-6, impl="triton")
    dx, dw = torch.autograd.grad(y, (x1, w1), dy)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    x2, w2 = leaves(x.double(), w.double())
    y_ref = F.layer_norm(x2, (96,), w2, None, 1e-6)
    rx, rw = torch.autograd.grad(y_ref, (x2, w2), dy.double())
    assert rel_err(y, y_ref) < 1e-2 and rel_err(dx, rx) < 1e-2 and rel_err(dw, rw) < 1e-2


def test_layer_norm_only_input_grad_and_empty():
    x, w, b = torch.randn(4, 9, device=DEV), torch.randn(9, device=DEV), torch.randn(9, device=DEV)
    (x1,) = leaves(x)
    (dx,) = torch.autograd.grad(layer_norm(x1, w, b, impl="triton").sum(), (x1,))
    (x2,) = leaves(x)
    (rx,) = torch.autograd.grad(F.layer_norm(x2, (9,), w, b).sum(), (x2,))
    assert rel_err(dx, rx.double()) < 1e-4
    empty = torch.randn(0, 9, device=DEV)
    assert layer_norm(empty, w, b, impl="triton").shape == (0, 9)


def test_layer_norm_kernel_variants_agree():
    """Kernel variants the GPU configs pick (one-pass pair sum, prefetch or not, one or
    several row blocks a program) agree, on a shape small enough for the interpreter."""
    g = torch.Generator().manual_seed(6)
    x, dy = (torch.randn(9, 24, generator=g).to(DEV) for _ in range(2))
    w = torch.randn(24, generator=g).to(DEV)
    y, mean, rstd = ln_mod.ln_fwd_rows(x, w, w, 1e-5)
    for a, r in zip(ln_mod.ln_fwd_rows(x, w, w, 1e-5, block_m=2), (y, mean, rstd)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    x32, w32 = torch.randn(8, 32, generator=g).to(DEV), torch.randn(32, generator=g).to(DEV)
    for a, r in zip(ln_mod.ln_fwd_rows(x32, w32, w32, 1e-5, block_m=2),            # unmasked
                    ln_mod.ln_fwd_rows(x32, w32, w32, 1e-5, block_m=2, even=False)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    ref = ln_mod.ln_bwd_rows(dy, x, w, mean, rstd, True, True, w.dtype, w.dtype)
    for pair_sum, prefetch in ((True, False), (True, True), (False, False)):
        out = ln_mod.ln_bwd_rows(dy, x, w, mean, rstd, True, True, w.dtype, w.dtype, block_m=2,
                                 per_sm=1, prefetch=prefetch, pair_sum=pair_sum)
        for a, r in zip(out, ref):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_custom_ops_opcheck():
    """Schema, fake (meta) impls and autograd registration of the ops torch.compile sees."""
    x = torch.randn(3, 8, device=DEV, requires_grad=True)
    w, b = (torch.randn(8, device=DEV, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.meshtron.layer_norm_fwd, (x, w, b, 1e-5))
    torch.library.opcheck(torch.ops.meshtron.bias_gelu_fwd, (x, b, "tanh"))
    torch.library.opcheck(torch.ops.meshtron.rms_norm_fwd, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.meshtron.rms_norm_fwd, (x, None, 1e-6))
    torch.library.opcheck(torch.ops.meshtron.swiglu_fwd, (x, torch.randn(3, 8, device=DEV, requires_grad=True)))


def test_layer_norm_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    w = torch.randn(5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    b = torch.randn(5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: layer_norm(*a, 1e-5, impl="triton"), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: layer_norm(x, w, None, 1e-5, impl="triton"), (x, w))


# ----------------------------------------------------------------------------- bias-GeLU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.fast_cases(shape=((1, 3), (3, 77), (130, 1000)))
def test_bias_gelu_vs_float64(shape, dtype):
    m, n = shape
    g = torch.Generator().manual_seed(m * 31 + n)
    x = (torch.randn(m, n, generator=g) * 3).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)
    for approx in ("tanh", "none") if n in (77, 1000) else ("tanh",):
        x1, b1 = leaves(x, b)
        y = bias_gelu(x1, b1, approximate=approx, impl="triton")
        dx, db = torch.autograd.grad(y, (x1, b1), dy)
        x2, b2 = leaves(x.double(), b.double())
        y_ref = F.gelu(x2 + b2, approximate=approx)
        rx, rb = torch.autograd.grad(y_ref, (x2, b2), dy.double())
        for name, out, ref in (("y", y, y_ref), ("dx", dx, rx), ("db", db, rb)):
            assert out.dtype == dtype
            assert rel_err(out, ref) < TOL[dtype], (approx, name)


def test_bias_gelu_fp16_3d_extremes_and_promotion():
    x = torch.tensor([[-1e4, -30.0, -8.0, -1.0, 0.0, 1.0, 8.0, 30.0, 1e4]], device=DEV)
    zeros = torch.zeros(9, device=DEV)
    for approx in ("tanh", "none"):
        y = bias_gelu(x, zeros, approximate=approx, impl="triton")
        torch.testing.assert_close(y, F.gelu(x, approximate=approx), rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, generator=g).to(DEV, torch.float16)
    b = torch.randn(40, generator=g).to(DEV, torch.float16)
    assert rel_err(bias_gelu(x, b, impl="triton"), F.gelu(x.double() + b.double(), approximate="tanh")) < 2e-3
    b32 = b.float()                      # bf16/fp16 x + fp32 bias promotes, as x + bias does
    assert bias_gelu(x, b32, impl="triton").dtype == torch.float32
    x1, b1 = leaves(x, b32)
    dx, db = torch.autograd.grad(bias_gelu(x1, b1, impl="triton").sum(), (x1, b1))
    assert dx.dtype == torch.float16 and db.dtype == torch.float32


def test_bias_gelu_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 5, generator=g, dtype=torch.float64) * 2).to(DEV).requires_grad_()
    b = torch.randn(5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    for approx in ("tanh", "none"):
        assert torch.autograd.gradcheck(lambda x, b, approx=approx: bias_gelu(x, b, approx, impl="triton"), (x, b))


# ----------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.fast_cases(shape=((1, 3), (3, 77), (130, 1000)))
def test_rms_norm_vs_float64(shape, dtype):
    m, n = shape
    g = torch.Generator().manual_seed(m * 7907 + n)
    x = (torch.randn(m, n, generator=g) * 3 + 1).to(DEV, dtype)
    w = (torch.randn(n, generator=g) * 0.5 + 1).to(DEV, dtype)
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)
    x2, w2 = leaves(x.double(), w.double())
    y_ref = F.rms_norm(x2, (n,), w2, 1e-6)
    refs = torch.autograd.grad(y_ref, (x2, w2), dy.double())
    for impl in ("triton", "torch"):
        x1, w1 = leaves(x, w)
        y = rms_norm(x1, w1, 1e-6, impl=impl)
        assert y.dtype == dtype and y.shape == x.shape
        grads = torch.autograd.grad(y, (x1, w1), dy)
        for name, out, ref in zip(("y", "dx", "dw"), (y, *grads), (y_ref, *refs)):
            assert out.dtype == dtype
            assert rel_err(out, ref) < TOL[dtype], (impl, name)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")   # F.rms_norm's, on the reference path
def test_rms_norm_no_weight_3d_and_mixed_dtype():
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 5, 96, generator=g) * 4).to(DEV, torch.bfloat16)
    dy = torch.randn(2, 5, 96, generator=g).to(DEV, torch.bfloat16)
    (x1,) = leaves(x)
    y = rms_norm(x1, None, 1e-5, impl="triton")
    (dx,) = torch.autograd.grad(y, (x1,), dy)
    (x2,) = leaves(x.double())
    y_ref = F.rms_norm(x2, (96,), None, 1e-5)
    (rx,) = torch.autograd.grad(y_ref, (x2,), dy.double())
    assert y.shape == x.shape and rel_err(y, y_ref) < 1e-2 and rel_err(dx, rx) < 1e-2

    w = torch.randn(96, generator=g).to(DEV)                      # fp32 weight, bf16 x
    x1, w1 = leaves(x, w)
    y = rms_norm(x1, w1, 1e-6, impl="triton")
    dx, dw = torch.autograd.grad(y, (x1, w1), dy)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert rms_norm(x, w, 1e-6, impl="torch").dtype == torch.bfloat16   # same contract on both paths
    x2, w2 = leaves(x.double(), w.double())
    y_ref = F.rms_norm(x2, (96,), w2, 1e-6)
    rx, rw = torch.autograd.grad(y_ref, (x2, w2), dy.double())
    assert rel_err(y, y_ref) < 1e-2 and rel_err(dx, rx) < 1e-2 and rel_err(dw, rw) < 1e-2


def test_rms_norm_only_input_grad_and_empty():
    x, w = torch.randn(4, 9, device=DEV), torch.randn(9, device=DEV)
    (x1,) = leaves(x)
    (dx,) = torch.autograd.grad(rms_norm(x1, w, impl="triton").sum(), (x1,))
    (x2,) = leaves(x.double())
    (rx,) = torch.autograd.grad(F.rms_norm(x2, (9,), w.double(), 1e-6).sum(), (x2,))
    assert rel_err(dx, rx) < 1e-5
    empty = torch.randn(0, 9, device=DEV)
    assert rms_norm(empty, w, impl="triton").shape == (0, 9)
    e1, w1 = leaves(empty, w)
    de, dw = torch.autograd.grad(rms_norm(e1, w1, impl="triton").sum(), (e1, w1))
    assert de.shape == (0, 9) and torch.equal(dw, torch.zeros_like(w))


def test_rms_norm_kernel_variants_agree():
    """The unmasked forward, several row blocks a program, prefetch on and off agree."""
    g = torch.Generator().manual_seed(12)
    x, dy = (torch.randn(9, 24, generator=g).to(DEV) for _ in range(2))
    w = torch.randn(24, generator=g).to(DEV)
    y, rstd = rms_mod.rms_fwd_rows(x, w, 1e-6)
    for a, r in zip(rms_mod.rms_fwd_rows(x, w, 1e-6, block_m=2), (y, rstd)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    x32, w32 = torch.randn(8, 32, generator=g).to(DEV), torch.randn(32, generator=g).to(DEV)
    for a, r in zip(rms_mod.rms_fwd_rows(x32, w32, 1e-6, block_m=2),            # unmasked
                    rms_mod.rms_fwd_rows(x32, w32, 1e-6, block_m=2, even=False)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    ref = rms_mod.rms_bwd_rows(dy, x, w, rstd, True)
    for prefetch in (True, False):
        out = rms_mod.rms_bwd_rows(dy, x, w, rstd, True, block_m=2, per_sm=1, prefetch=prefetch)
        for a, r in zip(out, ref):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    dx, dw = rms_mod.rms_bwd_rows(dy, x, w, rstd, False)
    assert dw is None
    torch.testing.assert_close(dx, ref[0], rtol=1e-6, atol=1e-6)


def test_rms_norm_gradcheck_float64():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    w = torch.randn(5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6, impl="triton"), (x, w))
    assert torch.autograd.gradcheck(lambda x: rms_norm(x, None, 1e-6, impl="triton"), (x,))


# ----------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.fast_cases(shape=((1, 3), (3, 77), (130, 1000)))
def test_swiglu_vs_float64(shape, dtype):
    m, n = shape
    g = torch.Generator().manual_seed(m * 37 + n)
    gate = (torch.randn(m, n, generator=g) * 3).to(DEV, dtype)
    up = torch.randn(m, n, generator=g).to(DEV, dtype)
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)
    g2, u2 = leaves(gate.double(), up.double())
    y_ref = F.silu(g2) * u2
    refs = torch.autograd.grad(y_ref, (g2, u2), dy.double())
    for impl in ("triton", "torch"):
        g1, u1 = leaves(gate, up)
        y = swiglu(g1, u1, impl=impl)
        assert y.dtype == dtype and y.shape == gate.shape
        grads = torch.autograd.grad(y, (g1, u1), dy)
        for name, out, ref in zip(("y", "dgate", "dup"), (y, *grads), (y_ref, *refs)):
            assert out.dtype == dtype
            assert rel_err(out, ref) < TOL[dtype], (impl, name)


def test_swiglu_3d_extremes_promotion_and_errors():
    gate = torch.tensor([[-1e4, -100.0, -30.0, -8.0, -1.0, 0.0, 1.0, 8.0, 30.0, 100.0, 1e4]], device=DEV)
    up = torch.linspace(-2, 2, 11, device=DEV)[None]
    g1, u1 = leaves(gate, up)
    y = swiglu(g1, u1, impl="triton")
    dg, du = torch.autograd.grad(y.sum(), (g1, u1))
    g2, u2 = leaves(gate, up)
    y_ref = F.silu(g2) * u2
    rg, ru = torch.autograd.grad(y_ref.sum(), (g2, u2))
    for out, ref in ((y, y_ref), (dg, rg), (du, ru)):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    g = torch.Generator().manual_seed(14)
    gate = torch.randn(2, 3, 40, generator=g).to(DEV, torch.float16)
    up = torch.randn(2, 3, 40, generator=g).to(DEV, torch.float16)
    assert rel_err(swiglu(gate, up, impl="triton"), F.silu(gate.double()) * up.double()) < 2e-3
    up32 = up.float()                    # fp16 gate * fp32 up promotes, as silu(gate) * up does
    assert swiglu(gate, up32, impl="triton").dtype == torch.float32
    g1, u1 = leaves(gate, up32)
    dg, du = torch.autograd.grad(swiglu(g1, u1, impl="triton").sum(), (g1, u1))
    assert dg.dtype == torch.float16 and du.dtype == torch.float32
    (g1,) = leaves(gate)                 # only gate asks for a gradient
    (dg_only,) = torch.autograd.grad(swiglu(g1, up32, impl="triton").sum(), (g1,))
    torch.testing.assert_close(dg_only, dg)
    assert swiglu(gate[:0], up[:0], impl="triton").shape == (0, 3, 40)
    with pytest.raises(ValueError):
        swiglu(gate, up[..., :1])        # no broadcasting


def test_swiglu_kernel_variants_agree():
    """Several programs with a masked tail (as on the GPU) agree with one large block."""
    g = torch.Generator().manual_seed(15)
    gate, up, dy = (torch.randn(7, 45, generator=g).to(DEV) for _ in range(3))
    y = sw_mod.swiglu_fwd_flat(gate, up, gate.dtype)
    torch.testing.assert_close(sw_mod.swiglu_fwd_flat(gate, up, gate.dtype, block=64), y, rtol=0, atol=0)
    for a, r in zip(sw_mod.swiglu_bwd_flat(dy, gate, up, block=64), sw_mod.swiglu_bwd_flat(dy, gate, up)):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_swiglu_gradcheck_float64():
    g = torch.Generator().manual_seed(16)
    gate = (torch.randn(2, 5, generator=g, dtype=torch.float64) * 2).to(DEV).requires_grad_()
    up = torch.randn(2, 5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(lambda g, u: swiglu(g, u, impl="triton"), (gate, up))


# ----------------------------------------------------------------------------- dispatch, modules
def test_cpu_path_is_plain_pytorch():
    x, w, b = torch.randn(4, 6, 10), torch.randn(10), torch.randn(10)
    assert torch.equal(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (10,), w, b, 1e-5))
    assert torch.equal(layer_norm(x, w, b, 1e-5, impl="torch"), F.layer_norm(x, (10,), w, b, 1e-5))
    assert torch.equal(bias_gelu(x, b), F.gelu(x + b, approximate="tanh"))
    assert torch.equal(bias_gelu(x, b, "none"), F.gelu(x + b))
    with pytest.raises(ValueError):
        bias_gelu(x, b, "sigmoid")


def test_modules_match_nn_layer_norm():
    ref = nn.LayerNorm(12, eps=1e-6)
    nn.init.normal_(ref.weight)
    nn.init.normal_(ref.bias)
    mod = LayerNorm(12, eps=1e-6).to(DEV)
    assert set(mod.state_dict()) == set(ref.state_dict())
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 12)
    torch.testing.assert_close(mod(x.to(DEV)).cpu(), ref(x), rtol=1e-5, atol=1e-5)
    nb = LayerNorm(12, bias=False)
    assert nb.bias is None and set(nb.state_dict()) == set(nn.LayerNorm(12, bias=False).state_dict())
    bg = BiasGeLU(12).to(DEV)
    assert torch.equal(bg(x.to(DEV)).cpu(), F.gelu(x, approximate="tanh")) or DEV == "cuda"
    assert kt.__all__ == ["bias_gelu", "layer_norm", "LayerNorm", "BiasGeLU", "rms_norm", "RMSNorm", "swiglu"]


def test_llama_ops_cpu_path_is_plain_pytorch():
    x, w, u = torch.randn(4, 6, 10), torch.randn(10), torch.randn(4, 6, 10)
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (10,), w, 1e-6))
    assert torch.equal(rms_norm(x, w, 1e-6, impl="torch"), F.rms_norm(x, (10,), w, 1e-6))
    assert torch.equal(rms_norm(x, None, 1e-5, impl="torch"), F.rms_norm(x, (10,), None, 1e-5))
    assert torch.equal(swiglu(x, u), F.silu(x) * u)
    assert torch.equal(swiglu(x, u, impl="torch"), F.silu(x) * u)
    with pytest.raises(ValueError):
        swiglu(x, u, impl="cuda")


def test_rms_norm_module_matches_nn_rms_norm():
    ref = nn.RMSNorm(12, eps=1e-6)
    nn.init.normal_(ref.weight)
    mod = RMSNorm(12, eps=1e-6).to(DEV)
    assert set(mod.state_dict()) == set(ref.state_dict()) and mod.eps == 1e-6
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 12)
    torch.testing.assert_close(mod(x.to(DEV)).cpu(), ref(x), rtol=1e-5, atol=1e-5)
    nw = RMSNorm(12, elementwise_affine=False)
    assert nw.weight is None and set(nw.state_dict()) == set(nn.RMSNorm(12, elementwise_affine=False).state_dict())


def _block(x, w, b, fc_bias):
    h = layer_norm(x, w, b, 1e-5, impl="triton")
    return bias_gelu(h * 2.0, fc_bias, impl="triton")


def _grads_of(fn, x, w, b, c):
    args = leaves(x, w, b, c)
    out = fn(*args)
    grads = torch.autograd.grad((out * out).sum(), args)
    return out.detach(), grads


def test_torch_compile_fullgraph_and_checkpoint():
    torch.manual_seed(5)
    x, w, b, c = (torch.randn(6, 33, device=DEV), torch.randn(33, device=DEV),
                  torch.randn(33, device=DEV), torch.randn(33, device=DEV))
    out, grads = _grads_of(_block, x, w, b, c)

    torch._dynamo.reset()
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)
    out_c, grads_c = _grads_of(compiled, x, w, b, c)
    torch._dynamo.reset()
    torch.testing.assert_close(out_c, out)
    for a, r in zip(grads_c, grads):
        torch.testing.assert_close(a, r)

    def ckpt(*a):
        return torch.utils.checkpoint.checkpoint(_block, *a, use_reentrant=False)
    out_k, grads_k = _grads_of(ckpt, x, w, b, c)
    torch.testing.assert_close(out_k, out)
    for a, r in zip(grads_k, grads):
        torch.testing.assert_close(a, r)


def _llama_block(x, w, c, d):
    h = rms_norm(x, w, 1e-6, impl="triton")
    return swiglu(h + c, h * d, impl="triton")


def test_torch_compile_fullgraph_and_checkpoint_llama_ops():
    torch.manual_seed(17)
    x, w, c, d = (torch.randn(6, 33, device=DEV), torch.randn(33, device=DEV),
                  torch.randn(33, device=DEV), torch.randn(33, device=DEV))
    out, grads = _grads_of(_llama_block, x, w, c, d)

    torch._dynamo.reset()
    compiled = torch.compile(_llama_block, backend="aot_eager", fullgraph=True)
    out_c, grads_c = _grads_of(compiled, x, w, c, d)
    torch._dynamo.reset()
    torch.testing.assert_close(out_c, out)
    for a, r in zip(grads_c, grads):
        torch.testing.assert_close(a, r)

    def ckpt(*a):
        return torch.utils.checkpoint.checkpoint(_llama_block, *a, use_reentrant=False)
    out_k, grads_k = _grads_of(ckpt, x, w, c, d)
    torch.testing.assert_close(out_k, out)
    for a, r in zip(grads_k, grads):
        torch.testing.assert_close(a, r)


# ----------------------------------------------------------------------------- DTensor (2 ranks, gloo)
def _meshes():
    """Meshes over the two ranks of a test pool (tests/harness.py): tp alone, and 2-D
    (dp, tp) meshes with either axis the real one."""
    from torch.distributed.device_mesh import init_device_mesh

    return (init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
            init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")),
            init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")))


def _reference(fn, dy, *ts):
    """fn's output and the gradients of its inputs, on plain tensors."""
    ls = leaves(*ts)
    out = fn(*ls)
    return out.detach(), torch.autograd.grad(out, ls, dy)


def _placed(fn, x, dy, mesh, xpl, inputs):
    """fn on x placed as `xpl` and `inputs` [(tensor, mesh, placements)]: its output
    (which must come back with x's placements) and the gradients, all gathered."""
    from torch.distributed.tensor import distribute_tensor
    xd = distribute_tensor(x, mesh, xpl).requires_grad_()
    ds = [distribute_tensor(t, m, pl).requires_grad_() for t, m, pl in inputs]
    y = fn(xd, *ds)
    assert tuple(y.placements) == tuple(xpl), (y.placements, xpl)
    y.backward(distribute_tensor(dy, mesh, xpl))
    return y.full_tensor(), [xd.grad.full_tensor()] + [d.grad.full_tensor() for d in ds]


def _close(got, want):
    out, grads = got
    r_out, r_grads = want
    torch.testing.assert_close(out, r_out, rtol=1e-5, atol=1e-5)
    assert len(grads) == len(r_grads)
    for a, r in zip(grads, r_grads):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def _raises(fn, *a) -> str:
    try:
        fn(*a)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{fn} must raise ValueError")


def _impls():
    return ("torch", "triton") if _common.interpreting() else ("torch",)


def _dtensor_worker(rank, world):
    from torch.distributed.tensor import Replicate, Shard

    tp, dp2, tp2 = _meshes()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=g)       # (batch, seq, hidden); hidden 5 shards 3/2
    w, b, dy = torch.randn(5, generator=g), torch.randn(5, generator=g), torch.randn(2, 6, 5, generator=g)
    R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
    ln_ref = _reference(lambda x, w, b: F.layer_norm(x, (5,), w, b, 1e-5), dy, x, w, b)
    bg_ref = _reference(lambda x, b: F.gelu(x + b, approximate="tanh"), dy, x, b)
    for impl in _impls():
        def ln(x, w, b, impl=impl):
            return layer_norm(x, w, b, 1e-5, impl=impl)

        def bg(x, b, impl=impl):
            return bias_gelu(x, b, impl=impl)
        # sequence parallel: x Shard(seq), weight and bias Replicate -> Partial grads
        _close(_placed(ln, x, dy, tp, [S1], [(w, tp, [R]), (b, tp, [R])]), ln_ref)
        # 2-D mesh, batch on dp and sequence on tp; weights on the 2-D mesh and on the tp
        # submesh (whose gradient then holds no dp sum: FSDP/DDP do that one)
        _close(_placed(ln, x, dy, dp2, [S0, S1], [(w, dp2, [R, R]), (b, dp2, [R, R])]), ln_ref)
        _close(_placed(ln, x, dy, tp2, [S0, S1], [(w, tp2, [R, R]), (b, tp2["tp"], [R])]), ln_ref)
        # column parallel: x Shard(-1) (uneven 3/2), bias Shard(0)
        _close(_placed(bg, x, dy, tp, [S2], [(b, tp, [S0])]), bg_ref)
        # bias replicated while x is column sharded: the bias is sliced locally
        _close(_placed(bg, x, dy, tp, [S2], [(b, tp, [R])]), bg_ref)
        # sequence parallel bias-GeLU: bias grad is a partial sum over tp
        _close(_placed(bg, x, dy, tp, [S1], [(b, tp, [R])]), bg_ref)
    _raises(_placed, lambda x, w: layer_norm(x, w, None), x, dy, tp, [S2], [(w, tp, [R])])   # sharded hidden dim


def test_dtensor_two_ranks_gloo(pools):
    pools.run(2, _dtensor_worker)


def _dtensor_llama_worker(rank, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp, dp2, tp2 = _meshes()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=g)       # (batch, seq, hidden); hidden 5 shards 3/2
    u, dy = torch.randn(2, 6, 5, generator=g), torch.randn(2, 6, 5, generator=g)
    w = torch.randn(5, generator=g)
    R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
    rms_ref = _reference(lambda x, w: F.rms_norm(x, (5,), w, 1e-6), dy, x, w)
    rms_nw_ref = _reference(lambda x: F.rms_norm(x, (5,), None, 1e-6), dy, x)
    sw_ref = _reference(lambda g, u: F.silu(g) * u, dy, x, u)
    for impl in _impls():
        def rms(x, w=None, impl=impl):
            return rms_norm(x, w, 1e-6, impl=impl)

        def sw(g, u, impl=impl):
            return swiglu(g, u, impl=impl)
        # sequence parallel: x Shard(seq), weight Replicate -> Partial grad over tp
        _close(_placed(rms, x, dy, tp, [S1], [(w, tp, [R])]), rms_ref)
        _close(_placed(rms, x, dy, tp, [S1], []), rms_nw_ref)
        # 2-D meshes, batch on dp and sequence on tp; weight on the 2-D mesh and on the tp submesh
        _close(_placed(rms, x, dy, dp2, [S0, S1], [(w, dp2, [R, R])]), rms_ref)
        _close(_placed(rms, x, dy, tp2, [S0, S1], [(w, tp2["tp"], [R])]), rms_ref)
        # SwiGLU: gate and up alike, column parallel (uneven 3/2), sequence sharded, replicated, 2-D
        for mesh, pl in ((tp, [S2]), (tp, [S1]), (tp, [R]), (dp2, [S0, S2]), (tp2, [S1, S2])):
            _close(_placed(sw, x, dy, mesh, pl, [(u, mesh, pl)]), sw_ref)
    assert "RMSNorm" in _raises(rms_norm, distribute_tensor(x, tp, [S2]), distribute_tensor(w, tp, [R]))
    assert "placements" in _raises(swiglu, distribute_tensor(x, tp, [S1]), distribute_tensor(u, tp, [S2]))
    assert "both" in _raises(swiglu, distribute_tensor(x, tp, [S2]), u)
    assert "both" in _raises(swiglu, x, distribute_tensor(u, tp, [S2]))


def test_dtensor_llama_ops_two_ranks_gloo(pools):
    pools.run(2, _dtensor_llama_worker)
