"""A mixture-of-experts block's settings and parameter count, without torch: the
model presets hold them, and the command line reads the presets before torch
loads (meshtron.config). The block itself is moe.py's.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    hidden: int = 256              # each expert's MLP width
    score: str = "softmax"         # router scores: softmax or sigmoid
    route_norm: bool = True        # the chosen experts' weights renormalized to sum 1 (always for sigmoid)
    n_shared: int = 0              # shared experts (a dense MLP of n_shared * hidden applied to every token)
    aux_loss: float = 3e-2         # load-balancing loss coefficient (0: off)
    bias_update: float = 3e-3      # aux-loss-free expert bias rate, logits per unit of relative load (0: off)
    capacity: float = 0.0          # capacity factor (0: dropless)
    activation: str = "swiglu"     # swiglu (Llama) or gelu (GPT, with biases)
    batch_balance: int = 0         # rounds of per-sequence balancing while training (0: off)
    balanced: bool = False         # benchmarks only: round-robin experts instead of the router's choice


def moe_param_count(dim: int, cfg: MoEConfig, active: bool = False) -> int:
    """Parameters of one MoE block: all of them, or those one token uses (the router,
    top_k experts, the shared experts), which is what its FLOPs count."""
    def mlp(h):
        return 3 * dim * h if cfg.activation == "swiglu" else 2 * dim * h + h + dim
    experts = (cfg.top_k if active else cfg.n_experts) * mlp(cfg.hidden)
    return dim * cfg.n_experts + experts + (mlp(cfg.n_shared * cfg.hidden) if cfg.n_shared else 0)
