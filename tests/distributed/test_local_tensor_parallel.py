"""The Llama's blocks under tensor parallelism on local tensors
(meshtron.distributed.local_tensor_parallel): the same numbers as one process
under every TP layout, the same collectives as the DTensor styles, and a
fraction of their host calls (what made small micro-batches, and so pipelines
combined with TP, host-bound on the GPU); --tp-overlap's backward order."""

import os
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import meshtron
from meshtron import ParallelConfig, models
from meshtron.distributed.collectives import CollectiveCounter
from meshtron.distributed.local_tensor_parallel import (
    GatherLinears,
    LocalColwise,
    _GatherLinears,
    ce_copies,
    gather_seq,
)
from meshtron.distributed.tensor_parallel import parallelize_module
from meshtron.models.llama.parallelize import tp_plan
from meshtron.train.loss import loss_function
from meshtron.train.step import forward_backward

from harness import mesh, train
from parity import assert_parity, fb_kwargs, layout, perturbed_builder, pipelined, run_parity, tiny_batches

SPEC, CFG = models.get("llama-tiny")


def _local_parity(rank, world, degrees, sp, pp, overlap=False):
    m = mesh(**degrees)
    pcfg = ParallelConfig(sp=sp, loss_parallel=True, zero=3, tp_overlap=overlap)
    apply = pipelined(pcfg, SPEC, CFG) if pp else layout(pcfg, SPEC)
    used = []

    def parallelize(model, me):
        out = apply(model, me)
        parts = out.parts if pp else [out]
        used.append(all(isinstance(b.attention.wq.forward.__self__, torch.nn.Linear)
                        and "LocalColwise" in b.attention.wq.forward.__func__.__qualname__
                        for p in parts for b in p.layers.values()))
        return out
    report = run_parity(m, perturbed_builder(lambda: SPEC.model_cls(CFG, seed=0)), parallelize,
                        tiny_batches(CFG.vocab_size, steps=3, batch=8, seq=16), micro_batches=1 if pp else 2,
                        max_norm=0.5, fb_kwargs=fb_kwargs(m, pcfg))
    return report, used


@pytest.mark.parametrize("world,degrees,sp,pp", [
    (2, dict(tp=2), False, False), (2, dict(tp=2), True, False), (4, dict(tp=4), True, False),
    (4, dict(dp=2, tp=2), True, False), (4, dict(pp=2, tp=2), True, True), (4, dict(pp=2, tp=2), False, True)],
    ids=["tp2", "tp2-sp", "tp4-sp", "dp2xtp2-sp-zero3", "pp2xtp2-sp", "pp2xtp2"])
@pytest.mark.fast_cases("tp2", "tp2-sp", "pp2xtp2-sp")
def test_local_blocks_match_one_process(pools, world, degrees, sp, pp):
    results = pools.run(world, _local_parity, degrees, sp, pp)
    assert all(used == [True] for _, used in results), "the dense Llama did not take the local-tensor blocks"
    assert_parity([r for r, _ in results], tol=1e-5)


@pytest.mark.parametrize("world,degrees,sp,pp", [
    (2, dict(tp=2), False, False), (2, dict(tp=2), True, False), (4, dict(dp=2, tp=2), True, False),
    (4, dict(pp=2, tp=2), True, True)], ids=["tp2", "tp2-sp", "dp2xtp2-sp-zero3", "pp2xtp2-sp"])
@pytest.mark.fast_cases("tp2", "tp2-sp")
def test_overlapped_blocks_match_one_process(pools, world, degrees, sp, pp):
    results = pools.run(world, _local_parity, degrees, sp, pp, True)
    assert_parity([r for r, _ in results], tol=1e-5)


