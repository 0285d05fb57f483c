"""The planner's memory model: the bytes one rank holds at its peak in a step of a layout.

Parameter, gradient and optimizer bytes per rank are exact (meshtron.planner.state).

Activations follow Korthikanti et al. (2022) with flash attention (no score
matrix): s*b*h*(10 + 24/t) bytes per layer and micro-batch, 34*s*b*h/t with
sequence parallelism, s/cp tokens under cp; full recompute keeps the layer
input, selective keeps the matmul outputs. A pipeline's first stage holds
min(pp, micro-batches) of them in flight under 1F1B (all under GPipe).
"""
from __future__ import annotations

import dataclasses
import math

from meshtron.config import ParallelConfig
from meshtron.distributed.expert_parallel import dispatch_of
from meshtron.distributed.fused_loss import default_chunk
from meshtron.planner.state import pp_rank_share, pp_rank_states


def _layer_elements(cfg, t: int, sp: bool, routed_blocks: int = 1) -> float:
    """Elements per token one layer saves for backward on a tp rank, with flash
    attention and no dropout. The inputs of the two norms (split over tp by SP) and
    of the two column-parallel matmuls: those stay whole, since autograd keeps the
    gathered input of each (Megatron keeps the shard and gathers it again in
    backward); Q, K, V (K and V at the kv heads' width), the output projection's
    input and the MLP's: the activation's input and output (GeLU), or gate, up and
    their product (SwiGLU), split over tp; a mixture of experts runs top_k experts
    (and its shared ones) per token, on `routed_blocks` x as many rows under the
    padded dispatch (its ep blocks, padding included)."""
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


def activation_bytes(cfg, par: ParallelConfig, micro_batch: int, seq_len: int, layers: int, head: bool = True) -> float:
    """One micro-batch's saved activations over `layers` layers on one rank (bf16),
    and, where the rank holds the output head (`head`), the fp32 log-probabilities
    cross-entropy keeps for its backward (with --fused-loss: one chunk of them, and
    the gradients the fused loss keeps)."""
    d = par.degrees()
    tokens, h, t = micro_batch * seq_len / d["cp"], cfg.dim, d["tp"]
    full = 2 * tokens * _layer_elements(cfg, t, par.sp, _routed_blocks(par))
    if par.recompute == "full":   # each layer's input, and one layer's activations while it is recomputed
        held = 2 * tokens * h / (t if par.sp else 1) * layers + full
    elif par.recompute == "selective":   # Korthikanti et al.: the matmul outputs stay, the rest is recomputed
        held = tokens * h * (20 / t if par.sp else 2 + 18 / t) * layers
    else:
        held = full * layers
    if not head:
        return held
    if par.fused_loss:   # one chunk's fp32 logits, and the gradients of the hidden states and the head it keeps
        return held + 4 * min(tokens, default_chunk(cfg.vocab_size // t)) * cfg.vocab_size / t \
            + 2 * (tokens * h + cfg.vocab_size / t * h)
    return held + 4 * tokens * cfg.vocab_size / t


def pp_rank_memory(spec, cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int,
                   memo: dict | None = None) -> list[tuple[float, float, float, float]]:
    """(total, state, activations, gathered) bytes on the fullest rank of each pipeline rank's
    stages. They differ: each holds its own stages' layers and state, 1F1B's rank r keeps
    pp - r micro-batches in flight (GPipe all of them), and only the head's rank keeps logits."""
    d = par.degrees()
    key = tuple(getattr(par, f.name) for f in dataclasses.fields(par)
                if f.name not in ("recompute", "microbatches", "compile"))
    memo = {} if memo is None else memo
    if key not in memo:   # micro-batching and recompute leave the state as it is
        memo[key] = pp_rank_states(spec, cfg, par)
    out = []
    for r, state in enumerate(memo[key]):
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
        gathered = 2 * params * (1 if par.zero in (0, 1, 2) else 2 / max(1, layers))  # bf16 unsharded copies
        if par.fp8 == "tensorwise" and math.prod(d[a] for a in ("dp", "cp", "ep")) > 1:
            # the blocks' linears gather fp8, the rest bf16
            gathered *= 1 - 0.5 * 6 * cfg.dim * cfg.vocab_size / cfg.flops_per_token(0)
        if microbatches > 1 and (par.zero < 2 or d["pp"] > 1) and par.dtype != "fp32":
            # unsynced micro-batches accumulate the whole gradient in fp32, beside the sharded one state counts
            gathered += 4 * params
        out.append((state + acts + gathered, state, acts, gathered))
    return out


def memory_bytes(spec, cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int,
                 memo: dict | None = None) -> tuple[float, float, float, float]:
    """(total, state, activations, gathered) bytes on the fullest rank."""
    return max(pp_rank_memory(spec, cfg, par, micro_batch, microbatches, seq_len, memo))
