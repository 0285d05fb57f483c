"""Named benchmark suites: meshtron's layouts and their peers side by side, in one call.

    python benchmarks/suite.py list
    OUT=$OUT python benchmarks/suite.py tp2 [ep2 ...] [--pack] [--steps 30]

A suite is a list of jobs. A meshtron job runs benchmarks/bench_train.py (the recipe's
own step; every field it measures lands in OUT/results.jsonl); a peer job runs the
torchtitan 0.2.2 kit (.peer/run.sh, built per ../shared/torchtitan-peer/README.md and
carried to the GPU machine) and its tokens/s is the median of its 5-step windows after
the first (which holds compilation; TP windows swing by up to 25%). Each meshtron row
names the peer job it is compared with. `--pack` runs jobs side by side on disjoint
GPUs of the machine (a two-GPU job on GPUs 0-1 beside another on 2-3); timings meant
for benchmarks/RESULTS.md run unpacked, one job at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def l1b(global_batch: int, *more) -> list[str]:
    """llama-1B (untied, as torchtitan's), 16 x 2048 a model replica, global batch `global_batch`."""
    return ["--model", "llama-1B", "--untie-embeddings", "--seq-len", "2048", "--micro-batch", "16",
            "--global-batch", str(global_batch), *more]


MOE = ["--model", "llama-moe-3B", "--seq-len", "2048", "--micro-batch", "4"]


@dataclass
class Job:
    name: str                  # the row's name
    gpus: int
    layout: str = ""           # bench_train layout (meshtron) or run.sh variant (peer)
    flags: list = field(default_factory=list)
    peer: str | None = None    # the peer row this one is compared with
    env: dict = field(default_factory=dict)
    is_peer: bool = False


def mt(name, gpus, layout, flags, peer=None, **env):
    return Job(name, gpus, layout, flags, peer, env)


def tt(name, gpus, variant, **env):
    return Job(name, gpus, variant, [], None, env, is_peer=True)


TT16 = {"TT3_ARGS": "--training.local_batch_size 16"}
SUITES = {
    # llama-1B, 16 x 2048 a model replica, compiled (issue 41's two-GPU rows)
    "tp2": [tt("torchtitan tp2", 2, "llama1b_tp2_compile", **TT16),
            mt("tp2 + SP", 2, "tp2_compile", l1b(32), "torchtitan tp2"),
            tt("torchtitan fsdp2", 2, "llama1b_fsdp2_compile", **TT16),
            mt("fsdp2", 2, "fsdp2_compile", l1b(32), "torchtitan fsdp2")],
    # the same at four GPUs
    "tp4": [tt("torchtitan tp4", 4, "llama1b_tp4_compile", **TT16),
            mt("tp4 + SP", 4, "tp4_compile", l1b(16), "torchtitan tp4"),
            tt("torchtitan tp2 x fsdp2", 4, "llama1b_tp2fsdp2_compile", **TT16),
            mt("dp2 x tp2 + SP", 4, "tp2dp2_compile", l1b(32), "torchtitan tp2 x fsdp2")],
    # llama-moe-3B (16 experts, top-2), 4 x 2048 a rank (issue 42's rows)
    "ep2": [tt("torchtitan dp2 x ep2", 2, "moe_ep2_2gpu"),
            mt("--ep 2 --zero 1", 2, "ep2", MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2")],
}


def _peer_result(job: Job, log: str) -> dict:
    lines = [line for line in open(log, errors="replace") if re.search(r"step: *\d+ +loss", line)]

    def num(key, line):
        m = re.search(key + r":\s*([\d,.]+)", line)
        return float(m.group(1).replace(",", "")) if m else None
    windows = [w for w in (num("tps", line) for line in lines[1:]) if w]
    return dict(name=job.name, peer_variant=job.layout, world=job.gpus,
                tokens_per_s_per_gpu=statistics.median(windows) if windows else None, tps_windows=windows,
                mfu=(num("mfu", lines[-1]) or 0) / 100 if lines else None,
                peak_reserved_gib=num("memory", lines[-1]) if lines else None)


def run_job(job: Job, devices: list[int], out: str, args) -> dict:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")   # devices index what this process sees
    devices = [visible[d] if visible != [""] else str(d) for d in devices]
    env = {**os.environ, **job.env, "CUDA_VISIBLE_DEVICES": ",".join(devices),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONUNBUFFERED": "1", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", job.name)
    log = os.path.join(out, f"{tag}.log")
    if job.is_peer:
        env |= {"STEPS": str(args.steps), "OUT": ""}
        cmd = ["bash", os.path.join(ROOT, ".peer", "run.sh"), job.layout]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.gpus),
               os.path.join(ROOT, "benchmarks", "bench_train.py"), "--layouts", job.layout, "--out",
               os.path.join(out, tag), "--rounds", str(args.rounds), "--steps", str(args.round_steps),
               "--profile-steps", str(args.profile_steps), *job.flags]
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM: torchrun's agent then stops its workers (they run in sessions of their own,
            # which a SIGKILL to the agent would leave on the GPUs)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = 124
    result = {"name": job.name, "world": job.gpus, "rc": rc, "wall_s": round(time.time() - t0, 1),
              "devices": devices}
    if job.is_peer:
        result |= _peer_result(job, log)
    else:
        path = os.path.join(out, tag, "results.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        result |= rows[-1] if rows else {}
        result["name"], result["peer"] = job.name, job.peer
    with open(os.path.join(out, "suite.jsonl"), "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"  {job.name}: rc={rc} {result.get('tokens_per_s_per_gpu') or 'no result'} tokens/s/GPU "
          f"({result['wall_s']} s on GPUs {devices})", flush=True)
    return result


def run(jobs: list[Job], out: str, args) -> list[dict]:
    import torch
    free = list(range(torch.cuda.device_count()))
    if not args.pack:
        return [run_job(j, free[:j.gpus], out, args) for j in jobs if j.gpus <= len(free)]
    results, lock, threads = [], threading.Condition(), []

    def worker(job, devices):
        try:
            results.append(run_job(job, devices, out, args))
        finally:
            with lock:
                free.extend(devices)
                free.sort()
                lock.notify_all()
    for job in sorted(jobs, key=lambda j: -j.gpus):
        with lock:
            lock.wait_for(lambda n=job.gpus: len(free) >= n)
            devices, free[:] = free[:job.gpus], free[job.gpus:]
        t = threading.Thread(target=worker, args=(job, devices))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return results


def table(results: list[dict]) -> str:
    by_name = {r["name"]: r for r in results}
    rows = ["| row | GPUs | tokens/s/GPU | MFU | against | ratio | compute ms | NCCL ms | exposed ms | step ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps, peer = r.get("tokens_per_s_per_gpu"), by_name.get(r.get("peer") or "")
        ratio = f"{tps / peer['tokens_per_s_per_gpu']:.3f}" if tps and peer and peer.get(
            "tokens_per_s_per_gpu") else ""
        p = r.get("profile") or {}

        def ms(k, p=p):
            return f"{p[k]:.1f}" if k in p else ""
        rows.append(f"| {r['name']} | {r['world']} | {tps:,.0f} | {100 * (r.get('mfu') or 0):.1f}% | "
                    f"{r.get('peer') or ''} | {ratio} | {ms('compute_busy_ms')} | {ms('nccl_ms')} | "
                    f"{ms('exposed_comm_ms')} | {r.get('step_ms', 0):.1f} |" if tps else
                    f"| {r['name']} | {r['world']} | failed (rc {r.get('rc')}) | | | | | | | |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="+", help=f"'list', or suite names: {', '.join(SUITES)}")
    p.add_argument("--pack", action="store_true", help="run jobs side by side on disjoint GPUs")
    p.add_argument("--steps", type=int, default=30, help="the peer's steps")
    p.add_argument("--rounds", type=int, default=5, help="meshtron's timed rounds")
    p.add_argument("--round-steps", type=int, default=4, help="meshtron's steps per round")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--only", default="", help="row names to run, separated by ';' (default: all)")
    p.add_argument("--extra", default="", help="more bench_train flags for every meshtron job (e.g. --experiment X)")
    p.add_argument("--timeout", type=int, default=420)
    args = p.parse_args()
    if args.suites == ["list"]:
        for name, jobs in SUITES.items():
            print(f"{name}: " + "; ".join(f"{j.name} ({j.gpus} GPUs)" for j in jobs))
        return
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    out = os.environ.get("OUT") or "/tmp/suite"
    os.makedirs(out, exist_ok=True)
    only = {n.strip() for n in args.only.split(";") if n.strip()}
    jobs = [j for s in args.suites for j in SUITES[s] if not only or j.name in only]
    for j in jobs:
        if not j.is_peer and args.extra:
            j.flags = j.flags + args.extra.split()
    results = run(jobs, out, args)
    order = {j.name: i for i, j in enumerate(jobs)}
    print(table(sorted(results, key=lambda r: order[r["name"]])))


if __name__ == "__main__":
    main()
