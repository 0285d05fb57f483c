"""Faults at scale (issue 61): a slow rank named at the log line; a hung job ended within
--hang-timeout, the ranks that did not arrive named, each rank's stacks and flight recorder
written; a job of two "nodes" that loses one goes on with the other, on a layout planned
for what is left, and its losses from the checkpoint on equal an uninterrupted run's.
Hangs and slowdowns are planted (meshtron/cli/faults.py); the timing asserted is only
that the job ends well before --pg-timeout, which it would wait for otherwise."""
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from test_job_lifetime import DP2, FORKED, ROOT, TINY, _alive, _env

from meshtron.config import ConfigError
from meshtron.train import checkpoint
from meshtron.train.hang_report import ranks_text, verdict
from meshtron.train.progress import Progress
from meshtron.train.watchdog import FLOOR_S, deadline

from harness import RankError, train

RECIPE = os.path.join(ROOT, "recipes", "train.py")


# ---- point 1: stragglers -----------------------------------------------------------------

def _printed_with(rank, world, argv, env):
    os.environ.update(env)
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train(rank, world, argv)
        return out.getvalue()
    finally:
        for k in env:
            del os.environ[k]


def test_a_rank_slowed_3x_is_named_at_each_log_line(pools):
    # four ranks: the median is a rank of the others', so rank 1's ratio is about 3, the threshold 1.2
    argv = TINY + ["--dp", "4", "--micro-batch", "2", "--steps", "12", "--log-interval", "4"]
    printed = pools.run(4, _printed_with, argv, {"MESHTRON_SLOW_RANK": "1:3"}, timeout=300)[0].splitlines()
    named = [line for line in printed if line.startswith("stragglers at step")]
    assert [line.split()[3] for line in named] == ["4", "8", "12"], printed   # step 1's line starts the clock
    for line in named:   # the slowest first, with its time split
        assert re.search(r"\): rank 1 busy [\d.]+ s a step \([\d.]+ s computing, [\d.]+ s loading data; [\d.]+ s "
                         r"waiting in collectives or for a core\), [\d.]+x the median", line), line
    assert "; stragglers seen: rank 1 at 3 of 3 (up to " in printed[-1], printed[-1]


def test_no_straggler_is_said_where_none_was_seen(pools):
    argv = TINY + DP2 + ["--steps", "6", "--log-interval", "2"]
    closing = pools.run(2, _printed_with, argv, {}, timeout=300)[0].splitlines()[-1]
    assert closing.startswith("done: 6 steps") and "; no straggler seen at 3 log lines" in closing, closing


# ---- point 2: hangs ----------------------------------------------------------------------

def test_the_default_deadline_follows_the_slowest_step_within_its_bounds():
    p = Progress()
    assert deadline(p, None, 600) is None                  # set-up: not watched
    p.at("data loading", 1)
    p.at("forward/backward")
    assert deadline(p, None, 600) is None                  # the first step compiles: not watched
    p.since -= 50                                          # a first step of 50 s
    p.at("data loading", 2)
    assert deadline(p, None, 600) == pytest.approx(250, abs=1)                  # 5 x it, until a second step is seen
    p.at("data loading", 3)                                # a second step of ~0 s
    assert deadline(p, None, 600) == FLOOR_S
    assert deadline(p, None, 40) == 20                     # never past half of --pg-timeout
    assert deadline(p, 7, 600) == 7                        # --hang-timeout
    p.at("checkpoint")
    assert deadline(p, 7, 600) is None                     # no save seen yet
    p.since -= 10
    p.at("data loading", 4)
    p.at("checkpoint")
    assert deadline(p, 7, 600) == pytest.approx(50, abs=1)                      # never less than 5 x the longest save
    assert deadline(p, 7, 600, unarmed=("checkpoint",)) is None
    assert deadline(p, 0, 600) is None                     # 0: off


def test_the_verdict_names_the_quiet_the_behind_and_those_a_collective_waits_for():
    beats = {r: {"n": 5, "step": 7, "phase": "forward/backward", "pid": 10 + r, "host": "h"} for r in range(4)}
    moved = {r: dict(b, n=8) for r, b in beats.items()}

    def report(r, phase="forward/backward", seq=41):
        return {"rank": r, "step": 7, "phase": phase, "still_s": 5.0,
                "collectives": {"default_pg": {"op": "gloo:all_reduce", "seq": seq, "done": False}}}
    # rank 3 stopped: no report, its heartbeat still; rank 2 alive but not reporting yet is not named
    v = verdict("hang", {0: report(0), 1: report(1)}, beats, moved | {3: beats[3]}, 4)
    assert (v["gone"], v["behind"]) == ([3], [])
    v = verdict("hang", {r: report(r, "data loading" if r == 2 else "forward/backward") for r in range(4)},
                beats, moved, 4)
    assert (v["gone"], v["behind"]) == ([], [2])
    v = verdict("hang", {r: report(r, seq=40 if r in (1, 3) else 41) for r in range(4)}, beats, moved, 4)
    assert (v["gone"], v["behind"]) == ([], [1, 3])
    assert ranks_text([0, 2, 3, 4, 7]) == "ranks 0, 2-4, 7" and ranks_text([5]) == "rank 5"


