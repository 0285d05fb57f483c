"""The few global terms of the step-time model, fitted to measured steps of whole layouts, and
the error users can trust: each measured row predicted by a fit made without it.

    python -m meshtron.plan calibrate --fit                       # refit on the shipped rows, write both files
    python -m meshtron.plan calibrate --leave-one-out             # the table of docs/planner.md

Everything a step is made of is measured on the machine (meshtron.planner.calibrate: GEMMs per
dtype, attention, HBM bandwidth, the host) or counted from the code (FLOPs, bytes, collectives);
what no part shows is a handful of terms shared by every machine, since they describe the code,
not the GPU: what a real step adds to its counted compute, compiled and eager (the kernels no
count names); the host's eager time over calibrate's; a MoE block's routing kernels, whose time is
their launch latency rather than bytes; and, on several GPUs, collectives inside a
step over alone, the host per collective call, the pipeline's idle over its formula and what a
hidden collective still costs the compute beside it.

A measured row is a JSON line: `flags` (the recipe's), `world`, `step_ms`, `peak_mem_gib`,
`source` (date, machine, command) and optionally `excluded` (why the model cannot predict it: not
fitted). Each file of rows belongs to the machine its name starts with (h100_measured.jsonl).
The fit minimizes the mean squared log error over the rows by coordinate descent from several
fixed starting points.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import multiprocessing
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from meshtron import models
from meshtron.config import Config
from meshtron.distributed.mesh import resolve_degrees
from meshtron.planner import plan
from meshtron.planner.hardware import Hardware, calibration_path

# (term, lowest, highest): the range a physical value can take
TERMS = (("compute_scale_compiled", 0.7, 1.6), ("compute_scale_eager", 0.7, 1.6), ("host_scale", 0.5, 3.0),
         ("comm_scale", 0.3, 4.0), ("host_collective_s", 0.0, 5e-3), ("host_collective_compiled_s", 0.0, 5e-3),
         ("host_microbatch_compiled_s", 0.0, 0.05), ("bubble_scale", 0.3, 4.0), ("overlap_cost", 0.0, 1.0),
         ("moe_layer_s", 0.0, 0.01))

NEUTRAL = {"compute_scale_compiled": 1.0, "compute_scale_eager": 1.0, "host_scale": 1.0, "comm_scale": 1.0,
           "bubble_scale": 1.0}
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration")


def read_rows(path: str) -> list[dict]:
    """A file's rows, each with its machine (`gpu`: the file name's first word) unless it names one."""
    gpu = os.path.basename(path).split("_")[0]
    with open(path) as f:
        return [{"gpu": gpu} | json.loads(line) for line in f if line.strip()]


def shipped_rows() -> list[dict]:
    return [r for path in sorted(glob.glob(os.path.join(HERE, "*_measured.jsonl"))) for r in read_rows(path)]


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


def _terms_of(rows: list[dict], machines: dict[str, Hardware]) -> list[plan.StepTerms]:
    out = []
    for row in rows:
        spec, cfg, par, mb, m, seq = layout_of_row(row)
        out.append(plan.step_terms(spec, cfg, par, mb, m, seq, machines[row["gpu"]], 8))
    return out


def _with(hw: Hardware, values: dict) -> Hardware:
    return dataclasses.replace(hw, **values)


def _loss(terms, rows, machines, values: dict) -> float:
    hws = {name: _with(hw, values) for name, hw in machines.items()}
    return sum(math.log(plan.step_time(t, hws[r["gpu"]])[0] / (r["step_ms"] / 1e3)) ** 2
               for t, r in zip(terms, rows)) / len(rows)


def _descend(terms, rows, machines, values: dict, rounds: int, points: int) -> dict:
    """Coordinate descent from `values`: each term in turn on a grid over its range, then closer around it."""
    for r in range(rounds):
        for name, lo0, hi0 in TERMS:
            lo, hi = lo0, hi0
            if r:   # later rounds search closer around the value found
                width = (hi0 - lo0) / 2 ** r
                lo, hi = max(lo0, values[name] - width), min(hi0, values[name] + width)
            grid = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
            best = min(grid, key=lambda v: _loss(terms, rows, machines, values | {name: v}))
            values = values | {name: best}
    return values


def fit(rows: list[dict], machines: dict[str, Hardware], rounds: int = 5, points: int = 13,
        starts: int = 4) -> dict[str, float]:
    """TERMS fitted to the rows' step times (each row predicted with its machine's measured
    parts): the best of coordinate descents from neutral values and from `starts` fixed
    pseudo-random points (the terms trade against each other, and one descent can stop in a
    worse valley)."""
    rows = [r for r in rows if not r.get("excluded")]
    if not rows:
        raise ValueError("no measured rows to fit the terms on")
    terms = _terms_of(rows, machines)
    rng = random.Random(0)   # fixed: the same rows give the same terms
    begin = [{name: NEUTRAL.get(name, 0.0) for name, _, _ in TERMS}]
    begin += [{name: rng.uniform(lo, hi) for name, lo, hi in TERMS} for _ in range(starts)]
    found = [_descend(terms, rows, machines, b, rounds, points) for b in begin]
    return min(found, key=lambda v: _loss(terms, rows, machines, v))


def machines_of(rows: list[dict]) -> dict[str, Hardware]:
    return {name: plan.hardware(calibration_path(name)) for name in sorted({r["gpu"] for r in rows})}


def _fit_without(args) -> dict[str, float]:
    rows, i, machines, fit_kwargs = args
    return fit(rows[:i] + rows[i + 1:], machines, **fit_kwargs)


def leave_one_out(rows: list[dict], **fit_kwargs) -> list[dict]:
    """Each row predicted (step time and peak memory) by terms fitted to every other row;
    the fits, independent of each other, in a process per core."""
    rows = [r for r in rows if not r.get("excluded")]
    machines = machines_of(rows)
    jobs = [(rows, i, machines, fit_kwargs) for i in range(len(rows))]
    workers = min(len(os.sched_getaffinity(0)), len(rows))
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            fitted = list(pool.map(_fit_without, jobs))
    else:
        fitted = [_fit_without(job) for job in jobs]
    out = []
    for row, values in zip(rows, fitted):
        pred = predict_row(row, _with(machines[row["gpu"]], values))
        mem = row.get("peak_mem_gib")
        out.append(dict(gpu=row["gpu"], world=row["world"], flags=row["flags"], step_ms=row["step_ms"],
                        predicted_ms=pred.step_s * 1e3, step_error=pred.step_s * 1e3 / row["step_ms"] - 1,
                        peak_mem_gib=mem, predicted_gib=pred.memory / 2 ** 30,
                        mem_error=pred.memory / 2 ** 30 / mem - 1 if mem else None))
    return out


def table(results: list[dict]) -> str:
    """leave_one_out's rows as the Markdown table of docs/planner.md, and its summary line."""
    lines = ["| GPU | world | flags | step ms | predicted | error | peak GiB | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = (f"{r['peak_mem_gib']:.2f} | {r['predicted_gib']:.2f} | {r['mem_error']:+.1%}" if r["mem_error"]
               is not None else "| |")
        lines.append(f"| {r['gpu']} | {r['world']} | `{r['flags']}` | {r['step_ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{r['step_error']:+.1%} | {mem} |")
    errors = [abs(r["step_error"]) for r in results]
    mems = [abs(r["mem_error"]) for r in results if r["mem_error"] is not None]
    lines.append("")
    lines.append(f"{len(results)} rows: step time mean error {statistics.fmean(errors):.1%}, worst {max(errors):.1%}"
                 + (f"; peak memory mean {statistics.fmean(mems):.1%}, worst {max(mems):.1%} over {len(mems)} rows"
                    if mems else ""))
    return "\n".join(lines)


def write_fitted(rows: list[dict]) -> dict[str, float]:
    """Fit TERMS to `rows` and write them into every machine's calibration file."""
    rows = [r for r in rows if not r.get("excluded")]
    machines = machines_of(rows)
    values = fit(rows, machines)
    counts = ", ".join(f"{sum(r['gpu'] == g for r in rows)} on {g}" for g in machines)
    for name in ("h100", "h200"):
        path = calibration_path(name)
        with open(path) as f:
            data = json.load(f)
        data |= values
        data["fit_source"] = (f"fitted by `calibrate --fit` on {time.strftime('%Y-%m-%d')} to {len(rows)} measured "
                              f"steps ({counts}; the *_measured.jsonl files beside this one)")
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    return values
