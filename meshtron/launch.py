"""`meshtron-run`: torchrun, with a failed job's end in a line or two.

    meshtron-run --nproc-per-node 4 recipes/train.py --dp 2 --tp 2 --steps 50

It takes torchrun's arguments and starts the same elastic agent
(torch.distributed.run), so a job runs exactly as under torchrun. The
difference is a job's failure: torchrun raises it out of its own main, which
prints its own 16-line traceback and a 14-line summary box after the worker's
one-line error; no worker can shorten that. Here the first failure is one line
(rank, exit code, the worker's message from its error file) and the exit
code is the worker's; a worker of the recipe leaves its message to that line
(lifetime.LAUNCHER_SAYS_ERRORS), so it prints once. torchrun also prints a
4-line banner when it sets OMP_NUM_THREADS=1 for you (more than one process per
node, the variable unset); this sets the same value in the same case, silently.

Workers cost less to start. torchrun starts each rank as a new interpreter, which
imports torch again: seconds of CPU per rank, all ranks at once. Here, with one
thread per process (OMP_NUM_THREADS=1, the default above), a forkserver imports
torch once and forks every rank, which runs the script as `python -u SCRIPT ARGS`
would (`__main__`, sys.argv, sys.path[0], unbuffered output, and no module of
meshtron's loaded: the script imports its own, from its own sys.path and as its
files are now, also after an edit between --max-restarts attempts). Where the
command line already says so, the server starts before the agent imports torch,
and the two imports run side by side. The server starts no
thread and touches no GPU, so a forked rank initialises CUDA as a fresh process
does. It dies with the agent, and each rank's two processes (run_script's)
follow it. `-m`, `--no-python` and `--run-path` jobs,
and jobs with more OpenMP threads (a forked OpenMP pool can deadlock), start as
under torchrun.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import logging
import os
import runpy
import signal
import sys
import traceback

from meshtron.train.lifetime import LAUNCHER_SAYS_ERRORS

# imported once in the forkserver, before any rank is forked from it. Nothing of meshtron: the recipe puts
# its own checkout first on sys.path, which may not be the launcher's, and the server outlives an attempt
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.pipelining"]


def failure_line(error, name: str | None = None) -> str:
    """One line for a torchrun ChildFailedError: its first failure, and how many ranks failed on their own
    (`name` for the job's, where its workers ran a function rather than a script)."""
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, dict):   # what lifetime.one_line_errors writes: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    if message.startswith("To enable traceback"):   # no error file: the worker's traceback is above
        message = "see its output above"
    # ranks the agent stopped after the first failure show as signals (SIGTERM): not failures of their own
    others = sum(f.exitcode > 0 for r, f in error.failures.items() if r != rank)
    also = f" ({others} other rank{'s' if others > 1 else ''} failed too)" if others else ""
    return f"meshtron-run: {name or error.name} failed on rank {rank} (exit code {failure.exitcode}): {message}{also}"