def _line_of(proc, lines: list, seen: dict, text: str) -> None:
    """Read the job's output into `lines`, noting in `seen` when a line starting with `text` came."""
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(text) and text not in seen:
            seen[text] = time.monotonic()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's state from /proc")
@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_hang_timeout_naming_it(tmp_path):
    # rank 1 sends itself SIGSTOP before step 5; without the watchdog, rank 0 would wait out --pg-timeout
    ck = tmp_path / "ck"
    args = TINY + DP2 + ["--steps", "100000", "--hang-timeout", "5", "--pg-timeout", "300", "--checkpoint-dir",
                         str(ck), "--checkpoint-interval", "3"]
    proc = subprocess.Popen(FORKED + args, env=_env() | {"MESHTRON_HANG": "1:5:stop"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, seen = [], {}
    reader = threading.Thread(target=_line_of, args=(proc, lines, seen, "step      4/"), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=200)
    finally:
        proc.kill()
    reader.join(timeout=10)
    ended = time.monotonic()
    assert code == 124, "\n".join(lines[-30:])
    assert ended - seen["step      4/"] < 60, ended - seen["step      4/"]   # 5 s, and the end; not 300
    last = lines[-1]
    where = f"{ck}/hang-step-00000005"
    assert re.fullmatch(
        r"meshtron-run: .*train\.py failed on rank 0 \(exit code 124\): meshtron: hang: no progress for 5 s "
        r"\(--hang-timeout\) at step 5: rank 1 did not arrive \(stopped or gone; last heard of at step \d, "
        r"[a-z/ -]+, pid (\d+) on \S+\); rank 0 waited in step 5, forward/backward, inside gloo:all_reduce "
        rf"\(group default_pg, #\d+\); stacks and flight-recorder dumps in {where}; the job ends; steps 4-5 lost "
        r"since the checkpoint of step 3", last), last
    assert not any("Traceback" in line or line.startswith("frame #") for line in lines), "\n".join(lines)
    assert not _alive(int(re.search(r"pid (\d+)", last).group(1)))   # the stopped rank ended with its job
    assert sorted(os.listdir(where)) == ["flight-recorder-gloo-rank-0", "rank-0.stacks.txt"]
    stacks = open(os.path.join(where, "rank-0.stacks.txt")).read()
    assert stacks.startswith("rank 0, pid ") and "thread MainThread" in stacks and "in all_reduce" in stacks
    import pickle
    entries = pickle.load(open(os.path.join(where, "flight-recorder-gloo-rank-0"), "rb"))["entries"]
    assert entries[-1]["profiling_name"] == "gloo:all_reduce" and not entries[-1]["retired"]
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(ck))] == ["step-00000003"]


def _stuck(rank, world, argv, how, error_file):
    os.environ["MESHTRON_HANG"] = f"1:4:{how}"
    os.environ["TORCHELASTIC_ERROR_FILE"] = f"{error_file}.{rank}"   # where the line is written
    train(rank, world, argv)


@pytest.mark.parametrize("how", ["data", "collective"])
@pytest.mark.fast_cases("collective")
def test_a_rank_stuck_in_data_loading_or_in_a_collective_is_named(pools, tmp_path, how):
    argv = TINY + DP2 + ["--steps", "100000", "--hang-timeout", "3", "--checkpoint-dir", str(tmp_path / "ck")]
    with pytest.raises(RankError, match=r"died \(exit code 124\)"):   # the pool's group would wait 60 s
        pools.run(2, _stuck, argv, how, str(tmp_path / "error"), timeout=120)
    lines = set()
    for r in (0, 1):
        path = tmp_path / f"error.{r}"
        if path.exists():   # each rank writes its line before it exits, unless the other's exit ended it first
            lines.add(json.loads(path.read_text())["message"]["message"])
    assert len(lines) == 1, lines
    inside = ", inside gloo:all_reduce (group planted_hang, #1)" if how == "collective" else ""
    assert re.fullmatch(
        r"meshtron: hang: no progress for 3 s \(--hang-timeout\) at step 4: rank 1 did not arrive \(in step 4, "
        rf"data loading for \d+ s{re.escape(inside)}\); rank 0 waited in step 4, forward/backward, inside "
        rf"gloo:all_reduce \(group default_pg, #\d+\); stacks and flight-recorder dumps in "
        rf"{tmp_path}/ck/hang-step-00000004; the job ends; 4 steps lost \(no checkpoint yet\)", lines.pop())
    assert {"rank-0.stacks.txt", "rank-1.stacks.txt"} <= set(os.listdir(tmp_path / "ck" / "hang-step-00000004"))


