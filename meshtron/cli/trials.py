"""--layout auto's trials (meshtron.cli.layout_auto): configs trained a few steps each on
every rank of the job at once (`run`), each rank's trial in a process of its own; their
step times and peaks, the same on every rank, and a table of them.

A process of its own, for two reasons. A trial can fail on one rank alone (out of memory
on a pipeline's first stage) and leave the others inside a collective that never ends;
here the job's own processes only wait for their trials, poll together whether any has
failed and stop theirs when one has, so no rank hangs and the job goes on to the next
candidate. And a process's end gives back everything it held (the allocator's cache,
compiled graphs, communicators, a CUDA context), which `del`, gc,
torch.cuda.empty_cache and torch._dynamo.reset in the training process would not all do.

The processes are forks of a fork server (as the checkpoint writer's are: one import of
torch per rank, not one per trial); like multiprocessing's, each imports the main module,
so the training script needs its `if __name__ == "__main__":` guard (`why_not` checks).
They meet at the job's own store (the launcher's, which every node reaches) under a
prefix of their own, or, in a job of one process, at one this process starts.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtron.command_line import TRIAL_STEPS, WARMUP_STEPS
from meshtron.config import CheckpointConfig, Config, ConfigError
from meshtron.train import lifetime

GiB = 2 ** 30
POLL_S = 0.2
# what the fork server imports once: torch's, which initialize no CUDA (a process forked after
# CUDA's start could not use it); meshtron's own, a fraction of the time, each trial imports
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.tensor.parallel",
            "torch.distributed.checkpoint"]


@dataclass(frozen=True)
class Outcome:
    step_s: float | None = None     # the slowest rank's median of the timed steps
    peak_gib: float | None = None   # the fullest rank's peak (a GPU's allocated memory, a CPU process's RSS)
    error: str | None = None        # why the trial failed: the first rank's error


def why_not(world: int, unguarded: str | None) -> str | None:
    """Why this job cannot run trials, or None where it can."""
    if unguarded is not None:
        return (f"a trial process imports the main module, as multiprocessing does: put the training in {unguarded} "
                "under `if __name__ == \"__main__\":`")
    if world > 1 and meeting_point() is None:
        return "a job of several processes started without MASTER_ADDR and MASTER_PORT, where its trials would meet"
    return None


def planted_failure() -> tuple[int, int] | None:
    """MESHTRON_TRIAL_FAIL=K:R (the tests'): trial K (from 1) fails on rank R before its second step."""
    value = os.environ.get("MESHTRON_TRIAL_FAIL")
    if value is None:
        return None
    k, _, r = value.partition(":")
    if not (k.isdigit() and r.isdigit() and int(k) >= 1):
        raise ConfigError(f"MESHTRON_TRIAL_FAIL={value!r} must be TRIAL:RANK (TRIAL from 1)")
    return int(k) - 1, int(r)


def table(candidates: list, outcomes: list[Outcome]) -> list[str]:
    width = max(len(p.flags()) for p in candidates)
    lines = [f"layout auto: the planner's {len(candidates)} fastest, {TRIAL_STEPS} steps each on every rank "
             f"(measured: the median of steps {WARMUP_STEPS + 1}-{TRIAL_STEPS}, the slowest rank's; peak: the "
             "fullest rank's)",
             f"  {'candidate':<{width}}  predicted ms  measured ms  peak GiB measured/predicted"]
    for p, o in zip(candidates, outcomes):
        if o.step_s is None:
            lines.append(f"  {p.flags():<{width}}  {p.step_s * 1e3:>12.1f}  failed: {o.error}")
            continue
        peak = "-" if o.peak_gib is None else f"{o.peak_gib:.2f}"
        lines.append(f"  {p.flags():<{width}}  {p.step_s * 1e3:>12.1f}  {o.step_s * 1e3:>11.1f}  "
                     f"{peak:>17}/{p.memory / GiB:.2f}" + (f"  ({o.error})" if o.error else ""))
    return lines


def trial_config(config: Config, steps: int) -> Config:
    """`config` cut to a trial: `steps` steps; nothing saved, resumed, evaluated, exported or
    written to files (a model built from a Hugging Face directory stays that model)."""
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, steps=steps, metrics_file=None, tensorboard=None),
        data=dataclasses.replace(config.data, eval_data=None),
        checkpoint=CheckpointConfig(init_from_hf=config.checkpoint.init_from_hf))


