"""Mixture of experts, in plain PyTorch: a router picks the top-k experts of each
token; the experts hold one 3-D weight per projection, [n_experts, in, out];
tokens reach them through a dispatcher (here every expert is local; expert
parallelism swaps in one that moves tokens by all-to-all, from outside).

    router   scores = softmax or sigmoid(logits = x W_r) in fp32; the top-k of
             logits + the aux-loss-free expert bias (which only selects:
             DeepSeek-V3's, on the logits) pick the experts; their scores,
             renormalized to sum 1 (route_norm,
             Qwen3's; always for sigmoid; under batch balancing by the router's
             own top-k's sum), weigh the experts' outputs, summed in
             fp32. `batch_balance` (training only) then evens the top-k over each
             sequence; `balanced` (benchmarks only) assigns experts round-robin
    experts  SwiGLU w2(silu(x w1_gate) * x w1_up) or GeLU (x w1 + b1) -> w2 + b2,
             one grouped GEMM per projection over the tokens sorted by expert
             (experts.py)
    balance  the auxiliary loss a E sum_i f_i P_i (Switch / Megatron: f_i the
             fraction of copies the router itself sent expert i over the whole
             previous step, every rank's and micro-batch's (the global batch's,
             as Qwen balances, one step late so that every micro-batch knows
             it); P_i its mean score over the tokens), added to the gradients
             by an autograd function without changing the logged loss; the
             expert bias, moved after each step towards equal token counts of
             the router's own choice in proportion to each expert's distance
             from the mean load; and, with batch_balance = r rounds, a second
             bias for each sequence alone (moe_balance.py) that gives every expert
             about the mean number of its copies, the weights faded to 0 where
             that choice flips: these two train the router to
             balance over the data, this one evens each step, whose few
             documents route much alike
    capacity dropless by default; with a capacity factor c each expert takes
             at most ceil(c k T / E) of the T tokens of each sequence and drops
             the rest, lowest score first, ties by token order

Every routing decision and statistic is a function of one sequence, or of the
whole previous step: the same sequences give the same losses however the step is
cut into micro-batches, ranks, experts or tensor-parallel shards (a sequence split
by context parallelism is gathered for its balancing and capacity).

Statistics of the step (token counts per expert, the aux loss, tokens dropped)
are buffers of this rank's tokens, counted in forward (recomputation in backward
does not count again); `end_step` sums them over the ranks after the
optimizer step (one collective for all blocks) and moves the expert bias and f.
The aux loss's gradient is scaled by `aux_grad_scale`, which the layout sets
once (set_aux_grad_scale): the factor the layout's gradient reduction divides
by, over the micro-batches of a step (each micro-batch's aux loss weighs
1/micro-batches, as in Megatron).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron.distributed.counts import counts as expert_counts
from meshtron.models.common.experts import Experts
from meshtron.models.common.moe_balance import StepSum, gather_seq, sequence_balance
from meshtron.models.common.moe_config import MoEConfig, moe_param_count  # noqa: F401 - imported from here too


class _AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged and feeds d(aux) = scale into aux's graph when out's
    gradient arrives: the auxiliary loss trains the router without entering the
    logged loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def _recomputing() -> bool:
    """Whether this forward runs inside backward: activation recomputation. (A compiled
    block recomputes inside its own backward graph, not by running this again.)"""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))

    def forward(self, x: torch.Tensor, seq_parts: StepSum | None = None, seqs: int = 1):
        """x (N, dim), the tokens of `seqs` sequences -> weights (N, k) fp32, experts
        (N, k), scores (N, E) fp32, and the router's own top-k (N, k): the experts
        unless `seq_parts` is given (training, batch_balance > 0): each sequence's
        choice is then evened over its tokens, of which the ranks of seq_parts hold
        the others (context parallel)."""
        with torch.autocast(x.device.type, enabled=False):   # fp32 under autocast too
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        k = self.cfg.top_k
        if self.cfg.balanced:   # token t's copies to experts kt, kt+1, ... (mod E): every expert equally loaded
            experts = torch.arange(x.shape[0] * k, device=x.device).view(-1, k) % self.cfg.n_experts
            own = experts
        else:
            # on the logits, not the scores: a softmax's scores shrink with E and saturate as the
            # router sharpens, so a bias on them moves fewer tokens the longer a run trains
            select = logits.detach() + self.expert_bias
            experts = own = select.topk(k, dim=-1).indices
        weights = own_weights = scores.gather(-1, own)
        if seq_parts is not None and self.cfg.batch_balance > 0 and not self.cfg.balanced:
            experts, fade = sequence_balance(select.view(seqs, -1, select.shape[-1]), k, self.cfg.batch_balance,
                                             seq_parts)
            weights = scores.gather(-1, experts) * fade
        if self.cfg.route_norm or self.cfg.score == "sigmoid":
            # over the router's own top-k, not the balanced one: a sum over the chosen experts
            # would jump where balancing swaps one of them
            weights = weights / own_weights.sum(-1, keepdim=True)
        return weights, experts, scores, own


def capacity_keep(weights: torch.Tensor, experts: torch.Tensor, n_experts: int, capacity: float,
                  n_tokens: int) -> torch.Tensor:
    """(N, k) bool: which assignments an expert keeps under a capacity of
    ceil(capacity k N / E) tokens, the highest weights first, ties by token order."""
    cap = math.ceil(capacity * experts.shape[1] * n_tokens / n_experts)
    flat_e, flat_w = experts.flatten(), weights.detach().flatten()
    # per expert, its assignments by weight (descending), ties by position: two stable sorts
    by_weight = (-flat_w).argsort(stable=True)
    sorted_idx = by_weight[flat_e[by_weight].argsort(stable=True)]
    e_sorted = flat_e[sorted_idx]
    first = torch.searchsorted(e_sorted, e_sorted, side="left")
    rank_in_expert = torch.arange(e_sorted.numel(), device=e_sorted.device) - first
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[sorted_idx] = rank_in_expert < cap
    return keep.view_as(experts)


class LocalDispatch(nn.Module):
    """Every expert on this rank: sort the token copies by expert, run the experts,
    put each result back at its token, weighted (fp32)."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, mlp: Experts) -> torch.Tensor:
        n_experts = mlp.w1.shape[0]
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        y = mlp(x[order // experts.shape[1]], expert_counts(flat, n_experts))
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, order // experts.shape[1], y.float() * weights.flatten()[order, None])
        return out.to(x.dtype)


class Routed(NamedTuple):
    """MoE.route's choice for N tokens."""
    x: torch.Tensor                 # (N, dim) the tokens
    weights: torch.Tensor           # (N, k) fp32, each chosen expert's (0 where capacity dropped it)
    experts: torch.Tensor           # (N, k) the chosen experts
    scores: torch.Tensor            # (N, E) fp32, the router's scores of every expert
    own: torch.Tensor               # (N, k) the router's own top-k (before batch balancing)
    keep: torch.Tensor | None       # (N, k) bool, what the capacity kept (None: dropless)


class MoE(nn.Module):
    """The MoE feed-forward block: (B, T, dim) -> (B, T, dim). Its forward is route,
    dispatch, finish: a layout may run the dispatch in stages between them
    (meshtron.distributed.two_batch)."""

    aux_grad_scale = 1.0

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(dim, cfg)
        self.experts = Experts(dim, cfg)
        self.dispatch = LocalDispatch()
        self.step_sum = StepSum()     # the ranks holding other tokens of the step (end_step sums over them)
        self.seq_parts = StepSum()    # the ranks holding other tokens of the same sequences (context parallel)
        self.shared = None
        if cfg.n_shared:
            self.shared = Experts(dim, MoEConfig(hidden=cfg.n_shared * cfg.hidden, activation=cfg.activation), 1)
        # the step's statistics, summed over micro-batches and every rank's tokens: copies each
        # expert ran and those the router's own choice (before batch balancing) sent it
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts), persistent=False)
        self.register_buffer("own_per_expert", torch.zeros(cfg.n_experts), persistent=False)
        # the last finished step's [tokens_per_expert, own_per_expert], kept by end_step for readers
        self.register_buffer("last_step", torch.zeros(2, cfg.n_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("calls", torch.zeros(()), persistent=False)
        # f of the aux loss: the share of the router's own copies each expert took over the last
        # step, every rank's (end_step); even before the first. Persistent: a resume continues it
        self.register_buffer("load_fraction", torch.full((cfg.n_experts,), 1.0 / cfg.n_experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.is_meta:   # a pipeline schedule's shape inference (torch 2.11): nothing to route
            return torch.empty_like(h)
        r = self.route(h)
        out = self.dispatch(r.x, r.weights, r.experts, self.experts)
        return self.finish(h, r, out, self.shared_out(r.x))

    def route(self, h: torch.Tensor) -> Routed:
        """The router's choice for the tokens of h (B, T, dim), capacity applied."""
        B, T, dim = h.shape
        x = h.reshape(-1, dim)
        weights, experts, scores, own = self.router(x, self.seq_parts if self.training else None, B)
        capacity = self.cfg.capacity if self.training else 0.0   # evaluation and generation keep every token
        keep = None
        if capacity > 0:   # decided over each whole sequence: the same drops under any layout
            keep = self._capacity_keep(weights.detach().view(B, T, -1), experts.view(B, T, -1), capacity)
            weights = weights * keep
        return Routed(x, weights, experts, scores, own, keep)

    def shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output for the tokens x (N, dim), if the block has them."""
        return None if self.shared is None else self.shared(x, x.new_full((1,), x.shape[0], dtype=torch.long))

    def finish(self, h: torch.Tensor, r: Routed, out: torch.Tensor, shared: torch.Tensor | None,
               share: float = 1.0) -> torch.Tensor:
        """The block's output from the routed experts' `out` and the `shared` experts' (N, dim);
        while training, the step's statistics and the aux loss. `share`: the part of the
        micro-batch that h holds (meshtron.distributed.two_batch runs each half with 1/2): the
        aux loss is normalised by the whole micro-batch's tokens, and a call counts its share."""
        if shared is not None:
            out = out + shared
        if not self.training:
            return out.view(h.shape)
        E = self.cfg.n_experts
        # counted in forward, not again where recomputation runs it in backward: torch's
        # checkpoint stops recomputing once backward has what it needs, which may be before
        # this point, or (two_batch.py) after one half's and before the other's
        count = not _recomputing()
        if count:
            with torch.no_grad():
                self.calls += share
                run = expert_counts(r.experts, E).float()
                self.tokens_per_expert += run
                self.own_per_expert += run if r.own is r.experts else expert_counts(r.own, E).float()
                if r.keep is not None:
                    self.dropped += (~r.keep).sum()
        if self.cfg.aux_loss > 0:
            # Switch: E * sum_i f_i P_i, P_i the mean score over the micro-batch's tokens of
            # every rank (each holds as many: this rank's part of the sum, the gradient its own)
            n_tokens = r.x.shape[0] / share * self.step_sum.size
            f = self.load_fraction.clone()    # saved for backward: end_step may move the buffer first
            aux = self.cfg.aux_loss * E * (r.scores.sum(0) * f).sum() / n_tokens
            if count:
                self.aux_loss_sum += aux.detach()
            out = _AuxLoss.apply(out, aux, self.aux_grad_scale)
        return out.view(h.shape)

    def _capacity_keep(self, weights: torch.Tensor, experts: torch.Tensor, capacity: float) -> torch.Tensor:
        """(B, T_local, k) -> (B * T_local, k) bool: capacity_keep over each whole sequence."""
        all_w, start = gather_seq(self.seq_parts, weights)
        all_e, _ = gather_seq(self.seq_parts, experts)
        keep = torch.stack([capacity_keep(w, e, self.cfg.n_experts, capacity, w.shape[0])
                            for w, e in zip(all_w, all_e)])
        return keep[:, start:start + weights.shape[1]].reshape(-1, weights.shape[-1])


class RoutingStats(NamedTuple):
    """A step's routing over every MoE block, as device scalars (reading one waits for the GPU)."""
    aux_loss: torch.Tensor      # summed over blocks, mean over micro-batches
    dropped: torch.Tensor       # expert copies dropped by capacity, per micro-batch
    routed: torch.Tensor        # expert copies routed, per micro-batch
    load: torch.Tensor          # max over blocks of the busiest expert's copies over the mean, as run
    router_load: torch.Tensor   # the same of the router's own choice (before batch balancing)


SUMMED = 3   # RoutingStats' first fields add over pipeline stages; the others take the maximum


def moe_blocks(parts) -> list[MoE]:
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(blocks: list[MoE], n_dp: int, microbatches: int) -> None:
    """Part of the layout, set with it: each micro-batch's aux loss weighs 1/microbatches
    of the step, and the gradient reduction divides by the n_dp data-parallel ranks."""
    for m in blocks:
        m.aux_grad_scale = n_dp / microbatches


@torch.no_grad()
def end_step(blocks: list[MoE]) -> RoutingStats:
    """After the optimizer step: sum the step's statistics over the ranks holding its
    other tokens (one collective for every block); move each expert's bias towards
    equal loads of the router's own choice, by bias_update x (1 - load / mean load);
    keep each expert's share of those copies as the next step's f (load_fraction) and
    the loads in `last_step`; reset the statistics.
    DeepSeek-V3 steps by bias_update x sign(mean - load): a fixed step that
    overshoots near balance, where the router's logits differ by little (early in
    training), and catches up slowly with a collapsed start; the proportional step
    does neither.
    Returns the step's RoutingStats (the same on every rank of it)."""
    out = torch.zeros(5, device=blocks[0].calls.device if blocks else None)
    if not blocks:
        return RoutingStats(*out)
    summed = blocks[0].step_sum(torch.stack([torch.cat([m.tokens_per_expert, m.own_per_expert,
                                                        torch.stack([m.aux_loss_sum, m.dropped])])
                                             for m in blocks]))
    for m, row in zip(blocks, summed):
        E = m.cfg.n_experts
        load, own, (aux, dropped) = row[:E], row[E:2 * E], row[2 * E:]
        if m.cfg.bias_update > 0 and not m.cfg.balanced:
            step = m.cfg.bias_update * (1 - own / own.mean().clamp_min(1e-9))
            m.router.expert_bias += step - step.mean()   # centred: only differences select
        m.load_fraction.copy_(torch.where(own.sum() > 0, own / own.sum().clamp_min(1e-9), m.load_fraction))
        out[:SUMMED] += torch.stack([aux, dropped, load.sum()]) / m.calls.clamp_min(1)
        worst = torch.stack([x.max() / x.mean().clamp_min(1e-9) for x in (load, own)])
        out[SUMMED:] = torch.maximum(out[SUMMED:], worst)
        m.last_step.copy_(torch.stack([load, own]))
        for b in (m.tokens_per_expert, m.own_per_expert, m.aux_loss_sum, m.dropped, m.calls):
            b.zero_()
    return RoutingStats(*out)


def step_loads(blocks: list[MoE]) -> torch.Tensor:
    """(layers, 2, E): each block's copies per expert in the last finished step, as
    run and as the router itself chose (before batch balancing)."""
    return torch.stack([m.last_step for m in blocks])


def init_moe(moe: MoE, seed: int, prefix: str, std: float, out_std: float, normal, fill) -> None:
    """Name-seeded init of an MoE block: the first projections N(0, std), the router
    and the output projections N(0, out_std), biases 0; the expert bias and the
    step's statistics zeroed (buffers that building on meta leaves empty).
    The router's small init (torchtitan 0.2.2 draws it at the residual outputs'
    scaled std too): at init the router inputs of all tokens share much of their
    direction, so the common logits send most tokens to the same experts; smaller
    logits leave the expert bias less to even out."""
    for name, p in moe.named_parameters():
        if name.endswith((".b1", ".b2")):
            full = torch.zeros(p.shape)
        else:
            scaled = name.endswith(".w2") or name.startswith("router.")
            full = normal(p.shape, out_std if scaled else std, seed, f"{prefix}.{name}")
        fill(p, full)
    for b in moe.buffers():
        b.zero_()
    moe.load_fraction.fill_(1.0 / moe.cfg.n_experts)   # f: even before the first step
