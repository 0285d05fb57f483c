"""meshtron-run (meshtron/launch.py): torchrun's agent and flags; ranks forked from a
server that imported torch and the trainer once, each running its script as
`python -u SCRIPT ARGS` does; a failed job's end in one line."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_job_lifetime import _alive
from test_job_lifetime import _env as lifetime_env

# A rank's report: whether torch was imported before the script ran (a forked rank),
# and what python gives a script. One write(2) per line: ranks share the pipe.
SCRIPT = """import multiprocessing, os, sys, time
preloaded = "torch" in sys.modules
import sibling
rank = int(os.environ["RANK"])
os.write(1, f"rank {rank} {__name__} {sys.argv[1:]} {sibling.VALUE} {preloaded} {os.path.basename(__file__)} "
         f"{os.environ.get('OMP_NUM_THREADS', 'unset')} {multiprocessing.get_start_method()}\\n".encode())
mode = sys.argv[1]
if mode == "ok":
    lock = multiprocessing.Lock()   # left to the process's end, as a library's lock is
    import atexit
    atexit.register(lambda: open(os.path.join(os.path.dirname(__file__), f"atexit{rank}"), "w").close())
    if rank == 0:          # printed unbuffered, then the recipe's own ending: no teardown, no atexit
        print("before os._exit", rank)
        os._exit(0)
elif mode == "raise" and rank == 1:
    raise RuntimeError("rank 1 failed")
elif mode in ("raise", "sleep"):
    open(os.path.join(os.path.dirname(__file__), f"pid{rank}"), "w").write(str(os.getpid()))
    time.sleep(600)
"""


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Appended to a copy's meshtron/cli/train.py: the recipe's entry point says whose code a rank runs. With
# --edit, rank 0 of the first attempt edits it (into a longer file: a .pyc of the same size and second would
# pass for current) and the attempt fails, so the next attempt's ranks say whether they run the edit.
COPY_RUN = """

EDIT = "as copied"


def run(argv=None, description=None):
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    os.write(1, f"the copy's cli, {EDIT}, attempt {attempt}, rank {rank}\\n".encode())
    if argv == ["--edit"] and attempt == "0":
        if rank == "0":
            with open(__file__) as f:
                text = f.read().replace('EDIT = "as copied"', 'EDIT = "edited between attempts"')
            with open(__file__ + ".new", "w") as f:
                f.write(text)
            os.replace(__file__ + ".new", __file__)
        sys.exit(1)
"""


def _copy_of_the_project(tmp_path) -> str:
    """Another checkout of meshtron, whose recipe (a copy of recipes/train.py) puts it first on sys.path."""
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(ROOT, "meshtron"), copy / "meshtron", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "recipes").mkdir()
    shutil.copy(os.path.join(ROOT, "recipes", "train.py"), copy / "recipes")
    with open(copy / "meshtron" / "cli" / "train.py", "a") as f:
        f.write(COPY_RUN)
    return str(copy / "recipes" / "train.py")


def _env(**extra) -> dict:
    """A plain launch's environment (test_job_lifetime's), OMP_NUM_THREADS left to the launcher or `extra`."""
    env = {k: v for k, v in lifetime_env().items() if k != "OMP_NUM_THREADS"}
    return env | extra


def _script(tmp_path) -> str:
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    (tmp_path / "job.py").write_text(SCRIPT)
    return str(tmp_path / "job.py")


def _start_method() -> str:
    """multiprocessing's default start method in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _launch(script, mode, nproc="2"):
    return [sys.executable, "-m", "meshtron.launch", "--nproc-per-node", nproc, script, mode]


def test_forked_ranks_run_their_script_as_python_does(tmp_path):
    # two ranks, OMP_NUM_THREADS unset: the launcher sets it to 1 (as torchrun does) and forks
    # them; one rank ends in os._exit(0), the other returns and runs its atexit hooks
    script = _script(tmp_path)
    out = subprocess.run(_launch(script, "ok"), env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert reports == [f"rank {r} __main__ ['ok'] 7 True job.py 1 {_start_method()}" for r in (0, 1)], out.stdout
    assert "before os._exit 0" in out.stdout
    assert "leaked" not in out.stderr, out.stderr   # no resource tracker of the agent's warns of rank 0's lock
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("atexit")) == ["atexit1"]


