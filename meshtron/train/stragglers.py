"""Stragglers named at each log line: every rank's busy time a step, against the median.

In a synchronous job every rank's step takes the same wall time: a slow rank makes the
others wait in their collectives. What tells them apart is the time a rank spends on its
own work, busy: loading data (no collective in it) and computing, the step's time less what
it waited in collectives. Each rank measures that on its own over the log interval
(meshtron/train/progress.py's Progress, no collective per step); at the log line one
small all-gather brings every rank's figures together, and a rank whose busy time exceeds
the median's by more than --straggler-threshold is named, with its time.

How the computing is told from the waiting:
- CPU ranks (gloo): the training thread's CPU time in forward/backward and the optimizer.
  A thread blocked in a gloo collective uses no CPU; one computing does (one thread per
  rank, OMP_NUM_THREADS=1, as the launchers set it).
- GPUs (NCCL): the host runs ahead of the device, so its clocks say nothing of either. The
  flight recorder (TORCH_NCCL_ENABLE_TIMING, set by lifetime.init_process_group) holds the
  duration of each collective's kernels; their share of the interval the recorder covers is
  the time in collectives. A collective that overlaps compute counts as waiting on every
  rank alike; the slow rank's collectives are the short ones, since the others' wait for it.
"""
from __future__ import annotations

import pickle
import statistics
import time

import torch
import torch.distributed as dist

from meshtron.train.progress import Progress

COMPUTE = ("forward/backward", "optimizer")
FIELDS = ("busy", "compute", "data", "wait")


class Stragglers:
    """The all-gather at each log line and what it found, for the log and the closing line."""

    def __init__(self, threshold: float, device: torch.device):
        self.threshold, self.device = threshold, device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.active = threshold > 0 and self.world > 1
        self.intervals = 0
        self.seen: dict[int, float] = {}   # rank -> its largest ratio to the median
        self.counts: dict[int, int] = {}   # rank -> log lines that named it
        self._started = None
        # a CPU rank's wait is its wall time less its CPU time: in collectives, or for a core of its own
        self._waiting = " in collectives" if device.type == "cuda" else " in collectives or for a core"

    def interval(self, progress: Progress, step: int, say) -> None:
        """At a log line, on every rank: the interval's times, gathered; `say` the stragglers (rank 0's
        log). The run's first interval, its first step, compiles and warms up: it only starts the clock."""
        wall, cpu, steps = progress.take()
        since, self._started = self._started, time.time_ns()
        if not self.active or since is None or steps == 0:
            return
        mine = torch.tensor([v / steps for v in self._split(wall, cpu, since)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        self.intervals += 1
        rows = {r: dict(zip(FIELDS, t.tolist())) for r, t in enumerate(every)}
        median = statistics.median(row["busy"] for row in rows.values())
        slow = {r: row["busy"] / median for r, row in rows.items() if median > 0 and
                row["busy"] > self.threshold * median}
        for r, ratio in slow.items():
            self.seen[r] = max(self.seen.get(r, 0.0), ratio)
            self.counts[r] = self.counts.get(r, 0) + 1
        if slow and self.rank == 0:
            named = "; ".join(
                f"rank {r} busy {rows[r]['busy']:.3f} s a step ({rows[r]['compute']:.3f} s computing, "
                f"{rows[r]['data']:.3f} s loading data; {rows[r]['wait']:.3f} s waiting{self._waiting}), "
                f"{ratio:.2f}x the median" for r, ratio in sorted(slow.items(), key=lambda kv: -kv[1]))
            say(f"stragglers at step {step} (over --straggler-threshold {self.threshold:g}; the ranks' median "
                f"{median:.3f} s busy a step): {named}")

    def _split(self, wall: dict, cpu: dict, since_ns: int) -> tuple[float, float, float, float]:
        """(busy, compute, data, wait) seconds of this rank over the interval."""
        data = wall.get("data loading", 0.0)
        stepping = sum(wall.get(p, 0.0) for p in COMPUTE)
        if self.device.type == "cuda":
            share = collective_share(since_ns)
            compute = stepping if share is None else stepping * (1.0 - share)
        else:
            compute = min(stepping, sum(cpu.get(p, 0.0) for p in COMPUTE))
        return data + compute, compute, data, stepping - compute

    def summary(self) -> str:
        """For the closing line: whether stragglers were seen ('' where none are looked for)."""
        if not self.active:
            return ""
        if not self.seen:
            return f"; no straggler seen at {self.intervals} log line{'s' if self.intervals != 1 else ''}"
        named = ", ".join(f"rank {r} at {self.counts[r]} of {self.intervals} (up to {self.seen[r]:.2f}x the median)"
                          for r in sorted(self.seen))
        return f"; stragglers seen: {named}"


def collective_share(since_ns: int) -> float | None:
    """The share of the time since `since_ns` (wall clock) that this rank's NCCL collectives ran,
    from the flight recorder's durations; over the part of it the recorder still holds where its
    ring has overwritten the start. None where it has no durations (a CPU build, timing off)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    try:
        try:
            blob = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        except TypeError:
            blob = dump()
        entries = pickle.loads(blob).get("entries", [])   # noqa: S301 - this process's own recorder's bytes
    except Exception:  # noqa: BLE001 - no recorder: the split is not measured
        return None
    timed = [e for e in entries if e.get("duration_ms") is not None and e.get("time_created_ns", 0) >= since_ns]
    if not timed:
        return None
    start = max(since_ns, min(e["time_created_ns"] for e in entries))
    span_s = (time.time_ns() - start) / 1e9
    return min(1.0, sum(e["duration_ms"] for e in timed) / 1e3 / span_s) if span_s > 0 else None
