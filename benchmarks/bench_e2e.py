"""End-to-end training step on one GPU: meshtron's recipe step (kernels on/off,
torch.compile on/off) next to a plain PyTorch loop of the same model, same run.

    python3 benchmarks/bench_e2e.py --models 350M,1.3B --steps 10

Every configuration: bf16 compute with fp32 master weights (the plain loop:
torch.autocast on fp32 weights; meshtron: bf16 weights through FSDP2's mixed
precision on the size-1 dp mesh, see parallelize.py), fused AdamW, grad
clipping at 1.0, sequence 2048, random tokens. Step time = wall time of `steps`
steps between two synchronisations / steps (the CPU may run ahead, as in
training), after `warmup` steps; `rounds` such times, their median quoted. meshtron's
configs take the recipe's loss (`parallelize.loss_function`: cross-entropy compiled
on a GPU); a name ending in `_eagerloss` takes the eager one. MFU against 989 TFLOP/s dense bf16. The loss
curves of kernels on and off (same init, same batches) are printed side by side.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron import ParallelConfig, init_mesh, parallelize, train  # noqa: E402
from meshtron.models import GPT, gpt_config  # noqa: E402
from meshtron.parallelize import loss_function  # noqa: E402

PEAK = 989e12


def batches(cfg, n, mb, T, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(n):
        xy = torch.randint(0, cfg.vocab_size, (mb, T + 1), generator=g)
        out.append((xy[:, :-1].to(device), xy[:, 1:].to(device)))
    return out


def run(name, step_fn, data, warmup, steps, rounds, device, flops_per_step):
    losses = []
    for i in range(warmup):
        losses.append(step_fn(data[i % len(data)]))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(steps):
            loss = step_fn(data[(warmup + i) % len(data)])
            if r == 0:
                losses.append(loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps)
    dt = statistics.median(times)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return dict(name=name, ms=dt * 1e3, mfu=flops_per_step / dt / PEAK, mem=mem, losses=[float(x) for x in losses],
                rounds_ms=[t * 1e3 for t in times])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="350M,1.3B")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="plain,plain_compiled,kernels_off,kernels_on,kernels_on_eagerloss,kernels_off_compiled")
    args = p.parse_args()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_mesh(dp=1)
    amp_dtype = torch.bfloat16
    configs = args.configs.split(",")
    for preset in args.models.split(","):
        rows = []
        for cname in configs:
            fused = cname.startswith("kernels_on")
            compiled = "compiled" in cname
            cfg = gpt_config(preset, fused_kernels=fused)
            T, mb = args.seq_len, args.micro_batch
            data = batches(cfg, 4, mb, T, device)
            flops = cfg.flops_per_token(T) * mb * T
            torch.manual_seed(0)
            model = GPT(cfg, seed=None).to(device)
            model.init_weights(0)
            if cname.startswith("plain"):
                # the plain loop: no meshtron in the step, the model as nn.Module
                fwd = torch.compile(model) if compiled else model
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)

                def step(b, fwd=fwd, opt=opt, model=model):
                    x, y = b
                    with torch.autocast(device.type, dtype=amp_dtype):
                        logits = fwd(x)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss.detach()
            else:
                pcfg = ParallelConfig(param_dtype="bf16", compile=compiled)
                model = parallelize(model, mesh, pcfg)
                loss_fn = train.cross_entropy if cname.endswith("_eagerloss") else loss_function(mesh, pcfg, device)
                opt = train.build_optimizer(model, 1e-4)

                def step(b, model=model, opt=opt, loss_fn=loss_fn):
                    loss, _ = train.train_step(model, opt, None, [b], mesh, max_norm=1.0,
                                               forward_backward=lambda m, mbs, me: train.forward_backward(
                                                   m, mbs, me, loss_fn=loss_fn))
                    return loss
            r = run(cname, step, data, args.warmup, args.steps, args.rounds, device, flops)
            rows.append(r)
            print(f"{preset} {cname}: {r['ms']:.1f} ms/step (rounds: {', '.join(f'{t:.1f}' for t in r['rounds_ms'])}), "
                  f"MFU {100 * r['mfu']:.1f}%, peak {r['mem']:.1f} GiB", flush=True)
            del model, opt, step
            if cuda:
                torch.cuda.empty_cache()
        base = next((r for r in rows if r["name"] == "plain"), rows[0])
        print(f"\n{preset}: seq {args.seq_len}, micro-batch {args.micro_batch}, {cfg.flops_per_token(args.seq_len) / 1e9:.2f} "
              f"GFLOP/token; torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if cuda else ""))
        print(f"{'config':<22}{'ms/step':>9}{'MFU':>8}{'vs plain':>10}{'peak GiB':>10}")
        for r in rows:
            print(f"{r['name']:<22}{r['ms']:>9.1f}{100 * r['mfu']:>7.1f}%{base['ms'] / r['ms']:>9.2f}x{r['mem']:>10.1f}")
        on = next((r for r in rows if r["name"] == "kernels_on"), None)
        off = next((r for r in rows if r["name"] == "kernels_off"), None)
        if on and off:
            diff = max(abs(a - b) for a, b in zip(on["losses"], off["losses"]))
            print("loss kernels on : " + " ".join(f"{x:.4f}" for x in on["losses"]))
            print("loss kernels off: " + " ".join(f"{x:.4f}" for x in off["losses"]))
            print(f"max |difference| {diff:.4f} (bf16 noise: the two paths round differently)")
        print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
