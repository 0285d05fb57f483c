"""What a hang or a lost peer leaves (watchdog.py decides when): each rank's evidence (its
stacks and flight recorders' dumps), the verdict of which ranks the job waits for, from every
rank's report and heartbeats, and the job's one line, with what the restart will cost."""
from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch

from meshtron.train.lifetime import under_torchrun
from meshtron.train.progress import PHASES, Progress


def ranks_text(ranks) -> str:
    """'rank 3', 'ranks 0, 2-5'."""
    ranks = sorted(ranks)
    runs, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(runs)}"


def _position(step: int, phase: str) -> tuple[int, int]:
    return step, PHASES.index(phase) if phase in PHASES else -1


def flight_recorder_dumps() -> dict[str, bytes]:
    """The flight recorders' pickled dumps, by backend: NCCL's on a GPU, gloo's where this torch
    records gloo's collectives too. A dump that fails is left out: this is evidence, never the error."""
    c10d = torch._C._distributed_c10d
    found = {}
    wanted = [("gloo", "_dump_fr_trace")]
    if torch.cuda.is_available():
        wanted.insert(0, ("nccl", "_dump_nccl_trace"))
    for name, fn in ((n, getattr(c10d, f, None)) for n, f in wanted):
        if fn is None:
            continue
        try:
            try:
                found[name] = fn(includeCollectives=True, includeStackTraces=True, onlyActive=False)
            except TypeError:   # a torch whose binding takes no arguments
                found[name] = fn()
        except Exception:  # noqa: BLE001, S112 - no recorder on this backend, or a dump that failed
            continue
    return found


def last_collectives(dumps: dict[str, bytes]) -> dict[str, dict]:
    """Each process group's last recorded collective (and last point-to-point, as GROUP:p2p):
    {"op", "seq", "done"}; what a rank waits in is its last one not done."""
    last = {}
    for blob in dumps.values():
        try:
            entries = pickle.loads(blob).get("entries", [])   # noqa: S301 - this process's own recorder's bytes
        except Exception:  # noqa: BLE001, S112
            continue
        for e in entries:
            group = e.get("process_group") or ("?", "")
            p2p = bool(e.get("is_p2p"))
            name = f"{group[1] or group[0]}" + (":p2p" if p2p else "")
            done = bool(e.get("retired")) or e.get("state") == "completed"
            last[name] = {"op": e.get("profiling_name"), "seq": e.get("p2p_seq_id" if p2p else "collective_seq_id"),
                          "done": done}
    return last


def waiting_in(collectives: dict[str, dict]) -> str | None:
    """'gloo:all_reduce (group default_pg, #41)' for the collective a rank waits in, if its recorder has one."""
    for group, c in collectives.items():
        if not c["done"]:
            return f"{c['op']} (group {group.removesuffix(':p2p')}, #{c['seq']})"
    return None


def verdict(kind: str, reports: dict[int, dict], first: dict[int, dict], last: dict[int, dict], world: int) -> dict:
    """Who the job waits for. `reports`: the ranks that reported (position, collectives), `first`
    and `last`: every rank's heartbeat at the start and the end of the wait. Ranks gone quiet
    (no report, a heartbeat that did not move) are `gone`; among the others, on a hang, those
    whose position is behind are `behind`, and where all are at one position, those that a
    group's collective waits for (its sequence number lower than the others' on that group)."""
    gone = sorted(r for r in range(world) if r not in reports and (first.get(r) or {}).get("n") ==
                  (last.get(r) or {}).get("n"))
    behind = []
    if kind == "hang" and reports:
        positions = {r: _position(rep["step"], rep["phase"]) for r, rep in reports.items()}
        lowest = min(positions.values())
        if lowest != max(positions.values()):
            behind = sorted(r for r, p in positions.items() if p == lowest)
        else:
            seqs: dict[str, dict[int, int]] = {}
            for r, rep in reports.items():
                for group, c in rep.get("collectives", {}).items():
                    if not group.endswith(":p2p") and isinstance(c.get("seq"), int):
                        seqs.setdefault(group, {})[r] = c["seq"]
            behind = sorted({r for by_rank in seqs.values() for r, s in by_rank.items()
                             if s < max(by_rank.values())})
    seen = sorted({(b["step"], PHASES.index(b["phase"]) if b["phase"] in PHASES else -1, b["phase"], b["host"],
                    b["pid"]) for r, b in last.items() if r in gone})
    why = "stopped or gone" + ("; last heard of at " + "; ".join(
        f"{_where(step, phase)}" + (f", pid {pid}" if len(gone) == 1 else "") + f" on {host}"
        for step, _, phase, host, pid in seen) if seen else "")
    return {"kind": kind, "gone": gone, "behind": behind, "why": why,
            "reports": {str(r): rep for r, rep in reports.items()}}


