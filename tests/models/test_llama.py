"""The Llama (RMSNorm, SwiGLU, RoPE with Llama 3 scaling, GQA): the same logits as
transformers' LlamaForCausalLM, its own layout checks, and the GPT's parity
suite: every layout against one process, fp32, over 3 steps."""
import pytest
import torch

from meshtron import ParallelConfig
from meshtron.distributed.pipeline_parallel import split_model
from meshtron.models import get
from meshtron.models.llama import SPEC, Llama, LlamaConfig
from meshtron.models.llama import hf as adapter
from meshtron.train import hf
from meshtron.train.loss import cross_entropy_sum

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, run_parity, tiny_batches

_, TINY = get("llama-tiny")   # 4 layers, dim 64, 8 heads, 4 KV heads, tied, Llama 3 rope scaling
TOL = 1e-5


def test_same_logits_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    for cfg in (TINY, LlamaConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=1, ffn_dim=96, vocab_size=128,
                                  max_seq_len=64, rope_theta=1000.0, tie_embeddings=False)):
        model = Llama(cfg, seed=3)
        hf.export_safetensors(model, str(tmp_path / str(cfg.n_kv_heads)), cfg, adapter)
        theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / str(cfg.n_kv_heads))).eval()
        x = torch.randint(0, cfg.vocab_size, (2, min(200, cfg.max_seq_len)))   # past the scaled rope's context
        with torch.no_grad():
            torch.testing.assert_close(model(x), theirs(x).logits, rtol=1e-5, atol=1e-5)


def test_param_count_and_presets():
    for name, n in (("llama-1B", 1.24e9), ("llama-3B", 3.21e9), ("llama-8B", 8.03e9), ("llama-617M", 0.617e9)):
        assert abs(get(name)[1].num_params() / n - 1) < 0.01, (name, get(name)[1].num_params())
    model = Llama(TINY, seed=0)
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params()
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("degrees,msg", [
    (dict(tp=8), "tp=8 does not divide the number of KV heads 4"),
    (dict(tp=3), "tp=3 does not divide the number of KV heads 4"),
    (dict(pp=8), "pp=8 is greater than the number of layers 4"),
])
def test_layout_checks(degrees, msg):
    full = dict(dp=1, pp=1, cp=1, tp=1, ep=1) | degrees
    with pytest.raises(ValueError, match=msg):
        SPEC.check_layout(TINY, full, ParallelConfig(tp=full["tp"]), 32)


def build():
    return Llama(TINY, seed=0)


def _parity(rank, world, degrees, pcfg_kwargs, micro_batches=1):
    me = mesh(**degrees)
    pcfg = ParallelConfig(**pcfg_kwargs)
    return run_parity(me, build, layout(pcfg, SPEC), tiny_batches(TINY.vocab_size, steps=3, batch=8, seq=16),
                      micro_batches=micro_batches, max_norm=0.5, fb_kwargs=fb_kwargs(me, pcfg))


CASES = {  # name: (world, degrees, parallel config, micro-batches)
    "dp2 zero0": (2, dict(dp=2), dict(zero=0), 2),
    "dp2 zero1": (2, dict(dp=2), dict(zero=1), 2),
    "dp2 zero2": (2, dict(dp=2), dict(zero=2), 2),
    "dp2 zero3": (2, dict(dp=2), dict(zero=3), 2),
    "hsdp 2x2 zero2": (4, dict(dp=4), dict(zero=2, hsdp=2), 2),
    "tp2 sp": (2, dict(dp=1, tp=2), dict(sp=True), 1),
    "tp4 sp": (4, dict(dp=1, tp=4), dict(sp=True), 1),
    "tp2 no sp, gathered loss": (2, dict(dp=1, tp=2), dict(loss_parallel=False), 1),
    "dp2 x tp2 sp zero3, selective recompute": (4, dict(dp=2, tp=2), dict(sp=True, zero=3, recompute="selective"), 2),
    "tp2 sp, full recompute": (2, dict(dp=1, tp=2), dict(sp=True, recompute="full"), 1),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.fast_cases("dp2 zero3", "tp2 sp", "tp2 no sp, gathered loss", "tp2 sp, full recompute")
def test_llama_parity(pools, case):
    world, degrees, pcfg, mb = CASES[case]
    assert_parity(pools.run(world, _parity, degrees, pcfg, mb), TOL)


def _pp_parity(rank, world, degrees, schedule, v, m, pcfg_kwargs):
    me = mesh(**degrees)
    pcfg = ParallelConfig(**pcfg_kwargs)

    def pipeline(model, me):
        pipe = split_model(model, me, schedule, v, m, SPEC.pipeline_split(TINY, me["pp"].size() * v))
        for stage in pipe.parts:
            SPEC.parallelize(stage, me, pcfg)
        pipe.build_schedule(cross_entropy_sum)
        return pipe

    return run_parity(me, build, pipeline, tiny_batches(TINY.vocab_size, steps=3, batch=8, seq=16), max_norm=0.5,
                      fb_kwargs=fb_kwargs(me, pcfg))


PP_CASES = [  # (degrees, schedule, virtual stages, micro-batches, parallel config)
    (dict(dp=1, pp=2), "1f1b", 1, 4, {}),
    (dict(dp=1, pp=2), "interleaved-1f1b", 2, 4, {}),
    (dict(dp=1, pp=2), "gpipe", 1, 4, {}),
    (dict(dp=1, pp=2), "zbv", 2, 4, {}),
    (dict(dp=1, pp=2), "zero-bubble", 2, 4, {}),
    (dict(dp=1, pp=2, tp=2), "1f1b", 1, 2, dict(sp=True)),
    (dict(dp=2, pp=2, tp=2), "1f1b", 1, 2, dict(zero=3, sp=True)),
]


@pytest.mark.parametrize("degrees,schedule,v,m,pcfg", PP_CASES,
                         ids=[f"{'x'.join(f'{k}{n}' for k, n in c[0].items())}-{c[1]}" for c in PP_CASES])
@pytest.mark.fast_cases("dp1xpp2-1f1b", "dp1xpp2-interleaved-1f1b", "dp1xpp2-zbv", "dp1xpp2xtp2-1f1b")
def test_llama_pipeline_parity(pools, degrees, schedule, v, m, pcfg):
    world = degrees["dp"] * degrees["pp"] * degrees.get("tp", 1)
    assert_parity(pools.run(world, _pp_parity, degrees, schedule, v, m, pcfg), TOL)


def _compiled_losses(rank, world):
    from meshtron.train.step import forward_backward
    losses = []
    for compiled in (False, True):
        model = build()
        SPEC.parallelize(model, mesh(dp=1), ParallelConfig(compile=compiled))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in tiny_batches(TINY.vocab_size, steps=2, batch=2, seq=16):
            losses.append(float(forward_backward([model], x, y, None)))
            opt.step()
            opt.zero_grad()
    return losses[:2], losses[2:]


@pytest.mark.slow
def test_compiled_blocks_match_eager(pools):
    eager, compiled = pools.run(1, _compiled_losses, timeout=300)[0]
    assert compiled == pytest.approx(eager, rel=1e-5)
