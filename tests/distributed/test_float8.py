"""FP8 training (--fp8, meshtron.distributed.float8) on gloo, through torchao's
emulation: real fp8 rounding of every matmul operand, the matmuls in fp32. So
each layout is compared with one FP8-emulated process (not with bf16): same
model, seed and batches, the reference's micro-batches the ranks' own, several
AdamW steps; what converts and what stays high precision; checkpoints written
by FP8 runs load into plain ones and back; --export-hf writes plain tensors."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from meshtron import ParallelConfig, parallelize
from meshtron.distributed import float8
from meshtron.models import GPT, gpt_config
from meshtron.models.common.moe import MoEConfig
from meshtron.models.gpt import SPEC as GPT_SPEC
from meshtron.models.llama import SPEC as LLAMA_SPEC
from meshtron.models.llama import Llama, LlamaConfig
from meshtron.models.llama.parallelize import FP8_SKIP

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, pipelined, run_parity, tiny_batches

pytest.importorskip("torchao.float8")

CFG = LlamaConfig(n_layers=2, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=320, max_seq_len=64,
                  rope_theta=1e4)
SEQ, STEPS = 16, 4
TOL = 1e-5


def _fp8_reference(recipe):
    """The one-process FP8 model: converted as the layouts convert it, nothing else."""
    def build():
        m = Llama(CFG, seed=0)
        float8.convert(m, recipe, "cpu", skip=FP8_SKIP)
        return m
    return build


def _scaled(parallelize):
    """The layout, then the weights' fp8 scales, as the trainer computes them before its first step."""
    def apply(model, mesh):
        out = parallelize(model, mesh)
        float8.precompute_scales(getattr(out, "parts", [out]))
        return out
    return apply


def _parity(rank, world, degrees, recipe, pcfg_kwargs=None):
    me = mesh(**degrees)
    pcfg = ParallelConfig(**{k: v for k, v in degrees.items() if k != "dp"}, fp8=recipe, **(pcfg_kwargs or {}))
    batches = tiny_batches(CFG.vocab_size, steps=STEPS, batch=8, seq=SEQ)
    n_dp = degrees.get("dp", 1)
    micro = 2 if degrees.get("pp", 1) > 1 else 1
    par = _scaled(pipelined(pcfg, LLAMA_SPEC, CFG, microbatches=2) if micro == 2 else layout(pcfg, LLAMA_SPEC))
    return run_parity(me, lambda: Llama(CFG, seed=0), par, batches, max_norm=0.5, fb_kwargs=fb_kwargs(me, pcfg),
                        ref_fb_kwargs={"microbatches": n_dp * micro}, build_ref=_fp8_reference(recipe),
                        rank_major=True, after_step=float8.precompute_scales)


LAYOUTS = {"one process": (1, dict(dp=1), None),
           "dp2 zero3 (fp8 all-gather)": (2, dict(dp=2), dict(zero=3)),
           "dp2 x tp2 sp": (4, dict(dp=2, tp=2), dict(sp=True, zero=1)),
           "pp2": (2, dict(dp=1, pp=2), None)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_fp8_layouts_match_one_fp8_process(pools, name, recipe):
    world, degrees, kwargs = LAYOUTS[name]
    reports = pools.run(world, _parity, degrees, recipe, kwargs, timeout=300)
    worst = assert_parity(reports, TOL)
    print(f"\n{name} {recipe}: loss {worst.loss:.2g} grad {worst.grad:.2g} ({worst.worst_grad_name}) "
          f"param {worst.param:.2g} norm {worst.grad_norm:.2g}")
