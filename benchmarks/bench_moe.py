"""Expert compute on one GPU: meshtron's grouped GEMM (the MoE block's experts)
against a dense GEMM of the same FLOPs, the experts module's forward+backward
against one dense MLP of the same shape over the same rows, and one MoE layer's forward+backward
against a dense SwiGLU MLP doing the same FLOPs per token, in the same run.

    python benchmarks/bench_moe.py            # bf16, llama-moe-3B's expert shapes
    python benchmarks/bench_moe.py --smoke    # tiny CPU run: the script works, no numbers

FLOPs: one projection of E experts with n tokens each is 2 * E * n * d * h; the
dense peer multiplies (E n, d) by (d, h), the same count. An MoE layer (router,
top-k of E SwiGLU experts of width h) does 6 * k * d * h FLOPs per token forward
(three projections), the dense peer a SwiGLU MLP of width k * h; backward twice
that. Times are medians over 20 repetitions of 10 calls back to back (CUDA
events), after 5 warm-ups.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from meshtron.models.common.moe import Experts, MoE, MoEConfig, grouped_mm


def median_ms(fn, reps: int = 20, warmup: int = 5, inner: int = 10) -> float:
    """Median over reps of the time of `inner` calls back to back, per call: the
    GPU's time, where the host queues calls faster than they run."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        return float("nan")
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def grouped_rows(d, h, experts, per_expert, dtype, device):
    x = torch.randn(experts * per_expert, d, dtype=dtype, device=device)
    w = torch.randn(experts, d, h, dtype=dtype, device=device) / d ** 0.5
    dense_w = torch.randn(d, h, dtype=dtype, device=device) / d ** 0.5
    counts = torch.full((experts,), per_expert, device=device)
    flops = 2 * experts * per_expert * d * h
    t_grouped = median_ms(lambda: grouped_mm(x, w, counts))
    t_dense = median_ms(lambda: x @ dense_w)
    # the same product with each expert's weight stored (N, K), as nn.Linear and torchtitan keep it
    w_nk = w.transpose(-2, -1).contiguous()
    t_nk = median_ms(lambda: grouped_mm(x, w_nk.transpose(-2, -1), counts))
    return flops, t_grouped, t_dense, t_nk


def experts_row(d, h, experts, per_expert, dtype, device):
    """The experts module (SwiGLU: w1 gate|up as one grouped GEMM, then w2) forward +
    backward against one dense MLP of the same shape over all the rows: the same
    FLOPs and elementwise work, only the grouping differs."""
    cfg = MoEConfig(n_experts=experts, hidden=h)
    grouped = Experts(d, cfg).to(device, dtype)
    w1, w2 = (torch.randn(d, 2 * h), torch.randn(h, d))
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=d ** -0.5)
    w1, w2 = ((w * d ** -0.5).to(device, dtype).requires_grad_() for w in (w1, w2))
    x = torch.randn(experts * per_expert, d, dtype=dtype, device=device, requires_grad=True)
    counts = torch.full((experts,), per_expert, device=device)
    flops = 3 * 6 * experts * per_expert * d * h          # three projections, forward and backward

    def dense():
        gate, up = (x @ w1).chunk(2, dim=-1)
        ((torch.nn.functional.silu(gate) * up) @ w2).sum().backward()
    return flops, median_ms(lambda: grouped(x, counts).sum().backward()), median_ms(dense)


def layer_row(d, h, n_experts, top_k, tokens, dtype, device):
    moe = MoE(d, MoEConfig(n_experts=n_experts, top_k=top_k, hidden=h, aux_loss=1e-2)).to(device, dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    dense = torch.nn.ModuleDict({n: torch.nn.Linear(*s, bias=False) for n, s in
                                 (("w1", (d, top_k * h)), ("w3", (d, top_k * h)), ("w2", (top_k * h, d)))})
    dense = dense.to(device, dtype)
    x = torch.randn(1, tokens, d, dtype=dtype, device=device, requires_grad=True)

    def moe_step():
        moe(x).sum().backward()

    def dense_step():
        y = dense["w2"](torch.nn.functional.silu(dense["w1"](x)) * dense["w3"](x))
        y.sum().backward()
    return 3 * 6 * top_k * d * h * tokens, median_ms(moe_step), median_ms(dense_step)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    d, h, E, k = (2048, 2048, 16, 2) if not args.smoke else (32, 16, 4, 2)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} | torch {torch.__version__} | "
          f"{dtype} | d={d} h={h}")
    print("grouped GEMM against a dense GEMM of the same FLOPs")
    print(f"{'experts':>8} {'tokens/expert':>14} {'grouped ms':>11} {'dense ms':>9} {'grouped TFLOP/s':>16} "
          f"{'grouped/dense':>14} {'(N,K) ms':>9} {'(N,K)/dense':>12}")
    for experts in ((4, 16) if not args.smoke else (2,)):       # ep=4 holds 4 of 16; ep=1 all 16
        for per_expert in ((256, 512, 1024, 2048, 4096) if not args.smoke else (8,)):
            flops, tg, td, tnk = grouped_rows(d, h, experts, per_expert, dtype, device)
            print(f"{experts:>8} {per_expert:>14} {tg:>11.3f} {td:>9.3f} {flops / tg / 1e9:>16.1f} "
                  f"{td / tg:>14.3f} {tnk:>9.3f} {td / tnk:>12.3f}")
    print("expert MLPs (SwiGLU) forward+backward against one dense MLP of the same shape over the same rows")
    print(f"{'experts':>8} {'tokens/expert':>14} {'grouped ms':>11} {'dense ms':>9} {'grouped TFLOP/s':>16} "
          f"{'grouped/dense':>14}")
    for experts in ((4, 16) if not args.smoke else (2,)):
        for per_expert in ((256, 512, 1024, 2048, 4096) if not args.smoke else (8,)):
            flops, tg, td = experts_row(d, h, experts, per_expert, dtype, device)
            print(f"{experts:>8} {per_expert:>14} {tg:>11.3f} {td:>9.3f} {flops / tg / 1e9:>16.1f} {td / tg:>14.3f}")
    print("one MoE layer (router, top-2 of 16 SwiGLU experts) forward+backward against a dense SwiGLU of width k*h")
    print(f"{'tokens':>8} {'moe ms':>8} {'dense ms':>9} {'moe TFLOP/s':>12} {'moe/dense speed':>16}")
    for tokens in ((4096, 8192, 16384) if not args.smoke else (64,)):
        flops, tm, td = layer_row(d, h, E, k, tokens, dtype, device)
        print(f"{tokens:>8} {tm:>8.3f} {td:>9.3f} {flops / tm / 1e9:>12.1f} {td / tm:>16.3f}")


if __name__ == "__main__":
    sys.exit(main())
