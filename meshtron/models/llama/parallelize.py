"""The Llama's layout: its tensor-parallel plan (q, k, v split by heads, KV heads
too), its layout checks, its FSDP units and its pipeline split, applied in
torchtitan's order (meshtron.distributed.parallelize)."""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from meshtron.config import ParallelConfig
from meshtron.distributed import expert_parallel
from meshtron.distributed.chunked_tensor_parallel import ChunkedColumn, ChunkedRow, chunked
from meshtron.distributed.context_parallel import apply_cp
from meshtron.distributed.local_tensor_parallel import (
    GatherInput,
    GatherLinears,
    LocalColwise,
    LocalNorm,
    LocalRowwise,
)
from meshtron.distributed.mesh import degree
from meshtron.distributed.parallelize import apply_compile, apply_dp, apply_fp8, compile_options, fp8_tp_plan
from meshtron.distributed.pipeline_parallel import split_layers
from meshtron.distributed.recompute import apply_recompute
from meshtron.distributed.tensor_parallel import (
    ReplicateParallel,
    cast_output_to_autocast_dtype,
    matches,
    parallelize_module,
    tp_mesh_of,
    vocab_parallel,
)
from meshtron.distributed.two_batch import apply_two_batch
from meshtron.models.common.layout import check_decoder_layout, head_cost
from meshtron.models.common.moe import MoE


def check_layout(cfg, degrees: dict[str, int], parallel: ParallelConfig, seq_len: int) -> None:
    tp = degrees["tp"]
    if cfg.n_kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide the number of KV heads {cfg.n_kv_heads} (grouped-query "
                         f"attention splits whole KV heads; use a tp that divides {cfg.n_kv_heads})")
    check_decoder_layout(degrees, parallel, seq_len, n_layers=cfg.n_layers, max_seq_len=cfg.max_seq_len,
                         heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, n_experts=cfg.moe.n_experts if cfg.moe else 0,
                         tp_divides={"the MLP width": cfg.ffn_dim,
                                                        "the vocabulary size": cfg.vocab_size})
    if cfg.moe and chunked(parallel) and tp > 1:
        raise ValueError("--tp-overlap-comm chunked cuts the dense blocks' matmuls: mixture-of-experts blocks "
                         "keep the DTensor styles; leave it at nccl")


