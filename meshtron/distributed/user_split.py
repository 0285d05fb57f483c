"""Which pipeline stage holds which module of a user model, and the check that
the stages compute what one process computes (the stages themselves:
user_pipeline).

Placement is by the order a probe forward calls the modules in (hooks record
it), not by the order they were registered in: a module with parameters goes to
the stage between whose cut blocks it is called (the embedding before the first
cut: stage 0; the final norm and the head after the last: the last stage); a
module without parameters (rotary tables, dropout, a parameter-free norm) runs
on every stage, as the model's forward calls it.

Then `check_split` runs the stages one after another on the probe, sharing the
model's weights, and compares what each stage sends, the output and every
gradient with the one-process forward: whatever else crosses a cut (an
embedding output that every block reads, a block's output used after the
head) makes a difference, and the split is refused with a one-line error
before any stage is built. Refused before that, by the probe: a block called
twice or out of order, a module with parameters called on two stages,
parameters registered directly on the modules that every stage runs.
The probe and the check run in eval mode (dropout off); they cost three
forwards and two backwards of the whole model on the probe, once.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from meshtron.distributed.user_pipeline import UserSplit, _hidden, _output_tensor

# the stages run the operations one process runs, on the same tensors; a tensor
# missing at a cut changes results by orders of magnitude more
CHECK_TOL = 1e-6


def user_stages(model: nn.Module, blocks: str, points: list[str],
                probe: torch.Tensor | None = None) -> tuple[list[list[str]], UserSplit]:
    """Stages of any model cut before the blocks named in `points` (blocks of the
    container `blocks`, e.g. "model.layers"): the module names each stage holds
    and the UserSplit that builds them (split_model(..., user=)). `probe`: token
    ids to run the model on (default: 2 x 16 random ids below the smallest
    embedding's size), on the model's device; the model must hold real weights.
    Raises ValueError, naming the obstacle, for a split that would not compute
    what one process computes."""
    container = model.get_submodule(blocks)
    names = [f"{blocks}.{n}" for n, _ in container.named_children()]
    unknown = [p for p in points if p not in names]
    if unknown:
        raise ValueError(f"split points {unknown} are not blocks of {blocks} ({names[0]} ... {names[-1]})")
    cuts = [names.index(p) for p in points]
    if cuts != sorted(set(cuts)) or 0 in cuts:
        raise ValueError(f"split points {points} must be increasing blocks after {names[0]}")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("user_stages runs the model on a probe batch: build it with real weights, not on the "
                         "meta device")
    probe = _default_probe(model) if probe is None else probe
    calls, block_out, shapes = _record(model, probe)
    split = UserSplit(names, [0] + cuts + [len(names)], _place(model, blocks, names, cuts, calls), block_out, shapes)
    check_split(model, split, probe)
    return split.stage_names(), split


def _default_probe(model: nn.Module) -> torch.Tensor:
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if not sizes:
        raise ValueError(f"{type(model).__name__} has no nn.Embedding to size a probe batch by: pass probe=")
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(sizes), (2, 16), generator=g).to(next(model.parameters()).device)


def _record(model: nn.Module, probe: torch.Tensor) -> tuple[dict, dict, dict]:
    """One forward on the probe with hooks on every module: the positions of each
    module's calls in the order of all calls, each block's output structure, and
    what a stand-in for each module must return."""
    calls, block_out, shapes, counter, handles = {}, {}, {}, itertools.count(), []

    def pre(name, module, args, kwargs):
        calls.setdefault(name, []).append(next(counter))

    def post(name, module, args, kwargs, out):
        block_out.setdefault(name, len(out) if isinstance(out, tuple) else 0)
        x = _hidden(args, kwargs)
        if isinstance(out, torch.Tensor) and x is not None:
            keep = next((i for i, (a, b) in enumerate(zip(x.shape, out.shape)) if a != b), min(x.ndim, out.ndim))
            shapes.setdefault(name, (keep, tuple(out.shape[keep:]), out.dtype))
        else:
            shapes.setdefault(name, None)

    for name, m in model.named_modules():
        if name:
            handles += [m.register_forward_pre_hook(lambda *a, n=name: pre(n, *a), with_kwargs=True),
                        m.register_forward_hook(lambda *a, n=name: post(n, *a), with_kwargs=True)]
    try:
        with torch.no_grad(), _eval(model):
            model(probe)
    finally:
        for h in handles:
            h.remove()
    return calls, block_out, shapes


def _place(model: nn.Module, blocks: str, names: list[str], cuts: list[int], calls: dict) -> dict[str, int]:
    """The stage of each module with parameters outside the blocks: the stage its
    calls fall in, between the calls of the blocks that begin stages."""
    for i, n in enumerate(names):
        if len(calls.get(n, ())) != 1:
            raise ValueError(f"block {n} was called {len(calls.get(n, ()))} times in one forward: a pipeline "
                             "stage must hold each block it calls, once")
        if i and calls[n][0] < calls[names[i - 1]][0]:
            raise ValueError(f"block {n} runs before {names[i - 1]}: blocks must run in the order they are listed")
    starts = [calls[names[c]][0] for c in cuts]
    spine = {""} | {blocks[:i] for i, ch in enumerate(blocks) if ch == "."}
    for name in sorted(spine):
        direct = [n for n, _ in model.get_submodule(name).named_parameters(recurse=False)]
        if direct:
            raise ValueError(f"parameters {direct} sit directly on {name or type(model).__name__}, which every "
                             "pipeline stage runs: move them into a submodule so that one stage holds them")
    units = {}
    for name, m in model.named_modules():
        if name in spine or name == blocks or name.rpartition(".")[0] not in spine or \
                not any(True for _ in m.parameters()):
            continue
        where = sorted({sum(p > c for c in starts) for p in calls.get(name, [0])})
        if len(where) > 1:
            raise ValueError(f"{name} (with parameters) is called on pipeline stages {where}: a module with "
                             "parameters must run on one stage")
        units[name] = where[0]
    order = {n: calls.get(n, [-1])[0] for n in units}
    return dict(sorted(units.items(), key=lambda kv: order[kv[0]]))


class _eval:
    """Eval mode (dropout off) for the probe and the check, each module's mode restored after."""

    def __init__(self, model: nn.Module):
        self.modes = {m: m.training for m in model.modules()}

    def __enter__(self):
        for m in self.modes:
            m.training = False

    def __exit__(self, *exc):
        for m, mode in self.modes.items():
            m.training = mode


def check_split(model: nn.Module, split: UserSplit, probe: torch.Tensor) -> None:
    """Refuse (ValueError) a split whose stages, run one after another on the probe
    with the model's weights, send other hidden states, give another output or
    other gradients than the model's one-process forward."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    cuts = [split.blocks[b] for b in split.bounds[1:-1]]
    with _eval(model):
        ref, ref_sent = _reference(model, cuts, probe)
        weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0)).to(ref.device)
        ref_grads = torch.autograd.grad((ref.float() * weights).sum(), params, allow_unused=True)
        out, sent = _staged(model, split, probe)
        grads = torch.autograd.grad((out.float() * weights).sum(), params, allow_unused=True)
    for s, (a, b) in enumerate(zip(sent, ref_sent)):
        if not _err(a, b) <= CHECK_TOL:
            raise ValueError(f"pipeline stage {s} of {type(model).__name__} sends {cuts[s]} other hidden states "
                             f"than one process gives it (relative error {_err(a, b):.2g}): something other than "
                             "the hidden states crosses a cut before it")
    if not _err(out, ref) <= CHECK_TOL:
        raise ValueError(f"the last pipeline stage of {type(model).__name__} computes another output than one "
                         f"process (relative error {_err(out, ref):.2g}): something other than the hidden states "
                         f"crosses the cut at {', '.join(cuts)}")
    norms = [g.norm() for g in ref_grads if g is not None]
    floor = 1e-3 * float(torch.stack(norms).norm()) if norms else 0.0
    for (name, p), g, r in zip(named, grads, ref_grads):
        g, r = (torch.zeros_like(p) if t is None else t for t in (g, r))
        if not _err(g, r, floor) <= CHECK_TOL:
            raise ValueError(f"pipeline stages of {type(model).__name__} give {name} another gradient than one "
                             f"process (relative error {_err(g, r, floor):.2g}): it is used across the cut at "
                             f"{', '.join(cuts)}")


@torch.no_grad()
def _err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), floor))


def _reference(model: nn.Module, cuts: list[str], probe: torch.Tensor):
    """The one-process output, and the input each cut block gets."""
    inputs, handles = {}, []

    def keep(name, module, args, kwargs):
        inputs.setdefault(name, _hidden(args, kwargs))

    for name in cuts:
        handles.append(model.get_submodule(name).register_forward_pre_hook(
            lambda *a, n=name: keep(n, *a), with_kwargs=True))
    try:
        out = _output_tensor(model(probe))
    finally:
        for h in handles:
            h.remove()
    return out, [inputs[n] for n in cuts]


def _staged(model: nn.Module, split: UserSplit, probe: torch.Tensor):
    """The stages, sharing the model's parameters, run one after another: the last
    one's output, and what each other one sends."""
    x, sent = probe, []
    for s in range(split.n_stages):
        stage = split.build(model, s, share=True)
        try:
            x = stage(x, ids=probe)
        except Exception as e:   # noqa: BLE001 - any failure refuses the split, saying what it was
            first = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(f"pipeline stage {s} of {type(model).__name__} fails on the probe batch: "
                             f"{type(e).__name__}: {first}") from e
        sent.append(x)
    return x, sent[:-1]
