"""--tp-overlap-comm chunked (meshtron.distributed.chunked_tensor_parallel): SP's gathers and
reduce-scatters cut into one piece per tp rank under the matmuls. The operators against the
whole collective and the plain linears (FP8 too, against torchao's Float8Linear on the whole
tensors), the Llama against one process (FP8's in test_float8.py), a compiled block against
eager, and the order in which the pieces move and the matmuls run, forward and backward."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron import ParallelConfig, models
from meshtron.distributed.chunked_tensor_parallel import ChunkedColumn, ChunkedRow, _GatherMatmuls, _MatmulScatter
from meshtron.distributed.local_tensor_parallel import gather_seq, scatter_seq
from meshtron.distributed.tensor_parallel import parallelize_module
from meshtron.models.llama import LlamaConfig
from meshtron.models.llama.parallelize import tp_plan

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, perturbed_builder, run_parity, tiny_batches

SPEC, CFG = models.get("llama-tiny")
CHUNKED = dict(sp=True, tp_overlap=True, tp_overlap_comm="chunked")


def _float8(w: torch.Tensor):
    """A Float8Linear (tensorwise, emulated) holding w."""
    from meshtron.distributed import float8
    lin = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
    float8.convert(lin, "tensorwise", "cpu")
    with torch.no_grad():
        lin[0].weight.copy_(w)
    return lin[0]


def _operators_against_whole(rank, world, fp8):
    """_GatherMatmuls and _MatmulScatter on this rank's shards against the whole computation on
    one process (torchao's Float8Linear on the whole tensors under FP8, whose scales are the
    whole tensors' too): the worst relative error of each output and gradient."""
    torch.manual_seed(0)    # the same tensors on every rank, each rank taking its own shards
    group = mesh(tp=world)["tp"].get_group().group_name
    B, T, K, N = 2, 4 * world, 16 * world, 32 * world
    x_all, ws = torch.randn(B, T, K), [torch.randn(N, K) for _ in range(2)]
    gys, w_row, gz = [torch.randn(B, T, N) for _ in ws], torch.randn(K, N), torch.randn(B, T, K)
    linears = [_float8(w) if fp8 else None for w in ws]
    row = _float8(w_row) if fp8 else None

    def whole(x, w, m):
        return m(x) if m is not None else F.linear(x, w)
    mine = lambda t, dim: t.chunk(world, dim=dim)[rank].clone().requires_grad_()   # noqa: E731
    errors = []
    # gather + column-parallel, and its backward (matmul + reduce-scatter)
    x, wl = mine(x_all, 1), [mine(w, 0) for w in ws]
    ys = _GatherMatmuls.apply(x, group, rank, world, linears, *wl, None, None)
    torch.autograd.backward(ys, [g.chunk(world, dim=-1)[rank] for g in gys])
    xr = x_all.clone().requires_grad_()
    wr = [m.weight if m is not None else w.clone().requires_grad_() for w, m in zip(ws, linears)]
    yr = [whole(xr, w, m) for w, m in zip(wr, linears)]
    torch.autograd.backward(yr, gys)
    pairs = [(y, r.chunk(world, dim=-1)[rank]) for y, r in zip(ys, yr)] + [(x.grad, xr.grad.chunk(world, 1)[rank])]
    pairs += [(w.grad, r.grad.chunk(world, 0)[rank]) for w, r in zip(wl, wr)]
    # row-parallel + reduce-scatter, and its backward (all-gather + matmul)
    h_all = torch.randn(B, T, N)
    h, wo = mine(h_all, -1), mine(w_row, 1)
    z = _MatmulScatter.apply(h, wo, group, rank, world, row)
    z.backward(gz.chunk(world, dim=1)[rank])
    hr, wor = h_all.clone().requires_grad_(), row.weight if row is not None else w_row.clone().requires_grad_()
    zr = whole(hr, wor, row)
    zr.backward(gz)
    pairs += [(z, zr.chunk(world, 1)[rank]), (h.grad, hr.grad.chunk(world, -1)[rank]),
              (wo.grad, wor.grad.chunk(world, 1)[rank])]
    errors += [((a - b).norm() / b.norm()).item() for a, b in pairs]
    # and the plain path against SP's own collectives around F.linear
    if not fp8:
        xp = mine(x_all, 1)
        xg = gather_seq(xp, group)
        torch.autograd.backward([F.linear(xg, w.detach()) for w in wl], [g.chunk(world, dim=-1)[rank] for g in gys])
        errors.append(((xp.grad - x.grad).norm() / xp.grad.norm()).item())
        hp = mine(h_all, -1)
        scatter_seq(F.linear(hp, wo.detach()), group).backward(gz.chunk(world, dim=1)[rank])
        errors.append(((hp.grad - h.grad).norm() / hp.grad.norm()).item())
    return errors


@pytest.mark.parametrize("world,fp8", [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "tp2-fp8"])
def test_chunked_operators_equal_the_whole_gather_and_matmuls(pools, world, fp8):
    if fp8:
        pytest.importorskip("torchao.float8")
    for errors in pools.run(world, _operators_against_whole, fp8):
        assert len(errors) == (8 if fp8 else 10) and max(errors) < 1e-6, " ".join(f"{e:.2g}" for e in errors)


class _Order(TorchDispatchMode):
    """The matmuls ("mm") and the pieces' transfers ("start", "wait") in the order they run."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(("aten.mm", "aten.addmm")):
            self.seen.append("mm")
        elif name.startswith("_c10d_functional.all_to_all_single"):
            self.seen.append("start")
        elif name.startswith("_c10d_functional.wait_tensor"):
            self.seen.append("wait")
        return func(*args, **(kwargs or {}))


def _orders(rank, world):
    """The forward and backward order of ChunkedColumn over two linears and of ChunkedRow."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3, self.w2 = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def in_proj(self, x):
            return self.w1(x), self.w3(x)
    block = Block()
    parallelize_module(block, mesh(tp=world), {"": ChunkedColumn(("w1", "w3")), "w2": ChunkedRow()})
    x = torch.randn(2, 4, 8, requires_grad=True)
    out = {}
    with _Order() as fwd:
        a, b = block.in_proj(x)
    with _Order() as bwd:
        torch.autograd.backward([a, b], [torch.randn_like(a), torch.randn_like(b)])
    out["column"] = fwd.seen, bwd.seen
    h = torch.randn(2, 4 * world, 8, requires_grad=True)
    with _Order() as fwd:
        z = block.w2(h)
    with _Order() as bwd:
        z.backward(torch.randn_like(z))
    out["row"] = fwd.seen, bwd.seen
    return out


def test_each_piece_moves_while_a_matmul_runs_forward_and_backward(pools):
    # gather + matmul (column forward, row backward): the next piece's transfer starts before the
    # current piece's matmuls and is waited after them. matmul + scatter (row forward, column
    # backward): a piece starts moving once computed and is waited after the next piece's matmul
    # (and, in the column backward, the weights' gradients)
    for orders in pools.run(2, _orders):
        assert orders["column"] == (["start", "mm", "mm", "wait", "mm", "mm"],
                                    ["mm", "mm", "start", "mm", "mm", "mm", "mm", "wait"]), orders["column"]
        assert orders["row"] == (["mm", "start", "mm", "wait"],
                                 ["start", "mm", "wait", "mm", "mm"]), orders["row"]


def _chunked_parity(rank, world, degrees):
    m = mesh(**degrees)
    pcfg = ParallelConfig(loss_parallel=True, zero=3, **CHUNKED)
    used = []

    def parallelize(model, me):
        layout(pcfg, SPEC)(model, me)
        used.extend(b.feed_forward.w2.forward.__func__.__qualname__ for b in model.layers.values())
        return model
    report = run_parity(m, perturbed_builder(lambda: SPEC.model_cls(CFG, seed=0)), parallelize,
                        tiny_batches(CFG.vocab_size, steps=3, batch=8, seq=16), micro_batches=2,
                        max_norm=0.5, fb_kwargs=fb_kwargs(m, pcfg))
    return report, used


@pytest.mark.parametrize("world,degrees", [(2, dict(tp=2)), (4, dict(dp=2, tp=2))], ids=["tp2-sp", "dp2xtp2-sp-zero3"])
@pytest.mark.fast_cases("tp2-sp")
def test_chunked_blocks_match_one_process(pools, world, degrees):
    # loss, gathered gradients, gradient norm and updated weights over 3 AdamW steps, within 1e-5
    results = pools.run(world, _chunked_parity, degrees)
    assert all(used and all("ChunkedRow" in q for q in used) for _, used in results), results[0][1]
    assert_parity([r for r, _ in results], tol=1e-5)


def _chunked_block_compiled(rank, world, backend):
    """A tp2 + SP Llama block under the chunked styles, eager and compiled: the worst
    difference of its output and gradients."""
    model = SPEC.model_cls(CFG, seed=0)
    parallelize_module(model, mesh(tp=world), tp_plan(model, True, True, local=True, overlap=True,
                                                      overlap_comm="chunked"))
    block, runs = model.layers["0"], []
    torch.manual_seed(rank)
    h, gy = torch.randn(2, 8, CFG.dim), torch.randn(2, 8, CFG.dim)
    for fn in (block, torch.compile(block, backend=backend)):
        x = h.clone().requires_grad_()
        out = fn(x)
        out.backward(gy)
        runs.append([out.detach(), x.grad, *(p.grad.to_local().clone() for p in block.parameters())])
        block.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(*runs))


