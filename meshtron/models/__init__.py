from meshtron.models.gpt import GPT, GPTConfig, PRESETS, gpt_config

__all__ = ["GPT", "GPTConfig", "PRESETS", "gpt_config"]
