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
             passes dK/dV (fp32) around the ring, each rank's part of a block's
             gradient arriving while the rank computes its own. A rank sends (cp-1)/cp of
             2 S n_kv_heads head_dim elements per layer forward. With head-tail
             chunks, step 0 is causal over the own tokens and every later step
             is a full block of c x 2c (from a lower rank: all queries, its
             first chunk; from a higher rank: the second query chunk, all of
             its keys), the same work on every rank.
  allgather  all-gather K and V (cheap with grouped-query attention: n_kv_heads),
             then each local chunk attends its causal prefix (Llama 3's choice),
             blockwise: the keys before the chunk in full, its own causally.
  a2a        Ulysses: all-to-all from sequence-sharded to head-sharded q, k, v,
             causal attention over the whole sequence, all-to-all back; cp must
             divide the KV heads.

Block attention returns its log-sum-exp: on CUDA in bf16/fp16 through SDPA's
cuDNN or flash kernels (grouped-query K/V as they are), elsewhere a math path
(fp64 on the CPU, fp32 on GPUs), so every variant runs, and is tested exactly, on
the CPU; benchmarks/bench_cp.py checks the GPU kernels against float32.
"""
from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

VARIANTS = ("p2p", "allgather", "a2a")
aten = torch.ops.aten


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

def _kernel(q: torch.Tensor, k: torch.Tensor, causal: bool) -> str | None:
    """The fused kernel of a block: cuDNN's where SDPA would take it (the faster on
    Hopper: benchmarks/HISTORY.md, tenth session), flash's otherwise; both take grouped-query K/V
    as they are. None (the math path) off the GPU, in fp32/fp64, and for shapes
    neither kernel takes."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return None
    params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, causal, k.shape[1] != q.shape[1])
    if torch.backends.cuda.can_use_cudnn_attention(params):
        return "cudnn"
    return "flash" if torch.backends.cuda.can_use_flash_attention(params) else None


def _acc(q: torch.Tensor) -> torch.dtype:
    """The accumulator of the math path and of the merged blocks: fp64 on the CPU
    (its speed does not matter there, and the tests then hold every variant to one
    process' float64 result), fp32 on GPUs."""
    return torch.float32 if q.is_cuda and q.dtype != torch.float64 else torch.float64


def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """The math path's scaled scores q k^T / sqrt(d), -inf above the diagonal if causal."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def block_forward(q, k, v, causal: bool):
    """(out, lse (B, H, Tq)) of q over one K/V block; `causal` means q and k are
    the same tokens. The fused kernels give out in q's dtype and lse in fp32, the
    math path both in `_acc`."""
    kernel = _kernel(q, k, causal)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if kernel == "cudnn":   # its lse is (B, H, Tq, 1)
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
        return out, lse.squeeze(-1)
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    acc = _acc(q)
    s = _scores(q.to(acc), _expand(k, q.shape[1]).to(acc), causal)
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp() @ _expand(v, q.shape[1]).to(acc)), lse


def block_backward(dout, q, k, v, out, lse, causal: bool):
    """dq, dk, dv of one block, given the whole attention's out and lse (flash
    attention's backward: P = exp(S - lse), dS = P (dP - rowsum(dout * out)))."""
    kernel = _kernel(q, k, causal)
    if kernel is not None:   # the kernels read lse (and the rest) as contiguous: a row slice gives wrong gradients
        dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
        tq, tk = q.shape[2], k.shape[2]
        if kernel == "cudnn":   # no dropout: the RNG state is unused, but cuDNN wants it on the device
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            return aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse.unsqueeze(-1), seed, seed, None, None, None, tq, tk, 0.0, causal)[:3]
        seed = torch.zeros((), dtype=torch.int64)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, tq, tk, 0.0, causal, seed, seed)[:3]
    acc, kv_heads = _acc(q), k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1])
    qa, ka, va, da = q.to(acc), _expand(k, q.shape[1]).to(acc), _expand(v, q.shape[1]).to(acc), dout.to(acc)
    p = (_scores(qa, ka, causal) - lse.to(acc)[..., None]).exp()
    ds = p * (da @ va.transpose(-1, -2) - (da * out.to(acc)).sum(-1, keepdim=True))
    dq, dk, dv = ds @ ka * scale, ds.transpose(-1, -2) @ qa * scale, p.transpose(-1, -2) @ da
    if kv_heads != q.shape[1]:   # the query heads of one KV head add up
        g = q.shape[1] // kv_heads
        dk = dk.unflatten(1, (kv_heads, g)).sum(2)
        dv = dv.unflatten(1, (kv_heads, g)).sum(2)
    return dq, dk, dv