def run_script(path: str, *argv: str) -> None:
    """A rank, forked from the preloaded server: `path` runs in a child of this process,
    whose end is this one's. The agent's function protocol needs a worker that returns,
    and a script may end in os._exit (the recipe's does, past a gloo group's teardown):
    only a process of its own can end so."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    from meshtron.train.lifetime import die_with_parent
    # The server ends when the agent does (its end of a pipe closes), and this process with
    # the server; but every process it forks inherits a copy of the agent's end, which
    # would keep the server alive as long as its ranks
    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    die_with_parent("meshtron-run's fork server")
    pid = os.fork()
    if pid == 0:
        die_with_parent("this rank's process in meshtron-run")
        # multiprocessing as a fresh interpreter has it: the platform's start method (not
        # the server's, whose locks are named and tracked), a resource tracker of its own
        multiprocessing.set_start_method(None, force=True)
        tracker = resource_tracker._resource_tracker
        if getattr(tracker, "_fd", None) is not None:
            os.close(tracker._fd)
            tracker._fd, tracker._pid = None, None
        _forget_meshtron()
        os._exit(_run_as_main(path, argv))
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's ^C reaches the script itself
    stops = []

    def forward(sig, _):   # the agent's stop, and a stopped rank's end: SIGCONT lets it take the signal
        stops.append(sig)
        with contextlib.suppress(ProcessLookupError):   # the script ended as the signal came
            os.kill(pid, sig)
            os.kill(pid, signal.SIGCONT)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    if stops and code >= 0:
        # the agent stopped this rank (another failed) while its script was ending on its own, or
        # the script took the signal as a request: returning would leave this process waiting for
        # the agent's all-finished event, which never comes, until the agent kills it 30 s later
        code = -stops[0]
    if code < 0:                                   # ended by a signal: end by the same one
        with contextlib.suppress(OSError, ValueError):   # SIGKILL's action is the default already
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    if code:
        os._exit(code)


def _forget_meshtron() -> None:
    """This process's modules of meshtron (this one, unpickled as the rank's function, and what it imports)
    dropped, and the directory listings the server took when it started: the script's `import meshtron` then
    finds the package where a new interpreter would (a loaded package would resolve its submodules from the
    launcher's checkout), as its files are now."""
    for name in [n for n in sys.modules if n == "meshtron" or n.startswith("meshtron.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _run_as_main(path: str, argv: tuple[str, ...]) -> int:
    """`python -u path argv`'s run of the script, and its exit code."""
    for name, fd in (("stdout", 1), ("stderr", 2)):   # -u: each write reaches the pipe at once
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                            errors="backslashreplace" if fd == 2 else None))
    sys.argv = [path, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if e.code is None or isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 1)
    except BaseException as e:
        tb = e.__traceback__   # from the script's frame on, as python prints it
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        code = 1
    atexit._run_exitfuncs()   # what an interpreter's exit runs first (logging's flush among them)
    return code or 0


def forks_ranks(args) -> bool:
    """Whether the ranks are forked from a preloaded server (see the module's doc)."""
    script = not (args.module or args.no_python or args.run_path)
    return script and os.environ.get("OMP_NUM_THREADS") == "1" and sys.platform == "linux"


def forks_by_command_line(argv: list[str]) -> bool:
    """forks_ranks's answer read from the command line alone, before torch is imported:
    True only where it is sure (a `.py` script, no -m / --no-python / --run-path before it,
    and OMP_NUM_THREADS 1 or unset with a number of processes over 1)."""
    script = next((i for i, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")), None)
    if script is None or sys.platform != "linux":
        return False
    launcher = argv[:script]
    nproc = None
    for i, a in enumerate(launcher):
        name, eq, value = a.partition("=")
        if name in ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"):
            return False
        if name in ("--nproc-per-node", "--nproc_per_node"):
            nproc = value if eq else (launcher[i + 1] if i + 1 < len(launcher) else "")
    threads = os.environ.get("OMP_NUM_THREADS")
    return threads == "1" or (threads is None and nproc is not None and nproc.isdigit() and int(nproc) > 1)


def start_server() -> None:
    """The fork server, started now (again: a no-op): it imports torch (PRELOAD) while
    this process goes on, on another core; called before the agent imports
    torch where the command line says the ranks will be forked. Starting it does not wait for
    its imports; the first fork does."""
    import multiprocessing
    from multiprocessing import forkserver
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    os.environ[LAUNCHER_SAYS_ERRORS] = "1"   # the workers inherit it, a forked rank through the server
    if forks_by_command_line(argv):
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # as below, before the server inherits the environment
        start_server()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    args = torchrun.parse_args(argv)
    if torchrun.determine_local_world_size(args.nproc_per_node) > 1:   # where torchrun would, and no more
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the agent logs each failed worker with its pid and binary; the line below says it once
    for logger in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    if forks_ranks(args):
        start_server()   # running already where forks_by_command_line said so
        # torchrun's --run-path (runpy in a worker started by start_method), with this module's runner
        args.run_path, args.start_method = True, "forkserver"
        torchrun.run_script_path = run_script
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        print(failure_line(e, args.training_script), file=sys.stderr, flush=True)
        code = e.get_first_failure()[1].exitcode
        sys.exit(code if code > 0 else 1)


if __name__ == "__main__":
    main()
