"""Sequence parallelism's two patterns, one matmul each, under every way of moving
the data: how much of the collective each hides behind its matmul.

    torchrun --nproc-per-node 2 benchmarks/bench_async_tp.py --model 1.3B --tokens 16384 --out $OUT

For each linear of one transformer layer at tp = world size (the column-parallel
ones after an all-gather of the (tokens/tp, d) input, the row-parallel ones
before a reduce-scatter of their (tokens, d) output), bf16, forward shapes:
  mm       the matmul alone (no communication): the floor
  comm     the collective alone (NCCL)
  plain    NCCL collective, then the matmul (what SP does)
  symm     torch's fused symmetric-memory op (fused_all_gather_matmul /
           fused_matmul_reduce_scatter; what inductor's micro-pipeline TP emits)
  ring     meshtron's ring decomposition on NCCL send/recv (the eager --async-tp)
hidden = 1 - (t - mm) / comm: the share of the collective's time the variant hides.
Times are the mean of --iters back-to-back calls, slowest rank, median of --rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron import models  # noqa: E402
from meshtron.distributed.async_tp import compute_scatter, gather_compute  # noqa: E402


def timed(fn, iters: int, rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor(start.elapsed_time(end) / iters, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def linears(cfg) -> list[tuple[str, str, int, int]]:
    """(name, 'col' or 'row', in features, out features) of one layer, unsplit."""
    d = cfg.dim
    if hasattr(cfg, "ffn_dim"):     # the Llama
        kv = cfg.n_kv_heads * cfg.head_dim
        return [("qkv", "col", d, d + 2 * kv), ("wo", "row", d, d), ("w1+w3", "col", d, 2 * cfg.ffn_dim),
                ("w2", "row", cfg.ffn_dim, d)]
    return [("qkv", "col", d, 3 * d), ("proj", "row", d, d), ("fc1", "col", d, cfg.ffn_mult * d),
            ("fc2", "row", cfg.ffn_mult * d, d)]


def col_variants(M: int, k: int, m: int, n: int, group) -> dict:
    """x (M/n, k) all-gathered, then x_full W^T with W (m/n, k)."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, w, full = torch.randn(M // n, k, **bf16), torch.randn(m // n, k, **bf16), torch.empty(M, k, **bf16)
    name = group.group_name
    return {
        "mm": lambda: F.linear(full, w),
        "comm": lambda: dist.all_gather_into_tensor(full, x),
        "plain": lambda: (dist.all_gather_into_tensor(full, x), F.linear(full, w)),
        "symm": lambda: torch.ops.symm_mem.fused_all_gather_matmul(x, [w.t()], 0, name),
        "ring": lambda: torch.cat(gather_compute(x, group, lambda chunk: F.linear(chunk, w))[1]),
    }


def row_variants(M: int, k: int, m: int, n: int, group) -> dict:
    """h W^T with h (M, k/n), W (m, k/n), reduce-scattered to (M/n, m)."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    h, w = torch.randn(M, k // n, **bf16), torch.randn(m, k // n, **bf16)
    y, shard, c = torch.empty(M, m, **bf16), torch.empty(M // n, m, **bf16), M // n
    name = group.group_name
    return {
        "mm": lambda: F.linear(h, w),
        "comm": lambda: dist.reduce_scatter_tensor(shard, y),
        "plain": lambda: dist.reduce_scatter_tensor(shard, F.linear(h, w)),
        "symm": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w.t(), "sum", 0, name),
        "ring": lambda: compute_scatter(lambda j: F.linear(h[j * c:(j + 1) * c], w), group),
    }


def cell(r: dict, key: str, pct: bool = False) -> str:
    v = r.get(key)
    return "-" if v is None else f"{100 * v:.0f}%" if pct else f"{v:.3f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.3B", choices=tuple(models.PRESETS))
    p.add_argument("--tokens", type=int, default=16384, help="tokens of one micro-batch (batch x sequence)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=".")
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    group = dist.group.WORLD
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enable_symm_mem_for_group(group.group_name)
    cfg = models.get(a.model)[1]
    M = a.tokens
    rows = []
    for lin, kind, k, m in linears(cfg):
        variants = (col_variants if kind == "col" else row_variants)(M, k, m, n, group)
        row = dict(linear=lin, kind=kind, tokens=M, k=k, m=m, tp=n)
        for v, fn in variants.items():
            try:
                row[v] = timed(fn, a.iters, a.rounds)
            except Exception as e:  # noqa: BLE001 - a variant that cannot run here is reported, not fatal
                row[v] = None
                row[f"{v}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for v in ("plain", "symm", "ring"):
            if row.get(v) is not None:
                row[f"{v}_hidden"] = 1 - (row[v] - row["mm"]) / row["comm"]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        with open(os.path.join(a.out, "async_tp.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(r | {"device": torch.cuda.get_device_name(), "torch": torch.__version__}) + "\n")
        print("| linear | tp | mm ms | comm ms | plain ms | symm ms | ring ms | hidden: plain / symm / ring |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            times = " | ".join(cell(r, v) for v in ("mm", "comm", "plain", "symm", "ring"))
            hidden = " / ".join(cell(r, f"{v}_hidden", True) for v in ("plain", "symm", "ring"))
            print(f"| {r['linear']} ({r['kind']}) | {r['tp']} | {times} | {hidden} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
