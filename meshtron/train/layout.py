"""What a config makes on `world` ranks, before anything runs: the model and
its preset resolved, the layout checked against the model, the batch split into
micro-batches, and this rank's part of the model built on the meta device and
parallelized. Shared by the trainer and the dry run (meshtron.planner.dry_run)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron import models
from meshtron.config import Config, ConfigError
from meshtron.distributed.data_parallel import DTYPES
from meshtron.distributed.mesh import degree
from meshtron.distributed.parallelize import dp_mesh_of
from meshtron.distributed.pipeline_parallel import Pipeline, check_pipeline, split_model, stage_io
from meshtron.models.common.moe import moe_blocks, set_aux_grad_scale


def batch_layout(par, tr, degrees: dict[str, int]) -> tuple[int, int]:
    """(micro-batches per step, global batch) from --micro-batch, --microbatches and
    --global-batch: each data-parallel rank (dp x ep) runs the micro-batches of its
    slice; a pipeline takes pp micro-batches unless told otherwise."""
    ranks = degrees["dp"] * degrees["ep"]
    per_step = tr.micro_batch * ranks
    if tr.global_batch is None:
        m = par.microbatches or (degrees["pp"] if degrees["pp"] > 1 else 1)
        return m, per_step * m
    if tr.global_batch % per_step:
        raise ConfigError(f"--global-batch {tr.global_batch} must be a multiple of --micro-batch {tr.micro_batch} "
                          f"x {ranks} data-parallel ranks (dp x ep)")
    m = tr.global_batch // per_step
    if par.microbatches is not None and par.microbatches != m:
        raise ConfigError(f"--global-batch {tr.global_batch} at --micro-batch {tr.micro_batch} and {ranks} "
                          f"data-parallel ranks makes {m} micro-batches, not --microbatches {par.microbatches}")
    return m, tr.global_batch


def resolve_layout(c: Config, world: int):
    """(spec, model config, degrees, micro-batches, global batch) of a config on
    `world` ranks, after every check of the config (Config.validate) and of the
    layout against the model."""
    degrees = c.validate(world)
    par, tr = c.parallel, c.training
    # compiled blocks take plain norms and activations: inductor fuses them itself, and
    # the Triton custom ops, opaque to it, would split its fusions and run slower
    fused = c.model.fused_kernels and not par.compile
    if c.checkpoint.init_from_hf:
        spec, mc = models.from_hf(c.checkpoint.init_from_hf)
        mc = dataclasses.replace(mc, fused_kernels=fused)
    else:
        spec, preset = models.get(c.model.model)
        mc = spec.configure(preset, dataclasses.replace(c.model, fused_kernels=fused))
    spec.check_layout(mc, degrees, par, tr.seq_len)
    if c.data.document_positions and degrees["cp"] > 1 and getattr(mc, "pos_emb", "rope") == "learned":
        raise ConfigError("--document-positions under context parallelism needs rotary positions (--pos-emb rope): "
                          "context parallelism gives learned position embeddings the sequence's own positions")
    microbatches, global_batch = batch_layout(par, tr, degrees)
    if degrees["pp"] > 1:
        check_pipeline(par.pp_schedule, degrees["pp"], par.pp_virtual, microbatches, mc.n_layers)
    return spec, mc, degrees, microbatches, global_batch


def build_model(spec, mc, mesh: DeviceMesh, par, microbatches: int) -> tuple[list[nn.Module], Pipeline | None]:
    """The model on the meta device, cut into this rank's pipeline stages and
    parallelized by its spec (TP, recompute, compile, FSDP); not yet materialized."""
    with torch.device("meta"):
        model = spec.model_cls(mc, seed=None)
    pipeline = None
    if degree(mesh, "pp") > 1:
        stages = spec.pipeline_split(mc, degree(mesh, "pp") * par.pp_virtual)
        pipeline = split_model(model, mesh, par.pp_schedule, par.pp_virtual, microbatches, stages)
    parts = pipeline.parts if pipeline is not None else [model]
    dp_mesh = dp_mesh_of(mesh, par)   # one for every part: an HSDP mesh is new process groups
    for m in parts:
        spec.parallelize(m, mesh, par, dp_mesh=dp_mesh)
    set_aux_grad_scale(moe_blocks(parts), degree(mesh, "dense_dp"), microbatches)
    return parts, pipeline


def pipeline_io(mc, config: Config, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pipeline's stage shapes from the config (stage_io), so that torch's
    schedule need not learn them by running every stage on its first step."""
    par, tr = config.parallel, config.training
    sp = degree(mesh, "tp") if par.sp else 1
    return stage_io(tr.micro_batch, tr.seq_len // degree(mesh, "cp"), mc.dim, mc.vocab_size, DTYPES[par.dtype], sp,
                    hidden_out=par.fused_loss)
