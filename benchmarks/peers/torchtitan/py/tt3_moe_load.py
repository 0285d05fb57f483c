"""torchtitan 0.2.2 peer (the kit's `run.sh moe_1gpu`): its MoE routing load, for a
speed comparison at a stated load.

Loaded through `--experimental.custom_import tt3_moe_load` (with this folder on
PYTHONPATH); it imports the kit's `tt3_flavors` and wraps MoE.forward to keep
each layer's load max/mean of every forward (the busiest expert's tokens / the
mean, from the router's counts) on the GPU, and prints per step the worst
layer's at exit (no host sync while training). torchtitan's own balanced mode
is `--debug.moe_force_load_balance` (round-robin experts); 0.2.2 copies that
flag into MoEArgs._debug_force_load_balance when it builds the model, so a
flavor setting the field is overwritten.
"""
from __future__ import annotations

import atexit

import torch
import tt3_flavors  # noqa: F401  (registers tt3_moe)
from torchtitan.models.moe import moe as tt_moe
from torchtitan.models.qwen3 import qwen3_args

_base = qwen3_args["tt3_moe"]
_loads: list[torch.Tensor] = []
_forward = tt_moe.MoE.forward


def _forward_keeping_load(self, x):
    before = self.tokens_per_expert.detach().clone()
    out = _forward(self, x)
    if self.training:
        counts = self.tokens_per_expert.detach() - before    # this forward's tokens per expert
        _loads.append(counts.max() / counts.mean().clamp_min(1e-9))
    return out


def _report():
    if not _loads:
        return
    n_layers = _base.n_layers
    per_step = torch.stack(_loads).view(-1, n_layers).max(1).values.tolist()
    print("tt3_moe_load: load max/mean (worst layer) by step: " + " ".join(f"{x:.2f}" for x in per_step), flush=True)


tt_moe.MoE.forward = _forward_keeping_load
atexit.register(_report)
