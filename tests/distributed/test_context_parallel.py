"""Context parallelism (issue 14) on gloo: each variant (ring, all-gather, a2a)
against one process for both models at cp = 2, 3, 4 and composed with dp, tp+SP
and pp; float64 exactness of the attention itself; ignored tokens spread
unevenly; the ring's balance and bytes; the recipe; checkpoints across cp."""
import json

import pytest
import torch
import torch.distributed as dist

from meshtron import ParallelConfig
from meshtron.distributed import block_attention as ba
from meshtron.distributed import context_parallel as cpm
from meshtron.models import GPT, gpt_config
from meshtron.models.gpt import SPEC as GPT_SPEC
from meshtron.models.llama import SPEC as LLAMA_SPEC
from meshtron.models.llama import Llama, LlamaConfig
from meshtron.train.loss import IGNORE_INDEX

from harness import mesh, train
from parity import assert_parity, fb_kwargs, layout, pipelined, run_parity, tiny_batches

TOL = 1e-5
SEQ = 24                                   # divisible into 2*cp chunks for cp = 2, 3, 4
GPT_CFG = gpt_config("tiny", n_heads=12, dim=96, n_layers=2)          # 12 heads: a2a at cp = 2, 3, 4
LLAMA_CFG = LlamaConfig(n_layers=2, dim=96, n_heads=24, n_kv_heads=12, ffn_dim=128, vocab_size=320, max_seq_len=256,
                        rope_theta=1e4)     # GQA, 12 KV heads
MODELS = {"gpt": (lambda: GPT(GPT_CFG, seed=0), GPT_SPEC, GPT_CFG),
          "llama": (lambda: Llama(LLAMA_CFG, seed=0), LLAMA_SPEC, LLAMA_CFG)}
VARIANTS = ("p2p", "allgather", "a2a")


def _parity(rank, world, model, degrees, pcfg_kwargs, batches=None):
    build, spec, cfg = MODELS[model]
    me = mesh(**degrees)
    pcfg = ParallelConfig(cp=degrees["cp"], tp=degrees.get("tp", 1), **pcfg_kwargs)
    batches = batches or tiny_batches(cfg.vocab_size, steps=3, batch=4, seq=SEQ)
    par = pipelined(pcfg, spec, cfg) if degrees.get("pp", 1) > 1 else layout(pcfg, spec)
    return run_parity(me, build, par, batches, max_norm=0.5, fb_kwargs=fb_kwargs(me, pcfg))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.fast_cases(cp=2)
def test_cp_alone_matches_one_process(pools, variant, cp, model):
    assert_parity(pools.run(cp, _parity, model, dict(dp=1, cp=cp), dict(cp_comm=variant)), TOL)


COMPOSED = {"dp2 x cp2": (dict(dp=2, cp=2), dict(zero=3)),
            "cp2 x tp2 sp": (dict(dp=1, cp=2, tp=2), dict(sp=True)),
            "pp2 x cp2": (dict(dp=1, pp=2, cp=2), {})}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("composed", COMPOSED)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.fast_cases(model="llama")
def test_cp_composed_matches_one_process(pools, variant, composed, model):
    degrees, extra = COMPOSED[composed]
    assert_parity(pools.run(4, _parity, model, degrees, dict(cp_comm=variant, **extra)), TOL)


def test_ignored_tokens_spread_unevenly_over_the_chunks(pools):
    # label -100 on most of the first chunks of some samples: cp ranks then hold different
    # numbers of counted tokens, and the loss must still be the global token mean
    batches = [(x, y.clone()) for x, y in tiny_batches(GPT_CFG.vocab_size, steps=3, batch=4, seq=SEQ)]
    for i, (_, y) in enumerate(batches):
        y[0, :10] = IGNORE_INDEX
        y[1 + i % 3, 3:5] = IGNORE_INDEX
    for variant in VARIANTS:
        assert_parity(pools.run(2, _parity, "gpt", dict(dp=1, cp=2), dict(cp_comm=variant), batches), TOL)


# ---- the attention itself, in float64 -----------------------------------------------

