"""Expert compute on one GPU: meshtron's grouped GEMM (the MoE block's experts)
against a dense GEMM of the same FLOPs, the experts module's forward+backward
against one dense MLP of the same shape over the same rows, and one MoE layer's forward+backward
against a dense SwiGLU MLP doing the same FLOPs per token, in the same run.

    python benchmarks/bench_moe.py            # bf16, llama-moe-3B's expert shapes
    python benchmarks/bench_moe.py --smoke    # tiny CPU run: the script works, no numbers
    python benchmarks/bench_moe.py --balanced-routing   # the MoE layer's tokens assigned round-robin
    python benchmarks/bench_moe.py --batch-balance      # only the cost of batch balancing (batch_bias)

The MoE layer rows print the routing's load balance beside the time (the busiest
expert's copies / the mean): the layer's speed depends on it (one expert with
most tokens makes one large GEMM and idles the rest). Its input is random, which
the router spreads evenly-ish; --balanced-routing gives every expert exactly
k N / E copies, for speed comparisons at load max/mean 1.

--batch-balance times batch_bias (the rounds of batch balancing, 4 of them) alone,
eager and compiled, and one MoE layer's forward+backward with it against the
same layer without it (its peer): what the evened loads cost in time.

FLOPs: one projection of E experts with n tokens each is 2 * E * n * d * h; the
dense peer multiplies (E n, d) by (d, h), the same count. An MoE layer (router,
top-k of E SwiGLU experts of width h) does 6 * k * d * h FLOPs per token forward
(three projections), the dense peer a SwiGLU MLP of width k * h; backward twice
that. Times (`timings`): the wall time of calls back to back, and the GPU's
kernel time per call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from meshtron.models.common.experts import Experts, grouped_mm
from meshtron.models.common.moe import MoE, MoEConfig
from meshtron.models.common.moe_balance import batch_bias


def timings(fn, reps: int = 20, warmup: int = 5, inner: int = 10) -> tuple[float, float]:
    """(wall, GPU) ms per call. Wall: the median over reps of `inner` calls back to
    back between CUDA events, which includes the GPU's idle gaps where the host
    launches slower than the kernels run (small groups); GPU: the kernels' own time
    per call (the profiler's), what a step pays when the host runs ahead, as it
    does in training."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        return float("nan"), float("nan")
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / inner)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()
    kernels = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return statistics.median(times), kernels / 1e3 / inner


def grouped_rows(d, h, experts, per_expert, dtype, device):
    """One projection of width h (w2's) and 2h (the fused gate|up w1) against a
    dense GEMM of the same FLOPs: {width: (flops, grouped (wall, gpu), dense (wall, gpu))}."""
    x = torch.randn(experts * per_expert, d, dtype=dtype, device=device)
    counts = torch.full((experts,), per_expert, device=device)
    rows = {}
    for width in (h, 2 * h):
        w = torch.randn(experts, d, width, dtype=dtype, device=device) / d ** 0.5
        dense_w = torch.randn(d, width, dtype=dtype, device=device) / d ** 0.5
        rows[width] = (2 * experts * per_expert * d * width, timings(lambda w=w: grouped_mm(x, w, counts)),
                       timings(lambda w=dense_w: x @ w))
    return rows


