"""The planner's memory terms for run.sh's layouts (CPU): python predict.py (from the repo root's venv, PYTHONPATH=.)
The CLI has no --untie-embeddings: this calls meshtron.planner.plan.predict with the untied config, as
Config/--untie-embeddings builds it, and prints each pp stage's terms as well as the fullest rank's."""
import dataclasses
import math

from meshtron import models
from meshtron.config import ParallelConfig
from meshtron.distributed.pipeline_parallel import bubble_fraction
from meshtron.planner.hardware import hardware
from meshtron.planner.plan import activation_bytes, memory_bytes, predict
from meshtron.planner.state import state_bytes

GiB = 2 ** 30
hw = hardware("h100")
spec, preset = models.get("llama-1B")
cfg = dataclasses.replace(preset, tie_embeddings=False)
print(f"llama-1B untied: {cfg.num_params() / 1e9:.3f}B parameters; layers {cfg.n_layers}, dim {cfg.dim}, "
      f"vocab {cfg.vocab_size}")
cases = {
    "A pp2 x tp2 + SP, micro-batch 4, 8 micro-batches, 1F1B": (
        ParallelConfig(dp=1, pp=2, tp=2, sp=True, zero=1, pp_schedule="1f1b", microbatches=8, compile=True,
                       dtype="bf16"), 4, 8),
    "B dp2 x tp2 + SP ZeRO-3, micro-batch 16": (
        ParallelConfig(dp=2, pp=1, tp=2, sp=True, zero=3, microbatches=1, compile=True, dtype="bf16"), 16, 1),
}
for name, (par, mb, m) in cases.items():
    pr = predict(spec, cfg, par, mb, m, 2048, hw, 8)
    total, state, acts, gathered = memory_bytes(spec, cfg, par, mb, m, 2048)
    print(f"\n{name}: predicted step {pr.step_s * 1e3:.1f} ms, MFU {pr.mfu:.1%}")
    print(f"  fullest rank: total {total / GiB:.2f} GiB = state {state / GiB:.2f} + bf16/accumulation "
          f"{gathered / GiB:.2f} + activations {acts / GiB:.2f}")
    d = par.degrees()
    stride = math.prod(d[a] for a in ("cp", "tp", "ep")) if d["pp"] > 1 else 1
    stages = spec.pipeline_split(cfg, d["pp"]) if d["pp"] > 1 else [None]
    for s in range(d["pp"]):
        sb = state_bytes(spec, cfg, par, s * stride)
        layers = sum(1 for x in stages[s] if x.startswith("layers.")) if stages[s] else cfg.n_layers
        in_flight = min(d["pp"] - s, m) if d["pp"] > 1 else 1   # 1F1B: stage s warms up pp - s micro-batches
        one = activation_bytes(cfg, par, mb, 2048, layers)
        h, t, tokens = cfg.dim, d["tp"], mb * 2048
        logits = 4 * tokens * cfg.vocab_size / t
        print(f"  stage {s} (rank {s * stride}): {layers} layers{' + embedding' if s == 0 else ''}"
              f"{' + head' if s == d['pp'] - 1 else ''}; params {sb['params'] / GiB:.3f}, "
              f"grads {sb['grads'] / GiB:.3f}, "
              f"AdamW {sb['optim'] / GiB:.3f} GiB; one micro-batch's activations {one / GiB:.3f} GiB "
              f"(of it logits/pp {logits / max(1, d['pp']) / GiB:.3f}; the whole fp32 logits on the head's stage "
              f"{logits / GiB:.3f}), x {in_flight} in flight = {one * in_flight / GiB:.3f}")
    if d["pp"] > 1:
        print(f"  bubble formula {bubble_fraction(par.pp_schedule, d['pp'], m, par.pp_virtual):.3f}")
