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

The blocks themselves, with their log-sum-exp and exact merge, and the one
attention the a2a variant runs, are in block_attention.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from meshtron.distributed.block_attention import BlockGrads, BlockwiseAttention, WholeBlocks, attention

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


class _RingGrads(BlockGrads):
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


def ring_attention(q, k, v, group):
    ring = _Ring(group)
    return BlockwiseAttention.apply(q, k, v, ring_steps(ring.rank, ring.cp, q.shape[2] // 2), ring)


# ---- all-gather and all-to-all --------------------------------------------------------

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
    return BlockwiseAttention.apply(q, whole(k), whole(v), prefix_steps(rank, cp, c), WholeBlocks())


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
