"""The planner inside the recipe: `--layout auto` takes its fastest layout that fits
for the world size, model, sequence and global batch; every finished run compares its
step time with the planner's prediction for its layout (one line), so each run checks
the cost model (meshtron.planner.plan; its calibration: docs/planner.md).

The calibration is the GPU's (h100 or h200 by the device's name, h200 for other GPUs);
on a CPU the prediction is an H100's, and says so: there is no CPU calibration.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch

from meshtron import models
from meshtron.config import Config, ConfigError, ParallelConfig
from meshtron.distributed.mesh import resolve_degrees

GiB = 2 ** 30
# the flags --layout auto sets: a user's own value of any of them would be overridden
LAYOUT_FIELDS = ("dp", "pp", "cp", "tp", "ep", "sp", "zero", "hsdp", "pp_schedule", "pp_virtual", "microbatches",
                 "recompute")


def calibration_gpu(device: torch.device | None = None) -> str:
    """The shipped calibration of this machine's GPU."""
    if device is not None and device.type == "cuda" or device is None and torch.cuda.is_available():
        return "h100" if "H100" in torch.cuda.get_device_name(device) else "h200"
    return "h100"


def _model_config(config: Config):
    spec, preset = models.get(config.model.model)
    return spec, spec.configure(preset, config.model)


def choose(config: Config, world: int, gpus_per_node: int, gpu: str):
    """(the config with the planner's fastest layout that fits, its Prediction)."""
    from meshtron.planner import plan
    config = config.on_device("cuda" if torch.cuda.is_available() else "cpu")
    par, tr = config.parallel, config.training
    default = ParallelConfig()
    given = [f"--{f.replace('_', '-')}" for f in LAYOUT_FIELDS if getattr(par, f) != getattr(default, f)]
    if given:
        raise ConfigError(f"--layout auto chooses the layout itself: leave out {', '.join(given)}")
    if tr.global_batch is None:
        raise ConfigError("--layout auto needs --global-batch (samples per step), to split it over the ranks")
    _, cfg = _model_config(config)
    fit, over = plan.plan(config.model.model, tr.seq_len, tr.global_batch, world, min(gpus_per_node, world), gpu,
                          compile=par.compile, fp8=par.fp8, cfg=cfg, dtype=par.dtype)
    if not fit:
        hw = plan.hardware(gpu)
        smallest = f"; the smallest needs {over[0].memory / GiB:.1f} GiB ({over[0].flags()})" if over else ""
        raise ConfigError(f"--layout auto: no layout of {config.model.model} at global batch {tr.global_batch} x "
                          f"{tr.seq_len} fits {world} x {gpu} ({hw.memory_bytes / GiB:.0f} GiB each){smallest}: "
                          "more GPUs, a smaller global batch or sequence")
    best = fit[0]
    chosen = dataclasses.replace(par, **{f: getattr(best.par, f) for f in LAYOUT_FIELDS})
    training = dataclasses.replace(tr, micro_batch=best.micro_batch)
    return dataclasses.replace(config, parallel=chosen, training=training), best


def choice_line(pred, world: int, gpu: str) -> str:
    from meshtron.planner.hardware import calibration_line
    return (f"layout auto: {pred.flags()} on {world} ranks: predicted {pred.step_s * 1e3:.1f} ms a step, "
            f"{pred.memory / GiB:.1f} GiB on the fullest rank (calibration {calibration_line(gpu)})")


def predicted_step_s(config: Config, world: int, microbatches: int, gpus_per_node: int, gpu: str) -> float:
    """The planner's step seconds for the layout a run used."""
    from meshtron.planner import plan
    spec, cfg = _model_config(config)
    par = config.parallel
    degrees = resolve_degrees(world, **par.degrees())
    par = dataclasses.replace(par, **degrees, microbatches=microbatches)
    tr = config.training
    return plan.predict(spec, cfg, par, tr.micro_batch, microbatches, tr.seq_len, plan.hardware(gpu),
                        min(gpus_per_node, world)).step_s


def comparison_line(config: Config, world: int, microbatches: int, measured_s: float | None,
                    device: torch.device) -> str:
    """A finished run's measured step time against the planner's prediction, one line."""
    gpu = calibration_gpu(device)
    where = gpu if device.type == "cuda" else f"{gpu} (no CPU calibration: an {gpu.upper()}'s prediction)"
    try:
        pred = predicted_step_s(config, world, microbatches, int(os.environ.get("LOCAL_WORLD_SIZE", world)), gpu)
    except Exception as e:   # noqa: BLE001 -- the run itself succeeded: a planner gap is reported, not raised
        return f"planner: no prediction for this layout ({type(e).__name__}: {e})"
    if measured_s is None or not math.isfinite(measured_s):
        return f"planner: predicted {pred * 1e3:.1f} ms a step on {where}; too few steps to measure one"
    return (f"planner: measured {measured_s * 1e3:.1f} ms a step, predicted {pred * 1e3:.1f} ms on {where} "
            f"({pred / measured_s - 1:+.0%})")


def command_line(argv: list[str], pred, world: int) -> str:
    """The command `--layout auto` would run: the user's flags with the chosen layout's,
    each flag once (the layout's own, given by the user too, only as the layout has it)."""
    chosen = pred.flags()
    drop = {t for t in chosen.split() if t.startswith("--")} | {"--layout", "--dry-run"}
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
            if not a.startswith("-"):
                continue
        if a in drop:
            skip = True   # and its value
            continue
        if a.partition("=")[0] in drop:
            continue
        keep.append(a)
    return f"meshtron-run --nproc-per-node {world} recipes/train.py {' '.join(keep)} {chosen}".replace("  ", " ")
