"""Training-step throughput of meshtron's TP+SP and ZeRO/FSDP layouts against stock
PyTorch peers measured in the same run (issues 3 and 4).

    # one GPU: the plain model (eager and compiled)
    torchrun --nproc-per-node 1 benchmarks/bench_parallel.py --out $OUT
    # two GPUs: TP (tp=2) and DP (dp=2) layouts, meshtron and stock
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --out $OUT
    # the table from both runs
    python benchmarks/bench_parallel.py --summarize $OUT/results.jsonl

Every configuration runs the same step (meshtron.train's forward_backward, clip_grad_norm_: forward,
fp32 loss, backward, global-norm clip at 1.0, fused AdamW with fp32 master
weights) on random tokens; only the parallelization differs. Step time is the
median of --steps timed steps after --warmup steps (compilation happens in
the warm-up); tokens/s/GPU = tokens consumed per step / step time / GPUs;
MFU = tokens/s/GPU * GPTConfig.flops_per_token(T) / 989 TFLOP/s.

Configurations (world 2): tp_meshtron_sp[_compiled], tp_stock[_compiled],
dp_meshtron_z1, dp_meshtron_z3, dp_stock_fsdp[_compiled...]; (world 1):
single, single_compiled. bf16: meshtron always through FSDP2's
MixedPrecisionPolicy(bf16 params, fp32 reduce), on the size-1 dp mesh when dp = 1
(the one-GPU model and tp only); the stock TP peer under torch.autocast(bf16) on
fp32 parameters; the stock FSDP peer with the same policy as meshtron.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from meshtron import ParallelConfig, init_mesh, parallelize, submesh  # noqa: E402
from meshtron import train  # noqa: E402
from meshtron.models import GPT, gpt_config  # noqa: E402
from meshtron.parallelize import loss_context  # noqa: E402

PEAK = 989e12
T0 = time.perf_counter()

CONFIGS_2 = ["tp_meshtron_sp", "tp_stock", "dp_meshtron_z1", "dp_meshtron_z3", "dp_stock_fsdp",
             "tp_meshtron_sp_compiled", "tp_stock_compiled", "dp_meshtron_z1_compiled", "dp_stock_fsdp_compiled"]
CONFIGS_1 = ["single", "single_compiled"]


def log(*a):
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------- kernels check

def kernels_ok(dev) -> tuple[bool, str]:
    """Run the Triton LayerNorm and bias-GeLU forward+backward once against PyTorch."""
    if dev.type != "cuda":
        return True, "cpu: model takes the PyTorch path"
    try:
        import torch.nn.functional as F
        from meshtron.kernels_triton import bias_gelu, layer_norm
        g = torch.Generator(device=dev).manual_seed(1)
        errs = []
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(4096, 2048, device=dev, dtype=dt, generator=g).requires_grad_()
            w = (1 + 0.1 * torch.randn(2048, device=dev, generator=g)).requires_grad_()
            b = (0.1 * torch.randn(2048, device=dev, generator=g)).requires_grad_()
            dy = torch.randn(4096, 2048, device=dev, dtype=dt, generator=g)
            y = layer_norm(x, w, b, 1e-5)
            gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
            xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
            yr = F.layer_norm(xr, (2048,), wr, br, 1e-5)
            rx, rw, rb = torch.autograd.grad(yr, (xr, wr, br), dy.double())
            for a, r in ((y, yr), (gx, rx), (gw, rw), (gb, rb)):
                errs.append(float((a.detach().double() - r.detach()).norm() / r.detach().norm()))
            h = torch.randn(4096, 8192, device=dev, dtype=dt, generator=g).requires_grad_()
            bb = (0.1 * torch.randn(8192, device=dev, generator=g)).requires_grad_()
            dz = torch.randn(4096, 8192, device=dev, dtype=dt, generator=g)
            z = bias_gelu(h, bb)
            gh, gbb = torch.autograd.grad(z, (h, bb), dz)
            hr, bbr = (t.detach().double().requires_grad_() for t in (h, bb))
            zr = F.gelu(hr + bbr, approximate="tanh")
            rh, rbb = torch.autograd.grad(zr, (hr, bbr), dz.double())
            for a, r in ((z, zr), (gh, rh), (gbb, rbb)):
                errs.append(float((a.detach().double() - r.detach()).norm() / r.detach().norm()))
        worst = max(errs)
        ok = worst < 2e-2 and all(e == e for e in errs)
        return ok, f"worst rel err {worst:.2e}"
    except Exception as e:  # noqa: BLE001 - fall back to the PyTorch path and say so
        return False, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- model building

@torch.no_grad()
def fast_init(model: nn.Module, seed: int = 0):
    """Megatron-like values drawn on the GPU (GPT.init_weights draws 1.3B numbers on
    the CPU per rank); Replicate params get the same values on every rank."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02)


