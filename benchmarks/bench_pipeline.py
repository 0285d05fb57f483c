"""Pipeline schedules on 2 GPUs: tokens/s/GPU, measured vs predicted bubble, memory per stage.

    torchrun --nproc-per-node 2 benchmarks/bench_pipeline.py --model 1.3B --microbatches 8

Measured bubble = 1 - T_ideal / T_step, where T_ideal = m * t_mb / pp and t_mb is
the whole model's forward+backward time for one micro-batch on one GPU (measured
first, on rank 0, in the same run): a perfect pipeline would split that work
evenly over pp GPUs with no idle time. Compute in bf16 (autocast), fp32 weights.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron import init_mesh, train  # noqa: E402
from meshtron.models import GPT, gpt_config  # noqa: E402
from meshtron.pipeline_parallel import bubble_fraction, pipeline_forward_backward, split_model  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)]


def timed(fn, steps, warmup, device):
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1.3B")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = gpt_config(args.model, tie_embeddings=False)
    mesh = init_mesh(dp=1, pp=world)
    amp = (lambda: torch.autocast("cuda", torch.bfloat16)) if cuda else None
    m, T, mb = args.microbatches, args.seq_len, args.micro_batch
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (m * mb, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (m * mb, T), generator=g)
    tokens = m * mb * T

    # one micro-batch through the whole model on one GPU: the work a perfect pipeline shares out
    t_mb = None
    if rank == 0:
        full = GPT(cfg, seed=None).to(device)
        full.init_weights(0)
        xs, ys = x[:mb].to(device), y[:mb].to(device)

        def one():
            with amp() if amp else torch.enable_grad():
                loss = train.cross_entropy(full(xs), ys)
            loss.backward()
        t_mb = timed(one, args.steps, args.warmup, device)
        del full
        if cuda:
            torch.cuda.empty_cache()
    box = [t_mb]
    dist.broadcast_object_list(box, src=0)
    t_mb = box[0]

    rows = []
    for sched, v in SCHEDULES:
        with torch.device("meta"):
            model = GPT(cfg, seed=None)
        pipe = split_model(model, mesh, sched, v, m)
        for s in pipe.stages:
            s.to_empty(device=device)
            s.init_weights(0)
        opt = train.build_optimizer(pipe, 1e-4)
        if cuda:
            torch.cuda.reset_peak_memory_stats()

        def step():
            pipeline_forward_backward(pipe, [(x, y)], mesh, loss_fn=train.cross_entropy, loss_context=amp)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t_step = timed(step, args.steps, args.warmup, device)
        mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        mems = [None] * world
        dist.all_gather_object(mems, mem)
        ideal = m * t_mb / world
        rows.append((sched, v, t_step, tokens / t_step / world, 1 - ideal / t_step, bubble_fraction(sched, world, m, v), mems))
        del pipe, opt, model
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        flops = cfg.flops_per_token(T)
        print(f"\n{args.model} pp={world} m={m} micro-batch {mb}x{T}; one-GPU fwd+bwd per micro-batch {1e3 * t_mb:.1f} ms "
              f"(= {flops * mb * T / t_mb / 1e12:.0f} TFLOP/s); torch {torch.__version__}"
              + (f", {torch.cuda.get_device_name()}" if cuda else ""))
        print(f"{'schedule':<18}{'v':>2}{'step ms':>9}{'tok/s/GPU':>11}{'TFLOP/s/GPU':>12}{'bubble meas':>12}{'pred':>7}  mem/stage GiB")
        for sched, v, t, tps, meas, pred, mems in rows:
            print(f"{sched:<18}{v:>2}{1e3 * t:>9.1f}{tps:>11,.0f}{tps * flops / 1e12:>12.1f}{meas:>12.3f}{pred:>7.3f}  "
                  + " / ".join(f"{mm:.1f}" for mm in mems))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
