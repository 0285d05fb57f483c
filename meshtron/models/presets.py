"""Every preset's name and the training settings its family gives it, without
torch: the command line offers these names (--model) and takes the defaults of
--lr and --warmup from them before torch loads (meshtron/cli/train.py). The
registry (meshtron.models.PRESETS) maps the same names to their specs, which
import the models; tests/test_config.py checks that the two agree.
"""
from meshtron.models.gpt import config as gpt
from meshtron.models.llama import config as llama

TRAINING: dict[str, dict] = {name: family.TRAINING.get(name, {}) for family in (gpt, llama) for name in family.PRESETS}
"""preset name -> {"lr": peak, "warmup": steps}, in the registry's order"""
