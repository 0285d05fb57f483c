"""GB/s of meshtron's Triton kernels against their peers, on one GPU: LayerNorm and
bias-GeLU (GPT), RMSNorm and SwiGLU (Llama).

    python benchmarks/bench_kernels.py                          # the tables (RESULTS.md, "Kernels")
    python benchmarks/bench_kernels.py --sweep                  # also time kernel configs per shape
    python benchmarks/bench_kernels.py --only rms_norm,swiglu   # some ops only
    python benchmarks/bench_kernels.py --smoke                  # tiny CPU run: the script works, no numbers

Peers: ``torch.nn.functional`` eager, ``torch.compile`` of the same function, and
Liger-Kernel (``LigerLayerNormFunction``, ``LigerRMSNormFunction``,
``LigerSiLUMulFunction``; install its wheel with --no-deps; a missing one skips
its column). Bytes are counted as the peers count them, the tensors each op must
read and write (weights and statistics left out):
- LayerNorm, RMSNorm: forward x read + y written; backward x and dy read + dx written.
- bias-GeLU: as LayerNorm.
- SwiGLU: forward gate and up read + y written; backward dy, gate and up read +
  dgate and dup written.
"fwd+bwd" (RMSNorm and SwiGLU) is a forward with autograd recording then the
backward, timed as one call: the bytes of both.
The ceiling is a device-to-device copy of 1 GiB (bytes read + written).
Backward is timed as ``torch.autograd.grad(y, inputs, dy, retain_graph=True)``
on a graph built once, so it includes every kernel the backward launches.

RMSNorm and SwiGLU run at Llama shapes, bf16: rows = 16 x 2048 tokens
(``--llama-rows``), RMSNorm over hidden 2048 (Llama-1B) and 4096 (Llama-8B),
SwiGLU over 8192 (1B) and 14336 (8B). Each peer gets its own copies of the
inputs and dy, since Liger's backwards write in place (RMSNorm's dx into dy,
SwiGLU's gradients into the saved gate and up): timings are unaffected.

Two timings, both medians over CUDA events, the L2 cleared (256 MB written)
before every call so that inputs come from HBM:
- "GPU time" (the main table): before each timed call the GPU is also held in a
  ~500 µs spin kernel, so the host has queued the whole call before its start
  event runs: the time is what the GPU spends, whatever the Python overhead of
  the caller. This is the kernels' throughput, for meshtron and peers alike.
- ``triton.testing.do_bench`` (second table): the same without the spin. When a
  call's host overhead exceeds the ~70 µs the L2 clear covers, it shows up here,
  so small shapes vary from run to run with the host.
"vs best" is meshtron's GB/s over the best peer's in the same run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtron.kernels_triton import bias_gelu, layer_norm, rms_norm, swiglu  # noqa: E402

ln_mod = importlib.import_module("meshtron.kernels_triton.layer_norm")
bg_mod = importlib.import_module("meshtron.kernels_triton.bias_gelu")
rms_mod = importlib.import_module("meshtron.kernels_triton.rms_norm")
sw_mod = importlib.import_module("meshtron.kernels_triton.swiglu")

OPS = ("layer_norm", "bias_gelu", "rms_norm", "swiglu")
LLAMA = (("1B", 2048, 8192), ("8B", 4096, 14336))   # (model, hidden, ffn hidden)
EPS = 1e-5
RMS_EPS = 1e-5          # Llama 3's norm_eps
DT = torch.bfloat16
DEV = "cuda"
SMOKE = False           # --smoke: CPU tensors, wall-clock medians
IMPL = "auto"           # meshtron's impl=: "triton" for a smoke run under TRITON_INTERPRET=1
_FLUSH = None


def liger(module: str, name: str):
    """A Liger-Kernel autograd Function, imported when first needed; None (and a note) without it."""
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), name)
    except Exception as e:  # noqa: BLE001 - report and go on without the peer
        print(f"liger-kernel {name} not available, its column is skipped: {e!r}")
        return None


def wall_ms(fn, reps: int = 2) -> float:
    """--smoke: median wall time of fn() in ms (CPU; no numbers worth keeping)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def gpu_ms(fn, reps: int = 60, spin_cycles: int = 1_000_000) -> float:
    """Median GPU time of fn() in ms: L2 cleared, host queued ahead (see module doc)."""
    global _FLUSH
    if SMOKE:
        return wall_ms(fn)
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
    if SMOKE:
        return wall_ms(fn)
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def gbps(nbytes: int, t_ms: float) -> float:
    return nbytes / (t_ms * 1e-3) / 1e9


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(fn, ref_fn, inputs, dy):
    """Max relative norm error of fn's output and grads against ref_fn in fp64."""
    ls = [t.detach().clone().requires_grad_() for t in inputs]   # copies: fn may write in place
    y = fn(*ls)
    g = torch.autograd.grad(y, ls, dy.clone())
    rs = [t.detach().double().requires_grad_() for t in inputs]
    yr = ref_fn(*rs)
    gr = torch.autograd.grad(yr, rs, dy.double())
    errs = [rel(a, r) for a, r in zip((y, *g), (yr, *gr))]
    # (a smoke run without the interpreter checks PyTorch's CPU path, whose bf16 LayerNorm
    # weight gradients land just above 1e-2 at 64 rows)
    assert all(e < (3e-2 if SMOKE and IMPL != "triton" else 1e-2) for e in errs), errs
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
                 lambda bm=bm, nw=nw, even=even: ln_mod.ln_fwd_rows(x, w, b, EPS, block_m=bm, num_warps=nw,
                                                                    even=even),
                 nbytes_f, res)
    print("  best:", max(res))
    bwd = {1024: [(2, 4, 4, True, False)],
           4096: [(1, 8, 2, True, True)],
           8192: [(1, 16, 1, True, False)]}[n]
    res = []
    for bm, nw, k, pf, ps in bwd:
        _try(f"LN bwd H={n} BLOCK_M={bm} warps={nw} per_sm={k} prefetch={pf} pair_sum={ps}",
             lambda bm=bm, nw=nw, k=k, pf=pf, ps=ps: ln_mod.ln_bwd_rows(
                 dy, x, w, mean, rstd, True, True, w.dtype, b.dtype, block_m=bm, num_warps=nw, per_sm=k,
                 prefetch=pf, pair_sum=ps), nbytes_b, res)
    print("  best:", max(res))
    _try(f"LN bwd H={n} default config, main kernel alone (partials not summed)",
         lambda: ln_mod.ln_bwd_rows(dy, x, w, mean, rstd, True, True, w.dtype, b.dtype,
                                    reduce_partials=False), nbytes_b, [])


