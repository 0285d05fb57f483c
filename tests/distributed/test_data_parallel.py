"""Data parallelism (issue 4) on gloo: every ZeRO stage, HSDP, gradient
accumulation, clipping and 2-D FSDP x TP against one process; what each stage
keeps per rank and what it sends per micro-batch; mixed precision."""
import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from meshtron import ParallelConfig
from meshtron.distributed.mesh import batch_slice
from meshtron.distributed.reduce import clip_grad_norm_, grad_norm
from meshtron.models import GPT, gpt_config
from meshtron.train.optim import build_optimizer
from meshtron.train.step import forward_backward

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, run_parity, tiny_batches

CFG = gpt_config("tiny", n_layers=2)
BATCHES = tiny_batches(CFG.vocab_size, steps=3, batch=8, seq=16)
FP32_TOL = 1e-5
GROUPS = CFG.n_layers + 1          # FSDP units: one per block, one for the root
P_BYTES = CFG.num_params() * 4     # the whole model's fp32 bytes (tied output counted once)


def build():
    return GPT(CFG, seed=0)


def parallelize(model, me, pcfg):
    return layout(pcfg)(model, me)


# ---- parity against one process ------------------------------------------------

def _parity(rank, world, pcfg, micro_batches=1, max_norm=None, degrees=None):
    me = mesh(**(degrees or {"dp": world}))
    return run_parity(me, build, layout(pcfg), BATCHES, micro_batches=micro_batches, max_norm=max_norm,
                      fb_kwargs=fb_kwargs(me, pcfg))


def _report(what, worst):
    print(f"\n{what}: worst rel err {worst.worst:.1e} (loss {worst.loss:.1e}, grad {worst.grad:.1e}, "
          f"param {worst.param:.1e}, grad norm {worst.grad_norm:.1e})", end="")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.fast_cases(world=2)
def test_zero_stage_matches_one_process(pools, zero, world):
    _report(f"zero {zero} dp={world}", assert_parity(pools.run(world, _parity, ParallelConfig(zero=zero)),
                                                      FP32_TOL))


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.fast_cases(zero=3)
def test_hsdp_2x2_matches_one_process(pools, zero):
    # 2 replicas x 2 shards; 2 micro-batches, so ZeRO-2/3's once-per-step all-reduce
    # across replicas (set_requires_all_reduce) is covered too
    pcfg = ParallelConfig(zero=zero, hsdp=2)
    _report(f"HSDP 2x2 zero {zero}", assert_parity(pools.run(4, _parity, pcfg, 2), FP32_TOL))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_four_micro_batches_match_one_big_batch(pools, zero):
    # dp=2: 4 samples per rank in 4 micro-batches of 1, against 8 samples at once
    _report(f"zero {zero} dp=2, 4 micro-batches", assert_parity(
        pools.run(2, _parity, ParallelConfig(zero=zero), 4), FP32_TOL))


def _clipping(rank, world, pcfg, max_norm, degrees):
    """One backward, then clipping on both sides: the global norm and every clipped
    gradient must match one process (run_parity compares grads before clipping,
    and Adam is nearly blind to a uniform gradient scale)."""
    me = mesh(**degrees)
    ref, par = build(), parallelize(build(), me, pcfg)
    x, y = BATCHES[0]
    index, count = batch_slice(me)
    forward_backward([ref], x, y, None)
    forward_backward([par], x.chunk(count)[index], y.chunk(count)[index], me, **fb_kwargs(me, pcfg))
    ref_norm, norm = clip_grad_norm_(ref.parameters(), max_norm), clip_grad_norm_(par.parameters(), max_norm, me)
    grads = {n: p.grad for n, p in par.named_parameters()}
    err = max(float((grads[n].full_tensor() - p.grad).norm() / p.grad.norm()) for n, p in ref.named_parameters())
    return float(ref_norm), float(norm), float(grad_norm(par.parameters(), me)), err


CLIP_CASES = {"zero3-dp4": (ParallelConfig(zero=3), {"dp": 4}),
              "zero0-dp4": (ParallelConfig(zero=0), {"dp": 4}),
              "hsdp2x2-zero2": (ParallelConfig(zero=2, hsdp=2), {"dp": 4})}


