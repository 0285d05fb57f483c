"""The model registry: every preset name maps to its model's spec.

    spec, config = meshtron.models.get("llama-1B")

Adding a model: a folder with its presets (config.py, no torch) and its SPEC
(train_spec.py), one line in MODELS (registry.py) and one in presets.py.

Each name below loads its module on first use (PEP 562), so that the command
line reads meshtron.models.presets (and the folders' config.py) before torch
loads; the registry imports every model, and torch with them.
"""
from meshtron._lazy import lazy

_HOME = {"MODELS": ".registry", "PRESETS": ".registry", "from_checkpoint": ".registry", "from_hf": ".registry",
         "get": ".registry", "GPT": ".gpt.model", "GPTConfig": ".gpt.config", "gpt_config": ".gpt.config",
         "MoEConfig": ".common.moe_config", "ModelSpec": ".spec", "read_hf_config": ".spec"}


# the model folders, which importing this package used to load
__getattr__, __dir__ = lazy(__name__, _HOME, ("gpt", "llama"))

__all__ = ["GPT", "GPTConfig", "MODELS", "ModelSpec", "PRESETS", "from_checkpoint", "from_hf", "get", "gpt_config"]