def sweep_bg(x, b, dy, nbytes_f, nbytes_b):
    res = []
    for bm, bn, nw in [(4, 1024, 4), (4, 2048, 8)]:
        _try(f"GeLU fwd BLOCK={bm}x{bn} warps={nw}",
             lambda bm=bm, bn=bn, nw=nw: bg_mod.bias_gelu_fwd_rows(x, b, x.dtype, True, bm, bn, nw), nbytes_f, res)
    print("  best:", max(res))
    res = []
    for bm, bn, nw, k in [(2, 1024, 4, 8), (2, 2048, 8, 4)]:
        _try(f"GeLU bwd BLOCK={bm}x{bn} warps={nw} per_sm={k}",
             lambda bm=bm, bn=bn, nw=nw, k=k: bg_mod.bias_gelu_bwd_rows(dy, x, b, True, True, bm, bn, nw, k),
             nbytes_b, res)
    print("  best:", max(res))


def sweep_rms(x, w, dy, nbytes_f, nbytes_b):
    """RMSNorm's configs came from LayerNorm's sweep: time the neighbours at Llama widths."""
    n = x.shape[-1]
    _, rstd = rms_mod.rms_fwd_rows(x, w, RMS_EPS)
    print(f"  defaults: fwd {rms_mod.fwd_config(n)}, bwd {rms_mod.bwd_config(n)}")
    res = []
    for bm, nw in [(1, 4), (2, 4), (2, 8), (4, 8), (1, 8), (1, 16), (2, 16)]:
        for even in (True, False):
            _try(f"RMS fwd H={n} BLOCK_M={bm} warps={nw} unmasked={even}",
                 lambda bm=bm, nw=nw, even=even: rms_mod.rms_fwd_rows(x, w, RMS_EPS, block_m=bm, num_warps=nw,
                                                                      even=even),
                 nbytes_f, res)
    print("  best:", max(res))
    res = []
    for bm, nw, k, pf in [(1, 4, 4, True), (1, 8, 2, True), (2, 8, 2, True), (1, 8, 4, True),
                          (1, 16, 1, True), (1, 16, 2, True), (1, 8, 2, False), (2, 4, 4, True)]:
        _try(f"RMS bwd H={n} BLOCK_M={bm} warps={nw} per_sm={k} prefetch={pf}",
             lambda bm=bm, nw=nw, k=k, pf=pf: rms_mod.rms_bwd_rows(dy, x, w, rstd, True, block_m=bm,
                                                                   num_warps=nw, per_sm=k, prefetch=pf),
             nbytes_b, res)
    print("  best:", max(res))
    _try(f"RMS bwd H={n} default config, main kernel alone (partials not summed)",
         lambda: rms_mod.rms_bwd_rows(dy, x, w, rstd, True, reduce_partials=False), nbytes_b, [])