@pytest.mark.parametrize("case", CLIP_CASES)
@pytest.mark.fast_cases("zero3-dp4")
def test_clipping_by_global_norm_matches_one_process(pools, case):
    pcfg, degrees = CLIP_CASES[case]
    max_norm = 0.05
    results = pools.run(4, _clipping, pcfg, max_norm, degrees)
    for ref_norm, norm, after, err in results:
        assert ref_norm > 10 * max_norm                       # clipping is active, by a lot
        assert abs(norm - ref_norm) / ref_norm < FP32_TOL       # the norm logged is the global one
        assert abs(after - max_norm) / max_norm < FP32_TOL      # each parameter counted once
        assert err < FP32_TOL
    print(f"\n{case}: global norm {results[0][0]:.4f} (one process) vs {results[0][1]:.4f}, clipped grads "
          f"err {max(r[3] for r in results):.1e}", end="")
    # and over 3 optimizer steps with 2 micro-batches
    _report(f"{case}, clipped to {max_norm}, 2 micro-batches",
            assert_parity(pools.run(4, _parity, pcfg, 2, max_norm, degrees), FP32_TOL))


# ---- instruments -----------------------------------------------------------------

def probe_each_forward(model, probe):
    """Call probe(i) before the forward of micro-batch i (after the backward of i-1)."""
    count = [0]

    def hook(mod, args):
        probe(count[0])
        count[0] += 1
    return model.register_forward_pre_hook(hook, prepend=True)   # before FSDP gathers the root


@contextlib.contextmanager
def record_collectives(log: list):
    """Append (kind, group size, dtype) to log for every collective torch.distributed
    issues. FSDP2 calls dist.<name> at run time, so wrapping the module's functions
    sees them all; the deprecated aliases forward to these, so nothing counts twice."""
    kinds = {"all_reduce": "all_reduce",
             "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor":
                 "reduce_scatter"}
    saved = {name: getattr(dist, name) for name in kinds}

    def wrap(name, fn):
        sig = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            a = sig.bind(*args, **kwargs).arguments
            tensor = next(v for v in a.values() if isinstance(v, torch.Tensor))
            log.append((kinds[name], dist.get_world_size(a.get("group")), tensor.dtype))
            return fn(*args, **kwargs)
        return wrapped

    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def fsdp_params(model):
    """FSDP2's per-parameter records (private API, read-only here): the only place
    that says which unsharded parameters and gradients a rank holds right now."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            yield from (group.fsdp_params if group else [])


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (DTensors: their local shard);
    a freed FSDP buffer has a storage of size 0."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        seen[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
    return sum(seen.values())


def held(model) -> dict:
    fps = list(fsdp_params(model))
    unsharded = [fp._unsharded_param for fp in fps if hasattr(fp, "_unsharded_param")]
    return {"params": storage_bytes(fp.sharded_param for fp in fps),
            "gathered params": storage_bytes(unsharded),
            "grads": storage_bytes(fp.sharded_param.grad for fp in fps),
            "unsharded grads": storage_bytes([fp.unsharded_accumulated_grad for fp in fps] +
                                             [p.grad for p in unsharded])}


# ---- what each stage keeps, and what it sends ------------------------------------

def _one_step_observed(rank, world, pcfg, micro_batches=4):
    """One optimizer step of `micro_batches` after a warm-up step, observed: the bytes
    held between micro-batches and after the step, every collective in order (with
    ("mb", i) marking where micro-batch i starts), and the dtypes mixed precision uses."""
    me = mesh(dp=world)
    model = parallelize(build(), me, pcfg)
    opt = build_optimizer(model, 1e-3)
    (x, y), = tiny_batches(CFG.vocab_size, steps=1, batch=4 * world, seq=16)
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    fb = dict(microbatches=micro_batches, **fb_kwargs(me, pcfg))
    forward_backward([model], xs, ys, me, **fb)        # warm-up: FSDP's lazy init, Adam's state
    clip_grad_norm_(model.parameters(), None, me)
    opt.step()
    opt.zero_grad(set_to_none=True)
    snapshots, log, logits = [], [], []
    model.register_forward_hook(lambda mod, args, out: logits.append(out.dtype))
    probe_each_forward(model, lambda i: (snapshots.append(held(model)), log.append(("mb", i))))
    with record_collectives(log):
        # mesh=None: no loss all-reduce, so the log holds FSDP's collectives only
        loss = forward_backward([model], xs, ys, None, **fb)
    after_backward = held(model)
    opt.step()
    state = [t for st in opt.state.values() for k, t in st.items() if k != "step"]
    after_step = {"params": storage_bytes(model.parameters()),
                  "grads": storage_bytes(p.grad for p in model.parameters()),
                  "adam": storage_bytes(state), "gathered params": after_backward["gathered params"]}
    dtypes = {"params": {p.dtype for p in model.parameters()}, "grads": {p.grad.dtype for p in model.parameters()},
              "adam": {t.dtype for t in state}, "logits": set(logits), "loss": {loss.dtype}}
    return {"between micro-batches": snapshots[-1], "after step": after_step, "log": log, "dtypes": dtypes}


# bytes held per rank at dp=n, as fractions of the model's fp32 bytes P_BYTES.
# Every sharded dim of the tiny GPT divides by 4, so the fractions are exact.
#   between micro-batches: master weights (FSDP's shards), gathered weights (the
#   compute copy), reduced (sharded) grads, unreduced (unsharded) grads
#   after the step: weights, grads, AdamW's two moments, gathered weights left
def expected_bytes(zero, n):
    s = 1 if zero == 0 else 1 / n     # zero 0 shards over a dim of size 1
    between = {0: (s, 1, 0, 1), 1: (s, 1, 0, 1), 2: (s, 1, s, 0), 3: (s, 0, s, 0)}[zero]
    return (dict(zip(("params", "gathered params", "grads", "unsharded grads"), between)),
            {"params": s, "grads": s, "adam": 2 * s, "gathered params": 0})


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bytes_per_rank_per_zero_stage(pools, zero):
    results = pools.run(4, _one_step_observed, ParallelConfig(zero=zero))
    between, after = expected_bytes(zero, 4)
    for r in results:
        got_between = {k: v / P_BYTES for k, v in r["between micro-batches"].items()}
        got_after = {k: v / P_BYTES for k, v in r["after step"].items()}
        assert got_between == between, (zero, got_between)
        assert got_after == after, (zero, got_after)
    print(f"\nzero {zero}, dp=4, x {P_BYTES:,} B: between micro-batches {got_between}; after the step {got_after}",
          end="")


def per_micro_batch(log, kind):
    """Counts of `kind` collectives in each micro-batch's forward + backward."""
    counts = []
    for entry in log:
        if entry[0] == "mb":
            counts.append(0)
        elif entry[0] == kind:
            counts[-1] += 1
    return counts


