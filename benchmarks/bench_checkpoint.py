"""What a checkpoint costs the step loop: blocking saves against --checkpoint-async,
for any registered model under any layout.

    # two GPUs, Llama-1B, dp2 ZeRO-3: 30 steps, a save every 10
    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py --model llama-1B --dp 2 --zero 3 --dtype bf16 \
        --seq-len 2048 --micro-batch 4 --steps 30 --every 10 --dir /tmp/bench-ck --out $OUT
    # the CPU, the tiny model (two gloo ranks, or one process)
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py --model tiny --dp 2 --zero 3 \
        --seq-len 32 --micro-batch 4 --steps 12 --every 4 --dir /tmp/bench-ck

For each mode (sync, then async) the Trainer is built as recipes/train.py builds it
(every flag this script does not know goes to the recipe), saving into a fresh
subdirectory of --dir with --keep-checkpoints 1. It runs --warmup steps, then
--steps steps, saving after every --every of them through the Trainer's CheckpointManager.
The device is synchronized after each step, so a step's time is its own, and after
each save: a save's hold is the time from the loop calling it to the device being
free again (for async: waiting for the previous save, the copy into host memory
and starting the writer; for sync: the whole write). A step counts as "in flight"
when a background write was running as it started. The largest time over ranks is
reported. Printed: each step's time, each save's hold, then per mode the median
step without a save in flight, with one in flight, the median hold, and the hold
ratio sync / async; --out DIR appends the same as one JSON line per mode to
DIR/checkpoint.jsonl.

After the async mode's timing, a check (--no-check skips it: on a large model it is one
more whole write and read): one more save, one more step while it is
written (changing the weights and AdamW state in place), then the checkpoint is
loaded back and every tensor of every rank must equal, bit for bit, the state at
the step it was saved (on a GPU this covers the copies into pinned memory that the
loop does not wait for). A mismatch fails the script.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.distributed.tensor import DTensor  # noqa: E402

from meshtron import Config, Trainer, models  # noqa: E402
from meshtron.train import checkpoint  # noqa: E402
from meshtron.train.lifetime import init_process_group  # noqa: E402


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worst(values: list[float], device) -> list[float]:
    """Each value's largest over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(mode: str, recipe_flags: list[str], args) -> dict:
    directory = os.path.join(args.dir, mode)
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    total = args.warmup + args.steps
    flags = ["--steps", str(total), "--checkpoint-dir", directory, "--checkpoint-interval", str(total + 1),
             "--keep-checkpoints", "1"] + (["--checkpoint-async"] if mode == "async" else [])
    trainer = Trainer(Config.from_args(recipe_flags + flags, models=models.PRESETS), verbose=False)
    device = trainer.device
    for i in range(args.warmup):
        trainer.step(*trainer.next_batch())
        if i == 0:   # as Trainer.train: the async host copy made beside the steps after the first
            trainer.checkpoints.prepare()
    sync(device)
    step_s, in_flight, holds, writes = [], [], [], []
    started = None   # when the save being written in the background was called
    for i in range(1, args.steps + 1):
        writing = trainer.checkpoints.in_flight is not None
        if started is not None and not writing:   # one entry per save on every rank, whenever each notices
            writes[-1], started = time.perf_counter() - started, None
        t0 = time.perf_counter()
        trainer.step(*trainer.next_batch())
        sync(device)
        step_s.append(time.perf_counter() - t0)
        in_flight.append(writing)
        if i % args.every == 0 and len(holds) < args.max_saves:
            t0 = time.perf_counter()
            if started is not None:   # the previous write still runs: the save waits for it (part of its hold)
                trainer.checkpoints.wait()
                writes[-1], started = time.perf_counter() - started, None
            trainer.checkpoints.save(args.warmup + i)
            sync(device)
            holds.append(time.perf_counter() - t0)
            if mode == "async":
                started = t0
                writes.append(0.0)
    t0 = time.perf_counter()
    trainer.checkpoints.wait()
    last_wait_s = time.perf_counter() - t0
    if started is not None:
        writes[-1] = time.perf_counter() - started
    check = check_async(trainer, total + 1) if mode == "async" and args.check else None
    trainer.close()
    step_s, holds, writes = worst(step_s, device), worst(holds, device), worst(writes, device)
    # a step is in flight when any rank's writer was running as it started
    flags_any = worst([float(w) for w in in_flight], device)
    idle = [s for s, w in zip(step_s, flags_any) if not w]
    busy = [s for s, w in zip(step_s, flags_any) if w]
    result = dict(mode=mode, model=trainer.config.model.model, world=dist.get_world_size(),
                  flags=" ".join(recipe_flags), steps=args.steps, every=args.every,
                  step_ms=[s * 1e3 for s in step_s], in_flight=[bool(w) for w in flags_any],
                  hold_ms=[h * 1e3 for h in holds], last_wait_ms=last_wait_s * 1e3,
                  write_s=writes,
                  step_ms_idle=statistics.median(idle) * 1e3 if idle else None,
                  step_ms_in_flight=statistics.median(busy) * 1e3 if busy else None,
                  hold_ms_median=statistics.median(holds) * 1e3 if holds else None, check=check,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__)
    trainer = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    return result


