"""The parity helper: the same model, seed and batches on one process and
under a parallel layout must give the same loss, gradients (gathered to full
tensors) and updated parameters over several optimizer steps.

Runs inside every rank of a worker pool: the one-process reference is computed
locally on each rank (no communication), the parallel run uses the mesh. The
error of a tensor is ||parallel - reference|| / ||reference|| (norm-relative, so
entries near zero do not blow it up); the report keeps the worst of each kind.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from meshtron import train
from meshtron.checkpoint import fqn as clean_name



def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(floor))


@dataclass
class ParityReport:
    loss: float = 0.0
    grad: float = 0.0
    param: float = 0.0
    grad_norm: float = 0.0
    worst_grad_name: str = ""
    worst_param_name: str = ""
    names: set = field(default_factory=set)     # parameters this rank checked
    ref_names: set = field(default_factory=set)
    losses: list = field(default_factory=list)  # (reference, parallel) per step

    @property
    def worst(self) -> float:
        return max(self.loss, self.grad, self.param, self.grad_norm)


def run_parity(mesh, build_model, parallelize, batches, *, micro_batches: int = 1, lr: float = 1e-3,
               max_norm: float | None = None, forward_backward=None, fb_kwargs=None, ref_fb_kwargs=None) -> ParityReport:
    """batches: list of global (x, y) batches, one per optimizer step.
    parallelize(model, mesh) -> model under the layout. forward_backward runs the
    parallel side (default meshtron.train.forward_backward; pipeline parallelism
    passes its own); the reference always runs the plain one."""
    forward_backward = forward_backward or train.forward_backward
    report = ParityReport()

    # AdamW's step is lr * g / (|g| + eps) per entry (first step): for entries with
    # |g| << eps it is linear in g, for |g| >> eps it is sign(g). With the usual
    # eps=1e-8, entries of ~1e-7 (rounding-noise-sized next to the tensor's norm,
    # e.g. grads that cancel, or the key bias, which softmax ignores) get full
    # lr-sized steps whose value rides on their rounding noise, so two correct
    # runs differ by ~1e-4 in updated weights. eps=1e-4 (under the grads that
    # matter here, ~1e-3) keeps AdamW's state and update rule but weighs each
    # entry's step by its size, so weight errors track gradient errors.
    ref = build_model()
    ref_opt = train.build_optimizer(ref, lr, eps=1e-4)
    par = parallelize(build_model(), mesh)
    par_opt = train.build_optimizer(par, lr, eps=1e-4)
    index, count = train.batch_slice(mesh)
    # a tied weight has one name in the reference and may have a copy under each
    # name elsewhere (a pipeline's first and last stages): map names to the reference's
    canonical, seen = {}, {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        canonical[n] = seen.setdefault(id(p), n)

    for x, y in batches:
        # reference: the whole global batch at once, one process
        ref_loss = train.forward_backward(ref, [(x, y)], None, **(ref_fb_kwargs or {}))
        ref_grads = {n: p.grad.detach().float().clone() for n, p in ref.named_parameters()}
        # a gradient that is zero in exact arithmetic (a key bias: softmax ignores a
        # per-row shift) is pure rounding noise, and noise has no relative error:
        # measure such tensors against 1e-3 of the whole gradient's norm instead
        floor = 1e-3 * float(torch.stack([g.norm() for g in ref_grads.values()]).norm())
        ref_norm = train.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        # parallel: this rank's slice of the batch, in micro-batches
        xs, ys = x.chunk(count)[index], y.chunk(count)[index]
        mbs = list(zip(xs.chunk(micro_batches), ys.chunk(micro_batches)))
        loss = forward_backward(par, mbs, mesh, **(fb_kwargs or {}))
        report.losses.append((float(ref_loss), float(loss)))
        report.loss = max(report.loss, abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)))
        for n, p in par.named_parameters():
            n = canonical[clean_name(n)]
            report.names.add(n)
            e = rel_err(full(p.grad), ref_grads[n], floor) if p.grad is not None else float("inf")
            if e > report.grad:
                report.grad, report.worst_grad_name = e, n
        norm = train.clip_grad_norm_(par.parameters(), max_norm, mesh, getattr(par, "norm_parameters", lambda: None)())
        report.grad_norm = max(report.grad_norm, abs(float(norm) - float(ref_norm)) / float(ref_norm))
        par_opt.step()
        par_opt.zero_grad(set_to_none=True)

    ref_params = dict(ref.named_parameters())
    report.ref_names = set(ref_params)
    for n, p in par.named_parameters():
        e = rel_err(full(p), ref_params[canonical[clean_name(n)]].detach().float())
        if e > report.param:
            report.param, report.worst_param_name = e, canonical[clean_name(n)]
    return report


def assert_parity(reports: list[ParityReport], tol: float) -> ParityReport:
    """Combine the per-rank reports: every reference parameter must have been
    checked on some rank, and every error must be under tol."""
    checked = set().union(*(r.names for r in reports))
    missing = reports[0].ref_names - checked
    assert not missing, f"parameters never compared on any rank: {sorted(missing)}"
    worst = max(reports, key=lambda r: r.worst)
    assert worst.worst < tol, (
        f"parity failed (tol {tol:g}): loss {worst.loss:.3g}, grad {worst.grad:.3g} ({worst.worst_grad_name}), "
        f"param {worst.param:.3g} ({worst.worst_param_name}), grad norm {worst.grad_norm:.3g}; losses {worst.losses}")
    return worst


def tiny_batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        xy = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((xy[:, :-1], xy[:, 1:]))
    return out
