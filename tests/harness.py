"""Real multi-rank tests on the CPU: gloo worker pools forked once per world
size and reused for many checks, plus the parity helper.

A check is a module-level function `fn(rank, world_size, *args)`; `run(world,
fn, *args)` calls it on every rank of the pool of that size and returns the
per-rank results. If any rank raises, or the check outlasts its timeout (a
rank stuck in a collective), the pool is killed and restarted on next use, and
the error carries the failing rank's traceback. A fresh 4-rank world costs
seconds; a check on a warm pool costs tens of milliseconds.

Tests start ranks here, not with torch.multiprocessing.spawn: a spawned rank
exits through the interpreter's teardown, and a gloo group that a mesh still
references keeps threads that then abort the finished rank (SIGABRT, "terminate
called without an active exception"), on a loaded machine, after its checks
passed. A pool rank is a forked process, which ends by os._exit (or the pool's
kill), never through that teardown; the recipe skips it the same way
(meshtron/train/lifetime.py, one_line_errors).
"""
from __future__ import annotations

import datetime
import faulthandler
import functools
import gc
import io
import json
import logging
import multiprocessing as mp
import os
import pickle
import runpy
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist

PG_TIMEOUT_S = 60


class RankError(RuntimeError):
    pass


def _worker(rank: int, world_size: int, store_path: str, conn) -> None:
    # A daemon to the parent, which kills it at exit, but not to itself: a rank may start
    # processes of its own (--checkpoint-async's writer), which multiprocessing refuses
    # a daemon. They end with the rank.
    mp.current_process().daemon = False
    # what the parent holds (all the suite ran in it so far) is no garbage of this rank's: left
    # to the collector, a check late in the suite ran past its 120 s timeout, its ranks' stacks
    # inside the collector, where it takes 0.56 s alone
    gc.freeze()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # a check that outlasts its timeout shows where each rank is: the pool asks for the stacks
    faulthandler.register(signal.SIGUSR1, file=open(f"{store_path}.stacks{rank}", "w"), all_threads=True)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(rank, world_size, *args, **kwargs)
            _release_groups()
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()