def merge_(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor) -> None:
    """Adds the attention o (log-sum-exp o_lse) of the same queries over other keys
    into out and lse (fp32 at least; views are updated in place): two passes over
    out. Empty rows start as out 0, lse -inf."""
    new = torch.logaddexp(lse, o_lse)
    out.mul_((lse - new).exp().unsqueeze(-1)).addcmul_(o, (o_lse - new).exp().unsqueeze(-1))
    lse.copy_(new)


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


def blockwise_forward(q, steps, blocks):
    """q's attention over K/V blocks, one per step (owner, q rows, key rows,
    causal), merged by their log-sum-exp: (out in q's dtype, lse in `_acc`)."""
    out = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=_acc(q), device=q.device)
    for (_, rows, keys, causal), (k, v) in zip(steps, blocks):
        o, o_lse = block_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal)
        merge_(out[:, :, rows], lse[:, :, rows], o, o_lse)
    return out.to(q.dtype), lse


def blockwise_backward(dout, q, out, lse, steps, blocks, add_dkv) -> torch.Tensor:
    """dq (in `_acc` precision) over the same blocks; each block's dk, dv go to
    add_dkv(owner, key rows, dk, dv)."""
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    for (j, rows, keys, causal), (k, v) in zip(steps, blocks):
        g_q, g_k, g_v = block_backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                       out[:, :, rows], lse[:, :, rows], causal)
        dq[:, :, rows] += g_q
        add_dkv(j, keys, g_k, g_v)
    return dq


class _Ring:
    """The cp group as a ring: each rank sends to the next and receives from the
    previous; a transfer runs while the caller computes on the block before it."""

    def __init__(self, group):
        self.group, self.cp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.cp], ranks[(self.rank - 1) % self.cp]

    def rotate(self, tensors: list[torch.Tensor]):
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return recv, dist.batch_isend_irecv(ops)

    def blocks(self, tensors: list[torch.Tensor]):
        """Yields this rank's tensors, then those of rank-1, rank-2, ...: the next
        block is on its way while the caller works on the current one."""
        for s in range(self.cp):
            nxt, works = self.rotate(tensors) if s < self.cp - 1 else (None, [])
            yield tensors
            for w in works:
                w.wait()
            tensors = nxt

    def grads(self, k, v, acc):
        return _RingGrads(self, k, v, acc)


class _Whole:
    """Every block is the whole K/V at hand (the all-gather variant): nothing moves."""

    def blocks(self, tensors: list[torch.Tensor]):
        return itertools.repeat(tensors)

    def grads(self, k, v, acc):
        return _Grads(k, v, acc)


class _Grads:
    """dK/dV of the K/V at hand, summed over the blocks that use them."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, acc: torch.dtype):
        self.dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]

    def add(self, owner: int, keys: slice, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        self.dkv[0][:, :, keys] += g_k
        self.dkv[1][:, :, keys] += g_v

    def result(self) -> list[torch.Tensor]:
        return self.dkv


class _RingGrads(_Grads):
    """dK/dV follow their block round the ring, each rank adding its part, and are
    back at the owner after cp steps; the sum so far arrives from the previous
    rank while this rank computes its own part."""

    def __init__(self, ring: _Ring, k: torch.Tensor, v: torch.Tensor, acc: torch.dtype):
        super().__init__(k, v, acc)
        self.ring, self.works = ring, []

    def add(self, owner: int, keys: slice, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        for w in self.works:
            w.wait()
        super().add(owner, keys, g_k, g_v)
        self.dkv, self.works = self.ring.rotate(self.dkv)

    def result(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.dkv


class _BlockwiseAttention(torch.autograd.Function):
    """q's attention over the K/V blocks `source` brings (the ring, or the whole K/V
    at hand), one per step of `steps`."""

    @staticmethod
    def forward(ctx, q, k, v, steps, source):
        # (B, heads, T, hd) views of the projections: sent whole
        out, lse = blockwise_forward(q, steps, source.blocks([k.contiguous(), v.contiguous()]))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.steps, ctx.source = steps, source
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.source.grads(k, v, _acc(q))
        dq = blockwise_backward(dout, q, out, lse, ctx.steps, ctx.source.blocks([k.contiguous(), v.contiguous()]),
                                grads.add)
        dk, dv = grads.result()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, group):
    ring = _Ring(group)
    return _BlockwiseAttention.apply(q, k, v, ring_steps(ring.rank, ring.cp, q.shape[2] // 2), ring)


# ---- all-gather and all-to-all --------------------------------------------------------

def attention(q, k, v, mask=None) -> torch.Tensor:
    """Differentiable attention (mask: True where a query sees a key, or a FlexAttention
    BlockMask; None: causal, aligned): SDPA (or FlexAttention) on GPUs, the math
    path in `_acc` precision elsewhere."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    acc = _acc(q)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v.to(acc)).to(q.dtype)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)   # uncompiled, FlexAttention materialises the scores


