"""What ties the Llama to the trainer (meshtron.models.spec.ModelSpec): its model,
presets, user options, layout checks, parallelize function, pipeline split and
Hugging Face adapter.
"""
from dataclasses import replace

from meshtron.config import ConfigError
from meshtron.models.llama import hf
from meshtron.models.llama.config import PRESETS, TRAINING, LlamaConfig
from meshtron.models.llama.model import Llama
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


SPEC = ModelSpec(name="llama", model_cls=Llama, presets=PRESETS, configure=configure, check_layout=check_layout,
                 parallelize=parallelize_llama, pipeline_split=pipeline_split, tp_plan=tp_plan,
                 hf=hf, training=TRAINING)
