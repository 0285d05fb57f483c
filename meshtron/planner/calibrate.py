"""Measure the figures the planner's step-time model needs, on the machine it runs on.

    python -m meshtron.plan calibrate --model llama-8B --out h200.json             # one GPU
    torchrun --nproc-per-node 8 -m meshtron.plan calibrate --model llama-8B --out h200.json   # and its links

- matmul efficiency: the model's own GEMMs (QKV, attention output, the MLP's,
  the output head) at its hidden sizes and a training micro-batch of tokens,
  forward shapes and both backward ones, bf16 on GPU; FLOP-weighted achieved
  throughput over the GPU's dense bf16 peak (a datasheet figure: MFU is quoted
  against it); and the same at 1K to 16K tokens (the planner's curve: a small
  micro-batch fills the GPU less);
- attention efficiency: causal SDPA forward and backward at the model's heads
  and --seq-len, over the same peak, and a curve of it over head dims 64 and
  128 and sequences of 1K to 64K tokens;
- HBM bandwidth: a large device-to-device copy (read + write);
- host time: the eager forward and backward of the model cut to 1 and to 3
  layers on a few tokens (what a small micro-batch waits for in Python and
  kernel launches), per micro-batch and per layer, the latter under each
  recompute mode;
- usable memory: what the device reports as its total;
- intra-node link: with more than one rank, all-gather and all-reduce over all
  of them from 64 KiB to 256 MiB, and a least-squares fit of
  t = alpha * (n-1) + factor * bytes / bandwidth, the planner's alpha-beta model.

What a run cannot measure (the inter-node link on one node; the intra-node link
on one GPU) keeps the built-in figure, and the file's "measured" lists what was.
The file is what `python -m meshtron.plan --gpu FILE` reads.

    python -m meshtron.plan calibrate --fit ROWS.jsonl --gpu h100 --out h100.json   # no GPU needed

then fits the terms one GPU cannot measure (collectives inside a step, the host per
collective and micro-batch, compile's effect, the bubble) to measured steps of whole
layouts (meshtron.planner.fit), keeping the rest of the `--gpu` file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from meshtron import models
from meshtron.distributed.data_parallel import cast_embeddings
from meshtron.distributed.recompute import MODES, apply_recompute
from meshtron.planner.hardware import GPUS
from meshtron.train.loss import logits_of

# dense bf16 tensor-core peak by device name (datasheets, SXM parts)
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def _peak(device: torch.device) -> tuple[str, float]:
    if device.type != "cuda":
        return "cpu", 1e12   # a nominal peak: CPU figures only exercise the code path
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAKS.items():
        if key in name:
            return key.lower(), peak
    raise ValueError(f"no datasheet bf16 peak for {name!r}: add it to meshtron.planner.calibrate.PEAKS")


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_gemms(cfg, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of one layer's matmuls and the output head, forward and the two
    backward products (dX = dY W^T, dW = X^T dY) of each."""
    head_dim = cfg.dim // cfg.n_heads
    kv = getattr(cfg, "n_kv_heads", cfg.n_heads) * head_dim
    swiglu = hasattr(cfg, "ffn_dim")
    hidden = cfg.ffn_dim if swiglu else cfg.ffn_mult * cfg.dim
    forward = [(tokens, cfg.dim, cfg.dim + 2 * kv), (tokens, cfg.dim, cfg.dim),
               (tokens, cfg.dim, (2 if swiglu else 1) * hidden), (tokens, hidden, cfg.dim),
               (tokens, cfg.dim, cfg.vocab_size)]
    return [s for m, k, n in forward for s in ((m, k, n), (m, n, k), (k, m, n))]


def matmul_efficiency(cfg, device: torch.device, tokens: int, peak: float, repeats: int = 10) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flops = seconds = 0.0
    for m, k, n in model_gemms(cfg, tokens):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds += _time(lambda a=a, b=b: a @ b, device, repeats)
        flops += 2 * m * k * n
    return flops / seconds / peak


def _fp8_operands(m: int, k: int, n: int, device: torch.device):
    """torch._scaled_mm's operands as torchao's tensorwise Float8Linear makes them: e4m3 rows, a
    column-major e4m3 weight, one fp32 scale each."""
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return a, b, one


