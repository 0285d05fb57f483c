"""Pipeline parallelism on the pp axis: stage splitting and schedules.

A model is cut into S = pp x v stages (v virtual stages per rank for
interleaving) by module names: its spec lists, per stage, the modules the stage
holds (the embedding and the first layers, ..., the last layers, the final norm
and the output head, and so the loss). A stage is a copy of the model with every
other listed module removed (a ModuleDict entry deleted, an attribute set to
None), so stages keep their module names and checkpoints do not depend on the
split. Rank r of the pp axis holds stages r, r + pp, ... (looped, interleaved
1F1B) or r and 2pp-1-r (V shape, ZBV). A weight tied across stages is a copy on
each holder whose gradients are summed after the backward (tied.TiedCopies).
A model meshtron did not write is cut by `user_stages` instead: each of its
stages runs the model's own forward, with stand-ins for the modules it does not
hold (user_pipeline.py), and the split is checked against one process first.

Communication: one send/recv of a (micro-batch, T, d) activation per stage
boundary and micro-batch, forward and backward (T/tp under SP). The bubble of
each schedule (`bubble_fraction`) is tabled in docs/parallelism.md ("Pipeline
parallelism"); 1F1B keeps at most p micro-batches of activations alive on the
first stage (GPipe keeps all m), which a test measures.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from meshtron.distributed.choices import MULTI_STAGE, SPLIT_BACKWARD
from meshtron.distributed.mesh import degree
from meshtron.distributed.reduce import reduce_partial_grads
from meshtron.distributed.tied import TiedCopies
from meshtron.distributed.user_pipeline import UserSplit
from meshtron.distributed.user_split import user_stages  # noqa: F401 - split_model's partner, imported from here

# the names the command line offers (choices.SCHEDULES; tests/test_config.py checks they agree)
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """Predicted idle fraction of a step (equal stage times, no communication cost)."""
    p, m, v = pp, microbatches, virtual
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule in SPLIT_BACKWARD:
        return (p - 1) / (3 * v * m + p - 1)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {sorted(SCHEDULES)}")


def check_pipeline(schedule: str, pp: int, virtual: int, microbatches: int, n_blocks: int) -> None:
    """Every bad combination raises here, before any stage talks to another."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {sorted(SCHEDULES)}")
    if virtual < 1:
        raise ValueError(f"--pp-virtual must be >= 1, not {virtual}")
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank; use interleaved-1f1b or zero-bubble "
                         f"for v={virtual}")
    if schedule == "zbv" and virtual != 2:
        raise ValueError(f"the V-shaped zero-bubble schedule needs exactly 2 stages per rank, not v={virtual}")
    if schedule != "gpipe" and microbatches < pp:
        raise ValueError(f"schedule {schedule} needs at least pp={pp} micro-batches, got {microbatches}")
    if schedule in MULTI_STAGE and microbatches % pp:
        raise ValueError(f"schedule {schedule} needs the micro-batch count {microbatches} to be a multiple of pp={pp}")
    if n_blocks < pp * virtual:
        raise ValueError(f"{n_blocks} layers cannot be split into pp*v = {pp}*{virtual} = {pp * virtual} stages "
                         "of at least one layer each")


def split_layers(n_layers: int, n_stages: int, embed_cost: float = 1.0, head_cost: float = 1.0) -> list[list[int]]:
    """Contiguous layer ranges per stage, balancing cost where the embedding and
    the head (with the loss) weigh like `embed_cost` / `head_cost` layers."""
    return [list(ids) for ids in _split_layers(n_layers, n_stages, embed_cost, head_cost)]


@functools.lru_cache(maxsize=1024)   # the planner asks for the same few splits for thousands of layouts
def _split_layers(n_layers: int, n_stages: int, embed_cost: float, head_cost: float) -> tuple[range, ...]:
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot be split into {n_stages} stages")
    total = embed_cost + n_layers + head_cost
    stages = [[] for _ in range(n_stages)]
    for i in range(n_layers):
        mid = embed_cost + i + 0.5          # the layer's centre on the cumulative cost axis
        stages[min(n_stages - 1, int(mid * n_stages / total))].append(i)
    # every stage needs a layer: where the embedding or head alone filled a
    # stage's share, take a layer from the fullest stage (ranges stay contiguous)
    counts = [len(s) for s in stages]
    while 0 in counts:
        counts[counts.index(0)] += 1
        counts[counts.index(max(counts))] -= 1
    bounds = [sum(counts[:s]) for s in range(n_stages + 1)]
    return tuple(range(bounds[s], bounds[s + 1]) for s in range(n_stages))


