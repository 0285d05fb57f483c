"""The GPT's Hugging Face adapter: GPT-2 names, tensors and config.json.

Mapping (HF GPT-2 uses Conv1D, whose weight is the transpose of a
Linear's, and lays c_attn out as [q; k; v] where meshtron interleaves heads):
    tok_embeddings / pos_embeddings   transformer.wte / transformer.wpe
    layers.i.attn_norm / mlp_norm     transformer.h.i.ln_1 / ln_2
    layers.i.attn.qkv / attn.proj     transformer.h.i.attn.c_attn / c_proj
    layers.i.mlp.fc1 / mlp.fc2        transformer.h.i.mlp.c_fc / c_proj
    norm / output                     transformer.ln_f / lm_head
"""
from __future__ import annotations

import re

import torch

_NAMES = [
    (r"tok_embeddings\.weight", "transformer.wte.weight"),
    (r"pos_embeddings\.weight", "transformer.wpe.weight"),
    (r"layers\.(\d+)\.attn_norm\.(weight|bias)", r"transformer.h.\1.ln_1.\2"),
    (r"layers\.(\d+)\.attn\.qkv\.(weight|bias)", r"transformer.h.\1.attn.c_attn.\2"),
    (r"layers\.(\d+)\.attn\.proj\.(weight|bias)", r"transformer.h.\1.attn.c_proj.\2"),
    (r"layers\.(\d+)\.mlp_norm\.(weight|bias)", r"transformer.h.\1.ln_2.\2"),
    (r"layers\.(\d+)\.mlp\.fc1\.(weight|bias)", r"transformer.h.\1.mlp.c_fc.\2"),
    (r"layers\.(\d+)\.mlp\.fc2\.(weight|bias)", r"transformer.h.\1.mlp.c_proj.\2"),
    (r"norm\.(weight|bias)", r"transformer.ln_f.\1"),
    (r"output\.weight", "lm_head.weight"),
]


def to_hf_name(name: str) -> str:
    for pat, rep in _NAMES:
        if re.fullmatch(pat, name):
            return re.sub(pat, rep, name)
    raise KeyError(f"no GPT-2 name for {name}")


def _qkv_perm(dim: int, head_dim: int) -> torch.Tensor:
    """Row order of meshtron's head-interleaved qkv in terms of HF's [q; k; v]."""
    heads = dim // head_dim
    idx = torch.arange(3 * dim).view(3, heads, head_dim)       # HF rows: (which, head, d)
    return idx.permute(1, 0, 2).reshape(-1)                     # meshtron rows: (head, which, d)


def to_hf_tensor(name: str, t: torch.Tensor, config) -> torch.Tensor:
    if ".attn.qkv." in name:
        t = t[torch.argsort(_qkv_perm(config.dim, config.head_dim))]   # meshtron -> HF row order
    if name.endswith(".weight") and t.ndim == 2 and not name.startswith(("tok_", "pos_", "output")):
        t = t.t()                                                    # Linear -> Conv1D
    return t.contiguous()


def from_hf_tensor(name: str, t: torch.Tensor, config) -> torch.Tensor:
    if name.endswith(".weight") and t.ndim == 2 and not name.startswith(("tok_", "pos_", "output")):
        t = t.t()
    if ".attn.qkv." in name:
        t = t[_qkv_perm(config.dim, config.head_dim)]
    return t.contiguous()


def tied_names(config) -> dict[str, str]:
    """Names stored once in the file: HF ties lm_head to wte itself."""
    return {"output.weight": "tok_embeddings.weight"} if config.tie_embeddings else {}


def hf_config(config) -> dict:
    """transformers' GPT2Config for a meshtron GPTConfig."""
    if config.pos_emb != "learned":
        raise ValueError("GPT-2 has learned positions; a rotary GPT has no Hugging Face equivalent")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.max_seq_len, "n_embd": config.dim, "n_layer": config.n_layers,
            "n_head": config.n_heads, "n_inner": config.ffn_mult * config.dim, "activation_function": "gelu_new",
            "layer_norm_epsilon": config.norm_eps, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
            "tie_word_embeddings": config.tie_embeddings}


MODEL_TYPE = "gpt2"
MATH_FIELDS = ("n_layers", "dim", "n_heads", "vocab_size", "max_seq_len", "ffn_mult", "norm_eps", "tie_embeddings",
               "dropout")


def from_hf_config(d: dict):
    """A GPTConfig from a transformers GPT2Config dict; what meshtron's GPT cannot
    compute is refused by name."""
    from meshtron.models.gpt.model import GPTConfig
    problems = [f"{k}={d[k]!r} (meshtron's GPT has {v!r})" for k, v in
                (("activation_function", "gelu_new"), ("scale_attn_weights", True),
                 ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)) if k in d and d[k] != v]
    inner = d.get("n_inner") or 4 * d["n_embd"]
    if inner % d["n_embd"]:
        problems.append(f"n_inner={inner} (meshtron's GPT has a multiple of n_embd={d['n_embd']})")
    drops = {d.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(drops) > 1:
        problems.append(f"resid/embd/attn_pdrop {sorted(drops)} (meshtron's GPT has one dropout)")
    if problems:
        raise ValueError("this GPT-2 config has what meshtron's GPT cannot build: " + "; ".join(problems))
    return GPTConfig(n_layers=d["n_layer"], dim=d["n_embd"], n_heads=d["n_head"], vocab_size=d["vocab_size"],
                     max_seq_len=d.get("n_positions", 1024), ffn_mult=inner // d["n_embd"], pos_emb="learned",
                     tie_embeddings=d.get("tie_word_embeddings", True), bias=True, dropout=drops.pop(),
                     norm_eps=d.get("layer_norm_epsilon", 1e-5))


def sliceable(name: str) -> bool:
    """Conv1D weights are stored transposed and c_attn's rows reordered: read whole."""
    return False
