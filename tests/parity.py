"""The parity helper: the same model, seed and batches on one process and
under a parallel layout must give the same loss, gradients (gathered to full
tensors) and updated parameters over several optimizer steps.

Runs inside every rank of a worker pool: the one-process reference is computed
locally on each rank (no communication), the parallel run uses the mesh. The
error of a tensor is ||parallel - reference|| / ||reference|| (norm-relative, so
entries near zero do not blow it up); the report keeps the worst of each kind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtron.distributed.data_parallel import autocast_dtype
from meshtron.distributed.mesh import batch_slice, degree
from meshtron.distributed.pipeline_parallel import Pipeline
from meshtron.distributed.reduce import clip_grad_norm_
from meshtron.models.common.moe import end_step, moe_blocks, set_aux_grad_scale
from meshtron.train.checkpoint import fqn as clean_name
from meshtron.train.optim import build_optimizer
from meshtron.train.step import forward_backward


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(floor))


def sharded_errors(named, ref: dict, floor: float) -> list[tuple[str, float]]:
    """[(name, rel_err(full(t), ref[name]))] for (name, t) pairs, without gathering: each
    rank compares its shard with the same slice of the reference (distribute_tensor with
    src_data_rank=None slices, sending nothing), and the squared differences are summed
    over each mesh in one all-reduce, a replicated shard counted once. A gather per tensor
    and step was most of a tiny model's parity check."""
    out, per_mesh = [], {}
    for n, t in named:
        r = ref[n]
        if t is None or t.shape != r.shape:
            out.append((n, float("inf")))
        elif not isinstance(t, DTensor) or any(p.is_partial() for p in t.placements):
            out.append((n, rel_err(full(t), r, floor)))
        else:
            mine = distribute_tensor(r, t.device_mesh, t.placements, src_data_rank=None).to_local()
            copies = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())
            squares = (t.to_local().detach().float() - mine).pow(2).sum() / copies
            per_mesh.setdefault(t.device_mesh, []).append((n, squares, r.norm().clamp_min(floor)))
    for mesh, rows in per_mesh.items():
        summed = torch.stack([s for _, s, _ in rows])
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(summed, group=mesh.get_group(dim))
        out += [(n, float(s.sqrt() / norm)) for (n, _, norm), s in zip(rows, summed)]
    return out


@dataclass
class ParityReport:
    loss: float = 0.0
    grad: float = 0.0
    param: float = 0.0
    grad_norm: float = 0.0
    aux: float = 0.0                            # mixture of experts: the aux loss and the expert biases
    buffer: float = 0.0
    worst_grad_name: str = ""
    worst_param_name: str = ""
    names: set = field(default_factory=set)     # parameters this rank checked
    ref_names: set = field(default_factory=set)
    losses: list = field(default_factory=list)  # (reference, parallel) per step
    noise: ParityReport | None = None           # run_parity(noise=True): one fp32 process against the same float64

    @property
    def worst(self) -> float:
        return max(self.loss, self.grad, self.param, self.grad_norm, self.aux, self.buffer)

    def grads(self, named, ref_grads: dict, canonical: dict, floor: float) -> None:
        named = [(canonical[clean_name(n)], p.grad) for n, p in named]
        self.names.update(n for n, _ in named)
        for n, e in sharded_errors(named, ref_grads, floor):
            if e > self.grad:
                self.grad, self.worst_grad_name = e, n

    def params(self, named, ref_params: dict, canonical: dict) -> None:
        self.ref_names = set(ref_params)
        named = [(canonical[clean_name(n)], p.detach()) for n, p in named]
        ref = {n: ref_params[n].detach().float() for n, _ in named}
        for n, e in sharded_errors(named, ref, 1e-12):
            if e > self.param:
                self.param, self.worst_param_name = e, n


# run_parity(noise=True): the layout may err by this many times what fp32 rounding alone
# gives one process on the same steps (both measured against float64)
NOISE_MARGIN = 10


@dataclass
class _Reference:
    """The reference's step: its loss, its gradients before clipping, their floor
    (below), and its clipped norm; the other sides are measured against them."""
    loss: float
    grads: dict
    floor: float
    norm: float


def _in_reference_order(t: torch.Tensor, count: int, micro: int) -> torch.Tensor:
    """The global batch in micro-batches whose i-th holds every rank's i-th (what an
    MoE's routing statistics sum over)."""
    return t.view(count, micro, -1, t.shape[-1]).transpose(0, 1).reshape(t.shape)


def _clip_and_step(params, opt, max_norm, *norm_args) -> torch.Tensor:
    norm = clip_grad_norm_(params, max_norm, *norm_args)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def _reference_step(ref, opt, x, y, kwargs: dict, max_norm) -> _Reference:
    loss = forward_backward([ref], x, y, None, **kwargs)
    grads = {n: p.grad.detach().float().clone() for n, p in ref.named_parameters()}
    # a gradient that is zero in exact arithmetic (a key bias: softmax ignores a
    # per-row shift) is pure rounding noise, and noise has no relative error:
    # measure such tensors against 1e-3 of the whole gradient's norm instead
    floor = 1e-3 * float(torch.stack([g.norm() for g in grads.values()]).norm())
    return _Reference(float(loss), grads, floor, float(_clip_and_step(ref.parameters(), opt, max_norm)))


