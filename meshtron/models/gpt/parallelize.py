"""The GPT's layout: its tensor-parallel plan, its layout checks, its FSDP units
and its pipeline split. Applied in torchtitan's order (meshtron.distributed.parallelize)."""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from meshtron.config import ParallelConfig
from meshtron.distributed import expert_parallel
from meshtron.distributed.chunked_tensor_parallel import chunked
from meshtron.distributed.context_parallel import apply_cp
from meshtron.distributed.mesh import degree
from meshtron.distributed.parallelize import apply_compile, apply_dp, apply_fp8, compile_options, fp8_tp_plan
from meshtron.distributed.pipeline_parallel import split_layers
from meshtron.distributed.recompute import apply_recompute
from meshtron.distributed.tensor_parallel import (
    ReplicateParallel,
    cast_output_to_autocast_dtype,
    fork_rng_per_rank,
    matches,
    parallelize_module,
    tp_mesh_of,
    vocab_parallel,
)
from meshtron.distributed.two_batch import apply_two_batch
from meshtron.models.common.layout import check_decoder_layout, head_cost
from meshtron.models.common.moe import MoE


def check_layout(cfg, degrees: dict[str, int], parallel: ParallelConfig, seq_len: int) -> None:
    check_decoder_layout(degrees, parallel, seq_len, n_layers=cfg.n_layers, max_seq_len=cfg.max_seq_len,
                         heads=cfg.n_heads, tp_divides={"the hidden size": cfg.dim,
                                                        "the vocabulary size": cfg.vocab_size},
                         attention_dropout=cfg.dropout, n_experts=cfg.moe.n_experts if cfg.moe else 0)
    if chunked(parallel) and degrees["tp"] > 1:
        raise ValueError("--tp-overlap-comm chunked cuts the Llama's local-tensor blocks; the GPT's keep the "
                         "DTensor styles: leave it at nccl")


def tp_plan(model: nn.Module, sp: bool, loss_parallel: bool, moe: bool = False) -> dict:
    """Megatron's plan. The fused QKV weight is laid out head by head, so its
    column split gives each rank whole heads of q, k and v. A pipeline stage
    holds only some of these modules; the plan keeps the ones it has."""
    seq = Shard(1) if sp else Replicate()
    norm = SequenceParallel() if sp else ReplicateParallel()
    plan = {
        "tok_embeddings": vocab_parallel(sp),
        "pos_embeddings": ReplicateParallel(output_shard_dim=-2 if sp else None),   # (T, dim) or (B, T, dim)
        "layers.*.attn_norm": norm,
        "layers.*.attn": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attn.qkv": ColwiseParallel(),
        "layers.*.attn.proj": RowwiseParallel(output_layouts=seq),
        "layers.*.mlp_norm": norm,
        "layers.*.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.mlp.fc1": ColwiseParallel(),
        "layers.*.mlp.fc2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel() if sp else ReplicateParallel(),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if moe:   # mixture-of-experts blocks stay whole on each tp rank
        plan["layers.*.mlp"] = expert_parallel.tp_style(sp)
    present = {n for n, m in model.named_modules() if m is not None}
    return {k: v for k, v in plan.items() if any(matches(k, n) for n in present)}


def apply_tp(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig, moe: list[nn.Module] = ()) -> None:
    tp_mesh, sp = tp_mesh_of(mesh), parallel.sp
    plan = fp8_tp_plan(tp_plan(model, sp, parallel.loss_parallel, bool(moe)), model, mesh, parallel)
    parallelize_module(model, tp_mesh, plan, leave=moe)
    norms = [m for n, m in model.named_modules() if n == "norm" or n.endswith(("attn_norm", "mlp_norm"))]
    if sp:
        cast_output_to_autocast_dtype(norms)
    if model.config.dropout > 0:
        # attention's heads are split over tp; with SP the residual stream is split too
        sharded = [f"layers.{i}.attn.core" for i in model.layers]
        if sp:
            sharded += ["emb_dropout"] + [f"layers.{i}.{d}" for i in model.layers
                                          for d in ("attn.resid_dropout", "mlp.dropout")]
        present = dict(model.named_modules())
        for name in sharded:
            if present.get(name) is not None:
                fork_rng_per_rank(present[name], tp_mesh)


# linears that stay in the compute dtype under --fp8: the head feeds the loss, routers are fp32
# (fc1, a LinearGeLU, stays too: float8.convertible)
FP8_SKIP = ("output", "layers.*.mlp.router.*")


def parallelize_gpt(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig,
                    dp_mesh: DeviceMesh | None = None) -> None:
    """Expert parallelism, FP8, TP, CP, two-batch overlap, recompute, compile, FSDP (on `dp_mesh`: apply_dp's)."""
    blocks = list(model.layers.values())
    moe = [b.mlp for b in blocks if isinstance(b.mlp, MoE)]
    apply_fp8(model, mesh, parallel, FP8_SKIP)
    if moe:
        expert_parallel.apply_moe(moe, mesh, parallel.moe_dispatch)
    if degree(mesh, "tp") > 1:
        apply_tp(model, mesh, parallel, moe)
    if degree(mesh, "cp") > 1:
        apply_cp(mesh, parallel.cp_comm, cores=[b.attn.core for b in blocks], attentions=[b.attn for b in blocks],
                 position_embeddings=[model.pos_embeddings] if model.pos_embeddings is not None else [],
                 document_masks=[model.document_mask])
    if parallel.moe_two_batch:   # before recompute, which then recomputes the interleaved block
        apply_two_batch([b for b in blocks if isinstance(b.mlp, MoE)],
                        lambda b: (b.attn_norm, b.attn, b.mlp_norm, b.mlp))
    apply_recompute(blocks, parallel.recompute)
    if parallel.compile:
        apply_compile(blocks, compile_options(parallel))
    apply_dp(model, mesh, parallel, blocks, experts=[m.experts for m in moe], dp_mesh=dp_mesh)


def pipeline_split(cfg, n_stages: int) -> list[list[str]]:
    """Layers balanced by matmul work, the head weighing what its matmul does
    (models.common.layout.head_cost); the embeddings go to the first stage, the
    final norm and the head to the last."""
    split = split_layers(cfg.n_layers, n_stages, embed_cost=0.0, head_cost=head_cost(cfg))
    stages = [[f"layers.{i}" for i in ids] for ids in split]
    stages[0] = ["tok_embeddings"] + (["pos_embeddings"] if cfg.pos_emb == "learned" else []) + stages[0]
    stages[-1] = stages[-1] + ["norm", "output"]
    return stages
