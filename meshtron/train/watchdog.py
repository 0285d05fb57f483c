"""A job that stops moving is ended within --hang-timeout, naming the ranks it waits for;
a lost peer is one line from each rank left, saying what the restart will cost.

The training loop says where its rank is (`Progress.at`: the step and its phase: data
loading, forward/backward, optimizer, logging, evaluation, checkpoint). A thread of each
rank (`Watchdog`) writes that position to the job's store every second, a heartbeat, over
a connection of its own (a main thread blocked in the store does not hold it up), and
watches its own rank: no move for the phase's deadline (`deadline`) is a hang. No
collective is involved in any of this: the ranks a hang waits for are those that would
not answer one (its one all-gather is at the start).

A hang, on every rank that can still run its watchdog: its Python stacks (every thread's)
and the flight recorders' last collectives (NCCL's on GPUs, gloo's where torch has one)
are written under <--checkpoint-dir>/hang-step-N (else beside --metrics-file, else a
temporary directory; the line names it), then its position and unfinished collective go
to the store. The first rank there is the one that decides: it waits until every rank has
either reported or gone quiet (a heartbeat that no longer moves: a stopped process, a dead
one, a lost node), names the ranks that did not arrive (those gone quiet; else those whose
position is behind the others'; else those a collective of some group still waits for,
by its sequence numbers), prints the one line and stores it; every rank then exits
(EXIT_HANG), so the launcher ends the job, or restarts it under --max-restarts.

A lost peer: a rank whose collective fails because a peer went away (gloo's "Connection
reset by peer") hands the error to `lost_peer`; the same exchange finds the ranks gone
quiet, and each rank left prints one line (which ranks, at which step, that the job
restarts and the steps lost since the newest checkpoint) instead of a traceback, and
exits. An error with no rank gone quiet is not a lost peer: it is raised as it came.
Under torchrun the job's store is held by node 0's agent, which node 0's loss takes along:
a rank that finds the store gone decides alone that node 0's ranks are lost.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import tempfile
import threading
import time
import uuid

import torch.distributed as dist

from meshtron.train.hang_report import (
    evidence_root,
    flight_recorder_dumps,
    hang_line,
    last_collectives,
    lost_line,
    next_attempt,
    verdict,
    write_evidence,
)
from meshtron.train.lifetime import under_torchrun, write_error_file
from meshtron.train.progress import PHASES, STEP_PHASES, Progress

BEAT_S = 1.0
QUIET_S = 3 * BEAT_S       # a heartbeat that has not moved for this long is a process that no longer runs
POLL_S = 0.2
STORE_TIMEOUT_S = 10       # the watchdog's store operations: a store that does not answer must not hold it
# the default deadline of a step's phase: FACTOR x the slowest step seen, at least FLOOR_S (a loaded host, a
# collector's pause, a slow read are no hang), at most CEILING x --pg-timeout (named before a collective fails)
FACTOR, FLOOR_S, CEILING = 5, 30.0, 0.5
EXIT_HANG = 124            # GNU timeout's status for a command it stopped
EXIT_LOST_PEER = 1
# how gloo and NCCL say that a peer went away; an error so worded is a lost peer only if a rank went quiet
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ncclRemoteError",
             "remote process exited", "Connection refused")


def deadline(progress: Progress, hang_timeout: float | None, pg_timeout: float,
             unarmed: tuple[str, ...] = ()) -> float | None:
    """Seconds the current phase may last before it is a hang; None: not watched. The first step
    (compiling, warming up) and a phase of no kind seen before are not watched: a hang there
    still fails at --pg-timeout. Evaluation and checkpoints never get less than FACTOR x their
    longest yet."""
    phase = progress.phase
    basis = progress.slowest_step or progress.first_step
    if hang_timeout == 0 or basis is None or phase in unarmed or phase not in PHASES:
        return None
    limit = hang_timeout or min(max(FACTOR * basis, FLOOR_S), CEILING * pg_timeout)
    if phase in STEP_PHASES:
        return limit
    longest = progress.longest.get(phase)
    return None if longest is None else max(limit, FACTOR * longest)


def is_peer_error(error: BaseException) -> bool:
    """Whether `error` is how a collective ends when a peer went away (to be confirmed by the heartbeats)."""
    for e in (error, error.__cause__, error.__context__):
        if e is not None and (isinstance(e, getattr(dist, "DistNetworkError", ())) or
                              any(s in str(e) for s in PEER_GONE)):
            return True
    return False


class Watchdog:
    """Each rank's: heartbeats to the job's store, the hang deadline, and what the job does
    when it stops moving or loses a peer (the module's doc). `start` on every rank at once
    (one all-gather: this run's name in the store, where every rank runs), `stop` when the
    run ends."""

    def __init__(self, progress: Progress, *, hang_timeout: float | None, pg_timeout: float,
                 checkpoint_dir: str | None = None, metrics_file: str | None = None, resume_auto: bool = False,
                 unarmed: tuple[str, ...] = ()):
        self.progress = progress
        self.hang_timeout, self.pg_timeout, self.unarmed = hang_timeout, pg_timeout, unarmed
        self.root = evidence_root(checkpoint_dir, metrics_file)
        self.resume_auto = resume_auto
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = None
        self._beats = 0
        self._stop = threading.Event()
        self._incident = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """A collective: every rank of the job calls it, once the run's set-up is done."""
        # this run's keys, apart from an earlier run's in the same store (rank 0's name for them); and
        # where every rank runs, for a verdict without the store (_without_store)
        mine = (uuid.uuid4().hex, socket.gethostname(), os.getpid(), int(os.environ.get("GROUP_RANK", "0")))
        self.table = [mine]
        if self.world > 1:
            self.table = [None] * self.world
            dist.all_gather_object(self.table, mine)
        self.store = QuietStore(dist.PrefixStore(f"meshtron/watchdog/{self.table[0][0]}", _own_connection()))
        self._beat()   # before any step: a rank that hangs later has a heartbeat to read
        self._thread = threading.Thread(target=self._run, name="meshtron-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * BEAT_S)

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat()
            limit = deadline(self.progress, self.hang_timeout, self.pg_timeout, self.unarmed)
            if limit is not None and time.monotonic() - self.progress.since > limit:
                self._hang(limit)

    def _beat(self) -> None:
        self._beats += 1
        p = self.progress
        try:
            self.store.set(f"beat/{self.rank}", json.dumps({"n": self._beats, "step": p.step, "phase": p.phase,
                                                            "pid": os.getpid(), "host": socket.gethostname()}))
        except Exception:  # noqa: BLE001 - a store that does not answer: the deadline still ends the rank
            pass

    def _heartbeats(self) -> dict[int, dict]:
        keys = [f"beat/{r}" for r in range(self.world)]
        try:
            if self.store.check(keys):
                return {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}
            # a rank that never beat (it did not get this far): the others one by one
            return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])}
        except Exception:  # noqa: BLE001 - a store gone: no heartbeat to read
            return {}

    def _reports(self) -> dict[int, dict]:
        try:
            if not self.store.check(["reports"]):
                return {}
            lines = self.store.get("reports").decode().splitlines()
        except Exception:  # noqa: BLE001
            return {}
        return {rep["rank"]: rep for rep in map(json.loads, filter(None, lines))}

    # ---- an incident: a hang, a lost peer ----------------------------------------------

    def _hang(self, limit: float) -> None:
        """This rank made no progress for `limit` seconds: write the evidence, agree who is missing, end."""
        with self._incident:
            p = self.progress
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))   # a restarted job's hang: its own
            proposed = f"hang-step-{p.step:08d}" + (f"-attempt{attempt + 1}" if attempt else "")
            try:   # the first rank's name for the incident's directory
                name = self.store.compare_set("evidence", "", proposed).decode()
            except Exception:  # noqa: BLE001
                name = proposed
            directory = os.path.join(self.root, name)
            dumps = flight_recorder_dumps()
            try:
                write_evidence(directory, self.rank, p, dumps)
            except OSError as e:
                print(f"meshtron: rank {self.rank} could not write its stacks to {directory}: {e}", file=sys.stderr,
                      flush=True)
            v, decided = self._agree("hang", last_collectives(dumps), wait_s=limit)
            line = hang_line(v, limit, directory, next_attempt(p, self.resume_auto), self.hang_timeout is not None)
            self._end(line, EXIT_HANG, say=decided)

    def lost_peer(self, error: BaseException) -> None:
        """The training thread's collective failed with `error`: if a peer went away (a rank gone
        quiet), one line and exit; else return, and the caller raises the error as it came."""
        if self.store is None or not is_peer_error(error):
            return
        with self._incident:   # a hang found by this rank's thread first ends the process from there
            v, _ = self._agree("lost peer", {}, wait_s=QUIET_S)
            if v["kind"] == "hang":   # a rank's watchdog decided first, and its end failed this collective
                self._end(None, EXIT_HANG, say=False)
            if not v["gone"]:
                return
            line = lost_line(self.rank, v, self.progress, next_attempt(self.progress, self.resume_auto))
            self._end(line, EXIT_LOST_PEER, say=True)

    def _agree(self, kind: str, collectives: dict, wait_s: float) -> tuple[dict, bool]:
        """Report this rank, and the verdict: the first rank here decides it (waiting until every rank
        has reported or gone quiet, at most `wait_s` beyond QUIET_S), the others read it. (verdict,
        whether this rank decided it)."""
        p = self.progress
        report = {"rank": self.rank, "step": p.step, "phase": p.phase, "still_s": time.monotonic() - p.since,
                  "collectives": collectives}
        try:
            self.store.append("reports", json.dumps(report) + "\n")
            first = self.store.add("decider", 1) == 1
        except Exception:  # noqa: BLE001 - no store: this rank decides alone
            return self._without_store(kind, report), True
        if not first:
            waited = time.monotonic()
            while time.monotonic() - waited < wait_s + QUIET_S + STORE_TIMEOUT_S:
                try:
                    if self.store.check(["verdict"]):
                        return json.loads(self.store.get("verdict")), False
                except Exception:  # noqa: BLE001
                    break
                self._pause()
        v = self._decide(kind, wait_s)   # the first is gone too, or it never came: decide here
        try:
            self.store.compare_set("verdict", "", json.dumps(v))
            v = json.loads(self.store.get("verdict"))   # whichever was stored first
        except Exception:  # noqa: BLE001
            pass
        return v, first

    def _without_store(self, kind: str, report: dict) -> dict:
        """The verdict of a rank that cannot reach the job's store. Under torchrun the store is held by
        the agent of node 0, and a worker dies with its agent (lifetime.die_with_agent): a store that
        no longer answers is node 0 gone, its ranks with it."""
        v = {"kind": kind, "gone": [], "behind": [], "why": "", "reports": {str(self.rank): report}}
        node0 = [r for r, (_, _, _, node) in enumerate(self.table) if node == 0]
        if under_torchrun() and self.rank not in node0:
            host = self.table[node0[0]][1]
            v |= {"gone": node0, "why": f"node 0 on {host}, gone with its agent, which held the job's store"}
        return v

    def _decide(self, kind: str, wait_s: float) -> dict:
        t0, before = time.monotonic(), self._heartbeats()
        while True:
            self._pause()
            reports, now = self._reports(), self._heartbeats()
            if self.store.gone:   # it failed while we waited: nothing read from it is whole
                return self._without_store(kind, reports.get(self.rank) or {})
            quiet = [r for r in range(self.world) if r not in reports and (before.get(r) or {}).get("n") ==
                     (now.get(r) or {}).get("n")]
            waited = time.monotonic() - t0
            if len(reports) == self.world or (waited >= QUIET_S and (len(reports) + len(quiet) == self.world or
                                                                     waited >= QUIET_S + wait_s)):
                return verdict(kind, reports, before, now, self.world)

    def _pause(self) -> None:
        """POLL_S of waiting, beating on the way (the thread that waits may be the one that beats)."""
        time.sleep(POLL_S)
        if threading.current_thread() is self._thread:
            self._beat()

    def _end(self, line: str | None, code: int, say: bool) -> None:
        """The process's end: `line` in the error file (the launcher's summary carries it) and, where
        `say`, on stderr unless the launcher prints it (no restart follows); then exit."""
        if line is not None:
            launcher_says = write_error_file(line)
            restarts = under_torchrun() and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < int(
                os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
            if say and (restarts or not launcher_says):
                print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class StoreGone(RuntimeError):
    """The job's store failed once: it is not asked again."""


class QuietStore:
    """The watchdog's store: one operation at a time (its two threads share a connection), none once
    one has failed, and the C++ complaints of a store that is gone (a TCPStore's failed socket writes
    a warning with its C++ stack, some 25 lines a rank) kept off stderr."""

    def __init__(self, store):
        self._store, self.gone = store, False
        self._lock = threading.Lock()
        self._capture = tempfile.TemporaryFile()

    def __getattr__(self, name: str):
        fn = getattr(self._store, name)

        def call(*args):
            with self._lock:
                if self.gone:
                    raise StoreGone("the job's store failed before")
                with _stderr_without_store_complaints(self._capture):
                    try:
                        return fn(*args)
                    except Exception:
                        self.gone = True
                        raise
        return call


_COMPLAINT = ("Exception raised from", "frame #", "<omitting python frames>")


@contextlib.contextmanager
def _stderr_without_store_complaints(capture):
    """fd 2 into `capture` while the block runs, then copied back, less c10d's socket warnings and their
    C++ frames (what another thread wrote meanwhile comes through, a moment late)."""
    sys.stderr.flush()
    capture.seek(0)
    capture.truncate()
    try:
        saved = os.dup(2)
    except OSError:   # no stderr to keep clean
        yield
        return
    os.dup2(capture.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        capture.seek(0)
        kept = [line for line in capture.read().decode(errors="replace").splitlines(keepends=True)
                if line.strip() and "TCPStore.cpp" not in line and "socket.cpp" not in line
                and not line.startswith(_COMPLAINT)]
        if kept:
            os.write(2, "".join(kept).encode())


def _own_connection():
    """The job's store over a connection of this thread's own, with a short timeout (Store.clone,
    torch 2.7 on); the process group's where it cannot be cloned."""
    store = dist.distributed_c10d._get_default_store()
    try:
        clone = store.clone()
    except (AttributeError, RuntimeError):
        return store
    clone.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return clone
