"""meshtron's GPT (Megatron's): model, presets, layout, GPT-2 adapter.

Each name below loads its module on first use (PEP 562): config.py imports no
torch, and the command line reads the presets from it before torch loads
(meshtron.config); the model, its layout and its spec (train_spec.py) do.
"""
from meshtron._lazy import lazy

_HOME = {"GPTConfig": ".config", "PRESETS": ".config", "TRAINING": ".config", "gpt_config": ".config",
         "GPT": ".model", "check_layout": ".parallelize", "parallelize_gpt": ".parallelize",
         "pipeline_split": ".parallelize", "tp_plan": ".parallelize", "SPEC": ".train_spec", "configure": ".train_spec"}


__getattr__, __dir__ = lazy(__name__, _HOME, ("hf",))


__all__ = ["GPT", "GPTConfig", "PRESETS", "SPEC", "gpt_config"]