G = GROUPS
COMM_CASES = {  # 4 micro-batches at dp=4: per kind, (count in each micro-batch, group size)
    # DDP: one all-reduce per FSDP unit, after the last micro-batch only
    "zero0": {"all_reduce": ([0, 0, 0, G], 4), "reduce_scatter": ([0] * 4, None), "all_gather": ([0] * 4, None)},
    # one reduce-scatter per unit, after the last micro-batch only; one all-gather per step
    "zero1": {"all_reduce": ([0] * 4, None), "reduce_scatter": ([0, 0, 0, G], 4), "all_gather": ([G, 0, 0, 0], 4)},
    # reduce-scatter every micro-batch; one all-gather per step
    "zero2": {"all_reduce": ([0] * 4, None), "reduce_scatter": ([G] * 4, 4), "all_gather": ([G, 0, 0, 0], 4)},
    # gathered in forward and again in backward (the root stays gathered in between)
    "zero3": {"all_reduce": ([0] * 4, None), "reduce_scatter": ([G] * 4, 4), "all_gather": ([2 * G - 1] * 4, 4)},
    # HSDP 2 replicas x 2 shards: reduce-scatter inside a replica as the stage says,
    # all-reduce across replicas once per step
    "hsdp2-zero1": {"all_reduce": ([0, 0, 0, G], 2), "reduce_scatter": ([0, 0, 0, G], 2),
                    "all_gather": ([G, 0, 0, 0], 2)},
    "hsdp2-zero2": {"all_reduce": ([0, 0, 0, G], 2), "reduce_scatter": ([G] * 4, 2),
                    "all_gather": ([G, 0, 0, 0], 2)},
    "hsdp2-zero3": {"all_reduce": ([0, 0, 0, G], 2), "reduce_scatter": ([G] * 4, 2),
                    "all_gather": ([2 * G - 1] * 4, 2)},
}


