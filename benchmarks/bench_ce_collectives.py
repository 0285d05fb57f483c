"""tp2 + SP's reduce-scatter and all-gather: NCCL's against copy-engine transfers over
symmetric memory, alone and beside a bf16 matmul on another stream.

    torchrun --nproc-per-node 2 benchmarks/bench_ce_collectives.py [--out DIR]

Sizes are tp2 + SP's for llama-1B at micro-batch 16, sequence 2048: a 16 x 2048 x 2048
bf16 activation (128 MiB) reduce-scattered over the sequence, and its half all-gathered.
Collectives: NCCL (`dist.reduce_scatter_tensor`, `dist.all_gather_into_tensor`);
meshtron's `ce_reduce_scatter` (the one --tp-overlap-comm copy-engine runs); torch's
`symm_mem._low_contention_reduce_scatter` / `_low_contention_all_gather`. Each is issued
on a side stream, `--reps` times back to back, while the default stream runs a block of
`--matmuls` bf16 matmuls (8192 x 8192 x 8192); the same block and the same collectives
are also timed alone. Reported per collective: ms alone, ms beside the matmuls, and how
much longer the matmul block took beside it (the SMs the collective took from it).
Results print as a table on rank 0 and, with --out, land in DIR/ce_collectives.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from meshtron.distributed.local_tensor_parallel import ce_reduce_scatter, enable_copy_engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--reps", type=int, default=10, help="collectives back to back per timed region")
    p.add_argument("--matmuls", type=int, default=8, help="8192^3 bf16 matmuls per timed region")
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    group = dist.group.WORLD
    name = group.group_name
    enable_copy_engine(name, "cuda")

    torch.manual_seed(rank)
    act = torch.randn(16 * 2048 * 2048, device=dev, dtype=torch.bfloat16).view(world * 16, 2048 // world, 2048)
    half = torch.randn(16, 2048 // world, 2048, device=dev, dtype=torch.bfloat16)
    mm_a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)

    def nccl_rs():
        out = torch.empty(act.shape[0] // world, *act.shape[1:], device=dev, dtype=act.dtype)
        dist.reduce_scatter_tensor(out, act, group=group)
        return out

    def nccl_ag():
        out = torch.empty(world * half.shape[0], *half.shape[1:], device=dev, dtype=half.dtype)
        dist.all_gather_into_tensor(out, half, group=group)
        return out

    seq = act.view(world, 16, 2048 // world, 2048).transpose(0, 1).reshape(16, 2048, 2048).contiguous()

    def ce_rs():   # the same sums from the (B, T, d) activation, scattered over the sequence
        out, stream = ce_reduce_scatter(seq, name)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def torch_lc_rs():
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops.symm_mem._low_contention_reduce_scatter(act, "sum", name))

    def torch_lc_ag():
        return torch.ops._c10d_functional.wait_tensor(torch.ops.symm_mem._low_contention_all_gather(half, name))

    def matmuls():
        for _ in range(a.matmuls):
            torch.mm(mm_a, mm_b)

    def timed(coll, with_mm: bool) -> tuple[float, float]:
        """(collective block ms on the side stream, matmul block ms on the default stream)."""
        dist.barrier()
        torch.cuda.synchronize()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        e[0].record(main)
        if with_mm:
            matmuls()
        e[1].record(main)
        if coll is not None:
            with torch.cuda.stream(side):
                e[2].record(side)
                for _ in range(a.reps):
                    coll()
                e[3].record(side)
        torch.cuda.synchronize()
        return ((e[2].elapsed_time(e[3]) / a.reps) if coll is not None else 0.0,
                e[0].elapsed_time(e[1]) if with_mm else 0.0)

    def median_of(coll, with_mm):
        for _ in range(2):
            timed(coll, with_mm)
        runs = [timed(coll, with_mm) for _ in range(a.iters)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    results = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
               "device": torch.cuda.get_device_name(dev), "reps": a.reps, "matmuls": a.matmuls, "rows": []}
    # correctness against NCCL's result (two bf16 addends: the same sum in any order)
    ref_rs, ref_ag = nccl_rs(), nccl_ag()
    checks = {}
    for label, fn, ref in (("ce_reduce_scatter", ce_rs, ref_rs), ("torch _low_contention_reduce_scatter", torch_lc_rs,
                           ref_rs), ("torch _low_contention_all_gather", torch_lc_ag, ref_ag)):
        try:
            got = fn()
            torch.cuda.synchronize()
            checks[label] = (got - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001  (a failing collective is a result here)
            checks[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if rank == 0:
                traceback.print_exc()
    results["max_abs_diff_vs_nccl"] = checks

    _, mm_alone = median_of(None, True)
    results["matmul_block_ms_alone"] = mm_alone
    rows = [("NCCL reduce_scatter_tensor", nccl_rs), ("meshtron ce_reduce_scatter", ce_rs),
            ("torch _low_contention_reduce_scatter", torch_lc_rs),
            ("NCCL all_gather_into_tensor", nccl_ag), ("torch _low_contention_all_gather", torch_lc_ag)]
    for label, fn in rows:
        key = {"meshtron ce_reduce_scatter": "ce_reduce_scatter"}.get(label, label)
        if isinstance(checks.get(key), str):
            results["rows"].append({"collective": label, "error": checks[key]})
            continue
        try:
            alone, _ = median_of(fn, False)
            beside, mm = median_of(fn, True)
            results["rows"].append({"collective": label, "ms_alone": alone, "ms_beside_matmul": beside,
                                    "matmul_block_ms": mm, "matmul_slowdown_ms": mm - mm_alone})
        except Exception as e:  # noqa: BLE001
            results["rows"].append({"collective": label, "error": f"{type(e).__name__}: {e}"[:300]})
    if rank == 0:
        print(json.dumps(results, indent=1))
        print(f"\n{results['device']}, torch {results['torch']}, NCCL {results['nccl']}; matmul block "
              f"({a.matmuls} x 8192^3 bf16) alone {mm_alone:.2f} ms; collectives x{a.reps} back to back")
        print("| collective | ms alone | ms beside matmuls | matmul block ms | matmul slowdown ms (per reps) |")
        print("|---|---|---|---|---|")
        for r in results["rows"]:
            if "error" in r:
                print(f"| {r['collective']} | error: {r['error']} | | | |")
            else:
                print(f"| {r['collective']} | {r['ms_alone']:.3f} | {r['ms_beside_matmul']:.3f} | "
                      f"{r['matmul_block_ms']:.2f} | {r['matmul_slowdown_ms']:+.2f} |")
        print("max |diff| against NCCL:", checks)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "ce_collectives.json"), "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
