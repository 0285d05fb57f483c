"""Training throughput of the recipe's own step (meshtron.Trainer.step) for any
registered model under any layout.

    # one GPU, then four, the Llama-1B at sequence 2048 (bf16, 16 sequences a replica)
    torchrun --nproc-per-node 1 benchmarks/bench_train.py --layouts 1gpu,1gpu_compile --model llama-1B --out $OUT
    torchrun --nproc-per-node 4 benchmarks/bench_train.py --layouts fsdp4,tp2dp2,tp4 --model llama-1B --out $OUT
    python benchmarks/bench_train.py --summarize $OUT/results.jsonl [--peer $OUT/torchtitan.jsonl]

    # FP8 against bf16 on one GPU (benchmarks/RESULTS.md; torchao installed)
    python benchmarks/bench_train.py --layouts 1gpu_compile,1gpu_fp8_compile,1gpu_fp8_rowwise_compile \
        --model llama-1B --untie-embeddings --micro-batch 16 --seq-len 2048 --out $OUT

A layout is a set of recipe flags (LAYOUTS; `_compile` appends --compile); every
other flag is passed to the recipe as it is (--model, --seq-len, --micro-batch,
--untie-embeddings, ...). The Trainer is built exactly as recipes/train.py builds
it, then timed: --warmup steps (compilation happens there), then --rounds rounds
of --steps steps between two GPU synchronisations (the CPU runs ahead as in
training); the step time is the median round / steps. tokens/s/GPU = global
batch x sequence / step time / GPUs; MFU = tokens/s/GPU x the model's
flops_per_token / the GPU's dense bf16 peak (meshtron.train.metrics); peak memory is
torch.cuda.max_memory_allocated (and _reserved, which torchtitan logs), the
largest over ranks. Every step's loss and gradient norm are recorded (`losses`,
`grad_norms`): all layouts train the same batches from the same weights, at lr
1e-4 unless --lr says otherwise, so they must agree to bf16 noise. Peers (torchtitan) run
beside it in the suites (python -m benchmarks run SUITE); --summarize --peer joins a peer's rows
by layout name.
"""
from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron import Config, Trainer, models  # noqa: E402
from meshtron.distributed.pipeline_parallel import bubble_fraction  # noqa: E402
from meshtron.train.lifetime import init_process_group  # noqa: E402
from meshtron.train.metrics import peak_tflops  # noqa: E402