def _gather_linears_against_plain(rank, world, sp, bias):
    """_GatherLinears' outputs and gradients, and those of gather_seq + F.linear, on the same inputs."""
    torch.manual_seed(0)    # the same tensors on every rank, each rank taking its own shards
    tp_group = mesh(tp=world)["tp"].get_group()
    group = tp_group.group_name
    x_all, gys = torch.randn(2, 4 * world, 8), [torch.randn(2, 4 * world, 6 * world) for _ in range(3)]
    ws, bs = [torch.randn(6 * world, 8) for _ in range(3)], [torch.randn(6 * world) for _ in range(3)]
    x = x_all.chunk(world, dim=1)[rank] if sp else x_all
    mine = lambda ts: [t.chunk(world, dim=0)[rank].clone().requires_grad_() for t in ts]   # noqa: E731
    gys = [g.chunk(world, dim=-1)[rank] for g in gys]
    results = []
    for fused in (False, True):
        xi, wi, bi = x.clone().requires_grad_(), mine(ws), mine(bs) if bias else [None] * 3
        if fused:
            ys = _GatherLinears.apply(xi, group, sp, False, *wi, *bi)
        else:
            xg = gather_seq(xi, group) if sp else xi
            ys = [torch.nn.functional.linear(xg, w, b) for w, b in zip(wi, bi)]
        torch.autograd.backward(ys, gys)
        results.append([*ys, xi.grad, *(w.grad for w in wi), *(b.grad for b in bi if b is not None)])
    if not sp:   # without SP the plain linears' input gradient is partial: copy_to_tp sums it
        results[0][3] = torch.distributed.all_reduce(results[0][3], group=tp_group) or results[0][3]
    return [(a - b).abs().max().item() / (b.abs().max().item() + 1e-30) for a, b in zip(*results)]


@pytest.mark.parametrize("sp,bias", [(True, False), (True, True), (False, True)], ids=["sp", "sp-bias", "nosp-bias"])
def test_gather_linears_equal_the_gather_and_the_linears(pools, sp, bias):
    for errors in pools.run(2, _gather_linears_against_plain, sp, bias):
        assert len(errors) == (10 if bias else 7) and max(errors) < 1e-6, errors


class _BackwardOrder(TorchDispatchMode):
    """The order of a backward's matmuls ("dx": the input's gradient, "dW": a weight's, told
    apart by shape) and of its collective's start and wait."""

    def __init__(self, weight_shapes):
        super().__init__()
        self.weight_shapes, self.seen = weight_shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith(("aten.mm", "aten.addmm")):
            self.seen.append("dW" if out.shape in self.weight_shapes else "dx")
        elif name.startswith(("_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_reduce")):
            self.seen.append("start")
        elif name.startswith("_c10d_functional.wait_tensor"):
            self.seen.append("wait")
        return out


def _overlap_order(rank, world, sp):
    """The backward of GatherLinears over three column-parallel linears (--tp-overlap)."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (torch.nn.Linear(8, 6 * world) for _ in range(3))

        def in_proj(self, x):
            return self.wq(x), self.wk(x), self.wv(x)
    names = ("wq", "wk", "wv")
    model = torch.nn.ModuleDict({"attn": Attn()})
    parallelize_module(model, mesh(tp=world), {**{f"attn.{n}": LocalColwise() for n in names},
                                               "attn": GatherLinears(sp, names)})
    attn = model["attn"]
    x = torch.randn(2, 4 if sp else 4 * world, 8, requires_grad=True)
    ys = attn.in_proj(x)
    with _BackwardOrder({p.to_local().shape for p in attn.parameters() if p.dim() == 2}) as order:
        torch.autograd.backward(ys, [torch.randn_like(y) for y in ys])
    return order.seen


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "nosp"])
def test_overlap_computes_the_weight_gradients_while_the_collective_runs(pools, sp):
    # Megatron's order: the input's gradient, its reduce-scatter (all-reduce without SP)
    # started, the weights' gradients beside it, the wait last
    for seen in pools.run(2, _overlap_order, sp):
        assert seen == ["dx"] * 3 + ["start"] + ["dW"] * 3 + ["wait"], seen


class _DTensorCalls(TorchDispatchMode):
    """Ops dispatched with a DTensor among their arguments (each one a trip through
    DTensor's sharding propagation on the host)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += any(issubclass(t, DTensor) for t in types)
        return func(*args, **(kwargs or {}))


def _step_cost(rank, world, sp, local, overlap=False):
    """One forward and backward of the TP-only Llama: its DTensor calls and its collectives."""
    m = mesh(tp=world)
    model = SPEC.model_cls(CFG, seed=0)
    parallelize_module(model, m, tp_plan(model, sp, True, local=local, overlap=overlap))
    (x, y), = tiny_batches(CFG.vocab_size, steps=1, batch=4, seq=16)
    loss_fn = loss_function(torch.device("cpu"), True)
    forward_backward([model], x, y, m, loss_fn=loss_fn)    # warm DTensor's caches
    with CollectiveCounter(m) as comm, _DTensorCalls() as calls:
        forward_backward([model], x, y, m, loss_fn=loss_fn)
    return calls.n, dict(comm.calls), dict(comm.bytes)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.fast_cases("sp")
def test_local_blocks_move_the_same_bytes_with_a_fraction_of_the_host_calls(pools, sp):
    (stock, stock_calls, stock_bytes), _ = pools.run(2, _step_cost, sp, False)
    (local, local_calls, local_bytes), _ = pools.run(2, _step_cost, sp, True)
    assert local_calls == stock_calls and local_bytes == stock_bytes, (local_calls, stock_calls)
    (_, overlap_calls, overlap_bytes), _ = pools.run(2, _step_cost, sp, True, True)
    assert overlap_calls == stock_calls and overlap_bytes == stock_bytes, (overlap_calls, stock_calls)
    # what is left are the embedding, the final norm, the head and the loss, which keep DTensor styles
    per_block_stock, per_block_local = stock / CFG.n_layers, local / CFG.n_layers
    assert local < stock / 3, (local, stock)
    print(f"\nDTensor calls per step, {CFG.n_layers} blocks: {stock} (DTensor styles) -> {local} (local); "
          f"per block at most {per_block_stock:.0f} -> {per_block_local:.0f}", end="")


def test_local_colwise_refuses_other_modules():
    with pytest.raises(ValueError, match="nn.Linear only"):
        LocalColwise()._apply(torch.nn.Embedding(4, 4), None)
    with pytest.raises(ValueError, match="in_proj"):
        GatherLinears(True, ("0",))._apply(torch.nn.Sequential(torch.nn.Linear(4, 4)), None)


def _warnings_from_meshtron(rank, world, argv):
    """The deprecation warnings a recipe run raises from meshtron's own files (a torch API
    that meshtron calls and torch means to remove), as 'file:line: message'."""
    root = os.path.dirname(meshtron.__file__)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(rank, world, argv)
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if issubclass(w.category, (DeprecationWarning, FutureWarning)) and w.filename.startswith(root)]


