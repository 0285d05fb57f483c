"""What ties a model to the trainer (torchtitan's TrainSpec, smaller).

A model folder (meshtron/models/<name>/) holds its plain-PyTorch model, its
presets (config.py, without torch), its parallelize function, its layout checks,
its pipeline split and its Hugging Face adapter, and one `SPEC` (train_spec.py);
the registry (meshtron/models/registry.py) maps preset names to specs, and
meshtron/models/presets.py the same names to their training settings, for the
command line before torch loads. Adding a model touches its folder and those two
lines.

What the trainer relies on, for every model:
- the model config (a frozen dataclass) has `n_layers`, `vocab_size`,
  `max_seq_len`, `tie_embeddings`, `num_params()` and `flops_per_token(seq_len)`;
- the model is built as `model_cls(config, seed=None)` on the meta device,
  takes tokens (B, T) and returns logits (B, T, vocab), keeps its blocks in a
  ModuleDict, works with any listed module set to None or deleted (a pipeline
  stage: no embedding means hidden states in, no head means hidden states out),
  and has `init_weights(seed)` that draws each parameter from its name, so the
  values do not depend on the layout.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn

from meshtron.config import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """the model family ("gpt", "llama")"""
    model_cls: type[nn.Module]
    """builds the plain model from a config"""
    presets: dict[str, Any]
    """preset name -> model config"""
    configure: Callable
    """(preset config, meshtron.config.ModelConfig) -> model config with the user's options applied"""
    check_layout: Callable
    """(model config, degrees {axis: n}, ParallelConfig, seq_len) -> None; raises ValueError"""
    parallelize: Callable
    """(model or pipeline stage, mesh, ParallelConfig, dp_mesh=None) -> None: TP, recompute, compile,
    FSDP in place (dp_mesh: distributed.parallelize.dp_mesh_of's, built once for every stage)"""
    pipeline_split: Callable
    """(model config, n_stages) -> the module names each stage holds"""
    tp_plan: Callable | None = None
    """(model, sp, loss_parallel, moe) -> the TP plan {module glob: style} that parallelize applies
    (the layout planner reads which dims it splits)"""
    hf: Any = None
    """the Hugging Face adapter module (names, tensors and config.json both ways), or None"""
    training: dict[str, dict] = field(default_factory=dict)
    """preset name -> the training settings its family is trained with ({"lr": peak, "warmup": steps}),
    the defaults of --lr and --warmup"""


def moe_overrides(preset, options) -> dict:
    """The --moe-* options as overrides of a preset's `moe` field (refused for a dense model)."""
    given = {k: getattr(options, f"moe_{k}") for k in ("aux_loss", "bias_update", "capacity", "batch_balance")}
    given = {k: v for k, v in given.items() if v is not None}
    if getattr(options, "moe_balanced_routing", False):
        given["balanced"] = True
    if not given:
        return {}
    if getattr(preset, "moe", None) is None:
        raise ConfigError(f"--moe-{next(iter(given)).replace('_', '-')} applies to mixture-of-experts models "
                          "(e.g. --model llama-moe-tiny)")
    if given.get("batch_balance", 0) < 0:
        raise ConfigError(f"--moe-batch-balance is a number of rounds (0: off), not {given['batch_balance']}")
    return {"moe": replace(preset.moe, **given)}


def read_hf_config(path: str) -> dict:
    """DIR/config.json as a dict (a clear error naming the file if it is missing or broken)."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except OSError:
        raise FileNotFoundError(f"no Hugging Face config at {file}") from None
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