LAYOUTS = {  # name: (GPUs, recipe flags); bf16 compute, fp32 master weights and reduction throughout
    "1gpu": (1, []),
    "1gpu_fp8": (1, ["--fp8", "tensorwise"]),            # FP8 matmuls (torchao Float8Linear)
    "1gpu_fp8_rowwise": (1, ["--fp8", "rowwise"]),
    "1gpu_fused": (1, ["--fused-loss"]),                 # the head's matmul and the loss fused, chunk by chunk
    "1gpu_fsdp": (1, ["--mixed-precision", "fsdp"]),   # bf16 through FSDP2 on a one-rank mesh (before)
    "fsdp4": (4, ["--dp", "4", "--zero", "1"]),
    "fsdp4_zero3": (4, ["--dp", "4", "--zero", "3"]),
    "fsdp4_zero3_fp8": (4, ["--dp", "4", "--zero", "3", "--fp8", "tensorwise"]),   # fp8 all-gather (tensorwise)
    "fsdp4_zero3_bf16rs": (4, ["--dp", "4", "--zero", "3", "--reduce-dtype", "bf16"]),   # not the default: fp32
    "fsdp4_zero3_fused": (4, ["--dp", "4", "--zero", "3", "--fused-loss"]),
    "fsdp4_zero2": (4, ["--dp", "4", "--zero", "2"]),   # weights kept gathered from forward to backward
    "fsdp4_zero2_fp8": (4, ["--dp", "4", "--zero", "2", "--fp8", "tensorwise"]),
    "tp2dp2": (4, ["--dp", "2", "--tp", "2", "--sp", "--zero", "1"]),
    "tp2dp2_zero3": (4, ["--dp", "2", "--tp", "2", "--sp", "--zero", "3"]),
    "tp4": (4, ["--tp", "4", "--sp"]),
    "fsdp2": (2, ["--dp", "2", "--zero", "1"]),
    "tp2": (2, ["--tp", "2", "--sp"]),
    "tp2_overlap": (2, ["--tp", "2", "--sp", "--tp-overlap"]),   # Megatron's backward reduce-scatter overlap
    "tp2_overlap_ce": (2, ["--tp", "2", "--sp", "--tp-overlap", "--tp-overlap-comm", "copy-engine"]),
    "tp2_overlap_chunked": (2, ["--tp", "2", "--sp", "--tp-overlap", "--tp-overlap-comm", "chunked"]),
    "pp2": (2, ["--pp", "2", "--microbatches", "8"]),
    "pp2_interleaved": (2, ["--pp", "2", "--microbatches", "8", "--pp-schedule", "interleaved-1f1b",
                            "--pp-virtual", "2"]),
    "pp2_zb": (2, ["--pp", "2", "--microbatches", "8", "--pp-schedule", "zero-bubble", "--pp-virtual", "2"]),
    "pp4": (4, ["--pp", "4", "--microbatches", "8"]),
    "dp2pp2": (4, ["--dp", "2", "--pp", "2", "--microbatches", "8"]),
    # pipelines whose micro-batch count follows --global-batch / --micro-batch (the bubble against dp4's step)
    "pp4_1f1b": (4, ["--pp", "4"]),
    "pp4_interleaved": (4, ["--pp", "4", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2"]),
    "pp4_zbv": (4, ["--pp", "4", "--pp-schedule", "zbv", "--pp-virtual", "2", "--zero", "2"]),
    "dp2pp2_1f1b": (4, ["--dp", "2", "--pp", "2", "--zero", "1"]),
    "dp2pp2_interleaved": (4, ["--dp", "2", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2",
                               "--zero", "1"]),
    "dp2pp2_zbv": (4, ["--dp", "2", "--pp", "2", "--pp-schedule", "zbv", "--pp-virtual", "2", "--zero", "1"]),
    "pp2tp2": (4, ["--pp", "2", "--tp", "2", "--sp", "--microbatches", "8"]),
    "pp2tp2_1f1b": (4, ["--pp", "2", "--tp", "2", "--sp"]),   # micro-batches: --global-batch / --micro-batch
    "pp2tp2_nosp": (4, ["--pp", "2", "--tp", "2", "--microbatches", "8"]),
    "pp2tp2_m4": (4, ["--pp", "2", "--tp", "2", "--sp", "--microbatches", "4"]),
    "pp2tp2_interleaved": (4, ["--pp", "2", "--tp", "2", "--sp", "--microbatches", "8", "--pp-schedule",
                               "interleaved-1f1b", "--pp-virtual", "2"]),
    "cp2": (2, ["--cp", "2"]),                           # context parallelism: sequences over cp
    "cp4": (4, ["--cp", "4"]),
    "cp4_allgather": (4, ["--cp", "4", "--cp-comm", "allgather"]),
    "cp4_a2a": (4, ["--cp", "4", "--cp-comm", "a2a"]),
    "ep2": (2, ["--ep", "2", "--zero", "1"]),            # mixture-of-experts presets: experts over ep
    "ep2_zero2": (2, ["--ep", "2", "--zero", "2"]),      # a layout's flags follow the command line's: --zero here
    "ep2_zero0": (2, ["--ep", "2", "--zero", "0"]),      # DDP for the dense weights: no forward all-gathers
    "ep2_zero2_padded": (2, ["--ep", "2", "--zero", "2", "--moe-dispatch", "padded"]),   # no host sync
    "ep2_padded": (2, ["--ep", "2", "--zero", "1", "--moe-dispatch", "padded"]),
    "ep2_exact": (2, ["--ep", "2", "--zero", "1", "--moe-dispatch", "exact"]),   # the default (auto) at ep2 is padded
    "ep4": (4, ["--ep", "4", "--zero", "1"]),
}


def _compile_whole(trainer) -> None:
    """+whole: torch.compile each model part whole (embedding, blocks, norm, head), after the
    trainer built it (FSDP applied), instead of --compile's per-block compile. The layout is
    built without --compile and with plain norms and activations (--no-fused-kernels), as
    --compile builds them for inductor to fuse."""
    for part in trainer.parts:
        part.compile()


def _expandable():
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return [lambda: torch.cuda.memory._set_allocator_settings("expandable_segments:False")]


def _skip_guards():
    """Dynamo's guards left unevaluated from the second step on (torch.compiler.set_stance's
    skip_guard_eval_unsafe, set by step_fn): a compiled block with one entry runs it unchecked, one
    with several checks only the guards that tell them apart: the host's check before each block call
    (8 a block and step in a pipeline of 8 micro-batches). Unsafe where anything a guard checks
    changes after the first step; this benchmark's steps repeat one shape and mode, and the losses
    against the row without say whether that held. Measured 2026-11-28 (pp2 x tp2 with CUDA graphs):
    no faster (RESULTS.md, CUDA graphs)."""
    return [lambda: torch.compiler.set_stance("default")]


# per-layout options, `layout+option+...`: each sets what it needs of torch (never of meshtron,
# whose public options the layout's flags are) before the build, and returns what undoes it
OPTIONS = {
    "whole": lambda: [],         # each model part compiled whole (_compile_whole; flags_of drops --compile)
    "expandable": _expandable,   # the allocator's expandable segments from this layout's build on
    # the trainer's --cuda-graphs (flags_of adds it): CUDA graphs of the compiled blocks, FSDP's gathered
    # weights kept in place between steps, a new graph generation each step (meshtron.distributed.cuda_graphs)
    "graphs": lambda: [],
    # kept weights, a patch here until --cuda-graphs did it (2026-11-28): now part of +graphs, and accepted
    # so that results/2026-11-28-4xh100-graphs2/run.sh's job names still run (as +graphs)
    "keepweights": lambda: [],
    "skipguards": _skip_guards,  # dynamo's guards unevaluated after the first step (unsafe; measurements only)
    "cudnn": lambda: [], "flash": lambda: [],   # the SDPA backend tried first around each step
}


def split_options(name: str) -> tuple[str, list[str]]:
    base, *opts = name.split("+")
    for o in opts:
        if o not in OPTIONS:
            raise SystemExit(f"unknown option +{o}; known: {', '.join(OPTIONS)}")
    return base, opts


def flags_of(name: str) -> tuple[int, list[str]]:
    name, opts = split_options(name)
    base = name.removesuffix("_compile")
    if base not in LAYOUTS:
        raise SystemExit(f"unknown layout {name}; known: {', '.join(LAYOUTS)} (each also with _compile)")
    world, flags = LAYOUTS[base]
    whole = "whole" in opts
    return world, (flags + (["--compile"] if name.endswith("_compile") and not whole else [])
                   + (["--no-fused-kernels"] if whole else []) + (["--cuda-graphs"] if "graphs" in opts else []))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(trainer, args, opts):
    """trainer.step, under --sdpa's (or the layout's +cudnn / +flash) attention backend
    first and, with --sync-steps, waiting for the GPU after each step."""
    step = trainer.step
    sdpa = next((o for o in opts if o in ("cudnn", "flash")), args.sdpa)
    if sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[sdpa]
        order = [first] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
                           if b != first]

        def step(x, y, inputs=None):
            with sdpa_kernel(order, set_priority=True):
                return trainer.step(x, y, inputs)
    if "skipguards" in opts:   # after the first step, which compiled every block
        guarded, calls = step, []

        def step(x, y, inputs=None):
            out = guarded(x, y, inputs)
            if not calls:
                calls.append(1)
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
            return out
    if args.sync_steps:   # the host waits for each step: a race that needs the CPU ahead shows as a changed loss
        unsynced = step

        def step(x, y, inputs=None):
            out = unsynced(x, y, inputs)
            sync(trainer.device)
            return out
    return step


def timed(step, batches, args, trainer) -> tuple[list, list, float, list[float]]:
    """(every step's (loss, grad norm) and MoE load as device tensors, the warm-up's
    seconds, each round's seconds per step): the CPU runs ahead within a round, as in
    training."""
    trace, loads, device = [], [], trainer.device   # read after the timing

    def one(i):
        trace.append(step(*batches[i % len(batches)]))
        if trainer.moe_stats is not None:   # the worst layer's tokens of its busiest expert / the mean
            loads.append(torch.stack(trainer.moe_stats[3:]))   # [as run, the router's own choice]
    t0 = time.perf_counter()
    for i in range(args.warmup):
        one(i)
        if i == 0 and device.type == "cuda":   # the state a step leaves: weights and optimizer moments
            sync(device)
            trainer.mem_after_first_step = torch.cuda.memory_allocated(device) / 2**30
    sync(device)
    warmup_s = time.perf_counter() - t0
    rounds = []
    for _ in range(args.rounds):
        sync(device)
        t0 = time.perf_counter()
        for i in range(args.steps):
            one(i)
        sync(device)
        rounds.append((time.perf_counter() - t0) / args.steps)
    return trace, loads, warmup_s, rounds


def worst_over_ranks(step_s: float, device, peak: float = 0.0) -> tuple[float, float, float, list[float]]:
    """(step seconds, peak GiB allocated, peak GiB reserved), the largest over ranks,
    and each rank's peak GiB allocated (a pipeline's stages hold different amounts);
    `peak`: a peak read before the allocator's was reset (MemoryPhases)."""
    cuda = device.type == "cuda"
    mem = max(peak, torch.cuda.max_memory_allocated(device) / 2**30) if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else float("nan")
    mine = torch.tensor([step_s, mem, reserved], dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    every = torch.stack(parts)
    worst = every.max(0).values.tolist()
    return worst[0], worst[1], worst[2], [round(m, 3) for m in every[:, 1].tolist()]


def per_rank(values: list[float], device) -> list[list[float]]:
    """Each rank's `values` (the same length on every rank), rounded to 3 places."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [[round(v, 3) for v in t.tolist()] for t in parts]


class MemoryPhases:
    """--memory-phases: per step, GiB allocated when the optimizer step begins
    (weights, gradients, moments and whatever else is live), the peak of the
    forward/backward before it (from the previous optimizer step's end: zero_grad,
    the micro-batches or the pipeline's schedule, the gradient norm), the peak inside
    the optimizer step, and GiB allocated after it. The allocator's peak is reset at
    each boundary: `peak` keeps the largest. Host-side reads only, no synchronization."""

    def __init__(self, optimizer, device):
        self.device, self.rows, self.peak = device, [], 0.0
        self.handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _read(self) -> tuple[float, float]:
        alloc, peak = (torch.cuda.memory_allocated(self.device) / 2**30,
                       torch.cuda.max_memory_allocated(self.device) / 2**30)
        self.peak = max(self.peak, peak)
        torch.cuda.reset_peak_memory_stats(self.device)
        return alloc, peak

    def _pre(self, *_):
        self.rows.append(list(self._read()))

    def _post(self, *_):
        alloc, peak = self._read()
        self.rows[-1] += [peak, alloc]

    def summary(self, skip: int) -> list[float]:
        """[allocated at the optimizer step's start, forward/backward peak, optimizer peak,
        allocated after it]: the largest over the steps after `skip`."""
        rows = [r for r in self.rows[skip:] if len(r) == 4] or self.rows[-1:]
        return [max(r[k] for r in rows) for k in range(4)]

    def close(self):
        for h in self.handles:
            h.remove()


def bubble(result: dict, par, microbatches: int, world: int, device) -> None:
    """The pipeline's bubble, per rank, measured by the profile (the median over its steps):
    `bubble_measured` the share of the step the GPU computes nothing (its TP collectives idle
    too), `bubble_pipeline` the share it runs neither compute nor a collective of its own stage
    (waiting in a pipeline send/recv, or for the host); and the bubble as the schedule predicts it."""
    p = result["profile"]
    # the median over the profiled steps of each one's idle share; the average's without step spans
    idle = torch.tensor([statistics.median(p[steps]) if p.get(steps) else 1 - p[k] / result["step_ms"]
                         for k, steps in (("compute_busy_ms", "compute_idle_steps"),
                                          ("stage_busy_ms", "stage_idle_steps"))], device=device)
    idles = [torch.zeros_like(idle) for _ in range(world)]
    dist.all_gather(idles, idle)
    result["bubble_measured"] = [round(float(t[0]), 4) for t in idles]
    result["bubble_pipeline"] = [round(float(t[1]), 4) for t in idles]
    result["bubble_predicted"] = bubble_fraction(par.pp_schedule, par.pp, microbatches, par.pp_virtual)


def build_with_options(config, opts: list[str]):
    """The Trainer built under the layout's +options; (trainer, what undoes the options, to
    run after measuring)."""
    undo = [u for o in opts for u in OPTIONS[o]()]
    trainer = Trainer(config, verbose=False)
    if "whole" in opts:
        _compile_whole(trainer)
    return trainer, undo


def measure(name: str, recipe_flags: list[str], args) -> dict:
    world, flags = flags_of(name)
    # lr 1e-4 unless the flags say otherwise: at the recipe's 1e-3 the first steps of a
    # 1B model are chaotic and layouts' losses part within a few steps (docs/performance.md)
    steps = args.warmup + args.rounds * args.steps + 1
    config = Config.from_args(["--dtype", "bf16", "--lr", "1e-4", "--steps", str(steps)] + recipe_flags + flags,
                              models=models.PRESETS)
    opts = split_options(name)[1]
    t0 = time.perf_counter()
    trainer, undo = build_with_options(config, opts)
    build_s = time.perf_counter() - t0
    device = trainer.device
    cuda = device.type == "cuda"
    static_gib = torch.cuda.memory_allocated(device) / 2**30 if cuda else 0.0   # built: weights (moments come later)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    phases = MemoryPhases(trainer.optimizer, device) if args.memory_phases and cuda else None
    trainer.mem_after_first_step = 0.0
    batches = [trainer.next_batch() for _ in range(4)]   # (x, y, the per-token inputs of --document-mask)
    step = step_fn(trainer, args, opts)
    sdpa = next((o for o in opts if o in ("cudnn", "flash")), args.sdpa)
    trace, loads, warmup_s, rounds = timed(step, batches, args, trainer)
    losses, norms = ([round(float(t[k]), 5) for t in trace] for k in (0, 1))
    step_s, mem, reserved, mem_ranks = worst_over_ranks(statistics.median(rounds), device,
                                                        phases.peak if phases else 0.0)
    mem_static = per_rank([static_gib, trainer.mem_after_first_step], device)
    tokens = trainer.global_batch * config.training.seq_len
    tps_gpu = tokens / step_s / world
    peak = peak_tflops(device)
    flops = trainer.model_config.flops_per_token(config.training.seq_len)
    result = dict(layout=name, model=config.model.model, world=world, flags=" ".join(recipe_flags + flags),
                  sdpa=sdpa,
                  global_batch=trainer.global_batch, seq_len=config.training.seq_len, step_ms=step_s * 1e3,
                  step_ms_rounds=[r * 1e3 for r in rounds], tokens_per_s_per_gpu=tps_gpu,
                  tflops_per_gpu=tps_gpu * flops / 1e12, mfu=tps_gpu * flops / 1e12 / peak if peak else None,
                  peak_mem_gib=mem, peak_mem_gib_ranks=mem_ranks, peak_reserved_gib=reserved,
                  built_mem_gib_ranks=[r[0] for r in mem_static], first_step_mem_gib_ranks=[r[1] for r in mem_static],
                  build_s=build_s, warmup_s=warmup_s,
                  loss_first=losses[0], loss_last=losses[-1], losses=losses, grad_norms=norms,
                  params=trainer.model_config.num_params(),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__)
    if loads:   # throughput depends on the routing: every MoE figure carries its load balance
        loads, own = ([round(float(x[j]), 3) for x in loads] for j in (0, 1))
        result.update(expert_load_max_over_mean=loads, expert_load_timed_max=max(loads[args.warmup:]),
                      router_load_timed_max=max(own[args.warmup:]),
                      batch_balance=trainer.model_config.moe.batch_balance,
                      balanced_routing=trainer.model_config.moe.balanced)
    if phases:   # per rank: [allocated at the optimizer step, fwd/bwd peak, optimizer peak, allocated after]
        result["memory_phases_gib_ranks"] = per_rank(phases.summary(args.warmup), device)
        phases.close()
    if args.check_replicas:
        result["replica_spread"] = replica_spread(trainer.parts)
    if args.profile_steps:
        tag = f"{name}_w{world}_r{dist.get_rank()}"
        result["profile"] = profile(lambda i: step(*batches[i % len(batches)]), args.profile_steps, device,
                                    os.path.join(args.out, f"profile_{tag}.txt"),
                                    os.path.join(args.out, f"trace_{tag}.json.gz") if args.trace else None)
        if config.parallel.pp > 1:
            bubble(result, config.parallel, trainer.microbatches, world, device)
    trainer = batches = step = trace = None    # the closures hold them too: drop every reference, then collect
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for u in undo:
        u()
    return result


def replica_spread(parts) -> dict:
    """Every parameter replicated over a mesh axis whose copies on that axis' ranks
    differ, with the largest difference (a correct layout keeps them bit-equal)."""
    from torch.distributed.tensor import DTensor
    spread = {}
    for name, p in ((n, p) for m in parts for n, p in m.named_parameters()):
        if not isinstance(p, DTensor):
            continue
        for axis, placement in enumerate(p.placements):
            if placement.is_replicate() and p.device_mesh.size(axis) > 1:
                group = p.device_mesh.get_group(axis)
                hi, lo = p.to_local().detach().float(), p.to_local().detach().float()
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
                worst = float((hi - lo).abs().max())
                if worst > 0:
                    spread[f"{name}@{p.device_mesh.mesh_dim_names[axis]}"] = worst
    return spread


KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention", "sdpa")),   # before gemm: cuDNN's
         ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")),           # sdpa kernels say sm90_ too
         ("optimizer", ("adam", "multi_tensor")),
         ("casts", ("to_copy", "copy_kernel", "memcpy", "memset")),                   # dtype casts and copies
         ("triton", ("triton", "_rms", "_swiglu", "_ln_")),                           # inductor's fused kernels too
         ("elementwise", ("elementwise", "reduce_kernel", "vectorized", "embedding", "index")))


def profile(step, n: int, device, path: str, trace: str | None = None) -> dict:
    """GPU kernel time per step by kind, the busy union, the communication time and
    the part of it no compute kernel overlaps (exposed); the top kernels to `path`,
    and the timeline to `trace` (a gzipped Chrome trace) if given."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    sync(device)
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            with torch.profiler.record_function(f"{STEP_MARK}{i}"):   # its span on the GPU: the step's kernels
                step(i)
        sync(device)
    wall = (time.perf_counter() - t0) / n * 1e3
    if trace:
        raw = trace.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(trace, "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
    # kernels and copies only: record_function ranges (a collective's annotation) show on the GPU too
    kernels = [e for e in prof.events()
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    by_kind = dict.fromkeys([k for k, _ in KINDS] + ["other"], 0.0)
    comm, compute = [], []
    for e in kernels:
        name = e.name.lower()
        kind = next((k for k, keys in KINDS if any(s in name for s in keys)), "other")
        by_kind[kind] += e.time_range.elapsed_us() / 1e3 / n
        # NCCL kernels and the peer-to-peer copies of symmetric memory (--tp-overlap-comm copy-engine) move data
        span = (e.time_range.start, e.time_range.end)
        peer_copy = name.startswith("memcpy") and ("ptop" in name or "dtod" in name)
        (comm if kind == "nccl" or peer_copy else compute).append(span)
    nccl_ops = collections.Counter()   # NCCL kernel time by operation (SendRecv: all-to-all and p2p)
    for e in kernels:
        if "nccl" in e.name.lower():
            op = next((o for o in ("AllGather", "ReduceScatter", "AllReduce", "SendRecv", "Broadcast", "AllToAll")
                       if o.lower() in e.name.lower()), "other")
            nccl_ops[f"nccl_{op}_ms"] += e.time_range.elapsed_us() / 1e3 / n
    host = collections.Counter()   # the host waiting for the GPU (a .tolist() / .item() of a device tensor)
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name in ("cudaStreamSynchronize", "cudaEventSynchronize",
                                                          "cudaMemcpyAsync"):
            host[f"host_{e.name}_ms"] += e.time_range.elapsed_us() / 1e3 / n
            host[f"host_{e.name}_calls"] += 1 / n
    busy_u, comm_u, compute_u = _union(comm + compute), _union(comm), _union(compute)
    stage_u = stage_spans([(e.name, e.time_range.start, e.time_range.end) for e in kernels])
    busy, comm_total, stage = _length(busy_u), _length(comm_u), _length(stage_u)
    # each step's GPU span (its record_function, as the GPU ran it): per-step idle shares
    marks = sorted(e.time_range.start for e in prof.events() if e.device_type == DeviceType.CUDA
                   and e.name.startswith(STEP_MARK))
    end = max((e.time_range.end for e in kernels), default=0)
    per_step = {"compute_idle_steps": step_idle(compute_u, marks, end),
                "stage_idle_steps": step_idle(stage_u, marks, end)}
    exposed = comm_total - _length(_intersect(comm_u, compute_u))
    gaps = _gaps(busy_u, kernels, n)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=110))
        # host time: a step bound by its CPU, or by the CPU waiting for the GPU (synchronizations), shows here
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
        f.write("\nGPU idle gaps over 0.5 ms, per step: " + gaps)
    return {"wall_ms": wall, "gpu_busy_ms": busy / 1e3 / n, "compute_busy_ms": _length(compute_u) / 1e3 / n,
            "stage_busy_ms": stage / 1e3 / n, "comm_ms": comm_total / 1e3 / n,
            "exposed_comm_ms": exposed / 1e3 / n, **{f"{k}_ms": v for k, v in by_kind.items()}, **per_step,
            **dict(nccl_ops), **dict(host)}


STEP_MARK = "bench_train_step_"


def step_idle(busy: list, starts: list, end: float) -> list[float]:
    """Per profiled step, the share of its time (from its first kernel to the next step's,
    the last to `end`) that no span of the union `busy` covers: a pipeline's bubble step by step."""
    bounds = list(zip(starts, starts[1:] + [end]))
    return [round(1 - _length(_intersect(busy, [[s, e]])) / (e - s), 4) for s, e in bounds if e > s]


def stage_spans(kernels: list) -> list:
    """The union of a rank's kernels, (name, start, end) each, but the pipeline's
    peer-to-peer ones (NCCL SendRecv): its stage's compute and collectives."""
    return _union([(s, e) for name, s, e in kernels if "sendrecv" not in name.lower()])


def stage_busy(kernels: list) -> float:
    """The time stage_spans covers."""
    return _length(stage_spans(kernels))


def _gaps(busy: list, kernels: list, n: int) -> str:
    """The GPU's idle gaps over 0.5 ms: their count and time per step, and the
    kernels most often found right after one (what the GPU waited for)."""
    starts = sorted((e.time_range.start, e.name[:60]) for e in kernels)
    gaps = [(busy[i + 1][0] - busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)
            if busy[i + 1][0] - busy[i][1] > 500]
    after = collections.Counter()
    j = 0
    for _, t in sorted(gaps, key=lambda g: g[1]):
        while j < len(starts) and starts[j][0] < t:
            j += 1
        if j < len(starts):
            after[starts[j][1]] += 1
    return (f"{len(gaps) / n:.1f} gaps, {sum(g for g, _ in gaps) / 1e3 / n:.1f} ms; next kernel: "
            + "; ".join(f"{k} x{v}" for k, v in after.most_common(6)))


def _union(spans: list) -> list:
    merged = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _intersect(a: list, b: list) -> list:
    """Of two sorted unions of intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list) -> float:
    return sum(e - s for s, e in spans)


def summarize(path: str, peer_path: str | None, baseline: str | None = None) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if baseline:   # each row against the baseline layout of its model
        base = {r["model"]: r for r in rows if r.get("layout") == baseline and "error" not in r}
        print(f"| layout | model | step ms | tokens/s/GPU | vs {baseline} | peak GiB allocated / reserved |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            b = base.get(r.get("model"))
            if "error" in r or b is None:
                print(f"| {r['layout']} | {r.get('model')} | {r.get('error', 'no baseline')[:100]} | | | |")
                continue
            print(f"| {r['layout']} | {r['model']} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                  f"{r['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.3f}x | "
                  f"{r['peak_mem_gib']:.1f} / {r['peak_reserved_gib']:.1f} |")

    peers = {}
    if peer_path and os.path.exists(peer_path):
        peers = {r["layout"]: r for r in map(json.loads, open(peer_path)) if r.get("tokens_per_s_per_gpu")}
    print("| layout | GPUs | step ms (median) | tokens/s/GPU | MFU | peak GiB (allocated / reserved) "
          "| MoE load max/mean (timed steps' worst) | peer tokens/s/GPU | peer peak GiB (reserved) | meshtron / peer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layout']} | {r['world']} | {r['error'][:100]} | | | | | | | |")
            continue
        p = peers.get(r["layout"], {})
        ratio = f"{r['tokens_per_s_per_gpu'] / p['tokens_per_s_per_gpu']:.3f}x" if p else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        load = ""
        if "expert_load_timed_max" in r:
            load = f"{r['expert_load_timed_max']:.2f}"
            if r["balanced_routing"]:
                load += " (balanced routing)"
            elif r.get("batch_balance"):
                load += f" (router's own {r['router_load_timed_max']:.2f})"
        if r.get("profile"):
            print("  profile (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in r["profile"].items()
                                                    if isinstance(v, (int, float))))
        print(f"| {r['layout']} | {r['world']} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | {mfu} | "
              f"{r['peak_mem_gib']:.1f} / {r.get('peak_reserved_gib', float('nan')):.1f} | {load} | "
              f"{p.get('tokens_per_s_per_gpu', 0):,.0f} | {p.get('peak_mem_gib', 0):.1f} "
              f"| {ratio} |")


def forget() -> None:
    """Drop what a failed measurement left behind (its graphs, its tensors)."""
    gc.collect()
    torch._dynamo.reset()


def error_text(e: BaseException) -> str:
    """`Type: message` of an exception and of each one it was raised from: the pipeline's
    "[Stage 0] failed to run forward" names no cause of its own."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {str(e).strip()[:1500]}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def record(result: dict, path: str) -> None:
    """Print one result and append it to a .jsonl file (rank 0), then wait for every rank."""
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1gpu", help="comma list of LAYOUTS names (each also with _compile, and "
                   "+OPTIONS: 1gpu_compile+cudnn+expandable)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=0, help="then profile this many steps: kernel time by kind")
    p.add_argument("--trace", action="store_true", help="with --profile-steps: also write the profiled steps' "
                   "timeline, a Chrome trace per rank (trace_<layout>_w<world>_r<rank>.json.gz)")
    p.add_argument("--sdpa", default="default", choices=["default", "cudnn", "flash"],
                   help="attention backend preferred around each step (an experiment's knob)")
    p.add_argument("--sync-steps", action="store_true", help="synchronize the GPU after every step")
    p.add_argument("--memory-phases", action="store_true", help="record GiB allocated at, and the peaks before and "
                   "inside, each optimizer step (memory_phases_gib_ranks)")
    p.add_argument("--check-replicas", action="store_true",
                   help="after the run, report parameters whose replicas differ across ranks")
    p.add_argument("--out", default=".")
    p.add_argument("--summarize", default=None, help="print the table of a results.jsonl")
    p.add_argument("--peer", default=None, help="with --summarize: the peers' results (same layout names)")
    p.add_argument("--baseline", default=None, help="with --summarize: also each row's tokens/s against this layout's")
    args, recipe_flags = p.parse_known_args()
    if args.summarize:
        summarize(args.summarize, args.peer, args.baseline)
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    init_process_group(600)
    world = dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)
    for name in args.layouts.split(","):
        if flags_of(name)[0] != world:
            continue
        try:
            result = measure(name, recipe_flags, args)
        except Exception as e:  # noqa: BLE001 - record and go on with the next layout
            result = dict(layout=name, world=world, error=error_text(e))
            forget()
        record(result, os.path.join(args.out, "results.jsonl"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
