"""Train meshtron's GPT under any layout of the one mesh.

    torchrun --nproc-per-node 4 recipes/train_gpt.py --model tiny --dp 2 --tp 2 --steps 50
    python recipes/train_gpt.py --model tiny --steps 20          # one process

Data: the Python standard library's sources (default), a text file or
directory (--data PATH), or a uint16/uint32 token file (--data file.u16).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron import ParallelConfig, checkpoint, degree, init_mesh, parallelize, train  # noqa: E402
from meshtron.data import BatchLoader, load_tokens  # noqa: E402
from meshtron.metrics import Throughput, peak_memory_gib  # noqa: E402
from meshtron.models import GPT, gpt_config  # noqa: E402
from meshtron.parallelize import loss_context, loss_function  # noqa: E402
from meshtron.pipeline_parallel import pipeline_forward_backward, split_model  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset: tiny, 125M, 350M, 1.3B, 2.7B, 6.7B")
    p.add_argument("--pos-emb", choices=["learned", "rope"], default=None)
    for axis in ("dp", "pp", "cp", "tp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=-1 if axis == "dp" else 1, help=f"{axis} degree")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument("--no-loss-parallel", action="store_true", help="gather the logits instead of a vocab-parallel loss")
    p.add_argument("--pp-schedule", default="1f1b", help="gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv")
    p.add_argument("--pp-virtual", type=int, default=1, help="virtual stages per pp rank (interleaved schedules)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: pp)")
    p.add_argument("--untie-embeddings", action="store_true", help="a separate output head instead of the tied embedding")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage over the dp axes")
    p.add_argument("--hsdp", type=int, default=1, help="HSDP replica groups (1 = plain FSDP)")
    p.add_argument("--recompute", choices=["none", "full", "selective"], default="none")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--no-fused-kernels", action="store_true", help="plain PyTorch LayerNorm/GeLU on GPU")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch per rank")
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step (default: no accumulation)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip by global gradient norm (0: off)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (master weights fp32)")
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32", help="gradient reduction dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text file/dir or .u16/.u32 token file (default: Python stdlib)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--pg-timeout", type=float, default=600, help="seconds a collective may wait before the job fails")
    p.add_argument("--checkpoint-dir", default=None, help="save DCP checkpoints under this directory")
    p.add_argument("--checkpoint-interval", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest K checkpoints")
    p.add_argument("--resume", default="none", help="none, auto (newest complete checkpoint in --checkpoint-dir), or a path")
    p.add_argument("--data-rebatch", action="store_true",
                   help="resume with another global batch / sequence length at the same token count")
    p.add_argument("--import-safetensors", default=None, help="start from these (HF GPT-2) safetensors weights")
    p.add_argument("--export-safetensors", default=None, help="write HF GPT-2 safetensors here at the end")
    p.add_argument("--exit-after", type=int, default=None, help="stop this run after N steps (the schedule still spans --steps)")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="fault-recovery demo: rank 1 dies at this step on the first attempt of a torchrun job")
    return p.parse_args(argv)


def init_distributed(timeout_s: float) -> None:
    """The default process group, with our own timeout (a lost peer fails the job,
    and torchrun --max-restarts restarts it). torchrun's agent keeps one store
    across restarts, so keys are prefixed by attempt: a restarted job must not
    read the addresses a dead attempt published."""
    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"meshtron/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def build(model, mesh, pcfg, args, device, microbatches):
    """Parallelize the (meta-device) model, materialize and initialize it; return
    it (or this rank's pipeline stages) and its forward-backward function."""
    if degree(mesh, "pp") > 1:
        model = split_model(model, mesh, args.pp_schedule, args.pp_virtual, microbatches)
        modules = model.stages
        fb = partial(pipeline_forward_backward, loss_fn=train.cross_entropy, loss_context=loss_context(mesh, pcfg))
    else:
        modules = [model]
        fb = partial(train.forward_backward, loss_fn=loss_function(mesh, pcfg, device), loss_context=loss_context(mesh, pcfg))
    for m in modules:
        parallelize(m, mesh, pcfg)
        m.to_empty(device=device)
        m.init_weights(args.seed)   # values keyed by parameter name: the same under any layout
    return model, fb


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    overrides = {"fused_kernels": not args.no_fused_kernels}
    if args.untie_embeddings:
        overrides["tie_embeddings"] = False
    if args.pos_emb:
        overrides["pos_emb"] = args.pos_emb
    cfg = gpt_config(args.model, **overrides)
    if args.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    init_distributed(args.pg_timeout)
    mesh = init_mesh(args.dp, args.pp, args.cp, args.tp, args.ep, config=cfg, seq_len=args.seq_len)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    batch_index, batch_ranks = train.batch_slice(mesh)
    pp = degree(mesh, "pp")
    microbatches = args.microbatches or (pp if pp > 1 else 1)
    global_batch = args.global_batch or args.micro_batch * microbatches * batch_ranks

    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    pcfg = ParallelConfig(zero_stage=args.zero, hsdp=args.hsdp, param_dtype=args.dtype, reduce_dtype=args.reduce_dtype,
                          sp=args.sp, loss_parallel=not args.no_loss_parallel, recompute=args.recompute,
                          compile=args.compile)
    model, fb = build(model, mesh, pcfg, args, device, microbatches)
    optimizer = train.build_optimizer(model, args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train.warmup_cosine(args.warmup, args.steps, args.min_lr_ratio))

    loader = BatchLoader(load_tokens(args.data), args.seq_len, global_batch, batch_index, batch_ranks,
                         args.micro_batch, seed=args.seed)
    if pp > 1 and loader.local_batch != microbatches * loader.micro_batch:
        raise ValueError(f"with --pp the local batch {loader.local_batch} must be --microbatches {microbatches} "
                         f"x --micro-batch {loader.micro_batch}")
    parts = model.stages if degree(mesh, "pp") > 1 else [model]
    layout = {a: degree(mesh, a) for a in mesh.mesh_dim_names} | {"zero": args.zero}
    start = 0
    if args.import_safetensors:
        checkpoint.import_safetensors(parts, args.import_safetensors)
    resume = checkpoint.latest(args.checkpoint_dir) if args.resume == "auto" and args.checkpoint_dir else \
        (None if args.resume in ("none", "auto") else args.resume)
    if resume:
        start = checkpoint.load(resume, parts, optimizer, scheduler, loader, config=cfg, rebatch_by_tokens=args.data_rebatch)
        if rank == 0:
            print(f"resumed from {resume} at step {start}", flush=True)
    meter = Throughput(cfg.flops_per_token(args.seq_len), dist.get_world_size(), device)
    if rank == 0:
        n_params = cfg.num_params()
        print(f"meshtron | {args.model} ({n_params / 1e6:.1f}M params) | mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} "
              f"| global batch {global_batch} x {args.seq_len} tokens, {loader.local_batch // loader.micro_batch} "
              f"micro-batches of {args.micro_batch} | {loader.n_samples} samples", flush=True)
    losses, t_start = [], time.perf_counter()
    last = min(args.steps, start + args.exit_after) if args.exit_after else args.steps
    for step in range(start + 1, last + 1):
        if step == args.crash_at_step and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os._exit(13)   # a rank lost mid-run; torchrun --max-restarts restarts the job
        loss, norm = train.train_step(model, optimizer, scheduler, loader.next(), mesh, max_norm=args.max_norm or None,
                                      forward_backward=fb)
        meter.add(global_batch * args.seq_len)
        losses.append(loss)     # a device tensor: reading it every step would sync the GPU
        if rank == 0 and (step % args.log_interval == 0 or step == args.steps or step == 1):
            m = meter.report()
            elapsed = time.perf_counter() - t_start
            eta = elapsed / (step - start) * (args.steps - step)
            line = (f"step {step:>6}/{args.steps} | loss {float(losses[-1]):.4f} | lr {scheduler.get_last_lr()[0]:.2e} "
                    f"| grad norm {float(norm):.3f} | {m['tokens_per_s']:,.0f} tok/s "
                    f"({m['tokens_per_s_per_gpu']:,.0f}/gpu) | {m['tflops_per_gpu']:.2f} TFLOP/s/gpu")
            if "mfu" in m:
                line += f" | MFU {100 * m['mfu']:.1f}%"
            mem = peak_memory_gib(device)
            if mem is not None:
                line += f" | peak mem {mem:.2f} GiB" + (" (host RSS)" if device.type == "cpu" else "")
            line += f" | eta {eta:,.0f}s"
            print(line, flush=True)
        if args.checkpoint_dir and (step % args.checkpoint_interval == 0 or step == args.steps):
            checkpoint.save(args.checkpoint_dir, step, parts, optimizer, scheduler, loader, config=cfg, layout=layout,
                            keep=args.keep_checkpoints)
    if args.export_safetensors:
        checkpoint.export_safetensors(parts, args.export_safetensors)
    if pp > 1:  # memory differs by stage: the first holds the most micro-batches in flight
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (model.stage_ids, peak_memory_gib(device)))
        if rank == 0:
            for r, (ids, mem) in enumerate(per_rank):
                print(f"rank {r} stages {ids}: peak mem {mem:.2f} GiB" + (" (host RSS)" if device.type == "cpu" else ""))
    return [float(x) for x in losses]


if __name__ == "__main__":
    if "RANK" not in os.environ:   # plain `python recipes/train_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    main()
    dist.destroy_process_group()
