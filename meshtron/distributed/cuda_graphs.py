"""CUDA graphs of the compiled blocks (--cuda-graphs): inductor records each
compiled block's kernels and collectives once (cudagraph trees) and replays them
with one launch, where a step of small micro-batches (pp x tp, dp x tp) otherwise
waits on the host launching them one by one. No communication of its own.

Three pieces, applied where the layout is: `compile_options` adds inductor's
`triton.cudagraphs` to each block's compile; `keep_gathered` (apply_dp, after FSDP)
keeps FSDP's gathered weights in their storage between steps; `step_begin` (the
trainer, before each optimizer step) opens a new generation of graphs, whose
outputs the previous step no longer reads.

A graph reads its inputs, the gathered weights among them, at the addresses it
recorded: FSDP frees the gathered weights after each step's backward and allocates
them again where the allocator has room, so without `keep_gathered` every graph is
recorded again each step, which costs more host time than the replays save. Kept, they cost no
memory under ZeRO 0-2, which hold them through the step anyway, but under ZeRO-3
they would hold every block's (the trainer refuses --zero 3 with --cuda-graphs).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def compile_options(options: dict | None, cuda_graphs: bool) -> dict | None:
    """A block's inductor `options` with CUDA graphs added under --cuda-graphs."""
    return {**(options or {}), "triton.cudagraphs": True} if cuda_graphs else options


def check_device(cuda_graphs: bool, device_type: str) -> None:
    """--cuda-graphs records CUDA graphs: refuse it where the ranks run on another device."""
    if cuda_graphs and device_type != "cuda":
        raise ValueError(f"--cuda-graphs records CUDA graphs: it needs GPUs, and this run's devices are "
                         f"{device_type.upper()}s; leave it out")


def _keep(*args) -> None:
    """FSDPParam.free_unsharded_param kept from freeing anything."""


def fsdp_params(model: nn.Module) -> list:
    """The FSDPParam objects of every FSDP unit in `model` (the fully_shard state's param
    group; one group a unit on torch 2.11 and 2.13, None for a unit left with no parameters)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return [p for g in groups if g is not None for p in g.fsdp_params]


def keep_gathered(model: nn.Module) -> None:
    """Every FSDP unit in `model` keeps its gathered (unsharded) weights' storage
    from one step to the next: each all-gather writes into the same memory, where
    the CUDA graphs recorded them. Patched on this model's FSDPParam objects, not on
    the class: other models in the process free theirs as usual."""
    for p in fsdp_params(model):
        p.free_unsharded_param = _keep


def step_begin() -> None:
    """A new optimizer step: the graphs' outputs of the step before may be overwritten."""
    torch.compiler.cudagraph_mark_step_begin()
