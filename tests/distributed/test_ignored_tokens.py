"""Ignored labels (-100) spread unevenly over the batch: the loss is a mean over
the global batch's counted tokens, so each layout must weigh every rank's and every
micro-batch's tokens the same way one process does (context parallelism has its
own case in test_context_parallel)."""
import pytest

from meshtron import ParallelConfig
from meshtron.models import GPT, gpt, gpt_config
from meshtron.train.loss import IGNORE_INDEX

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, pipelined, run_parity, tiny_batches


def uneven(vocab: int):
    """Sample 0 nearly all ignored, one whole sample ignored (a different one each
    step, so a different dp rank or micro-batch), a few scattered elsewhere."""
    batches = []
    for i, (x, y) in enumerate(tiny_batches(vocab, steps=3, batch=8, seq=16)):
        y = y.clone()   # x and y are views of one tensor
        y[0, :14] = IGNORE_INDEX
        y[1, 2:9] = IGNORE_INDEX
        y[4 + i % 4] = IGNORE_INDEX
        y[6, 5] = IGNORE_INDEX
        batches.append((x, y))
    return batches


def _parity(rank, world, degrees, pcfg_kwargs, micro, schedule):
    cfg = gpt_config("tiny", n_layers=4, tie_embeddings=schedule is None)
    me, pcfg = mesh(**degrees), ParallelConfig(**pcfg_kwargs)
    if schedule:   # the pipeline's own micro-batches
        par, micro = pipelined(pcfg, gpt.SPEC, cfg, microbatches=micro, schedule=schedule), 1
    else:
        par = layout(pcfg)
    return run_parity(me, lambda: GPT(cfg, seed=0), par, uneven(cfg.vocab_size), micro_batches=micro,
                      fb_kwargs=fb_kwargs(me, pcfg), max_norm=0.5)


CASES = [  # (world, mesh, parallel config, micro-batches, pipeline schedule)
    (1, dict(dp=1), {}, 4, None),
    (2, dict(dp=2), dict(zero=1), 1, None),
    (2, dict(dp=2), dict(zero=3), 4, None),
    (2, dict(dp=1, tp=2), dict(sp=True), 2, None),
    (4, dict(dp=2, tp=2), dict(sp=True), 2, None),
    (2, dict(dp=1, pp=2), {}, 4, "1f1b"),
    (4, dict(dp=2, pp=2), dict(zero=1), 2, "1f1b"),
]


@pytest.mark.parametrize("world,degrees,pcfg,micro,schedule", CASES,
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in c[1].items())}-m{c[3]}-{c[4] or 'nopp'}"
                              for c in CASES])
@pytest.mark.fast_cases("dp1-m4-nopp", "dp2-m1-nopp", "dp1xtp2-m2-nopp", "dp1xpp2-m4-1f1b")
def test_unevenly_ignored_tokens_match_one_process(pools, world, degrees, pcfg, micro, schedule):
    assert_parity(pools.run(world, _parity, degrees, pcfg, micro, schedule), tol=1e-5)
