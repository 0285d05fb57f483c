"""Named benchmark suites: meshtron's layouts and their peers side by side, in one run.

    python benchmarks/suite.py list
    OUT=$OUT python benchmarks/suite.py tp2 [ep2 ...] [--pack] [--steps 30]

Suites: 1gpu and fp8 (one GPU at the issue's batches, an H200's memory; 1gpu-80g and
fp8-80g: half the batches for an 80 GB GPU), tp2, tp2-overlap, tp4, fsdp4, pp, cp1, cp2, cp4, moe1,
ep2, ep4 (`list` prints each row). What no suite expresses has one script:
benchmarks/documents.sh (packed documents, with a torchtitan flex flavor) and
benchmarks/convergence.sh (300-step loss curves against torchtitan's).

A suite is a list of jobs. A meshtron job runs benchmarks/bench_train.py (the recipe's
own step; every field it measures lands in OUT/results.jsonl); a peer job runs the
torchtitan 0.2.2 kit (.peer/run.sh, built per ../shared/torchtitan-peer/README.md and
copied to .peer/ in the checkout) and its tokens/s is the median of its 5-step windows after
the first (which holds compilation; TP windows swing by up to 25%). Each meshtron row
names the row it is compared with (a peer's, or another meshtron row's where the peer has
no such layout: the pipelines against dp, the GPT's FP8 against its bf16). `--pack` runs jobs side by side on disjoint
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


def l1b(global_batch: int, *more, micro_batch: int = 16, model: str = "llama-1B") -> list[str]:
    """llama-1B (untied, as torchtitan's), 16 x 2048 a model replica, global batch `global_batch`."""
    return ["--model", model, "--untie-embeddings", "--seq-len", "2048", "--micro-batch", str(micro_batch),
            "--global-batch", str(global_batch), *more]


def l3b(global_batch: int, *more, micro_batch: int = 8) -> list[str]:
    """llama-3B (untied), 8 x 2048 a model replica."""
    return l1b(global_batch, *more, micro_batch=micro_batch, model="llama-3B")


def l617m(seq: int, *more) -> list[str]:
    """llama-617M (8 x 2048, torchtitan's cp_8l shape), one sequence of `seq` tokens a step."""
    return ["--model", "llama-617M", "--seq-len", str(seq), "--micro-batch", "1", "--global-batch", "1", *more]


MOE = ["--model", "llama-moe-3B", "--seq-len", "2048", "--micro-batch", "4"]
GPT = ["--model", "1.3B", "--seq-len", "2048", "--micro-batch", "8", "--global-batch", "8"]
PIPE = l1b(32, micro_batch=4)   # the pipeline rows: global batch 32, micro-batch 4


@dataclass
class Job:
    name: str                  # the row's name
    gpus: int
    layout: str = ""           # bench_train layout (meshtron) or run.sh variant (peer)
    flags: list = field(default_factory=list)
    peer: str | None = None    # the row this one is compared with (a peer's, or another meshtron row's)
    env: dict = field(default_factory=dict)
    is_peer: bool = False


def mt(name, gpus, layout, flags, peer=None, **env):
    return Job(name, gpus, layout, flags, peer, env)


def tt(name, gpus, variant, **env):
    return Job(name, gpus, variant, [], None, env, is_peer=True)


def tt_batch(n: int) -> dict:
    """The peer's sequences per data-parallel rank (TT3_ARGS, read by .peer/run.sh)."""
    return {"TT3_ARGS": f"--training.local_batch_size {n}"}


TT16 = tt_batch(16)
# torchtitan's MoE routing load (benchmarks/torchtitan/tt3_moe_load.py), and its forced balance
TT_MOE_LOAD = {"PYTHONPATH": os.path.join(ROOT, "benchmarks", "torchtitan"),
               "TT3_ARGS": "--experimental.custom_import tt3_moe_load"}
TT_MOE_BALANCED = {**TT_MOE_LOAD, "TT3_ARGS": TT_MOE_LOAD["TT3_ARGS"] + " --debug.moe_force_load_balance"}

SUITES = {
    # one GPU, Llama 3.2 shapes untied, bf16 (16 x 2048 and 8 x 2048: an H200's memory; `1gpu-80g` on an H100)
    "1gpu": [tt("torchtitan llama-1B eager", 1, "llama1b_1gpu", **TT16),
             mt("llama-1B eager", 1, "1gpu", l1b(16), "torchtitan llama-1B eager"),
             tt("torchtitan llama-1B", 1, "llama1b_1gpu_compile", **TT16),
             mt("llama-1B", 1, "1gpu_compile", l1b(16), "torchtitan llama-1B"),
             tt("torchtitan llama-3B", 1, "llama3b_1gpu_compile", **tt_batch(8)),
             mt("llama-3B", 1, "1gpu_compile", l3b(8), "torchtitan llama-3B")],
    # FP8 (torchao Float8Linear, output head bf16) beside bf16, compiled, one GPU at the shapes (an H200);
    # the GPT 1.3B has no peer: its FP8 row is compared with its bf16 row
    "fp8": [tt("torchtitan llama-1B bf16", 1, "llama1b_1gpu_compile", **TT16),
            mt("llama-1B bf16", 1, "1gpu_compile", l1b(16), "torchtitan llama-1B bf16"),
            tt("torchtitan llama-1B FP8 tensorwise", 1, "llama1b_1gpu_fp8", **TT16),
            mt("llama-1B FP8 tensorwise", 1, "1gpu_fp8_compile", l1b(16), "torchtitan llama-1B FP8 tensorwise"),
            tt("torchtitan llama-1B FP8 rowwise", 1, "llama1b_1gpu_fp8_rowwise", **TT16),
            mt("llama-1B FP8 rowwise", 1, "1gpu_fp8_rowwise_compile", l1b(16), "torchtitan llama-1B FP8 rowwise"),
            tt("torchtitan llama-3B bf16", 1, "llama3b_1gpu_compile", **tt_batch(8)),
            mt("llama-3B bf16", 1, "1gpu_compile", l3b(8), "torchtitan llama-3B bf16"),
            tt("torchtitan llama-3B FP8 tensorwise", 1, "llama3b_1gpu_fp8", **tt_batch(8)),
            mt("llama-3B FP8 tensorwise", 1, "1gpu_fp8_compile", l3b(8), "torchtitan llama-3B FP8 tensorwise"),
            mt("GPT 1.3B bf16", 1, "1gpu_compile", GPT),
            mt("GPT 1.3B FP8 tensorwise", 1, "1gpu_fp8_compile", GPT, "GPT 1.3B bf16")],
    # the same on an 80 GB GPU: half the batches
    "1gpu-80g": [tt("torchtitan llama-1B, 8 x 2048", 1, "llama1b_1gpu_compile", **tt_batch(8)),
                 mt("llama-1B, 8 x 2048", 1, "1gpu_compile", l1b(8, micro_batch=8), "torchtitan llama-1B, 8 x 2048"),
                 tt("torchtitan llama-3B, 4 x 2048", 1, "llama3b_1gpu_compile", **tt_batch(4)),
                 mt("llama-3B, 4 x 2048", 1, "1gpu_compile", l3b(4, micro_batch=4),
                    "torchtitan llama-3B, 4 x 2048")],
    "fp8-80g": [tt("torchtitan llama-1B, 8 x 2048", 1, "llama1b_1gpu_compile", **tt_batch(8)),
                mt("llama-1B, 8 x 2048", 1, "1gpu_compile", l1b(8, micro_batch=8), "torchtitan llama-1B, 8 x 2048"),
                tt("torchtitan llama-1B FP8, 8 x 2048", 1, "llama1b_1gpu_fp8", **tt_batch(8)),
                mt("llama-1B FP8, 8 x 2048", 1, "1gpu_fp8_compile", l1b(8, micro_batch=8),
                   "torchtitan llama-1B FP8, 8 x 2048"),
                tt("torchtitan llama-3B, 4 x 2048", 1, "llama3b_1gpu_compile", **tt_batch(4)),
                mt("llama-3B, 4 x 2048", 1, "1gpu_compile", l3b(4, micro_batch=4), "torchtitan llama-3B, 4 x 2048"),
                tt("torchtitan llama-3B FP8, 4 x 2048", 1, "llama3b_1gpu_fp8", **tt_batch(4)),
                mt("llama-3B FP8, 4 x 2048", 1, "1gpu_fp8_compile", l3b(4, micro_batch=4),
                   "torchtitan llama-3B FP8, 4 x 2048")],
    # llama-1B, 16 x 2048 a model replica, compiled, two GPUs
    "tp2": [tt("torchtitan tp2", 2, "llama1b_tp2_compile", **TT16),
            mt("tp2 + SP", 2, "tp2_compile", l1b(32), "torchtitan tp2"),
            tt("torchtitan fsdp2", 2, "llama1b_fsdp2_compile", **TT16),
            mt("fsdp2", 2, "fsdp2_compile", l1b(32), "torchtitan fsdp2")],
    # hiding tp2's communication: --tp-overlap (Megatron's backward overlap) and --async-tp against the plain
    # row and the peer; the two meshtron rows compared first, side by side under --pack
    "tp2-overlap": [mt("tp2 + SP", 2, "tp2_compile", l1b(32), "torchtitan tp2"),
                    mt("tp2 + SP --tp-overlap", 2, "tp2_overlap_compile", l1b(32), "torchtitan tp2"),
                    tt("torchtitan tp2", 2, "llama1b_tp2_compile", **TT16),
                    mt("tp2 + SP --async-tp", 2, "tp2_async_compile", l1b(32), "torchtitan tp2"),
                    # NCCL's kernels on fewer SMs, leaving the matmuls beside an overlapped collective more
                    # the overlapped reduce-scatter moved by the copy engines over symmetric memory
                    mt("tp2 + SP --tp-overlap copy-engine", 2, "tp2_overlap_ce_compile", l1b(32), "torchtitan tp2"),
                    mt("tp2 + SP --tp-overlap, NCCL_MAX_CTAS=8", 2, "tp2_overlap_compile", l1b(32), "torchtitan tp2",
                       NCCL_MAX_CTAS="8"),
                    mt("tp2 + SP --tp-overlap, NCCL_MAX_CTAS=4", 2, "tp2_overlap_compile", l1b(32), "torchtitan tp2",
                       NCCL_MAX_CTAS="4"),
                    mt("tp2 + SP, NCCL_MAX_CTAS=8", 2, "tp2_compile", l1b(32), "torchtitan tp2", NCCL_MAX_CTAS="8")],
    # the same at four GPUs
    "tp4": [tt("torchtitan tp4", 4, "llama1b_tp4_compile", **TT16),
            mt("tp4 + SP", 4, "tp4_compile", l1b(16), "torchtitan tp4"),
            tt("torchtitan tp2 x fsdp2", 4, "llama1b_tp2fsdp2_compile", **TT16),
            mt("dp2 x tp2 + SP", 4, "tp2dp2_compile", l1b(32), "torchtitan tp2 x fsdp2"),
            # FP8 tensorwise on both sides (torchtitan's tp2 x fsdp2 gathers its weights in fp8)
            tt("torchtitan tp4 FP8", 4, "llama1b_tp4_fp8", **TT16),
            mt("tp4 + SP FP8", 4, "tp4_compile", l1b(16, "--fp8", "tensorwise"), "torchtitan tp4 FP8"),
            tt("torchtitan tp2 x fsdp2 FP8", 4, "llama1b_tp2fsdp2_fp8", **TT16),
            mt("dp2 x tp2 + SP FP8", 4, "tp2dp2_compile", l1b(32, "--fp8", "tensorwise"),
               "torchtitan tp2 x fsdp2 FP8")],
    # data parallel on four GPUs: llama-1B ZeRO-1 (16 x 2048 a rank), llama-8B ZeRO-3 (2 and 4 x 2048 a rank),
    # compiled
    "fsdp4": [tt("torchtitan fsdp4", 4, "llama1b_fsdp4_compile", **TT16),
              mt("dp4 ZeRO-1", 4, "fsdp4_compile", l1b(64), "torchtitan fsdp4"),
              tt("torchtitan llama-8B fsdp4", 4, "llama8b_fsdp4_compile", **tt_batch(2)),
              mt("llama-8B dp4 ZeRO-3", 4, "fsdp4_zero3_compile",
                 ["--model", "llama-8B", "--seq-len", "2048", "--micro-batch", "2", "--global-batch", "8"],
                 "torchtitan llama-8B fsdp4"),
              # weights kept gathered from forward to backward (one all-gather a step): 12.5 GiB more a rank
              mt("llama-8B dp4 ZeRO-2", 4, "fsdp4_zero2_compile",
                 ["--model", "llama-8B", "--seq-len", "2048", "--micro-batch", "2", "--global-batch", "8"],
                 "torchtitan llama-8B fsdp4"),
              # twice the tokens a rank: the same gradient and weight traffic under twice the matmuls
              tt("torchtitan llama-8B fsdp4, local batch 4", 4, "llama8b_fsdp4_compile", **tt_batch(4)),
              mt("llama-8B dp4 ZeRO-3, micro-batch 4", 4, "fsdp4_zero3_compile",
                 ["--model", "llama-8B", "--seq-len", "2048", "--micro-batch", "4", "--global-batch", "16"],
                 "torchtitan llama-8B fsdp4, local batch 4")],
    # the planner's first choice for llama-1B at global batch 64 on four GPUs against the fastest layout measured
    # before it (docs/planner.md)
    "planner-choice": [mt("dp4 ZeRO-1, micro-batch 4 (the planner's first choice)", 4, "fsdp4_compile",
                          ["--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "4", "--global-batch", "64"]),
                       mt("dp4 ZeRO-3, micro-batch 16", 4, "fsdp4_zero3_compile",
                          ["--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "16", "--global-batch", "64"],
                          "dp4 ZeRO-1, micro-batch 4 (the planner's first choice)")],
    # pipelines on four GPUs, llama-1B, global batch 32: pp2 x tp2 against dp2 x tp2 at the same micro-batch (4,
    # compiled), at each layout's natural micro-batch (8 and 16), and the schedules' bubbles against dp4 (eager,
    # micro-batch 4; each pipeline row records its predicted and measured bubble)
    "pp": [mt("dp2 x tp2, micro-batch 4", 4, "tp2dp2_compile", PIPE),
           mt("pp2 x tp2, micro-batch 4", 4, "pp2tp2_compile", PIPE, "dp2 x tp2, micro-batch 4"),
           mt("dp2 x tp2, micro-batch 16", 4, "tp2dp2_compile", l1b(32)),
           mt("pp2 x tp2, 4 micro-batches of 8", 4, "pp2tp2_m4_compile", l1b(32, micro_batch=8),
              "dp2 x tp2, micro-batch 16"),
           mt("dp4 ZeRO-1, micro-batch 4", 4, "fsdp4", PIPE),
           mt("pp4 1F1B", 4, "pp4_1f1b", PIPE, "dp4 ZeRO-1, micro-batch 4"),
           mt("pp4 interleaved", 4, "pp4_interleaved", PIPE, "dp4 ZeRO-1, micro-batch 4"),
           mt("pp4 ZBV", 4, "pp4_zbv", PIPE, "dp4 ZeRO-1, micro-batch 4"),
           mt("dp2 x pp2 1F1B", 4, "dp2pp2_1f1b", PIPE, "dp4 ZeRO-1, micro-batch 4"),
           mt("dp2 x pp2 interleaved", 4, "dp2pp2_interleaved", PIPE, "dp4 ZeRO-1, micro-batch 4"),
           mt("dp2 x pp2 ZBV", 4, "dp2pp2_zbv", PIPE, "dp4 ZeRO-1, micro-batch 4")],
    # long context, llama-617M, one sequence a step, not compiled unless named (torchtitan's cp_8l shape)
    "cp1": [tt("torchtitan cp1 16K", 1, "cp1_16k"),
            mt("16K, one GPU", 1, "1gpu", l617m(16384), "torchtitan cp1 16K")],
    "cp2": [tt("torchtitan cp2 32K", 2, "cp2_32k"),
            mt("32K, cp2 (ring)", 2, "cp2", l617m(32768), "torchtitan cp2 32K")],
    "cp4": [tt("torchtitan cp4 64K", 4, "cp4_64k"),
            mt("64K, cp4 (ring)", 4, "cp4", l617m(65536), "torchtitan cp4 64K"),
            tt("torchtitan cp4 128K", 4, "cp4_128k"),
            mt("128K, cp4 (ring)", 4, "cp4", l617m(131072), "torchtitan cp4 128K"),
            mt("128K, cp4 (a2a)", 4, "cp4", l617m(131072, "--cp-comm", "a2a"), "torchtitan cp4 128K"),
            tt("torchtitan cp4 128K, compiled", 4, "cp4_128k", TT3_ARGS="--compile.enable"),
            mt("128K, cp4 (a2a), compiled", 4, "cp4_compile", l617m(131072, "--cp-comm", "a2a"),
               "torchtitan cp4 128K, compiled")],
    # llama-moe-3B (16 experts, top-2), 4 x 2048 a rank, not compiled; each side's routing load is recorded
    # (meshtron: expert_load_*; torchtitan: tt3_moe_load's line in its log)
    "moe1": [tt("torchtitan moe natural", 1, "moe_1gpu", **TT_MOE_LOAD),
             mt("moe, batch balancing (defaults)", 1, "1gpu", MOE + ["--global-batch", "4"], "torchtitan moe natural"),
             mt("moe, the router's own choice", 1, "1gpu", MOE + ["--global-batch", "4", "--moe-batch-balance", "0"],
                "torchtitan moe natural"),
             tt("torchtitan moe balanced", 1, "moe_1gpu", **TT_MOE_BALANCED),
             mt("moe, forced balanced", 1, "1gpu", MOE + ["--global-batch", "4", "--moe-balanced-routing"],
                "torchtitan moe balanced")],
    # two GPUs: ZeRO-1 and ZeRO-2 (alike at one micro-batch a step; ZeRO-2 reduce-scatters each micro-batch's
    # gradients where there are several), and both sides compiled
    "ep2": [tt("torchtitan dp2 x ep2", 2, "moe_ep2_2gpu"),
            mt("--ep 2 --zero 1", 2, "ep2", MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
            mt("--ep 2 --zero 2", 2, "ep2_zero2", MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
            tt("torchtitan dp2 x ep2, compiled", 2, "moe_ep2_2gpu", TT3_ARGS="--compile.enable", T="240"),
            mt("--ep 2 --zero 1, compiled", 2, "ep2_compile", MOE + ["--global-batch", "8"],
               "torchtitan dp2 x ep2, compiled"),
            mt("--ep 2 --zero 2, compiled", 2, "ep2_zero2_compile", MOE + ["--global-batch", "8"],
               "torchtitan dp2 x ep2, compiled"),
            mt("--ep 2 --zero 2 --moe-dispatch padded", 2, "ep2_zero2_padded", MOE + ["--global-batch", "8"],
               "torchtitan dp2 x ep2"),
            mt("--ep 2 --zero 2 --moe-dispatch padded, compiled", 2, "ep2_zero2_padded_compile",
               MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2, compiled"),
            # the all-to-alls beside the expert GEMMs (two token chunks), and FSDP's all-gathers 2 blocks ahead
            mt("--ep 2 --zero 2 --moe-dispatch overlap, compiled", 2, "ep2_zero2_overlap_compile",
               MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
            mt("--ep 2 --zero 2 --fsdp-prefetch 2, compiled", 2, "ep2_zero2_pf2_compile",
               MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
            mt("--ep 2 --zero 2 --moe-dispatch overlap --fsdp-prefetch 2, compiled", 2,
               "ep2_zero2_overlap_pf2_compile", MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2")],
    "ep4": [tt("torchtitan dp4 x ep4", 4, "moe_ep4"),
            mt("--ep 4 --zero 1", 4, "ep4", MOE + ["--global-batch", "16"], "torchtitan dp4 x ep4"),
            tt("torchtitan moe fsdp4", 4, "moe_fsdp4"),
            mt("dp4 ZeRO-1, experts replicated", 4, "fsdp4", MOE + ["--global-batch", "16"], "torchtitan moe fsdp4")],
}


def _peer_result(job: Job, log: str) -> dict:
    # the kit's closing summary repeats its last step's line: only what comes before it
    steps = open(log, errors="replace").read().split("=== summary")[0]
    lines = [line for line in steps.splitlines() if re.search(r"step: *\d+ +loss", line)]

    def num(key, line):
        m = re.search(key + r":\s*([\d,.]+)", line)
        return float(m.group(1).replace(",", "")) if m else None
    windows = [w for w in (num("tps", line) for line in lines[1:]) if w]
    return dict(name=job.name, peer_variant=job.layout, world=job.gpus,
                tokens_per_s_per_gpu=statistics.median(windows) if windows else None, tps_windows=windows,
                mfu=(num("mfu", lines[-1]) or 0) / 100 if lines else None,
                peak_reserved_gib=num("memory", lines[-1]) if lines else None)


def run_job(job: Job, devices: list[int], out: str, args) -> dict:
    timeout = args.timeout
    if args.deadline:   # --budget: a job starts only with a minute left, and stops at the deadline
        left = args.deadline - time.time()
        if left < 60:
            print(f"  {job.name}: skipped, {left:.0f} s of --budget left", flush=True)
            result = {"name": job.name, "world": job.gpus, "rc": "skipped", "wall_s": 0.0, "devices": devices}
            with open(os.path.join(out, "suite.jsonl"), "a") as f:
                f.write(json.dumps(result) + "\n")
            return result
        timeout = min(timeout, int(left))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")   # devices index what this process sees
    devices = [visible[d] if visible != [""] else str(d) for d in devices]
    env = {**os.environ, **job.env, "CUDA_VISIBLE_DEVICES": ",".join(devices),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONUNBUFFERED": "1", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", job.name)
    log = os.path.join(out, f"{tag}.log")
    if job.is_peer:
        env |= {"STEPS": str(args.steps), "OUT": "", "TAIL": "1000"}   # every logged step, not the kit's last 4
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
    bubbles = any("bubble_predicted" in r for r in results)
    rows = ["| row | GPUs | tokens/s/GPU | MFU | against | ratio | compute ms | NCCL ms | exposed ms | step ms |"
            + (" bubble predicted / measured |" if bubbles else ""),
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if bubbles else "")]
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
        if bubbles:
            measured = " ".join(f"{b:.2f}" for b in r.get("bubble_measured") or [])
            rows[-1] += (f" {r['bubble_predicted']:.3f} / {measured} |" if "bubble_predicted" in r else " |")
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
    p.add_argument("--timeout", type=int, default=420, help="seconds a job may run")
    p.add_argument("--budget", type=int, default=0,
                   help="seconds for all the jobs (a device call's): a job starts only with 60 s of it left")
    args = p.parse_args()
    args.deadline = time.time() + args.budget if args.budget else None
    if args.suites == ["list"]:
        for name, jobs in SUITES.items():
            print(f"{name}:")
            for j in jobs:
                what = f"torchtitan run.sh {j.layout}" if j.is_peer else f"bench_train.py --layouts {j.layout}"
                print(f"  {j.name} ({j.gpus} GPU{'s' if j.gpus > 1 else ''}): {what}"
                      + (f" {' '.join(j.flags)}" if j.flags else "")
                      + (f" {j.env['TT3_ARGS']}" if j.is_peer and "TT3_ARGS" in j.env else "")
                      + (f"; against {j.peer}" if j.peer else ""))
        return
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    out = os.environ.get("OUT") or "/tmp/suite"
    os.makedirs(out, exist_ok=True)
    only = {n.strip() for n in args.only.split(";") if n.strip()}
    jobs, seen = [], set()   # a row in two of the suites asked for runs once
    for j in (j for s in args.suites for j in SUITES[s] if not only or j.name in only):
        if j.name not in seen:
            seen.add(j.name)
            jobs.append(j)
    for j in jobs:
        if not j.is_peer and args.extra:
            j.flags = j.flags + args.extra.split()
    results = run(jobs, out, args)
    order = {j.name: i for i, j in enumerate(jobs)}
    print(table(sorted(results, key=lambda r: order[r["name"]])))


if __name__ == "__main__":
    main()
