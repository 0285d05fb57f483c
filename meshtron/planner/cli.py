"""The planner's command line: the layouts that fit, ranked, each with the command that
launches it (meshtron.planner.plan does the planning).

    python -m meshtron.plan --model llama-8B --seq-len 8192 --global-batch 64 --gpus 64 --gpus-per-node 8
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from meshtron import models
from meshtron.planner import plan as planner
from meshtron.planner.hardware import calibration_line, hardware
from meshtron.planner.plan import GiB, Prediction

COLUMNS = """columns: step ms and MFU, predicted (bf16, or FP8 with --fp8; the GPU's calibration); GiB (MiB
where all are under one) on the fullest rank = state (fp32 weights, gradients and AdamW moments as sharded) +
bf16 (the unsharded bf16 weights computed with: a stage's all under ZeRO 0-2, about one block's under ZeRO 3)
+ acts (activations in flight; a pipeline's ranks each from their own stages' layers, micro-batches in flight
and, on the head's rank, logits). Layouts that predict the same in every column and differ only in --zero are
one row, the lowest --zero, with the others named.

calibration: `python -m meshtron.plan calibrate --out FILE.json` measures this GPU (GEMMs per dtype, attention,
HBM bandwidth, host time per layer, links) and writes a file that --gpu reads; `calibrate --fit` fits the few
global terms no part shows to the shipped measured steps; `calibrate --leave-one-out` prints the error below.

what the step model includes: the model's GEMMs at the measured rate of their size and dtype (FP8's block
linears at fp8's), attention at its head dim, sequence and dtype, and the memory-bound kernels' bytes counted
from the code (activations, the loss, MoE permutations, optimizer, clipping, casts) at the HBM bandwidth;
the host per layer of the model's family and per micro-batch (a small micro-batch waits for it); each
collective by the alpha-beta model on its group's link (TP, EP and CP exposed; FSDP hidden but for one
unit's, what the compute cannot cover and a share that slows the compute beside it); the pipeline's bubble.
Not included: expert parallelism's exposed all-to-alls; the interleaved and zero-bubble schedules' stalls at
pp4; the inter-node link (nominal).

error users can trust (each of 55 measured steps on one H200 and two and four H100s predicted by a fit made
without it): step time mean 7.7%, compiled steps within 15% but a pipeline row and a MoE row, eager steps
paced by the host up to 41% off; peak memory within 8% on every row. Held-out shapes: within 4% in time but
FP8 without --compile (2.4-2.8x slower than predicted: train FP8 compiled), within 3% in memory.
The table: docs/planner.md."""


def _collapse_ties(fit: list[Prediction]) -> list[tuple[Prediction, list[int]]]:
    """Each prediction with the --zero levels of the next ones that predict the same and differ only in --zero."""
    rows: list[tuple[Prediction, list[int]]] = []
    for pr in fit:
        if rows:
            kept, same = rows[-1]
            if (dataclasses.replace(kept.par, zero=pr.par.zero) == pr.par and kept.micro_batch == pr.micro_batch
                    and math.isclose(kept.step_s, pr.step_s) and math.isclose(kept.memory, pr.memory)):
                same.append(pr.par.zero)
                continue
        rows.append((pr, []))
    return rows


def launch_command(gpus: int, gpus_per_node: int) -> str:
    """The launcher for `gpus` GPUs: one node, or every node's command (run on each, same endpoint)."""
    per_node = min(gpus, gpus_per_node)
    if gpus <= per_node:
        return f"meshtron-run --nproc-per-node {per_node}"
    return (f"meshtron-run --nnodes {gpus // per_node} --nproc-per-node {per_node} --rdzv-backend c10d "
            "--rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $JOB_ID")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meshtron.plan", description=planner.__doc__.split("\n\n")[0],
                                epilog=COLUMNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=tuple(models.PRESETS), help="a registered preset")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per machine: tp, cp and ep stay inside one "
                   "(default %(default)s)")
    p.add_argument("--gpu", default="h200", help="h200, h100 or a calibration JSON file (default %(default)s)")
    p.add_argument("--top", type=int, default=15, help="rows to print, fastest first (default %(default)s)")
    p.add_argument("--compile", action="store_true", help="plan compiled blocks (and print --compile)")
    p.add_argument("--fp8", default="none", choices=("none", "tensorwise", "rowwise"),
                   help="plan FP8 matmuls (and print --fp8; default %(default)s)")
    return p


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.gpus > a.gpus_per_node and a.gpus % a.gpus_per_node:
        fits = max(d for d in range(1, a.gpus_per_node + 1) if a.gpus % d == 0)
        sys.exit(f"error: --gpus {a.gpus} is not a whole number of {a.gpus_per_node}-GPU nodes: give a multiple of "
                 f"{a.gpus_per_node}, or --gpus-per-node {fits} ({a.gpus // fits} nodes of {fits})")
    t0 = time.perf_counter()
    try:
        fit, over = planner.plan(a.model, a.seq_len, a.global_batch, a.gpus, a.gpus_per_node, a.gpu, a.compile, a.fp8)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    rows = _collapse_ties(fit)
    nodes = f" ({a.gpus_per_node} per node)" if a.gpus > a.gpus_per_node else ""   # one node: nothing to say
    print(f"{a.model}, sequence {a.seq_len}, global batch {a.global_batch}, {a.gpus} x {a.gpu}{nodes}: "
          f"{len(fit)} layouts fit, {len(over)} do not (planned in {time.perf_counter() - t0:.2f} s)")
    print(f"calibration: {calibration_line(a.gpu)}")
    # a model that fits in under a GiB a rank would print 0.0 in every memory column
    unit, size = ("GiB", GiB) if any(pr.memory >= GiB for pr, _ in rows[:a.top]) else ("MiB", 2**20)
    print(f"{'#':>3} {'step ms':>8} {'MFU':>6} {unit:>7} {'state':>7} {'bf16':>7} {'acts':>7}  command")
    launch = launch_command(a.gpus, a.gpus_per_node)
    for i, (pr, same) in enumerate(rows[:a.top], 1):
        also = f"   (the same at --zero {', '.join(map(str, same))})" if same else ""
        print(f"{i:>3} {pr.step_s * 1e3:8.1f} {pr.mfu:6.1%} {pr.memory / size:7.1f} {pr.state / size:7.1f} "
              f"{pr.gathered / size:7.1f} {pr.activations / size:7.1f}  {launch} recipes/train.py "
              f"--model {a.model} --seq-len {a.seq_len} --global-batch {a.global_batch} --dtype bf16 {pr.flags()}"
              + also)
    if a.gpus > min(a.gpus, a.gpus_per_node):
        print(f"run the command on each of the {a.gpus // a.gpus_per_node} nodes, with HEAD_NODE the address of "
              "one of them and JOB_ID any name shared by all")
    if not fit and over:
        best = over[0]
        print(f"nothing fits in {hardware(a.gpu).memory_bytes / GiB:.0f} GiB; the smallest needs "
              f"{best.memory / GiB:.1f} GiB ({best.flags()}): more GPUs, a smaller micro-batch or sequence")
    sys.stdout.flush()
