"""What ties the GPT to the trainer (meshtron.models.spec.ModelSpec): its model,
presets, user options, layout checks, parallelize function, pipeline split and
GPT-2 adapter.
"""
from dataclasses import replace

from meshtron.models.gpt import hf
from meshtron.models.gpt.config import PRESETS, TRAINING, GPTConfig
from meshtron.models.gpt.model import GPT
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


SPEC = ModelSpec(name="gpt", model_cls=GPT, presets=PRESETS, configure=configure, check_layout=check_layout,
                 parallelize=parallelize_gpt, pipeline_split=pipeline_split, tp_plan=tp_plan,
                 hf=hf, training=TRAINING)