def test_a_tp2_sp_run_calls_no_deprecated_torch_api(pools):
    argv = ["--model", "llama-tiny", "--tp", "2", "--sp", "--seq-len", "32", "--global-batch", "4",
            "--steps", "2", "--log-interval", "1"]
    assert pools.run(2, _warnings_from_meshtron, argv) == [[], []]


def _overlapped_block_compiled(rank, world):
    """A tp2 + SP Llama block with --tp-overlap, eager and compiled (inductor): its output and
    gradients, and whether the compiled backward calls the column-parallel backward as one op."""
    from torch._inductor.utils import run_and_get_code
    model = SPEC.model_cls(CFG, seed=0)
    parallelize_module(model, mesh(tp=world), tp_plan(model, True, True, local=True, overlap=True))
    block, runs = model.layers["0"], []
    torch.manual_seed(rank)
    h, gy = torch.randn(2, 8, CFG.dim), torch.randn(2, 8, CFG.dim)
    for fn in (block, torch.compile(block)):
        x = h.clone().requires_grad_()

        def step(fn=fn, x=x):
            out = fn(x)
            out.backward(gy)
            return out
        out, code = run_and_get_code(step) if fn is not block else (step(), [])
        grads = [p.grad.to_local().clone() for p in block.parameters()]
        block.zero_grad()
        runs.append(([out.detach(), x.grad, *grads], "meshtron.column_backward" in "".join(code)))
    (eager, _), (compiled, opaque) = runs
    return max((a - b).abs().max().item() for a, b in zip(eager, compiled)), opaque


@pytest.mark.slow
def test_overlapped_block_compiles(pools):
    """Compiled (inductor, on the CPU here), the overlapped backward stays one op, whose
    order inductor's scheduler cannot change, and gives the eager numbers."""
    for error, opaque in pools.run(2, _overlapped_block_compiled, timeout=300):
        assert error < 1e-5 and opaque, (error, opaque)


def test_tp_overlap_with_sp_and_cp_is_refused_in_one_line():
    from meshtron.config import Config, ConfigError
    from meshtron.models import PRESETS
    with pytest.raises(ConfigError, match="--tp-overlap with --sp and --cp is not supported"):
        Config.from_args(["--model", "llama-tiny", "--tp", "2", "--sp", "--cp", "2", "--tp-overlap"],
                         models=PRESETS).validate(world_size=4)


