import math

import pytest
import torch

from meshtron.distributed.reduce import clip_grad_norm_, reduce_partial_grads
from meshtron.train.optim import build_optimizer, warmup_cosine

from harness import mesh
from harness import train as _train


@pytest.mark.slow
def test_tiny_gpt_loss_falls_on_the_default_data(pools):
    argv = ["--model", "tiny", "--dp", "2", "--zero", "3", "--steps", "40", "--seq-len", "64", "--micro-batch", "4",
            "--global-batch", "16", "--lr", "3e-3", "--warmup", "5", "--log-interval", "20"]
    runs = pools.run(2, _train, argv, timeout=300)
    losses = runs[0]
    assert runs[0] == runs[1]                      # every rank logs the same global loss
    assert math.isclose(losses[0], math.log(320), rel_tol=0.05)   # starts near uniform over the vocabulary
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def test_warmup_cosine_schedule():
    f = warmup_cosine(warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def _clip(rank, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    m = mesh(dp=2, tp=2)
    torch.manual_seed(0)
    a, b, c = torch.randn(6, 4), torch.randn(5), torch.randn(3, 3)
    params = [torch.nn.Parameter(distribute_tensor(a, m["tp"], [Shard(0)])),
              torch.nn.Parameter(distribute_tensor(b, m["dp", "tp"], [Replicate(), Shard(0)])),
              torch.nn.Parameter(c.clone())]
    for p, g in zip(params, (a, b, c)):
        p.grad = distribute_tensor(g * 2, p.device_mesh, p.placements) if hasattr(p, "placements") else g * 2
    norm = clip_grad_norm_(params, max_norm=1.0, mesh=m)
    expected = torch.cat([a.flatten(), b, c.flatten()]).mul(2).norm()
    clipped = torch.cat([p.grad.full_tensor().flatten() if hasattr(p.grad, "full_tensor") else p.grad.flatten()
                         for p in params]).norm()
    return float(norm), float(expected), float(clipped)


def test_global_norm_clipping_across_meshes(pools):
    # parameters on different meshes (tp only, dp x tp, none): stock clip_grad_norm_ fails here
    for norm, expected, clipped in pools.run(4, _clip):
        assert norm == pytest.approx(expected, rel=1e-6)
        assert clipped == pytest.approx(1.0, rel=1e-5)


def test_recipe_loss_does_not_depend_on_the_layout(pools):
    # the same 8-sample global batches through one process, dp=2, pp=2 (1F1B, 4
    # micro-batches) and tp=2 + SP
    common = ["--model", "tiny", "--untie-embeddings", "--steps", "4", "--seq-len", "32", "--global-batch", "8",
              "--log-interval", "100"]
    one = pools.run(1, _train, common + ["--micro-batch", "8"])[0]
    dp = pools.run(2, _train, common + ["--dp", "2", "--micro-batch", "4"])[0]
    pp = pools.run(2, _train, common + ["--pp", "2", "--microbatches", "4", "--micro-batch", "2"])[0]
    tp = pools.run(2, _train, common + ["--tp", "2", "--sp", "--micro-batch", "8"])[0]
    # AdamW (eps 1e-8) amplifies rounding differences of near-zero gradient entries
    # into ~1e-6 weight differences (see tests/parity.py), hence 1e-5 on the loss
    for name, got in (("dp", dp), ("pp", pp), ("tp", tp)):
        assert got == pytest.approx(one, rel=1e-5), (name, one, got)


def _local_adamw(rank, world, layout):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from meshtron import ParallelConfig
    from meshtron.models import GPT, gpt_config
    from meshtron.train.step import forward_backward

    from parity import fb_kwargs, tiny_batches
    from parity import layout as apply_layout
    cfg = gpt_config("tiny", n_layers=2)
    m = mesh(dp=1, tp=2) if layout == "tp_sp" else mesh(dp=2)
    pcfg = ParallelConfig(sp=True) if layout == "tp_sp" else ParallelConfig(zero=3)
    models = [apply_layout(pcfg)(GPT(cfg, seed=0), m) for _ in range(2)]
    ours = build_optimizer(models[0], 1e-2, eps=1e-4)
    # the same groups (decay / no decay) for torch's AdamW on the twin model
    twin = dict(models[1].named_parameters())
    names = {id(p): n for n, p in models[0].named_parameters()}
    theirs = torch.optim.AdamW([{"params": [twin[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
                                for g in ours.param_groups], lr=1e-2, betas=(0.9, 0.95), eps=1e-4, foreach=True)
    comms = []
    for step, (x, y) in enumerate(tiny_batches(cfg.vocab_size, 3, 4, 16)):
        for model, opt in zip(models, (ours, theirs)):
            forward_backward([model], x, y, m, **fb_kwargs(m, pcfg))
            if opt is ours and step == 0:
                partial = sum(1 for p in model.parameters() if p.grad.placements != p.placements)
                with CommDebugMode() as cdm:
                    reduce_partial_grads(model.parameters())
                comms.append((partial, cdm.get_total_counts()))
                assert all(p.grad.placements == p.placements for p in model.parameters())
            opt.step()
            opt.zero_grad()
    weights = max(float((p.full_tensor() - q.full_tensor()).abs().max())
                  for p, q in zip(*(mod.parameters() for mod in models)))
    states = [(type(ours.state[p]["exp_avg"]) is DTensor, ours.state[p]["exp_avg"].placements == p.placements,
               float((ours.state[p]["exp_avg_sq"].full_tensor() - theirs.state[q]["exp_avg_sq"].full_tensor())
                     .abs().max()))
              for p, q in zip(*(mod.parameters() for mod in models))]
    return weights, states, comms


@pytest.mark.parametrize("layout", ["tp_sp", "zero3"])
def test_adamw_on_local_shards_matches_torch_adamw(pools, layout):
    # meshtron's AdamW steps on to_local() shards; torch's AdamW (foreach) on the DTensors
    weights, states, comms = pools.run(2, _local_adamw, layout)[0]
    assert weights < 1e-6, weights
    assert all(is_dt and same and diff < 1e-9 for is_dt, same, diff in states), states
    if layout == "tp_sp":   # 2 LayerNorms a layer + the final one, weight and bias: 10 Partial grads, 1 all-reduce
        assert comms == [(10, 1)], comms
