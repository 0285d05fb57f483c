"""The model registry: every preset name maps to its model's spec. Importing it
imports torch and every model; the command line needs only the presets' names
and training settings, which meshtron.models.presets holds without torch.
"""
from meshtron.models.common.moe_config import MoEConfig
from meshtron.models.gpt import train_spec as gpt
from meshtron.models.llama import train_spec as llama
from meshtron.models.spec import ModelSpec, read_hf_config

MODELS: dict[str, ModelSpec] = {"gpt": gpt.SPEC, "llama": llama.SPEC}
PRESETS: dict[str, ModelSpec] = {preset: spec for spec in MODELS.values() for preset in spec.presets}


def from_hf(path: str):
    """(spec, model config) of a Hugging Face model directory, by its config.json's model_type."""
    d = read_hf_config(path)
    for spec in MODELS.values():
        if spec.hf is not None and spec.hf.MODEL_TYPE == d.get("model_type"):
            return spec, spec.hf.from_hf_config(d)
    known = [spec.hf.MODEL_TYPE for spec in MODELS.values() if spec.hf is not None]
    raise ValueError(f"{path}/config.json has model_type {d.get('model_type')!r}; meshtron builds {known}")


def from_checkpoint(meta: dict):
    """(spec, model config) of a meshtron checkpoint's record (meshtron.json)."""
    spec = MODELS[meta["model"]]
    cls = type(next(iter(spec.presets.values())))
    fields = {k: tuple(v) if isinstance(v, list) else MoEConfig(**v) if isinstance(v, dict) else v
              for k, v in meta["config"].items()}
    return spec, cls(**fields)


def get(preset: str):
    """(spec, preset config) of a preset name."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model {preset!r}; known: {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    return spec, spec.presets[preset]
