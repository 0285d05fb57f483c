"""The planner's predictions (meshtron.planner.plan.predict) against measured runs of the
same layouts: peak memory (torch.cuda.max_memory_allocated, the largest over
ranks) and step time (bench_train's median), per layout and as a mean absolute
percentage error.

    torchrun --nproc-per-node 1 benchmarks/bench_plan.py --suite 1gpu --out $OUT
    python benchmarks/bench_plan.py --summarize $OUT/plan.jsonl [--gpu FILE]   # predicted again with FILE
    python benchmarks/bench_plan.py --planner-speed    # CPU: seconds to rank every layout of 64 GPUs

A suite is a list of recipe flag sets for one world size; each is timed by
bench_train.measure exactly as bench_train times a layout (bf16, eager unless
the flags say --compile), and predicted with the calibration file of the GPU it
ran on (--gpu, default: h200 or h100 by the device's name).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_train  # noqa: E402

from meshtron import Config, models  # noqa: E402
from meshtron.distributed.mesh import resolve_degrees  # noqa: E402
from meshtron.planner import plan  # noqa: E402
from meshtron.train.layout import batch_layout  # noqa: E402
from meshtron.train.lifetime import init_process_group  # noqa: E402

GB16 = ["--seq-len", "2048", "--global-batch", "16"]
SUITES = {   # world size, [recipe flags]
    "1gpu": (1, [[*GB16, "--model", m, "--micro-batch", mb, *extra]
                 for m in ("1.3B", "llama-1B")
                 for mb, extra in (("1", []), ("2", []), ("4", []), ("8", []),
                                   ("4", ["--recompute", "selective"]), ("4", ["--recompute", "full"]),
                                   ("8", ["--recompute", "full"]))]),
    "recompute": (1, [[*GB16, "--model", m, "--micro-batch", "4", "--recompute", r]
                      for m in ("1.3B", "llama-1B") for r in ("none", "full", "selective")]),
    "1gpu_compile": (1, [[*GB16, "--model", m, "--micro-batch", mb, "--compile", *extra]
                         for m in ("1.3B", "llama-1B")
                         for mb, extra in (("2", []), ("4", []), ("8", []), ("4", ["--recompute", "full"]))]),
    "4gpu": (4, [[*GB16, "--model", m, *flags] for m in ("1.3B", "llama-1B") for flags in (
        ["--dp", "4", "--micro-batch", "2"], ["--dp", "4", "--zero", "3", "--micro-batch", "4"],
        ["--dp", "2", "--tp", "2", "--sp", "--micro-batch", "4"], ["--tp", "4", "--sp", "--micro-batch", "4"],
        ["--pp", "4", "--micro-batch", "2"], ["--dp", "2", "--pp", "2", "--micro-batch", "2"],
        ["--pp", "2", "--tp", "2", "--sp", "--micro-batch", "2"], ["--dp", "2", "--cp", "2", "--micro-batch", "4"],
        ["--dp", "4", "--micro-batch", "4", "--recompute", "full"])]),
    # shapes a user runs on one GPU, off the fitted rows: long sequences, recompute, fp32, FP8, the
    # fused loss, the GPT family, MoE; one micro-batch a step unless named
    "shapes_1gpu": (1, [[*flags[1:], "--global-batch", flags[0]] for flags in (
        ["2", "--model", "llama-1B", "--seq-len", "8192", "--micro-batch", "2", "--compile"],
        ["4", "--model", "llama-1B", "--seq-len", "4096", "--micro-batch", "4"],
        ["1", "--model", "llama-1B", "--seq-len", "16384", "--micro-batch", "1"],
        ["8", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "8", "--fused-loss"],
        ["2", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "2", "--dtype", "fp32"],
        ["4", "--model", "llama-3B", "--seq-len", "2048", "--micro-batch", "4", "--recompute", "full"],
        ["4", "--model", "llama-3B", "--seq-len", "4096", "--micro-batch", "2", "--compile"],
        ["8", "--model", "350M", "--seq-len", "2048", "--micro-batch", "8"],
        ["8", "--model", "1.3B", "--seq-len", "2048", "--micro-batch", "8", "--compile"],
        ["4", "--model", "1.3B", "--seq-len", "4096", "--micro-batch", "4", "--recompute", "full"],
        ["4", "--model", "2.7B", "--seq-len", "2048", "--micro-batch", "4"],
        ["4", "--model", "llama-moe-3B", "--seq-len", "2048", "--micro-batch", "4"],
        ["1", "--model", "llama-617M", "--seq-len", "32768", "--micro-batch", "1"],
        ["4", "--model", "llama-1B", "--seq-len", "4096", "--micro-batch", "2", "--recompute", "full"],
        ["16", "--model", "125M", "--seq-len", "2048", "--micro-batch", "16"],
        ["8", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "8", "--fp8", "tensorwise", "--compile"],
        ["8", "--model", "1.3B", "--seq-len", "2048", "--micro-batch", "8", "--fp8", "tensorwise", "--compile"],
        ["4", "--model", "llama-3B", "--seq-len", "2048", "--micro-batch", "4", "--recompute", "selective",
         "--compile"],
        ["4", "--model", "llama-moe-3B", "--seq-len", "2048", "--micro-batch", "4", "--compile"],
    )]),
    "shapes_1gpu_b": (1, [[*flags[1:], "--global-batch", flags[0]] for flags in (
        ["2", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "1"],
        ["2", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "2", "--compile"],
        ["8", "--model", "llama-moe-3B", "--seq-len", "2048", "--micro-batch", "8", "--compile"],
        ["1", "--model", "llama-3B", "--seq-len", "8192", "--micro-batch", "1", "--recompute", "full", "--compile"],
        ["8", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "8", "--fp8", "rowwise", "--compile"],
        ["16", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "16", "--fused-loss", "--compile"],
        ["2", "--model", "6.7B", "--seq-len", "2048", "--micro-batch", "2", "--recompute", "full"],
        ["2", "--model", "1.3B", "--seq-len", "2048", "--micro-batch", "2"],
        ["4", "--model", "llama-1B", "--seq-len", "4096", "--micro-batch", "2", "--recompute", "selective",
         "--compile"],
        ["4", "--model", "350M", "--seq-len", "2048", "--micro-batch", "4", "--dtype", "fp32"],
        ["1", "--model", "llama-617M", "--seq-len", "65536", "--micro-batch", "1", "--compile"],
    )]),
    # shapes none of the fitted rows has, predicted by the fit made without them
    "held_out_1gpu": (1, [[*flags[1:], "--global-batch", flags[0]] for flags in (
        ["2", "--model", "llama-3B", "--seq-len", "8192", "--micro-batch", "1", "--compile"],
        ["4", "--model", "2.7B", "--seq-len", "2048", "--micro-batch", "4", "--compile"],
        ["1", "--model", "llama-1B", "--seq-len", "32768", "--micro-batch", "1", "--compile"],
        ["4", "--model", "llama-moe-3B", "--seq-len", "2048", "--micro-batch", "2"],
        ["16", "--model", "350M", "--seq-len", "2048", "--micro-batch", "16", "--fused-loss", "--compile"],
        ["4", "--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "4", "--fp8", "tensorwise"],
    )]),
}


def predicted(flags: list[str], world: int, gpu: str) -> plan.Prediction:
    config = Config.from_args(["--dtype", "bf16", *flags], models=models.PRESETS)
    spec, preset = models.get(config.model.model)
    cfg = spec.configure(preset, config.model)
    degrees = resolve_degrees(world, **config.parallel.degrees())
    microbatches, _ = batch_layout(config.parallel, config.training, degrees)
    par = dataclasses.replace(config.parallel, **degrees, microbatches=microbatches)
    return plan.predict(spec, cfg, par, config.training.micro_batch, microbatches, config.training.seq_len,
                        plan.hardware(gpu), gpus_per_node=8)


def compare(r: dict, flags: list[str], world: int, gpu: str) -> dict:
    """A measured row with the planner's prediction for its flags under calibration `gpu`."""
    pr, gib = predicted(flags, world, gpu), 2 ** 30
    return r | dict(predicted_step_ms=pr.step_s * 1e3, predicted_mem_gib=pr.memory / gib, gpu_file=gpu,
                    step_error=pr.step_s * 1e3 / r["step_ms"] - 1, mem_error=pr.memory / gib / r["peak_mem_gib"] - 1,
                    predicted_state_gib=pr.state / gib, predicted_acts_gib=pr.activations / gib)


