"""Context parallelism on the cp axis: every rank of a cp group holds 2 of the
2*cp chunks of each sequence and attention runs across the group.

Sequence sharding (Megatron's and torch's head-tail split, load-balanced for
causal masks): chunk size c = T / (2 cp); rank r holds chunks r and 2cp-1-r,
and the positions of its tokens are theirs. Everything but attention is
token-local, so only the attention core changes (`apply_cp`): the model spec
names its attention modules, and each rank computes exact causal attention of
its queries over the whole sequence, one of three ways (`--cp-comm`):

  p2p        ring attention. K/V blocks travel around the cp ranks (the next
             block's send/recv runs while the current block is computed);
             partial outputs merge by their log-sum-exp in fp32; the backward
             passes dK/dV (fp32) around the ring. A rank sends (cp-1)/cp of
             2 S n_kv_heads head_dim elements per layer forward. With head-tail
             chunks, step 0 is causal over the own tokens and every later step
             is a full block of c x 2c (from a lower rank: all queries, its
             first chunk; from a higher rank: the second query chunk, all of
             its keys), the same work on every rank.
  allgather  all-gather K and V (cheap with grouped-query attention: n_kv_heads),
             then each local chunk attends its causal prefix (Llama 3's choice).
  a2a        Ulysses: all-to-all from sequence-sharded to head-sharded q, k, v,
             causal attention over the whole sequence, all-to-all back; cp must
             divide the KV heads.

Block attention returns its log-sum-exp: on CUDA in bf16/fp16 through SDPA's
flash kernels, elsewhere a math path in fp32 (fp64 for fp64 inputs), so every
variant runs, and is tested exactly, on the CPU.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

VARIANTS = ("p2p", "allgather", "a2a")


# ---- the sequence split ---------------------------------------------------------

def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions of the tokens cp rank `rank` holds: chunks rank and 2cp-1-rank."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def shard_sequence(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This cp rank's tokens of (B, T, ...) sequences."""
    cp = mesh["cp"]
    return t[:, local_positions(t.shape[1], cp.size(), cp.get_local_rank(), t.device)]


