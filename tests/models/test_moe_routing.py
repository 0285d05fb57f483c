"""MoE routing balance (issue 25 point 5): the auxiliary loss's gradient reaches the
router as the Switch loss's, the expert-bias step is proportional to each
expert's distance from the mean load (centred), the bias evens a router that sends nearly every token
to the same experts, the top-k weights sum to 1, the benchmark-only balanced
routing is exact, batch balancing evens each sequence in training only while
the router still learns from its own choice, and llama-moe-tiny trained at its
preset's defaults ends balanced."""
import pytest
import torch

from meshtron.models.common.moe import MoE, MoEConfig, Router, end_step, moe_blocks, step_loads
from meshtron.models.common.moe_balance import StepSum, batch_bias


def _block(dim=8, **kw):
    torch.manual_seed(1)
    m = MoE(dim, MoEConfig(n_experts=4, top_k=2, hidden=4, **kw))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_aux_loss_gradient_is_the_switch_loss_gradient_with_the_last_steps_f():
    # the router's gradient with the aux loss minus without it = d/dW of a E sum_i f_i P_i
    # (P: mean score over this batch; f: the routed fraction over the whole previous step),
    # written out here; before any step f is even, and softmax scores leave that no gradient
    g = torch.Generator().manual_seed(0)
    first, x = torch.randn(2, 16, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    grads, first_grads = {}, {}
    for a in (0.0, 0.5):
        m = _block(aux_loss=a, bias_update=0.0)
        m(first).sum().backward()
        first_grads[a] = m.router.gate.weight.grad.clone()
        end_step([m])
        m.zero_grad()
        m(x).sum().backward()
        grads[a] = m.router.gate.weight.grad
    torch.testing.assert_close(first_grads[0.5], first_grads[0.0], rtol=0, atol=1e-6)
    w = m.router.gate.weight.detach().clone().requires_grad_()
    f = torch.bincount((first.reshape(-1, 8) @ w.T).topk(2, -1).indices.flatten(), minlength=4).float() / (32 * 2)
    scores = (x.reshape(-1, 8) @ w.T).softmax(-1)
    (0.5 * 4 * (f * scores.mean(0)).sum()).backward()
    # fp32 rounding of two backward passes: measured 1e-6 against gradients of 1e-2
    torch.testing.assert_close(grads[0.5] - grads[0.0], w.grad, rtol=0, atol=1e-5)
    assert w.grad.abs().max() > 1e-3          # the aux term is not scaled to nothing


def test_expert_bias_step_is_proportional_and_centred():
    m = _block(bias_update=0.01)
    m.own_per_expert.copy_(torch.tensor([30.0, 2.0, 0.0, 0.0]))   # the router's own: mean 8, one over, three under
    m.tokens_per_expert.copy_(torch.tensor([8.0, 8.0, 8.0, 8.0]))  # as run (batch balancing): not what the bias reads
    m.calls.fill_(1)
    end_step([m])
    # 0.01 x (1 - load / mean) = 0.01 x [-2.75, 0.75, 1, 1]: sums to zero, so centring changes nothing
    torch.testing.assert_close(m.router.expert_bias, torch.tensor([-0.0275, 0.0075, 0.01, 0.01]))
    assert float(m.tokens_per_expert.sum() + m.own_per_expert.sum()) == 0      # the statistics are reset


def test_expert_bias_selects_on_the_logits():
    # a bias that outweighs the logits' spread decides the top-k; the weights stay the scores'
    m = _block()
    x = torch.randn(64, 8)
    m.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1e3, 1e3]))
    w, e, s, own = m.router(x)
    assert set(e.flatten().tolist()) == {2, 3} and torch.equal(own, e)
    torch.testing.assert_close(w, s.gather(-1, e) / s.gather(-1, e).sum(-1, keepdim=True))


