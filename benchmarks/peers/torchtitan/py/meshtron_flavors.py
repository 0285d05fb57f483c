"""meshtron's Llama presets as torchtitan 0.2.2 llama3 flavors, for a side-by-side
on the same model (the documents suite, benchmarks/suites.py). Loaded by torchtitan through
`--experimental.custom_import meshtron_flavors`; only adds entries to its table.

llama-1B = Llama 3.2 1B's shape: 16 x 2048, 32 heads, 8 KV heads, SwiGLU 8192
(torchtitan: 256 * ceil(int(1.5 * int(2 * 4 * 2048 / 3)) / 256) = 8192), vocabulary
128256, rope theta 5e5 with Llama 3 scaling (factor 32). torchtitan's llama3 has
no tied output, so meshtron runs it with --untie-embeddings: the same parameters
and the same FLOPs.
"""
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

llama3_args.setdefault("meshtron_llama1b", TransformerModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.5,
    rope_theta=500000, rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0), attn_type="sdpa",
    attn_mask_type="causal"))