def natural_order(cp: int) -> list[int]:
    """Chunk order [rank 0's two, rank 1's two, ...] -> indices into it in sequence order."""
    held = [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
    return [held.index(c) for c in range(2 * cp)]


# ---- block attention with its log-sum-exp ------------------------------------------

def _fused(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _acc(q: torch.Tensor) -> torch.dtype:
    """The math path's accumulator: fp64 on the CPU (its speed does not matter there,
    and the merged blocks then err less than one fused kernel does), fp32 on GPUs."""
    return torch.float32 if q.is_cuda and q.dtype != torch.float64 else torch.float64


def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def block_forward(q, k, v, causal: bool):
    """(out in q's dtype, lse fp32 (B, H, Tq)) of q over one K/V block; `causal`
    means q and k are the same tokens."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out, lse
    acc = _acc(q)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp() @ v.to(acc)), lse


def block_backward(dout, q, k, v, out, lse, causal: bool):
    """dq, dk, dv of one block, given the whole attention's out and lse (flash
    attention's backward: P = exp(S - lse), dS = P (dP - rowsum(dout * out)))."""
    kv_heads = k.shape[1]
    k2, v2 = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if _fused(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k2, v2, out, lse, None, None, q.shape[2], k2.shape[2], 0.0, causal,
            torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))[:3]
    else:
        acc = _acc(q)
        scale = 1 / math.sqrt(q.shape[-1])
        qa, ka, va, da = q.to(acc), k2.to(acc), v2.to(acc), dout.to(acc)
        s = (qa @ ka.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        p = (s - lse.to(acc)[..., None]).exp()
        ds = p * (da @ va.transpose(-1, -2) - (da * out.to(acc)).sum(-1, keepdim=True))
        dq, dk, dv = ds @ ka * scale, ds.transpose(-1, -2) @ qa * scale, p.transpose(-1, -2) @ da
    if kv_heads != q.shape[1]:   # the query heads of one KV head add up
        g = q.shape[1] // kv_heads
        dk = dk.unflatten(1, (kv_heads, g)).sum(2)
        dv = dv.unflatten(1, (kv_heads, g)).sum(2)
    return dq, dk, dv


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor, o_lse: torch.Tensor):
    """Two attentions of the same queries over disjoint keys -> their union's (in
    fp32 at least)."""
    o = o.to(torch.promote_types(o.dtype, torch.float32))
    o_lse = o_lse.to(o.dtype)
    if out is None:
        return o, o_lse
    new = torch.logaddexp(lse, o_lse)
    return out * (lse - new).exp()[..., None] + o * (o_lse - new).exp()[..., None], new


# ---- ring (p2p) -------------------------------------------------------------------

def ring_steps(rank: int, cp: int, c: int) -> list[tuple[int, slice, slice, bool]]:
    """The blocks rank `rank` computes, one per ring step: (the rank whose K/V it
    holds, its query rows, that block's key rows, causal). Local rows: chunk
    `rank` is 0..c, chunk 2cp-1-rank is c..2c."""
    steps = []
    for s in range(cp):
        j = (rank - s) % cp
        if s == 0:
            steps.append((j, slice(0, 2 * c), slice(0, 2 * c), True))
        elif j < rank:    # keys of chunks j (earlier than both of ours) and 2cp-1-j (later than both)
            steps.append((j, slice(0, 2 * c), slice(0, c), False))
        else:             # j > rank: both its chunks sit between our two
            steps.append((j, slice(c, 2 * c), slice(0, 2 * c), False))
    return steps


def _rotate(tensors: list[torch.Tensor], group, rank: int, cp: int):
    """Send to the next cp rank, receive from the previous one: (received, works)."""
    ranks = dist.get_process_group_ranks(group)
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, ranks[(rank + 1) % cp], group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, ranks[(rank - 1) % cp], group) for t in recv]
    return recv, dist.batch_isend_irecv(ops)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        out = lse = None
        kv = [k.contiguous(), v.contiguous()]   # (B, heads, T, hd) views of the projections: sent whole
        for s, (_, rows, keys, causal) in enumerate(ring_steps(rank, cp, c)):
            nxt, works = _rotate(kv, group, rank, cp) if s < cp - 1 else (None, [])
            o, o_lse = block_forward(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal)
            if out is None:
                out, lse = merge(None, None, o, o_lse)
            else:
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, o_lse)
            for w in works:
                w.wait()
            kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        acc = _acc(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        for s, (_, rows, keys, causal) in enumerate(ring_steps(rank, cp, c)):
            nxt, works = _rotate(kv, group, rank, cp) if s < cp - 1 else (None, [])
            g_q, g_k, g_v = block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                           out[:, :, rows], lse[:, :, rows], causal)
            dq[:, :, rows] += g_q
            dkv[0][:, :, keys] += g_k
            dkv[1][:, :, keys] += g_v
            # this block's gradients follow it round the ring, back to its owner at the end
            dkv, dworks = _rotate(dkv, group, rank, cp)
            for w in works + dworks:
                w.wait()
            kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


# ---- all-gather and all-to-all --------------------------------------------------------

def attention(q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable attention (mask: True where a query sees a key; None: causal,
    aligned): SDPA on GPUs, the math path in `_acc` precision elsewhere."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    acc = _acc(q)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v.to(acc)).to(q.dtype)


def _prefix_attention(q, k, v, end: int):
    """q (its last rows the last of k[:end]) attending k[:end] causally, lower-right aligned."""
    k, v = k[:, :, :end], v[:, :, :end]
    tq, tk = q.shape[2], k.shape[2]
    return attention(q, k, v, torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq))


