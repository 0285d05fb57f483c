"""The GPUs the planner knows: what its step-time model needs of a device and its
links, read from calibration files that `python -m meshtron.plan calibrate`
(meshtron.planner.calibrate) writes. The shipped ones were measured on one GPU of each
kind (benchmarks/RESULTS.md, "Planner accuracy"); their "measured" key lists what was, the rest
(links, for now) are nominal NVLink / InfiniBand figures."""
from __future__ import annotations

import dataclasses
import json
import math
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
    # (tokens per GEMM, matmul efficiency) measured at several micro-batch sizes: small
    # GEMMs fill the GPU less, so a micro-batch of 2048 tokens runs slower per FLOP
    matmul_curve: tuple[tuple[int, float], ...] = ()
    # eager forward + backward host time (Python, kernel launches): a micro-batch whose
    # GPU work is shorter waits for it; compiled graphs launch far less
    host_microbatch_s: float = 0.0
    host_layer_s: float = 0.0
    # per layer with each recompute: full runs the forward twice; selective also sends
    # every op through its policy's Python dispatch mode
    host_layer_full_s: float = 0.0
    host_layer_selective_s: float = 0.0
    # (head dim, sequence length, attention efficiency): short sequences and small
    # heads fill the GPU less; attention_efficiency stands in without one
    attention_curve: tuple[tuple[int, int, float], ...] = ()

    def host_layer(self, recompute: str) -> float:
        """Eager host seconds of one layer's forward and backward under `recompute`."""
        return {"full": self.host_layer_full_s, "selective": self.host_layer_selective_s}.get(recompute) \
            or self.host_layer_s

    def matmul_at(self, tokens: float) -> float:
        """Matmul efficiency at `tokens` rows per GEMM: the curve interpolated in
        log2(tokens), held flat beyond its ends; matmul_efficiency without one."""
        return _interpolate(self.matmul_curve, tokens, self.matmul_efficiency)

    def attention_at(self, head_dim: int, seq_len: float) -> float:
        """Causal attention efficiency over `seq_len` tokens: the curve of the nearest
        measured head dim (in log2), interpolated like matmul_at."""
        dims = {hd for hd, _, _ in self.attention_curve}
        if not dims:
            return self.attention_efficiency
        near = min(dims, key=lambda hd: abs(math.log2(hd) - math.log2(head_dim)))
        return _interpolate([(s, e) for hd, s, e in self.attention_curve if hd == near], seq_len,
                            self.attention_efficiency)


def _interpolate(curve, x: float, default: float) -> float:
    """A curve of (size, value) at `x`: linear in log2(size), flat beyond its ends."""
    curve = sorted(curve)
    if not curve:
        return default
    lx = math.log2(max(x, 1))
    for (t0, e0), (t1, e1) in zip(curve, curve[1:]):
        if lx <= math.log2(t1):
            w = min(max((lx - math.log2(t0)) / (math.log2(t1) - math.log2(t0)), 0.0), 1.0)
            return e0 + w * (e1 - e0)
    return curve[-1][1]


def _read(path: str) -> Hardware:
    with open(path) as f:   # a calibration file (meshtron.planner.calibrate)
        data = json.load(f)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    def value(v):
        return tuple(value(x) for x in v) if isinstance(v, list) else v
    return Hardware(**{k: value(v) for k, v in data.items() if k in fields})


_HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = {name: _read(os.path.join(_HERE, "calibration", f"{name}.json")) for name in ("h200", "h100")}


def hardware(name: str) -> Hardware:
    return GPUS[name] if name in GPUS else _read(name)