def _attention_f64(rank, world, variant, kv_heads):
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 8, 8 * world, 8
    q = torch.randn(B, H, T, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, T, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, H, T, d, generator=g, dtype=torch.float64)
    # one process: the whole sequence, causal
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(ql, kl.repeat_interleave(H // kv_heads, 1),
                                                           vl.repeat_interleave(H // kv_heads, 1), is_causal=True)
    ref.backward(dout)
    me = mesh(dp=1, cp=world)
    idx = cpm.local_positions(T, world, me["cp"].get_local_rank())
    qs, ks, vs = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    group = me["cp"].get_group()
    out = {"p2p": lambda: cpm.ring_attention(qs, ks, vs, group),
           "allgather": lambda: cpm.allgather_attention(qs, ks, vs, group),
           "a2a": lambda: cpm.a2a_attention(qs, ks, vs, group)}[variant]()
    out.backward(dout[:, :, idx])
    err = {"out": (out - ref[:, :, idx]).abs().max(), "dq": (qs.grad - ql.grad[:, :, idx]).abs().max(),
           "dk": (ks.grad - kl.grad[:, :, idx]).abs().max(), "dv": (vs.grad - vl.grad[:, :, idx]).abs().max()}
    # and the log-sum-exp of one block, against the whole row's
    o, lse = ba.block_forward(q, k, v, causal=True)
    s = (q @ k.repeat_interleave(H // kv_heads, 1).transpose(-1, -2)) / d ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    err["lse"] = (lse - s.logsumexp(-1)).abs().max()
    return {k_: float(e) for k_, e in err.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_float64_attention_matches_one_process_to_1e12(pools, variant):
    for world in (2, 4):
        for errs in pools.run(world, _attention_f64, variant, 4):   # grouped-query: 8 heads, 4 KV heads
            assert max(errs.values()) < 1e-12, (variant, world, errs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels need a GPU (bench_cp.py checks them too)")
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_fused_blocks_on_row_slices_err_as_bf16_does(kv_heads):
    # the ring hands the kernels row slices of q, out and lse (the second query chunk): the
    # kernels read lse as contiguous, which once gave gradients 250x off on GPUs
    g = torch.Generator("cuda").manual_seed(0)
    B, H, T, d = 1, 8, 1024, 64
    q, dout = (torch.randn(B, H, T, d, device="cuda", generator=g) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, T, d, device="cuda", generator=g) for _ in range(2))
    for rows, keys, causal in ((slice(0, T), slice(0, T), True), (slice(T // 2, T), slice(0, T), False),
                               (slice(0, T), slice(0, T // 2), False)):
        errs = []
        for dtype in (torch.bfloat16, torch.float64):
            qq, kk, vv, dd = (t.to(dtype) for t in (q, k[:, :, keys], v[:, :, keys], dout))
            out, lse = ba.block_forward(qq, kk, vv, causal)   # every row; the backward takes a slice
            errs.append(ba.block_backward(dd[:, :, rows], qq[:, :, rows], kk, vv, out[:, :, rows], lse[:, :, rows],
                                           causal))
        for got, ref in zip(*errs):
            assert (got.double() - ref).norm() / ref.norm() < 2e-2, (rows, keys, causal)


# ---- balance and bytes of the ring ----------------------------------------------------

def work(rank, cp, c, layout_):
    """Attention work (query x key pairs computed) per ring step of one rank."""
    if layout_ == "head-tail":
        return [(r.stop - r.start) * (k.stop - k.start) * (0.5 if causal else 1)
                for _, r, k, causal in cpm.ring_steps(rank, cp, c)]
    # contiguous chunks of 2c: rank r attends rank j < r fully, itself causally, later ranks not at all
    return [(2 * c) ** 2 * (0.5 if j == rank else (1.0 if j < rank else 0.0))
            for j in ((rank - s) % cp for s in range(cp))]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_the_ring_gives_every_rank_the_same_work_each_step(cp):
    c = 64
    for layout_, limit in (("head-tail", 1.01), ("contiguous", None)):
        per_step = [[work(r, cp, c, layout_)[s] for r in range(cp)] for s in range(cp)]
        ratios = [max(w) / (sum(w) / cp) for w in per_step if sum(w)]
        total = [sum(work(r, cp, c, layout_)) for r in range(cp)]
        if limit:
            assert max(ratios) <= limit and max(total) / (sum(total) / cp) <= limit, (ratios, total)
        elif cp == 2:
            assert max(total) / (sum(total) / cp) == pytest.approx(1.5)   # what head-tail chunks avoid


def _ring_bytes(rank, world):
    sent = []
    real = cpm.dist.batch_isend_irecv

    def counting(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real(ops)

    S, kv_heads, d = 8 * world, 2, 16
    q = torch.randn(1, 4, S // world, d)
    k, v = torch.randn(1, kv_heads, S // world, d), torch.randn(1, kv_heads, S // world, d)
    cpm.dist.batch_isend_irecv = counting
    try:
        cpm.ring_attention(q, k, v, mesh(dp=1, cp=world)["cp"].get_group())
    finally:
        cpm.dist.batch_isend_irecv = real
    return sum(sent), (world - 1) / world * 2 * S * kv_heads * d * 4


@pytest.mark.parametrize("world", [2, 4])
def test_the_ring_moves_its_share_of_k_and_v_per_layer(pools, world):
    for sent, expected in pools.run(world, _ring_bytes):
        assert sent == expected


# ---- the recipe ----------------------------------------------------------------------

ARGS = ["--seq-len", "32", "--steps", "3", "--global-batch", "4", "--micro-batch", "4", "--log-interval", "1",
        "--lr", "3e-3"]


def losses(path):
    return [r["loss"] for r in map(json.loads, open(path))]


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
@pytest.mark.fast_cases(model="llama-tiny")
def test_recipe_loss_with_cp_equals_one_process(pools, tmp_path, model):
    pools.run(1, train, ["--model", model] + ARGS + ["--metrics-file", str(tmp_path / "one.jsonl")])
    ref = losses(tmp_path / "one.jsonl")
    for cp in (2, 4):
        path = tmp_path / f"cp{cp}.jsonl"
        pools.run(cp, train, ["--model", model] + ARGS + ["--cp", str(cp), "--metrics-file", str(path)])
        assert losses(path) == pytest.approx(ref, rel=1e-5), cp


def test_a_checkpoint_resumes_at_another_cp_degree(pools, tmp_path):
    argv = ["--model", "tiny"] + ARGS + ["--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"),
                                         "--checkpoint-interval", "2"]
    straight = pools.run(1, train, ["--model", "tiny"] + ARGS + ["--steps", "4"])[0]
    first = pools.run(2, train, argv + ["--cp", "2"], 2)[0]
    second = pools.run(4, train, argv + ["--cp", "4", "--cp-comm", "allgather", "--resume", "auto"])[0]
    assert first + second == pytest.approx(straight, rel=1e-5)


def test_cp_layout_errors():
    full = dict(dp=1, pp=1, cp=4, tp=1, ep=1)
    with pytest.raises(ValueError, match="cp=4 needs the sequence length 36 to be divisible by 2\\*cp=8"):
        GPT_SPEC.check_layout(GPT_CFG, full, ParallelConfig(cp=4), 36)
    with pytest.raises(ValueError, match="--cp-comm a2a splits each tp rank's 4 attention heads over cp=3"):
        GPT_SPEC.check_layout(gpt_config("tiny"), full | dict(cp=3), ParallelConfig(cp=3, cp_comm="a2a"), 48)
    with pytest.raises(ValueError, match="each cp rank's 12 tokens must be divisible by 8"):
        GPT_SPEC.check_layout(gpt_config("tiny", n_heads=8), full | dict(cp=2, tp=8),
                              ParallelConfig(cp=2, tp=8, sp=True), 24)
    with pytest.raises(ValueError, match="without dropout"):
        GPT_SPEC.check_layout(gpt_config("tiny", dropout=0.1), full | dict(cp=2), ParallelConfig(cp=2), 32)
