import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from meshtron.models import GPT, gpt_config
from meshtron.models.gpt import PRESETS

from harness import mesh


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("tied", [False, True])
def test_forward_shapes_and_backward(pos_emb, tied):
    cfg = gpt_config("tiny", pos_emb=pos_emb, tie_embeddings=tied)
    model = GPT(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, cfg.vocab_size)
    F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_causal_and_position_dependent():
    model = GPT(gpt_config("tiny", pos_emb="rope"), seed=0).eval()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8] = (y[0, 8] + 1) % 256
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :8], b[:, :8])        # the future does not leak back
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_init_is_deterministic_and_name_keyed():
    a, b = GPT(gpt_config("tiny"), seed=3), GPT(gpt_config("tiny"), seed=3)
    c = GPT(gpt_config("tiny"), seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 2:
            assert not torch.equal(p, r), n
    # a pipeline stage that drops layers keeps the values of the ones it holds
    stage = GPT(gpt_config("tiny"), seed=None)
    del stage.layers["0"]
    stage.init_weights(3)
    assert torch.equal(stage.layers["2"].mlp.fc1.weight, a.layers["2"].mlp.fc1.weight)
    # meta-device construction then init gives the same model
    with torch.device("meta"):
        m = GPT(gpt_config("tiny"), seed=3)
    m.to_empty(device="cpu")
    m.init_weights(3)
    for p, q in zip(m.parameters(), a.parameters()):
        assert torch.equal(p, q)


def test_presets_have_the_advertised_sizes():
    expected = {"125M": 0.125e9, "350M": 0.35e9, "1.3B": 1.3e9, "2.7B": 2.7e9, "6.7B": 6.7e9}
    for name, n in expected.items():
        got = PRESETS[name].num_params()
        assert 0.8 * n < got < 1.25 * n, (name, got)
    with pytest.raises(ValueError, match="unknown GPT preset"):
        gpt_config("13B")


def _sharded_init(rank, world):
    m = mesh(dp=world)
    model = GPT(gpt_config("tiny"), seed=None)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            placement = [Shard(0)] if p.shape[0] % world == 0 else [Shard(0)]  # uneven shards too
            setattr(mod, name, torch.nn.Parameter(distribute_tensor(torch.empty_like(p), m["dp"], placement)))
    model.init_weights(7)
    ref = GPT(gpt_config("tiny"), seed=7)
    return max(float((p.full_tensor() - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


def test_init_does_not_depend_on_the_layout(pools):
    assert pools.run(4, _sharded_init) == [0.0] * 4


def _compiled_model_kernels(rank, world):
    from meshtron import Config, Trainer
    from meshtron.models.gpt.model import LayerNorm, LinearGeLU
    config = Config()
    config.parallel.compile = True
    trainer = Trainer(config, verbose=False)
    return trainer.model_config.fused_kernels, {type(m).__name__: m.fused for m in trainer.parts[0].modules()
                                                if isinstance(m, (LayerNorm, LinearGeLU))}


def test_compiled_blocks_leave_layernorm_and_gelu_to_inductor(pools):
    # inductor fuses them itself; the Triton custom ops are opaque to it (set in the model config, not per module)
    fused, modules = pools.run(1, _compiled_model_kernels)[0]
    assert fused is False and modules == {"LayerNorm": False, "LinearGeLU": False}


LAYOUT_ERRORS = [  # (model config, degrees, sp, seq_len, message): the GPT spec's own checks
    (gpt_config("tiny", n_heads=2, dim=64), dict(tp=4), False, 32,
     "tp=4 does not divide the number of attention heads 2"),
    (gpt_config("tiny", vocab_size=322), dict(tp=4), False, 32,
     "tp=4 does not divide the vocabulary size 322 (pad it)"),
    (gpt_config("tiny", n_layers=2), dict(pp=4), False, 32, "pp=4 is greater than the number of layers 2"),
    (gpt_config("tiny"), dict(cp=4), False, 36, "sequence length 36 to be divisible by 2*cp=8"),
    (gpt_config("tiny"), dict(ep=4), False, 32, "ep=4 needs a mixture-of-experts model"),
    (gpt_config("tiny"), dict(tp=2), True, 33, "--seq-len 33 must be divisible by 2"),
    (gpt_config("tiny"), dict(), False, 300, "--seq-len 300 exceeds the model's max_seq_len 256"),
]


@pytest.mark.parametrize("cfg,degrees,sp,seq,msg", LAYOUT_ERRORS, ids=[e[-1][:30] for e in LAYOUT_ERRORS])
def test_layout_checks_belong_to_the_model(cfg, degrees, sp, seq, msg):
    from meshtron import ParallelConfig
    from meshtron.models.gpt import SPEC
    full = dict(dp=1, pp=1, cp=1, tp=1, ep=1) | degrees
    with pytest.raises(ValueError, match=msg.replace("*", "\\*").replace("(", "\\(").replace(")", "\\)")):
        SPEC.check_layout(cfg, full, ParallelConfig(sp=sp, tp=full["tp"]), seq)
