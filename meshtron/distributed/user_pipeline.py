"""Pipeline stages of a model meshtron did not write (a Hugging Face causal LM,
your own nn.Module), cut before named blocks.

Every stage runs the model's own top-level forward, whole, on the micro-batch's
token ids, with stand-ins for the modules it does not hold:
- the blocks before its own are pass-throughs, and a forward pre-hook on its
  first block swaps that block's input for the hidden states received from the
  previous stage (whatever ran before it on this stage is dropped);
- the block that begins the next stage is a `Cut`: it raises `_CutReached`
  (a BaseException, so a model's `except Exception` lets it through) carrying
  its input, which the stage returns and so sends on;
- a module with parameters that an earlier stage holds (the embedding) returns
  zeros of its output's shape; one a later stage holds is never reached.
So whatever the model does outside its blocks (embedding multipliers, masks and
rotary tables, a parameter-free final norm, logit soft-capping after the head)
runs where one process runs it: between the same two blocks.

Which stage holds what, and the check that the split computes what one
process computes, are user_split's.

Why not torch's `pipeline()` (torch.export traces the model and splits the
graph): tracing fails on the data-dependent control flow and keyword plumbing
of many Hugging Face models; running the eager forward works for any model
that runs eagerly. Costs: each later stage also runs the model's code outside
the blocks (masks, rotary tables, zeros for the embedding), small next to the
blocks.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn


class _CutReached(BaseException):
    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline cut reached")
        self.hidden = hidden


def _hidden_slot(args: tuple, kwargs: dict):
    """Where a module call's hidden states are: its first tensor argument."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor | None:
    slot = _hidden_slot(args, kwargs)
    return None if slot is None else (args[slot] if isinstance(slot, int) else kwargs[slot])


def _output_tensor(out):
    """What a model hands the loss: the tensor it returns, or an output object's `.logits`."""
    return out if isinstance(out, torch.Tensor) else out.logits


class Stub(nn.Module):
    """A stand-in for a module this stage does not hold (no parameters)."""

    def __init__(self, name: str):
        super().__init__()
        self.stands_for = name

    def __getattr__(self, attr: str):
        try:
            return super().__getattr__(attr)
        except AttributeError:
            name = self.__dict__.get("stands_for", "a module")
            raise AttributeError(f"{name} is held by another pipeline stage, but this stage's forward reads its "
                                 f"{attr!r} outside a call to it (tie a weight through a module)") from None


class PassThrough(Stub):
    """A block of an earlier stage: returns its input, shaped as the block's output
    (a tensor, or a tuple of `n_out` with the hidden states first)."""

    def __init__(self, name: str, n_out: int):
        super().__init__(name)
        self.n_out = n_out

    def forward(self, *args, **kwargs):
        x = _hidden(args, kwargs)
        return x if self.n_out == 0 else (x,) + (None,) * (self.n_out - 1)


class Cut(Stub):
    """The block that begins the next stage: ends this stage's forward with its input."""

    def forward(self, *args, **kwargs):
        raise _CutReached(_hidden(args, kwargs))


class Standin(Stub):
    """A module with parameters that an earlier stage holds: zeros shaped like its
    output (the leading `keep` dims of its input, then `tail`), which the cut that
    follows drops. Floating zeros take the dtype of the hidden states `received`
    (bf16 under mixed precision), so that what the forward derives from them
    (rotary tables, masks) has the dtype it has in one process."""

    def __init__(self, name: str, keep: int, tail: tuple, dtype: torch.dtype, received: list):
        super().__init__(name)
        self.keep, self.tail, self.dtype, self.received = keep, tail, dtype, received

    def forward(self, *args, **kwargs):
        x = _hidden(args, kwargs)
        dtype = self.received[0].dtype if self.dtype.is_floating_point and self.received else self.dtype
        return torch.zeros(*x.shape[:self.keep], *self.tail, dtype=dtype, device=x.device)


class Unreached(Stub):
    """A module of a later stage: this stage's forward ends at its cut before it."""

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.stands_for} ran on a pipeline stage before its own: the model called its "
                           "modules in another order than in the probe forward user_stages ran")