def local_state(trainer, step: int) -> dict[str, torch.Tensor]:
    """This rank's tensors of what a checkpoint of `step` holds, copied to the CPU."""
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, torch.Tensor):
            out[prefix] = (obj.to_local() if isinstance(obj, DTensor) else obj).detach().to("cpu", copy=True)
    walk("", checkpoint.saved_state(trainer.parts, trainer.optimizer, trainer.scheduler, trainer.loader, step,
                                    trainer._param_names()))
    return out


def check_async(trainer, step: int) -> str:
    """Save `step` in the background, train one more step while it is written, load it
    back: every tensor must be the state at `step`. Raises on a mismatch."""
    sync(trainer.device)
    before = local_state(trainer, step)
    trainer.checkpoints.save(step)
    trainer.step(*trainer.next_batch())
    sync(trainer.device)
    moved = sum(not torch.equal(before[k], v) for k, v in local_state(trainer, step).items())
    path = trainer.checkpoints.wait()
    checkpoint.load(path, trainer.parts, trainer.optimizer, trainer.scheduler, trainer.loader,
                    config=trainer.model_config, names=trainer._param_names())
    bad = [k for k, v in local_state(trainer, step).items() if not torch.equal(before[k], v)]
    counts = worst([float(len(bad)), float(-moved), float(-len(before))], trainer.device)
    bad_any, moved_min, n_min = int(counts[0]), int(-counts[1]), int(-counts[2])
    if bad_any or not moved_min:
        raise RuntimeError(f"check failed: {bad_any} tensors of the background save of step {step} differ from "
                           f"the state at that step ({bad[:3]} on rank {dist.get_rank()}); {moved_min} were "
                           "changed by the step after it")
    return (f"the background save of step {step} holds that step's state bit for bit ({n_min}+ tensors a rank, "
            f"{moved_min}+ changed by the step trained while it was written)")


def report(results: list[dict], out: str | None) -> None:
    for r in results:
        print(f"{r['mode']}: steps (ms) " + " ".join(f"{s:.0f}{'*' if w else ''}"
                                                    for s, w in zip(r["step_ms"], r["in_flight"]))
              + "   (* a background write in flight)")
        print(f"{r['mode']}: hold per save (ms) " + " ".join(f"{h:.0f}" for h in r["hold_ms"])
              + (f"; waited {r['last_wait_ms']:.0f} ms for the last write; each write took (s) "
                 + " ".join(f"{w:.1f}" for w in r["write_s"]) if r["mode"] == "async" else ""))
        if r.get("check"):
            print(f"{r['mode']}: check: {r['check']}")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"{'mode':<6} {'step ms, no save in flight':>27} {'step ms, save in flight':>24} {'hold ms per save':>17}")
    for r in results:
        print(f"{r['mode']:<6} {fmt(r['step_ms_idle']):>27} {fmt(r['step_ms_in_flight']):>24} "
              f"{fmt(r['hold_ms_median']):>17}")
    by = {r["mode"]: r for r in results}
    if "sync" in by and "async" in by and by["async"]["hold_ms_median"]:
        ratio = by["sync"]["hold_ms_median"] / by["async"]["hold_ms_median"]
        print(f"hold ratio sync / async: {ratio:.1f}x")
        by["async"]["hold_ratio_sync_over_async"] = ratio
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "checkpoint.jsonl"), "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="sync,async", help="comma list of sync, async")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (compilation happens there)")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--every", type=int, default=10, help="steps between saves")
    p.add_argument("--max-saves", type=int, default=1_000_000,
                   help="saves at most (a large model's write can outlast the steps between saves)")
    p.add_argument("--dir", required=True, help="where the checkpoints go (a subdirectory per mode, removed after)")
    p.add_argument("--out", default=None, help="append the results to OUT/checkpoint.jsonl")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="the async mode's bit-for-bit check after its timing (one more save and a load)")
    args, recipe_flags = p.parse_known_args()
    if args.every < 1 or args.steps < args.every:
        p.error(f"--every must be between 1 and --steps ({args.steps}), not {args.every}")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_process_group(600)
    results = [measure(mode, recipe_flags, args) for mode in args.modes.split(",")]
    if dist.get_rank() == 0:
        report(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