@pytest.mark.slow
def test_one_process_and_more_omp_threads_start_a_fresh_interpreter(tmp_path):
    # as torchrun starts every rank, and OMP_NUM_THREADS as torchrun leaves it: one process
    # (unset), or threads of the user's (where a forked OpenMP pool could deadlock)
    script = _script(tmp_path)
    for nproc, env, threads in (("1", _env(), "unset"), ("2", _env(OMP_NUM_THREADS="2"), "2")):
        out = subprocess.run(_launch(script, "ok", nproc), env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        reports = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
        want = [f"rank {r} __main__ ['ok'] 7 False job.py {threads} {_start_method()}" for r in range(int(nproc))]
        assert reports == want, out


def test_a_forked_rank_that_raises_fails_the_job_in_one_line(tmp_path):
    script = _script(tmp_path)
    out = subprocess.run(_launch(script, "raise"), env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    err = out.stderr.splitlines()
    # python's traceback, from the script's own frame: nothing of the launcher's
    start = err.index("Traceback (most recent call last):")
    assert err[start + 1].startswith(f'  File "{script}", line ') and "RuntimeError: rank 1 failed" in err
    assert err[-1] == f"meshtron-run: {script} failed on rank 1 (exit code 1): see its output above", err
    assert not [line for line in err if "launch.py" in line or "Terminating process" in line], err


@pytest.mark.slow
def test_forked_ranks_run_the_meshtron_their_script_imports(tmp_path):
    # issue 57, point 1: torchrun's ranks, new interpreters, import the recipe's own checkout (first on its
    # sys.path); ranks forked from a server that had imported the launcher's meshtron ran that one instead
    recipe = _copy_of_the_project(tmp_path)
    cmd = [sys.executable, "-m", "meshtron.launch", "--nproc-per-node", "2", "--standalone", recipe]
    out = subprocess.run(cmd, env=_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = sorted(line for line in out.stdout.splitlines() if line.startswith("the copy's cli"))
    assert runs == [f"the copy's cli, as copied, attempt 0, rank {r}" for r in (0, 1)], out.stdout + out.stderr


@pytest.mark.slow
def test_a_restarted_attempt_runs_the_code_as_edited(tmp_path):
    # the fork server outlives an attempt: the next one's ranks, forked from it, must read meshtron's files
    # as they are now, as torchrun's new interpreters do
    recipe = _copy_of_the_project(tmp_path)
    cmd = [sys.executable, "-m", "meshtron.launch", "--nproc-per-node", "2", "--standalone", "--max-restarts", "1",
           recipe, "--edit"]
    out = subprocess.run(cmd, env=_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = sorted(line for line in out.stdout.splitlines() if "attempt 1" in line)
    assert runs == [f"the copy's cli, edited between attempts, attempt 1, rank {r}" for r in (0, 1)], out.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="ranks are forked on Linux only")
@pytest.mark.slow
def test_forked_ranks_end_with_a_killed_agent(tmp_path):
    # SIGKILL the agent alone: its server sees the agent gone and ends, and each rank
    # follows its parent (prctl): nothing is left training
    script = _script(tmp_path)
    agent = subprocess.Popen(_launch(script, "sleep"), env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2:
            assert agent.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
            pids = [int(p.read_text()) for p in tmp_path.glob("pid*") if p.read_text()]
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 30
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, pids)), "ranks outlived their agent"
    finally:
        agent.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("argv,threads,early", [
    (["--nproc-per-node", "2", "job.py", "ok"], None, True),
    (["--nproc_per_node=4", "--standalone", "job.py", "--nproc-per-node", "1"], None, True),
    (["--nnodes", "1", "--nproc-per-node", "1", "job.py"], "1", True),
    (["--nproc-per-node", "1", "job.py"], None, False),           # one process: a fresh interpreter
    (["--nproc-per-node", "2", "job.py"], "2", False),            # the user's OpenMP threads
    (["--nproc-per-node", "2", "-m", "pkg.train"], None, False),  # a module
    (["--nproc-per-node", "2", "--no-python", "echo.py"], None, False),
    (["--nproc-per-node", "2", "--run-path", "job.py"], None, False),
    (["--nproc-per-node", "auto", "job.py"], None, False),        # a count torch works out: not guessed
])
def test_the_server_starts_early_only_where_the_ranks_are_forked(monkeypatch, argv, threads, early):
    # meshtron-run starts its fork server before it imports torch where the command line alone
    # says the ranks will be forked from it, and only there (a server of no use costs a core's
    # seconds): wherever it guesses yes, torchrun's own parse forks them too
    from torch.distributed import run as torchrun

    from meshtron import launch
    if threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
    assert launch.forks_by_command_line(argv) == early
    args = torchrun.parse_args(argv)
    if torchrun.determine_local_world_size(args.nproc_per_node) > 1:   # what main sets, where torchrun would
        monkeypatch.setenv("OMP_NUM_THREADS", threads or "1")
    assert launch.forks_ranks(args) or not early


_TAKES_SIGTERM_AS_A_REQUEST = """import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: None)   # a script that finishes its step on SIGTERM, then exits 0
open(sys.argv[1], "w").close()
time.sleep(1.0)
os._exit(0)
"""


def test_a_rank_the_agent_stopped_ends_by_the_signal_even_where_its_script_exits_0(tmp_path):
    # the agent stops the other ranks when one fails; a rank whose script then ends with 0 (it took
    # SIGTERM as a request, or was ending anyway: the recipe's other ranks exit 0 on an error rank 0
    # reports) returned into torch's worker wrapper, which waits for the agent's all-finished event:
    # the job's one line came after the agent's 30 s grace
    from meshtron.launch import run_script
    script, started = tmp_path / "script.py", tmp_path / "started"
    script.write_text(_TAKES_SIGTERM_AS_A_REQUEST)
    pid = os.fork()
    if pid == 0:   # the rank's process, as the agent's worker wrapper runs it: returning is exit 0
        try:
            run_script(str(script), str(started))
        finally:
            os._exit(0)
    while not started.exists():
        time.sleep(0.02)
    os.kill(pid, signal.SIGTERM)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signal.SIGTERM