def stage_ids_of(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_owner(stage: int, pp: int, virtual: int, schedule: str) -> int:
    """The pp rank holding `stage` (inverse of stage_ids_of)."""
    for r in range(pp):
        if stage in stage_ids_of(r, pp, virtual, schedule):
            return r
    raise ValueError(f"no pp rank holds stage {stage}")


def stage_io(micro_batch: int, tokens: int, dim: int, vocab: int, dtype: torch.dtype,
             sp: int = 1, hidden_out: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one micro-batch of a decoder feeds its first stage (token ids), passes
    between stages (hidden states, this rank's 1/sp of the sequence under sequence
    parallelism) and gets out of its last (logits, a vocab-sharded DTensor's whole
    shape; `hidden_out`: the final hidden states, a sequence-sharded DTensor's whole
    shape, for a loss that runs the head), as meta tensors for Pipeline.build_schedule.
    `tokens`: the sequence length a rank holds (T/cp); `dtype`: the one the blocks
    compute in."""
    grad = dict(dtype=dtype, device="meta", requires_grad=True)   # their gradients travel back
    return (torch.empty(micro_batch, tokens, dtype=torch.long, device="meta"),
            torch.empty(micro_batch, tokens // sp, dim, **grad),
            torch.empty(micro_batch, tokens, dim if hidden_out else vocab, **grad))


def build_stage(model: nn.Module, keep: set[str], split: set[str]) -> nn.Module:
    """A copy of the model holding, of the modules named in `split`, only `keep`; the
    others are removed (a ModuleDict entry deleted, an attribute set to None: the
    meshtron models' forward skips them)."""
    stage = copy.deepcopy(model)
    for name in sorted(split - keep, key=lambda n: -n.count(".")):
        path, _, attr = name.rpartition(".")
        owner = stage.get_submodule(path) if path else stage
        if isinstance(owner, nn.ModuleDict):
            del owner[attr]
        else:
            setattr(owner, attr, None)
    return stage


@dataclass
class Pipeline:
    """This pp rank's stages and the schedule that drives them. `parts` are the
    stage modules (the trainer parallelizes them, then calls build_schedule)."""
    parts: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    schedule_name: str
    microbatches: int
    mesh: DeviceMesh
    tied: TiedCopies
    token_ids: bool = False     # every stage gets the micro-batch's token ids as `ids` (a user model's stages)
    schedule: object = None
    loss_fn: object = None
    stage_kwargs: dict = field(default_factory=dict)
    loss_scale: torch.Tensor | float = 1.0

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def _by_stage(self) -> dict[int, nn.Module]:
        return dict(zip(self.stage_ids, self.parts))

    def build_schedule(self, loss_fn, io: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                       stage_kwargs: dict | None = None) -> None:
        """`loss_fn(output, target)`: a micro-batch's summed token loss. Each step
        scales it (`step`), and the schedule sums micro-batches without dividing.
        `stage_kwargs`: what every stage's forward is called with besides its input
        ({"return_hidden": True} where the loss runs the output head itself).

        `io`: what one micro-batch feeds the first stage, passes between stages and
        gets out of the last (meta tensors, `stage_io`). Given, torch takes the
        stages' shapes from it; else it learns them on the first step by running
        every stage once and sending the shapes along the pipeline."""
        device = next(self.parts[0].parameters()).device
        group = self.mesh["pp"].get_group()
        stages = []
        model_input, hidden, model_output = io or (None, None, None)
        for m, i in zip(self.parts, self.stage_ids):
            shapes = {}
            if io is not None:
                shapes = {"input_args": model_input if i == 0 else hidden,
                          "output_args": model_output if i == self.n_stages - 1 else hidden}
            stage = PipelineStage(m, i, self.n_stages, device, group=group, **shapes)
            if io is None:
                _keep_buffers_through_shape_inference(stage)
            stages.append(stage)
        cls = SCHEDULES[self.schedule_name]
        # the split-backward schedules run each micro-batch's backward in two passes (input,
        # then weight gradients) over a retained graph: a block compiled in their steps must
        # keep its saved buffers for the second. functorch's switch is process-wide, so it is
        # set for this pipeline's steps only.
        self._compile_options = contextlib.nullcontext if self.schedule_name not in SPLIT_BACKWARD else \
            functools.partial(functorch_config.patch, donated_buffer=False)
        self.loss_fn, self.stage_kwargs = loss_fn, dict(stage_kwargs or {})
        self.schedule = cls(stages if self.schedule_name in MULTI_STAGE else stages[0], self.microbatches,
                            loss_fn=self._scaled_loss, scale_grads=False)
        # else the last stage keeps every micro-batch's logits until the step ends (older torch cannot say so)
        self._step_options = {} if "return_outputs" not in inspect.signature(self.schedule.step).parameters \
            else {"return_outputs": False}

    def _scaled_loss(self, output, target):
        return self.loss_fn(output, target) * self.loss_scale

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_scale: torch.Tensor | float = 1.0,
             inputs: dict | None = None) -> torch.Tensor:
        """Forward and backward of all micro-batches of the local batch (x, y), each
        micro-batch's loss times `loss_scale`; returns the sum of the scaled losses
        on the last stage, else 0. `inputs`: per-token keyword inputs (B, T) of every
        stage's forward (packed documents' indices and positions), split into
        micro-batches with x."""
        self.loss_scale = loss_scale
        losses = []
        # contiguous, as the shapes given to torch are (the loader's are views of longer windows)
        args = (x.contiguous(),) if self.has_first else ()
        kwargs = {"target": y, "losses": losses, **self._step_options} if self.has_last else {}
        inputs = {k: t.contiguous() for k, t in (inputs or {}).items()}
        with self._compile_options():
            self.schedule.step(*args, **kwargs, **self._ids(x), **inputs, **self.stage_kwargs)
        self.tied.sum_grads(self._by_stage(), reduce_partial_grads)
        losses = [(t.full_tensor() if isinstance(t, DTensor) else t).detach().float() for t in losses]
        return torch.stack(losses).sum() if losses else torch.zeros((), device=x.device)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, inputs: dict | None = None) -> torch.Tensor:
        """Forward only: the sum of the micro-batch losses on the last stage, else 0.
        `inputs`: as step's."""
        self.loss_scale = 1.0
        losses = []
        args = (x.contiguous(),) if self.has_first else ()
        kwargs = {**self._ids(x), **{k: t.contiguous() for k, t in (inputs or {}).items()}, **self.stage_kwargs}
        if self.has_last:
            kwargs |= {"target": y, "losses": losses}
        if hasattr(self.schedule, "eval"):   # torch 2.13; older schedules take the switch it sets
            self.schedule.eval(*args, **kwargs)
        else:
            self.schedule._has_backward = False
            try:
                self.schedule.step(*args, **kwargs)
            finally:
                self.schedule._has_backward = True
        losses = [(t.full_tensor() if isinstance(t, DTensor) else t).detach().float() for t in losses]
        return torch.stack(losses).sum() if losses else torch.zeros((), device=x.device)

    def _ids(self, x: torch.Tensor) -> dict:
        return {"ids": x.contiguous()} if self.token_ids else {}

    def param_names(self) -> dict[int, str]:
        """id(parameter) -> the name checkpoints use: a tied copy takes its weight's first name."""
        names = {id(p): n for m in self.parts for n, p in m.named_parameters()}
        return names | self.tied.names(self._by_stage())

    def norm_parameters(self) -> list:
        """Parameters counted once in the global gradient norm (one copy of each tied weight)."""
        skip = self.tied.duplicates(self._by_stage())
        return [p for m in self.parts for p in m.parameters() if id(p) not in skip]


def _keep_buffers_through_shape_inference(stage: PipelineStage) -> None:
    """Before its first micro-batch, torch 2.13's schedule runs each stage once on
    uninitialised tensors to learn its output shapes (`_stage_meta.outputs` is
    unset until then): undo what that call wrote into buffers (a mixture of
    experts' routing counts, running statistics)."""
    saved = {}

    def before(module, args):
        meta = getattr(stage, "_stage_meta", None)
        if meta is not None and meta.outputs is None:
            saved.update({n: b.clone() for n, b in module.named_buffers()})

    def after(module, args, output):
        if saved:
            with torch.no_grad():
                for n, b in module.named_buffers():
                    b.copy_(saved[n])
            saved.clear()

    stage.submod.register_forward_pre_hook(before)
    stage.submod.register_forward_hook(after)


def split_model(model: nn.Module, mesh: DeviceMesh, schedule: str, virtual: int, microbatches: int,
                stages: list[list[str]], user: UserSplit | None = None) -> Pipeline:
    """Cut the (unparallelized) model into this pp rank's stages; `stages[s]` names
    the modules stage s holds (a model spec's split, or user_stages' with its
    UserSplit as `user`: then each stage runs the model's own forward with
    stand-ins for what it does not hold). Call check_pipeline first."""
    pp = degree(mesh, "pp")
    n_stages = pp * virtual
    if len(stages) != n_stages or (user is not None and user.n_stages != n_stages):
        raise ValueError(f"the split must list pp*v = {n_stages} stages, got {len(stages)}")
    split = {n for names in stages for n in names}
    modules = dict(model.named_modules())
    unknown = sorted(split - set(modules))
    if unknown:
        raise ValueError(f"the pipeline split names modules the model does not have: {unknown}")
    # every parameter must belong to exactly one stage's modules
    kept = [{pn for pn, _ in model.named_parameters(remove_duplicate=False)
             if any(pn.startswith(n + ".") for n in names)} for names in stages]
    for pn, _ in model.named_parameters(remove_duplicate=False):
        owners = [s for s, k in enumerate(kept) if pn in k]
        if len(owners) != 1:
            raise ValueError(f"parameter {pn} is held by {len(owners)} pipeline stages (the split must place every "
                             "parameter on exactly one)")
    owner = lambda s: stage_owner(s, pp, virtual, schedule)  # noqa: E731
    tied = TiedCopies.find(model, kept, owner, mesh["pp"])
    ids = stage_ids_of(mesh["pp"].get_local_rank(), pp, virtual, schedule)
    parts = [user.build(model, s) if user is not None else build_stage(model, set(stages[s]), split) for s in ids]
    return Pipeline(parts, ids, n_stages, schedule, microbatches, mesh, tied, token_ids=user is not None)
