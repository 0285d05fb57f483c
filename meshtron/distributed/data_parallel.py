"""Data parallelism: DDP and ZeRO-1/2/3 through FSDP2, HSDP, mixed precision.

Every stage is one `fully_shard` call per transformer block plus one on the
root, over the dense data-parallel sub-mesh dp x cp x ep. What each stage keeps
per rank and sends per step is tabled once, in docs/parallelism.md ("Data
parallelism and ZeRO"), and measured by tests/distributed/test_data_parallel.py. Stages 0-2
keep the gathered weights from the first forward to the last backward of the
step (one all-gather per step); zero 3 gathers them per use.

FSDP2 always reduce-scatters gradients into shards and keeps a sharded fp32
master next to the weights it computes with, so ZeRO-1 (grads whole, optimizer
state sharded) is expressed by its nearest faithful equivalent: unsharded
gradients accumulate locally over micro-batches and are reduce-scattered once,
while the optimizer state and the master weights are sharded.

HSDP (`hsdp=R`): the dense dp group is split into R replicas x (n/R) shards;
parameters are sharded inside a replica (keep it inside a node) and the
gradient shards all-reduced across replicas once per step.

Mixed precision: fp32 master weights (FSDP's shards), weights cast to
param_dtype before the all-gather, gradients reduced (and accumulated) in
reduce_dtype, fp32 by default as in Megatron.

One process (a mesh of one rank) needs no FSDP: there `autocast_dtype` names
the dtype its forward runs under torch.autocast, on the module's own fp32
weights (their gradients and AdamW's state fp32, gradients accumulated in fp32
over micro-batches), and `cast_embeddings` keeps the residual stream in that
dtype, as FSDP's bf16 weights make it. Autocast casts each weight once per
micro-batch; FSDP (zero 1) once per step, but adds copies into and out of its
all-gather and reduce-scatter buffers, which on one rank move nothing.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from meshtron.distributed.choices import default_dtype
from meshtron.distributed.mesh import degree, submesh

# the names the command line offers (choices.DTYPES; tests/test_config.py checks they agree)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dp_mesh_for(mesh: DeviceMesh, zero_stage: int, hsdp: int = 1) -> DeviceMesh:
    """The 1-D (FSDP) or 2-D (HSDP / DDP) mesh FSDP2 runs on, derived from the one mesh.
    A 2-D mesh is new each call, with new process groups (a rendezvous of every rank):
    build it once per model and pass it to each of its parts (apply_fsdp's dp_mesh)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage}")
    n = degree(mesh, "dense_dp")
    if hsdp < 1 or n % hsdp:
        raise ValueError(f"hsdp={hsdp} replicas must divide the dense data-parallel size dp*cp*ep={n}")
    if zero_stage == 0 and hsdp not in (1, n):
        raise ValueError("zero 0 (DDP) replicates across all data-parallel ranks; do not combine it with --hsdp")
    replicate = n if zero_stage == 0 else hsdp
    flat = submesh(mesh, "dense_dp")
    if replicate == 1:
        return flat
    names = ("dp_replicate", "dp_shard")
    if hasattr(flat, "_unflatten"):
        return flat._unflatten(0, (replicate, n // replicate), names)
    return DeviceMesh(flat.device_type, flat.mesh.view(replicate, n // replicate), mesh_dim_names=names)


def mp_policy(param_dtype: str = "bf16", reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """fp32 master weights (FSDP keeps the sharded fp32 copy), compute in
    param_dtype, gradients reduced in reduce_dtype (fp32 by default, as Megatron)."""
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])


def autocast_dtype(mesh: DeviceMesh | None, dtype: str, mixed_precision: str = "autocast") -> torch.dtype | None:
    """The dtype one process's forward runs under torch.autocast (--mixed-precision
    autocast, --dtype bf16 or fp16, a mesh of one rank); None where the weights
    themselves are in the compute dtype (FSDP's policy) or compute is fp32."""
    if mixed_precision not in ("autocast", "fsdp"):
        raise ValueError(f"mixed_precision must be autocast or fsdp, not {mixed_precision!r}")
    dtype = dtype or default_dtype(mesh.device_type if mesh is not None else "cpu")
    one_rank = mesh is None or mesh.size() == 1
    return DTYPES[dtype] if one_rank and dtype != "fp32" and mixed_precision == "autocast" else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast to `dtype` on the device's type, or nothing for None."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def cast_embeddings(model: nn.Module) -> None:
    """Under autocast, cast every embedding's output to the autocast dtype: the
    lookups of fp32 tables would otherwise keep the residual stream (every add,
    every saved norm input) in fp32, twice the bytes of FSDP's bf16 stream. A
    lookup copies values, so this is what bf16 tables give. Outside autocast (a
    plain fp32 forward) the hook changes nothing."""
    def hook(mod, args, out):
        device = out.device.type
        if device != "meta" and out.is_floating_point() and torch.is_autocast_enabled(device):
            return out.to(torch.get_autocast_dtype(device))
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            m.register_forward_hook(hook)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, blocks: list[nn.Module], zero_stage: int = 3, hsdp: int = 1,
               param_dtype: str = "fp32", reduce_dtype: str = "fp32", experts: list[nn.Module] = (),
               dp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard each block (the transformer layers: one FSDP unit, one all-gather,
    each), then the root (embedding, final norm, output). Expert weights (Shard(0)
    over ep) are units of their own over expert_dp (dp x cp; expert_parallel.py
    divides their gradients by the ep factor FSDP does not); where expert_dp is one
    rank, below zero 3, no unit: FSDP ignores them (fp32, cast per use). `dp_mesh`: the mesh
    dp_mesh_for gives, when the caller has built it already (for another part)."""
    if dp_mesh is None:
        dp_mesh = dp_mesh_for(mesh, zero_stage, hsdp)
    reshard = zero_stage == 3
    policy = mp_policy(param_dtype, reduce_dtype)
    expert_mesh = submesh(mesh, "expert_dp")
    ignored = set()
    for e in experts:
        if expert_mesh.size() == 1 and not reshard:
            # nothing to shard or reduce: FSDP would only cast, copy in and out of its
            # buffers, and break a compiled block at its hooks. The fp32 weights stay as
            # they are; grouped_mm casts them to the activations' dtype per use, and
            # their gradients come back fp32. (zero 3 keeps FSDP: it frees that cast.)
            ignored.update(e.parameters())
        else:
            fully_shard(e, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy)
    ignored = ignored or None
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored)
    # the root's parameters are used last in forward and first in backward:
    # resharding them after forward only to gather them again at once is waste
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=ignored)
    return model


def reshard(parts: list[nn.Module]) -> None:
    """Free gathered weights after a forward that no backward follows (evaluation):
    zero 0-2 keep them gathered until the backward, which would not come, and the
    modules would keep holding the unsharded tensors in place of their parameters."""
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def set_grad_sync(model: nn.Module, zero_stage: int, is_last_micro_batch: bool) -> None:
    """Tell FSDP what the coming micro-batch's backward should communicate.

    zero 0, 1: no reduction before the last micro-batch: unsharded gradients
      accumulate locally and are reduced once (all-reduce / reduce-scatter);
    zero 2, 3 under HSDP: reduce-scatter every micro-batch (the point of ZeRO-2),
      but all-reduce across replicas once, on the summed shards;
    zero 0, 1, 2: keep the gathered parameters until the last micro-batch, so
      they are all-gathered once per step; zero 3 gathers them again each time.
    """
    if not isinstance(model, FSDPModule):
        return
    if zero_stage in (0, 1):
        model.set_requires_gradient_sync(is_last_micro_batch)
    else:
        model.set_requires_all_reduce(is_last_micro_batch)   # no-op without a replicate axis
    if zero_stage in (0, 1, 2):
        model.set_reshard_after_backward(is_last_micro_batch)