def meta_model(cfg):
    with torch.device("meta"):
        return GPT(cfg, seed=None)


def materialize(model, dev):
    model.to_empty(device=dev)
    fast_init(model)
    return model


def stock_tp(model, tp_mesh, compile_: bool):
    """torch's parallelize_module with the naive per-linear plan; everything else
    stays a plain replicated tensor (embedding, norms, tied output head: every rank
    computes the full logits)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {}
    for i in model.layers:
        plan[f"layers.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"layers.{i}.attn.proj"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.fc2"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    if compile_:
        for name, block in model.layers.items():
            block.compile()   # in place, as meshtron.parallelize does
    return model


def stock_fsdp(model, dp_mesh, compile_: bool):
    """fully_shard per block + root, stock defaults (reshard_after_forward=True)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if compile_:
        for name, block in model.layers.items():
            block.compile()   # in place, as meshtron.parallelize does
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model


def optimizer_for(model, lr=1e-4):
    """Fused AdamW; parameter groups split by tensor type, so a model with both
    DTensor and plain parameters (stock TP) still takes the fused path."""
    from torch.distributed.tensor import DTensor
    groups = {}
    for p in model.parameters():
        if p.requires_grad:
            key = (isinstance(p, DTensor), p.ndim < 2)
            groups.setdefault(key, []).append(p)
    pg = [{"params": ps, "weight_decay": 0.0 if nodecay else 0.1} for (_, nodecay), ps in groups.items()]
    cuda = all(p.is_cuda for ps in groups.values() for p in ps)
    return torch.optim.AdamW(pg, lr=lr, betas=(0.9, 0.95), fused=True if cuda else None,
                             foreach=None if cuda else False)


def build(name, cfg, meshes, dev):
    """-> model, optimizer, the meshtron mesh for loss averaging, fb kwargs, tokens/step/rank-group, note"""
    compiled = name.endswith("_compiled")
    base = name[: -len("_compiled")] if compiled else name
    model = meta_model(cfg)
    if base == "tp_meshtron_sp":
        mesh = meshes["tp"]
        pcfg = ParallelConfig(sp=True, loss_parallel=True, param_dtype="bf16", compile=compiled)
        model = parallelize(model, mesh, pcfg)
        materialize(model, dev)
        opt = train.build_optimizer(model, 1e-4)
        kw = dict(loss_context=loss_context(mesh, pcfg))
        note = "meshtron TP+SP, loss parallel, bf16 params (FSDP2 policy on the size-1 dp mesh), fp32 master"
    elif base == "tp_stock":
        mesh = meshes["tp"]
        model = stock_tp(model, mesh["tp"], compiled)
        materialize(model, dev)
        opt = optimizer_for(model)
        kw = dict(autocast_dtype=torch.bfloat16, loss_context=contextlib.nullcontext)
        note = "stock parallelize_module colwise qkv/fc1 rowwise proj/fc2, autocast bf16"
    elif base in ("dp_meshtron_z1", "dp_meshtron_z3"):
        mesh = meshes["dp"]
        pcfg = ParallelConfig(zero_stage=int(base[-1]), param_dtype="bf16", reduce_dtype="fp32", compile=compiled)
        model = parallelize(model, mesh, pcfg)
        materialize(model, dev)
        opt = train.build_optimizer(model, 1e-4)
        kw = dict(loss_context=loss_context(mesh, pcfg))
        note = f"meshtron FSDP2 zero {base[-1]}, bf16 params, fp32 reduce"
    elif base == "dp_stock_fsdp":
        mesh = meshes["dp"]
        model = stock_fsdp(model, submesh(mesh, "dense_dp"), compiled)
        materialize(model, dev)
        opt = optimizer_for(model)
        kw = dict(autocast_dtype=None, loss_context=contextlib.nullcontext)
        note = "stock fully_shard per block + root, MixedPrecisionPolicy(bf16, fp32)"
    elif base == "single":
        mesh = meshes["single"]
        pcfg = ParallelConfig(param_dtype="bf16", compile=compiled)
        model = parallelize(model, mesh, pcfg)
        materialize(model, dev)
        opt = train.build_optimizer(model, 1e-4)
        kw = dict(loss_context=loss_context(mesh, pcfg))
        note = "one GPU, meshtron bf16 params (FSDP2 policy on the size-1 dp mesh), fp32 master"
    else:
        raise ValueError(name)
    if compiled:
        note += ", each block torch.compile'd"
    return model, opt, mesh, kw, note


