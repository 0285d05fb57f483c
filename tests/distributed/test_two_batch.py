"""Two-batch overlap of MoE layers (--moe-two-batch, issue 60): each layout against
one process over 5 steps in fp32 (both dispatches, recompute, dp x ep at ZeRO-3, a
pipeline), packed documents' positions; the same losses, gradients and routing
statistics as the unsplit step of the same layout; each half's attention and
experts issued while the other half's all-to-alls travel, forward and backward."""
import pytest
import torch
from test_documents import TOL as DOCUMENTS_TOL
from test_documents import _positions_alone
from test_expert_parallel import LLAMA_CFG, LLAMA_MOE, SEQ, TOL, _parity
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron import ParallelConfig
from meshtron.models.common.moe import MoEConfig, end_step, moe_blocks, set_aux_grad_scale
from meshtron.models.llama import SPEC as LLAMA_SPEC
from meshtron.models.llama import Llama
from meshtron.train.optim import build_optimizer
from meshtron.train.step import forward_backward

from harness import mesh
from parity import assert_parity, tiny_batches

TWO = dict(moe_two_batch=True)
LAYOUTS = {   # (world, model, degrees, ParallelConfig fields); the padded dispatch is ep2's default
    "ep2 llama": (2, "llama", dict(dp=1, ep=2), TWO),
    "ep2 llama exact": (2, "llama", dict(dp=1, ep=2), TWO | dict(moe_dispatch="exact")),
    "ep2 gpt": (2, "gpt", dict(dp=1, ep=2), TWO),
    "ep2 llama recompute": (2, "llama", dict(dp=1, ep=2), TWO | dict(recompute="full")),
    "dp2 x ep2 llama zero 3": (4, "llama", dict(dp=2, ep=2), TWO | dict(zero=3)),
    "pp2 x ep2 llama": (4, "llama", dict(dp=1, pp=2, ep=2), TWO),
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.fast_cases("ep2 llama", "ep2 llama exact", "ep2 llama recompute")
def test_two_batch_layouts_match_one_process(pools, name):
    world, model, degrees, extra = LAYOUTS[name]
    assert_parity(pools.run(world, _parity, model, degrees, extra, timeout=300), TOL)


def test_each_half_takes_its_own_rows_per_document_positions(pools):
    # packed documents' positions, (B, T): each half the rows of its sequences
    for loss, grad, moved in pools.run(2, _positions_alone, "llama-moe", dict(dp=1, ep=2), TWO):
        assert loss < DOCUMENTS_TOL and grad < DOCUMENTS_TOL and moved > 1e-3, (loss, grad, moved)


# ---- against the unsplit step of the same layout ----------------------------------------------

# capacity drops copies (batch balancing, which evens each sequence under it, off)
CAPPED = type(LLAMA_CFG)(**{**LLAMA_CFG.__dict__, "moe": MoEConfig(**{
    **LLAMA_MOE.__dict__, "capacity": 1.0, "batch_balance": 0})})


def _step_stats(rank, world, two_batch, recompute, aux_loss, steps=3):
    """Per step of the capped Llama at ep=world in two micro-batches: the loss, this rank's
    gradients, each block's statistics before end_step and the step's RoutingStats."""
    cfg = type(CAPPED)(**{**CAPPED.__dict__, "moe": MoEConfig(**{**CAPPED.moe.__dict__, "aux_loss": aux_loss})})
    me = mesh(dp=1, ep=world)
    model = Llama(cfg, seed=0)
    LLAMA_SPEC.parallelize(model, me, ParallelConfig(ep=world, moe_two_batch=two_batch, recompute=recompute))
    set_aux_grad_scale(moe_blocks([model]), world, 2)
    opt = build_optimizer(model, 1e-3, eps=1e-4)
    out = []
    for x, y in tiny_batches(cfg.vocab_size, steps=steps, batch=4 * world, seq=SEQ):
        loss = forward_backward([model], x.chunk(world)[rank], y.chunk(world)[rank], me, microbatches=2)
        grads = [p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
                 for p in model.parameters()]
        stats = [torch.cat([m.tokens_per_expert, m.own_per_expert, torch.stack([m.dropped, m.calls])]).clone()
                 for m in moe_blocks([model])]
        aux = [m.aux_loss_sum.clone() for m in moe_blocks([model])]
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss, grads, stats, aux, torch.stack(end_step(moe_blocks([model])))))
    return out