def dtype_matmul_efficiency(cfg, device: torch.device, tokens: int, peak: float, dtype: str,
                            repeats: int = 10) -> float:
    """matmul_efficiency's GEMMs in fp32 (no TF32: torch's default) or fp8 (tensorwise
    scales, bf16 out), over the same bf16 peak: what --dtype fp32 and --fp8 run at."""
    flops = seconds = 0.0
    for m, k, n in model_gemms(cfg, tokens):
        if dtype == "fp8":
            a, b, one = _fp8_operands(m, k, n, device)
            fn = (lambda a=a, b=b, one=one: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
        else:
            a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
            fn = (lambda a=a, b=b: a @ b)
        seconds += _time(fn, device, repeats)
        flops += 2 * m * k * n
    return flops / seconds / peak


def attention_efficiency(dim: int, heads: int, device: torch.device, tokens: int, seq_len: int, peak: float,
                         repeats: int = 10, dtype: torch.dtype | None = None) -> float:
    """Causal SDPA forward and backward, `heads` heads of dim / heads over `seq_len`,
    against 6*b*s^2*dim FLOPs (forward 2*b*s^2*dim with the causal half skipped,
    backward twice that), as the planner counts it."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    b = max(1, tokens // seq_len)
    q, k, v = (torch.randn(b, heads, seq_len, dim // heads, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(b, heads, seq_len, dim // heads, device=device, dtype=dtype)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)
    return 6 * b * seq_len ** 2 * dim / _time(step, device, repeats) / peak


def attention_curve(cfg, device: torch.device, peak: float, repeats: int = 10, quick: bool = False) -> list:
    """[head dim, sequence length, efficiency] of causal SDPA at the model's width
    (dim / head dim heads) for head dims 64 and 128, over 1K to 64K tokens, each
    with at least 16K tokens of batch (as a training micro-batch has)."""
    dims, lens = ((8, 16), (64, 128)) if quick else ((64, 128), (1024, 2048, 4096, 8192, 16384, 32768, 65536))
    batch = 128 if quick else 16384
    return [[hd, s, attention_efficiency(cfg.dim, cfg.dim // hd, device, max(s, batch), s, peak, repeats)]
            for hd in dims for s in lens]


def host_seconds(spec, cfg, device: torch.device, repeats: int = 10, tokens: int = 64,
                 dtype: torch.dtype | None = None) -> dict[str, float]:
    """Host seconds of the model's eager forward and backward: per micro-batch, and
    per layer under each recompute mode. The model is cut to 1 and to 3 layers on a
    few tokens, where the GPU's work is negligible, so the wall time is the Python
    and kernel launches that a micro-batch too small to keep the GPU busy cannot hide."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)   # the trainer's default
    x = torch.randint(cfg.vocab_size, (1, tokens), device=device)
    # selective recompute is refused with mixture-of-experts blocks (models/common/layout.py)
    modes = ("none", "full") if getattr(cfg, "moe", None) else MODES
    times = {mode: [] for mode in modes}
    for layers in (1, 3):
        # as the trainer runs one process: fp32 weights under bf16 autocast, whose casts and
        # dispatch are host time too, and the residual stream in bf16 (an fp32 one sends a
        # MoE block's experts down their per-expert fp32 loop, 3x the host time)
        model = spec.model_cls(dataclasses.replace(cfg, n_layers=layers), seed=0).to(device)
        if dtype != torch.float32:
            cast_embeddings(model)
        blocks = list(model.layers.values())
        plain = [type(b) for b in blocks]
        for mode in modes:
            apply_recompute(blocks, mode)
            def step(m=model):
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    out = logits_of(m(x))
                out.float().sum().backward()
            times[mode].append(_time(step, device, repeats))
            for block, cls in zip(blocks, plain):
                block.__class__ = cls
        del model
    out = {}
    for mode in modes:
        per_layer = max(times[mode][1] - times[mode][0], 0.0) / 2
        if mode == "none":
            out["host_microbatch_s"] = max(times[mode][0] - per_layer, 0.0)
        out["host_layer_s" if mode == "none" else f"host_layer_{mode}_s"] = per_layer
    return out


def moe_parts(spec, cfg, device: torch.device, tokens: int, peak: float, repeats: int = 10) -> dict[str, float]:
    """A mixture of experts' block as the model runs it (router, sort, grouped GEMMs, weighted
    sum), forward and backward on `tokens` tokens under bf16 autocast, and its experts'
    grouped GEMMs alone on the same rows: the GEMMs' efficiency over the bf16 peak, and
    what the rest costs, as bytes per routed copy and model dim at the HBM bandwidth
    (the planner scales it to other widths, top-k and token counts)."""
    from meshtron.models.common.experts import Experts
    moe, dtype = cfg.moe, torch.bfloat16 if device.type == "cuda" else torch.float32
    block = spec.model_cls(dataclasses.replace(cfg, n_layers=1), seed=0).layers["0"].feed_forward.to(device)
    block.train()
    x = torch.randn(1, tokens, cfg.dim, device=device, dtype=dtype, requires_grad=True)   # the trainer's residual

    def whole():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            out = block(x)
        out.float().sum().backward()
    rows = tokens * moe.top_k
    experts = Experts(cfg.dim, moe).to(device, dtype)
    xr = torch.randn(rows, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    counts = torch.full((moe.n_experts,), rows // moe.n_experts, device=device, dtype=torch.long)
    counts[-1] += rows - int(counts.sum())
    gemms = _time(lambda: experts(xr, counts).float().sum().backward(), device, repeats)
    width = 3 if moe.activation == "swiglu" else 2
    flops = 6 * rows * cfg.dim * moe.hidden * width
    rest = max(_time(whole, device, repeats) - gemms, 0.0)
    return {"grouped_mm_efficiency": flops / gemms / peak,
            "moe_bytes_per_copy": rest * hbm_bandwidth(device, 2 ** 26, repeats) / (rows * cfg.dim)}


FAMILIES = (("llama", "llama-1B"), ("gpt", "1.3B"), ("moe", "llama-moe-3B"))
TINY_FAMILIES = (("llama", "llama-tiny"), ("gpt", "tiny"), ("moe", "llama-moe-tiny"))


def host_families(device: torch.device, repeats: int = 10, quick: bool = False) -> list[list]:
    """[family, recompute, seconds]: host_seconds' per-layer time of a preset of each model family."""
    out = []
    for name, preset in TINY_FAMILIES if quick else FAMILIES:
        spec, cfg = models.get(preset)
        for key, value in host_seconds(spec, cfg, device, repeats).items():
            if key.startswith("host_layer"):
                out.append([name, key.removeprefix("host_layer_").removesuffix("_s") if key != "host_layer_s"
                            else "none", value])
    return out


def fp8_rowwise_efficiency(cfg, device: torch.device, tokens: int, peak: float, repeats: int = 10) -> float:
    """dtype_matmul_efficiency's fp8 GEMMs with a scale per row of each operand (--fp8 rowwise)."""
    flops = seconds = 0.0
    for m, k, n in model_gemms(cfg, tokens):
        a, b, _ = _fp8_operands(m, k, n, device)
        sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        seconds += _time(lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
                         device, repeats)
        flops += 2 * m * k * n
    return flops / seconds / peak


def hbm_bandwidth(device: torch.device, nbytes: int = 2 ** 30, repeats: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src), device, repeats)   # read + write


def fit_alpha_beta(samples: list[tuple[str, int, float]], n: int) -> tuple[float, float]:
    """Least squares of t = alpha * (n-1) + factor * bytes / bw over (kind, bytes, seconds)."""
    factor = {"all_gather": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
    xs = [factor[k] * b for k, b, _ in samples]
    ts = [t for _, _, t in samples]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError("the collective times do not grow with the bytes: the link was busy; calibrate again")
    alpha = max(mt - slope * mx, 0.0) / (n - 1)
    return alpha, 1 / slope


def link_samples(device: torch.device, sizes: list[int], repeats: int = 10) -> list[tuple[str, int, float]]:
    """(kind, bytes of the full tensor, median seconds) over the default group;
    the slowest rank's time for each, so every rank returns the same samples."""
    n = dist.get_world_size()
    out = []
    for nbytes in sizes:
        full = torch.empty(nbytes // 4, device=device)
        shard = torch.empty(nbytes // 4 // n, device=device)
        for kind, fn in (("all_gather", lambda f=full, s=shard: dist.all_gather_into_tensor(f, s)),
                         ("all_reduce", lambda f=full: dist.all_reduce(f))):
            t = torch.tensor(_time(fn, device, repeats), device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append((kind, nbytes, float(t)))
    return out


def calibrate(model: str, tokens: int, seq_len: int, device: torch.device, quick: bool = False) -> dict:
    name, peak = _peak(device)
    base = GPUS.get(name, GPUS["h200"])
    spec, cfg = models.get(model)
    repeats = 2 if quick else 10
    out = dataclasses.asdict(base) | {"name": name, "peak_flops": peak}
    out["matmul_efficiency"] = matmul_efficiency(cfg, device, tokens, peak, repeats)
    out["matmul_curve"] = [[t, matmul_efficiency(cfg, device, t, peak, repeats)]
                           for t in ((256, 1024) if quick else (1024, 2048, 4096, 8192, 16384))]
    out["attention_efficiency"] = attention_efficiency(cfg.dim, cfg.n_heads, device, tokens, seq_len, peak, repeats)
    out["attention_curve"] = attention_curve(cfg, device, peak, repeats, quick)
    out["hbm_bandwidth"] = hbm_bandwidth(device, 2 ** 20 if quick else 2 ** 30, repeats)
    # the other compute dtypes' GEMMs and attention, as fractions of bf16's at the same shapes
    bf16 = matmul_efficiency(cfg, device, tokens, peak, repeats)
    ratios = [["fp32", dtype_matmul_efficiency(cfg, device, tokens, peak, "fp32", repeats) / bf16]]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        ratios.append(["fp8", dtype_matmul_efficiency(cfg, device, tokens, peak, "fp8", repeats) / bf16])
        ratios.append(["fp8_rowwise", fp8_rowwise_efficiency(cfg, device, tokens, peak, repeats) / bf16])
    out["matmul_dtype_ratio"] = ratios
    out["attention_fp32_ratio"] = attention_efficiency(
        cfg.dim, cfg.n_heads, device, tokens, seq_len, peak, repeats, torch.float32) / out["attention_efficiency"]
    host = host_seconds(spec, cfg, device, repeats)
    out |= host
    out["host_layers"] = host_families(device, repeats, quick)
    measured = ["matmul_efficiency", "matmul_curve", "attention_efficiency", "attention_curve", "hbm_bandwidth",
                "matmul_dtype_ratio", "attention_fp32_ratio", *host, "host_layers"]
    if getattr(cfg, "moe", None) is not None:
        parts = moe_parts(spec, cfg, device, tokens, peak, repeats)
        out |= parts
        measured += list(parts)
    if device.type == "cuda":
        out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        measured.append("memory_bytes")
    if dist.is_initialized() and dist.get_world_size() > 1:
        sizes = [2 ** k for k in range(16, 22 if quick else 29, 2)]
        out["intra"] = fit_alpha_beta(link_samples(device, sizes, repeats), dist.get_world_size())
        measured.append(f"intra ({dist.get_world_size()} ranks)")
    out["measured"] = measured
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m meshtron.plan calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-8B", choices=tuple(models.PRESETS), help="whose GEMM shapes to time")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (the GEMMs' m)")
    p.add_argument("--seq-len", type=int, default=2048, help="the attention's sequence length")
    p.add_argument("--out", help="the JSON file to write (rank 0)")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (tests)")
    p.add_argument("--fit", action="store_true", help="fit the global terms to the shipped measured steps "
                   "(calibration/*_measured.jsonl) and write them into the shipped files (no GPU needed)")
    p.add_argument("--leave-one-out", action="store_true", help="print each measured step predicted by a fit "
                   "made without it (no GPU needed)")
    a = p.parse_args(argv)
    if a.fit or a.leave_one_out:
        from meshtron.planner import fit
        rows = fit.shipped_rows()
        if a.leave_one_out:
            print(fit.table(fit.leave_one_out(rows)))
        if a.fit:
            values = fit.write_fitted(rows)
            print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
        return
    if not a.out:
        p.error("--out is needed to measure")
    if "RANK" in os.environ:   # the trainer's rendezvous: under torchrun, or a world of one with no port
        from meshtron.train.lifetime import init_process_group
        init_process_group(600)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = calibrate(a.model, a.tokens, a.seq_len, device, a.quick)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
