"""MoE routing balance (issue 25 point 5): the auxiliary loss's gradient reaches the
router as the Switch loss's, the expert-bias step is DeepSeek-V3's sign step
(centred, as torchtitan's), the bias evens a router that sends nearly every token
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


def test_expert_bias_step_is_a_centred_sign_step():
    m = _block(bias_update=0.01)
    m.tokens_per_expert.copy_(torch.tensor([30.0, 2.0, 0.0, 0.0]))   # mean 8: one over, three under
    m.calls.fill_(1)
    end_step([m])
    # sign(mean - load) = [-1, 1, 1, 1], minus its mean 0.5: underloaded experts rise
    torch.testing.assert_close(m.router.expert_bias, torch.tensor([-0.015, 0.005, 0.005, 0.005]))
    assert float(m.tokens_per_expert.sum()) == 0      # the statistics are reset


def test_expert_bias_evens_a_collapsed_router():
    # inputs sharing most of their direction (a model's router inputs at init): the
    # router sends almost every token to the same two experts; with its weights
    # frozen, the bias alone must even the load
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    dim, n_experts = 32, 8
    m = MoE(dim, MoEConfig(n_experts=n_experts, top_k=2, hidden=4, aux_loss=0.0, bias_update=1e-3))
    torch.nn.init.normal_(m.router.gate.weight, std=0.02)
    common = torch.randn(dim, generator=g)
    loads = []
    for _ in range(60):
        x = common + 0.5 * torch.randn(1, 512, dim, generator=g)
        with torch.no_grad():
            m(x)
        loads.append(float(m.tokens_per_expert.max() / m.tokens_per_expert.mean()))
        end_step([m])
    # measured: 3.1 at the start (4 = every token to 2 of 8; without the bias it stays
    # there), 1.08-1.27 over the last 10 steps
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


def _train_loads(rank, world, argv):
    """Every step's load max/mean of every MoE layer of the recipe's Trainer, read
    before the step's end resets the counts."""
    import meshtron.train.trainer as trainer_module
    from meshtron import Config, Trainer, models
    trainer = Trainer(Config.from_args(argv, models=models.PRESETS), verbose=False)
    blocks, loads, end = moe_blocks(trainer.parts), [], trainer_module.moe_end_step

    def read_then_end(parts, mesh):
        counts = torch.stack([m.tokens_per_expert for m in blocks])
        loads.append((counts.max(1).values / counts.mean(1)).tolist())
        return end(parts, mesh)
    trainer_module.moe_end_step = read_then_end
    try:
        for _ in range(trainer.config.training.steps):
            trainer.step(*trainer.loader.next())
    finally:
        trainer_module.moe_end_step = end
    return loads


def test_llama_moe_tiny_keeps_its_load_bounded(pools):
    # the recipe's Trainer at the preset's defaults (aux loss, expert bias, route
    # normalisation, router init): a collapsed layer reads E / k = 4.0 (measured: the
    # router without aux loss and bias reaches it by step 20 and stays there)
    loads = torch.tensor(pools.run(1, _train_loads, ["--model", "llama-moe-tiny", "--steps", "120"])[0])
    assert loads.shape == (120, 4)
    assert (loads[-20:].mean(0) < 2.5).all(), loads[-20:].mean(0)
    assert (loads[-20:] < 3.5).all(), loads[-20:]


def test_moe_blocks_finds_every_block():
    from meshtron.models.llama import Llama
    from meshtron.models.llama.model import PRESETS
    assert len(moe_blocks([Llama(PRESETS["llama-moe-tiny"])])) == 4
