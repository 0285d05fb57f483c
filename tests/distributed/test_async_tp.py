"""Async TP (--async-tp): the ring decompositions equal the plain collectives and
matmuls, and a model trained with them equals one process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from meshtron import ParallelConfig
from meshtron.config import Config, ConfigError
from meshtron.distributed.async_tp import all_gather_matmul, matmul_reduce_scatter
from meshtron.models import GPT, gpt_config
from meshtron.models.llama import SPEC as LLAMA_SPEC
from meshtron.models.llama import Llama, LlamaConfig

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, run_parity, tiny_batches

LLAMA_CFG = LlamaConfig(n_layers=2, dim=96, n_heads=12, n_kv_heads=4, ffn_dim=128, vocab_size=320, max_seq_len=64)


def _ops(rank, world):
    """float64: forward and every gradient against the unsplit math, to 1e-12."""
    group = mesh(tp=world)["tp"].get_group()
    g = torch.Generator().manual_seed(0)
    B, T, d, outs, d_in = 2, 6 * world, 8, (12, 4), 10 * world        # odd chunk sizes on purpose
    x = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    ws = [torch.randn(o * world, d, generator=g, dtype=torch.float64) for o in outs]
    g_ys = [torch.randn(B, T, o * world, generator=g, dtype=torch.float64) for o in outs]
    g_x_full = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    h = torch.randn(B, T, d_in, generator=g, dtype=torch.float64)
    w2 = torch.randn(d, d_in, generator=g, dtype=torch.float64)
    g_out = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    c, err = T // world, {}

    def mine(t, dim):       # this rank's slice of a full tensor
        n = t.shape[dim] // world
        return t.narrow(dim, rank * n, n).clone().requires_grad_()

    def compare(name, got, want):
        err[name] = max(err.get(name, 0.0), float((got - want).norm() / want.norm()))

    # all-gather-matmul: x sharded on the sequence, each W split by rows (column-parallel)
    ref = [t.clone().requires_grad_() for t in [x] + ws]
    ref_ys = [F.linear(ref[0], w) for w in ref[1:]]
    (sum((y * gy).sum() for y, gy in zip(ref_ys, g_ys)) + (ref[0] * g_x_full).sum()).backward()
    x_shard, w_shards = mine(x, 1), [mine(w, 0) for w in ws]
    x_full, *ys = all_gather_matmul(x_shard, w_shards, group)
    # each replica of the gathered x adds its share of g_x_full
    (sum((y * mine(gy, 2).detach()).sum() for y, gy in zip(ys, g_ys)) + (x_full * g_x_full / world).sum()).backward()
    compare("gathered x", x_full, x)
    for y, ry, w, rw in zip(ys, ref_ys, w_shards, ref[1:]):
        compare("y", y, mine(ry.detach(), 2))
        compare("dW (colwise)", w.grad, mine(rw.grad, 0))
    compare("dx (colwise)", x_shard.grad, mine(ref[0].grad, 1))

    # matmul-reduce-scatter: h and W split by columns (row-parallel), output sharded on the sequence
    rh, rw2 = h.clone().requires_grad_(), w2.clone().requires_grad_()
    ry2 = F.linear(rh, rw2)
    (ry2 * g_out).sum().backward()
    h_shard, w2_shard = mine(h, 2), mine(w2, 1)
    y2 = matmul_reduce_scatter(h_shard, w2_shard, group)
    (y2 * g_out.narrow(1, rank * c, c)).sum().backward()
    compare("y (rowwise)", y2, ry2.detach().narrow(1, rank * c, c))
    compare("dW (rowwise)", w2_shard.grad, mine(rw2.grad, 1))
    compare("dx (rowwise)", h_shard.grad, mine(rh.grad, 2))
    return err


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_decompositions_equal_the_plain_ops_in_float64(pools, world):
    for err in pools.run(world, _ops):
        assert max(err.values()) < 1e-12, err


def _model_parity(rank, world, model, dp, tp, recompute):
    m = mesh(dp=dp, tp=tp)
    pcfg = ParallelConfig(sp=True, async_tp=True, recompute=recompute)
    if model == "gpt":
        cfg = gpt_config("tiny", n_layers=2, n_heads=4, dim=64)
        build, spec = (lambda: GPT(cfg, seed=0)), None
    else:
        cfg, build, spec = LLAMA_CFG, (lambda: Llama(LLAMA_CFG, seed=0)), LLAMA_SPEC
    return run_parity(m, build, layout(pcfg, spec), tiny_batches(cfg.vocab_size, steps=3, batch=4, seq=12),
                      fb_kwargs=fb_kwargs(m, pcfg))


@pytest.mark.parametrize("model,dp,tp,recompute", [("gpt", 1, 2, "none"), ("llama", 1, 2, "none"),
                                                   ("gpt", 1, 4, "full"), ("llama", 1, 4, "selective"),
                                                   ("gpt", 2, 2, "none"), ("llama", 2, 2, "full")])
def test_async_tp_training_matches_one_process(pools, model, dp, tp, recompute):
    worst = assert_parity(pools.run(dp * tp, _model_parity, model, dp, tp, recompute), tol=1e-5)
    assert len(worst.losses) == 3


def _collectives(rank, world, async_tp):
    """What one forward and backward of the GPT sends, by kind."""
    m = mesh(tp=world)
    cfg = gpt_config("tiny", n_layers=2, n_heads=4, dim=64)
    model = GPT(cfg, seed=0)
    layout(ParallelConfig(sp=True, async_tp=async_tp, loss_parallel=False))(model, m)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    sent = []
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: sent.extend(op.tensor.numel() for op in ops) or real(ops)
    try:
        with CommDebugMode() as comm:
            model(x).float().sum().backward()
    finally:
        dist.batch_isend_irecv = real
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    return counts, sum(sent)


def test_async_tp_replaces_each_layers_gathers_and_scatters_by_ring_steps(pools):
    (plain, _), (ring, p2p) = pools.run(2, _collectives, False)[0], pools.run(2, _collectives, True)[0]
    layers, sp_per_layer = 2, 4       # all-gathers per layer, forward and backward; reduce-scatters alike
    assert plain["all_gather_into_tensor"] - ring.get("all_gather_into_tensor", 0) == layers * sp_per_layer
    assert plain["reduce_scatter_tensor"] - ring.get("reduce_scatter_tensor", 0) == layers * sp_per_layer
    # at tp=2 each replaced collective is one ring step: a send and a receive of a (B, T/2, d) chunk
    steps = layers * 2 * sp_per_layer
    assert p2p == steps * 2 * (2 * 4 * 64)


def test_async_tp_needs_sp_and_compiled_needs_cuda(pools):
    with pytest.raises(ConfigError, match="needs --sp"):
        Config.from_args(["--tp", "2", "--async-tp"]).validate(world_size=2)
    pools.run(2, _compiled_on_cpu)


def _compiled_on_cpu(rank, world):
    cfg = gpt_config("tiny", n_layers=1, n_heads=4, dim=64)
    with pytest.raises(ValueError, match="need CUDA"):
        layout(ParallelConfig(sp=True, async_tp=True, compile=True))(GPT(cfg, seed=0), mesh(tp=world))



def test_compiled_async_tp_is_an_option_of_its_blocks_compiles_only():
    """Set in inductor's process-wide config, the pass would reach every later
    compile in the process (a plain layout built after an async one included)."""
    from torch._inductor import config as inductor_config

    from meshtron.distributed.async_tp import compile_options
    from meshtron.distributed.parallelize import apply_compile
    on = ParallelConfig(sp=True, async_tp=True, compile=True)
    assert compile_options(on) == {"_micro_pipeline_tp": True}
    assert compile_options(ParallelConfig(sp=True, compile=True)) is None
    assert compile_options(ParallelConfig(sp=True, async_tp=True)) is None   # eager: the ring
    block = torch.nn.Linear(4, 4)
    apply_compile([block], compile_options(on))
    block(torch.randn(2, 4)).sum().backward()    # forward and backward compiled under the option
    assert not inductor_config._micro_pipeline_tp
