"""Each rank's collectives of one training step, from the config and the model
spec alone (no model is built, no tensor made): calls and bytes per (kind, mesh
axes), keyed and counted as meshtron.distributed.collectives.CollectiveCounter
counts them (an all-gather the shard this rank sends, a reduce-scatter or
all-reduce the whole tensor, a send or receive what it moves). The planner's
step time is built on these (meshtron.planner.plan.predict); tests/test_plan.py holds
them equal to what gloo counts for every layout it runs.

Where each comes from, per micro-batch unless said:
- FSDP (data_parallel.py): one all-gather per unit (a block, the experts of an
  MoE block, the rest of a stage) of its shard, each parameter's dim 0 padded
  to a multiple of the shard count, in the compute dtype; a reduce-scatter of
  the padded whole in the reduce dtype (an all-reduce under zero 0, and across
  HSDP replicas, once a step). Zero 3 gathers a block again for its backward
  (under a pipeline m + 1 times a step: a forward after a backward finds it
  gathered); zero 0-2 gather once a step, zero 0-1 reduce once a step, and so
  does a pipeline's stage.
- TP: with SP, a block all-gathers its attention's and its MLP's input and
  reduce-scatters their outputs, and the backward mirrors each (--tp-overlap-comm
  chunked: each as tp - 1 all-to-alls of one rank's sequence piece); without SP an
  all-reduce of each output forward and of each input's gradient backward. The
  embedding and the head add one each way; the vocab-parallel loss three (N,)
  fp32 all-reduces, the fused one (--fused-loss) one all-gather of 2 x C fp32
  per chunk of C tokens. SP's norms give Partial gradients, all-reduced over tp.
- CP: the ring passes K and V round (cp - 1 steps forward, again backward) and
  dK, dV in the attention's accumulator (fp32 on GPUs, fp64 on the CPU).
- MoE: per step one sum of every block's routing statistics over the ranks
  holding other tokens; with batch balancing per block a gather of their fp32
  logits, and under cp with a capacity a gather of each sequence's weights and
  experts over cp.
- EP: per MoE block an all-to-all of the expert counts, of the token copies
  there and back, and both again backward. What a rank receives depends on the
  routing: predicted as if every rank received what it sends (exact summed
  over the ranks). The padded dispatch (--moe-dispatch padded) sends every ep
  rank a block of all of this rank's copies: ep x the bytes, whatever the routing.
  Two-batch overlap (--moe-two-batch) runs all of them once per half of the
  micro-batch, each with half the tokens.
- PP: each activation to the next stage on another rank, its gradient back;
  tied weights' gradients between the ranks holding their copies.
- Scalars: the loss' token count and sum over dp x cp x ep, the gradient norm
  once per (mesh, sharded axis) group and over pp, the MoE routing sums.
Recompute re-runs a block's forward collectives in its backward (selective:
only what it does not save, the all-gathers and c10d ops). Not modelled: async
TP's eager ring, which moves SP's all-gathers and reduce-scatters as sends over
tp (counted here as the collectives they replace); the zero-bubble schedules'
last stage under FSDP, predicted as under 1F1B (torch 2.13 computes its weight
gradients outside FSDP's accumulation; at zero 3 it lost some, so the config
refuses that pair).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

from meshtron.distributed.chunked_tensor_parallel import chunked
from meshtron.distributed.data_parallel import DTYPES
from meshtron.distributed.expert_parallel import dispatch_of
from meshtron.distributed.fused_loss import default_chunk
from meshtron.distributed.mesh import AXES, SUBMESHES
from meshtron.distributed.pipeline_parallel import stage_ids_of, stage_owner
from meshtron.planner.shards import layout_of, padded, stage_shards, tied
from meshtron.planner.state import coordinate

Key = tuple[str, str]


def _size(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _label(d: dict[str, int], axes) -> str:
    """A group's name as CollectiveCounter gives it: its axes of size > 1."""
    return "+".join(a for a in axes if d[a] > 1)