# ---- point 3: a job that loses a node goes on ---------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            if parent == pid:
                found += [int(p)] + _descendants(int(p))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the lost node's processes from /proc")
@pytest.mark.slow
def test_a_job_that_loses_a_node_goes_on_with_half_the_world(pools, tmp_path):
    # Two agents ("nodes") of two ranks, an elastic rendezvous of 1 to 2 nodes. The survivor hosts it
    # (is_host=1): a cluster keeps its rendezvous endpoint on a node that stays. The other starts
    # first and waits for it, so both are in the first round; it is lost, agent and workers at once,
    # after the checkpoint of step 4.
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = TINY + ["--steps", "10", "--layout", "auto", "--layout-trials", "0", "--resume", "auto",
                   "--checkpoint-dir", str(ck), "--checkpoint-interval", "4", "--metrics-file", str(metrics)]
    port, logs = _free_port(), [tmp_path / "survivor.log", tmp_path / "lost.log"]

    def agent(host: int, log):
        rdzv = f"is_host={host},last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
        launcher = [sys.executable, "-m", "meshtron.launch", "--nnodes", "1:2", "--nproc-per-node", "2",
                    "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", "faults", "--rdzv-conf", rdzv]
        with open(log, "w") as out:
            return subprocess.Popen(launcher + [RECIPE] + args, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    lost = agent(0, logs[1])
    survivor = agent(1, logs[0])
    try:
        deadline = time.monotonic() + 200
        while not (ck / "step-00000004").exists():
            assert survivor.poll() is None and lost.poll() is None, [p.read_text()[-2000:] for p in logs]
            assert time.monotonic() < deadline, [p.read_text()[-2000:] for p in logs]
            time.sleep(0.05)
        for pid in [lost.pid] + _descendants(lost.pid):   # the node: its agent and its workers, in their sessions
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        lost.wait()
        assert survivor.wait(timeout=200) == 0, logs[0].read_text()[-3000:]
    finally:
        for p in (survivor, lost):
            p.kill()
    out = logs[0].read_text().splitlines()
    said = [line for line in out if line.startswith("meshtron: rank")]
    noise = [line for line in out if "Traceback" in line or line.startswith(("frame #", "Exception raised"))]
    assert len(said) == 2 and not noise, "\n".join(out)
    gone = re.search(r"lost (ranks \d-\d) at step", said[0]).group(1)
    left = {int(re.match(r"meshtron: rank (\d)", line).group(1)) for line in said}
    assert {gone} == {ranks_text(sorted(set(range(4)) - left))}
    for line in said:   # one line each: which peers, which step, that the job restarts, what it lost
        assert re.fullmatch(rf"meshtron: rank \d lost {gone} at step (\d+), [a-z/ ]+ \((stopped or gone; last heard "
                            r"of at .*|node 0 on \S+, gone with its agent, which held the job's store)\); the job "
                            r"restarts \(1 of --max-restarts 1\) on the nodes left, from step 4; steps? 5(-\d+)? lost "
                            r"since the checkpoint of step 4", line), line
    assert f"resumed from {ck}/step-00000004 at step 4" in out
    assert any(line.startswith("layout auto: ") and " on 2 ranks: " in line for line in out), "\n".join(out)
    rows = {}
    for row in map(json.loads, metrics.read_text().splitlines()):
        rows[row["step"]] = row["loss"]   # the resumed run's rows come last
    one = pools.run(1, train, TINY + ["--steps", "10", "--micro-batch", "8"], timeout=300)[0]
    assert [rows[s] for s in range(5, 11)] == pytest.approx(one[4:], rel=1e-6, abs=0)


# ---- the layout of a smaller world -------------------------------------------------------

def test_a_layout_that_no_longer_fits_names_layout_auto(monkeypatch):
    from meshtron.cli.train import main
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(ConfigError) as e:
        main(TINY + ["--dp", "4", "--steps", "2"])
    assert str(e.value) == (
        "mesh dp*pp*cp*tp*ep = 4*1*1*1*1 = 4 does not equal the world size 2: with the other degrees as given, "
        "--dp 2 fits; this is attempt 2 of a job torchrun restarts (--max-restarts), whose world can change "
        "between attempts (--nnodes MIN:MAX, a node lost): --layout auto plans the layout for the world each "
        "attempt gets, and resumes the checkpoint resharded into it")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match=r"--dp 2 fits$"):   # not elastic: the plain message
        main(TINY + ["--dp", "4", "--steps", "2"])


def test_hang_timeout_and_straggler_threshold_are_checked(monkeypatch):
    from meshtron.cli.train import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"^--hang-timeout 600 must be at least 0 \(0: off\) and below "
                                          r"--pg-timeout 600"):
        main(TINY + ["--hang-timeout", "600"])
    with pytest.raises(ConfigError, match=r"^--straggler-threshold 0.9 must be above 1"):
        main(TINY + ["--straggler-threshold", "0.9"])
