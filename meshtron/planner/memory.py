"""The planner's memory model: the most bytes a rank holds at once in a step of a
layout, as the allocator's peak (torch.cuda.max_memory_allocated) counts them.

A step's memory peaks at one of two moments, and the model takes the larger:

  loss      the loss's backward of the last micro-batch: the fp32 weights and AdamW's
            two fp32 moments (meshtron.planner.state, exact), the gradients only
            where earlier micro-batches accumulated them, the bf16 weight copies the
            forward kept for backward, every saved activation of the micro-batches in
            flight, and on the head's rank the logits and their gradient;
  optimizer the end of backward and the optimizer step: weights, gradients and
            moments, with a tied embedding's dense gradient beside its own.

Activations are the bytes each layer saves for backward per token (`layer_bytes`),
term by term what autograd keeps in the models' own code: equal to saved-tensor
hooks on the CPU (tests/test_plan_memory.py) and checked against the measured
peaks of one H200 and of two and four H100s (docs/planner.md).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch.nn as nn

from meshtron.config import ParallelConfig
from meshtron.distributed.expert_parallel import dispatch_of
from meshtron.distributed.float8 import convertible
from meshtron.distributed.fused_loss import default_chunk
from meshtron.distributed.mesh import AXES
from meshtron.models.common.experts import Experts
from meshtron.planner.state import _meta_model, pp_rank_share, state_bytes


def _layer_elements(cfg, t: int, sp: bool, routed_blocks: int = 1) -> float:
    """Elements per token one layer saves for backward on a tp rank, with flash
    attention and no dropout. The inputs of the two norms (split over tp by SP) and
    of the two column-parallel matmuls: those stay whole, since autograd keeps the
    gathered input of each (Megatron keeps the shard and gathers it again in
    backward); Q, K, V (K and V at the kv heads' width), the output projection's
    input and the MLP's: the activation's input and output (GeLU), or gate, up and
    their product (SwiGLU), split over tp; a mixture of experts runs top_k experts
    (and its shared ones) per token, on `routed_blocks` x as many rows under the
    padded dispatch (its ep blocks, padding included). The step time's memory-bound
    work (plan.compute_s) reads it; memory counts bytes with `layer_bytes`."""
    h = cfg.dim
    kv = getattr(cfg, "n_kv_heads", cfg.n_heads) * (h // cfg.n_heads)
    moe = getattr(cfg, "moe", None)
    swiglu = moe.activation == "swiglu" if moe else hasattr(cfg, "ffn_dim")
    width = (routed_blocks * moe.top_k + moe.n_shared) * moe.hidden if moe else \
        (cfg.ffn_dim if swiglu else cfg.ffn_mult * h)
    split = 2 * h + 2 * kv + (3 if swiglu else 2) * width
    return 2 * h / (t if sp else 1) + 2 * h + split / t


def _routed_blocks(par: ParallelConfig) -> int:
    """The blocks of rows an MoE block's experts take per copy: ep under the padded dispatch."""
    return par.ep if par.ep > 1 and dispatch_of(par.moe_dispatch, par.ep) == "padded" else 1


def _one_process_autocast(par: ParallelConfig) -> bool:
    """One process computes bf16 under torch.autocast on its fp32 weights, without FSDP."""
    return math.prod(par.degrees().values()) == 1 and par.dtype != "fp32" and par.mixed_precision == "autocast"


def layer_bytes(cfg, par: ParallelConfig, routed_blocks: int = 1) -> float:
    """Bytes one layer saves for backward per token on a tp rank, no recompute.

    The residual stream is in the compute dtype (one process casts the embeddings'
    outputs under autocast, as FSDP's bf16 weights give). Each norm keeps its input
    (split over tp by SP) and its fp32 statistics (RMSNorm 1/rms, LayerNorm mean and
    1/std); the column-parallel matmuls their input, the norm's output, whole (SP's
    gathered one). Attention (flash, or memory-efficient in fp32) keeps q, k, v (k and
    v at the kv heads' width; fp32's kernel takes them repeated to every head), its
    output and fp32 logsumexp per head; flash writes its output in q's layout, so a
    rotated (B, H, T, hd) q makes the output projection copy it (the GPT's q is a
    view of its fused (B, T, 3, H, hd) projection: no copy). The MLP keeps SwiGLU's
    gate, up and product, or GeLU's input and output. Compiled FP8 blocks keep
    neither the norms' outputs nor the MLP's product nor the copy: inductor
    recomputes them (and their fp8 casts) in backward.

    A mixture of experts (its block whole on every tp rank) keeps the router's fp32
    input and scores; per row its experts take, the row and the grouped GEMMs'
    outputs (SwiGLU's halves, silu and product); per copy of a token, the combine's
    fp32 output and weighted output (eager). Compiled, the router reads the norm's
    bf16 output, silu is recomputed and the combine keeps the experts' bf16 output.
    Rows per token: top_k, x `routed_blocks` under the padded dispatch (its blocks
    of padding run through the experts too). RoPE's per-position cos and sin are left
    out (T x head_dim bytes)."""
    t = par.degrees()["tp"]
    ts = t if par.sp else 1
    b = 4 if par.dtype == "fp32" else 2
    h, heads = cfg.dim, cfg.n_heads
    llama = hasattr(cfg, "ffn_dim")
    kv = h if par.dtype == "fp32" else getattr(cfg, "n_kv_heads", heads) * (h // heads)
    fp8_compiled = par.fp8 != "none" and par.compile
    copy = b == 2 and (llama or cfg.pos_emb == "rope") and not fp8_compiled
    moe = getattr(cfg, "moe", None)
    stats = 4 if llama else 8
    norms = (2 * b * h + 2 * stats) / ts
    attention = (b * (2 * h + 2 * kv) + 4 * heads + (b * h if copy else 0)) / t + (0 if fp8_compiled else b * h)
    if moe:
        # the constants: the routing's int64 indices and fp32 weights
        router = 4 * moe.n_experts + 12 + (b * h if par.compile else 4 * h)
        row = b * h + (6 if par.compile else 8) * moe.hidden + 24
        per_copy = (b * h + 20) if par.compile else (8 * h + 28)
        shared = (b * h + 8 * moe.n_shared * moe.hidden) if moe.n_shared else 0
        return norms + attention + router + moe.top_k * (routed_blocks * row + per_copy) + shared
    ffn = cfg.ffn_dim if llama else cfg.ffn_mult * h
    kept = (3 if llama else 2) - (1 if fp8_compiled else 0)
    return norms + attention + (0 if fp8_compiled else b * h) + b * kept * ffn / t


def recomputed_layer_bytes(cfg, par: ParallelConfig) -> float:
    """Bytes per token a recomputed layer keeps until its backward: its input (full),
    or with it the matmuls' outputs (selective: q, k, v, the projections', the MLP's;
    the MoE's router logits, its grouped GEMMs are recomputed)."""
    t = par.degrees()["tp"]
    b = 4 if par.dtype == "fp32" else 2
    h = cfg.dim
    held = b * h / (t if par.sp else 1)
    if par.recompute == "full":
        return held
    kv = getattr(cfg, "n_kv_heads", cfg.n_heads) * (h // cfg.n_heads)
    moe = getattr(cfg, "moe", None)
    if moe:
        mlp = 4 * moe.n_experts
    else:
        mlp = b * ((2 * cfg.ffn_dim if hasattr(cfg, "ffn_dim") else cfg.ffn_mult * h) / t + h)
    return held + b * ((h + 2 * kv) / t + h) + mlp


def head_bytes(cfg, par: ParallelConfig, tokens: float) -> float:
    """On the head's rank, at the loss's backward: the final norm's input and statistics
    and the head's input, and the logits with their gradient (the compiled
    cross-entropy keeps the logits and writes their gradient beside them, both in the
    compute dtype). With --fused-loss no logits: one chunk's, in the compute dtype,
    their fp32 softmax and its gradient at once, the head's fp32 gradient, the hidden
    states' gradient, and under autocast the head's bf16 copy."""
    t = par.degrees()["tp"]
    b = 4 if par.dtype == "fp32" else 2
    h, vocab = cfg.dim, cfg.vocab_size / t
    ends = tokens * (b * h / (t if par.sp else 1) + 4 + b * h)
    if par.fused_loss:
        chunk = min(tokens, default_chunk(cfg.vocab_size // t))
        copy = 2 * vocab * h if _one_process_autocast(par) else 0
        return ends + chunk * vocab * (2 * b + 4) + 4 * vocab * h + copy + b * tokens * h
    return ends + 2 * b * tokens * vocab


def activation_bytes(cfg, par: ParallelConfig, micro_batch: int, seq_len: int, layers: int, head: bool = True) -> float:
    """One micro-batch's bytes at the loss's backward over `layers` layers on one rank: what
    each layer keeps (all of it, or under recompute what stays until its backward) and,
    where the rank holds the output head (`head`), the logits. A rank without the head
    peaks instead while it recomputes a layer, all of whose activations it then holds."""
    tokens = micro_batch * seq_len / par.degrees()["cp"]
    full = layer_bytes(cfg, par, _routed_blocks(par)) * tokens
    if par.recompute == "none":
        return full * layers + (head_bytes(cfg, par, tokens) if head else 0)
    held = recomputed_layer_bytes(cfg, par) * tokens * layers
    return held + (head_bytes(cfg, par, tokens) if head else full)


@functools.cache
def _cast_elements(spec_name: str, cfg, recompute: str, fp8: str) -> int:
    """Weights one process's autocast copies to bf16 and the forward keeps for backward:
    the linears' (not FP8's, not the fp32 routers') and the experts', or under recompute
    the head's alone (a recomputed block keeps no copy, its backward makes them again)."""
    model = _meta_model(spec_name, cfg)
    out = 0
    for name, m in model.named_modules():
        block = name.startswith("layers.")
        if block and recompute != "none" or name.endswith("router.gate"):
            continue
        fp8_linear = fp8 != "none" and block and convertible(name, m)
        if isinstance(m, Experts) or isinstance(m, nn.Linear) and not fp8_linear:
            out += sum(p.numel() for n, p in m.named_parameters(recurse=False) if n.startswith("w"))
    return out


def pp_rank_memory(spec, cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int,
                   memo: dict | None = None) -> list[tuple[float, float, float, float]]:
    """(total, state, activations, gathered) bytes at the peak of the fullest rank of each
    pipeline rank's stages: total = state + activations + gathered, each what is live at
    the peak. The ranks differ: each holds its own stages' layers and state, 1F1B's rank
    r keeps pp - r micro-batches in flight (GPipe all of them), and only the head's rank
    keeps logits."""
    d = par.degrees()
    key = tuple(getattr(par, f.name) for f in dataclasses.fields(par)
                if f.name not in ("recompute", "microbatches", "compile"))
    memo = {} if memo is None else memo
    if key not in memo:   # micro-batching and recompute leave the state as it is
        stride = math.prod(d[a] for a in AXES[AXES.index("pp") + 1:])   # FSDP's first chunks are the largest
        memo[key] = [state_bytes(spec, cfg, par, r * stride) for r in range(d["pp"])]
    out = []
    for r, s in enumerate(memo[key]):
        layers, head, params = pp_rank_share(spec, cfg, par, r)
        if d["pp"] == 1:
            in_flight = 1
        elif par.pp_schedule == "gpipe":
            in_flight = microbatches
        elif par.pp_schedule == "1f1b":
            in_flight = min(d["pp"] - r, microbatches)
        else:   # the interleaved and zero-bubble schedules warm up about pp micro-batches on every rank
            in_flight = min(d["pp"], microbatches)
        acts = activation_bytes(cfg, par, micro_batch, seq_len, layers, head) * in_flight
        unsynced = microbatches > 1 and (par.zero < 2 or d["pp"] > 1) and par.dtype != "fp32" and \
            not _one_process_autocast(par)
        if _one_process_autocast(par):
            gathered = 2 * _cast_elements(spec.name, cfg, par.recompute, par.fp8)
        elif par.dtype == "fp32" and math.prod(d.values()) == 1:   # no FSDP, the fp32 weights computed with
            gathered = 0.0
        else:   # FSDP's unsharded bf16 weights: the stage's all under ZeRO 0-2, about two blocks' under 3
            moe = getattr(cfg, "moe", None)
            if moe:   # the experts' weights are split over ep
                per_layer = moe.n_experts * (3 if moe.activation == "swiglu" else 2) * cfg.dim * moe.hidden
                params -= layers * per_layer * (1 - 1 / d["ep"])
            gathered = 2 * params * (1 if par.zero in (0, 1, 2) else 2 / max(1, layers))
            if par.fp8 == "tensorwise" and math.prod(d[a] for a in ("dp", "cp", "ep")) > 1:
                # the blocks' linears gather fp8, the rest bf16
                gathered *= 1 - 0.5 * 6 * cfg.dim * cfg.vocab_size / cfg.flops_per_token(0)
        if unsynced:   # unsynced micro-batches accumulate the whole gradient in fp32 beside the sharded state
            gathered += 4 * params
        grads = s["grads"] if microbatches > 1 and not unsynced else 0
        loss = (s["params"] + grads + s["optim"], acts, gathered)
        # a tied embedding's backward makes its dense fp32 gradient, then adds it to the head's
        tied = 4 * cfg.vocab_size * cfg.dim / d["tp"] if getattr(cfg, "tie_embeddings", False) and d["pp"] == 1 else 0
        step = (s["params"] + s["grads"] + s["optim"], tied, 0.0)
        peak = max(loss, step, key=sum)
        out.append((sum(peak), *peak))
    return out


def memory_bytes(spec, cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int,
                 memo: dict | None = None) -> tuple[float, float, float, float]:
    """(total, state, activations, gathered) bytes on the fullest rank."""
    return max(pp_rank_memory(spec, cfg, par, micro_batch, microbatches, seq_len, memo))