# ---------------------------------------------------------------- profiling

def profile_summary(step, dev, n_steps: int, title: str) -> tuple[str, dict]:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(n_steps):
            step()
        sync(dev)
    wall = (time.perf_counter() - t) / n_steps * 1e3
    info = {"prof_wall_ms_per_step": wall}
    lines = [f"==== {title}: {n_steps} profiled steps, {wall:.1f} ms/step wall under the profiler"]
    try:
        from torch.autograd import DeviceType
        kern = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        cats = {"nccl": 0.0, "gemm": 0.0, "attention": 0.0, "triton": 0.0, "other": 0.0}
        iv = []
        for e in kern:
            nm = e.name.lower()
            d = e.time_range.elapsed_us()
            iv.append((e.time_range.start, e.time_range.end))
            if "nccl" in nm:
                cats["nccl"] += d
            elif any(s in nm for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
                cats["gemm"] += d
            elif "flash" in nm or "fmha" in nm or "attention" in nm:
                cats["attention"] += d
            elif "triton" in nm or nm.startswith(("_ln_", "_bias_gelu", "_bg_")):
                cats["triton"] += d
            else:
                cats["other"] += d
        iv.sort()
        busy, cur_s, cur_e = 0.0, None, None
        for s, e_ in iv:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e_
            else:
                cur_e = max(cur_e, e_)
        if cur_e is not None:
            busy += cur_e - cur_s
        per = {k: v / 1e3 / n_steps for k, v in cats.items()}
        info.update({f"gpu_{k}_ms": v for k, v in per.items()})
        info["gpu_busy_ms"] = busy / 1e3 / n_steps
        lines.append("GPU kernel time per step (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in per.items())
                     + f"; union of all kernels (GPU busy) {info['gpu_busy_ms']:.1f} ms of {wall:.1f} ms wall")
        n_cpu_ops = sum(1 for e in prof.events() if e.device_type == DeviceType.CPU)
        lines.append(f"CPU-side profiler events per step: {n_cpu_ops / n_steps:.0f}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"(kernel breakdown unavailable: {type(e).__name__}: {e})")
    ka = prof.key_averages()
    if dev.type == "cuda":
        lines.append(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    return "\n".join(lines), info


# ---------------------------------------------------------------- one configuration

def run_config(name, cfg, meshes, dev, args, world, fused_note):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    tb = time.perf_counter()
    model, opt, mesh, kw, note = build(name, cfg, meshes, dev)
    build_s = time.perf_counter() - tb
    rank = dist.get_rank()
    # tokens: TP ranks share a batch; DP ranks read different batches
    dp_rank = rank if name.startswith("dp_") else 0
    g = torch.Generator(device=dev).manual_seed(1234 + dp_rank)
    B, T = args.micro_batch, args.seq_len
    x = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g)
    tokens_per_gpu = B * T * (1 if name.startswith("dp_") or name.startswith("single") else 1 / world)

    dtypes = {}

    def hook(mod, inp, out):
        o = out.to_local() if hasattr(out, "to_local") else out
        dtypes.setdefault("qkv_out", str(o.dtype).replace("torch.", ""))
        # the activation entering qkv: under SP this is what the all-gather moved
        dtypes.setdefault("qkv_in", str(inp[0].dtype).replace("torch.", ""))
    # which dtype the first matmul really ran in (eager only: a hook would perturb compilation)
    h = None if name.endswith("_compiled") else model.layers["0"].attn.qkv.register_forward_hook(hook)

    def step():
        # meshtron.train.train_step's body, spelled out (its signature is changing under pipeline work)
        loss = train.forward_backward(model, [(x, y)], mesh, **kw)
        norm = train.clip_grad_norm_(model.parameters(), 1.0, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, norm

    tw = time.perf_counter()
    losses = []
    for i in range(args.warmup):
        loss, _ = step()
        losses.append(float(loss))
        if i == 0:
            if h is not None:
                h.remove()
            first_s = time.perf_counter() - tw
    sync(dev)
    warm_s = time.perf_counter() - tw
    dist.barrier()
    times = []
    for _ in range(args.steps):
        sync(dev)
        t = time.perf_counter()
        loss, _ = step()
        sync(dev)
        times.append(time.perf_counter() - t)
    losses.append(float(loss))
    med = statistics.median(times)
    mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    stats = torch.tensor([med, mem], dtype=torch.float64, device=dev)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    med_max, mem_max = stats.tolist()
    tps_gpu = tokens_per_gpu / med_max
    mfu = tps_gpu * cfg.flops_per_token(T) / PEAK
    res = dict(config=name, world=world, note=note + fused_note, micro_batch=B, seq_len=T,
               step_ms_median=med_max * 1e3, step_ms_min=min(times) * 1e3, step_ms_max=max(times) * 1e3,
               tokens_per_s_per_gpu=tps_gpu, mfu=mfu, peak_mem_gib=mem_max, build_s=build_s,
               first_step_s=first_s, warmup_s=warm_s, qkv_out_dtype=dtypes.get("qkv_out"), qkv_in_dtype=dtypes.get("qkv_in"),
               loss_first=losses[0], loss_last=losses[-1], device=torch.cuda.get_device_name(dev)
               if dev.type == "cuda" else "cpu")
    log(f"{name}: step {med_max * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}) | "
        f"{tps_gpu:,.0f} tok/s/GPU | MFU {100 * mfu:.1f}% | peak {mem_max:.1f} GiB | qkv in/out {res['qkv_in_dtype']}/{res['qkv_out_dtype']} | "
        f"loss {losses[0]:.3f}->{losses[-1]:.3f} | build {build_s:.1f}s first step {first_s:.1f}s warmup {warm_s:.1f}s")
    if args.profile_steps > 0 and (not args.profile_configs or name in args.profile_configs.split(",")):
        text, info = profile_summary(step, dev, args.profile_steps, f"{name} (world {world}, rank {rank})")
        res.update(info)
        if rank == 0:
            with open(os.path.join(args.out, f"profile_w{world}.txt"), "a") as f:
                f.write(text + "\n\n")
            log(text.splitlines()[1] if len(text.splitlines()) > 1 else text)
    del model, opt, step, kw
    return res


def cleanup(dev):
    torch._dynamo.reset()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- summary

def summarize(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    by = {r["config"]: r for r in rows if "error" not in r}
    peers = {
        "tp_meshtron_sp": "tp_stock", "tp_meshtron_sp_compiled": "tp_stock_compiled",
        "dp_meshtron_z1": "dp_stock_fsdp", "dp_meshtron_z3": "dp_stock_fsdp",
        "dp_meshtron_z1_compiled": "dp_stock_fsdp_compiled",
    }
    print("| config | GPUs | step (ms, median) | tokens/s/GPU | MFU | peak mem (GiB) | vs stock peer | vs 1 GPU (per GPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['world']} | {r['error'][:80]} | | | | | |")
            continue
        c = r["config"]
        peer = by.get(peers.get(c, ""))
        vs = f"{r['tokens_per_s_per_gpu'] / peer['tokens_per_s_per_gpu']:.2f}x {peer['config']}" if peer else ""
        one = by.get("single_compiled" if c.endswith("_compiled") else "single")
        vs1 = f"{r['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.2f}" if one and r["world"] > 1 else ""
        print(f"| {c} | {r['world']} | {r['step_ms_median']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | "
              f"{100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {vs} | {vs1} |")
    print()
    for r in rows:
        if "gpu_busy_ms" in r:
            print(f"- {r['config']}: GPU busy {r['gpu_busy_ms']:.1f} ms of {r['prof_wall_ms_per_step']:.1f} ms "
                  f"(profiled); gemm {r['gpu_gemm_ms']:.1f}, attention {r['gpu_attention_ms']:.1f}, "
                  f"nccl {r['gpu_nccl_ms']:.1f}, triton {r['gpu_triton_ms']:.1f}, other {r['gpu_other_ms']:.1f} ms")


# ---------------------------------------------------------------- main

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.3B")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--configs", default=None, help="comma list (default: all for this world size)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--profile-configs", default=None, help="comma list of configs to profile (default: all)")
    p.add_argument("--no-fused-kernels", action="store_true")
    p.add_argument("--end-by", type=float, default=None,
                   help="epoch seconds: skip a config that would not finish by then (device leases are short)")
    p.add_argument("--compile-cost", type=float, default=90.0,
                   help="first guess of a compiled config's seconds (then the measured one is used)")
    p.add_argument("--out", default=".")
    p.add_argument("--tag", default="", help="suffix of the results file: results<tag>.jsonl")
    p.add_argument("--summarize", default=None)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    os.makedirs(args.out, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)

    try:
        import triton
        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = "none"
    log(f"torch {torch.__version__}, triton {tv}, world {world}, device "
        f"{torch.cuda.get_device_name(dev) if cuda else 'cpu'}")

    fused = not args.no_fused_kernels
    fused_note = ""
    if fused:
        ok, msg = kernels_ok(dev)
        flag = torch.tensor([0 if ok else 1], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        log(f"Triton kernel self-check: {'ok' if ok else 'FAILED'} ({msg})")
        if int(flag.item()):
            fused, fused_note = False, "; fused_kernels=False (Triton self-check failed)"
    else:
        fused_note = "; fused_kernels=False"
    cfg = gpt_config(args.model, fused_kernels=fused)
    log(f"model {args.model}: {cfg.num_params() / 1e9:.3f}B params, {cfg.flops_per_token(args.seq_len) / 1e9:.3f} "
        f"GFLOP/token at T={args.seq_len}; micro-batch {args.micro_batch}")

    if world == 2:
        meshes = {"tp": init_mesh(dp=1, tp=2), "dp": init_mesh(dp=2)}
        names = CONFIGS_2
    elif world == 1:
        meshes = {"single": init_mesh(dp=1)}
        names = CONFIGS_1
    else:
        raise SystemExit("run with 1 or 2 processes")
    if args.configs:
        names = args.configs.split(",")

    out_path = os.path.join(args.out, f"results{args.tag}.jsonl")
    cost = {"eager": 25.0, "compiled": args.compile_cost}
    for name in names:
        kind = "compiled" if name.endswith("_compiled") else "eager"
        late = torch.tensor([1 if args.end_by and time.time() + cost[kind] > args.end_by else 0], device=dev)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if int(late.item()):
            log(f"{name}: skipped (would end after --end-by; {cost[kind]:.0f}s budgeted)")
            if dist.get_rank() == 0:
                with open(out_path, "a") as f:
                    f.write(json.dumps(dict(config=name, world=world, error="skipped: out of lease time")) + "\n")
            continue
        t_cfg = time.time()
        res = None
        for attempt_cfg, attempt_note in ((cfg, fused_note), (replace(cfg, fused_kernels=False),
                                                              "; fused_kernels=False (run with them failed)")):
            try:
                res = run_config(name, attempt_cfg, meshes, dev, args, world, attempt_note)
                break
            except Exception as e:  # noqa: BLE001 - record and go on (both ranks fail alike)
                import traceback
                if dist.get_rank() == 0:
                    traceback.print_exc()
                res = dict(config=name, world=world, error=f"{type(e).__name__}: {e}")
                log(f"{name} (fused_kernels={attempt_cfg.fused_kernels}): FAILED {res['error'][:300]}")
                cleanup(dev)
                dist.barrier()
                if not attempt_cfg.fused_kernels:
                    break
        cost[kind] = max(cost[kind] if kind == "eager" else 0.0, 1.1 * (time.time() - t_cfg))
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(res) + "\n")
        cleanup(dev)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
