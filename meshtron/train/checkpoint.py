"""Distributed checkpoints: save, exact resume, resharding, crash safety.

Layout on disk (one directory per saved step under a root):

    root/step-00000100/   .metadata, __<rank>_*.distcp  (DCP: each rank writes its shards)
                          meshtron.json                  (model config, layout, step, file sizes + CRCs)
    root/.tmp-step-...    a save in progress; never read
    root/.lock            held by the run writing here (meshtron/train/lifetime.py)

State is keyed by parameter name (FQN), never by layout: model weights as the
DTensors FSDP/TP hold, AdamW state likewise, so DCP reshards on load to any
other layout (other dp/tp/pp degrees, zero stage, or one process). A tied weight
has one name (its first) for its optimizer state, also where a pipeline keeps a
copy on two stages. A save is made visible by one atomic rename, after every
rank has written, so a run killed mid-save leaves the previous checkpoint
untouched.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import _init_optim_state

from meshtron.distributed.agree import agree

STEP_DIR = re.compile(r"^step-(\d{8})$")
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class CheckpointError(ValueError):
    pass


class ModelMismatch(CheckpointError):
    """A sound checkpoint of another model: refused, never skipped (resuming past it
    would train this model into that model's directory)."""


STALE = "stale-"   # prefix of checkpoints set aside: never resumed, never pruned


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fqn(name: str) -> str:
    """A parameter's name without the prefixes module wrappers insert."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def model_state(parts: list[nn.Module]) -> dict:
    """Name -> tensor (DTensor shards under FSDP/TP) over all model parts (pipeline stages)."""
    return {k: v for m in parts for k, v in m.state_dict().items()}


def optimizer_state(parts: list[nn.Module], optimizer: torch.optim.Optimizer, names: dict[int, str] | None = None):
    """AdamW state keyed by parameter name instead of position, so it reshards.
    `names` (id(parameter) -> name) names tied copies by their weight's first name
    (Pipeline.param_names). Returns the state and the pairs (kept, copy) of
    parameters on this rank that share a name: the copy's state is the kept one's."""
    _init_optim_state(optimizer)   # the state exists only after a first step; loading needs its tensors
    names = names or {id(p): n for m in parts for n, p in m.named_parameters()}
    names = {k: fqn(v) for k, v in names.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state, copies, first = {}, [], {}
    for p in params:
        n = names[id(p)]
        if n in first:
            copies.append((first[n], p))
        elif p in optimizer.state:
            first[n] = p
            state[n] = optimizer.state[p]
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}, copies


def _training_state(parts, optimizer, scheduler, loader, step, names=None):
    optim, copies = optimizer_state(parts, optimizer, names)
    sd = {"model": model_state(parts), "optim": optim, "step": step}
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    if loader is not None:
        sd["data"] = loader.state_dict()
    return sd, copies


def _rng_key(rank: int) -> str:
    return f"rng/rank{rank}"


def _rng_state() -> dict:
    s = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def save(root: str, step: int, parts, optimizer, scheduler=None, loader=None, *, config=None, layout=None,
         keep: int = 3, names: dict[int, str] | None = None, model: str | None = None,
         preset: str | None = None, tokenizer: str | None = None, schedule: dict | None = None) -> str:
    """Write root/step-<step> from every rank; returns its path. `model`: the family
    (meshtron.models' registry key), `preset`: the name the run gave (--model),
    `tokenizer`: the one its text data was read with ("bytes", a tokenizer.json
    directory; None for token files, whose tokenizer is not known), `schedule`: a
    learning-rate schedule planned again at a resume (the Trainer's). Of the
    older checkpoints, only those of this model config count towards `keep`, and only
    those are removed. meshtron/train/async_checkpoint.py writes the same files from a
    background thread."""
    _stored(config)                              # before any collective: a bad config fails alone
    final, tmp = begin_save(root, step)
    sd = saved_state(parts, optimizer, scheduler, loader, step, names)
    dcp.save(sd, checkpoint_id=tmp)
    _barrier()                                   # every rank's shards are on disk
    if _rank() == 0:
        publish(root, step, keep, config=config, layout=layout, model=model, preset=preset, tokenizer=tokenizer,
                schedule=schedule)
    _barrier()
    return final


def begin_save(root: str, step: int) -> tuple[str, str]:
    """Every rank: refuse an existing step-<step>; rank 0 makes an empty .tmp-step-<step>
    (clearing what a save that died there left). Returns (final path, temporary path)."""
    final = os.path.join(root, f"step-{step:08d}")
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    if os.path.exists(final):
        raise CheckpointError(f"checkpoint {final} already exists; not overwriting it")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # a save that died earlier
        os.makedirs(tmp)
    _barrier()
    return final, tmp


def saved_state(parts, optimizer, scheduler, loader, step: int, names: dict[int, str] | None = None) -> dict:
    """What this rank writes into a checkpoint (references to the live tensors, not copies)."""
    sd, _ = _training_state(parts, optimizer, scheduler, loader, step, names)
    sd[_rng_key(_rank())] = _rng_state()        # RNG differs per rank (e.g. tp-sharded dropout)
    return sd


def publish(root: str, step: int, keep: int, *, config=None, **record) -> str:
    """Rank 0, once every rank's shards of .tmp-step-<step> are on disk: record the
    files in meshtron.json (write_record), then rename the directory to step-<step> and
    prune (put_in_place). Returns the path."""
    write_record(root, step, config=config, **record)
    return put_in_place(root, step, keep, config)


def write_record(root: str, step: int, *, config=None, layout=None, model: str | None = None,
                 preset: str | None = None, tokenizer: str | None = None, schedule: dict | None = None) -> None:
    """Rank 0: meshtron.json into .tmp-step-<step>: what the checkpoint is, and each
    file's size and CRC32 (which reads every rank's files back in full)."""
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    files = {os.path.basename(f): {"size": os.path.getsize(f), "crc32": _crc32(f)}
             for f in sorted(glob.glob(os.path.join(tmp, "*"))) + sorted(glob.glob(os.path.join(tmp, ".metadata")))}
    meta = {"step": step, "model": model, "preset": preset, "tokenizer": tokenizer, "config": _stored(config),
            "layout": _jsonable(layout), "files": files}
    if schedule is not None:
        meta["schedule"] = schedule
    with open(os.path.join(tmp, "meshtron.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def put_in_place(root: str, step: int, keep: int, config=None) -> str:
    """Rank 0, once meshtron.json is written: rename .tmp-step-<step> to step-<step>,
    then remove the oldest checkpoints of this model config beyond `keep`. Returns the path."""
    final = os.path.join(root, f"step-{step:08d}")
    os.rename(os.path.join(root, f".tmp-step-{step:08d}"), final)   # atomic: the checkpoint exists whole or not at all
    ours = [c for c in list_checkpoints(root) if _same_model(c, config)]
    for old in ours[:-keep]:   # renamed first: a killed prune leaves no partial step-N
        doomed = os.path.join(root, ".tmp-pruned-" + os.path.basename(old))
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under root, oldest first (in-progress saves are ignored)."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if STEP_DIR.match(d)]


def clear_unfinished(root: str) -> list[str]:
    """Remove what killed saves and prunes left (.tmp-*); only for the run that
    holds the directory's lock, since another run's save in progress looks the same."""
    if not os.path.isdir(root):
        return []
    left = sorted(d for d in os.listdir(root) if d.startswith(".tmp-"))
    for d in left:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return left


def latest(root: str) -> str | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def latest_good(root: str, config=None, name: str | None = None) -> tuple[str | None, list[str]]:
    """The newest checkpoint under root that validates, and what was wrong with
    each newer one (a corrupt or half-copied newest checkpoint is skipped, not fatal;
    one of another model raises ModelMismatch)."""
    skipped = []
    for path in reversed(list_checkpoints(root)):
        try:
            validate(path, config, name=name)
            return path, skipped
        except ModelMismatch:
            raise
        except CheckpointError as e:
            skipped.append(str(e))
    return None, skipped


def step_of(path: str) -> int:
    return int(STEP_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def set_aside_newer(root: str, step: int) -> list[str]:
    """Rename the checkpoints under root newer than `step` to stale-step-N (kept,
    but never resumed or pruned), so a run resumed from an older step saves its
    own later steps without meeting them. Rank 0 only; returns the new names."""
    moved = []
    for path in list_checkpoints(root):
        if step_of(path) > step:
            target = os.path.join(root, STALE + os.path.basename(path))
            n = 1
            while os.path.exists(target):
                target = os.path.join(root, f"{STALE}{n}-{os.path.basename(path)}")
                n += 1
            os.rename(path, target)
            moved.append(target)
    return moved


def record_of(path: str) -> dict | None:
    """A checkpoint's meshtron.json, or None where it is missing or unreadable."""
    return _read_meta(path)


def _read_meta(path: str) -> dict | None:
    """A checkpoint's meshtron.json, or None where it is missing or unreadable."""
    try:
        with open(os.path.join(path, "meshtron.json")) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def _config_diff(meta: dict | None, config) -> dict | None:
    """{field: (there, here)} where the checkpoint's model config differs from
    `config`; None where the checkpoint records none."""
    if meta is None or meta.get("config") is None:
        return None
    mine = _stored(config)
    return {k: (meta["config"].get(k), v) for k, v in mine.items()
            if meta["config"].get(k) != v and k != "fused_kernels"}


def _same_model(path: str, config) -> bool:
    """Whether the checkpoint at `path` records this model config (both none counts)."""
    meta = _read_meta(path)
    if meta is None:
        return False
    return meta.get("config") is None if config is None else _config_diff(meta, config) == {}


def validate(path: str, config=None, verify_crc: bool = True, name: str | None = None) -> dict:
    """Check a checkpoint before any tensor is touched: it exists, is complete,
    its files have the sizes (and CRCs) recorded at save, and it was made for
    this model (else ModelMismatch, naming both; `name`: this run's model). Returns
    its meshtron.json."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path}")
    meta_path = os.path.join(path, "meshtron.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} is not a complete meshtron checkpoint (no meshtron.json)")
    meta = _read_meta(path)
    if meta is None or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{meta_path} is empty or not a meshtron checkpoint record")
    diff = _config_diff(meta, config) if config is not None else None
    if diff:   # before the files: a checkpoint of another model is refused, whole or not
        there = meta.get("preset") or meta.get("model")
        fields = ", ".join(f"{k}={a!r} there, {b!r} here" for k, (a, b) in diff.items())
        if there:   # the models by name first, the fields that differ after
            here = f", this run trains {name}" if name else ""
            raise ModelMismatch(f"checkpoint {path} is for another model: it holds {there}{here} ({fields}); "
                                "nothing was written")
        raise ModelMismatch(f"checkpoint {path} is for another model: {fields}; nothing was written")
    for fname, info in meta["files"].items():
        fp = os.path.join(path, fname)
        if not os.path.isfile(fp):
            raise CheckpointError(f"checkpoint {path} is missing {fname}")
        if os.path.getsize(fp) != info["size"]:
            raise CheckpointError(f"checkpoint file {fp} is truncated or altered: "
                                  f"{os.path.getsize(fp)} bytes, {info['size']} expected")
        if verify_crc and _crc32(fp) != info["crc32"]:
            raise CheckpointError(f"checkpoint file {fp} is corrupted (CRC mismatch)")
    return meta


def load(path: str, parts, optimizer=None, scheduler=None, loader=None, *, config=None,
         rebatch_by_tokens: bool = False, names: dict[int, str] | None = None) -> int:
    """Load into the current layout (DCP reshards) and return the saved step. Every
    check runs on every rank first, and a problem any rank finds stops them all
    with its message, before DCP communicates."""
    with agree():
        validate(path, config)
        copies = []
        if optimizer is not None:
            sd, copies = _training_state(parts, optimizer, scheduler, None, 0, names)
        else:
            sd = {"model": model_state(parts)}
        sd["step"] = 0
        if loader is not None:
            sd["data"] = dict(loader.state_dict())
        stored = FileSystemReader(path).read_metadata().state_dict_metadata
        key = _rng_key(_rank())
        if f"{key}.cpu" in stored or key in stored:
            sd[key] = _rng_state()
        _check_shapes(path, sd, stored)
    dcp.load(sd, checkpoint_id=path)
    for kept, copy in copies:   # a tied weight held twice on this rank: one state, two parameters
        optimizer.state[copy] = {k: v.clone() for k, v in optimizer.state[kept].items()}
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, sd["optim"]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    if scheduler is not None:
        scheduler.load_state_dict(sd["scheduler"])
    if loader is not None:
        with agree():   # every rank finds the same: one message, not one per rank
            loader.load_state_dict(sd["data"], rebatch_by_tokens=rebatch_by_tokens)
    if key in sd:
        torch.set_rng_state(sd[key]["cpu"])
        if "cuda" in sd[key] and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd[key]["cuda"])
    return int(sd["step"])


def _check_shapes(path: str, sd: dict, stored: dict) -> None:
    """Every tensor asked for must be in the checkpoint with the same global shape."""
    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                yield from walk(f"{prefix}.{i}", v)
        else:
            yield prefix, obj

    for k, v in walk("", {k: v for k, v in sd.items() if k in ("model", "optim")}):
        if not isinstance(v, torch.Tensor):
            continue
        if k not in stored:
            raise CheckpointError(f"checkpoint {path} has no tensor {k!r}: it was saved from another model")
        if isinstance(stored[k], TensorStorageMetadata) and tuple(stored[k].size) != tuple(v.shape):
            raise CheckpointError(f"checkpoint {path}: {k} has shape {tuple(stored[k].size)}, "
                                  f"this model's is {tuple(v.shape)}")


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# Fields of a transformers config that say where and how it was written, not which model it
# describes: a config built in code and the same one read back from a saved model differ in them.
_NOT_THE_MODEL = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype")


def _jsonable(config):
    """A model config as stored: a dataclass (meshtron's), a mapping, or a Hugging Face
    config (its `to_dict`, less _NOT_THE_MODEL, so that a config read from disk or written by
    another transformers version still resumes). A transformers 5 config is also a dataclass,
    whose fields hold a torch.dtype: its `to_dict` comes first."""
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        return {k: v for k, v in config.to_dict().items() if k not in _NOT_THE_MODEL}
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)


def _stored(config):
    """`config` as meshtron.json will hold it (tuples become lists); a value JSON cannot
    hold is refused here, before any rank writes."""
    try:
        return json.loads(json.dumps(_jsonable(config)))
    except TypeError as e:
        raise CheckpointError(f"the model config given as config= cannot be recorded in meshtron.json: {e}") from None
