"""Attention of query blocks over key/value blocks, each block returning its
log-sum-exp, merged exactly: the pieces context parallelism computes attention from.

A block runs on CUDA in bf16/fp16 through SDPA's cuDNN or flash kernels (grouped-query
K/V as they are), elsewhere through a math path (fp64 on the CPU, fp32 on GPUs), so every
context-parallel variant runs, and is tested exactly, on the CPU;
benchmarks/bench_cp.py checks the GPU kernels against float32. `BlockwiseAttention` is
one autograd function over the blocks a source brings: the ring's (context_parallel) or
the whole K/V at hand (`WholeBlocks`). `attention` is one attention over a whole
sequence (the all-to-all variant's), under a document mask too.
"""
from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


# ---- block attention with its log-sum-exp ------------------------------------------

def _kernel(q: torch.Tensor, k: torch.Tensor, causal: bool) -> str | None:
    """The fused kernel of a block: cuDNN's where SDPA would take it (the faster on
    Hopper), flash's otherwise; both take grouped-query K/V
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


class WholeBlocks:
    """Every block is the whole K/V at hand (the all-gather variant): nothing moves."""

    def blocks(self, tensors: list[torch.Tensor]):
        return itertools.repeat(tensors)

    def grads(self, k, v, acc):
        return BlockGrads(k, v, acc)


class BlockGrads:
    """dK/dV of the K/V at hand, summed over the blocks that use them."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, acc: torch.dtype):
        self.dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]

    def add(self, owner: int, keys: slice, g_k: torch.Tensor, g_v: torch.Tensor) -> None:
        self.dkv[0][:, :, keys] += g_k
        self.dkv[1][:, :, keys] += g_v

    def result(self) -> list[torch.Tensor]:
        return self.dkv


class BlockwiseAttention(torch.autograd.Function):
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


# ---- one attention over the whole sequence at hand (the a2a variant) ------------------

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
    s = _scores(q.to(acc), k.to(acc), causal=mask is None)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.to(acc)).to(q.dtype)


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
