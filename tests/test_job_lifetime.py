"""A job's lifetime (issue 25, points 2-4): workers die with their torchrun agent
and a resumed job loses nothing; a checkpoint directory is held by one live run
at a time, and a dead holder's lock is taken over; one-process runs need no port.
Liveness is polled with a deadline (the issue's 15 s); no timing is asserted."""
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from meshtron.train import checkpoint
from meshtron.train.lifetime import DirectoryLock, DirectoryLocked

from harness import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "train.py")
TINY = ["--model", "tiny", "--untie-embeddings", "--seq-len", "32", "--global-batch", "8", "--warmup", "2",
        "--log-interval", "1"]
DP2 = ["--dp", "2", "--micro-batch", "4"]
# two ranks of the recipe under torchrun (its agent is what the kill tests kill), and the same under
# meshtron-run, which takes torchrun's flags and forks its ranks (the resumes)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", RECIPE]
FORKED = [sys.executable, "-m", "meshtron.launch", "--standalone", "--nproc-per-node", "2", RECIPE]
DEADLINE_S = 15
# lifetime.py alone, without torch: `m` is the module
LIFETIME_PY = os.path.join(ROOT, "meshtron", "train", "lifetime.py")
LOAD_LIFETIME = ("import importlib.util; "
                 f"s = importlib.util.spec_from_file_location('lifetime', {LIFETIME_PY!r}); "
                 "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); ")


def _env() -> dict:
    """This environment without any rendezvous variables: a plain one-process launch."""
    drop = {"MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC_")}
    return env | {"OMP_NUM_THREADS": "1"}


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    s = _stat(pid)
    return s is not None and s[0] not in "ZX"     # a zombie has stopped, whoever reaps it


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(int(p)) or ("", 0))[1] == pid]


def _kill_agent(agent, workers: list[int]) -> None:
    """SIGKILL the torchrun agent alone (its workers are in sessions of their own) and
    require that its workers end with it; whatever is left is killed."""
    try:
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + DEADLINE_S
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), f"workers {[w for w in workers if _alive(w)]} outlived their agent"
    finally:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


def _wait_for(predicate, what: str, timeout: float = 120.0, proc=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc is None or proc.poll() is None, f"{what}: the process ended (exit {proc.returncode})"
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.02)


def _wait_for_line(path, text: str, proc) -> None:
    _wait_for(lambda: os.path.exists(path) and text in open(path).read(), f"{text!r} in {path}", proc=proc)


# ---- point 2: workers die with their agent --------------------------------------------

@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads worker pids from /proc")
@pytest.mark.slow
def test_workers_die_with_a_killed_agent_and_the_job_resumes_exactly(pools, tmp_path):
    # --steps far beyond what runs: workers that outlived the agent would still be training at the
    # deadline; the resumed job stops after a few steps (MESHTRON_EXIT_AFTER), the schedule unchanged
    ck, metrics, log = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "agent.log"
    args = TINY + DP2 + ["--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-interval", "3",
                         "--metrics-file", str(metrics), "--pg-timeout", "30"]
    with open(log, "w") as out:
        agent = subprocess.Popen(TORCHRUN + args, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: checkpoint.latest(str(ck)) is not None, "a first checkpoint", proc=agent)
        workers = _children(agent.pid)
        assert len(workers) == 2 and all(map(_alive, workers)), (workers, open(log).read()[-2000:])
        _kill_agent(agent, workers)
    finally:
        agent.kill()
    saved = checkpoint.list_checkpoints(str(ck))
    for path in saved:                         # whatever the kill interrupted, every step-N is whole
        checkpoint.validate(path)

    out = subprocess.run(FORKED + args + ["--resume", "auto"], env=_env() | {"MESHTRON_EXIT_AFTER": "6"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from {saved[-1]}" in out.stdout
    assert "took over" in out.stdout and "died holding it" in out.stdout, out.stdout[:2000]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = checkpoint.step_of(saved[-1]) + 6
    assert {r["step"] for r in rows} == set(range(1, last + 1))
    straight = pools.run(2, train, TINY + DP2 + ["--steps", "100000"], last, timeout=300)[0]
    # the killed job's rows past its last checkpoint and the resumed job's rows for those steps alike
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], straight[r["step"] - 1]) for r in rows]


def _orphan_script(use_prctl: bool) -> str:
    """A parent that starts a 'worker' tying its life to the parent's, then waits."""
    worker = (LOAD_LIFETIME + "import time; "
              f"how = m.die_with_agent(poll_s=0.1, use_prctl={use_prctl}); print(how, flush=True); time.sleep(600)")
    return (f"import os, subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True, "
            f"env=dict(os.environ, TORCHELASTIC_RESTART_COUNT='0')); time.sleep(600)")


