"""Throughput, MFU and memory for the log line.

MFU = achieved model FLOP/s / (dense bf16 peak of the GPU). Model FLOPs come
from GPTConfig.flops_per_token (6N + 12*L*d*T per token, no recomputation
counted), so recomputation lowers MFU, as in Megatron and PaLM.
"""
from __future__ import annotations

import json
import os
import time

import torch

# dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets, no sparsity)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0,
                    "L40S": 362.0, "A10G": 70.0, "B200": 2250.0}


def peak_tflops(device: torch.device | None = None) -> float | None:
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_TFLOPS.items():
        if key in name:
            return peak
    return None


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB, host RSS
    except ImportError:
        return None


class Throughput:
    """Tokens/s and TFLOP/s per GPU over the steps since the last report.
    `attention_per_token`: the part of flops_per_token that is causal attention,
    which `add` scales by the share of it a document mask keeps."""

    def __init__(self, flops_per_token: float, world_size: int, device: torch.device,
                 attention_per_token: float = 0.0):
        self.flops_per_token, self.world_size, self.device = flops_per_token, world_size, device
        self.attention_per_token = attention_per_token
        self.peak = peak_tflops(device)
        self.reset()

    def reset(self):
        self.t0, self.tokens, self.flops = time.perf_counter(), 0, 0.0

    def add(self, tokens: int, attention_kept: float = 1.0):
        self.tokens += tokens
        self.flops += tokens * (self.flops_per_token - self.attention_per_token * (1.0 - attention_kept))

    def report(self) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - self.t0
        tps = self.tokens / dt
        tflops = self.flops / dt / self.world_size / 1e12
        out = {"tokens_per_s": tps, "tokens_per_s_per_gpu": tps / self.world_size, "tflops_per_gpu": tflops,
               "step_time_s": dt}
        if self.peak:
            out["mfu"] = tflops / self.peak
        self.reset()
        return out


class SavedActivations:
    """Live and peak bytes of tensors autograd saved for backward, on any device.

    Each saved tensor is wrapped in a holder whose lifetime is the autograd
    graph's: it counts on pack and uncounts when the graph frees it after
    backward. Tensors saved twice are counted twice (an upper bound), and
    parameters saved for backward are counted too: compare runs of one model.
    """

    def __init__(self):
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        tracker = self

        class Holder:
            def __init__(self, t):
                self.t, self.nbytes = t, t.numel() * t.element_size()
                tracker.live += self.nbytes
                tracker.peak = max(tracker.peak, tracker.live)

            def __del__(self):
                tracker.live -= self.nbytes

        return Holder(t)

    @staticmethod
    def _unpack(h):
        return h.t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class RunLog:
    """Where a run's numbers go, from rank 0 only: the console line, --metrics-file
    (one JSON line per logged step or evaluation, appended, so a resumed run
    continues the file) and --tensorboard (event files; the `tensorboard` package
    is an optional extra)."""

    def __init__(self, rank: int, metrics_file: str | None, tensorboard: str | None, verbose: bool = True):
        self.active = rank == 0
        self.verbose = verbose
        self.metrics_file = metrics_file if self.active else None
        if self.metrics_file:
            # made at start: a missing folder must not end a run at its first log line
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)
        self.writer = None
        if self.active and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.writer = SummaryWriter(tensorboard)

    def print(self, line: str) -> None:
        if self.active and self.verbose:
            print(line, flush=True)

    def record(self, step: int, values: dict, line: str) -> None:
        """One logged step: the console line, a JSON line and TensorBoard scalars."""
        if not self.active:
            return
        self.print(line)
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps({"step": step} | values) + "\n")
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and v is not None:
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