def summarize(path: str, gpu: str | None = None) -> None:
    """The table of a plan.jsonl; with `gpu`, predicted again under that calibration."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if gpu:
        rows = [r if "error" in r else compare(r, r["flags"].split(), r["world"], gpu) for r in rows]
    ok = [r for r in rows if "error" not in r]
    print("| flags | measured step ms | predicted | error | measured peak GiB | predicted | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['flags']} | {r['error'][:80]} | | | | | |")
            continue
        print(f"| {r['flags']} | {r['step_ms']:.1f} | {r['predicted_step_ms']:.1f} | {r['step_error']:+.1%} | "
              f"{r['peak_mem_gib']:.2f} | {r['predicted_mem_gib']:.2f} | {r['mem_error']:+.1%} |")
    if ok:
        print(f"mean absolute error: step time {statistics.fmean(abs(r['step_error']) for r in ok):.1%}, "
              f"peak memory {statistics.fmean(abs(r['mem_error']) for r in ok):.1%} over {len(ok)} layouts")


def planner_speed(repeats: int = 5) -> None:
    """The planner's own speed (CPU): ranking every layout of llama-8B on 64 GPUs, the
    median of `repeats` runs of this process' CPU time (other jobs do not count)."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fit, _ = plan.plan("llama-8B", seq_len=8192, global_batch=64, gpus=64, gpus_per_node=8)
        times.append(time.process_time() - t0)
    print(f"plan llama-8B on 64 GPUs: {len(fit)} layouts ranked, median {statistics.median(times):.2f} s CPU "
          f"(min {min(times):.2f}, max {max(times):.2f}, {repeats} runs)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="1gpu", choices=tuple(SUITES))
    p.add_argument("--gpu", default=None, help="calibration: h200, h100 or a file (default: by device name)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=".")
    p.add_argument("--budget", type=float, default=None, help="seconds: start no row after BUDGET - 60")
    p.add_argument("--summarize", default=None)
    p.add_argument("--planner-speed", action="store_true", help="time the planner itself on the CPU and exit")
    args = p.parse_args()
    if args.planner_speed:
        planner_speed()
        return
    if args.summarize:
        summarize(args.summarize, args.gpu)
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    init_process_group(600)
    world, suite = SUITES[args.suite]
    if dist.get_world_size() != world:
        raise SystemExit(f"suite {args.suite} runs on {world} ranks, not {dist.get_world_size()}")
    gpu = args.gpu or ("h100" if "H100" in torch.cuda.get_device_name() else "h200")
    bench_train.LAYOUTS["plan"] = (world, [])
    args.sdpa, args.experiment, args.profile_steps = "default", "", 0
    args.memory_phases = args.check_replicas = args.trace = args.sync_steps = False
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    for flags in suite:
        if args.budget and time.perf_counter() - start > args.budget - 60:
            bench_train.record(dict(flags=" ".join(flags), error="not run: out of the call's time"),
                               os.path.join(args.out, "plan.jsonl"))
            continue
        try:
            r = compare(bench_train.measure("plan", flags, args), flags, world, gpu)
        except Exception as e:  # noqa: BLE001 - record and go on
            r = dict(flags=" ".join(flags), error=f"{type(e).__name__}: {e}")
            bench_train.forget()
        bench_train.record(r, os.path.join(args.out, "plan.jsonl"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