@pytest.mark.slow
def test_a_compiled_tp2_sp_run_matches_the_eager_one(pools):
    """--compile with the local blocks: the embedding's reduce-scatter crosses into the first
    compiled block; it must arrive waited (VocabParallel), since torch 2.13's compiled
    backward returns no gradient for a pending collective's output."""
    argv = ["--model", "llama-tiny", "--tp", "2", "--sp", "--seq-len", "32", "--global-batch", "4",
            "--steps", "3", "--log-interval", "1"]
    eager, _ = pools.run(2, train, argv)
    compiled, _ = pools.run(2, train, argv + ["--compile"], timeout=300)
    assert compiled == pytest.approx(eager, rel=1e-4), (compiled, eager)


def test_copy_engine_overlap_is_refused_off_cuda_and_without_sp():
    """--tp-overlap-comm copy-engine: CUDA only (a CPU mesh is refused when the plan is applied,
    with the flag to leave out), and only with --tp-overlap and --sp (refused by the config)."""
    import types

    from meshtron.config import Config, ConfigError
    from meshtron.models import PRESETS

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = torch.nn.Linear(4, 4)

        def in_proj(self, x):
            return (self.wq(x),)
    cpu_mesh = types.SimpleNamespace(device_type="cpu", get_group=lambda: types.SimpleNamespace(group_name="0"))
    with pytest.raises(ValueError, match="copy-engine .* needs CUDA, not cpu; leave it at nccl"):
        GatherLinears(True, ("wq",), "copy-engine")._apply(Attn(), cpu_mesh)
    with pytest.raises(ValueError, match="needs --sp"):
        GatherLinears(False, ("wq",), "copy-engine")
    with pytest.raises(ValueError, match="comm is nccl or copy-engine"):
        GatherLinears(True, ("wq",), "nvshmem")
    for argv, match in ((["--tp-overlap-comm", "copy-engine"], "needs --tp-overlap and --sp"),
                        (["--tp-overlap", "--tp-overlap-comm", "copy-engine", "--compile", "--cuda-graphs"],
                         "with --cuda-graphs is not supported")):
        with pytest.raises(ConfigError, match=match):
            Config.from_args(["--model", "llama-tiny", "--tp", "2", "--sp", *argv],
                             models=PRESETS).validate(world_size=2)


def _simulated_ce_reduce_scatter(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """ce_reduce_scatter on every rank of len(xs), its copies and sums as ce_copies places
    them, each symmetric-memory workspace a flat tensor of x's size (NaN where nothing landed)."""
    tp = len(xs)
    blocks = [x.chunk(tp, dim=1) for x in xs]
    shape, n = blocks[0][0].shape, blocks[0][0].numel()
    workspaces = [torch.full((xs[0].numel(),), float("nan")) for _ in range(tp)]
    for rank in range(tp):
        for peer, there, _ in ce_copies(rank, tp, n):
            dst = workspaces[peer][there:there + n].view(shape)
            for b in range(shape[0]):
                dst[b].copy_(blocks[rank][peer][b])
    outs = []
    for rank in range(tp):
        arrived = [workspaces[rank][here:here + n].view(shape) for _, _, here in ce_copies(rank, tp, n)]
        out = blocks[rank][rank] + arrived[0]
        for block in arrived[1:]:
            out += block
        outs.append(out)
    return outs


@pytest.mark.parametrize("tp", [2, 4])
def test_copy_engine_copies_sum_to_a_reduce_scatter_over_the_sequence(tp):
    # the copy engines need CUDA (benchmarks/check_ce_reduce_scatter.py runs the real one against
    # NCCL); their arithmetic is checked here: which block of x goes to which peer, where it
    # lands and what is added. Integer values: every order of the sum is exact
    g = torch.Generator().manual_seed(tp)
    xs = [torch.randint(-1000, 1000, (3, 4 * tp, 5), generator=g).float() for _ in range(tp)]
    reduce_scatter = torch.stack(xs).sum(0).chunk(tp, dim=1)    # rank r: the sum of every x[:, r-th T/tp]
    got = _simulated_ce_reduce_scatter(xs)
    assert all(torch.equal(a, b) for a, b in zip(got, reduce_scatter, strict=True))