def sweep_sw(g, u, dy, nbytes_f, nbytes_b):
    print(f"  defaults: fwd {sw_mod.fwd_config(g.numel())}, bwd {sw_mod.bwd_config(g.numel())}")
    configs = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
    for d, nbytes in (("fwd", nbytes_f), ("bwd", nbytes_b)):
        res = []
        for bl, nw in configs:
            if d == "fwd":
                fn = lambda bl=bl, nw=nw: sw_mod.swiglu_fwd_flat(g, u, g.dtype, block=bl, num_warps=nw)
            else:
                fn = lambda bl=bl, nw=nw: sw_mod.swiglu_bwd_flat(dy, g, u, block=bl, num_warps=nw)
            _try(f"SwiGLU {d} N={g.shape[-1]} BLOCK={bl} warps={nw}", fn, nbytes, res)
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


def measure3(impls, inputs, dy, nf, nb):
    """{impl: (fwd, bwd, fwd+bwd) GB/s} by GPU time, and the same by do_bench.

    Every impl gets its own copies of the inputs and dy (Liger writes into them in
    its backward). The forward runs without autograd recording, as ``measure``'s
    does with inputs that need no grad.
    """
    gpu, dob = {}, {}
    for name, fn in impls.items():
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        dy_own = dy.clone()
        y = fn(*leaves)

        def fwd(fn=fn, leaves=leaves):
            with torch.no_grad():
                return fn(*leaves)

        def bwd(y=y, leaves=leaves, dy_own=dy_own):
            return torch.autograd.grad(y, leaves, dy_own, retain_graph=True)

        def fwd_bwd(fn=fn, leaves=leaves, dy_own=dy_own):
            return torch.autograd.grad(fn(*leaves), leaves, dy_own)
        fns = ((fwd, nf), (bwd, nb), (fwd_bwd, nf + nb))
        gpu[name] = tuple(gbps(n, gpu_ms(f)) for f, n in fns)
        dob[name] = tuple(gbps(n, bench_ms(f)) for f, n in fns)
        print(f"  {name}: GPU time {', '.join(f'{v:.0f}' for v in gpu[name])} GB/s (fwd, bwd, fwd+bwd)",
              flush=True)
        del y, leaves, dy_own
    return gpu, dob


PEERS = ("eager", "compile", "liger")