def is_stub(module: nn.Module) -> bool:
    return isinstance(module, Stub)


@dataclass
class UserSplit:
    """Where each module of a user model runs: `blocks` in call order, stage s
    holding blocks[bounds[s]:bounds[s + 1]]; `units` the other modules with
    parameters and their stage; what the stand-ins must return (`block_out`:
    the blocks' tuple lengths, 0 for a tensor; `shapes`: per module called, the
    dims it keeps of its input, the dims it appends, its dtype, or None where it
    returned no tensor from a tensor)."""
    blocks: list[str]
    bounds: list[int]
    units: dict[str, int]
    block_out: dict[str, int]
    shapes: dict[str, tuple]

    @property
    def n_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_names(self) -> list[list[str]]:
        """The module names each stage holds (split_model's `stages`)."""
        units = [[u for u, o in self.units.items() if o == s] for s in range(self.n_stages)]
        blocks = [self.blocks[self.bounds[s]:self.bounds[s + 1]] for s in range(self.n_stages)]
        return [units[0] + blocks[0]] + [b + u for b, u in zip(blocks[1:], units[1:])]

    def _stand_in(self, name: str, owner: int, s: int, received: list) -> nn.Module:
        if owner > s or name not in self.shapes:   # a later stage's, or never called
            return Unreached(name)
        if self.shapes[name] is None:
            raise ValueError(f"{name} (pipeline stage {owner}) returns no tensor from a tensor input: the "
                             f"stages after it cannot stand in for it")
        return Standin(name, *self.shapes[name], received)

    def build(self, model: nn.Module, s: int, share: bool = False) -> nn.Module:
        """Stage s: a copy of the model holding its own modules, stand-ins for the
        others (names unchanged), whose forward is `_stage_forward`'s. `share`:
        the copy uses the model's parameters (check_split), else copies them."""
        first, end = self.bounds[s], self.bounds[s + 1]
        received: list = []     # the hidden states this stage got, during its forward
        memo = {id(p): p for p in model.parameters()} if share else {}
        for i, name in enumerate(self.blocks):
            if not first <= i < end:
                memo[id(model.get_submodule(name))] = (PassThrough(name, self.block_out[name]) if i < first else
                                                       Cut(name) if i == end else Unreached(name))
        for name, owner in self.units.items():
            if owner != s:
                memo[id(model.get_submodule(name))] = self._stand_in(name, owner, s, received)
        stage = copy.deepcopy(model, memo)   # a module found in memo is replaced, not copied
        if s > 0:
            stage.get_submodule(self.blocks[first]).register_forward_pre_hook(
                lambda module, args, kwargs: _swap_hidden(args, kwargs, received), with_kwargs=True)
        _stage_forward(stage, received, s, self.n_stages)
        return stage


def _swap_hidden(args: tuple, kwargs: dict, received: list):
    if not received:
        raise RuntimeError("a pipeline stage's first block ran outside the stage's forward")
    slot = _hidden_slot(args, kwargs)
    if isinstance(slot, int):
        return args[:slot] + (received[0],) + args[slot + 1:], kwargs
    return args, {**kwargs, slot: received[0]}


def _stage_forward(module: nn.Module, received: list, s: int, n_stages: int) -> None:
    """A stage takes (x, ids=token ids): x is the token ids on stage 0, else the
    hidden states received, which its first block gets in place of what ran
    before it. It returns the hidden states at its cut, or on the last stage the
    logits. The class changes (a subclass with this forward); names and
    parameters do not."""
    cls = type(module)

    def forward(self, x, ids=None):
        if s > 0 and ids is None:
            raise ValueError(f"pipeline stage {s} of a user model runs the model's forward: it needs the "
                             "micro-batch's token ids (ids=)")
        received[:] = [x] if s > 0 else []
        try:
            out = cls.forward(self, ids if s > 0 else x)
        except _CutReached as cut:
            return cut.hidden
        finally:
            received.clear()
        if s < n_stages - 1:
            raise RuntimeError(f"pipeline stage {s}'s forward ended without reaching the block that begins "
                               f"stage {s + 1}")
        return _output_tensor(out)
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward})