@pytest.mark.parametrize("case", COMM_CASES)
@pytest.mark.fast_cases("zero0", "zero1", "zero2", "zero3")
def test_collectives_per_micro_batch(pools, case):
    hsdp = 2 if case.startswith("hsdp") else 1
    pcfg = ParallelConfig(zero=int(case[-1]), hsdp=hsdp)
    for r in pools.run(4, _one_step_observed, pcfg):
        for kind, (counts, group_size) in COMM_CASES[case].items():
            assert per_micro_batch(r["log"], kind) == counts, (case, kind, r["log"])
            assert {e[1] for e in r["log"] if e[0] == kind} <= {group_size}, (case, kind, r["log"])
        assert {e[2] for e in r["log"] if e[0] != "mb"} == {torch.float32}


# ---- mixed precision ---------------------------------------------------------------

@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [1, 3])
def test_mixed_precision_dtypes(pools, zero, reduce_dtype):
    pcfg = ParallelConfig(zero=zero, dtype="bf16", reduce_dtype=reduce_dtype)
    for r in pools.run(2, _one_step_observed, pcfg):
        d = r["dtypes"]
        # fp32 master weights, grads and Adam state; bf16 compute; fp32 loss
        assert d["params"] == d["grads"] == d["adam"] == d["loss"] == {torch.float32}, d
        assert d["logits"] == {torch.bfloat16}, d
        reduced = {e[2] for e in r["log"] if e[0] == "reduce_scatter"}
        assert reduced == {torch.float32 if reduce_dtype == "fp32" else torch.bfloat16}
        assert {e[2] for e in r["log"] if e[0] == "all_gather"} == {torch.bfloat16}   # gathered already cast


def _bf16_vs_fp32(rank, world, pcfg):
    """(what bf16 costs one process, what bf16 under FSDP costs): the first is the
    fp32 run (FSDP fp32 = one process to 1e-5) against one process in bf16
    (autocast on the plain model); the second FSDP in bf16 against one
    process in fp32. Same model, data, steps and metrics."""
    me = mesh(dp=world)
    fp32 = ParallelConfig(zero=pcfg.zero)
    one_process_bf16 = run_parity(me, build, layout(fp32), BATCHES, fb_kwargs=fb_kwargs(me, fp32),
                                  ref_fb_kwargs={"autocast": torch.bfloat16})
    return one_process_bf16, _parity(rank, world, pcfg)


# bf16's unit roundoff: one rounding of a result errs by up to this, relative
BF16_ROUNDOFF = 2.0 ** -8


@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world,zero", [(2, 3), (4, 1)])
@pytest.mark.fast_cases(world=2)
def test_bf16_training_matches_one_process_within_bf16_error(pools, world, zero, reduce_dtype):
    """Tolerance, per metric: max(twice what bf16 compute costs one process,
    measured here on the same model, data and metrics; bf16's unit roundoff 2^-8).

    bf16 keeps 8 significant bits, so one rounding of a result errs by up to 2^-8
    relative: an error under that is below what bf16 can resolve at all, and two
    such errors' ratio is noise (the loss, a mean over tokens, errs by ~1e-5 here,
    and its ratio to one process's error changed from one CPU to another). Above
    it, errors are systematic: the gradients of LayerNorm weights are sums over
    tokens with cancellation, so their norm-relative error reaches ~1e-2 on one
    process already, and data parallelism must add nothing of that order: it
    only moves where bf16 partial sums are rounded, fp32 reduction adds no error
    of its own and bf16 reduction one rounding per gradient."""
    pcfg = ParallelConfig(zero=zero, dtype="bf16", reduce_dtype=reduce_dtype)
    results = pools.run(world, _bf16_vs_fp32, pcfg)
    for metric in ("loss", "grad", "param", "grad_norm"):
        floor, got = (max(getattr(r[i], metric) for r in results) for i in (0, 1))
        assert got <= max(2 * floor, BF16_ROUNDOFF), (metric, got, floor)
    assert min(r[1].grad for r in results) > 100 * FP32_TOL    # bf16 compute really happened
    _report("bf16 one process vs fp32", max((r[0] for r in results), key=lambda rep: rep.worst))
    _report(f"bf16 zero {zero} dp={world} reduce {reduce_dtype} vs fp32",
            max((r[1] for r in results), key=lambda rep: rep.worst))


# ---- 2-D: FSDP over dp on top of TP over tp ---------------------------------------------

@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.fast_cases(zero=3)
def test_fsdp_over_tp_with_sp_matches_one_process(pools, zero):
    # torchtitan's order (parallelize: TP first, FSDP last): dp=2 x tp=2, sequence
    # parallel, loss parallel, 2 micro-batches, clipping active
    pcfg = ParallelConfig(zero=zero, sp=True)
    _report(f"dp=2 x tp=2 SP zero {zero}, clipped, 2 micro-batches",
            assert_parity(pools.run(4, _parity, pcfg, 2, 0.05, {"dp": 2, "tp": 2}), FP32_TOL))


