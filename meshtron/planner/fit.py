"""The machine's multi-GPU terms (Hardware's compute_scale_compiled, compute_scale_eager, tp_compute_overhead,
comm_scale, host_collective_s, host_collective_compiled_s, host_microbatch_compiled_s,
bubble_scale, overlap_cost), fitted to measured steps of whole layouts: what one GPU's calibration
cannot see (collectives inside a step, ranks out of step, the host of several ranks).

    python -m meshtron.plan calibrate --fit meshtron/planner/calibration/h100_measured.jsonl --gpu h100 --out h100.json

A measured row is a JSON line: `flags` (the recipe's), `world`, `step_ms`, optionally
`peak_mem_gib`, `source` (date, machine, command) and `excluded` (why the model cannot
predict it; not fitted). The fit minimizes the mean squared log error of the step times
over the rows by coordinate descent from several fixed starting points: nine terms for
all the layouts, none per layout.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time

from meshtron import models
from meshtron.config import Config
from meshtron.distributed.mesh import resolve_degrees
from meshtron.planner import plan
from meshtron.planner.hardware import Hardware, calibration_path

# (term, lowest, highest): the range a physical value can take
TERMS = (("compute_scale_compiled", 0.7, 1.6), ("compute_scale_eager", 0.7, 1.6), ("tp_compute_overhead", 0.0, 0.8),
         ("comm_scale", 0.3, 4.0), ("host_collective_s", 0.0, 5e-3), ("host_collective_compiled_s", 0.0, 5e-3),
         ("host_microbatch_compiled_s", 0.0, 0.05), ("bubble_scale", 0.3, 4.0), ("overlap_cost", 0.0, 1.0))

NEUTRAL = {"compute_scale_compiled": 1.0, "compute_scale_eager": 1.0, "comm_scale": 1.0, "bubble_scale": 1.0}


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def layout_of_row(row: dict):
    """(spec, model config, ParallelConfig with explicit degrees, micro-batch, micro-batches, seq_len) of a row."""
    config = Config.from_args(["--dtype", "bf16", *row["flags"].split()], models=models.PRESETS)
    spec, preset = models.get(config.model.model)
    cfg = spec.configure(preset, config.model)
    degrees = resolve_degrees(row["world"], **config.parallel.degrees())
    from meshtron.train.layout import batch_layout
    microbatches, _ = batch_layout(config.parallel, config.training, degrees)
    par = dataclasses.replace(config.parallel, **degrees, microbatches=microbatches)
    return spec, cfg, par, config.training.micro_batch, microbatches, config.training.seq_len


def predict_row(row: dict, hw: Hardware, gpus_per_node: int = 8) -> plan.Prediction:
    spec, cfg, par, mb, m, seq = layout_of_row(row)
    return plan.predict(spec, cfg, par, mb, m, seq, hw, gpus_per_node)


def _loss(terms: list[plan.StepTerms], measured: list[float], hw: Hardware) -> float:
    return sum(math.log(plan.step_time(t, hw)[0] / s) ** 2 for t, s in zip(terms, measured)) / len(terms)


def _descend(terms, measured, hw: Hardware, rounds: int, points: int) -> Hardware:
    """Coordinate descent from `hw`: each term in turn on a grid over its range, then closer around it."""
    lo_hi = {name: (lo, hi) for name, lo, hi in TERMS}
    for r in range(rounds):
        for name, lo, hi in TERMS:
            if r:   # later rounds search closer around the value found
                width = (hi - lo) / 2 ** r
                value = getattr(hw, name)
                lo, hi = max(lo_hi[name][0], value - width), min(lo_hi[name][1], value + width)
            grid = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
            best = min(grid, key=lambda v: _loss(terms, measured, dataclasses.replace(hw, **{name: v})))
            hw = dataclasses.replace(hw, **{name: best})
    return hw


def fit(rows: list[dict], hw: Hardware, rounds: int = 8, points: int = 21, starts: int = 24) -> Hardware:
    """`hw` with TERMS fitted to the rows' step times (their one-GPU terms are `hw`'s): the best
    of coordinate descents from neutral values and from `starts` fixed pseudo-random points (the
    terms trade against each other, and one descent can stop in a worse valley)."""
    rows = [r for r in rows if not r.get("excluded")]
    if not rows:
        raise ValueError("no measured rows to fit the machine's terms on")
    terms = []
    for row in rows:
        spec, cfg, par, mb, m, seq = layout_of_row(row)
        terms.append(plan.step_terms(spec, cfg, par, mb, m, seq, hw, 8))
    measured = [r["step_ms"] / 1e3 for r in rows]
    rng = random.Random(0)   # fixed: the same rows give the same terms
    begin = [{name: NEUTRAL.get(name, 0.0) for name, _, _ in TERMS}]
    begin += [{name: rng.uniform(lo, hi) for name, lo, hi in TERMS} for _ in range(starts)]
    found = [_descend(terms, measured, dataclasses.replace(hw, **b), rounds, points) for b in begin]
    return min(found, key=lambda h: _loss(terms, measured, h))


def fitted_file(rows_path: str, gpu: str) -> dict:
    """The calibration file `gpu` with its multi-GPU terms fitted to the rows at `rows_path`."""
    path = calibration_path(gpu)
    with open(path) as f:
        out = json.load(f)
    rows = read_rows(rows_path)
    hw = fit(rows, plan.hardware(path))
    out |= {name: getattr(hw, name) for name, _, _ in TERMS}
    used = [r for r in rows if not r.get("excluded")]
    worlds = " and ".join(sorted({str(r["world"]) for r in used}))
    out["fit_source"] = (f"fitted by `calibrate --fit {os.path.basename(rows_path)}` on {time.strftime('%Y-%m-%d')} "
                         f"to {len(used)} steps measured on {worlds} GPUs (sources in that file)")
    return out