def meeting_point() -> tuple[str, int] | None:
    """The job's store (host, port), where its trials' processes can meet; None in a job of
    several processes started without one (no MASTER_ADDR and MASTER_PORT)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return None


def run(configs: list[Config], warmup: int, fail: tuple[int, int] | None = None) -> list[Outcome]:
    """Train each config (trial_config's) on every rank, one after another; their outcomes, the
    same on every rank. Call on every rank of the job with the same configs. `warmup`: the
    steps left out of the timing. `fail`: (trial, rank), both from 0: that trial raises an
    out-of-memory error on that rank before its second step (the tests' MESHTRON_TRIAL_FAIL)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=configs[0].training.pg_timeout)
    own, meet = None, meeting_point() if world > 1 else None
    if meet is None:   # a world of one: a store of its own, for its one trial process
        own = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timeout)
        meet = ("127.0.0.1", own.port)
    token = [uuid.uuid4().hex]   # the prefix of this run's trials in a store that outlives them
    dist.broadcast_object_list(token, src=0)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)   # where this process starts the fork server
    outcomes = []
    for k, config in enumerate(configs):
        job = dict(config=config, rank=rank, world=world, addr=meet[0], port=meet[1],
                   prefix=f"meshtron/layout-trial/{token[0]}/{k}", timeout=timeout,
                   fail_step=2 if fail == (k, rank) else None)
        found = [None] * world
        dist.all_gather_object(found, _one(ctx, job))
        outcomes.append(_outcome(found, warmup))
    del own
    return outcomes


def _one(ctx, job: dict) -> dict:
    """This rank's trial process, from start to end, polled with the other ranks': stopped
    as soon as any rank's has failed. What it sent, or why it sent nothing."""
    fd, log = tempfile.mkstemp(prefix="meshtron-trial-", suffix=".log")
    os.close(fd)
    mine, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_trial, args=(theirs, log, job), name=f"meshtron-trial-{job['rank']}")
    try:
        child.start()
        theirs.close()
        result = None
        while True:
            if result is None and mine.poll():
                try:
                    result = mine.recv()
                except EOFError:   # it ended without a word: its exit code says how
                    result = {}
            code = child.exitcode
            failed = (result is not None and "step_s" not in result) or code not in (None, 0)
            # the decision is the reduced one, so every rank leaves the loop at the same round
            state = torch.tensor([failed, result is None and code is None], dtype=torch.int32)
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
            if state[0] or not state[1]:
                break
            time.sleep(POLL_S)
        if state[0] and not failed:   # another rank's failed: this one's may wait in a collective for ever
            return {"stopped": True}
        child.join(timeout=10)   # its teardown, after it sent its result: else stopped below
        if result is None and mine.poll():   # sent as it ended, after the last look
            try:
                result = mine.recv()
            except EOFError:
                pass
        if not result:
            return {"error": f"ended with {_exit(child.exitcode)}{_last_line(log)}", "at": time.time()}
        return result
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        mine.close()
        os.unlink(log)


def _exit(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _last_line(log: str) -> str:
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return f": {lines[-1][:300]}" if lines else ""


def _outcome(found: list[dict], warmup: int) -> Outcome:
    errors = sorted((f["at"], r, f["error"]) for r, f in enumerate(found) if "error" in f)
    if errors:   # the first to fail: the others may have failed of it (a peer's connection closed)
        _, r, error = errors[0]
        return Outcome(error=f"rank {r}: {error}")
    if any("stopped" in f for f in found):
        return Outcome(error="stopped")
    # a rank's median step: a few steps on a shared machine, one of them slowed by something else
    medians = [statistics.median(f["step_s"][warmup:]) for f in found]
    peaks = [f["peak_gib"] for f in found if f.get("peak_gib") is not None]
    return Outcome(max(medians), max(peaks) if peaks else None)


def _trial(conn, log: str, job: dict) -> None:
    """A trial process: join the trial's group, train, send the step times and the peak."""
    lifetime.die_with_parent("the trials' fork server")   # which ends with the training process
    out = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(out, 1)   # torch's warnings and a crash's last words: the log, read where it ends without a result
    os.dup2(out, 2)
    try:
        timeout = job["timeout"]
        store = dist.PrefixStore(job["prefix"], dist.TCPStore(job["addr"], job["port"], job["world"],
                                                              is_master=False, timeout=timeout))
        backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=store, rank=job["rank"], world_size=job["world"], timeout=timeout)
        from meshtron.train.metrics import peak_memory_gib
        from meshtron.train.trainer import Trainer
        trainer = Trainer(job["config"], verbose=False)
        trainer.train(on_step=_failing(job["fail_step"]))
        conn.send({"step_s": trainer.step_s, "peak_gib": peak_memory_gib(trainer.device)})
    except BaseException as e:  # noqa: BLE001 - every failure is the trial's outcome, sent to the job
        message = str(e).strip().splitlines()
        conn.send({"error": f"{type(e).__name__}: {message[0][:300] if message else ''}".rstrip(": "),
                   "at": time.time()})
        if isinstance(e, PlantedOutOfMemoryError):   # it stays, as a failed process may to NCCL, till stopped
            threading.Event().wait()
        raise SystemExit(1) from None


class PlantedOutOfMemoryError(torch.OutOfMemoryError):
    """MESHTRON_TRIAL_FAIL's failure. Its process stays after it (where gloo would tell the other ranks at
    once that a process died, NCCL may not): the ranks that wait in its collectives must be stopped."""


def _failing(step: int | None):
    if step is None:
        return None

    def hook(at: int) -> None:
        if at == step:
            raise PlantedOutOfMemoryError("out of memory (MESHTRON_TRIAL_FAIL)")
    return hook
