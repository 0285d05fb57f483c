"""Activation recomputation: none / selective / full hold less and less between
forward and backward, recompute what they should, and change no bit of the
loss or the gradients; under FSDP they still match one process."""
from collections import Counter

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshtron import ParallelConfig
from meshtron.distributed.recompute import MODES, apply_recompute
from meshtron.models import GPT, gpt_config
from meshtron.train.loss import cross_entropy_sum

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, run_parity, tiny_batches

CFG = gpt_config("tiny", n_layers=2)
(X, Y), = tiny_batches(CFG.vocab_size, steps=1, batch=8, seq=16)
aten = torch.ops.aten


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops created and that are still alive, by weak
    reference to the storage itself: whoever keeps an activation (autograd, a
    checkpoint's inputs, selective recompute's cache) keeps its storage. CPU
    has no allocator statistics, and this sees exactly the tensors, not the heap.
    Also counts the ops run, so a test can see what backward recomputes."""

    def __init__(self, exclude):
        super().__init__()
        self.exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        self.alive, self.peak, self.ops = {}, 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func] += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.exclude:
                    self.alive[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        self.alive = {k: (r, n) for k, (r, n) in self.alive.items() if not r.expired()}
        return sum(n for _, n in self.alive.values())


def _fwd_bwd(mode: str) -> dict:
    model = GPT(CFG, seed=0)
    apply_recompute(list(model.layers.values()), mode)
    tracker = LiveBytes(list(model.parameters()) + [X, Y])
    with tracker:
        loss = cross_entropy_sum(model(X), Y) / Y.numel()
        held, fwd_ops = tracker.live(), Counter(tracker.ops)
        loss.backward()
    return {"loss": loss.detach(), "held": held, "peak": tracker.peak, "bwd_ops": tracker.ops - fwd_ops,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def test_recompute_memory_falls_and_results_are_identical():
    runs = {mode: _fwd_bwd(mode) for mode in MODES}
    none, sel, full = runs["none"], runs["selective"], runs["full"]
    print("\n" + "\n".join(f"recompute {m:>9}: held after forward {r['held']:>9,} B, peak {r['peak']:>9,} B"
                           for m, r in runs.items()))
    # activations held from forward to backward, and the peak over the step (grads included)
    assert none["held"] > sel["held"] > full["held"]
    assert none["peak"] > sel["peak"] > full["peak"]
    for mode in ("selective", "full"):
        assert torch.equal(runs[mode]["loss"], none["loss"])
        for name, g in none["grads"].items():
            assert torch.equal(runs[mode]["grads"][name], g), (mode, name)
    # what backward re-runs per block: selective, the 2 LayerNorms and the attention
    # but no matmul; full, those and the linears too, bar fc2 (torch's checkpoint
    # stops recomputing once it has every saved tensor, and no backward needs fc2's output)
    n = CFG.n_layers
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    for mode, addmm, ln, att in (("none", 0, 0, 0), ("selective", 0, 2 * n, n), ("full", 3 * n, 2 * n, n)):
        ops = runs[mode]["bwd_ops"]
        assert (ops[aten.addmm.default], ops[aten.native_layer_norm.default], ops[sdpa]) == (addmm, ln, att), mode


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_keeps_parameter_names_and_init(mode):
    # the recipe builds on meta, parallelizes, then initialises by parameter name:
    # recomputation must not rename anything (a wrapper module would, and change the init)
    with torch.device("meta"):
        model = GPT(CFG, seed=None)
    apply_recompute(list(model.layers.values()), mode)
    model.to_empty(device="cpu")
    model.init_weights(0)
    ref = GPT(CFG, seed=0).state_dict()
    got = model.state_dict()
    assert list(got) == list(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_unknown_recompute_mode_is_refused():
    with pytest.raises(ValueError, match="recompute must be one of"):
        apply_recompute(list(GPT(CFG, seed=0).layers.values()), "everything")


def _parity(rank, world):
    me = mesh(dp=2, tp=2)
    reports = {}
    for mode in MODES:
        pcfg = ParallelConfig(zero=3, recompute=mode, sp=True)
        reports[mode] = run_parity(me, lambda: GPT(CFG, seed=0), layout(pcfg),
                                   tiny_batches(CFG.vocab_size, steps=3, batch=8, seq=16), micro_batches=2,
                                   fb_kwargs=fb_kwargs(me, pcfg), noise=True)
    return reports


@pytest.mark.slow
def test_recompute_under_fsdp_and_tp_is_exact(pools):
    # dp=2 x tp=2 with SP, zero 3, 2 micro-batches: recomputation inside FSDP units
    # (parameters gathered again for it) on tensor-parallel blocks (whose reductions
    # selective recompute keeps). Each mode matches one process, and the modes match
    # each other to the bit: same losses and the same errors on every metric. Errors
    # are against float64, bounded by 1e-5 or 10x one fp32 process' own error, if larger
    # (a 1e-5 bound against an fp32 reference once failed at 1.02e-5 on a zero-init bias).
    results = pools.run(4, _parity)
    for mode in MODES:
        worst = assert_parity([r[mode] for r in results], 1e-5)
        print(f"recompute {mode:>9} under zero 3, dp=2 x tp=2 SP: worst rel err {worst.worst:.2e} "
              f"(one fp32 process: {worst.noise.worst:.2e})")
    for r in results:
        same = [(x.losses, x.loss, x.grad, x.param, x.grad_norm) for x in r.values()]
        assert same[1:] == same[:-1]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_blocks_trace_under_torch_compile(mode):
    # dynamo once refused every context_fn it met, noop_context_fn included: --compile
    # --recompute full failed at the first step. The eager backend traces the same
    # graph as inductor's without compiling kernels.
    torch.manual_seed(0)
    plain = GPT(CFG, seed=0)
    model = GPT(CFG, seed=0)
    apply_recompute(list(model.layers.values()), mode)
    for block in model.layers.values():
        block.compile(backend="eager", fullgraph=True)
    for m in (plain, model):
        cross_entropy_sum(m(X), Y).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
