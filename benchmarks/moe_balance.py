"""Routing balance of a mixture-of-experts model while it trains: every layer's
load max/mean (the busiest expert's routed copies over the mean), step by step,
through the recipe's own Trainer (its defaults unless flags say otherwise).

    python benchmarks/moe_balance.py --model llama-moe-tiny --steps 200 --every 10
    python benchmarks/moe_balance.py --model llama-moe-3B --seq-len 2048 --micro-batch 4 --dtype bf16 --steps 50

Prints one line per --every steps (loss, each layer's load of that step, the
expert bias's spread per layer) and, at the end, each layer's load at the last
step, its mean over the last 10 steps, and the load of those 10 steps' tokens
pooled (their counts summed): a router balanced over the data but not within
each step (a few documents a step, each routed much alike) reads near 1 pooled
and higher per step. A collapsed layer of E experts, top-k,
reads E / k (every token to the same k experts); a uniform router about 1 + a few
standard deviations of the per-expert counts. One process, no pipeline (the
statistics are each block's, as its step ended). With batch balancing on, each
line also shows the router's own choice before it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron import Config, Trainer, models  # noqa: E402
from meshtron.models.common.moe import moe_blocks, step_loads  # noqa: E402
from meshtron.train.lifetime import init_process_group  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=10, help="print every this many steps")
    ap.add_argument("--out", default=None, help="append the per-step loads to this .jsonl")
    ap.add_argument("--router-std", type=float, default=None,
                    help="an experiment: redraw every router's weights N(0, std) before the first step")
    args, recipe = ap.parse_known_args(argv)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29544"))
    init_process_group(600)
    trainer = Trainer(Config.from_args(recipe, models=models.PRESETS), verbose=False)
    if trainer.pipeline is not None or getattr(trainer.model_config, "moe", None) is None:
        raise SystemExit("moe_balance.py: a mixture-of-experts model without a pipeline")
    blocks, loads, own_loads, counts_by_step = moe_blocks(trainer.parts), [], [], []
    if args.router_std is not None:
        torch.manual_seed(0)
        with torch.no_grad():
            for m in blocks:
                m.router.gate.weight.normal_(0.0, args.router_std)
    steps = trainer.config.training.steps
    print(f"{trainer.config.model.model}: {len(blocks)} MoE layers, {blocks[0].cfg} | global batch "
          f"{trainer.global_batch} x {trainer.config.training.seq_len}", flush=True)
    for step in range(1, steps + 1):
        loss, _ = trainer.step(*trainer.loader.next())
        counts = step_loads(blocks).cpu()               # (layers, [run, router's own], E)
        counts_by_step.append(counts[:, 0])
        ratio = (counts.max(-1).values / counts.mean(-1)).tolist()
        loads.append([r[0] for r in ratio])
        own_loads.append([r[1] for r in ratio])
        if step % args.every == 0 or step in (1, steps):
            spread = [float(m.router.expert_bias.max() - m.router.expert_bias.min()) for m in blocks]
            own = ""
            if blocks[0].cfg.batch_balance:
                own = " | router's own " + " ".join(f"{x:.2f}" for x in own_loads[-1])
            print(f"step {step:>5} | loss {float(loss):.4f} | load max/mean by layer "
                  + " ".join(f"{x:.2f}" for x in loads[-1]) + own
                  + " | bias spread " + " ".join(f"{x:.3f}" for x in spread), flush=True)
    tail = torch.tensor(loads[-10:])
    pooled = torch.stack(counts_by_step[-10:]).sum(0)
    pooled = (pooled.max(1).values / pooled.mean(1)).tolist()
    summary = dict(model=trainer.config.model.model, steps=steps, moe=str(blocks[0].cfg), router_std=args.router_std,
                   final_loss=float(loss),
                   last=[round(x, 3) for x in loads[-1]], last10_mean=[round(x, 3) for x in tail.mean(0).tolist()],
                   last10_pooled=[round(x, 3) for x in pooled],
                   own_last10_mean=[round(x, 3) for x in torch.tensor(own_loads[-10:]).mean(0).tolist()],
                   loads=[[round(x, 3) for x in row] for row in loads])
    print(f"last step by layer {summary['last']} | mean of the last 10 steps by layer {summary['last10_mean']} "
          f"| the last 10 steps pooled by layer {summary['last10_pooled']} | the router's own choice, "
          f"mean of the last 10 steps {summary['own_last10_mean']} | loss {summary['final_loss']:.4f}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(summary) + "\n")
    return summary


if __name__ == "__main__":
    main()