@pytest.mark.parametrize("use_prctl", [True, False], ids=["prctl", "watchdog"])
def test_a_worker_dies_with_its_parent(use_prctl):
    parent = subprocess.Popen([sys.executable, "-c", _orphan_script(use_prctl)], stdout=subprocess.PIPE, text=True,
                              env=_env())
    try:
        how = parent.stdout.readline().strip()
        assert how == ("prctl" if use_prctl and sys.platform.startswith("linux") else "watchdog")
        worker, = _children(parent.pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + DEADLINE_S
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)
    finally:
        parent.kill()


# ---- point 3: one live run per checkpoint directory -----------------------------------

def test_lock_names_its_holder_is_released_and_a_dead_holders_is_taken_over(tmp_path):
    first = DirectoryLock(str(tmp_path))
    assert first.acquire() is None                       # a fresh directory
    host = socket.gethostname()
    with pytest.raises(DirectoryLocked, match=f"in use by another run: pid {os.getpid()} on host {host} "):
        DirectoryLock(str(tmp_path)).acquire()           # flock: a second open file conflicts in one process too
    first.release()
    assert (tmp_path / ".lock").read_text() == ""        # released cleanly: no holder recorded
    again = DirectoryLock(str(tmp_path))
    assert again.acquire() is None
    again.release()
    code = (LOAD_LIFETIME + "import os; "
            f"m.DirectoryLock({str(tmp_path)!r}).acquire(); os._exit(0)")   # dies holding it
    dead = subprocess.Popen([sys.executable, "-c", code], env=_env())
    assert dead.wait() == 0
    taken = DirectoryLock(str(tmp_path))
    previous = taken.acquire()                           # the kernel dropped the dead holder's flock
    assert previous == {"host": host, "pid": dead.pid, "started": previous["started"]}
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    taken.release()



def test_a_finished_recipe_exits_without_the_interpreters_teardown():
    # A gloo group still referenced (by a mesh, a pipeline stage) keeps its worker threads past
    # destroy_process_group; one that frees the last collective's tensors while the interpreter
    # finalizes aborts the finished job (SIGABRT, about 1 pp2 run in 7 on a loaded machine). So the
    # recipe's entry point skips the teardown: an exit handler must not run, output must be flushed.
    code = (LOAD_LIFETIME + "import atexit; "
            "m.one_line_errors(lambda: (print('trained'), atexit.register(print, 'teardown ran')))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "trained\n"), out.stderr

def _run_catching(rank, world, argv):
    """The run's losses and what rank 0 printed, or the error every rank stopped with."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            losses = train(rank, world, argv)
    except ValueError as e:
        return "error", str(e).splitlines()[0]
    return losses, printed.getvalue()


def test_a_held_directory_is_refused_and_taken_over_once_its_holder_died(pools, tmp_path):
    ck, metrics, log = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "holder.log"
    with open(log, "w") as out:
        holder = subprocess.Popen([sys.executable, RECIPE] + TINY + [
            "--micro-batch", "8", "--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-interval", "100000"],
            env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_line(log, "step      1/", holder)     # set up, lock held, training
        argv = TINY + DP2 + ["--steps", "3", "--checkpoint-dir", str(ck), "--metrics-file", str(metrics)]
        refused = pools.run(2, _run_catching, argv, timeout=120)
        message = (f"checkpoint directory {ck} is in use by another run: pid {holder.pid} on host "
                   f"{socket.gethostname()} (since ")
        assert all(r[0] == "error" and r[1].startswith(message) for r in refused), refused   # every rank, no hang
        assert not metrics.exists()                      # nothing trained
        assert holder.poll() is None                     # and the holder was never disturbed
    finally:
        holder.kill()
        holder.wait()
    losses, printed = pools.run(2, _run_catching, argv, timeout=120)[0]
    assert len(losses) == 3 and len(metrics.read_text().splitlines()) == 3
    assert f"took over {ck}: its lock was left by a run that died holding it, pid {holder.pid} on host" in printed
    assert (ck / ".lock").read_text() == ""              # released at the end of the run
    # a set-up that fails after taking the lock (a fresh run into a used directory) releases it
    fresh = pools.run(2, _run_catching, [a for a in argv if a != str(metrics) and a != "--metrics-file"])
    assert fresh == [("error", f"--checkpoint-dir {ck} already holds checkpoints (newest step-00000003): pass "
                               "--resume auto to continue from them, or another directory")] * 2
    free = DirectoryLock(str(ck))
    assert free.acquire() is None
    free.release()


# ---- point 4: a one-process run needs no port -----------------------------------------

@pytest.mark.slow
def test_two_one_process_runs_at_once_both_train(tmp_path):
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen([sys.executable, RECIPE] + TINY + ["--micro-batch", "8", "--steps", "100000"],
                                 env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_line(log, "step      1/", first)      # the first run is up, with its process group
        second = subprocess.run([sys.executable, RECIPE] + TINY + ["--micro-batch", "8", "--steps", "3"],
                                env=_env(), capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "step      3/3" in second.stdout
        assert first.poll() is None, open(log).read()[-3000:]   # they overlapped: the first still runs
    finally:
        first.kill()
        first.wait()
