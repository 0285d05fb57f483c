"""safetensors export and import, with Hugging Face GPT-2 names for the GPT.

Export gathers one tensor at a time (full_tensor() over its dp/tp shards),
converts it, and buffers it until the current file reaches `max_shard_bytes`;
then the file is written and the buffer dropped, so no rank ever holds more
than one file's worth of full tensors next to its own shards. Above one file
an index json maps names to files (the Hugging Face convention). Under
pipeline parallelism each stage's first rank writes its stage's files.

Import streams the other way: each rank opens the files lazily (safe_open),
reads one tensor, converts it and keeps its own shard.

GPT-2 mapping (HF GPT-2 uses Conv1D, whose weight is the transpose of a
Linear's, and lays c_attn out as [q; k; v] where meshtron interleaves heads):
    tok_embeddings / pos_embeddings   transformer.wte / transformer.wpe
    layers.i.attn_norm / mlp_norm     transformer.h.i.ln_1 / ln_2
    layers.i.attn.qkv / attn.proj     transformer.h.i.attn.c_attn / c_proj
    layers.i.mlp.fc1 / mlp.fc2        transformer.h.i.mlp.c_fc / c_proj
    norm / output                     transformer.ln_f / lm_head
"""
from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

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


def _writer_info(parts):
    """Under pipeline parallelism the first rank of each stage group writes."""
    if not dist.is_initialized():
        return True, 0
    p = next(parts[0].parameters())
    mesh = p.device_mesh if isinstance(p, DTensor) else None
    lead = mesh is None or all(c == 0 for c in mesh.get_coordinate())
    return lead, dist.get_rank()


def export_safetensors(model_or_parts, path: str, *, hf_names: bool = True, max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write the model's full tensors to `path` (a directory) as safetensors;
    `hf_names` maps to GPT-2's names (loadable by transformers' GPT2LMHeadModel)."""
    parts = model_or_parts if isinstance(model_or_parts, (list, tuple)) else [model_or_parts]
    config = parts[0].config
    if hf_names and config.pos_emb != "learned":
        raise ValueError("GPT-2 has learned positions; a rotary model can be exported with hf_names=False")
    lead, rank = _writer_info(parts)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    files, index, buf, size = [], {}, {}, 0

    def flush():
        nonlocal buf, size
        if buf:
            fname = f"model-r{rank:05d}-{len(files):05d}.safetensors"
            save_file(buf, os.path.join(path, fname), metadata={"format": "pt"})
            files.append(fname)
            index.update({k: fname for k in buf})
        buf, size = {}, 0

    for part in parts:
        for name, t in part.state_dict().items():
            if name == "output.weight" and config.tie_embeddings and hf_names and part.tok_embeddings is not None:
                continue   # HF ties lm_head to wte itself
            full = t.full_tensor() if isinstance(t, DTensor) else t   # a collective over this tensor's mesh
            if lead:
                key = to_hf_name(name) if hf_names else name
                buf[key] = (to_hf_tensor(name, full, config) if hf_names else full).detach().cpu().clone()
                size += buf[key].numel() * buf[key].element_size()
                if size >= max_shard_bytes:
                    flush()
            del full
    if lead:
        flush()
    all_index = [index]
    if dist.is_initialized():
        all_index = [None] * dist.get_world_size()
        dist.all_gather_object(all_index, index)
    merged = {k: v for idx in all_index for k, v in idx.items()}
    if rank == 0:
        if len(set(merged.values())) == 1 and hf_names:
            only = next(iter(merged.values()))
            os.replace(os.path.join(path, only), os.path.join(path, "model.safetensors"))
        else:
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": dict(sorted(merged.items()))}, f, indent=1)
        if hf_names:
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(gpt2_config(config), f, indent=1)
    if dist.is_initialized():
        dist.barrier()
    return sorted(set(merged.values()))


def gpt2_config(config) -> dict:
    """transformers' GPT2Config for a meshtron GPTConfig."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.max_seq_len, "n_embd": config.dim, "n_layer": config.n_layers,
            "n_head": config.n_heads, "n_inner": config.ffn_mult * config.dim, "activation_function": "gelu_new",
            "layer_norm_epsilon": config.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": config.tie_embeddings}


def _hf_files(path: str) -> dict[str, str]:
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(idx):
        with open(idx) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    with safe_open(single, "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


@torch.no_grad()
def import_safetensors(model_or_parts, path: str, *, hf_names: bool = True) -> None:
    """Load (HF GPT-2 or meshtron-named) safetensors into a model under any layout,
    one tensor at a time. Every parameter of the model must be found."""
    parts = model_or_parts if isinstance(model_or_parts, (list, tuple)) else [model_or_parts]
    config = parts[0].config
    weight_map = _hf_files(path)
    handles = {}
    try:
        for part in parts:
            for name, p in part.state_dict(keep_vars=True).items():
                key = name
                if hf_names:
                    key = to_hf_name(name)
                    if name == "output.weight" and key not in weight_map:
                        key = "transformer.wte.weight"   # tied in the file
                if key not in weight_map:
                    raise KeyError(f"{path} has no tensor {key!r} for parameter {name}")
                fname = weight_map[key]
                if fname not in handles:
                    handles[fname] = safe_open(os.path.join(path, fname), "pt").__enter__()
                full = handles[fname].get_tensor(key)
                if hf_names:
                    full = from_hf_tensor(name, full, config)
                if tuple(full.shape) != tuple(p.shape):
                    raise ValueError(f"{key} in {path} has shape {tuple(full.shape)}, parameter {name} has {tuple(p.shape)}")
                if isinstance(p, DTensor):
                    full = distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                             src_data_rank=None).to_local()
                    p.to_local().copy_(full)
                else:
                    p.copy_(full)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
