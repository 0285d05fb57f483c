"""Context-parallel attention on GPUs (issue 14): causal, grouped-query, bf16,
forward + backward, each cp variant against the ideal (one GPU's flash
attention of the whole sequence, divided by cp) and against torch's
experimental `context_parallel` on the same shapes.

    torchrun --nproc-per-node 4 benchmarks/bench_cp.py --out $OUT   # cp = 4: p2p, allgather, a2a, torch's
    python benchmarks/bench_cp.py --simulate 4 --out $OUT           # one GPU: each cp rank's ring blocks in turn
    python benchmarks/bench_cp.py --simulate 2 --seq 64 --smoke     # the CPU: the script runs, no timings

Counting first: causal attention of S tokens, H query heads of d is 2 S^2 H d
FLOPs forward (half of the full 4 S^2 H d) and 2.5x that backward. At S = 32K,
32 heads of 64 that is 4.4 TFLOP forward, ~10 ms at 450 TFLOP/s, and 34 ms
forward + backward; a cp = 4 rank computes a quarter. The ring sends (cp-1)/cp
of 2 S n_kv_heads d bf16 elements per rank forward (8 KV heads: 50 MB at 32K,
~0.14 ms at 370 GB/s, against ~2.5 ms of its forward), and in backward K/V
again plus dK/dV in fp32 (3x those bytes): hidden when overlapped.

`--simulate` runs every cp rank's blocks on one GPU through meshtron's own
block computation (`blockwise_forward`, `blockwise_backward`: the ring's blocks
or the all-gather variant's), dK/dV added straight to their owner instead of
sent: the time per rank is what the variant computes without its transfers,
an upper bound on its efficiency; its outputs and gradients are checked
against a float32 reference beside the one-GPU bf16 kernel's.

Times are medians over --reps of forward + backward, each between two device
synchronizations (and a barrier), after warm-up; every rank's time is the
slowest rank's (an all-reduce of the max).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron.distributed import block_attention as ba  # noqa: E402
from meshtron.distributed import context_parallel as cpm  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device, reps: int, warmup: int = 2) -> float:
    """Median ms of fn() over reps, the slowest rank's where a process group runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        t = torch.tensor((time.perf_counter() - t0) * 1e3, device=device)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def inputs(seq: int, heads: int, kv_heads: int, dim: int, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, heads, seq, dim, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, seq, dim, generator=g, device=device, dtype=dtype) for _ in range(2))
    dout = torch.randn(1, heads, seq, dim, generator=g, device=device, dtype=dtype)
    return q, k, v, dout


