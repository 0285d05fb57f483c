"""The output head + cross-entropy of one micro-batch, forward and backward: the
plain path (F.linear, then F.cross_entropy on the fp32 logits; eager, and the two
under one torch.compile) against the fused one (meshtron.distributed.fused_loss:
chunks of tokens, eager, and with its per-chunk softmax compiled as the trainer
runs it on a GPU). Llama-1B's shapes by default: 16 x 2048 tokens, dim 2048,
vocabulary 128,256, bf16.

    python benchmarks/bench_fused_loss.py --out $OUT

Time: median of --iters fwd+bwd, each between two CUDA events, after --warmup
(compilation happens there). Memory: torch.cuda.max_memory_allocated during one
fwd+bwd, less what the inputs and their gradients hold before it. Each variant's
loss and gradients are compared with the plain eager one's (norm-relative); each
line gives the ratio to the plain eager and the plain compiled times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron.distributed.fused_loss import fused_linear_cross_entropy_sum  # noqa: E402


def plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float().flatten(0, 1), y.flatten(), reduction="sum", ignore_index=-100)


def variants(chunks: list[int]):
    out = {"plain_eager": plain, "plain_compile": torch.compile(plain)}
    for c in chunks:
        tag = f"c{c}" if c else "default"   # 0: the default chunk
        out[f"fused_eager_{tag}"] = lambda h, w, y, c=c: fused_linear_cross_entropy_sum(h, w, y, -100, c or None)
        out[f"fused_compiled_{tag}"] = lambda h, w, y, c=c: fused_linear_cross_entropy_sum(h, w, y, -100, c or None,
                                                                                              True)
    return out


def run_once(fn, h, w, y):
    h.grad = w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return loss


def measure(name, fn, h, w, y, args, ref):
    try:
        for _ in range(args.warmup):
            run_once(fn, h, w, y)
        torch.cuda.synchronize()
        h.grad = w.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = run_once(fn, h, w, y)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        times = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run_once(fn, h, w, y)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return dict(name=name, error=f"OOM: {str(e)[:200]}")
    res = dict(name=name, ms=statistics.median(times), ms_all=[round(t, 2) for t in times], peak_gib=peak,
               loss=float(loss))
    if ref is not None:
        res["loss_rel"] = abs(float(loss) - ref["loss"]) / abs(ref["loss"])
        res["dh_rel"] = float((h.grad.float() - ref["dh"]).norm() / ref["dh"].norm())
        res["dw_rel"] = float((w.grad.float() - ref["dw"]).norm() / ref["dw"].norm())
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunks", default="0", help="comma list of tokens per chunk (0: the default)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    h = torch.randn(args.batch, args.seq, args.dim, device=dev, dtype=dt).requires_grad_()
    w = (torch.randn(args.vocab, args.dim, device=dev, dtype=dt) * 0.02).requires_grad_()
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    y[0, : args.seq // 4] = -100
    ref, results = None, []
    for name, fn in variants([int(c) for c in args.chunks.split(",")]).items():
        r = measure(name, fn, h, w, y, args, ref)
        if name == "plain_eager" and "error" not in r:
            ref = dict(loss=r["loss"], dh=h.grad.float().clone(), dw=w.grad.float().clone())
        results.append(r)
        print(json.dumps(r), flush=True)
    base = {r["name"]: r["ms"] for r in results if "ms" in r}
    for r in results:
        if "ms" in r:
            ratios = " ".join(f"{r['ms'] / base[k]:.3f}x {k}" for k in ("plain_eager", "plain_compile") if k in base)
            print(f"{r['name']:24s} {r['ms']:8.2f} ms  peak {r['peak_gib']:6.2f} GiB  ({ratios})")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=vars(args))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fused_loss.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
