"""The Llama's configuration and presets, and the learning rates they are trained
with, without torch: the command line offers the presets and takes --lr and
--warmup from them before torch loads (meshtron.config). The model is model.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshtron.models.common.moe_config import MoEConfig, moe_param_count


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int = 16
    dim: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 8192
    vocab_size: int = 128256
    max_seq_len: int = 131072
    rope_theta: float = 500000.0
    rope_scaling: tuple | None = None     # Llama 3: (factor, low_freq_factor, high_freq_factor, original context)
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    fused_kernels: bool = True             # Triton RMSNorm / SwiGLU on GPU; plain PyTorch on CPU
    moe: MoEConfig | None = None           # mixture-of-experts feed-forwards (SwiGLU experts) in every layer

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameters (tied output counted once); `active`: with only the experts a token uses."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        ffn = moe_param_count(d, self.moe, active) if self.moe else 3 * d * self.ffn_dim
        per_layer = attn + ffn + 2 * d
        n = self.n_layers * per_layer + d + (0 if self.tie_embeddings else self.vocab_size * d)
        return n + (self.vocab_size * d if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """6 per weight that multiplies the token (the output head included) plus
        attention scores and values, 12*L*d*T, causal mask not discounted (PaLM's
        convention, as the GPT's)."""
        n_matmul = self.num_params(embeddings=False, active=True) - self.n_layers * 2 * self.dim - self.dim
        if self.tie_embeddings:
            n_matmul += self.vocab_size * self.dim
        return 6 * n_matmul + 12 * self.n_layers * self.dim * seq_len


LLAMA3_SCALING = (8.0, 1.0, 4.0, 8192)
PRESETS = {
    # CI-sized: GQA (8 heads, 4 KV heads) so tp=2 and tp=4 split both; scaled rope
    "llama-tiny": LlamaConfig(n_layers=4, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=160, vocab_size=320,
                              max_seq_len=256, rope_theta=10000.0, rope_scaling=(4.0, 1.0, 4.0, 64)),
    "llama-1B": LlamaConfig(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192,       # Llama 3.2 1B
                            rope_scaling=(32.0, 1.0, 4.0, 8192)),
    "llama-3B": LlamaConfig(n_layers=28, dim=3072, n_heads=24, n_kv_heads=8, ffn_dim=8192,       # Llama 3.2 3B
                            rope_scaling=(32.0, 1.0, 4.0, 8192)),
    "llama-8B": LlamaConfig(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,      # Llama 3.1 8B
                            rope_scaling=LLAMA3_SCALING, tie_embeddings=False),
    # the long-context (cp) model, the torchtitan kit's tt3_8l: 8 x 2048, 16 heads of 128 (no GQA),
    # SwiGLU 5632, untied; 617M parameters; 512K positions, for sequences that need cp
    "llama-617M": LlamaConfig(n_layers=8, dim=2048, n_heads=16, n_kv_heads=16, ffn_dim=5632, vocab_size=50304,
                              tie_embeddings=False, max_seq_len=524288),
    # CI-sized mixture of experts: 8 SwiGLU experts of width 64, top-2; batch balancing evens
    # each sequence, and its short sequences of a tiny vocabulary route alike: more rounds
    "llama-moe-tiny": LlamaConfig(n_layers=4, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=160, vocab_size=320,
                                  max_seq_len=256, rope_theta=10000.0,
                                  moe=MoEConfig(n_experts=8, top_k=2, hidden=64, batch_balance=16)),
    # GPU-sized (the Qwen3-style shape of the torchtitan kit): 12 x 2048, 16 experts of 2048, top-2;
    # 2.77B parameters, 0.66B of them active
    "llama-moe-3B": LlamaConfig(n_layers=12, dim=2048, n_heads=16, n_kv_heads=8, ffn_dim=2048, vocab_size=50304,
                                rope_theta=1e6, tie_embeddings=False,
                                moe=MoEConfig(n_experts=16, top_k=2, hidden=2048, batch_balance=8)),
}


# Llama 2's published schedule (peak 3e-4 after 2,000 warm-up steps; Llama 3 8B's peak is
# 3e-4 too); the CI-sized presets keep a short warm-up for runs of tens of steps
TRAINING = {name: dict(lr=1e-3, warmup=10) if name.endswith("tiny") else dict(lr=3e-4, warmup=2000)
            for name in PRESETS}