def experts_row(d, h, experts, per_expert, dtype, device):
    """The experts module (SwiGLU: w1 gate|up as one grouped GEMM, then w2) forward +
    backward against one dense MLP of the same shape over all the rows: the same
    FLOPs and elementwise work, only the grouping differs."""
    grouped = Experts(d, MoEConfig(n_experts=experts, hidden=h)).to(device, dtype)
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=d ** -0.5)
    w1, w2 = ((torch.randn(*shape) * d ** -0.5).to(device, dtype).requires_grad_() for shape in ((d, 2 * h), (h, d)))
    x = torch.randn(experts * per_expert, d, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(experts * per_expert, d, dtype=dtype, device=device)
    counts = torch.full((experts,), per_expert, device=device)
    flops = 3 * 6 * experts * per_expert * d * h          # three projections, forward and backward

    def dense():   # autograd.grad: nothing accumulates into .grad (the grouped weights are E times larger)
        gate, up = (x @ w1).chunk(2, dim=-1)
        torch.autograd.grad((torch.nn.functional.silu(gate) * up) @ w2, (x, w1, w2), dy)

    def experts():
        torch.autograd.grad(grouped(x, counts), (x, *grouped.parameters()), dy)
    return flops, timings(experts), timings(dense)


def layer_row(d, h, n_experts, top_k, tokens, dtype, device, balanced=False):
    moe = MoE(d, MoEConfig(n_experts=n_experts, top_k=top_k, hidden=h, balanced=balanced)).to(device, dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    dense = torch.nn.ModuleDict({n: torch.nn.Linear(*s, bias=False) for n, s in
                                 (("w1", (d, top_k * h)), ("w3", (d, top_k * h)), ("w2", (top_k * h, d)))})
    dense = dense.to(device, dtype)
    x = torch.randn(1, tokens, d, dtype=dtype, device=device, requires_grad=True)

    dy = torch.randn_like(x)

    def moe_step():   # autograd.grad: no accumulation into the (E times larger) .grad
        torch.autograd.grad(moe(x), (x, *moe.parameters()), dy)

    def dense_step():
        y = dense["w2"](torch.nn.functional.silu(dense["w1"](x)) * dense["w3"](x))
        torch.autograd.grad(y, (x, *dense.parameters()), dy)
    times = timings(moe_step), timings(dense_step)
    load = moe.tokens_per_expert.max() / moe.tokens_per_expert.mean()   # summed over every call: the same routing
    return 3 * 6 * top_k * d * h * tokens, *times, float(load)


def balance_rows(d, h, n_experts, top_k, dtype, device, smoke):
    """batch_bias alone (eager, compiled) and an MoE layer with and without it."""
    print("batch_bias, 4 rounds, alone: ms wall / GPU per call (eager, torch.compile)")
    shapes = ((8192, 16), (16384, 16), (32768, 64)) if not smoke else ((64, 4),)
    compiled = torch.compile(batch_bias) if device == "cuda" else batch_bias
    for n, e in shapes:
        select = torch.randn(n, e, device=device) + torch.randn(e, device=device)   # a common part: unbalanced
        t_eager, t_comp = (timings(lambda f=f, s=select: f(s, top_k, 4)) for f in (batch_bias, compiled))
        print(f"{n:>8} tokens {e:>4} experts   eager {t_eager[0]:.3f} / {t_eager[1]:.3f}   "
              f"compiled {t_comp[0]:.3f} / {t_comp[1]:.3f}")
    print("one MoE layer forward+backward (training): batch_balance 4 against 0, ms wall / GPU")
    for tokens in ((8192, 16384) if not smoke else (64,)):
        x = torch.randn(1, tokens, d, dtype=dtype, device=device, requires_grad=True)
        dy = torch.randn_like(x)
        row = []
        for rounds in (4, 0):
            torch.manual_seed(0)
            moe = MoE(d, MoEConfig(n_experts=n_experts, top_k=top_k, hidden=h, batch_balance=rounds)).to(device, dtype)
            for p in moe.parameters():
                torch.nn.init.normal_(p, std=0.02)
            row.append(timings(lambda m=moe, x=x, dy=dy: torch.autograd.grad(m(x), (x, *m.parameters()), dy)))
            row.append(float(moe.tokens_per_expert.max() / moe.tokens_per_expert.mean()))
        (on, load_on, off, load_off) = row
        print(f"{tokens:>8} tokens   balanced {on[0]:.3f} / {on[1]:.3f} (load {load_on:.2f})   "
              f"router's own {off[0]:.3f} / {off[1]:.3f} (load {load_off:.2f})   "
              f"ratio wall {on[0] / off[0]:.3f} GPU {on[1] / off[1]:.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--balanced-routing", action="store_true",
                    help="the MoE layer assigns experts round-robin (load max/mean 1), not by its router")
    ap.add_argument("--batch-balance", action="store_true", help="only the cost of batch balancing")
    ap.add_argument("--out", default=None, help="also write the experts' and the layer's rows to OUT/moe.jsonl")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    d, h, E, k = (2048, 2048, 16, 2) if not args.smoke else (32, 16, 4, 2)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} | torch {torch.__version__} | "
          f"{dtype} | d={d} h={h}")
    if args.batch_balance:
        return balance_rows(d, h, E, k, dtype, device, args.smoke)
    head = (f"{'ms wall / GPU':>16} {'dense':>16} {'TFLOP/s GPU':>12} {'/dense wall':>12} {'/dense GPU':>11}")

    def cols(flops, t, td):
        return (f"{t[0]:>7.3f} / {t[1]:>6.3f} {td[0]:>7.3f} / {td[1]:>6.3f} {flops / t[1] / 1e9:>12.1f} "
                f"{td[0] / t[0]:>12.3f} {td[1] / t[1]:>11.3f}")
    sizes = [(e, n) for e in ((4, 16) if not args.smoke else (2,))      # ep=4 holds 4 of 16; ep=1 all 16
             for n in ((256, 512, 1024, 2048, 4096) if not args.smoke else (8,))]
    print("one projection (grouped GEMM) against a dense GEMM of the same FLOPs")
    print(f"{'experts':>8} {'tokens/expert':>14} {'width':>6} " + head)
    for experts, per_expert in sizes:
        for width, (flops, t, td) in grouped_rows(d, h, experts, per_expert, dtype, device).items():
            print(f"{experts:>8} {per_expert:>14} {width:>6} " + cols(flops, t, td))
    print("expert MLPs (SwiGLU) forward+backward against one dense MLP of the same shape over the same rows")
    print(f"{'experts':>8} {'tokens/expert':>14} " + head)
    rows = []   # the dense GPU time over the experts' (or the layer's): `python -m benchmarks run moe-experts`
    for experts, per_expert in sizes:
        flops, t, td = experts_row(d, h, experts, per_expert, dtype, device)
        print(f"{experts:>8} {per_expert:>14} " + cols(flops, t, td))
        rows.append(dict(kind="experts", experts=experts, tokens=per_expert, dense_over_moe_gpu=td[1] / t[1]))
    routing = "round-robin (--balanced-routing)" if args.balanced_routing else "its router, random input"
    print(f"one MoE layer (router, top-2 of 16 SwiGLU experts; experts by {routing}) forward+backward against "
          "a dense SwiGLU of width k*h")
    print(f"{'tokens':>8} " + head + f" {'load max/mean':>14}")
    for tokens in ((4096, 8192, 16384) if not args.smoke else (64,)):
        flops, t, td, load = layer_row(d, h, E, k, tokens, dtype, device, args.balanced_routing)
        print(f"{tokens:>8} " + cols(flops, t, td) + f" {load:>14.2f}")
        rows.append(dict(kind="layer", experts=E, tokens=tokens, dense_over_moe_gpu=td[1] / t[1], load=load))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

if __name__ == "__main__":
    sys.exit(main())