def table(title, rows, copy):
    print(f"\n{title}")
    w_op = max([9] + [len(r[0]) for r in rows])
    w_shape = max([11] + [len(r[1]) for r in rows])
    w_dir = max([3] + [len(r[2]) for r in rows])
    hdr = (f"| {'op':{w_op}} | {'shape':{w_shape}} | {'dir':{w_dir}} | {'meshtron':>8} | {'eager':>6} | "
           f"{'compile':>7} | {'liger':>6} | {'best peer':>9} | {'vs best':>7} | {'vs copy':>7} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for op, shape, d, r in rows:
        best = max(v for k, v in r.items() if k in PEERS)
        peers = [f"{r[k]:{w}.0f}" if k in r else f"{'-':>{w}}" for k, w in zip(PEERS, (6, 7, 6))]
        print(f"| {op:{w_op}} | {shape:{w_shape}} | {d:{w_dir}} | {r['meshtron']:8.0f} | "
              f"{' | '.join(peers)} | {best:9.0f} | {r['meshtron'] / best:6.2f}x | "
              f"{r['meshtron'] / copy:6.0%} |")


def parse_ops(text: str) -> tuple[str, ...]:
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"--only takes a comma-separated subset of {','.join(OPS)}; got {text!r}")
    return ops


class Rows:
    """The result tables: per (op, shape, direction) GB/s of each implementation,
    by GPU time and by do_bench."""

    def __init__(self):
        self.gpu, self.do_bench = [], []

    def record(self, op, shape, gpu, dob):
        dirs = ("fwd", "bwd", "fwd+bwd")[:len(next(iter(gpu.values())))]
        for i, d in enumerate(dirs):
            self.gpu.append((op, shape, d, {k: v[i] for k, v in gpu.items()}))
            self.do_bench.append((op, shape, d, {k: v[i] for k, v in dob.items()}))
        print(*self.gpu[-len(dirs):], flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time kernel configs")
    ap.add_argument("--rows", type=int, default=16384, help="rows of the LayerNorm and bias-GeLU shapes")
    ap.add_argument("--llama-rows", type=int, default=16 * 2048,
                    help="rows (tokens) of the RMSNorm and SwiGLU shapes: micro-batch 16 x sequence 2048")
    ap.add_argument("--only", type=parse_ops, default=OPS, metavar="OPS",
                    help=f"comma-separated ops to run, of {','.join(OPS)} (default: all)")
    ap.add_argument("--out", default=None, help="also write the GPU-time rows to OUT/kernels.jsonl")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU tensors with wall-clock medians and torch.compile's aot_eager "
                         "backend: checks that the script runs, measures nothing")
    return ap.parse_args(argv)


def versions() -> str:
    vers = f"torch {torch.__version__}, triton {triton.__version__}"
    try:
        import importlib.metadata as md
        vers += f", liger-kernel {md.version('liger-kernel')}"
    except Exception:  # noqa: BLE001 - not installed: its columns are skipped
        vers += ", no liger-kernel"
    return vers


def copy_bandwidth() -> tuple[float, float, int]:
    """(GB/s by GPU time, GB/s by do_bench, elements) of a bf16 copy: what each op is measured against."""
    numel = 2 ** 29 if DEV == "cuda" else 2 ** 20     # 1 GiB of bf16 on the GPU
    src = torch.randn(numel, device=DEV, dtype=DT)
    dst = torch.empty_like(src)
    return gbps(4 * numel, gpu_ms(lambda: dst.copy_(src))), gbps(4 * numel, bench_ms(lambda: dst.copy_(src))), numel


