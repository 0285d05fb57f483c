"""Two builds of one layout (e.g. compiled against eager, or an experiment against
the shipped path) on the same GPUs, seed and batches: the per-parameter relative
difference of their gradients after each of the first --steps-compared steps (default 2), worst first.
Where one tensor stands far above the rest's bf16 noise, that parameter's gradient
path differs between the two builds.

    torchrun --nproc-per-node 2 benchmarks/compare_grads.py --model 1.3B --seq-len 2048 \\
        --global-batch 32 --micro-batch 8 --tp 2 --sp -- --compile
(flags before `--` build both; after it, only the second). --same-weights: the second
build takes the first's weights before each step (its own optimizer is not used), so
the two compute on identical weights at every step; --same-state: also identical AdamW
state, both optimizers step, and their updates are compared too.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron import Config, Trainer, models  # noqa: E402
from meshtron.train.lifetime import init_process_group  # noqa: E402
from meshtron.train.step import gradients  # noqa: E402


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def named(trainer) -> list:
    return [(n, p) for m in trainer.parts for n, p in m.named_parameters()]


def snapshot(trainer, what: str) -> dict:
    return {n: local(p.grad if what == "grad" else p).detach().float().clone() for n, p in named(trainer)}


@torch.no_grad()
def copy_from(src, dst, state: bool) -> None:
    """dst's weights (and, with state, its AdamW moments and step counts) := src's."""
    pairs = list(zip(named(src), named(dst), strict=True))
    for (na, a), (nb, b) in pairs:
        assert na == nb, (na, nb)
        local(b).copy_(local(a))
        if state and a in src.optimizer.state:
            for k, v in src.optimizer.state[a].items():
                dst.optimizer.state[b][k] = v.clone() if isinstance(v, torch.Tensor) else v


def worst(a: dict, b: dict) -> list:
    return sorted(((float((b[n] - t).norm() / t.norm().clamp_min(1e-30)), n) for n, t in a.items()), reverse=True)


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    steps, same = 2, None
    for flag in ("--same-weights", "--same-state"):
        if flag in argv[:split]:
            same = flag.removeprefix("--same-")
            argv.remove(flag)
            split -= 1
    if "--steps-compared" in argv[:split]:
        i = argv.index("--steps-compared")
        steps = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
        split -= 2
    common, extra = argv[:split], argv[split + 1:]
    init_process_group(600)
    configs = [Config.from_args(["--dtype", "bf16"] + common + flags, models=models.PRESETS) for flags in ([], extra)]
    # the second build waits for the first's first step: torch.compile reads inductor's
    # global config (async TP sets it) when it compiles, at a module's first call
    trainers = [Trainer(configs[0], verbose=False)]
    batches = [trainers[0].loader.next() for _ in range(steps)]
    rank = dist.get_rank()
    for step, (x, y) in enumerate(batches):
        grads, losses, updates, before = [], [], [], []
        for i in range(2):
            if i == len(trainers):
                trainers.append(Trainer(configs[1], verbose=False))
            t = trainers[i]
            if same and i == 1:
                copy_from(*trainers, state=same == "state")
            before.append(snapshot(t, "weight") if same == "state" else None)
            loss, norm = gradients(t.parts, x, y, t.mesh, t.pipeline, t.config, t.microbatches, t.loss_fn)
            grads.append(snapshot(t, "grad"))
            losses.append((float(loss), float(norm)))
        for i, t in enumerate(trainers):
            if not (same == "weights" and i == 1):
                t.optimizer.step()
            if before[i] is not None:
                updates.append({n: w - before[i][n] for n, w in snapshot(t, "weight").items()})
            t.optimizer.zero_grad(set_to_none=True)
            t.scheduler.step()
        for what, (a, b) in [("grad", grads)] + ([("update", updates)] if updates else []):
            rows = worst(a, b)
            if rank == 0:
                print(f"step {step + 1} {what}: (loss, norm) {losses[0]} vs {losses[1]}; median rel diff "
                      f"{rows[len(rows) // 2][0]:.3g}", flush=True)
                for e, n in rows[:8]:
                    print(f"  {e:.3g}  {n}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
