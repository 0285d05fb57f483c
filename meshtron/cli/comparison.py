"""Each run checks the planner's cost model: the run's training steps (the Trainer's `step_s`:
each step's own time, evaluation and saves left out; those after WARMUP_STEPS) against the
planner's prediction for its layout, in one line before the closing one (meshtron.planner.plan;
docs/planner.md). Where the device has no calibration of its own the line has no percentage:
the prediction is another device's (meshtron.cli.layout_auto.calibration_of).
"""
from __future__ import annotations

import dataclasses
import os
import statistics

import torch

from meshtron import models
from meshtron.cli.layout_auto import calibration_of
from meshtron.command_line import WARMUP_STEPS
from meshtron.config import Config
from meshtron.distributed.mesh import resolve_degrees
from meshtron.planner import plan


def predicted_step_s(config: Config, world: int, microbatches: int, gpus_per_node: int, gpu: str) -> float:
    """The planner's step seconds for the layout a run used."""
    spec, preset = models.get(config.model.model)
    par = config.parallel
    degrees = resolve_degrees(world, **par.degrees())
    par = dataclasses.replace(par, **degrees, microbatches=microbatches)
    tr = config.training
    return plan.predict(spec, spec.configure(preset, config.model), par, tr.micro_batch, microbatches, tr.seq_len,
                        plan.hardware(gpu), min(gpus_per_node, world)).step_s


def line(config: Config, world: int, microbatches: int, step_s: list[float], device: torch.device) -> str:
    """A finished run's training steps against the planner's prediction for its layout, one line."""
    gpu, missing = calibration_of(device)
    try:
        pred = predicted_step_s(config, world, microbatches, int(os.environ.get("LOCAL_WORLD_SIZE", world)), gpu)
    except Exception as e:   # noqa: BLE001 -- the run itself succeeded: a planner gap is reported, not raised
        return f"planner: no prediction for this layout ({type(e).__name__}: {e})"
    timed = step_s[WARMUP_STEPS:]
    if not timed:
        return (f"planner: predicted {pred * 1e3:.1f} ms a step on {gpu}; too few steps to time one (the first "
                f"{WARMUP_STEPS} warm up and compile)")
    measured = statistics.fmean(timed)
    which = f"{len(timed)} training steps after the first {WARMUP_STEPS}"
    if missing:
        return (f"planner: measured {measured * 1e3:.1f} ms a step ({which}); no calibration of {missing}: an "
                f"{gpu.upper()}'s prediction, {pred * 1e3:.1f} ms, is no check of it")
    return (f"planner: measured {measured * 1e3:.1f} ms a step ({which}), predicted {pred * 1e3:.1f} ms on {gpu} "
            f"({pred / measured - 1:+.0%})")
