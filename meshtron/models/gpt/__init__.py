"""meshtron's GPT (Megatron's): model, presets, layout, GPT-2 adapter."""
from dataclasses import replace

from meshtron.models.gpt import hf
from meshtron.models.gpt.model import GPT, PRESETS, GPTConfig, gpt_config
from meshtron.models.gpt.parallelize import check_layout, parallelize_gpt, pipeline_split, tp_plan
from meshtron.models.spec import ModelSpec, moe_overrides


def configure(preset: GPTConfig, options) -> GPTConfig:
    """The preset with the user's model options (meshtron.config.ModelConfig)."""
    overrides = {"fused_kernels": options.fused_kernels}
    if options.untie_embeddings:
        overrides["tie_embeddings"] = False
    if options.vocab_size:
        overrides["vocab_size"] = options.vocab_size
    overrides.update(moe_overrides(preset, options))
    if options.pos_emb:
        overrides["pos_emb"] = options.pos_emb
    return replace(preset, **overrides)


# GPT-3's peak learning rates by size (Brown et al. 2020, table 2.1) and its warm-up of 375M
# tokens, in steps of 1M-token batches; the CI-sized presets keep a short warm-up
TRAINING = {"tiny": dict(lr=1e-3, warmup=10), "gpt-moe-tiny": dict(lr=1e-3, warmup=10),
            "125M": dict(lr=6e-4, warmup=375), "350M": dict(lr=3e-4, warmup=375), "1.3B": dict(lr=2e-4, warmup=375),
            "2.7B": dict(lr=1.6e-4, warmup=375), "6.7B": dict(lr=1.2e-4, warmup=375)}

SPEC = ModelSpec(name="gpt", model_cls=GPT, presets=PRESETS, configure=configure, check_layout=check_layout,
                 parallelize=parallelize_gpt, pipeline_split=pipeline_split, tp_plan=tp_plan,
                 hf=hf, training=TRAINING)

__all__ = ["GPT", "GPTConfig", "PRESETS", "SPEC", "gpt_config"]
