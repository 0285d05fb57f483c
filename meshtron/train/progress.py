"""Where a rank's run is: the step, its phase and since when, written by the training loop
(`Progress.at`) and read by the watchdog's thread (watchdog.py), the stragglers' split
(stragglers.py) and a hang's report (hang_report.py)."""
from __future__ import annotations

import time

PHASES = ("data loading", "forward/backward", "optimizer", "logging", "evaluation", "checkpoint")
STEP_PHASES = PHASES[:4]   # every step's; evaluation and checkpoints come at intervals, and take longer


class Progress:
    """Where this rank's run is: the step, its phase and since when, written by the training
    loop (`at`) and read by the watchdog's thread; the time each phase took since the last
    `take` (wall, and this thread's CPU time: a thread waiting in a gloo collective uses none),
    for the stragglers' split; the slowest step and each phase's longest stretch, for the
    watchdog's deadlines; the newest checkpoint's step, for what a restart loses."""

    def __init__(self):
        self.step, self.phase, self.since = 0, "set-up", time.monotonic()
        self._cpu = time.thread_time()
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.steps = 0                        # steps begun since the last take()
        self.longest: dict[str, float] = {}   # each phase's longest stretch
        self.first_step: float | None = None  # the run's first step (compiles, warms up)
        self.slowest_step: float | None = None   # the slowest of the others
        self._step_s, self._begun = 0.0, 0
        self.saved: int | None = None         # the step of the newest checkpoint this run saved or resumed

    def at(self, phase: str, step: int | None = None) -> None:
        """The training thread enters `phase` (of a new step, where `step` is given)."""
        now, cpu = time.monotonic(), time.thread_time()
        took = now - self.since
        self.wall[self.phase] = self.wall.get(self.phase, 0.0) + took
        self.cpu[self.phase] = self.cpu.get(self.phase, 0.0) + cpu - self._cpu
        if took > self.longest.get(self.phase, 0.0):
            self.longest[self.phase] = took
        if self.phase in STEP_PHASES:
            self._step_s += took
        if step is not None:
            if self._begun == 1:
                self.first_step = self._step_s
            elif self._begun > 1:
                self.slowest_step = max(self.slowest_step or 0.0, self._step_s)
            self._step_s, self._begun = 0.0, self._begun + 1
            self.step = step
            self.steps += 1
        self.phase, self.since, self._cpu = phase, now, cpu

    def take(self) -> tuple[dict[str, float], dict[str, float], int]:
        """(wall, cpu, steps) since the last take, then zero."""
        out = (self.wall, self.cpu, self.steps)
        self.wall, self.cpu, self.steps = {}, {}, 0
        return out
