"""The GPT's configuration and presets, and the learning rates they are trained
with, without torch: the command line offers the presets and takes --lr and
--warmup from them before torch loads (meshtron.config). The model is model.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from meshtron.models.common.moe_config import MoEConfig, moe_param_count


@dataclass(frozen=True)
class GPTConfig:
    n_layers: int = 12
    dim: int = 768
    n_heads: int = 12
    vocab_size: int = 50304          # GPT-2's 50257 padded to a multiple of 128
    max_seq_len: int = 2048
    ffn_mult: int = 4
    pos_emb: str = "learned"          # "learned" or "rope"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True       # GPT-2 / Megatron default; sizes below count it once
    bias: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    fused_kernels: bool = True        # Triton LayerNorm / bias-GeLU on GPU; plain PyTorch on CPU
    moe: MoEConfig | None = None      # mixture-of-experts MLPs (GeLU experts) in every layer

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.pos_emb not in ("learned", "rope"):
            raise ValueError(f"pos_emb must be 'learned' or 'rope', not {self.pos_emb!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters (tied output counted once); `active`: with only the experts a token uses."""
        d, L, f = self.dim, self.n_layers, self.ffn_mult * self.dim
        b = 1 if self.bias else 0
        mlp = moe_param_count(d, self.moe, active) if self.moe else (d * f + f * b) + (f * d + d * b)
        per_layer = (3 * d * d + 3 * d * b) + (d * d + d * b) + mlp + 4 * d
        n = L * per_layer + 2 * d + (0 if self.tie_embeddings else self.vocab_size * d)
        if embeddings:
            n += self.vocab_size * d + (self.max_seq_len * d if self.pos_emb == "learned" else 0)
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight that multiplies the token (the
        output head included, embeddings excluded) plus attention scores and
        values, 12*L*d*T, counted without the causal halving (PaLM's convention)."""
        n_matmul = self.num_params(embeddings=False, active=True) - self.n_layers * 4 * self.dim - 2 * self.dim
        if self.tie_embeddings:
            n_matmul += self.vocab_size * self.dim
        return 6 * n_matmul + 12 * self.n_layers * self.dim * seq_len


PRESETS = {
    "tiny": GPTConfig(n_layers=4, dim=64, n_heads=4, vocab_size=320, max_seq_len=256),
    "125M": GPTConfig(n_layers=12, dim=768, n_heads=12),
    "350M": GPTConfig(n_layers=24, dim=1024, n_heads=16),
    "1.3B": GPTConfig(n_layers=24, dim=2048, n_heads=16),
    "2.7B": GPTConfig(n_layers=32, dim=2560, n_heads=32),
    "6.7B": GPTConfig(n_layers=32, dim=4096, n_heads=32),
    # CI-sized mixture of experts: 8 GeLU experts of width 64, top-2, in every layer (batch
    # balancing's rounds as llama-moe-tiny's)
    "gpt-moe-tiny": GPTConfig(n_layers=4, dim=64, n_heads=4, vocab_size=320, max_seq_len=256,
                              moe=MoEConfig(n_experts=8, top_k=2, hidden=64, activation="gelu", batch_balance=16)),
}


def gpt_config(preset: str, **overrides) -> GPTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; known: {list(PRESETS)}")
    return replace(PRESETS[preset], **overrides)


# GPT-3's peak learning rates by size (Brown et al. 2020, table 2.1) and its warm-up of 375M
# tokens, in steps of 1M-token batches; the CI-sized presets keep a short warm-up
TRAINING = {"tiny": dict(lr=1e-3, warmup=10), "gpt-moe-tiny": dict(lr=1e-3, warmup=10),
            "125M": dict(lr=6e-4, warmup=375), "350M": dict(lr=3e-4, warmup=375), "1.3B": dict(lr=2e-4, warmup=375),
            "2.7B": dict(lr=1.6e-4, warmup=375), "6.7B": dict(lr=1.2e-4, warmup=375)}
