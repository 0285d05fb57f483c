"""A Llama-family model (RMSNorm, SwiGLU, RoPE with Llama 3 scaling, GQA): model,
presets, layout, Hugging Face adapter.

Each name below loads its module on first use (PEP 562): config.py imports no
torch, and the command line reads the presets from it before torch loads
(meshtron.config); the model, its layout and its spec (train_spec.py) do.
"""
from meshtron._lazy import lazy

_HOME = {"LlamaConfig": ".config", "PRESETS": ".config", "TRAINING": ".config", "LLAMA3_SCALING": ".config",
         "Llama": ".model", "check_layout": ".parallelize", "parallelize_llama": ".parallelize",
         "pipeline_split": ".parallelize", "tp_plan": ".parallelize", "SPEC": ".train_spec", "configure": ".train_spec"}


__getattr__, __dir__ = lazy(__name__, _HOME, ("hf",))


__all__ = ["Llama", "LlamaConfig", "PRESETS", "SPEC"]