def bench_layer_norm(m: int, n: int, args, compile_kw: dict, rows: Rows, liger_ln) -> None:
    x = torch.randn(m, n, device=DEV, dtype=DT)
    w = (1 + 0.1 * torch.randn(n, device=DEV)).to(DT)
    b = (0.1 * torch.randn(n, device=DEV)).to(DT)
    dy = torch.randn(m, n, device=DEV, dtype=DT)
    nf, nb = 2 * x.numel() * x.element_size(), 3 * x.numel() * x.element_size()
    cp = torch.empty_like(x)
    print(f"copy of {m}x{n} bf16: {gbps(nf, gpu_ms(lambda: cp.copy_(x))):.0f} GB/s")
    cp = None
    err = check(lambda x, w, b: layer_norm(x, w, b, EPS, impl=IMPL),
                lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS), (x, w, b), dy)
    print(f"LayerNorm {m}x{n}: max rel err of y, dx, dw, db vs fp64 {err:.1e}")
    if args.sweep:
        sweep_ln(x, w, b, dy, nf, nb)

    def eager(x, w, b):
        return F.layer_norm(x, (n,), w, b, EPS)
    impls = {"meshtron": lambda x, w, b: layer_norm(x, w, b, EPS, impl=IMPL),
             "eager": eager,
             "compile": torch.compile(eager, **compile_kw)}
    if liger_ln is not None:
        impls["liger"] = lambda x, w, b: liger_ln.apply(x, w, b, EPS)
    rows.record("LayerNorm", f"{m}x{n}", *measure(impls, (x, w, b), dy, nf, nb))


def bench_bias_gelu(m: int, args, compile_kw: dict, rows: Rows) -> None:
    n = 16384
    x = torch.randn(m, n, device=DEV, dtype=DT)
    b = torch.randn(n, device=DEV, dtype=DT)
    dy = torch.randn(m, n, device=DEV, dtype=DT)
    nf, nb = 2 * x.numel() * x.element_size(), 3 * x.numel() * x.element_size()
    err = check(lambda x, b: bias_gelu(x, b, impl=IMPL), lambda x, b: F.gelu(x + b, approximate="tanh"),
                (x, b), dy)
    print(f"bias-GeLU {m}x{n}: max rel err of y, dx, db vs fp64 {err:.1e}")
    if args.sweep:
        sweep_bg(x, b, dy, nf, nb)

    def eager_bg(x, b):
        return F.gelu(x + b, approximate="tanh")
    impls = {"meshtron": lambda x, b: bias_gelu(x, b, impl=IMPL), "eager": eager_bg,
             "compile": torch.compile(eager_bg, **compile_kw)}
    rows.record("bias-GeLU", f"{m}x{n}", *measure(impls, (x, b), dy, nf, nb))


def bench_rms_norm(ml: int, h: int, model: str, args, compile_kw: dict, rows: Rows, liger_rms) -> None:
    n_check = min(ml, 4096)   # the fp64 reference on a slice of the rows: the 8B shapes would need ~40 GB
    x = torch.randn(ml, h, device=DEV, dtype=DT)
    w = (1 + 0.1 * torch.randn(h, device=DEV)).to(DT)
    dy = torch.randn(ml, h, device=DEV, dtype=DT)
    nf, nb = 2 * x.numel() * x.element_size(), 3 * x.numel() * x.element_size()
    err = check(lambda x, w: rms_norm(x, w, RMS_EPS, impl=IMPL),
                lambda x, w: F.rms_norm(x, (h,), w, RMS_EPS), (x[:n_check], w), dy[:n_check])
    print(f"RMSNorm {ml}x{h} (Llama-{model}): max rel err of y, dx, dw vs fp64 {err:.1e} "
          f"(first {n_check} rows)")
    if args.sweep:
        sweep_rms(x, w, dy, nf, nb)

    def eager_rms(x, w):
        return F.rms_norm(x, (h,), w, RMS_EPS)
    impls = {"meshtron": lambda x, w: rms_norm(x, w, RMS_EPS, impl=IMPL), "eager": eager_rms,
             "compile": torch.compile(eager_rms, **compile_kw)}
    if liger_rms is not None:   # its defaults: Llama casting, dx written into dy
        impls["liger"] = lambda x, w: liger_rms.apply(x, w, RMS_EPS)
    else:
        print(f"RMSNorm {ml}x{h}: Liger column skipped (liger-kernel not installed)")
    rows.record("RMSNorm", f"{ml}x{h} ({model})", *measure3(impls, (x, w), dy, nf, nb))


