
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

from meshtron import ParallelConfig, parallelize_module
from meshtron.models import GPT, gpt_config
from meshtron.train.step import forward_backward

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, run_parity, tiny_batches

CFG = gpt_config("tiny", n_layers=2, n_heads=4, dim=64)


def _gpt_parity(rank, world, tp, sp, lp, pos_emb, tied):
    cfg = gpt_config("tiny", n_layers=2, pos_emb=pos_emb, tie_embeddings=tied)
    m = mesh(dp=world // tp, tp=tp)
    pcfg = ParallelConfig(sp=sp, loss_parallel=lp)
    return run_parity(m, lambda: GPT(cfg, seed=0), layout(pcfg), tiny_batches(cfg.vocab_size, steps=3, batch=4, seq=16),
                      fb_kwargs=fb_kwargs(m, pcfg))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("lp", [False, True], ids=["gathered-loss", "loss-parallel"])
@pytest.mark.fast_cases(tp=2)
def test_gpt_tp_parity(pools, tp, sp, lp):
    # learned positions + tied output on some cases, rope + untied on the others
    pos_emb, tied = ("learned", True) if sp == lp else ("rope", False)
    worst = assert_parity(pools.run(tp, _gpt_parity, tp, sp, lp, pos_emb, tied), tol=1e-5)
    assert len(worst.losses) == 3


# ---- a transformer meshtron did not write, through string plans ----------

class UserBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln(x)
        q, k, v = (f(h).view(B, T, -1, 16).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o(a)
        return x + self.down(F.relu(self.up(self.ln2(x))))


class UserModel(nn.Module):
    def __init__(self, vocab=96, d=64, n=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([UserBlock(d, 4) for _ in range(n)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


USER_PLAN = {"emb": "vocab_parallel", "blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
             "blocks.*.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_rep"}


def _user_model_parity(rank, world):
    m = mesh(dp=1, tp=world)
    return run_parity(m, UserModel, lambda mod, me: parallelize_module(mod, me, USER_PLAN),
                      tiny_batches(96, steps=3, batch=4, seq=16))


def test_user_transformer_with_string_plan_parity(pools):
    assert_parity(pools.run(2, _user_model_parity), tol=1e-5)
    assert_parity(pools.run(4, _user_model_parity), tol=1e-5)


def _stock_optimizer_and_clip(rank, world):
    m = mesh(dp=1, tp=world)
    model = parallelize_module(UserModel(), m, USER_PLAN)           # the whole 5-D mesh: its tp axis is used
    assert all(isinstance(p, DTensor) and p.device_mesh == m["tp"] for p in model.parameters())
    assert isinstance(model.blocks[0].ln.weight, DTensor) and model.blocks[0].ln.weight.placements == (Replicate(),)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, foreach=True)  # eps: see parity.py
    ref = UserModel()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4, foreach=True)
    (x, y), = tiny_batches(96, 1, 4, 16)
    for mod in (model, ref):
        F.cross_entropy(mod(x).flatten(0, 1), y.flatten()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, foreach=True)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5, foreach=True)
    opt.step()
    ref_opt.step()
    err = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm), float(ref_norm), err


def test_stock_adamw_foreach_and_clip_grad_norm_work(pools):
    for norm, ref_norm, err in pools.run(2, _stock_optimizer_and_clip):
        assert norm == pytest.approx(ref_norm, rel=1e-5) and norm > 0.5   # clipping was active
        assert err < 1e-5


def _plan_errors(rank, world):
    m = mesh(dp=1, tp=world)
    errors = []
    for plan in ({"blocks.*.nope": "colwise"}, {"blocks.*.q": "diagonal"}, {"blocks.*.ln": "colwise"}):
        try:
            parallelize_module(UserModel(), m, plan)
        except ValueError as e:
            errors.append(str(e))
    try:  # 96 x 3 = 288 output features and a 96-entry vocabulary do not split 5 ways... use a 7-wide model
        parallelize_module(UserModel(vocab=98), m, {"emb": "vocab_parallel"})
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_plans_name_the_module_and_sizes(pools):
    errors = pools.run(4, _plan_errors)[0]
    assert "'blocks.*.nope' matches no module" in errors[0]
    assert "unknown TP style 'diagonal'" in errors[1]
    assert "module 'blocks.0.ln' (LayerNorm): only nn.Linear, nn.Embedding and Hugging Face's Conv1D" in errors[2]
    assert "module 'emb' (Embedding): num_embeddings (vocabulary) 98 is not divisible by tp=4" in errors[3]


# ---- communication per layer -------------------------------------------------

def _comm_counts(rank, world, sp):
    cfg = gpt_config("tiny", n_layers=3)
    m = mesh(dp=1, tp=world)
    model = layout(ParallelConfig(sp=sp, loss_parallel=True))(GPT(cfg, seed=0), m)
    out = {}
    block = model.layers["1"]
    h_local = torch.randn(2, 16 // world if sp else 16, cfg.dim, requires_grad=True)
    with CommDebugMode() as fwd:
        y = block(h_local, torch.arange(16))
    with CommDebugMode() as bwd:
        y.sum().backward()
    c = torch.ops.c10d_functional
    for name, mode in (("fwd", fwd), ("bwd", bwd)):
        counts = mode.get_comm_counts()
        out[name] = {k: counts.get(op, 0) for k, op in (("all_gather", c.all_gather_into_tensor),
                                                         ("reduce_scatter", c.reduce_scatter_tensor),
                                                         ("all_reduce", c.all_reduce))}
    return out


def test_comm_per_layer_matches_megatron(pools):
    sp = pools.run(2, _comm_counts, True)[0]
    # SP: one all-gather before each column-parallel linear, one reduce-scatter after
    # each row-parallel one; the mirror in backward (the LayerNorm weight grads are
    # Partial sums, reduced once per step in one bucket (train.reduce_partial_grads) or by FSDP)
    assert sp["fwd"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 0}, sp
    assert sp["bwd"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 0}, sp
    nosp = pools.run(2, _comm_counts, False)[0]
    assert nosp["fwd"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2}, nosp
    assert nosp["bwd"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2}, nosp


# ---- dropout under TP ---------------------------------------------------------

def _dropout(rank, world, sp):
    cfg = gpt_config("tiny", n_layers=2, dropout=0.2)
    m = mesh(dp=1, tp=world)
    losses = []
    for _ in range(2):
        torch.manual_seed(123)
        pcfg = ParallelConfig(sp=sp, loss_parallel=True)
        model = layout(pcfg)(GPT(cfg, seed=0), m)
        model.train()
        (x, y), = tiny_batches(cfg.vocab_size, 1, 4, 16)
        losses.append(float(forward_backward([model], x, y, m, **fb_kwargs(m, pcfg))))
    # the attention-dropout region draws per-rank numbers; outside it, numbers are shared
    core = model.layers["0"].attn.core
    draws = {}
    core.register_forward_pre_hook(lambda mod, a: draws.update(inside=torch.rand(4)))  # runs after the fork
    torch.manual_seed(5)
    model(x)
    draws["outside"] = torch.rand(4)
    return losses, draws


def test_dropout_rng_regions_under_tp(pools):
    for sp in (False, True):
        r0, r1 = pools.run(2, _dropout, sp)
        assert r0[0][0] == r0[0][1]                     # reproducible for a seed and layout
        assert r0[0] == r1[0]                           # every rank reports the same loss
        assert not torch.equal(r0[1]["inside"], r1[1]["inside"])   # sharded region: differs across tp ranks
        assert torch.equal(r0[1]["outside"], r1[1]["outside"])     # replicated region: agrees


def _sp_with_triton_layer_norm(rank, world):
    # the Triton LayerNorm inside sequence-parallel regions: its incoming gradient
    # is an in-flight AsyncCollectiveTensor from the all-gather's backward
    from meshtron.kernels_triton import layer_norm
    from meshtron.models.gpt.model import LayerNorm
    cfg = gpt_config("tiny", n_layers=2)
    m = mesh(dp=1, tp=world)
    pcfg = ParallelConfig(sp=True)
    ref, tri = (layout(pcfg)(GPT(cfg, seed=0), m) for _ in range(2))
    for mod in tri.modules():
        if isinstance(mod, LayerNorm):
            mod.forward = (lambda ln: lambda x: layer_norm(x, ln.weight, ln.bias, ln.eps, impl="triton"))(mod)
    (x, y), = tiny_batches(cfg.vocab_size, 1, 2, 16)
    losses = [float(forward_backward([mod], x, y, m, **fb_kwargs(m, pcfg))) for mod in (ref, tri)]
    errs = [float((p.grad.full_tensor() - q.grad.full_tensor()).norm() / q.grad.full_tensor().norm())
            for p, q in zip(tri.parameters(), ref.parameters())]
    return losses, max(errs)


def test_sequence_parallel_with_the_triton_layer_norm(pools):
    (l_ref, l_tri), err = pools.run(2, _sp_with_triton_layer_norm)[0]
    assert l_tri == pytest.approx(l_ref, rel=1e-6) and err < 1e-5, (l_ref, l_tri, err)


def _sp_autocast(rank, world):
    cfg = gpt_config("tiny", n_layers=2)
    (x, y), = tiny_batches(cfg.vocab_size, 1, 4, 16)
    m = mesh(dp=1, tp=world)
    pcfg = ParallelConfig(sp=True)
    losses, seen = [], {}
    for tp in (1, world):
        model = GPT(cfg, seed=0)
        if tp > 1:
            model = layout(pcfg)(model, m)
            for name in ("layers.0.attn.qkv", "layers.1.mlp.fc1", "output"):
                # runs after the column-parallel style's own hook: sees what the all-gather moved
                model.get_submodule(name).register_forward_pre_hook(
                    lambda mod, a, name=name: seen.setdefault(name, (a[0].dtype, tuple(a[0].shape))) and None)
        kw = {**(fb_kwargs(m, pcfg) if tp > 1 else {}), "autocast": torch.bfloat16}
        losses.append(float(forward_backward([model], x, y, m if tp > 1 else None, **kw)))
    return losses, seen


def test_sp_all_gathers_move_the_compute_dtype(pools):
    # under autocast LayerNorm returns fp32; SP must gather bf16 (half the bytes), as Megatron does
    losses, seen = pools.run(2, _sp_autocast)[0]
    for name, (dtype, shape) in seen.items():
        assert dtype == torch.bfloat16 and shape[1] == 16, (name, dtype, shape)   # the whole sequence, in bf16
    assert losses[1] == pytest.approx(losses[0], rel=1e-2), losses           # bf16 rounding, reduction order


def _vocab_parallel_ce(rank, world):
    from torch.distributed.tensor import Shard, distribute_tensor

    from meshtron.train.loss import IGNORE_INDEX, cross_entropy_sum
    m = mesh(tp=world)["tp"]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 12 * world, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, 12 * world, (3, 7), generator=g)
    targets[0, :5] = IGNORE_INDEX
    ref = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref.flatten(0, 1), targets.flatten(), reduction="sum",
                                             ignore_index=IGNORE_INDEX)
    want.backward()
    sharded = distribute_tensor(logits.clone(), m, [Shard(2)]).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        got = cross_entropy_sum(sharded, targets)
    got.backward()
    grad = sharded.grad.full_tensor()
    local = logits.numel() // world * 8
    return (float((got - want).abs() / want.abs()), float((grad - ref.grad).norm() / ref.grad.norm()),
            sum(saved) - local, 3 * 21 * 8)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_matches_and_keeps_only_the_logits(pools, world):
    for loss_err, grad_err, saved_beyond_logits, vectors in pools.run(world, _vocab_parallel_ce):
        assert loss_err < 1e-12 and grad_err < 1e-12, (loss_err, grad_err)
        # besides this rank's logits: the targets' local index, two masks and the log-sum-exp, (N,) each
        assert saved_beyond_logits <= vectors, saved_beyond_logits


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_compiled_passes_equal_the_eager_ones():
    # the GPU's path: each fp32 pass over the logits compiled (inductor on the CPU here), on an odd shape
    from meshtron.distributed import loss_parallel as lp
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 53, generator=g) * 4).to(torch.bfloat16)
    row_max = logits.amax(-1).float() + 0.5                  # another rank's larger max
    lse = row_max + torch.rand(37, generator=g)
    local = torch.randint(0, 53, (37,), generator=g)
    hit = torch.rand(37, generator=g) > 0.3                  # targets another rank holds: no onehot here
    scale = (torch.rand(37, generator=g) > 0.2).float() * 0.7
    sum_exp, dlogits = lp._compiled()
    want = (logits.double() - row_max.double()[:, None]).exp().sum(-1)
    assert torch.allclose(sum_exp(logits, row_max).double(), want, rtol=1e-6)
    p = (logits.double() - lse.double()[:, None]).exp()
    p[torch.arange(37), local] -= hit.double()
    ref = p * scale.double()[:, None]
    got, eager = dlogits(logits, lse, local, hit, scale), lp._dlogits(logits, lse, local, hit, scale)
    assert got.dtype == torch.bfloat16 and torch.equal(got, eager)
    assert (got.double() - ref).norm() / ref.norm() < 4e-3          # bf16 rounding of the gradient
