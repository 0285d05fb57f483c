"""Test hooks for faults at scale (environment, not flags), run before each step, in its data
loading, by the command line (meshtron/cli/train.py):

MESHTRON_SLOW_RANK=R:F   rank R is a straggler: each step takes F times its own work, the rest
                         asleep (F - 1 times the CPU time it used since the last step began).
MESHTRON_HANG=R:S:HOW    on a job's first attempt, rank R at step S: `stop` sends itself SIGSTOP
                         (a process stopped), `data` blocks for ever (a rank stuck in data loading),
                         `collective` waits in an all-reduce of a group of every rank that no other
                         rank joins (a rank stuck in a collective).
"""
from __future__ import annotations

import os
import signal
import threading
import time

from meshtron.config import ConfigError

HOW = ("stop", "data", "collective")


def _parse(name: str, kinds: tuple) -> tuple | None:
    value = os.environ.get(name)
    if value is None:
        return None
    parts = value.split(":")
    try:
        if len(parts) != len(kinds):
            raise ValueError
        return tuple(kind(p) for kind, p in zip(kinds, parts))
    except ValueError:
        raise ConfigError(f"{name}={value!r} must read " + ":".join(k.__name__.upper() for k in kinds)) from None


def _how(value: str) -> str:
    if value not in HOW:
        raise ValueError
    return value


def slow(rank: int):
    """MESHTRON_SLOW_RANK's hook for this rank, or None."""
    found = _parse("MESHTRON_SLOW_RANK", (int, float))
    if found is None or found[0] != rank:
        return None
    factor, last = found[1], []

    def hook(step: int) -> None:
        if last:
            time.sleep(max(0.0, (factor - 1) * (time.thread_time() - last[0])))
        last[:] = [time.thread_time()]
    return hook


def hang(rank: int):
    """MESHTRON_HANG's hook for this rank, or None."""
    found = _parse("MESHTRON_HANG", (int, int, _how))
    if found is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    at, how = found[1], found[2]
    if how == "collective":   # a group of every rank, made by every rank, where only this one will call
        import torch
        import torch.distributed as dist
        group = dist.new_group(group_desc="planted_hang")
    if found[0] != rank:
        return None

    def hook(step: int) -> None:
        if step != at:
            return
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif how == "data":
            threading.Event().wait()   # never set
        else:
            dist.all_reduce(torch.zeros(1), group=group)   # which no other rank joins
    return hook


def on_step(*hooks):
    """One on_step hook of the given ones (None where there is none)."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None

    def hook(step: int) -> None:
        for h in hooks:
            h(step)
    return hook