def bench_swiglu(ml: int, f: int, model: str, args, compile_kw: dict, rows: Rows, liger_sw) -> None:
    n_check = min(ml, 4096)
    g = torch.randn(ml, f, device=DEV, dtype=DT)
    u = torch.randn(ml, f, device=DEV, dtype=DT)
    dy = torch.randn(ml, f, device=DEV, dtype=DT)
    nf, nb = 3 * g.numel() * g.element_size(), 5 * g.numel() * g.element_size()
    err = check(lambda g, u: swiglu(g, u, impl=IMPL), lambda g, u: F.silu(g) * u, (g[:n_check], u[:n_check]),
                dy[:n_check])
    print(f"SwiGLU {ml}x{f} (Llama-{model}): max rel err of y, dgate, dup vs fp64 {err:.1e} "
          f"(first {n_check} rows)")
    if args.sweep:
        sweep_sw(g, u, dy, nf, nb)

    def eager_sw(g, u):
        return F.silu(g) * u
    impls = {"meshtron": lambda g, u: swiglu(g, u, impl=IMPL), "eager": eager_sw,
             "compile": torch.compile(eager_sw, **compile_kw)}
    if liger_sw is not None:   # its backward writes dgate, dup into the saved gate, up
        impls["liger"] = lambda g, u: liger_sw.apply(g, u)
    else:
        print(f"SwiGLU {ml}x{f}: Liger column skipped (liger-kernel not installed)")
    rows.record("SwiGLU", f"{ml}x{f} ({model})", *measure3(impls, (g, u), dy, nf, nb))


def main():
    global DEV, SMOKE, IMPL
    args = parse_args()
    compile_kw = {"dynamic": False}
    if args.smoke:
        SMOKE, DEV = True, "cpu"
        args.rows = args.llama_rows = 64
        compile_kw["backend"] = "aot_eager"   # no C++ builds for a smoke run
        if os.environ.get("TRITON_INTERPRET") == "1":
            IMPL = "triton"     # meshtron's kernels in the interpreter (slow, but they run)
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)"
    vers = versions()
    print(f"device: {dev}; {vers}" + ("; meshtron's kernels in the Triton interpreter" if IMPL == "triton" else ""))
    copy, copy_db, numel = copy_bandwidth()
    print(f"copy bandwidth ({2 * numel / 2 ** 30:g} GiB, read + write): {copy:.0f} GB/s (do_bench: {copy_db:.0f})")

    rows = Rows()
    liger_ln = liger("layer_norm", "LigerLayerNormFunction") if "layer_norm" in args.only else None
    widths = (1024,) if SMOKE else (1024, 4096, 8192)   # a smoke run: each path once
    for n in widths if "layer_norm" in args.only else ():
        bench_layer_norm(args.rows, n, args, compile_kw, rows, liger_ln)
    if "bias_gelu" in args.only:
        bench_bias_gelu(args.rows, args, compile_kw, rows)
    # Llama: RMSNorm, SwiGLU
    liger_rms = liger("rms_norm", "LigerRMSNormFunction") if "rms_norm" in args.only else None
    liger_sw = liger("swiglu", "LigerSiLUMulFunction") if "swiglu" in args.only else None
    for model, h, f in LLAMA[:1] if SMOKE else LLAMA:
        if "rms_norm" in args.only:
            bench_rms_norm(args.llama_rows, h, model, args, compile_kw, rows, liger_rms)
        if "swiglu" in args.only:
            bench_swiglu(args.llama_rows, f, model, args, compile_kw, rows, liger_sw)

    print(f"\ndevice: {dev}; {vers}; bf16; copy {copy:.0f} GB/s ({2 * numel / 2 ** 30:g} GiB)")
    table(f"do_bench medians, GB/s (copy by do_bench {copy_db:.0f})", rows.do_bench, copy_db)
    table("GPU time (host queued ahead), GB/s", rows.gpu, copy)
    if args.out:   # one JSON line per (op, shape, direction): the rows of `python -m benchmarks run kernels`
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernels.jsonl"), "a") as f:
            for op, shape, d, r in rows.gpu:
                f.write(json.dumps(dict(op=op, shape=shape, dir=d, **r, device=dev, versions=vers)) + "\n")


if __name__ == "__main__":
    main()