def test_expert_bias_evens_a_collapsed_router():
    # inputs sharing most of their direction (a model's router inputs at init): the
    # router sends almost every token to the same two experts; with its weights
    # frozen, the bias alone must even the load
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    dim, n_experts = 32, 8
    m = MoE(dim, MoEConfig(n_experts=n_experts, top_k=2, hidden=4, aux_loss=0.0))   # the default rate
    torch.nn.init.normal_(m.router.gate.weight, std=0.02)
    common = torch.randn(dim, generator=g)
    loads = []
    for _ in range(60):
        x = common + 0.5 * torch.randn(1, 512, dim, generator=g)
        with torch.no_grad():
            m(x)
        loads.append(float(m.tokens_per_expert.max() / m.tokens_per_expert.mean()))
        end_step([m])
    # measured: 3.4 at the start (4 = every token to 2 of 8; without the bias it stays
    # there), 1.11-1.24 over the last 10 steps
    assert loads[0] > 2.5, loads[0]
    assert max(loads[-10:]) < 1.4, loads[-10:]


def test_top_k_weights_sum_to_one():
    x = torch.randn(64, 8)
    for score in ("softmax", "sigmoid"):
        w, e, s, _ = _block(score=score).router(x)
        torch.testing.assert_close(w.sum(-1), torch.ones(64))
    w, e, s, _ = _block(route_norm=False).router(x)       # Switch / GShard: the raw softmax scores
    torch.testing.assert_close(w, s.gather(-1, e))


def test_balanced_routing_is_round_robin_and_leaves_the_bias():
    m = _block(balanced=True, bias_update=0.01)
    m(torch.randn(3, 10, 8))
    assert m.tokens_per_expert.tolist() == [15.0] * 4   # 30 tokens x top-2 over 4 experts
    stats = end_step([m])
    assert float(stats[3]) == 1.0 and float(m.router.expert_bias.abs().sum()) == 0


def _collapsed_inputs(n=2048, dim=32, seed=0):
    # inputs sharing most of their direction, as a model's router inputs at init
    g = torch.Generator().manual_seed(seed)
    return torch.randn(dim, generator=g) + 0.5 * torch.randn(n, dim, generator=g)


def _load(experts, n_experts):
    c = torch.bincount(experts.flatten(), minlength=n_experts).float()
    return float(c.max() / c.mean())


def test_batch_bias_evens_one_batch():
    # one call, no history: a router sending every copy to the same 2 of 16 experts
    torch.manual_seed(0)
    gate = torch.randn(16, 32) * 0.3
    select = _collapsed_inputs() @ gate.T
    loads = {r: _load((select + batch_bias(select, 2, r)).topk(2, -1).indices, 16) for r in (0, 1, 2, 4, 8)}
    # measured: 8.0 (collapsed) with no round; 1.55, 1.13, 1.02, 1.01 after 1, 2, 4, 8
    assert loads[0] == 8.0 and loads[1] < 1.7 and loads[2] < 1.2 and loads[4] < 1.05 and loads[8] < 1.05, loads


def test_batch_bias_leaves_a_masked_expert_off():
    select = torch.randn(256, 8)
    select[:, 3] = float("-inf")
    experts = (select + batch_bias(select, 2, 4)).topk(2, -1).indices
    assert 3 not in experts.flatten().tolist()
    counts = torch.bincount(experts.flatten(), minlength=8).float()
    assert float(counts.max() / (512 / 7)) < 1.15, counts      # the other seven share the copies


def _dense(router, x, seqs):
    """The router's training choice as (N, E) weights, 0 off the chosen experts."""
    with torch.no_grad():
        w, e, s, _ = router(x, StepSum(), seqs)
    return torch.zeros_like(s).scatter(-1, e, w), e


def test_sequence_balance_evens_each_sequence_alone_and_continuously():
    torch.manual_seed(0)
    router = Router(32, MoEConfig(n_experts=16, top_k=2, score="sigmoid", batch_balance=8))
    torch.nn.init.normal_(router.gate.weight, std=0.03)
    x = torch.cat([_collapsed_inputs(256, seed=s) for s in range(4)])          # 4 sequences of 256 tokens
    dense, experts = _dense(router, x, 4)
    # each sequence's choice is its own: the same alone as in any batch
    assert all(torch.equal(_dense(router, x[256 * i:256 * (i + 1)], 1)[0], dense[256 * i:256 * (i + 1)])
               for i in range(4))
    assert max(_load(experts[256 * i:256 * (i + 1)], 16) for i in range(4)) < 1.1
    # moving one expert's logits by 2e-4 either way (each expert in turn) flips some tokens'
    # choice, and moves no weight by more than 1e-2 (without the fade, by its whole score):
    # the weights are continuous in the logits, so rounding moves the losses no further
    flips, worst = 0, 0.0
    for e in range(16):
        for shift in (2e-4, -2e-4):
            router.expert_bias.zero_()
            router.expert_bias[e] = shift
            moved, chosen = _dense(router, x, 4)
            flips += int((chosen.sort(-1).values != experts.sort(-1).values).any(-1).sum())
            worst = max(worst, float((moved - dense).abs().max()))
    assert flips > 0 and worst < 2e-2, (flips, worst)


