"""Runs suites' jobs on this machine's GPUs and appends their rows to the suites' data files.

Each job runs in a process of its own (bench_train.py under torchrun, the peer kit's run.sh, or
a tool), its log and output in OUT/<job>/; a job that fails or runs past --timeout records no row.
A row's record: suite, row, commit, date, machine (GPU name and count), versions, figures, peer,
ratio (the row's tokens/s over its peer's from the same run, or what the tool's reader gives) and
the command, one JSON line appended to DATA/<suite>.jsonl.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time

from benchmarks.suites import PY, SUITES, Job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "benchmarks", "peers", "torchtitan")
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "PYTHONUNBUFFERED": "1", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}


def assets() -> str:
    """Where the peer kit's built wheels, tokenizer and data are: the checkout's .peer/ where it has them."""
    peer = os.path.join(ROOT, ".peer")
    return peer if os.path.isdir(os.path.join(peer, "whl")) else KIT


def fill(text: str, out: str) -> str:
    """An argument or environment value with its placeholders: the job's folder, the kit's assets, Python."""
    return sys.executable if text == PY else text.replace("{out}", out).replace("{assets}", assets())


def command(job: Job, out: str, args) -> list[str]:
    if job.kind == "peer":
        return ["bash", os.path.join(KIT, "run.sh"), job.layout]
    if job.kind == "tool":
        return [fill(a, out) for a in job.flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.gpus),
            os.path.join(ROOT, "benchmarks", "bench_train.py"), "--layouts", job.layout, "--out", out,
            "--rounds", str(args.rounds), "--steps", str(args.round_steps), "--profile-steps", str(args.profile_steps),
            *[fill(a, out) for a in job.flags], *args.extra.split()]


def train_figures(r: dict) -> dict:
    """bench_train.py's result -> the row's figures."""
    p = r.get("profile") or {}
    figs = {"tokens_per_s_per_gpu": r.get("tokens_per_s_per_gpu"), "step_ms": r.get("step_ms"), "mfu": r.get("mfu"),
            "peak_gib": r.get("peak_mem_gib"), "reserved_gib": r.get("peak_reserved_gib"),
            "compute_ms": p.get("compute_busy_ms"), "nccl_ms": p.get("nccl_ms"), "exposed_ms": p.get("exposed_comm_ms"),
            "load": r.get("expert_load_timed_max"), "bubble_predicted": r.get("bubble_predicted")}
    if r.get("bubble_measured"):
        figs["bubble_measured"] = max(r["bubble_measured"])
    return figs


def kept(figs: dict) -> dict:
    """The figures that were measured: no None, no NaN (the CPU's peak memory)."""
    return {k: v for k, v in figs.items() if isinstance(v, (int, float)) and v == v}


def peer_figures(log: str) -> tuple[dict, str | None]:
    """The kit's log -> (figures, torchtitan's version): tokens/s is the median of its logged windows
    after the first (which holds compilation), read before the kit's closing summary."""
    text = open(log, errors="replace").read()
    steps = text.split("=== summary")[0]
    found = [line for line in steps.splitlines() if re.search(r"step: *\d+ +loss", line)]

    def num(key, line):
        m = re.search(key + r":\s*([\d,.]+)", line)
        return float(m.group(1).replace(",", "")) if m else None
    windows = [w for w in (num("tps", line) for line in found[1:]) if w]
    figs = {"tokens_per_s_per_gpu": statistics.median(windows) if windows else None,
            "mfu": (num("mfu", found[-1]) or 0) / 100 if found else None,
            "reserved_gib": num("memory", found[-1]) if found else None}
    load = re.search(r"tt3_moe_load: .* by step: ([\d. ]+)", text)
    if load:
        figs["load"] = max(float(x) for x in load.group(1).split()[-5:])
    version = re.search(r"torchtitan ([\w.+]+)", text)
    return figs, version.group(1) if version else None


def run_job(job: Job, devices: list[int], out: str, args) -> dict:
    """One job in its own process; {row: (figures, peer, ratio)} of what it measured, and its rc."""
    timeout = args.timeout
    if args.deadline:   # --budget: a job starts only with a minute left, and stops at the deadline
        left = args.deadline - time.time()
        if left < 60:
            print(f"  {job.name}: skipped, {left:.0f} s of --budget left", flush=True)
            return {"rc": "skipped", "rows": {}}
        timeout = min(timeout, int(left))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")   # devices index what this process sees
    devices = [visible[d] if visible != [""] else str(d) for d in devices]
    folder = os.path.join(out, re.sub(r"[^A-Za-z0-9_.-]+", "_", job.name))
    os.makedirs(folder, exist_ok=True)
    env = {**os.environ, **ENV, "CUDA_VISIBLE_DEVICES": ",".join(devices), "ASSETS": assets(),
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if job.kind == "peer":   # every logged step, not the kit's last 4
        env |= {"STEPS": str(args.steps), "OUT": "", "TAIL": "1000"}
    env |= {k: fill(v, folder) for k, v in job.env.items()}
    cmd, log = command(job, folder, args), os.path.join(folder, "log.txt")
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM: torchrun's agent then stops its workers (they run in sessions of their own,
            # which a SIGKILL to the agent would leave on the GPUs)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = 124
    rows, versions = {}, {}
    if rc == 0 and job.kind == "peer":
        figs, versions["torchtitan"] = peer_figures(log)
        rows[job.name] = (figs, None, None)
    elif rc == 0 and job.kind == "meshtron":
        results = [json.loads(x) for x in open(os.path.join(folder, "results.jsonl"))] \
            if os.path.exists(os.path.join(folder, "results.jsonl")) else []
        if results and "error" not in results[-1]:
            rows[job.name] = (train_figures(results[-1]), job.peer, None)
    elif rc == 0:   # a tool's rows; its reader names a peer, or the job's is theirs
        rows = {row: (figs, peer or job.peer, ratio) for row, (figs, peer, ratio) in job.read(job, folder).items()}
    print(f"  {job.name}: rc={rc}, {len(rows)} row(s) in {time.time() - t0:.0f} s on GPUs {devices}"
          + ("" if rc == 0 else f"; log {log}"), flush=True)
    return {"rc": rc, "rows": rows, "versions": {k: v for k, v in versions.items() if v}}


def run_jobs(jobs: list[Job], out: str, args, gpus: int) -> list[dict]:
    free = list(range(gpus))
    for j in [j for j in jobs if j.gpus > max(gpus, 1)]:
        print(f"  {j.name}: skipped, needs {j.gpus} GPUs ({gpus} here)", flush=True)
    jobs = [j for j in jobs if j.gpus <= max(gpus, 1)]
    if not args.pack:
        return [run_job(j, free[:j.gpus], out, args) for j in jobs]
    results, lock, threads = [None] * len(jobs), threading.Condition(), []

    def worker(i, job, devices):
        try:
            results[i] = run_job(job, devices, out, args)
        finally:
            with lock:
                free.extend(devices)
                free.sort()
                lock.notify_all()
    for i, job in sorted(enumerate(jobs), key=lambda p: -p[1].gpus):
        with lock:
            lock.wait_for(lambda n=job.gpus: len(free) >= n)
            devices, free[:] = free[:job.gpus], free[job.gpus:]
        t = threading.Thread(target=worker, args=(i, job, devices))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def machine() -> tuple[dict, dict]:
    """(this machine's GPU name and count, the versions every row shares)."""
    import torch
    versions = {"torch": torch.__version__}
    for name in ("triton", "torchao"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    count = torch.cuda.device_count()
    if count:
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return {"gpu": torch.cuda.get_device_name(0) if count else "cpu", "count": count}, versions


def git_commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def run(names: list[str], args, suites: dict = SUITES) -> list[dict]:
    """The suites' jobs (a row in two of them runs once), then one record per row and suite."""
    only = {n.strip() for n in args.only.split(";") if n.strip()}
    jobs, seen = [], set()
    for job in (j for s in names for j in suites[s].jobs if not only or set(j.row_names()) & only):
        if job.name not in seen:
            seen.add(job.name)
            jobs.append(job)
    out = args.out or os.environ.get("OUT") or "/tmp/benchmarks"
    os.makedirs(out, exist_ok=True)
    where, versions = machine()
    for s in names:   # the suites' set-up (a data set to build) once, before their jobs
        suite = suites[s]
        if suite.setup and not os.path.exists(fill(suite.creates, out)):
            subprocess.run([fill(a, out) for a in suite.setup], cwd=ROOT, check=True,
                           env={**os.environ, "PYTHONPATH": ROOT})
    results = run_jobs(jobs, out, args, where["count"])
    measured = {row: (*values, r["versions"]) for r in results for row, values in r["rows"].items()}
    base = {"commit": args.commit or git_commit(), "date": datetime.date.today().isoformat(), "machine": where,
            "command": "python -m benchmarks " + shlex.join(sys.argv[1:] if args.argv is None else args.argv)}
    records = []
    for s in names:
        rows = [row for j in suites[s].jobs for row in j.row_names()]
        for row in (r for r in rows if r in measured):
            figs, peer, ratio, more = measured[row]
            tps = figs.get("tokens_per_s_per_gpu")
            peer_tps = (measured.get(peer) or ({},))[0].get("tokens_per_s_per_gpu")
            if ratio is None and tps and peer_tps:
                ratio = tps / peer_tps
            records.append({"suite": s, "row": row, **base, "versions": versions | more,
                            "figures": {k: round(v, 6) if isinstance(v, float) else v for k, v in kept(figs).items()},
                            "peer": peer if peer in measured or ratio else None,
                            "ratio": round(ratio, 4) if ratio else None})
    os.makedirs(args.data, exist_ok=True)
    for r in records:
        with open(os.path.join(args.data, f"{r['suite']}.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
    print(f"{len(records)} row(s) appended to {args.data}/<suite>.jsonl; `python -m benchmarks report` "
          "writes RESULTS.md")
    return records


def list_suites(suites: dict = SUITES) -> None:
    for name, suite in suites.items():
        print(f"{name}: {suite.about}")
        for j in suite.jobs:
            what = {"peer": f"run.sh {j.layout}" + (f" {j.env['TT3_ARGS']}" if "TT3_ARGS" in j.env else ""),
                    "meshtron": f"bench_train.py --layouts {j.layout} {' '.join(j.flags)}",
                    "tool": " ".join(a for a in j.flags if a != PY)}[j.kind]
            rows = "" if j.row_names() == [j.name] else f" -> {len(j.row_names())} rows"
            print(f"  {j.name} ({j.gpus} GPU{'s' if j.gpus > 1 else ''}): {what}{rows}"
                  + (f"; against {j.peer}" if j.peer else ""))