def whole(q, k, v, dout):
    """One GPU's causal attention of the whole sequence: (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ba.attention(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def simulate(q, k, v, dout, cp: int, variant: str):
    """Every cp rank's blocks (the ring's, or the all-gather variant's over the whole
    K/V) on this one device, rank after rank: (out, dq, dk, dv in sequence order,
    per-rank forward ms, per-rank backward ms)."""
    T, device = q.shape[2], q.device
    c = T // (2 * cp)
    pos = [cpm.local_positions(T, cp, r, device) for r in range(cp)]
    order = torch.cat(pos).argsort()
    qs, ds = ([t[:, :, p].contiguous() for p in pos] for t in (q, dout))
    if variant == "p2p":   # K/V of rank j: its own chunks; dK/dV straight to their owner
        kv = [(k[:, :, p].contiguous(), v[:, :, p].contiguous()) for p in pos]
    else:                  # the whole K/V, as the all-gather leaves it on every rank
        kv = [(k, v)]
    dkv = [[torch.zeros(t.shape, dtype=torch.float32, device=device) for t in pair] for pair in kv]

    def add_dkv(owner, keys, g_k, g_v):
        dkv[owner][0][:, :, keys] += g_k
        dkv[owner][1][:, :, keys] += g_v

    outs, dqs, fwd, bwd = [], [], [], []
    for r in range(cp):
        steps = cpm.ring_steps(r, cp, c) if variant == "p2p" else cpm.prefix_steps(r, cp, c)
        blocks = [kv[j] for j, *_ in steps]
        _sync(device)
        t0 = time.perf_counter()
        out, lse = ba.blockwise_forward(qs[r], steps, blocks)
        _sync(device)
        t1 = time.perf_counter()
        dq = ba.blockwise_backward(ds[r], qs[r], out, lse, steps, blocks, add_dkv)
        _sync(device)
        fwd.append((t1 - t0) * 1e3)
        bwd.append((time.perf_counter() - t1) * 1e3)
        outs.append(out)
        dqs.append(dq)

    def natural(parts):
        return torch.cat(parts, dim=2)[:, :, order]
    dk, dv = (natural([pair[i] for pair in dkv]) if variant == "p2p" else dkv[0][i] for i in (0, 1))
    return natural(outs), natural(dqs), dk, dv, fwd, bwd


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def run_simulated(args, device, dtype, out_rows):
    for seq in args.seq:
        q, k, v, dout = inputs(seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
        t_whole = timed_ms(functools.partial(whole, q, k, v, dout), device, args.reps)
        ideal = t_whole / args.simulate
        ref = whole(*(t.float() for t in (q, k, v)), dout.float()) if seq <= args.check_max_seq else None
        for variant in [v for v in args.variants if v in ("p2p", "allgather")]:
            simulate(q, k, v, dout, args.simulate, variant)   # warm-up: the kernels' first calls
            sims = [simulate(q, k, v, dout, args.simulate, variant) for _ in range(max(1, args.reps // 2))]
            fwd = [statistics.median(s[4][r] for s in sims) for r in range(args.simulate)]
            bwd = [statistics.median(s[5][r] for s in sims) for r in range(args.simulate)]
            per_rank = [f + b for f, b in zip(fwd, bwd)]
            row = dict(mode="simulate", variant=variant, cp=args.simulate, seq=seq, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, whole_ms=t_whole, ideal_ms=ideal,
                       rank_fwd_ms=fwd, rank_bwd_ms=bwd, compute_of_ideal=ideal / max(per_rank),
                       balance=max(per_rank) / statistics.mean(per_rank))
            if ref is not None:   # errors against float32: the blocks' and one GPU's, in the same dtype
                one = whole(q, k, v, dout)
                for name, a, b, r in zip(("out", "dq", "dk", "dv"), sims[0][:4], one, ref):
                    row[f"err_{name}"], row[f"err_{name}_one_gpu"] = rel_err(a, r), rel_err(b, r)
            out_rows.append(row)
            print(json.dumps(row), flush=True)


def torch_peer_ms(q, k, v, dout, mesh, device, reps: int) -> float:
    """torch.distributed.tensor.experimental.context_parallel on the same shapes: its
    load-balanced causal attention on the cp mesh, SDPA inside its context. The
    buffers are sharded once, outside the timed steps (as meshtron's inputs are);
    K/V at the query heads (its ring handlers take the kernels' equal-head form)."""
    from torch.distributed.tensor.experimental import context_parallel
    heads = q.shape[1]
    buffers = [t.detach().clone() for t in (q, ba._expand(k, heads), ba._expand(v, heads), dout)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)):
        lq, lk, lv, ld = buffers   # this rank's shards now

        def step():
            a, b, c = (t.detach().requires_grad_() for t in (lq, lk, lv))
            F.scaled_dot_product_attention(a, b, c, is_causal=True).backward(ld)
        return timed_ms(step, device, reps)


def run_distributed(args, device, dtype, out_rows):
    from meshtron.distributed.mesh import init_mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_mesh(cp=world, device_type=device.type)
    group = mesh["cp"].get_group()
    attend = {"p2p": lambda q, k, v: cpm.ring_attention(q, k, v, group),
              "allgather": lambda q, k, v: cpm.allgather_attention(q, k, v, group),
              "a2a": lambda q, k, v: cpm.a2a_attention(q, k, v, group)}
    for seq in args.seq:
        q, k, v, dout = inputs(seq, args.heads, args.kv_heads, args.head_dim, dtype, device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        row = dict(mode="distributed", cp=world, seq=seq, heads=args.heads, kv_heads=args.kv_heads,
                   head_dim=args.head_dim, device=name)
        if device.type == "cuda" and not args.no_whole:   # one GPU's whole sequence, on every rank at once
            row["whole_ms"] = timed_ms(functools.partial(whole, q, k, v, dout), device, args.reps)
            row["ideal_ms"] = row["whole_ms"] / world
        local = [cpm.shard_sequence(t.transpose(1, 2), mesh).transpose(1, 2).contiguous() for t in (q, k, v, dout)]
        for variant in args.variants:
            if variant == "a2a" and args.kv_heads % world:
                row[f"{variant}_ms"] = None
                continue

            def step(fn=attend[variant], local=local):
                lq, lk, lv = (t.detach().requires_grad_() for t in local[:3])
                fn(lq, lk, lv).backward(local[3])
            row[f"{variant}_ms"] = timed_ms(step, device, args.reps)
            if "ideal_ms" in row:
                row[f"{variant}_of_ideal"] = row["ideal_ms"] / row[f"{variant}_ms"]
        if device.type == "cuda" and not args.no_peer:
            from torch.distributed.tensor.experimental._attention import set_rotate_method
            for method in ("allgather", "alltoall"):   # its K/V all-gathered, or passed round (its ring)
                try:
                    set_rotate_method(method)
                    row[f"torch_cp_{method}_ms"] = torch_peer_ms(q, k, v, dout, mesh["cp"], device, args.reps)
                    row[f"p2p_vs_torch_cp_{method}"] = row[f"torch_cp_{method}_ms"] / row["p2p_ms"]
                except Exception as e:  # noqa: BLE001 - the peer's failure is a result too
                    row[f"torch_cp_{method}_error"] = f"{type(e).__name__}: {e}"[:300]
        if rank == 0:
            out_rows.append(row)
            print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=lambda s: [int(x) for x in s.split(",")], default=[32768, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(cpm.VARIANTS))
    ap.add_argument("--simulate", type=int, default=0, help="cp ranks simulated on one device (0: torchrun's world)")
    ap.add_argument("--check-max-seq", type=int, default=32768, help="longest sequence checked against float32")
    ap.add_argument("--no-peer", action="store_true", help="leave torch's context_parallel out")
    ap.add_argument("--no-whole", action="store_true", help="leave the one-GPU whole-sequence time out")
    ap.add_argument("--smoke", action="store_true", help="the CPU: float32, whatever the device")
    ap.add_argument("--out", default=None, help="folder for results.jsonl")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dtype = torch.bfloat16 if cuda else torch.float32
    distributed = "RANK" in os.environ
    if distributed:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = []
    if args.simulate:
        run_simulated(args, device, dtype, rows)
    else:
        run_distributed(args, device, dtype, rows)
    if args.out and (not distributed or dist.get_rank() == 0):
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, bench="bench_cp", torch=torch.__version__)) + "\n")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