def _hsdp_labels(d: dict[str, int], replicas: int) -> tuple[str, int, str]:
    """(shard group's name, its size, replica group's name) of the dense data-parallel
    group split into `replicas` x shards: the replicas are its outer ranks. A group
    that is one mesh axis takes that axis' name."""
    dense = [a for a in SUBMESHES["dense_dp"] if d[a] > 1]
    n = math.prod(d[a] for a in dense)
    shards = n // replicas
    if replicas in (1, n):
        return _label(d, dense), shards, _label(d, dense)

    def name(size, inner, fallback):
        axes, span = [], 1
        for a in (reversed(dense) if inner else dense):
            if span == size:
                break
            axes.append(a)
            span *= d[a]
        return axes[0] if len(axes) == 1 and span == size else fallback
    return name(shards, True, "dp_shard"), shards, name(replicas, False, "dp_replicate")


def _loss_chunks(tokens: int, width: int) -> list[tuple[int, int]]:
    """(chunk size, how many) of the fused loss' token chunks (distributed.fused_loss)."""
    chunk = default_chunk(width)
    return [(chunk, tokens // chunk), (tokens % chunk, 1)]


@dataclasses.dataclass
class _Tally:
    """Calls and bytes per key: (kind, axes), or (part, kind, axes) when `by_part`."""
    by_part: bool
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    nbytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, kind: str, group: str, size: int, n: float = 1, part: str = "dp") -> None:
        """`n` calls of `size` bytes each over `group`; none when the group, the size or n is empty."""
        if group and size and n:
            key = (part, kind, group) if self.by_part else (kind, group)
            self.calls[key] += n
            self.nbytes[key] += int(size * n)


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every part of one rank's step reads: the layout, the sizes, the group names."""
    spec_name: str
    cfg: object
    par: object
    d: dict[str, int]           # the degrees
    pp_rank: int
    m: int                      # micro-batches
    mb: int                     # micro-batch size
    seq_len: int
    a: int                      # bytes per element: compute dtype, reduce dtype
    r: int
    sp: bool
    fsdp: bool
    zero: int
    shard_label: str
    k_dense: int                # the dense parameters' FSDP shards
    replica_label: str
    expert_label: str
    k_expert: int               # the expert parameters' FSDP shards
    loss_label: str
    n_stages: int
    stages: list[int]           # this rank's pipeline stages
    summaries: list[tuple]      # _stage of each
    acc: int                    # bytes per element of the ring's dK, dV (block_attention._acc)
    refwd: int                  # forwards run again in backward
    reductions_again: int       # reductions run again in backward

    @property
    def tokens(self) -> int:
        return self.mb * self.seq_len // self.d["cp"]

    @property
    def act(self) -> int:
        """Bytes of one micro-batch's activations [tokens, dim] on a tp rank before SP splits them."""
        return self.tokens * self.cfg.dim * self.a


def _step(spec, cfg, par, micro_batch: int, microbatches: int, seq_len: int, rank: int, device: str) -> _Step:
    d = par.degrees()
    a = _size(par.dtype or "bf16")   # a GPU run unless --dtype says otherwise
    n_dense = math.prod(d[x] for x in SUBMESHES["dense_dp"])
    zero = par.zero if n_dense > 1 else 1
    shard_label, k_dense, replica_label = _hsdp_labels(d, n_dense if zero == 0 else par.hsdp)
    if zero == 0:
        k_dense = 1
    k_expert = d["dp"] * d["cp"]
    pp, n_stages = d["pp"], d["pp"] * par.pp_virtual
    pp_rank = coordinate(rank, d)["pp"]
    stages = stage_ids_of(pp_rank, pp, par.pp_virtual, par.pp_schedule) if pp > 1 else [0]
    summaries = [stage_shards(spec.name, cfg, d["tp"], par.sp, par.loss_parallel, n_stages, s, d["ep"],
                              k_dense, k_expert) for s in stages]
    # selective saves all-reduces and reduce-scatters; full recomputes the attention's, not
    # the block's last (torch's checkpoint stops once backward has what it needs)
    return _Step(spec.name, cfg, par, d, pp_rank, microbatches, micro_batch, seq_len, a, _size(par.reduce_dtype),
                 sp=par.sp and d["tp"] > 1, fsdp=n_dense > 1 or par.dtype != "fp32", zero=zero,
                 shard_label=shard_label, k_dense=k_dense, replica_label=replica_label,
                 expert_label=_label(d, SUBMESHES["expert_dp"]), k_expert=k_expert,
                 loss_label=_label(d, SUBMESHES["loss"]), n_stages=n_stages, stages=stages, summaries=summaries,
                 acc=8 if device == "cpu" or a == 8 else 4,
                 refwd={"none": 0, "full": 1, "selective": 1}[par.recompute],
                 reductions_again=1 if par.recompute == "full" else 0)


def _fsdp(t: _Tally, s: _Step) -> None:
    """FSDP's gathers and reductions of each unit, and SP's Partial gradients."""
    m, pp, zero, a, r = s.m, s.d["pp"], s.zero, s.a, s.r
    gathers = {"root": 1 if pp > 1 or zero < 3 else m, "block": (m + 1 if pp > 1 else 2 * m) if zero == 3 else 1}
    gathers["experts"] = gathers["block"]
    reductions = 1 if pp > 1 or zero < 2 else m
    accumulated = (pp > 1 or zero < 2) and m > 1 and a != r    # unsynced micro-batches accumulate in fp32
    for units, partial, _, _ in s.summaries:
        for (kind, numel), count in units.items():
            expert = kind == "experts"
            if s.fsdp:
                k, group = (s.k_expert, s.expert_label) if expert else (s.k_dense, s.shard_label)
                t.add("all_gather", group if k > 1 else "", numel * a, gathers[kind] * count)
                if zero == 0 and not expert:
                    t.add("all_reduce", s.replica_label, numel * r, reductions * count)
                else:
                    t.add("reduce_scatter", group if k > 1 else "", numel * k * r, reductions * count)
                    if s.par.hsdp > 1 and not expert:
                        t.add("all_reduce", s.replica_label, numel * r, count)
        for numel in partial:   # under FSDP one at its reduction; else one bucket at the clipping
            t.add("all_reduce", "tp", numel * (r if accumulated else a), reductions if s.fsdp else 0, "tp")
    if not s.fsdp:
        t.add("all_reduce", "tp", sum(sum(p) for _, p, _, _ in s.summaries) * a, part="tp")


def _tp_blocks(t: _Tally, s: _Step, blocks: int) -> None:
    """SP's all-gathers and reduce-scatters of each block, or TP's all-reduces."""
    is_moe = getattr(s.cfg, "moe", None) is not None
    matmuls = 1 if is_moe else 2       # an MoE block's MLP runs whole on each tp rank
    m, act, act_shard = s.m * blocks, s.act, s.act // s.d["tp"]
    if s.sp and chunked(s.par):
        # each gather and reduce-scatter of a dense block as tp - 1 shifts of one piece (chunked_tensor_parallel),
        # forward and backward; recompute runs the forward's again, the last reduce-scatter's too
        t.add("all_to_all", "tp", act_shard, m * (s.d["tp"] - 1) * 4 * (2 + s.refwd), part="tp")
    elif s.sp:
        t.add("all_gather", "tp", act_shard, m * (2 * matmuls + s.refwd * matmuls), part="tp")
        t.add("reduce_scatter", "tp", act, m * (2 * matmuls + s.reductions_again), part="tp")
        if is_moe:   # its input gathered, its output split; the split's backward gathers
            t.add("all_gather", "tp", act_shard, m * (2 + s.refwd), part="tp")
    else:
        t.add("all_reduce", "tp", act, m * (2 * matmuls + s.reductions_again), part="tp")


def _cp_blocks(t: _Tally, s: _Step, blocks: int) -> None:
    """Each block's attention over the cp ranks' keys and values: ring, all-gather or all-to-all."""
    cfg, cp, a, m = s.cfg, s.d["cp"], s.a, s.m * blocks
    hd, tp = cfg.dim // cfg.n_heads, s.d["tp"]
    heads, kv_heads = cfg.n_heads // tp, getattr(cfg, "n_kv_heads", cfg.n_heads) // tp
    kv = s.mb * kv_heads * (s.seq_len // cp) * hd
    if s.par.cp_comm == "p2p":
        for kind in ("send", "recv"):
            t.add(kind, "cp", kv * a, m * 2 * (cp - 1) * (2 + s.refwd), part="cp")
            t.add(kind, "cp", kv * s.acc, m * 2 * cp, part="cp")
    elif s.par.cp_comm == "allgather":
        t.add("all_gather", "cp", kv * a, m * 2 * (1 + s.refwd), part="cp")
        t.add("reduce_scatter", "cp", kv * a * cp, m * 2, part="cp")
    else:
        q_kv_out = (2 * heads + 2 * kv_heads) * s.mb * (s.seq_len // cp) * hd * a
        t.add("all_to_all", "cp", q_kv_out, m * (2 + s.refwd), part="cp")


def _moe_blocks(t: _Tally, s: _Step, blocks: int) -> None:
    """Each MoE block's gathers of a cp-split sequence (batch balancing, capacity) and ep all-to-alls."""
    moe, m, refwd, tokens = s.cfg.moe, s.m * blocks, s.refwd, s.tokens
    E, k = moe.n_experts, moe.top_k
    seq = "cp" if s.d["cp"] > 1 else ""
    if moe.batch_balance > 0 and not moe.balanced:   # each sequence's selection logits, fp32, from its cp ranks
        t.add("all_gather", seq, tokens * E * 4, m * (1 + refwd), part="cp")
    if moe.capacity > 0:
        t.add("all_gather", seq, tokens * k * s.a, m * (1 + refwd), part="cp")
        t.add("all_gather", seq, tokens * k * 8, m * (1 + refwd), part="cp")
    if s.d["ep"] > 1:
        halves = 2 if s.par.moe_two_batch else 1   # each half of the micro-batch its own all-to-alls
        t.add("all_to_all", "ep", 8 * E, m * halves * (1 + refwd), part="ep")
        blocks_sent = s.d["ep"] if dispatch_of(s.par.moe_dispatch, s.d["ep"]) == "padded" else 1
        t.add("all_to_all", "ep", blocks_sent * tokens // halves * k * s.cfg.dim * s.a, m * halves * (4 + 2 * refwd),
              part="ep")


def _tp_embedding(t: _Tally, s: _Step) -> None:
    """The vocab-parallel embedding (and SP's split of a learned positions' table)."""
    m, act, tp = s.m, s.act, s.d["tp"]
    if s.sp:
        t.add("reduce_scatter", "tp", act, m, part="tp")
        t.add("all_gather", "tp", act // tp, m, part="tp")
        if getattr(s.cfg, "pos_emb", None) == "learned":   # the positions' table, split by SP
            t.add("all_gather", "tp", s.seq_len // s.d["cp"] // tp * s.cfg.dim * s.a, m, part="tp")
    else:
        t.add("all_reduce", "tp", act, m, part="tp")


def _tp_head(t: _Tally, s: _Step) -> None:
    """The head, and the loss over its vocab shards."""
    m, act, tp = s.m, s.act, s.d["tp"]
    if s.sp:
        t.add("all_gather", "tp", act // tp, m, part="tp")
        t.add("reduce_scatter", "tp", act, m, part="tp")
    else:
        t.add("all_reduce", "tp", act, m, part="tp")
    if s.par.fused_loss:   # one all-gather of (logsumexp, target logit) per chunk of tokens
        for chunk, n in _loss_chunks(s.tokens, s.cfg.vocab_size // tp):
            t.add("all_gather", "tp", 2 * chunk * (8 if s.a == 8 else 4), m * n, part="tp")
    elif s.par.loss_parallel:
        t.add("all_reduce", "tp", s.tokens * (8 if s.a == 8 else 4), 3 * m, part="tp")
    else:
        t.add("all_gather", "tp", s.tokens * s.cfg.vocab_size // tp * s.a, m, part="tp")


def _activations(t: _Tally, s: _Step) -> None:
    """TP, CP and EP traffic of each of this rank's stages, per micro-batch."""
    tp, moe = s.d["tp"], getattr(s.cfg, "moe", None)
    for stage, (_, _, _, n_blocks) in zip(s.stages, s.summaries):
        if tp > 1:
            _tp_blocks(t, s, n_blocks)
        if s.d["cp"] > 1:
            _cp_blocks(t, s, n_blocks)
        if moe is not None:
            _moe_blocks(t, s, n_blocks)
        if tp > 1 and stage == 0:
            _tp_embedding(t, s)
        if tp > 1 and stage == s.n_stages - 1:
            _tp_head(t, s)
    if moe is not None:   # end_step: every block's statistics of the step, one sum
        blocks = sum(n for *_, n in s.summaries)
        t.add("all_reduce", s.loss_label, blocks * (2 * moe.n_experts + 2) * 4)


def _pipeline(t: _Tally, s: _Step) -> None:
    """Activations and their gradients between stages on other ranks, tied weights'
    gradients, and the pipeline's scalars."""
    d, par, m = s.d, s.par, s.m
    pp, sp_degree = d["pp"], d["tp"] if s.sp else 1
    hop = s.mb * (s.seq_len // d["cp"] // sp_degree) * s.cfg.dim * s.a
    owner = functools.partial(stage_owner, pp=pp, virtual=par.pp_virtual, schedule=par.pp_schedule)
    for stage in s.stages:
        for peer in (stage - 1, stage + 1):
            if 0 <= peer < s.n_stages and owner(peer) != s.pp_rank:
                t.add("send", "pp", hop, m, part="pp")
                t.add("recv", "pp", hop, m, part="pp")
    params, _ = layout_of(s.spec_name, s.cfg, d["tp"], par.sp, par.loss_parallel)
    for pid, held in tied(s.spec_name, s.cfg, d["tp"], par.sp, par.loss_parallel, s.n_stages):
        holders = {owner(st) for st in held}   # a tied weight's copies on two pp ranks swap gradients
        if len(holders) > 1 and s.pp_rank in holders:
            shape = params[pid][0]
            numel = padded(shape, s.k_dense) if s.fsdp else math.prod(shape)
            t.add("send", "pp", numel * 4, part="pp")
            t.add("recv", "pp", numel * 4, part="pp")
    t.add("all_reduce", "pp", 4, 2, "pp")    # the loss' sum over stages, the squared norm's
    if getattr(s.cfg, "moe", None) is not None:
        t.add("all_reduce", "pp", 3 * 4, part="pp")    # the MoE statistics: sums, then the worst loads
        t.add("all_reduce", "pp", 2 * 4, part="pp")


def _scalars(t: _Tally, s: _Step) -> None:
    """The loss' token count and sum; the gradient norm's all-reduce per (mesh, sharded axis) group."""
    t.add("all_reduce", s.loss_label, 4, 2)
    groups = set()
    for expert, tp_dtensor, tp_split in set().union(*(kinds for _, _, kinds, _ in s.summaries)):
        if expert:
            groups.add(("experts", ((s.expert_label,) if s.fsdp and s.k_expert > 1 else ())
                        + (("ep",) if s.d["ep"] > 1 else ())))
        else:
            sharded = ((s.shard_label,) if s.fsdp and s.k_dense > 1 else ()) + (("tp",) if tp_split else ())
            groups.add(("dense", tp_dtensor, sharded))
    for g in groups:
        for axis in g[-1]:
            t.add("all_reduce", axis, 4)


def step_collectives(spec, cfg, par, micro_batch: int, microbatches: int, seq_len: int, rank: int = 0,
                     device: str = "cuda", by_part: bool = False) -> tuple[dict[Key, int], dict[Key, int]]:
    """(calls, bytes) per (kind, mesh axes) that `rank` issues in one training step
    under `par` (explicit degrees). `device`: where it runs ("cpu" changes the
    dtype of the context-parallel ring's gradients). `by_part`: keys (part, kind,
    axes), part one of "dp" (FSDP and the scalars), "tp", "cp", "ep", "pp", for the
    step time (an all-gather over cp may be FSDP's or attention's)."""
    s, t = _step(spec, cfg, par, micro_batch, microbatches, seq_len, rank, device), _Tally(by_part)
    _fsdp(t, s)
    _activations(t, s)
    if s.d["pp"] > 1:
        _pipeline(t, s)
    _scalars(t, s)
    return dict(t.calls), dict(t.nbytes)


def group_size(d: dict[str, int], label: str, hsdp: int = 1) -> int:
    """How many ranks a CollectiveCounter group name spans."""
    n_dense = math.prod(d[a] for a in SUBMESHES["dense_dp"])
    if label == "dp_shard":
        return n_dense // hsdp
    if label == "dp_replicate":
        return hsdp
    return math.prod(d[a] for a in label.split("+") if a in AXES)