# ---- bf16 at dp = 1: autocast on one process, FSDP's policy at dp > 1 -------------------

def _bf16_losses(rank, world, mixed_precision="autocast"):
    me = mesh(dp=world)
    pcfg = ParallelConfig(zero=1, dtype="bf16", mixed_precision=mixed_precision)
    model = parallelize(build(), me, pcfg)
    opt = build_optimizer(model, 1e-3)
    losses = []
    for x, y in BATCHES:
        losses.append(float(forward_backward([model], x.chunk(world)[rank], y.chunk(world)[rank], me,
                                             **fb_kwargs(me, pcfg))))
        clip_grad_norm_(model.parameters(), 1.0, me)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return isinstance(model, FSDPModule), losses


@pytest.mark.parametrize("mixed_precision", ["autocast", "fsdp"])
def test_bf16_at_dp1_matches_dp2(pools, mixed_precision):
    # fp32 master weights, grads and Adam state and a bf16 residual stream on one process
    # either way (autocast: no FSDP; fsdp: FSDP's policy on a one-rank mesh), so the loss
    # does not change with dp
    r = pools.run(1, _one_step_observed, ParallelConfig(dtype="bf16", mixed_precision=mixed_precision))[0]
    d = r["dtypes"]
    assert d["params"] == d["grads"] == d["adam"] == d["loss"] == {torch.float32}, d
    assert d["logits"] == {torch.bfloat16}, d
    (fsdp1, one), = pools.run(1, _bf16_losses, mixed_precision)
    (fsdp2, two), _ = pools.run(2, _bf16_losses)
    assert fsdp1 == (mixed_precision == "fsdp") and fsdp2
    # the same bf16 roundings; only the order of the fp32 gradient sums differs
    assert two == pytest.approx(one, rel=1e-4), (one, two)   # measured 1e-5
    print(f"\nbf16 losses dp=1 ({mixed_precision}) {one}, dp=2 {two}", end="")


def _autocast_and_fsdp_vs_fp32(rank, world, model):
    """One process, bf16, 3 steps of 2 micro-batches with clipping, each of the two
    one-process paths (autocast without FSDP; FSDP's policy on a one-rank mesh)
    against one fp32 process on the same weights and batches."""
    from meshtron import models
    me = mesh(dp=1)
    spec, cfg = models.get(model)
    batches = tiny_batches(cfg.vocab_size, steps=3, batch=8, seq=16)
    out = {}
    for mp in ("autocast", "fsdp"):
        pcfg = ParallelConfig(zero=1, dtype="bf16", mixed_precision=mp)
        out[mp] = run_parity(me, lambda: spec.model_cls(cfg, seed=0), layout(pcfg, spec), batches, micro_batches=2,
                             max_norm=0.05, fb_kwargs=fb_kwargs(me, pcfg))
    return out


@pytest.mark.parametrize("model", ["tiny", "llama-tiny", "llama-moe-tiny"])
def test_one_process_autocast_errs_as_fsdp_one_rank_mesh(pools, model):
    """The one-process bf16 path (no FSDP) against the path it replaces (FSDP's
    policy on a one-rank mesh), each measured against fp32: per metric, autocast may
    err by max(twice FSDP's error, bf16's roundoff 2^-8), the tolerance every dp > 1
    bf16 layout meets (test_bf16_training_matches_one_process_within_bf16_error).
    Both cast the same fp32 weights to bf16 and run a bf16 residual stream; they
    differ only where a bf16 weight's own rounding enters (the norms' weights, which
    autocast keeps fp32, and their gradients, formed in fp32)."""
    r = pools.run(1, _autocast_and_fsdp_vs_fp32, model)[0]
    for metric in ("loss", "grad", "param", "grad_norm"):
        got, floor = getattr(r["autocast"], metric), getattr(r["fsdp"], metric)
        assert got <= max(2 * floor, BF16_ROUNDOFF), (metric, got, floor)
    assert r["autocast"].grad > 100 * FP32_TOL    # bf16 compute really happened
    _report(f"{model} bf16 one process, autocast, vs fp32", r["autocast"])
    _report(f"{model} bf16 one process, FSDP one rank, vs fp32", r["fsdp"])