def _noise_step(noise: ParityReport, solo, opt, x, y, kwargs: dict, max_norm, ref: _Reference, canonical) -> None:
    """One plain fp32 process's step against the float64 reference's."""
    loss = forward_backward([solo], x, y, None, **kwargs)
    noise.loss = max(noise.loss, abs(float(loss) - ref.loss) / abs(ref.loss))
    noise.grads(solo.named_parameters(), ref.grads, canonical, ref.floor)
    norm = _clip_and_step(solo.parameters(), opt, max_norm)
    noise.grad_norm = max(noise.grad_norm, abs(float(norm) - ref.norm) / ref.norm)


def _layout_step(report: ParityReport, parts, opt, mesh, pipeline, x, y, micro_batches: int, kwargs: dict, max_norm,
                 ref: _Reference, canonical, after_step=None) -> None:
    """The layout's step on this rank's slice of the batch, in micro-batches;
    after_step(parts) after its optimizer step."""
    loss = forward_backward(parts, x, y, mesh, microbatches=micro_batches, pipeline=pipeline, **kwargs)
    report.losses.append((ref.loss, float(loss)))
    report.loss = max(report.loss, abs(float(loss) - ref.loss) / abs(ref.loss))
    report.grads((np for m in parts for np in m.named_parameters()), ref.grads, canonical, ref.floor)
    norm = _clip_and_step([p for m in parts for p in m.parameters()], opt, max_norm, mesh,
                          pipeline.norm_parameters() if pipeline else None)
    if after_step is not None:
        after_step(parts)
    report.grad_norm = max(report.grad_norm, abs(float(norm) - ref.norm) / ref.norm)


def _moe_step(report: ParityReport, ref, parts, mesh, pipeline) -> None:
    """The MoE statistics of the step (the aux loss), reset for the next."""
    ref_aux, aux = end_step(moe_blocks([ref])).aux_loss, end_step(moe_blocks(parts)).aux_loss
    if pipeline is not None and degree(mesh, "pp") > 1:
        torch.distributed.all_reduce(aux, group=mesh["pp"].get_group())
    report.aux = max(report.aux, abs(float(aux - ref_aux)) / max(float(ref_aux), 1e-12))


def _final_state(report: ParityReport, ref, parts, solo, canonical) -> None:
    """The updated weights and the expert biases after the last step."""
    ref_buffers = dict(ref.named_buffers())
    for n, b in (nb for m in parts for nb in m.named_buffers()):
        if n.endswith("expert_bias"):
            report.buffer = max(report.buffer, rel_err(b.float(), ref_buffers[clean_name(n)].float()))
    ref_params = dict(ref.named_parameters())
    report.params((np for m in parts for np in m.named_parameters()), ref_params, canonical)
    if solo is not None:
        report.noise.params(solo.named_parameters(), ref_params, canonical)


