"""A job's lifetime: its workers die with their torchrun agent, and it holds its
checkpoint directory, alone, while it lives.

torchrun starts every worker in a session of its own, so a SIGKILL to the agent
(or to the agent's process group) leaves the workers training and writing
checkpoints into a directory that the next job then shares with them.
`die_with_agent` asks the kernel to SIGKILL the worker when its parent (the
agent) goes: Linux's prctl(PR_SET_PDEATHSIG); elsewhere a thread polls the
parent pid. SIGKILL because a worker stuck in a collective runs no Python signal
handler; it cannot leave a half-written checkpoint, since `checkpoint.save`
makes a save visible by one rename once it is whole. `die_with_parent` does the
same for any process (--checkpoint-async's writer dies with its parent).

`DirectoryLock` is an flock on `<dir>/.lock` for the run's life; the file holds
the holder's host, pid and start time, for the message that refuses a second run.
The kernel drops an flock when its holder dies, so a lock whose holder is gone
is free: the next run takes it and says whose it was.

`unguarded_main` finds a script that would run again in every process that
multiprocessing starts (no `if __name__ == "__main__":`); `raise_open_files_limit`
makes room for tensors shared as file descriptors.

`init_process_group` starts the default process group with the job's timeout,
after tying the worker to its agent; `one_line_errors` is a recipe's entry
point, which turns a user's mistake into one line under torchrun too. The
module imports torch only inside those two, once they need it: a recipe loads it
before parsing its flags, and a mistake in them shows without torch's seconds
of import.
"""
from __future__ import annotations

import ast
import ctypes
import datetime
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>
LAUNCHER_SAYS_ERRORS = "MESHTRON_RUN_SAYS_ERRORS"
"""set by meshtron-run for its workers: it ends a failed job with a line that names the rank and carries the
message of the rank's error file, so one_line_errors writes the message there and prints nothing"""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RESTART_COUNT" in os.environ


def die_with_agent(poll_s: float = 1.0, use_prctl: bool = True) -> str | None:
    """Under torchrun, make this worker die (SIGKILL) when the agent that started
    it dies. Returns how: "prctl", "watchdog" (a thread polling the parent pid,
    where prctl is missing or `use_prctl` is False), or None outside torchrun.
    Call it first thing: a worker orphaned before the call cannot tell its new
    parent from the agent (in a container the agent may be pid 1), but it then
    fails to reach the agent's rendezvous store and exits."""
    if not under_torchrun():
        return None
    return die_with_parent("the torchrun agent", poll_s, use_prctl)


def die_with_parent(parent_is: str = "the parent process", poll_s: float = 1.0, use_prctl: bool = True) -> str:
    """Make this process die (SIGKILL) when its parent process dies: die_with_agent's
    mechanism, for any process (the checkpoint writer, meshtron/train/async_checkpoint.py).
    `parent_is` names the parent in the line printed where the watchdog sees it go."""
    parent = os.getppid()
    if use_prctl and _set_pdeathsig(signal.SIGKILL):
        if os.getppid() != parent:   # the parent died between reading its pid and the prctl
            _die(parent, parent_is)
        return "prctl"
    threading.Thread(target=_watch, args=(parent, poll_s, parent_is), name="meshtron-die-with-parent",
                     daemon=True).start()
    return "watchdog"


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, poll_s: float, parent_is: str) -> None:
    stop = threading.Event()   # never set: a sleep that a daemon thread may be cut off in
    while os.getppid() == parent:
        stop.wait(poll_s)
    _die(parent, parent_is)


def _die(parent: int, parent_is: str) -> None:
    print(f"meshtron: {parent_is} (pid {parent}) is gone; this worker (pid {os.getpid()}) stops",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def unguarded_main() -> str | None:
    """Where the main module, still running, calls this outside `if __name__ == "__main__":`
    ("path:line"), when a process that multiprocessing starts by spawn or its fork server
    would import that module again: such a process would run the script's training too
    (the checkpoint writer, meshtron/train/async_checkpoint.py)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if main is None or name.split(".")[-1] == "__main__":   # `python -m pkg`: multiprocessing skips it
        return None
    frame = sys._getframe()
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:   # not under the main module's own code: a prompt, `python -c`, a test runner
        return None
    path, line = frame.f_code.co_filename, frame.f_lineno
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    guarded = (n.body for n in ast.walk(tree) if isinstance(n, ast.If) and _is_main_guard(n.test))
    if any(body[0].lineno <= line <= body[-1].end_lineno for body in guarded):
        return None
    return f"{path}:{line}"


def _is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return ({s.id for s in sides if isinstance(s, ast.Name)} == {"__name__"}
            and {s.value for s in sides if isinstance(s, ast.Constant)} == {"__main__"})


def raise_open_files_limit() -> None:
    """--checkpoint-async shares each tensor of its host copy as a file descriptor, in the
    training process and in the writer: a model's state can pass the usual soft limit of
    1,024 open files. Raise it to the hard limit, as the system allows any process to."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20),
                                                        hard))
    except (ImportError, ValueError, OSError):   # not POSIX, or not allowed: torch's error says it, if it comes
        pass