def flex(*args, **kwargs):
    """FlexAttention compiled: by itself, or inside a compiled block as part of its graph
    (not through the cached compiled function, which dynamo would trace past its cache)."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention
        return flex_attention(*args, **kwargs)
    return _compiled_flex()(*args, **kwargs)


def prefix_steps(rank: int, cp: int, c: int) -> list[tuple[int, slice, slice, bool]]:
    """The all-gather variant's blocks over the whole sequence: each of the rank's
    chunks attends every key before it in full and its own keys causally."""
    steps = []
    for rows, chunk in ((slice(0, c), rank), (slice(c, 2 * c), 2 * cp - 1 - rank)):
        if chunk:
            steps.append((0, rows, slice(0, chunk * c), False))
        steps.append((0, rows, slice(chunk * c, (chunk + 1) * c), True))
    return steps


def allgather_attention(q, k, v, group):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    order = torch.tensor(natural_order(cp), device=q.device)

    def whole(t):   # (B, H, 2c, hd) on every rank -> (B, H, T, hd) in sequence order
        t = all_gather_tensor_autograd(t.contiguous(), gather_dim=2, group=group)
        return t.unflatten(2, (2 * cp, c))[:, :, order].flatten(2, 3)

    # dK/dV of the whole go back through the all-gather's backward
    return _BlockwiseAttention.apply(q, whole(k), whole(v), prefix_steps(rank, cp, c), _Whole())


def a2a_attention(q, k, v, group, mask=None):
    """Ulysses: heads split over cp for the attention itself; `mask` (the whole
    sequence's, in sequence order: a boolean (B, 1, T, T) or a FlexAttention
    BlockMask) where packed documents do not see each other."""
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

    y = attention(to_heads(q), to_heads(k), to_heads(v), mask)
    B, h, T, d = y.shape
    y = y.unflatten(2, (2 * cp, c))[:, :, back].unflatten(2, (cp, 2)).flatten(3, 4)   # (B, H/cp, cp, 2c, d)
    y = all_to_all_single_autograd(y.movedim(2, 0).contiguous(), None, None, group)   # (cp, B, H/cp, 2c, d)
    return y.movedim(0, 1).flatten(1, 2)                                     # (B, H, 2c, d)


# ---- applying it to a model --------------------------------------------------------

def whole_sequence(t: torch.Tensor, group) -> torch.Tensor:
    """(B, 2c) of every cp rank's tokens (no gradient: document indices) -> (B, T) in sequence order."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    chunks = torch.cat(parts, dim=1).unflatten(1, (2 * cp, t.shape[1] // 2))
    return chunks[:, natural_order(cp)].flatten(1, 2)


def _swap_class(modules: list[nn.Module], prefix: str, forward) -> None:
    classes = {}
    for m in modules:
        cls = type(m)
        if cls not in classes:
            classes[cls] = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})
        m.__class__ = classes[cls]


def apply_cp(mesh: DeviceMesh, variant: str, cores: list[nn.Module], attentions: list[nn.Module],
             position_embeddings: list[nn.Module] = (), document_masks: list[nn.Module] = ()) -> None:
    """Attention across the cp group for a model whose sequences are sharded by
    `shard_sequence`: each `cores` module (q, k, v[, mask]) -> out attends over the
    whole sequence; each `attentions` module (which applies rotary positions from its
    `positions` argument) and each learned `position_embeddings` module sees this
    rank's positions; each `document_masks` module (documents -> mask) builds its
    mask over the whole sequence, which only the a2a variant attends at once.
    Model code stays as it is: forwards are swapped from outside."""
    if variant not in VARIANTS:
        raise ValueError(f"--cp-comm must be one of {VARIANTS}, not {variant!r}")
    group = mesh["cp"].get_group()
    cp, rank = mesh["cp"].size(), mesh["cp"].get_local_rank()

    def attend(self, q, k, v, mask=None):
        if variant == "a2a":
            return a2a_attention(q, k, v, group, mask)
        if mask is not None:   # Config.validate refuses this first
            raise ValueError(f"--cp-comm {variant} does not take a document mask: use --cp-comm a2a")
        return ring_attention(q, k, v, group) if variant == "p2p" else allgather_attention(q, k, v, group)

    _swap_class(cores, "ContextParallel", attend)
    _swap_class(document_masks, "ContextParallel",
                lambda self, documents: super(type(self), self).forward(whole_sequence(documents, group)))

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
