"""The Llama's Hugging Face adapter: names, tensors and config.json of
transformers' LlamaForCausalLM. Every projection is an nn.Linear on both sides
and the rotary embedding rotates halves on both, so tensors map unchanged."""
from __future__ import annotations

import re

_NAMES = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


def to_hf_name(name: str) -> str:
    for pat, rep in _NAMES:
        if re.fullmatch(pat, name):
            return re.sub(pat, rep, name)
    raise KeyError(f"no Llama name for {name}")


def to_hf_tensor(name, t, config):
    return t.contiguous()


def from_hf_tensor(name, t, config):
    return t.contiguous()


def tied_names(config) -> dict[str, str]:
    return {"output.weight": "tok_embeddings.weight"} if config.tie_embeddings else {}


def hf_config(config) -> dict:
    """transformers' LlamaConfig for a meshtron LlamaConfig."""
    rope_scaling = None
    if config.rope_scaling is not None:
        factor, low, high, context = config.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": context}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.dim, "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.head_dim, "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "rope_scaling": rope_scaling,
            "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "float32"}


MODEL_TYPE = "llama"
MATH_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta", "rope_scaling",
               "norm_eps", "tie_embeddings")


def from_hf_config(d: dict):
    """A LlamaConfig from a transformers config.json dict; fields that change the
    math and that meshtron's Llama does not have are refused by name."""
    from meshtron.models.llama.model import LlamaConfig
    problems = [f"{k}={d[k]!r} (meshtron's Llama has {v!r})" for k, v in
                (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1))
                if k in d and d[k] != v]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}       # transformers 5 / 4
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind == "llama3":
        scaling = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                   int(rope["original_max_position_embeddings"]))
    elif kind != "default":
        problems.append(f"rope type {kind!r} (meshtron's Llama has the default and llama3)")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if d.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim={d['head_dim']} (meshtron's Llama has hidden_size / heads = {hidden // heads})")
    if problems:
        raise ValueError("this Llama config has what meshtron's Llama cannot build: " + "; ".join(problems))
    return LlamaConfig(n_layers=d["num_hidden_layers"], dim=hidden, n_heads=heads,
                       n_kv_heads=d.get("num_key_value_heads") or heads, ffn_dim=d["intermediate_size"],
                       vocab_size=d["vocab_size"], max_seq_len=d.get("max_position_embeddings", 2048),
                       rope_theta=float(theta), rope_scaling=scaling, norm_eps=d.get("rms_norm_eps", 1e-6),
                       tie_embeddings=d.get("tie_word_embeddings", False))


def sliceable(name: str) -> bool:
    """Tensors stored as meshtron holds them: a rank can read just its shard."""
    return True
