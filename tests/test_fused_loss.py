"""The fused output projection + cross-entropy against the plain path (F.linear,
then F.cross_entropy on the whole logits), one process, fp32: the same loss and
gradients of the hidden states and of the head, to 1e-6 (norm-relative), on odd
shapes, ignored labels, chunk sizes that do not divide the token count, a tied
head, and through a model's forward_backward."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from meshtron.distributed.fused_loss import fused_linear_cross_entropy_sum
from meshtron.models import GPT, gpt_config
from meshtron.models.llama.model import PRESETS as LLAMA
from meshtron.models.llama.model import Llama
from meshtron.train.loss import IGNORE_INDEX, FusedLoss, cross_entropy_sum, forward_kwargs, output_head
from meshtron.train.step import forward_backward

TOL = 1e-6


def rel(a, b):
    return float((a - b).norm() / b.norm())


def _case(b, t, d, v, seed, ignored=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype) * 0.3
    y = torch.randint(0, v, (b, t), generator=g)
    y[torch.rand(b, t, generator=g) < ignored] = IGNORE_INDEX
    return h, w, y


def _both(h, w, y, chunk, grad_out=1.0):
    """(loss, dh, dw) of the plain path and of the fused one."""
    out = []
    for fused in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            loss = fused_linear_cross_entropy_sum(hh, ww, y, IGNORE_INDEX, chunk)
        else:
            loss = F.cross_entropy(F.linear(hh, ww).flatten(0, 1), y.flatten(), reduction="sum",
                                   ignore_index=IGNORE_INDEX)
        (loss * grad_out).backward()
        out.append((loss.detach(), hh.grad, ww.grad))
    return out


@pytest.mark.parametrize("b,t,d,v,chunk,ignored", [
    (2, 7, 5, 11, 3, 0.0),        # chunk does not divide 14 tokens
    (3, 5, 16, 97, 4, 0.3),       # ignored labels, odd vocabulary
    (1, 13, 8, 33, 1, 0.5),       # one token per chunk
    (2, 9, 12, 50, 100, 0.2),     # one chunk larger than the tokens
    (4, 16, 32, 257, None, 0.1),  # the default chunk
])
def test_fused_matches_plain_cross_entropy(b, t, d, v, chunk, ignored):
    h, w, y = _case(b, t, d, v, seed=b * 100 + v, ignored=ignored)
    (l0, dh0, dw0), (l1, dh1, dw1) = _both(h, w, y, chunk, grad_out=0.37)
    assert abs(float(l1 - l0)) / abs(float(l0)) < TOL
    assert rel(dh1, dh0) < TOL and rel(dw1, dw0) < TOL


def test_ignored_rows_get_no_gradient_and_all_ignored_is_zero():
    h, w, y = _case(2, 6, 4, 9, seed=3)
    y[0] = IGNORE_INDEX
    (l0, dh0, _), (l1, dh1, _) = _both(h, w, y, chunk=5)
    assert float(dh1[0].abs().max()) == 0.0
    assert abs(float(l1 - l0)) / abs(float(l0)) < TOL
    y[:] = IGNORE_INDEX
    (_, _, dw0), (l1, dh1, dw1) = _both(h, w, y, chunk=5)
    assert float(l1) == 0.0 and float(dh1.abs().max()) == 0.0 and float(dw1.abs().max()) == 0.0


def test_no_grad_computes_the_loss_only():
    h, w, y = _case(2, 5, 4, 9, seed=4, ignored=0.2)
    with torch.no_grad():
        loss = fused_linear_cross_entropy_sum(h.requires_grad_(), w.requires_grad_(), y, IGNORE_INDEX, 3)
    ref = F.cross_entropy(F.linear(h, w).flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    ref = ref.detach()
    assert not loss.requires_grad and abs(float(loss - ref)) / float(ref) < TOL


def test_float64_is_kept():
    h, w, y = _case(2, 5, 4, 9, seed=5, dtype=torch.float64)
    (l0, dh0, dw0), (l1, dh1, dw1) = _both(h, w, y, chunk=3)
    assert l1.dtype == torch.float64 and rel(dh1, dh0) < 1e-12 and rel(dw1, dw0) < 1e-12


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [
    lambda: GPT(gpt_config("tiny", n_layers=2, tie_embeddings=True), seed=0),
    lambda: Llama(replace(LLAMA["llama-tiny"], n_layers=2, tie_embeddings=False), seed=0),
], ids=["gpt-tied", "llama-untied"])
def test_model_step_fused_equals_plain(build):
    """forward_backward with the fused loss (the model returns hidden states) gives
    the plain path's loss and every parameter's gradient; a tied head's weight gets
    the embedding's and the head's gradients summed."""
    plain, fused = build(), build()
    vocab = plain.config.vocab_size
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, vocab, (3, 9), generator=g), torch.randint(0, vocab, (3, 9), generator=g)
    y[1, 2:7] = IGNORE_INDEX
    loss_fn = FusedLoss(output_head([fused]), chunk=5)
    assert forward_kwargs(loss_fn) == {"return_hidden": True} and forward_kwargs(cross_entropy_sum) == {}
    l0 = forward_backward([plain], x, y, None, microbatches=3)
    l1 = forward_backward([fused], x, y, None, microbatches=3, loss_fn=loss_fn)
    assert abs(float(l1 - l0)) / float(l0) < TOL
    g0, g1 = _grads(plain), _grads(fused)
    assert g0.keys() == g1.keys()
    worst = max(rel(g1[n], g0[n]) for n in g0)
    assert worst < TOL, worst


def test_fused_loss_refuses_a_head_with_bias():
    with pytest.raises(ValueError, match="without bias"):
        FusedLoss(torch.nn.Linear(4, 9))


def test_mismatched_shapes_are_refused():
    h, w, y = _case(2, 5, 4, 9, seed=6)
    with pytest.raises(ValueError, match="do not match"):
        fused_linear_cross_entropy_sum(h, w, y[:, :4])
    with pytest.raises(ValueError, match="do not match"):
        fused_linear_cross_entropy_sum(h[..., :3], w, y)


def test_one_process_bf16_under_autocast_keeps_an_fp32_head():
    """One process in bf16 runs under autocast with fp32 weights: the fused loss
    computes in the hidden states' bf16, as autocast's F.linear does, and trains
    as the plain loss does (to bf16 rounding)."""
    from meshtron.cli.train import main
    argv = ["--model", "llama-tiny", "--steps", "3", "--dtype", "bf16", "--log-interval", "1"]
    plain, fused = main(argv + ["--no-fused-loss"]), main(argv + ["--fused-loss"])
    assert len(fused) == 3 and all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(plain, fused)), (plain, fused)




def test_the_fused_loss_computes_in_the_forwards_autocast_dtype():
    """One process's bf16 autocasts the forward and runs the loss outside it: the
    unfused head's matmul is bf16 whatever the final norm returns (a LayerNorm
    returns fp32 under CUDA's autocast, as GPT's does here). The layout's fused loss
    computes its matmul in that bf16 too: the plain path's loss to 1e-6 (8e-8 here),
    not that of fp32 logits (8e-6 apart; on a GPU, fp32 GEMMs: twice the step)."""
    from meshtron.distributed.data_parallel import autocast_dtype
    from meshtron.train.loss import loss_function
    plain, fused = (GPT(gpt_config("tiny", n_layers=2), seed=0) for _ in range(2))
    vocab = plain.config.vocab_size
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, vocab, (2, 64), generator=g), torch.randint(0, vocab, (2, 64), generator=g)
    bf16 = autocast_dtype(None, "bf16")
    with torch.autocast("cpu", dtype=bf16):
        assert fused(x, return_hidden=True).dtype == torch.float32   # the case this covers
    loss_fn = loss_function(torch.device("cpu"), False, output_head([fused]), bf16)
    l0 = forward_backward([plain], x, y, None, autocast=bf16)
    l1 = forward_backward([fused], x, y, None, loss_fn=loss_fn, autocast=bf16)
    assert abs(float(l1 - l0)) <= 1e-6 * float(l0), (float(l0), float(l1))