@pytest.mark.parametrize("recompute,aux_loss", [("none", 1e-2), ("full", 0.0)])
def test_two_batch_gives_the_unsplit_steps_losses_gradients_and_routing_statistics(pools, recompute, aux_loss):
    # the counts (copies per expert as run and as the router chose, drops, calls) exactly, the
    # loss, gradients, aux loss and the step's RoutingStats to fp32 rounding; under full
    # recompute without the aux loss, torch's checkpoint stops recomputing between one half's
    # statistics and the other's: the statistics are the forward's alone
    unsplit, halves = (pools.run(2, _step_stats, two, recompute, aux_loss) for two in (False, True))
    for a_rank, b_rank in zip(unsplit, halves):
        for (loss, grads, stats, aux, routing), (loss2, grads2, stats2, aux2, routing2) in zip(a_rank, b_rank):
            assert abs(loss2 - loss) <= 1e-6 * abs(loss), (loss, loss2)
            assert all((g2 - g).norm() <= 1e-6 * g.norm().clamp_min(1e-12) for g, g2 in zip(grads, grads2))
            assert all(torch.equal(s, s2) for s, s2 in zip(stats, stats2)), (stats, stats2)
            assert stats[0][-2] > 0 and stats[0][-1] == 2, stats      # capacity dropped copies; 2 micro-batches
            assert torch.allclose(torch.stack(aux2), torch.stack(aux), rtol=1e-6, atol=0), (aux, aux2)
            assert torch.allclose(routing2, routing, rtol=1e-6, atol=0), (routing, routing2)


# ---- what runs while an all-to-all travels ----------------------------------------------------

ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class IssueOrder(TorchDispatchMode):
    """The ops issued, as ("start", i) for the i-th token all-to-all (fp32: not the counts'),
    ("wait", i) where its result is first read, "attention" and "matmul"."""

    def __init__(self):
        super().__init__()
        self.seen, self._started = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, AsyncCollectiveTensor) and id(a.elem) in self._started:
                self.seen.append(("wait", self._started.pop(id(a.elem))))
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_to_all_single.default and args[0].is_floating_point():
            self._started[id(out)] = n = sum(s[0] == "start" for s in self.seen)
            self.seen.append(("start", n))
        elif func in ATTENTION:
            self.seen.append("attention")
        elif func in MATMULS:
            self.seen.append("matmul")
        return out


def _issue_order(rank, world):
    """The ops one step of the one-layer Llama at ep=world issues, forward and backward."""
    cfg = type(LLAMA_CFG)(**{**LLAMA_CFG.__dict__, "n_layers": 1})
    model = Llama(cfg, seed=0)
    LLAMA_SPEC.parallelize(model, mesh(dp=1, ep=world), ParallelConfig(ep=world, moe_two_batch=True))
    x = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    with IssueOrder() as forward:
        loss = model(x).float().pow(2).mean()
    with IssueOrder() as backward:
        loss.backward()
    return forward.seen, backward.seen


def _between(seen, i):
    """What was issued between token all-to-all i's start and its wait."""
    return seen[seen.index(("start", i)) + 1:seen.index(("wait", i))]


def test_each_halfs_all_to_alls_travel_while_the_other_half_computes(pools):
    forward, backward = pools.run(2, _issue_order)[0]
    # forward: A's dispatch, B's dispatch, A's combine, B's combine
    assert [s for s in forward if s[0] == "start"] == [("start", i) for i in range(4)], forward
    assert "attention" in _between(forward, 0), forward          # B's attention behind A's dispatch
    assert "matmul" in _between(forward, 1), forward             # A's experts behind B's dispatch
    assert "matmul" in _between(forward, 2), forward             # B's experts behind A's combine
    assert "matmul" in _between(forward, 3), forward             # the shared experts behind B's combine
    # backward: the combines' gradients (B's, then A's), then the dispatches' (B's, A's), each
    # behind the other half's matmuls (torch's own all-to-all backward waits at once)
    assert [s for s in backward if s[0] == "start"] == [("start", i) for i in range(4)], backward
    assert all("matmul" in _between(backward, i) for i in range(4)), backward
    assert "attention" in _between(backward, 3), backward        # B's attention behind A's dispatch