def test_batch_balance_routes_in_training_only_and_trains_on_the_routers_own_choice():
    torch.manual_seed(0)
    cfg = dict(n_experts=8, top_k=2, hidden=4, aux_loss=0.1, bias_update=0.01)
    on, off = (MoE(32, MoEConfig(**cfg, batch_balance=b)) for b in (4, 0))
    for p in on.parameters():
        torch.nn.init.normal_(p, std=0.3)
    off.load_state_dict(on.state_dict())
    x = _collapsed_inputs(512)[None]
    grads = []
    for m in (on, off):
        m(x).sum().backward()
        grads.append(m.router.gate.weight.grad)
    # the balanced block ran even loads; both saw the same own choice, so the same aux loss
    assert float(on.tokens_per_expert.max() / on.tokens_per_expert.mean()) < 1.15
    assert float(off.tokens_per_expert.max() / off.tokens_per_expert.mean()) > 2.0
    torch.testing.assert_close(on.own_per_expert, off.tokens_per_expert)
    torch.testing.assert_close(on.aux_loss_sum, off.aux_loss_sum)
    assert not torch.allclose(grads[0], grads[1])     # different experts weigh the outputs
    # the expert bias moves by the router's own loads: alike in both
    stats = [end_step([m]) for m in (on, off)]
    torch.testing.assert_close(on.router.expert_bias, off.router.expert_bias)
    assert float(stats[0][3]) < 1.15 and float(stats[0][4]) == pytest.approx(float(stats[1][3]))
    torch.testing.assert_close(step_loads([on])[0, 1], step_loads([off])[0, 0])
    # evaluation and generation take the router's own choice
    on.eval(), off.eval()
    with torch.no_grad():
        torch.testing.assert_close(on(x), off(x))


def _train_counts(rank, world, argv):
    """Every step's copies per expert of every MoE layer of the recipe's Trainer,
    (steps, layers, [run, router's own], experts)."""
    from meshtron import Config, Trainer, models
    trainer = Trainer(Config.from_args(argv, models=models.PRESETS), verbose=False)
    blocks, counts = moe_blocks(trainer.parts), []
    for _ in range(trainer.config.training.steps):
        trainer.step(*trainer.loader.next())
        counts.append(step_loads(blocks).tolist())
    return counts


def test_llama_moe_tiny_ends_balanced(pools):
    # the recipe's Trainer at the preset's defaults (batch balancing per sequence, 16 rounds),
    # 50 steps; issue 42's target: at most 1.10 in every layer at the end. Measured over seeds
    # 0-3 (docs/parallelism.md): the last step 1.00-1.05 per layer; the router's own choice
    # (the expert bias and the aux loss alone) pooled over the last 10 steps 1.17-1.95; a
    # collapsed layer reads E / k = 4.0
    counts = torch.tensor(pools.run(1, _train_counts, ["--model", "llama-moe-tiny", "--steps", "50"])[0])
    assert counts.shape == (50, 4, 2, 8)
    loads = counts.max(-1).values / counts.mean(-1)          # (steps, layers, 2)
    assert (loads[-1, :, 0] <= 1.10).all(), loads[-1]
    own_pooled = counts[-10:, :, 1].sum(0)
    assert (own_pooled.max(-1).values / own_pooled.mean(-1) < 2.0).all(), own_pooled


def test_moe_blocks_finds_every_block():
    from meshtron.models.llama import Llama
    from meshtron.models.llama.model import PRESETS
    assert len(moe_blocks([Llama(PRESETS["llama-moe-tiny"])])) == 4
