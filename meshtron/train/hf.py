"""safetensors export and import under any layout, with a model's Hugging Face
adapter (names, tensor layouts and config.json; meshtron/models/<name>/hf.py)
or under meshtron's own names.

Export gathers one tensor at a time (full_tensor() over its dp/tp shards),
converts it, and buffers it until the current file reaches `max_shard_bytes`;
then the file is written and the buffer dropped, so no rank ever holds more
than one file's worth of full tensors next to its own shards. Above one file
an index json maps names to files (the Hugging Face convention). Under
pipeline parallelism each stage's first rank writes its stage's files.

Import streams the other way: each rank opens the files lazily (safe_open) and
reads, tensor by tensor, only the block its shard covers (the whole tensor where
the adapter must reorder it first, or FSDP-over-TP strides its shard). When the
directory has a config.json, it must describe the model being loaded: every
field that changes the math is compared and the differences listed.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshtron.models.spec import read_hf_config


def check_hf_config(path: str, config, adapter) -> None:
    """Refuse to load weights made for another shape: every field of the adapter's
    MATH_FIELDS that differs between DIR/config.json and `config`, listed."""
    theirs = adapter.from_hf_config(read_hf_config(path))
    diff = [f"{k}: {getattr(theirs, k)!r} in {path}, {getattr(config, k)!r} here" for k in adapter.MATH_FIELDS
            if getattr(theirs, k) != getattr(config, k)]
    if diff:
        raise ValueError(f"{path} holds weights for another model: " + "; ".join(diff))


def _user_mode(path: str) -> None:
    # safetensors writes through a private temporary file (mode 0600); give it the user's umask
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _writer_info(parts):
    """Under pipeline parallelism the first rank of each stage group writes."""
    if not dist.is_initialized():
        return True, 0
    p = next(parts[0].parameters())
    mesh = p.device_mesh if isinstance(p, DTensor) else None
    lead = mesh is None or all(c == 0 for c in mesh.get_coordinate())
    return lead, dist.get_rank()


def export_safetensors(parts, path: str, config=None, adapter=None, *, max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write the model's full tensors to `path` (a directory) as safetensors; with
    a Hugging Face `adapter`, under its names with its config.json (loadable by
    transformers' from_pretrained), else under meshtron's names."""
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    hf_json = adapter.hf_config(config) if adapter else None    # refuses what has no HF equivalent, first
    skip = adapter.tied_names(config) if adapter else {}
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
            _user_mode(os.path.join(path, fname))
            files.append(fname)
            index.update({k: fname for k in buf})
        buf, size = {}, 0

    for part in parts:
        for name, t in part.state_dict().items():
            if name in skip:
                continue   # stored once, under the name it is tied to
            full = t.full_tensor() if isinstance(t, DTensor) else t   # a collective over this tensor's mesh
            if lead:
                key = adapter.to_hf_name(name) if adapter else name
                buf[key] = (adapter.to_hf_tensor(name, full, config) if adapter else full).detach().cpu().clone()
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
        if len(set(merged.values())) == 1:
            only = next(iter(merged.values()))
            os.replace(os.path.join(path, only), os.path.join(path, "model.safetensors"))
        else:
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": dict(sorted(merged.items()))}, f, indent=1)
        if hf_json is not None:
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(hf_json, f, indent=1)
            with open(os.path.join(path, "generation_config.json"), "w") as f:
                json.dump({"_from_model_config": True} | {k: hf_json[k] for k in ("bos_token_id", "eos_token_id")
                                                          if k in hf_json}, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
    return sorted(set(merged.values()))


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


def _block(p: DTensor):
    """The index block of the whole tensor that this rank's shard of `p` is, or
    None where it is no block (a strided FSDP-over-TP shard)."""
    if not all(isinstance(pl, (Shard, Replicate)) for pl in p.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def import_safetensors(parts, path: str, config, adapter=None) -> None:
    """Load safetensors (Hugging Face names through `adapter`, else meshtron's) into
    a model under any layout, one tensor at a time, each rank reading only its
    shards where it can. Every parameter must be found."""
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    if adapter and os.path.isfile(os.path.join(path, "config.json")):
        check_hf_config(path, config, adapter)
    tied = adapter.tied_names(config) if adapter else {}
    weight_map = _hf_files(path)
    handles = {}
    try:
        for part in parts:
            for name, p in part.state_dict(keep_vars=True).items():
                key = adapter.to_hf_name(name) if adapter else name
                if key not in weight_map and name in tied:
                    key = adapter.to_hf_name(tied[name]) if adapter else tied[name]   # stored once in the file
                if key not in weight_map:
                    raise KeyError(f"{path} has no tensor {key!r} for parameter {name}")
                fname = weight_map[key]
                if fname not in handles:
                    handles[fname] = safe_open(os.path.join(path, fname), "pt").__enter__()
                stored = handles[fname].get_slice(key)
                block = _block(p) if isinstance(p, DTensor) and (adapter is None or adapter.sliceable(name)) else None
                if block is not None:
                    if tuple(stored.get_shape()) != tuple(p.shape):
                        raise ValueError(f"{key} in {path} has shape {tuple(stored.get_shape())}, parameter {name} "
                                         f"has {tuple(p.shape)}")
                    p.to_local().copy_(stored[block])
                    continue
                full = handles[fname].get_tensor(key)
                if adapter:
                    full = adapter.from_hf_tensor(name, full, config)
                if tuple(full.shape) != tuple(p.shape):
                    raise ValueError(f"{key} in {path} has shape {tuple(full.shape)}, parameter {name} has "
                                     f"{tuple(p.shape)}")
                if isinstance(p, DTensor):
                    full = distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                             src_data_rank=None).to_local()
                    p.to_local().copy_(full)
                else:
                    p.copy_(full)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