def _release_groups(keep: int = 24) -> None:
    """Destroy the groups earlier checks made once there are more than `keep`. An
    idle gloo group keeps a thread that wakes every 10 ms: a few hundred of them,
    left in every pool, took most of the CPU from the tests that followed, while a
    mesh costs milliseconds to build again. DTensor's caches hold meshes (equal by
    layout, not by group) from earlier checks, so they are emptied too."""
    if len(dist.distributed_c10d._world.pg_map) <= keep:
        return
    _MESHES.clear()
    for obj in gc.get_objects():
        # type(), not isinstance(): a dead weakref proxy among the objects raises on isinstance
        if type(obj) is functools._lru_cache_wrapper and obj.__module__.startswith("torch.distributed"):
            obj.cache_clear()
    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()   # its C++ fast path's
    gc.collect()
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is not dist.group.WORLD:
            dist.destroy_process_group(pg)
    gc.collect()


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("fork")
        self._tmp = tempfile.mkdtemp(prefix=f"meshtron-pool{world_size}-")
        store_path = self._store_path = os.path.join(self._tmp, "store")
        self.conns, self.procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world_size, store_path, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        for c in self.conns:
            c.send((fn, args, kwargs))
        results, errors = [None] * self.world_size, {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{fn.__name__} on {self.world_size} ranks: ranks {sorted(pending)} "
                                   f"did not finish in {timeout:.0f} s" + _first_error(errors)
                                   + self._stacks(sorted(pending)))
            for r in sorted(pending):
                if self.conns[r].poll(min(left, 0.05)):
                    try:
                        status, value = self.conns[r].recv()
                    except EOFError:   # the rank's process is gone
                        self.procs[r].join(timeout=5)
                        raise RankError(f"rank {r} died (exit code {self.procs[r].exitcode})"
                                        + _first_error(errors)) from None
                    pending.discard(r)
                    if status == "ok":
                        results[r] = value
                    else:
                        errors[r] = value
                elif not self.procs[r].is_alive():
                    raise RankError(f"rank {r} died (exit code {self.procs[r].exitcode})" + _first_error(errors))
            if errors and pending:
                # the others are most likely blocked in a collective with the failed rank
                raise RankError(f"{fn.__name__} failed on ranks {sorted(errors)}" + _first_error(errors))
        if errors:
            raise RankError(f"{fn.__name__} failed on ranks {sorted(errors)}" + _first_error(errors))
        return results

    def _stacks(self, ranks: list[int]) -> str:
        """Where `ranks` are now: each one's Python stacks, every thread."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(1)
        text = ""
        for r in ranks:
            with open(f"{self._store_path}.stacks{r}") as f:   # pytest's frames, forked with the rank, left out
                lines = [x for x in f.read().splitlines() if not any(p in x for p in _PYTEST_FRAMES)]
            text += f"\n--- rank {r} stacks ---\n" + "\n".join(lines)[-8000:]
        return text

    def pause(self) -> None:
        """SIGSTOP the idle ranks (`resume` continues them). A live gloo group keeps a
        thread that wakes every 10 ms; the idle pools of the other world sizes, each rank
        holding up to `_release_groups`' 24, slowed every test after them by up to 1.8x
        (the kernels' tests behind the distributed ones). A stopped rank costs nothing, and
        nothing of it is in flight: it stops between checks, waiting for the next."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, sig)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)


_PYTEST_FRAMES = ("/_pytest/", "/pluggy/", "<frozen runpy>", "/pytest/__main__.py")


def _first_error(errors: dict) -> str:
    if not errors:
        return ""
    r = min(errors)
    return f"\n--- rank {r} traceback ---\n{errors[r]}"


class Pools:
    """One warm pool per world size; a pool that saw a failure is discarded."""

    def __init__(self):
        self._pools: dict[int, WorkerPool] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = WorkerPool(world_size)
        pool.resume()
        try:
            results = pool.run(fn, *args, timeout=timeout, **kwargs)
        except BaseException:
            pool.close()
            del self._pools[world_size]
            raise
        pool.pause()
        return results

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


# ---- worker-side helpers -------------------------------------------------

_MESHES: dict = {}


def mesh(**degrees):
    """A mesh for this layout, shared by the calls within one check."""
    from meshtron import init_mesh

    key = tuple(sorted(degrees.items()))
    if key not in _MESHES:
        _MESHES[key] = init_mesh(device_type="cpu", **degrees)
    return _MESHES[key]


def train(rank, world, argv, exit_after=None):
    """The recipe's whole run on a pool rank: parse argv, build, train; the losses."""
    from meshtron.cli.train import main
    return main(argv, exit_after=exit_after)


# ---- a script's run, forked ------------------------------------------------

_DEFAULT_WARNINGS = list(warnings.filters)   # as the interpreter set them, before any test


def run_script(argv: list[str], env: dict | None = None, cwd: str | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`
    returns, the script run in a child forked from this process: torch and meshtron are
    imported already, where a fresh interpreter spends seconds of CPU on them before the
    script's first line. argv: a script and its arguments, or "-m", a module and its
    arguments. For what a script does; a test of how a fresh process starts (what it imports,
    what it prints on import) starts one."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        code = 1
        gc.freeze()   # as a pool's rank does
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
            sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
            warnings.filters[:] = _DEFAULT_WARNINGS
            warnings.showwarning = warnings._showwarning_orig
            logging.root.handlers.clear()   # pytest's capture
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            # a tokenizer this process ran threads in warns in a fork that uses it again; the
            # fork's own use is single-threaded either way
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = list(argv[1:]) if argv[0] == "-m" else list(argv)
            if argv[0] == "-m":
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:   # noqa: BLE001 - as the interpreter reports it
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    chunks = {out_r: [], err_r: []}
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(argv, timeout)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
    _, status = os.waitpid(pid, 0)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
    return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status), out, err)


# ---- dry runs beside the tests that compare with them ------------------------

_DRY_RUNS = """
import json, pickle, sys
from meshtron.config import Config
from meshtron.models import PRESETS
from meshtron.planner import dry_run
out = {}
for world, argv, ranks, device in json.loads(sys.argv[1]):
    config = Config.from_args(argv, models=PRESETS)
    config = config.on_device(device) if device else config
    out[world, tuple(argv)] = {rank: dry_run.dry_run_rank(config, world, rank) for rank in ranks}
sys.stdout.buffer.write(pickle.dumps(out))
"""


class DryRuns:
    """The dry runs (meshtron.planner.dry_run) of `layouts`, each (world, argv, ranks, device: the
    device the dry run resolves its defaults for, or None for the CPU's), in two processes started
    at once, half the layouts each: a dry run is one thread, the machine has two cores, and the
    tests run beside them. Called with (world, argv): {rank: (state bytes, collectives)}."""

    def __init__(self, layouts: list[tuple[int, list[str], list[int], str | None]], cwd: str):
        self.procs = [subprocess.Popen([sys.executable, "-c", _DRY_RUNS, json.dumps(half)], cwd=cwd,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                      for half in (layouts[0::2], layouts[1::2]) if half]
        self.results = {}

    def __call__(self, world: int, argv: list[str]) -> dict:
        if not self.results:
            for proc in self.procs:
                out, err = proc.communicate(timeout=900)
                assert proc.returncode == 0, err.decode()[-3000:]
                self.results.update(pickle.loads(out))
        return self.results[world, tuple(argv)]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
