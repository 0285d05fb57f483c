"""A Llama-family model (RMSNorm, SwiGLU, RoPE with Llama 3 scaling, GQA): model,
presets, layout, Hugging Face adapter."""
from dataclasses import replace

from meshtron.config import ConfigError
from meshtron.models.llama import hf
from meshtron.models.llama.model import PRESETS, Llama, LlamaConfig
from meshtron.models.llama.parallelize import check_layout, parallelize_llama, pipeline_split, tp_plan
from meshtron.models.spec import ModelSpec, moe_overrides


def configure(preset: LlamaConfig, options) -> LlamaConfig:
    """The preset with the user's model options (meshtron.config.ModelConfig)."""
    if options.pos_emb:
        raise ConfigError("--pos-emb applies to GPT models; the Llama has rotary positions")
    overrides = {"fused_kernels": options.fused_kernels}
    if options.untie_embeddings:
        overrides["tie_embeddings"] = False
    if options.vocab_size:
        overrides["vocab_size"] = options.vocab_size
    overrides.update(moe_overrides(preset, options))
    return replace(preset, **overrides)


# Llama 2's published schedule (peak 3e-4 after 2,000 warm-up steps; Llama 3 8B's peak is
# 3e-4 too); the CI-sized presets keep a short warm-up for runs of tens of steps
TRAINING = {name: dict(lr=1e-3, warmup=10) if name.endswith("tiny") else dict(lr=3e-4, warmup=2000)
            for name in PRESETS}

SPEC = ModelSpec(name="llama", model_cls=Llama, presets=PRESETS, configure=configure, check_layout=check_layout,
                 parallelize=parallelize_llama, pipeline_split=pipeline_split, tp_plan=tp_plan,
                 hf=hf, training=TRAINING)

__all__ = ["Llama", "LlamaConfig", "PRESETS", "SPEC"]
