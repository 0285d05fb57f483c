"""The GPUs the planner knows: what its step-time model needs of a device and its
links, read from calibration files that `python -m meshtron.plan calibrate`
(meshtron.planner.calibrate) writes. The shipped ones were measured on one GPU of each
kind (docs/planner.md); their "measured" key lists what was, the rest
(links, for now) are nominal NVLink / InfiniBand figures. The H100's multi-GPU terms were
fitted to measured steps (`calibrate --fit`: its "fit_source"); the H200's are not yet."""
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
    # ---- what a training step on several GPUs adds (fitted from measured steps: `calibrate --fit`)
    # compiled and eager blocks' GPU time over the calibrated matmul, attention and memory-bound time (the
    # real step also casts, normalizes and runs the optimizer's kernels)
    compute_scale_compiled: float = 1.0
    compute_scale_eager: float = 1.0
    # a collective inside a step over the same collective alone (alpha-beta): concurrent
    # kernels and protocol; the tp, ep and cp collectives it scales are all exposed
    comm_scale: float = 1.0
    # host seconds per collective call a rank issues (launch, dispatch, and the ranks reaching it
    # out of step): small micro-batches are bound by calls x this, not by the GPU
    host_collective_s: float = 0.0
    host_collective_compiled_s: float = 0.0
    host_microbatch_compiled_s: float = 0.0
    # a hidden collective still slows the compute beside it (its kernels take SMs and HBM):
    # this share of FSDP's hidden time shows in the step
    overlap_cost: float = 0.0
    # (ranks, bus bandwidth B/s) of lone collectives inside a node, by group size: on NVSwitch
    # a pair reaches less than the whole node; `intra` stands in without them
    intra_bus: tuple[tuple[int, float], ...] = ()
    # the pipeline's idle share over its schedule's formula
    bubble_scale: float = 1.0
    # GEMMs in another compute dtype as a fraction of bf16's at the same shapes (measured: fp32 without
    # TF32, fp8 with tensorwise and with rowwise scales), and fp32 attention's fraction of bf16's
    matmul_dtype_ratio: tuple[tuple[str, float], ...] = ()
    attention_fp32_ratio: float = 1.0
    # FP8's casts (with their absolute maxima) move this many bytes per element of each linear's
    # input and output gradient
    fp8_cast_bytes: float = 0.0
    fp8_rowwise_cast_bytes: float = 0.0   # the same with a scale per row (an absolute maximum per row and column)
    # (family, recompute, seconds): eager host seconds of one layer of each model family (gpt,
    # llama, moe: a mixture of experts' routing launches many small kernels); host_layer_s and
    # its recompute forms stand in for a family not measured
    host_layers: tuple[tuple[str, str, float], ...] = ()
    # GPU seconds a MoE block's routing takes beyond its counted bytes: small kernels (top-k rounds,
    # counts, the sort) whose time is their launch latency on the device, not their bytes
    moe_layer_s: float = 0.0
    # the eager host time of a training step over calibrate's (the trainer's step adds the loss,
    # clipping and its own Python to the model's forward and backward)
    host_scale: float = 1.0
    # where the multi-GPU terms come from: date, machine, commands (`calibrate --fit` writes it)
    fit_source: str = ""

    def dtype_ratio(self, dtype: str) -> float:
        """GEMM speed in `dtype` (fp32, fp16, bf16, fp8 or fp8_rowwise) over bf16's."""
        if dtype in ("bf16", "fp16"):
            return 1.0
        return dict(self.matmul_dtype_ratio).get(dtype, 1.0)

    def host_layer(self, recompute: str, family: str = "") -> float:
        """Eager host seconds of one layer's forward and backward under `recompute`, for a
        layer of `family` (gpt, llama, moe) where measured."""
        measured = {(f, mode): s for f, mode, s in self.host_layers}
        if (family, recompute) in measured:
            return measured[family, recompute]
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


def calibration_path(name: str) -> str:
    """The file of a shipped GPU's name, or the path given."""
    return os.path.join(_HERE, "calibration", f"{name}.json") if name in ("h200", "h100") else name


GPUS = {name: _read(calibration_path(name)) for name in ("h200", "h100")}


def hardware(name: str) -> Hardware:
    if name in GPUS:
        return GPUS[name]
    if not os.path.isfile(name):
        raise ValueError(f"--gpu {name!r}: neither h200, h100 nor a calibration file")
    return _read(name)


def calibration_line(gpu: str) -> str:
    """Which calibration a prediction used, in one line."""
    hw = hardware(gpu)
    fitted = hw.fit_source or "multi-GPU terms not fitted (one GPU's calibration alone: optimistic on several GPUs)"
    return f"{os.path.relpath(calibration_path(gpu))}: {hw.name}; {fitted}"