def allgather_attention(q, k, v, group):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    order = torch.tensor(natural_order(cp), device=q.device)

    def whole(t):   # (B, H, 2c, hd) on every rank -> (B, H, T, hd) in sequence order
        t = all_gather_tensor_autograd(t.contiguous(), gather_dim=2, group=group)
        return t.unflatten(2, (2 * cp, c))[:, :, order].flatten(2, 3)

    k, v = whole(k), whole(v)
    first = _prefix_attention(q[:, :, :c], k, v, (rank + 1) * c)
    second = _prefix_attention(q[:, :, c:], k, v, (2 * cp - rank) * c)
    return torch.cat([first, second], dim=2)


def a2a_attention(q, k, v, group):
    """Ulysses: heads split over cp for the attention itself."""
    cp = dist.get_world_size(group)
    c = q.shape[2] // 2
    order = natural_order(cp)
    back = [order.index(i) for i in range(2 * cp)]

    def to_heads(t):   # (B, H, 2c, hd) -> (B, H/cp, T, hd), sequence order
        B, H, T, d = t.shape
        t = t.unflatten(1, (cp, H // cp)).movedim(1, 0).contiguous()        # (cp, B, H/cp, 2c, d)
        t = all_to_all_single_autograd(t, None, None, group)                # rows from every rank
        t = t.movedim(0, 2).flatten(2, 3)                                   # (B, H/cp, cp * 2c, d)
        return t.unflatten(2, (2 * cp, c))[:, :, order].flatten(2, 3)

    y = attention(to_heads(q), to_heads(k), to_heads(v))
    B, h, T, d = y.shape
    y = y.unflatten(2, (2 * cp, c))[:, :, back].unflatten(2, (cp, 2)).flatten(3, 4)   # (B, H/cp, cp, 2c, d)
    y = all_to_all_single_autograd(y.movedim(2, 0).contiguous(), None, None, group)   # (cp, B, H/cp, 2c, d)
    return y.movedim(0, 1).flatten(1, 2)                                     # (B, H, 2c, d)


# ---- applying it to a model --------------------------------------------------------

def apply_cp(mesh: DeviceMesh, variant: str, cores: list[nn.Module], attentions: list[nn.Module],
             position_embeddings: list[nn.Module] = ()) -> None:
    """Attention across the cp group for a model whose sequences are sharded by
    `shard_sequence`: each `cores` module (q, k, v) -> out attends over the whole
    sequence; each `attentions` module (which applies rotary positions from its
    `positions` argument) and each learned `position_embeddings` module sees this
    rank's positions. Model code stays as it is: forwards are swapped from outside."""
    if variant not in VARIANTS:
        raise ValueError(f"--cp-comm must be one of {VARIANTS}, not {variant!r}")
    group = mesh["cp"].get_group()
    cp, rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
    attend = {"p2p": lambda q, k, v: _RingAttention.apply(q, k, v, group),
              "allgather": lambda q, k, v: allgather_attention(q, k, v, group),
              "a2a": lambda q, k, v: a2a_attention(q, k, v, group)}[variant]
    classes = {}
    for core in cores:
        cls = type(core)
        if cls not in classes:
            classes[cls] = type(f"ContextParallel{cls.__name__}", (cls,), {"forward": lambda self, q, k, v: attend(
                q, k, v)})
        core.__class__ = classes[cls]

    def positions(x_len: int, device):
        return local_positions(x_len * cp, cp, rank, device)

    def attention_positions(mod, args, kwargs):
        # after tensor parallelism's input hook: x has the whole cp-local sequence (SP gathered it)
        x = args[0]
        if len(args) >= 2 and args[1] is None:
            args = (x, positions(x.shape[1], x.device)) + tuple(args[2:])
        elif len(args) < 2 and kwargs.get("positions") is None:
            kwargs["positions"] = positions(x.shape[1], x.device)
        return args, kwargs

    for m in attentions:
        m.register_forward_pre_hook(attention_positions, with_kwargs=True)
    for m in position_embeddings:   # before tensor parallelism's input hook turns them into a DTensor
        m.register_forward_pre_hook(lambda mod, args: (positions(args[0].shape[-1], args[0].device),), prepend=True)