def tp_plan(model: nn.Module, sp: bool, loss_parallel: bool, moe: bool = False, local: bool = False,
            overlap: bool = False, overlap_comm: str = "nccl") -> dict:
    """Megatron's plan on torchtitan's module names: wq, wk, wv and w1, w3
    column-parallel (whole heads of q and of k/v per rank), wo and w2 row-parallel.
    `local` (dense blocks only): the blocks compute on local tensors
    (local_tensor_parallel.py); the embedding, the final norm and the head keep the
    DTensor styles, whose outputs the pipeline and the losses take. `overlap` (with
    `local`): each block's gather and its column-parallel linears are one function
    whose backward hides the gather's reduce-scatter behind the weight gradients, moved
    by `overlap_comm` (nccl or copy-engine: GatherLinears), or with `overlap_comm` chunked
    every SP collective of the block cut into pieces under its matmuls, forward and
    backward (chunked_tensor_parallel.py; its column styles place the linears' weights)."""
    seq = Shard(1) if sp else Replicate()
    norm = SequenceParallel() if sp else ReplicateParallel()
    plan = {
        "tok_embeddings": vocab_parallel(sp),
        "layers.*.attention_norm": norm,
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": norm,
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "norm": norm,
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if moe:   # mixture-of-experts blocks stay whole on each tp rank
        plan["layers.*.feed_forward"] = expert_parallel.tp_style(sp)
    elif local:   # the same placements, the blocks computed on local tensors (local_tensor_parallel.py)
        plan |= {"layers.*.attention_norm": LocalNorm(sp), "layers.*.attention": GatherInput(sp),
                 "layers.*.attention.wq": LocalColwise(), "layers.*.attention.wk": LocalColwise(),
                 "layers.*.attention.wv": LocalColwise(), "layers.*.attention.wo": LocalRowwise(sp),
                 "layers.*.ffn_norm": LocalNorm(sp), "layers.*.feed_forward": GatherInput(sp),
                 "layers.*.feed_forward.w1": LocalColwise(), "layers.*.feed_forward.w3": LocalColwise(),
                 "layers.*.feed_forward.w2": LocalRowwise(sp)}
        if overlap and overlap_comm == "chunked":
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
                del plan[f"layers.*.{name}"]
            plan |= {"layers.*.attention": ChunkedColumn(("wq", "wk", "wv")), "layers.*.attention.wo": ChunkedRow(),
                     "layers.*.feed_forward": ChunkedColumn(("w1", "w3")), "layers.*.feed_forward.w2": ChunkedRow()}
        elif overlap:
            plan |= {"layers.*.attention": GatherLinears(sp, ("wq", "wk", "wv"), overlap_comm),
                     "layers.*.feed_forward": GatherLinears(sp, ("w1", "w3"), overlap_comm)}
    present = {n for n, m in model.named_modules() if m is not None}
    return {k: v for k, v in plan.items() if any(matches(k, n) for n in present)}


def apply_tp(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig, moe: list[nn.Module] = ()) -> None:
    tp_mesh, sp = tp_mesh_of(mesh), parallel.sp
    # FP8's styles and the MoE blocks' routing work on DTensors: those keep DTensor blocks,
    # except FP8 under the chunked operators, which cast their pieces themselves
    local = (parallel.fp8 == "none" or chunked(parallel)) and not moe
    plan = fp8_tp_plan(tp_plan(model, sp, parallel.loss_parallel, bool(moe), local, parallel.tp_overlap,
                               parallel.tp_overlap_comm),
                       model, mesh, parallel)
    parallelize_module(model, tp_mesh, plan, leave=moe)
    if sp:
        cast_output_to_autocast_dtype([m for n, m in model.named_modules()
                                       if n == "norm" or n.endswith(("attention_norm", "ffn_norm"))])


# linears that stay in the compute dtype under --fp8: the head feeds the loss, routers are fp32
FP8_SKIP = ("output", "layers.*.feed_forward.router.*")


def parallelize_llama(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig,
                      dp_mesh: DeviceMesh | None = None) -> None:
    """Expert parallelism, FP8, TP, CP, two-batch overlap, recompute, compile, FSDP (on `dp_mesh`: apply_dp's)."""
    blocks = list(model.layers.values())
    moe = [b.feed_forward for b in blocks if isinstance(b.feed_forward, MoE)]
    apply_fp8(model, mesh, parallel, FP8_SKIP)
    if moe:
        expert_parallel.apply_moe(moe, mesh, parallel.moe_dispatch)
    if degree(mesh, "tp") > 1:
        apply_tp(model, mesh, parallel, moe)
    if degree(mesh, "cp") > 1:
        apply_cp(mesh, parallel.cp_comm, cores=[b.attention.core for b in blocks],
                 attentions=[b.attention for b in blocks], document_masks=[model.document_mask])
    if parallel.moe_two_batch:   # before recompute, which then recomputes the interleaved block
        apply_two_batch([b for b in blocks if isinstance(b.feed_forward, MoE)],
                        lambda b: (b.attention_norm, b.attention, b.ffn_norm, b.feed_forward))
    apply_recompute(blocks, parallel.recompute)
    if parallel.compile:
        apply_compile(blocks, compile_options(parallel))
    apply_dp(model, mesh, parallel, blocks, experts=[m.experts for m in moe], dp_mesh=dp_mesh)


def pipeline_split(cfg, n_stages: int) -> list[list[str]]:
    """Layers balanced by matmul work, the head weighing what its matmul does
    (models.common.layout.head_cost)."""
    split = split_layers(cfg.n_layers, n_stages, embed_cost=0.0, head_cost=head_cost(cfg))
    stages = [[f"layers.{i}" for i in ids] for ids in split]
    stages[0] = ["tok_embeddings"] + stages[0]
    stages[-1] = stages[-1] + ["norm", "output"]
    return stages
