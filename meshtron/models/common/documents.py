"""Packed documents that do not see each other.

A sample packs documents back to back (Megatron's GPTDataset way). With a
document mask a token attends only to the tokens before it in its own document
(Megatron's --reset-attention-mask, torchtitan's block_causal), and with
per-document positions the rotary (or learned) positions restart at each
document's start (--reset-position-ids). The loader gives each token its
document's index within the sample (meshtron.data.BatchLoader.next_batch);
`document_inputs` turns that into what the model's forward takes.

The mask is built once per forward and reused by every layer: on CUDA a
FlexAttention BlockMask (blocks that the mask empties are skipped), elsewhere a
dense boolean (B, 1, T, T) for scaled_dot_product_attention, which computes
exactly what the GPU does, so the CPU tests check the masking itself.
`DocumentMask` is the module that builds it, so that a layout that shards the
sequence (context parallelism) can build it over the whole sequence instead.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.distributed.block_attention import flex


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document indices -> (B, T) each token's position within its document."""
    idx = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return idx - torch.where(first, idx, 0).cummax(dim=1).values


def document_inputs(documents: torch.Tensor, y: torch.Tensor, *, mask: bool, positions: bool,
                    eod_mask_loss: bool, ignore_index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """documents (B, T + 1): each token of the samples' windows (inputs then the last
    target) -> (targets, the model's per-token keyword inputs). eod_mask_loss: no loss
    where a document's last token would predict the next document's first."""
    docs = documents[:, :-1]
    if eod_mask_loss:
        y = y.masked_fill(documents[:, 1:] != docs, ignore_index)
    inputs = {}
    if mask:
        inputs["documents"] = docs
    if positions:
        inputs["positions"] = positions_in_documents(docs)
    return y, inputs


def kept_pairs(documents: torch.Tensor) -> float:
    """The share of the causal mask's query-key pairs that the document mask keeps in a
    batch of (B, T) document indices: sum of l(l+1) over its documents of l tokens, over
    B * T(T+1). The log counts attention FLOPs in this share (a run of many short
    documents computes a fraction of causal attention: FlexAttention skips the rest)."""
    b, t = documents.shape
    rows = documents.to(torch.int64) + torch.arange(b, device=documents.device).unsqueeze(1) * (t + 1)
    lengths = torch.unique_consecutive(rows.flatten(), return_counts=True)[1].to(torch.float64)
    return float((lengths * (lengths + 1)).sum() / (b * t * (t + 1)))


def dense_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor | None = None,
               k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1, Tq, Tk): True where a query sees a key, causally within its document.
    Positions (B, T) in the sequence default to 0..T-1."""
    q_pos = torch.arange(q_docs.shape[1], device=q_docs.device) if q_pos is None else q_pos
    k_pos = torch.arange(k_docs.shape[1], device=k_docs.device) if k_pos is None else k_pos
    causal = q_pos.unsqueeze(-1) >= k_pos.unsqueeze(-2)
    return ((q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2)) & causal).unsqueeze(1)


# FlexAttention's tiles where torch's defaults are slow, by (compute capability, dtype, head dim):
# max-autotune's picks (forward 128 x 64, backward 64 x 64, 4 warps, 3 stages) without its
# compile time. On an H100 at llama-1B's heads the default forward tile (128 x 128) is the slower
# one in autotuning.
TILES = {(9, 0, torch.bfloat16, 64): dict(BLOCK_M=128, BLOCK_N=64, BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64,
                                          num_warps=4, num_stages=3)}
_capability: dict = {}   # CUDA device index -> (major, minor): read where masks are built, outside compiled blocks


def kernel_options(q: torch.Tensor) -> dict | None:
    """TILES' options for q's GPU, dtype and head dim (None: torch's defaults)."""
    cap = _capability.get(q.device.index)
    return TILES.get((*cap, q.dtype, q.shape[-1])) if cap else None


BLOCK = 128   # FlexAttention's sparse block (its default): the mask's granularity


def block_mask(documents: torch.Tensor):
    """A FlexAttention BlockMask of `documents` (B, T), causal within each document.

    Which blocks of BLOCK x BLOCK scores to visit comes from each block's lowest and
    highest document index, O((T / BLOCK)^2): create_block_mask would evaluate the
    mask at all T^2 pairs (at 64K tokens, tensors of 4 GiB each). A query block
    visits a key block at or before it whose document range meets its own (a
    superset of the blocks with a visible pair: the mask itself decides inside); the
    block is full (the mask not evaluated) only below the diagonal with one document
    on both sides."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    def same_document_causal(b, h, q, k):
        return (documents[b, q] == documents[b, k]) & (q >= k)
    B, T = documents.shape
    if documents.is_cuda and documents.device.index not in _capability:
        _capability[documents.device.index] = torch.cuda.get_device_capability(documents.device)
    if T % BLOCK:
        return create_block_mask(same_document_causal, B, None, T, T, device=documents.device)
    blocks = documents.view(B, T // BLOCK, BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)                         # (B, n)
    i = torch.arange(T // BLOCK, device=documents.device)
    qlo, qhi, klo, khi = lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]   # [b, q block, kv block]
    visit = (i[:, None] >= i[None, :]) & (khi >= qlo) & (klo <= qhi)
    full = (i[:, None] > i[None, :]) & (qlo == qhi) & (klo == khi) & (qlo == klo)

    def ordered(dense):   # create_block_mask's layout: per query block, the count, then the visited blocks first
        dense = dense.to(torch.int32).unsqueeze(1)                     # (B, 1 head for all, n, n)
        return (dense.sum(-1).to(torch.int32).contiguous(),
                torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())
    return BlockMask.from_kv_blocks(*ordered(visit & ~full), *ordered(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=same_document_causal, seq_lengths=(T, T))


def document_mask(documents: torch.Tensor, dense: bool = False):
    """The mask every attention core of one forward takes: a BlockMask on CUDA (unless
    `dense`: an attention with dropout), else the dense boolean."""
    if documents.is_cuda and not dense:
        return block_mask(documents)
    return dense_mask(documents, documents)


def masked_attention(q, k, v, mask, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of (B, H, T, hd) q over (B, H_kv, T, hd) k, v under a document mask
    (document_mask's); grouped-query K/V as they are."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor):
        if gqa and q.is_cuda:   # CUDA's masked kernels take K/V with the query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    return flex(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=kernel_options(q))


# inductor's FlexAttention kernels take head dims of 16 and up (tl.dot): below, as in the tiny
# presets, the GPU takes the dense mask through SDPA
FLEX_MIN_HEAD_DIM = 16


class DocumentMask(nn.Module):
    """documents (B, T) -> the mask of one forward (document_mask). A module of its own,
    without parameters, so that a layout can replace how it is built. `dense` where
    FlexAttention cannot run the attention: dropout, or heads narrower than FLEX_MIN_HEAD_DIM."""

    def __init__(self, head_dim: int, dropout: float = 0.0):
        super().__init__()
        self.dense = dropout > 0 or head_dim < FLEX_MIN_HEAD_DIM

    def forward(self, documents: torch.Tensor):
        return document_mask(documents, self.dense)
