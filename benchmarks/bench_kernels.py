"""GB/s of meshtron's Triton LayerNorm and bias-GeLU against their peers, on one GPU.

    python benchmarks/bench_kernels.py            # the tables (RESULTS.md records them)
    python benchmarks/bench_kernels.py --sweep    # also time kernel configs per shape

Peers: ``torch.nn.functional`` eager, ``torch.compile`` of the same function, and
Liger-Kernel's LayerNorm (``LigerLayerNormFunction``; install its wheel with
--no-deps). Bytes are counted as the peers count them: forward = x read + y
written; backward = x and dy read + dx written (weights and statistics left out).
The ceiling is a device-to-device copy of 1 GiB (bytes read + written).
Backward is timed as ``torch.autograd.grad(y, inputs, dy, retain_graph=True)``
on a graph built once, so it includes every kernel the backward launches.

Two timings, both medians over CUDA events, the L2 cleared (256 MB written)
before every call so that inputs come from HBM:
- "GPU time" (the main table): before each timed call the GPU is also held in a
  ~500 µs spin kernel, so the host has queued the whole call before its start
  event runs: the time is what the GPU spends, whatever the Python overhead of
  the caller. This is the kernels' throughput, for meshtron and peers alike.
- ``triton.testing.do_bench`` (second table): the same without the spin. When a
  call's host overhead exceeds the ~70 µs the L2 clear covers, it shows up here,
  so small shapes vary from run to run with the host.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtron.kernels_triton import bias_gelu, layer_norm  # noqa: E402

ln_mod = importlib.import_module("meshtron.kernels_triton.layer_norm")
bg_mod = importlib.import_module("meshtron.kernels_triton.bias_gelu")

try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
except Exception as e:  # noqa: BLE001 - report and go on without the peer
    print(f"liger-kernel not available: {e!r}")
    LigerLayerNormFunction = None

EPS = 1e-5
DT = torch.bfloat16
_FLUSH = None


def gpu_ms(fn, reps: int = 60, spin_cycles: int = 1_000_000) -> float:
    """Median GPU time of fn() in ms: L2 cleared, host queued ahead (see module doc)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _FLUSH.zero_()
        torch.cuda._sleep(spin_cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def gbps(nbytes: int, t_ms: float) -> float:
    return nbytes / (t_ms * 1e-3) / 1e9


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(fn, ref_fn, inputs, dy):
    """Max relative norm error of fn's output and grads against ref_fn in fp64."""
    ls = [t.detach().requires_grad_() for t in inputs]
    y = fn(*ls)
    g = torch.autograd.grad(y, ls, dy)
    rs = [t.detach().double().requires_grad_() for t in inputs]
    yr = ref_fn(*rs)
    gr = torch.autograd.grad(yr, rs, dy.double())
    errs = [rel(a, r) for a, r in zip((y, *g), (yr, *gr))]
    assert all(e < 1e-2 for e in errs), errs
    return max(errs)


def _try(label, fn, nbytes, results):
    try:
        t = gpu_ms(fn, reps=30)
    except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
        print(f"  {label}: failed {type(e).__name__}: {str(e)[:80]}")
        return
    results.append((gbps(nbytes, t), label))
    print(f"  {label}: {gbps(nbytes, t):7.0f} GB/s", flush=True)


def sweep_ln(x, w, b, dy, nbytes_f, nbytes_b):
    n = x.shape[-1]
    _, mean, rstd = ln_mod.ln_fwd_rows(x, w, b, EPS)
    fwd = {1024: [(2, 4), (1, 2), (4, 4), (4, 8), (8, 8), (16, 8)],
           4096: [(2, 8)],
           8192: [(2, 8)]}[n]
    res = []
    for bm, nw in fwd:
        for even in (True, False):
            _try(f"LN fwd H={n} BLOCK_M={bm} warps={nw} unmasked={even}",
                 lambda: ln_mod.ln_fwd_rows(x, w, b, EPS, block_m=bm, num_warps=nw, even=even),
                 nbytes_f, res)
    print("  best:", max(res))
    bwd = {1024: [(2, 4, 4, True, False)],
           4096: [(1, 8, 2, True, True)],
           8192: [(1, 16, 1, True, False)]}[n]
    res = []
    for bm, nw, k, pf, ps in bwd:
        _try(f"LN bwd H={n} BLOCK_M={bm} warps={nw} per_sm={k} prefetch={pf} pair_sum={ps}",
             lambda: ln_mod.ln_bwd_rows(dy, x, w, mean, rstd, True, True, w.dtype, b.dtype,
                                        block_m=bm, num_warps=nw, per_sm=k, prefetch=pf,
                                        pair_sum=ps), nbytes_b, res)
    print("  best:", max(res))
    _try(f"LN bwd H={n} default config, main kernel alone (partials not summed)",
         lambda: ln_mod.ln_bwd_rows(dy, x, w, mean, rstd, True, True, w.dtype, b.dtype,
                                    reduce_partials=False), nbytes_b, [])


def sweep_bg(x, b, dy, nbytes_f, nbytes_b):
    res = []
    for bm, bn, nw in [(4, 1024, 4), (4, 2048, 8)]:
        _try(f"GeLU fwd BLOCK={bm}x{bn} warps={nw}",
             lambda: bg_mod.bias_gelu_fwd_rows(x, b, x.dtype, True, bm, bn, nw), nbytes_f, res)
    print("  best:", max(res))
    res = []
    for bm, bn, nw, k in [(2, 1024, 4, 8), (2, 2048, 8, 4)]:
        _try(f"GeLU bwd BLOCK={bm}x{bn} warps={nw} per_sm={k}",
             lambda: bg_mod.bias_gelu_bwd_rows(dy, x, b, True, True, bm, bn, nw, k), nbytes_b, res)
    print("  best:", max(res))


def measure(impls, inputs, dy, nf, nb):
    """{impl: (fwd GB/s, bwd GB/s)} by GPU time, and the same by do_bench."""
    gpu, dob = {}, {}
    for name, fn in impls.items():
        leaves = [t.detach().requires_grad_() for t in inputs]
        y = fn(*leaves)

        def fwd(fn=fn):
            return fn(*inputs)

        def bwd(y=y, leaves=leaves):
            return torch.autograd.grad(y, leaves, dy, retain_graph=True)
        gpu[name] = (gbps(nf, gpu_ms(fwd)), gbps(nb, gpu_ms(bwd)))
        dob[name] = (gbps(nf, bench_ms(fwd)), gbps(nb, bench_ms(bwd)))
        del y, leaves
    return gpu, dob


def table(title, rows, copy):
    print(f"\n{title}")
    hdr = (f"| {'op':9} | {'shape':11} | dir | {'meshtron':>8} | {'eager':>6} | {'compile':>7} | "
           f"{'liger':>6} | {'best peer':>9} | {'vs best':>7} | {'vs copy':>7} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for op, shape, d, r in rows:
        best = max(v for k, v in r.items() if not k.startswith("meshtron"))
        lig = f"{r['liger']:6.0f}" if "liger" in r else f"{'-':>6}"
        print(f"| {op:9} | {shape:11} | {d} | {r['meshtron']:8.0f} | {r['eager']:6.0f} | "
              f"{r['compile']:7.0f} | {lig} | {best:9.0f} | {r['meshtron'] / best:6.2f}x | "
              f"{r['meshtron'] / copy:6.0%} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time kernel configs")
    ap.add_argument("--rows", type=int, default=16384)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    vers = f"torch {torch.__version__}, triton {triton.__version__}"
    if LigerLayerNormFunction is not None:
        import importlib.metadata as md
        vers += f", liger-kernel {md.version('liger-kernel')}"
    print(f"device: {dev}; {vers}")
    src = torch.randn(2 ** 29, device="cuda", dtype=DT)   # 1 GiB
    dst = torch.empty_like(src)
    copy = gbps(2 * 2 ** 30, gpu_ms(lambda: dst.copy_(src)))
    copy_db = gbps(2 * 2 ** 30, bench_ms(lambda: dst.copy_(src)))
    del src, dst
    print(f"copy bandwidth (1 GiB, read + write): {copy:.0f} GB/s (do_bench: {copy_db:.0f})")

    m = args.rows
    gpu_rows, db_rows = [], []

    def record(op, shape, gpu, dob):
        for i, d in enumerate(("fwd", "bwd")):
            gpu_rows.append((op, shape, d, {k: v[i] for k, v in gpu.items()}))
            db_rows.append((op, shape, d, {k: v[i] for k, v in dob.items()}))
        print(gpu_rows[-2], gpu_rows[-1], flush=True)

    for n in (1024, 4096, 8192):
        x = torch.randn(m, n, device="cuda", dtype=DT)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(DT)
        b = (0.1 * torch.randn(n, device="cuda")).to(DT)
        dy = torch.randn(m, n, device="cuda", dtype=DT)
        nf, nb = 2 * x.numel() * x.element_size(), 3 * x.numel() * x.element_size()
        cp = torch.empty_like(x)
        print(f"copy of {m}x{n} bf16: {gbps(nf, gpu_ms(lambda: cp.copy_(x))):.0f} GB/s")
        del cp
        err = check(lambda x, w, b: layer_norm(x, w, b, EPS),
                    lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS), (x, w, b), dy)
        print(f"LayerNorm {m}x{n}: max rel err of y, dx, dw, db vs fp64 {err:.1e}")
        if args.sweep:
            sweep_ln(x, w, b, dy, nf, nb)

        def eager(x, w, b, n=n):
            return F.layer_norm(x, (n,), w, b, EPS)
        impls = {"meshtron": lambda x, w, b: layer_norm(x, w, b, EPS),
                 "eager": eager,
                 "compile": torch.compile(eager, dynamic=False)}
        if LigerLayerNormFunction is not None:
            impls["liger"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
        record("LayerNorm", f"{m}x{n}", *measure(impls, (x, w, b), dy, nf, nb))
        del x, dy

    n = 16384
    x = torch.randn(m, n, device="cuda", dtype=DT)
    b = torch.randn(n, device="cuda", dtype=DT)
    dy = torch.randn(m, n, device="cuda", dtype=DT)
    nf, nb = 2 * x.numel() * x.element_size(), 3 * x.numel() * x.element_size()
    err = check(bias_gelu, lambda x, b: F.gelu(x + b, approximate="tanh"), (x, b), dy)
    print(f"bias-GeLU {m}x{n}: max rel err of y, dx, db vs fp64 {err:.1e}")
    if args.sweep:
        sweep_bg(x, b, dy, nf, nb)

    def eager_bg(x, b):
        return F.gelu(x + b, approximate="tanh")
    impls = {"meshtron": bias_gelu, "eager": eager_bg,
             "compile": torch.compile(eager_bg, dynamic=False)}
    record("bias-GeLU", f"{m}x{n}", *measure(impls, (x, b), dy, nf, nb))

    print(f"\ndevice: {dev}; {vers}; bf16; copy {copy:.0f} GB/s (1 GiB)")
    table(f"do_bench medians, GB/s (copy by do_bench {copy_db:.0f})", db_rows, copy_db)
    table("GPU time (host queued ahead), GB/s", gpu_rows, copy)


if __name__ == "__main__":
    main()