def run_parity(mesh, build_model, parallelize, batches, *, micro_batches: int = 1, lr: float = 1e-3,
               max_norm: float | None = None, fb_kwargs=None, ref_fb_kwargs=None, noise: bool = False,
               build_ref=None, rank_major: bool = False, after_step=None) -> ParityReport:
    """batches: list of global (x, y) batches, one per optimizer step.
    parallelize(model, mesh) -> the model under the layout, or a Pipeline of its
    stages. Both sides run the trainer's forward_backward, clipping and AdamW;
    the reference is the plain model on the whole batch, in this process.

    build_ref: builds the reference instead of build_model (FP8: the model converted
    as the layout converts it). rank_major: the reference's micro-batches are the
    ranks' own, in rank order (FP8 scales each forward's activations by their own
    maximum). after_step(parts): run after the parallel optimizer step.

    noise=True: the reference runs in float64, and one more plain fp32 process runs
    beside it; its errors against float64 (report.noise) are what fp32 rounding alone
    costs on these steps, and assert_parity allows the layout NOISE_MARGIN times that."""
    report = ParityReport(noise=ParityReport() if noise else None)
    fb_kwargs, ref_fb_kwargs = fb_kwargs or {}, ref_fb_kwargs or {}
    # AdamW's step is lr * g / (|g| + eps) per entry (first step): for entries with
    # |g| << eps it is linear in g, for |g| >> eps it is sign(g). With the usual
    # eps=1e-8, entries of ~1e-7 (rounding-noise-sized next to the tensor's norm,
    # e.g. grads that cancel, or the key bias, which softmax ignores) get full
    # lr-sized steps whose value rides on their rounding noise, so two correct
    # runs differ by ~1e-4 in updated weights. eps=1e-4 (under the grads that
    # matter here, ~1e-3) keeps AdamW's state and update rule but weighs each
    # entry's step by its size, so weight errors track gradient errors.
    build_ref = build_ref or build_model
    ref = build_ref().double() if noise else build_ref()
    ref_opt = build_optimizer(ref, lr, eps=1e-4)
    solo = build_ref() if noise else None
    solo_opt = build_optimizer(solo, lr, eps=1e-4) if noise else None
    par = parallelize(build_model(), mesh)
    pipeline = par if isinstance(par, Pipeline) else None
    parts = pipeline.parts if pipeline else [par]
    par_opt = build_optimizer(parts, lr, eps=1e-4)
    # the aux loss's gradient scale, a part of each side's layout (meshtron.train.layout.build_model's)
    for model in (ref, solo):
        set_aux_grad_scale(moe_blocks([model] if model is not None else []), 1, ref_fb_kwargs.get("microbatches", 1))
    set_aux_grad_scale(moe_blocks(parts), degree(mesh, "dense_dp") if mesh is not None else 1,
                       pipeline.microbatches if pipeline else micro_batches)
    index, count = batch_slice(mesh)
    # a tied weight has one name in the reference and may have a copy under each
    # name elsewhere (a pipeline's first and last stages): map names to the reference's
    canonical, seen = {}, {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        canonical[n] = seen.setdefault(id(p), n)

    for x, y in batches:
        xr, yr = (t if rank_major else _in_reference_order(t, count, ref_fb_kwargs.get("microbatches", 1))
                  for t in (x, y))
        step = _reference_step(ref, ref_opt, xr, yr, ref_fb_kwargs, max_norm)
        if noise:
            _noise_step(report.noise, solo, solo_opt, xr, yr, ref_fb_kwargs, max_norm, step, canonical)
        _layout_step(report, parts, par_opt, mesh, pipeline, x.chunk(count)[index], y.chunk(count)[index],
                     micro_batches, fb_kwargs, max_norm, step, canonical, after_step)
        if moe_blocks([ref]):
            _moe_step(report, ref, parts, mesh, pipeline)
    _final_state(report, ref, parts, solo, canonical)
    return report


def assert_parity(reports: list[ParityReport], tol: float) -> ParityReport:
    """Combine the per-rank reports: every reference parameter must have been
    checked on some rank, and every error must be under tol, or, where the reports
    measured fp32's noise (run_parity(noise=True)), under NOISE_MARGIN times the
    largest error of one fp32 process if that is the larger."""
    checked = set().union(*(r.names for r in reports))
    missing = reports[0].ref_names - checked
    assert not missing, f"parameters never compared on any rank: {sorted(missing)}"
    worst = max(reports, key=lambda r: r.worst)
    noise = max((r.noise.worst for r in reports if r.noise), default=0.0)
    tol = max(tol, NOISE_MARGIN * noise)
    assert worst.worst < tol, (
        f"parity failed (tol {tol:g}, fp32 noise {noise:g}): loss {worst.loss:.3g}, grad {worst.grad:.3g} "
        f"({worst.worst_grad_name}), param {worst.param:.3g} ({worst.worst_param_name}), grad norm "
        f"{worst.grad_norm:.3g}, aux {worst.aux:.3g}, expert bias {worst.buffer:.3g}; losses {worst.losses}")
    return worst


def tiny_batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        xy = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((xy[:, :-1], xy[:, 1:]))
    return out


def layout(pcfg, spec=None):
    """run_parity's `parallelize`: the model's spec (the GPT's by default) under pcfg."""
    from meshtron.models import gpt
    spec = spec or gpt.SPEC

    def apply(model, mesh):
        spec.parallelize(model, mesh, pcfg)
        return model
    return apply


def pipelined(pcfg, spec, cfg, microbatches: int = 2, schedule: str = "1f1b"):
    """run_parity's `parallelize` for pp=2: the model's split, each stage under pcfg."""
    from meshtron.distributed.pipeline_parallel import split_model
    from meshtron.train.loss import cross_entropy_sum

    def apply(model, mesh):
        pipe = split_model(model, mesh, schedule, 1, microbatches, spec.pipeline_split(cfg, 2))
        for part in pipe.parts:
            spec.parallelize(part, mesh, pcfg)
        pipe.build_schedule(cross_entropy_sum)
        return pipe
    return apply


def fb_kwargs(mesh, pcfg) -> dict:
    """What the trainer passes forward_backward for this layout."""
    return {"zero": pcfg.zero, "autocast": autocast_dtype(mesh, pcfg.dtype, pcfg.mixed_precision)}


def perturbed_builder(factory):
    """A builder of factory()'s model, seeded, its 1-D parameters (norms, biases) moved
    off their initial values: a placement or mapping mistake then shows."""
    def make():
        torch.manual_seed(0)
        model = factory()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
        return model
    return make
