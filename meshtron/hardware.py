"""The GPUs the planner knows: what its step-time model needs of a device and its
links, read from calibration files that `python -m meshtron.plan calibrate`
(meshtron.calibrate) writes. The shipped ones were measured on one GPU of each
kind (benchmarks/RESULTS.md); their "measured" key lists what was, the rest
(links, for now) are nominal NVLink / InfiniBand figures."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What the step-time model needs of a GPU and its links (`calibrate` measures it)."""
    name: str
    peak_flops: float          # dense bf16 FLOP/s (what MFU is quoted against)
    matmul_efficiency: float   # achieved / peak at training shapes
    memory_bytes: float        # usable device memory
    intra: tuple[float, float]  # (alpha s, bandwidth B/s) inside a node
    inter: tuple[float, float]  # across nodes
    hbm_bandwidth: float = 4.8e12   # B/s: what the memory-bound ops move
    attention_efficiency: float = 0.5   # causal flash attention, forward and backward, achieved / peak


def _read(path: str) -> Hardware:
    with open(path) as f:   # a calibration file (meshtron.calibrate)
        data = json.load(f)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    return Hardware(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields})


_HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = {name: _read(os.path.join(_HERE, "calibration", f"{name}.json")) for name in ("h200", "h100")}


def hardware(name: str) -> Hardware:
    return GPUS[name] if name in GPUS else _read(name)