def _where(step, phase) -> str:
    return f"step {step}, {phase}"


def hang_line(v: dict, waited: float, evidence: str, next_attempt: str, explicit: bool = True) -> str:
    """The job's one line for a hang verdict."""
    reports = {int(r): rep for r, rep in v["reports"].items()}
    step = max((rep["step"] for rep in reports.values()), default=0)
    parts = [f"{ranks_text(v['gone'])} did not arrive ({v['why']})"] if v["gone"] else []
    for r in v["behind"]:
        rep = reports[r]
        inside = waiting_in(rep.get("collectives", {}))
        parts.append(f"rank {r} did not arrive (in {_where(rep['step'], rep['phase'])} for {rep['still_s']:.0f} s"
                     + (f", inside {inside}" if inside else "") + ")")
    others = sorted(set(reports) - set(v["behind"]))
    if others:
        rep = reports[others[0]]
        inside = waiting_in(rep.get("collectives", {}))
        who = ranks_text(others) if parts else f"every rank ({ranks_text(others)})"
        parts.append(f"{who} waited in {_where(rep['step'], rep['phase'])}" + (f", inside {inside}" if inside else ""))
    if not (v["gone"] or v["behind"]):
        parts.append("no rank is behind the others (a collective that no rank finishes: see the flight recorders)")
    setting = "--hang-timeout" if explicit else "--hang-timeout's default, from the slowest step"
    return (f"meshtron: hang: no progress for {waited:.0f} s ({setting}) at step {step}: " + "; ".join(parts)
            + f"; stacks and flight-recorder dumps in {evidence}; {next_attempt}")


def lost_line(rank: int, v: dict, progress: Progress, next_attempt: str) -> str:
    """A rank's one line for a lost peer."""
    return (f"meshtron: rank {rank} lost {ranks_text(v['gone'])} at {_where(progress.step, progress.phase)} "
            f"({v['why']}); {next_attempt}")


def next_attempt(progress: Progress, resume_auto: bool) -> str:
    """What follows the end of this attempt (torchrun --max-restarts), and the steps it loses."""
    step, saved = progress.step, progress.saved
    if saved is None:
        lost = f"{step} step{'s' if step != 1 else ''} lost (no checkpoint yet)"
    elif step > saved:
        lost = f"{'steps' if step - saved > 1 else 'step'} {saved + 1}" + (f"-{step}" if step - saved > 1 else "") + \
            f" lost since the checkpoint of step {saved}"
    else:
        lost = f"no step lost since the checkpoint of step {saved}"
    if not under_torchrun():
        return f"the job ends; {lost}"
    count, most = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if count >= most:
        return f"the job ends{f' (its --max-restarts {most} used)' if most else ''}; {lost}"
    start = "from step 0" if saved is None or not resume_auto else f"from step {saved}"
    return (f"the job restarts ({count + 1} of --max-restarts {most}) on the nodes left, {start}"
            + ("" if resume_auto or saved is None else " (no --resume auto)") + f"; {lost}")


def evidence_root(checkpoint_dir: str | None, metrics_file: str | None) -> str:
    if checkpoint_dir:
        return checkpoint_dir
    if metrics_file:
        return os.path.dirname(os.path.abspath(metrics_file))
    return tempfile.gettempdir()


def write_evidence(directory: str, rank: int, progress: Progress, dumps: dict[str, bytes]) -> None:
    """This rank's stacks (every thread's, named) and its flight recorders' dumps, as torch's
    analyser reads them (`python -m torch.distributed.flight_recorder.fr_trace DIR -p
    flight-recorder-nccl-rank-`)."""
    os.makedirs(directory, exist_ok=True)
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(os.path.join(directory, f"rank-{rank}.stacks.txt"), "w") as f:
        f.write(f"rank {rank}, pid {os.getpid()} on {socket.gethostname()}: {_where(progress.step, progress.phase)} "
                f"for {time.monotonic() - progress.since:.1f} s\n")
        for ident, frame in sys._current_frames().items():
            f.write(f"\nthread {names.get(ident, '?')} ({ident}), most recent call last:\n")
            f.writelines(traceback.format_stack(frame))
    for name, blob in dumps.items():
        with open(os.path.join(directory, f"flight-recorder-{name}-rank-{rank}"), "wb") as f:
            f.write(blob)