def init_process_group(timeout_s: float) -> None:
    """The default process group, with our own timeout (a lost peer fails the job,
    and torchrun --max-restarts restarts it). A world of one outside torchrun
    meets no one: an in-process store and no port, so one-process runs share a
    machine. A torchrun worker first ties its life to the agent's (die_with_agent);
    the agent keeps one store across restarts, so keys are prefixed by attempt:
    a restarted job must not read the addresses a dead attempt published."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        # NCCL's flight recorder: the last collectives of every group, which a hung job's ranks dump
        # (meshtron/train/watchdog.py), with each one's duration, the stragglers' time in collectives
        # (stragglers.py). Read when a group starts; off by default in some torch versions. Yours win.
        if "TORCH_FR_BUFFER_SIZE" not in os.environ:
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not under_torchrun():
        if os.environ.get("WORLD_SIZE", "1") == "1":
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        return
    die_with_agent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"meshtron/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


class DirectoryLocked(ValueError):
    """Another live run holds the directory."""


class DirectoryLock:
    """An exclusive flock on `<directory>/.lock`, held from `acquire` to `release`.
    The file is never deleted (a lock file removed while another process waits
    on its old inode would let two runs in); a clean release empties it, so a
    record found in a free lock is that of a run that died holding it."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, ".lock")
        self._fd: int | None = None

    def acquire(self) -> dict | None:
        """Take the lock. Returns the record of a dead holder it took over (None if
        the lock was clean); raises DirectoryLocked naming a live holder."""
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OSError(e.errno, f"cannot lock {self.path} ({e.strerror}): this filesystem may not "
                                       "support flock") from None
            raise DirectoryLocked(f"checkpoint directory {self.directory} is in use by another run: "
                                  f"{describe(holder)}; stop that run (its lock, {self.path}, frees itself "
                                  "when the run's process ends), or use another directory") from None
        previous = _read(fd)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return previous

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)   # closing the last descriptor drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None


def describe(holder: dict | None) -> str:
    """'pid 123 on host h (since 2026-...)' for a lock record."""
    if not holder:
        return "a run that has not written its record yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('started')})"


def _read(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None


def elastic_hint(message: str, layout: str | None) -> str:
    """What to add to a layout that does not fit the world (`message`) in an elastic job: an attempt's
    world may be smaller than the first's (torchrun --nnodes MIN:MAX with --max-restarts, a node lost),
    and only --layout auto plans for the world each attempt gets."""
    if layout == "auto" or "the world size" not in message or not under_torchrun():
        return ""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return ""
    return (f"; this is attempt {attempt + 1} of a job torchrun restarts (--max-restarts), whose world can change "
            "between attempts (--nnodes MIN:MAX, a node lost): --layout auto plans the layout for the world each "
            "attempt gets, and resumes the checkpoint resharded into it")


def write_error_file(message: str) -> bool:
    """Write `message` to torchrun's error file for this worker, where there is one: torchrun's summary
    then shows it instead of a pointer to its docs, and meshtron-run's closing line carries it. Returns
    whether the launcher will print it (meshtron-run's workers then print nothing themselves)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    with open(error_file, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    return bool(os.environ.get(LAUNCHER_SAYS_ERRORS))


def one_line_errors(fn, *args, **kwargs) -> None:
    """A recipe's entry point: fn(*args, **kwargs) in a world of one without torchrun;
    a problem of the user's (ValueError, OSError, KeyError) is one line on stderr,
    printed once (by rank 0 when every rank found it), and exit 1; success exits 0
    without the interpreter's teardown (below)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        fn(*args, **kwargs)
    except (ValueError, OSError, KeyError) as e:
        rank = int(os.environ.get("RANK", "0"))
        agreed = getattr(e, "all_ranks", False)
        message = f"error: {e}"
        if agreed and rank != 0:
            # every rank found it: rank 0 reports it and fails the job, so torchrun's
            # summary names one failure, with this message, not one per rank
            os._exit(0)
        if not write_error_file(message):   # else the job's one line is the launcher's
            print(message if rank == 0 else f"[rank {rank}] {message}", file=sys.stderr, flush=True)
        os._exit(1)   # skip the process group's teardown, which would wait for ranks that already left
    import torch.distributed as dist  # loaded already by a run that got this far

    if dist.is_initialized():
        dist.destroy_process_group()
    # Skip the interpreter's teardown too. A gloo group that a mesh or a pipeline stage
    # still references keeps its worker threads past destroy_process_group, and a worker
    # that drops the last collective's tensors while the interpreter finalizes needs the
    # GIL, which a finalizing interpreter no longer gives: the job aborts (SIGABRT,
    # "terminate called without an active exception") after it finished, more often on
    # a loaded machine. Everything the run writes is closed by now (Trainer.close).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
