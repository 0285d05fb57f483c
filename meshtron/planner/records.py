"""Steps measured on this machine, which the planner reads the next time it plans for it.

Every `--layout auto` trial (meshtron.cli.layout_auto) appends a row to
`$MESHTRON_CALIBRATION_DIR/<device>.jsonl` (default `~/.cache/meshtron/`), one file per
device name, in the format of `calibration/h200_measured.jsonl` (which meshtron.planner.fit
reads too): `world`, `flags` (the recipe's), `step_ms`, `peak_mem_gib`, `source` (what
measured it: the device, torch, the date), and here `gpus_per_node`; a trial that failed
has no `step_ms` and says why in `error`.

`correct` applies a device's rows to the planner's predictions: a layout measured before
takes its measured step time and peak, and the others' step times are scaled by the median
measured/predicted ratio of the rows (the model planned again for each row, so a better
model needs no new rows), clamped to RATIO_RANGE. A device without a calibration of its
own (the CPU, a GPU other than the shipped ones) is timed with another's, and its rows
bring its predictions to its own scale.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics

from meshtron.config import Config, ModelConfig

GiB = 2 ** 30
# a calibration off by more than this is the wrong one: the rows' own layouts still stand,
# the others keep the model's ranking and this much of its scale
RATIO_RANGE = (0.1, 10.0)


def directory() -> str:
    return os.environ.get("MESHTRON_CALIBRATION_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "meshtron")


def path(device: str) -> str:
    """The rows of a device, by its name ("NVIDIA H100 80GB HBM3" -> nvidia-h100-80gb-hbm3.jsonl; "cpu")."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"
    return os.path.join(directory(), f"{slug}.jsonl")


def read(device: str) -> list[dict]:
    try:
        with open(path(device)) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:   # a line cut short by a run killed while it wrote
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def append(device: str, rows: list[dict]) -> str:
    """Add rows to the device's file; returns its path."""
    os.makedirs(directory(), exist_ok=True)
    with open(path(device), "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path(device)


def _flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def flags(config: Config, pred) -> str:
    """The recipe's flags of one layout (a Prediction's) of `config`'s job, always spelled the
    same: a layout planned again finds its rows by them, and fit.layout_of_row reads them back."""
    m, tr = config.model, config.training
    model = [_flag(f.name, getattr(m, f.name)) for f in dataclasses.fields(ModelConfig)
             if getattr(m, f.name) != f.default]
    return " ".join([*model, f"--seq-len {tr.seq_len}", f"--global-batch {tr.global_batch}", pred.flags(),
                     f"--dtype {pred.par.dtype}"])


def row(config: Config, pred, world: int, gpus_per_node: int, step_s: float | None, peak_gib: float | None,
        source: str, error: str | None = None) -> dict:
    out = {"world": world, "gpus_per_node": gpus_per_node, "flags": flags(config, pred),
           "step_ms": None if step_s is None else round(step_s * 1e3, 3),
           "peak_mem_gib": None if peak_gib is None else round(peak_gib, 3), "source": source}
    if error is not None:
        out["error"] = error
    return out


def correct(preds: list, rows: list[dict], config: Config, world: int, gpus_per_node: int, hw,
            device: str) -> tuple[list, str | None]:
    """(the predictions with the device's rows applied, a line saying how; None without rows):
    see the module's docstring. `preds`: plan.plan's for `config`'s job on `world` ranks."""
    from meshtron.planner import fit  # its reading of a row's flags
    ratios, measured = [], {}
    for r in rows:
        if not r.get("step_ms") or r.get("excluded"):
            continue
        try:
            again = fit.predict_row(r, hw, r.get("gpus_per_node", min(8, r["world"])))
        except Exception:  # noqa: BLE001 - a row of a model or flag this version does not know: not this device's measure
            continue
        ratios.append(r["step_ms"] / 1e3 / again.step_s)
        measured.setdefault((r["world"], r["flags"]), []).append(r)
    if not ratios:
        return preds, None
    lo, hi = RATIO_RANGE
    scale = min(max(statistics.median(ratios), lo), hi)
    out, found = [], 0
    for p in preds:
        same = measured.get((world, flags(config, p)))
        if same:
            found += 1
            step = statistics.median(r["step_ms"] for r in same) / 1e3
            peaks = [r["peak_mem_gib"] for r in same if r.get("peak_mem_gib") is not None]
            memory = max(peaks) * GiB if peaks else p.memory
        else:
            step, memory = p.step_s * scale, p.memory
        out.append(dataclasses.replace(p, step_s=step, memory=memory, mfu=p.mfu * p.step_s / step))
    return out, (f"{found} of these layouts measured on this device before (their step time and peak as measured), "
                 f"the others' step times x{scale:.2f}: the median measured/predicted of {len(ratios)} rows of "
                 f"{path(device)} (held to {lo:g}-{hi:g}x)")
