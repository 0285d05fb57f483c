"""Tensor parallelism's collectives hidden behind compute: each block runs its
micro-batch as independent parts (Domino's idea: Wang et al., 2024).

Under TP a block's collectives lie on its critical path: with SP the all-gather
before each column-parallel pair and the reduce-scatter after each row-parallel
linear (2 + 2 per layer forward, as many backward), each moving
B x T x d x 2 bytes / tp per rank, and nothing in the block can run while they
do: its next matmul needs their result. Cut the micro-batch into `parts` along the
batch dim inside each block and the parts are independent, so while one part's
collective is in flight another part's matmuls and attention can run. The block is
compiled with inductor's overlap scheduler, which orders the compiled graph (forward
and backward) so that each collective is issued as soon as its input exists and
waited for only where its output is used, with the other part's compute between.

Exactness: rows of a matmul, attention over a sample and a norm over a token do
not interact across samples, so each part computes what the whole batch computes
for its samples (to the rounding of a matmul of fewer rows). Cost: each matmul
runs as `parts` matmuls of B/parts x T rows (at B = 16, T = 2048 and parts = 2:
16K rows each, still at the GPU's matmul rate) and the parts' outputs are
concatenated (one copy of the block's output, B x T/tp x d).

Where it does not apply: blocks given a per-batch argument other than one tensor
per sample (a document mask, a KV cache) run whole; a micro-batch of one sample
cannot be cut.
"""
from __future__ import annotations

import torch
import torch.nn as nn

SCHEDULER = {   # inductor options of each compiled block
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    # every rank must issue its collectives in the same order: estimate compute by
    # formula (benchmarking it would time each rank's kernels and could order them
    # differently) and keep each collective whole (no bucketing across the parts)
    "aten_distributed_optimizations.compute_estimator": "analytical",
    "aten_distributed_optimizations.collective_bucketing": False,
}


def _split_args(args: tuple, kwargs: dict, batch: int, parts: int):
    """Each part's (args, kwargs), or None when an argument cannot be cut by sample."""
    def cut(x):
        if x is None or not isinstance(x, torch.Tensor):
            return [x] * parts if x is None or isinstance(x, (int, float, bool, str)) else None
        if x.ndim >= 2 and x.shape[0] == batch:
            return list(x.chunk(parts))
        return [x] * parts if x.ndim <= 1 else None   # (T,) positions: the same for every sample
    cuts = [cut(a) for a in args]
    kcuts = {k: cut(v) for k, v in kwargs.items()}
    if any(c is None for c in cuts) or any(c is None for c in kcuts.values()):
        return None
    return [(tuple(c[i] for c in cuts), {k: c[i] for k, c in kcuts.items()}) for i in range(parts)]


def _split(cls: type, parts: int) -> type:
    def forward(self, h, *args, **kwargs):
        batch = h.shape[0]
        each = _split_args(args, kwargs, batch, parts) if batch >= parts else None
        if each is None:
            return cls.forward(self, h, *args, **kwargs)
        outs = [cls.forward(self, x, *a, **k) for x, (a, k) in zip(h.chunk(parts), each)]
        return torch.cat(outs)
    return type(f"Split{cls.__name__}", (cls,), {"forward": forward})


def split_batch(blocks: list[nn.Module], parts: int = 2) -> None:
    """Each block's forward runs its micro-batch as `parts` independent parts (a
    subclass swap: parameter names, and so checkpoints, stay as they are)."""
    if parts < 2:
        return
    made: dict[type, type] = {}
    for block in blocks:
        cls = type(block)
        block.__class__ = made.setdefault(cls, _split(cls, parts))


def compile_options() -> dict:
    """The overlap scheduler's options, those this torch has (it came in torch 2.10).
    None on a machine without CUDA: its cost model reads the GPU's memory bandwidth
    (on the CPU the parts compile, as in the tests, but nothing orders them)."""
    if not torch.cuda.is_available():
        return {}
    from torch._inductor import config
    known = set(config._config) if hasattr(config, "_config") else set()
    return {k: v for k, v in SCHEDULER.items() if k in known}
