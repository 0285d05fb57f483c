"""MoE routing balance (issue 25 point 5): the auxiliary loss's gradient reaches the
router as the Switch loss's, the expert-bias step is proportional to each
expert's distance from the mean load (centred), the bias evens a router that sends nearly every token
to the same experts, the top-k weights sum to 1, the benchmark-only balanced
routing is exact, and llama-moe-tiny trained at its preset's defaults does not
collapse."""
import torch

from meshtron.models.common.moe import MoE, MoEConfig, end_step, moe_blocks


def _block(dim=8, **kw):
    torch.manual_seed(1)
    m = MoE(dim, MoEConfig(n_experts=4, top_k=2, hidden=4, **kw))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_aux_loss_gradient_is_the_switch_loss_gradient():
    # the router's gradient with the aux loss minus without it = d/dW of
    # a E sum_i f_i P_i (f: routed fraction, P: mean score), written out here
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    grads = {}
    for a in (0.0, 0.5):
        m = _block(aux_loss=a, bias_update=0.0)
        m(x).sum().backward()
        grads[a] = m.router.gate.weight.grad
    w = m.router.gate.weight.detach().clone().requires_grad_()
    scores = (x.reshape(-1, 8) @ w.T).softmax(-1)
    f = torch.bincount(scores.topk(2, -1).indices.flatten(), minlength=4).float() / (32 * 2)
    (0.5 * 4 * (f * scores.mean(0)).sum()).backward()
    # fp32 rounding of two backward passes: measured 1e-6 against gradients of 1e-2
    torch.testing.assert_close(grads[0.5] - grads[0.0], w.grad, rtol=0, atol=1e-5)
    assert w.grad.abs().max() > 1e-3          # the aux term is not scaled to nothing


def test_expert_bias_step_is_proportional_and_centred():
    m = _block(bias_update=0.01)
    m.tokens_per_expert.copy_(torch.tensor([30.0, 2.0, 0.0, 0.0]))   # mean 8: one over, three under
    m.calls.fill_(1)
    end_step([m])
    # 0.01 x (1 - load / mean) = 0.01 x [-2.75, 0.75, 1, 1]: sums to zero, so centring changes nothing
    torch.testing.assert_close(m.router.expert_bias, torch.tensor([-0.0275, 0.0075, 0.01, 0.01]))
    assert float(m.tokens_per_expert.sum()) == 0      # the statistics are reset


def test_expert_bias_selects_on_the_logits():
    # a bias that outweighs the logits' spread decides the top-k; the weights stay the scores'
    m = _block()
    x = torch.randn(64, 8)
    m.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1e3, 1e3]))
    w, e, s = m.router(x)
    assert set(e.flatten().tolist()) == {2, 3}
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
        w, e, s = _block(score=score).router(x)
        torch.testing.assert_close(w.sum(-1), torch.ones(64))
    w, e, s = _block(route_norm=False).router(x)       # Switch / GShard: the raw softmax scores
    torch.testing.assert_close(w, s.gather(-1, e))


def test_balanced_routing_is_round_robin_and_leaves_the_bias():
    m = _block(balanced=True, bias_update=0.01)
    m(torch.randn(3, 10, 8))
    assert m.tokens_per_expert.tolist() == [15.0] * 4   # 30 tokens x top-2 over 4 experts
    stats = end_step([m])
    assert float(stats[3]) == 1.0 and float(m.router.expert_bias.abs().sum()) == 0


def _train_counts(rank, world, argv):
    """Every step's routed copies per expert of every MoE layer of the recipe's
    Trainer, (steps, layers, experts), read before the step's end resets them."""
    import meshtron.train.trainer as trainer_module
    from meshtron import Config, Trainer, models
    trainer = Trainer(Config.from_args(argv, models=models.PRESETS), verbose=False)
    blocks, counts, end = moe_blocks(trainer.parts), [], trainer_module.moe_end_step

    def read_then_end(parts, mesh):
        counts.append(torch.stack([m.tokens_per_expert for m in blocks]).tolist())
        return end(parts, mesh)
    trainer_module.moe_end_step = read_then_end
    try:
        for _ in range(trainer.config.training.steps):
            trainer.step(*trainer.loader.next())
    finally:
        trainer_module.moe_end_step = end
    return counts


def test_llama_moe_tiny_ends_balanced(pools):
    # the recipe's Trainer at the preset's defaults, 200 steps (issue 25's target: at
    # most 1.5 in every layer at the end). One step's load is noisy at 512 tokens
    # from 4 samples: measured over seeds 0-3, the last 10 steps' mean 1.28-1.49 per
    # layer, single steps up to 1.71, the same 10 steps pooled 1.04-1.35; the old
    # defaults (a sign step of 1e-3 on the scores, aux 1e-2) 1.50-1.68; a collapsed
    # layer reads E / k = 4.0. The bounds sit above the seeds' spread.
    counts = torch.tensor(pools.run(1, _train_counts, ["--model", "llama-moe-tiny", "--steps", "200"])[0])
    assert counts.shape == (200, 4, 8)
    loads = counts.max(-1).values / counts.mean(-1)
    pooled = counts[-10:].sum(0)
    assert (loads[-10:].mean(0) < 1.6).all(), loads[-10:].mean(0)
    assert (pooled.max(-1).values / pooled.mean(-1) < 1.5).all(), pooled


def test_moe_blocks_finds_every_block():
    from meshtron.models.llama import Llama
    from meshtron.models.llama.model import PRESETS
    assert len(moe_blocks([Llama(PRESETS["llama-moe-tiny"])])) == 4