@pytest.mark.slow
def test_chunked_block_compiles(pools):
    """Compiled, the block runs its chunked calls eagerly between its graphs and gives the eager
    numbers. aot_eager (dynamo and AOT autograd, no code generation): the chunked calls stay out
    of the graphs, and inductor compiles what is left of the block in the other compiled tests."""
    for error in pools.run(2, _chunked_block_compiled, "aot_eager", timeout=300):
        assert error < 1e-5, error


def _fp8_styles(rank, world):
    """Under --fp8 tensorwise the chunked styles take the dense blocks' Float8Linear layers (the
    FP8 parity is test_float8.py's "tp2 sp chunked"): what each block's linears compute with."""
    cfg = LlamaConfig(n_layers=1, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=320)
    model = SPEC.model_cls(cfg, seed=0)
    SPEC.parallelize(model, mesh(tp=world), ParallelConfig(fp8="tensorwise", **CHUNKED))
    block = model.layers["0"]
    return ([type(block.attention.wq).__name__, type(block.feed_forward.w2).__name__],
            [block.attention.in_proj.__func__.__qualname__, block.feed_forward.w2.forward.__func__.__qualname__])


def test_fp8_blocks_take_the_chunked_styles(pools):
    pytest.importorskip("torchao.float8")
    for types_, forwards in pools.run(2, _fp8_styles):
        assert types_ == ["Float8Linear", "Float8Linear"], types_
        assert [f.split(".")[0] for f in forwards] == ["ChunkedColumn", "ChunkedRow"], forwards
