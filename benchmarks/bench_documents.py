"""Packed documents on GPUs: is the FlexAttention path right, what does the mask save
in attention, and in a training step.

    python benchmarks/bench_documents.py --check                       # 1. right
    python benchmarks/bench_documents.py --attention [--data PREFIX]   # 2. attention alone
    torchrun --nproc-per-node N benchmarks/bench_documents.py --train --out DIR -- RECIPE FLAGS   # 3. a step

1. Right (`--check`): a small Llama (fp32) on packed batches with the document mask
   and per-document positions (the BlockMask path) against the same documents run
   one by one, and against the dense-mask path (SDPA): loss and gradients,
   relative; eager, then with each block compiled over two batches of other
   documents (a compiled block must not keep the first batch's mask). Also the
   BlockMask built from document ranges against create_block_mask's, tensor by
   tensor, on the data's documents.
2. Attention (`--attention`): forward + backward of one attention call at llama-1B's
   heads (32 query, 8 KV, of 64) at --seq tokens x --batch, and at llama-617M's
   under cp=4 Ulysses (4 heads of 128 per rank, 64K tokens): SDPA causal (the
   baseline), FlexAttention under create_block_mask's mask (the mask evaluated at
   every score) and under the block-range mask, optionally compiled as torchtitan
   compiles it (--autotune: max-autotune), and the flash varlen kernel where torch
   has it. Documents: the data's own (--data, a Megatron dataset prefix, samples in
   file order) or lengths 1 + Exp(--mean-doc). The mask leaves sum(L_i^2)/2 of T^2/2
   causal score entries ("kept").
3. A step (`--train`): the recipe's Trainer (the flags after `--`, as
   recipes/train.py takes them), samples in file order (--no-shuffle, as
   torchtitan's loader reads), --warmup steps, then --rounds rounds of --window
   steps between two GPU synchronisations; the step time is the median round /
   window. With --warmup 5 --window 5 --rounds 3, the timed steps are 6-20, the
   steps of torchtitan's last three 5-step log windows: the same samples.
   tokens/s/GPU, MFU (the model's flops_per_token: attention counted whole, PaLM's
   convention, so masked and causal runs share it), peak memory, the kept share of
   causal attention in the timed samples, and every step's loss: one JSON line
   per run to --out/documents.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron.models.common.documents import block_mask, document_inputs, masked_attention  # noqa: E402
from meshtron.models.llama import Llama, LlamaConfig  # noqa: E402
from meshtron.train.loss import IGNORE_INDEX  # noqa: E402


def packed(rng, B: int, T: int, mean: float, vocab: int):
    """(x, y, documents (B, T + 1)) of documents with lengths ~ 1 + Exp(mean)."""
    docs = np.zeros((B, T + 1), dtype=np.int64)
    for b in range(B):
        t, d = 0, 0
        while t < T + 1:
            n = 1 + int(rng.exponential(mean))
            docs[b, t:t + n] = d
            t, d = t + n, d + 1
    xy = torch.from_numpy(rng.integers(0, vocab, (B, T + 1)))
    return xy[:, :-1], xy[:, 1:], torch.from_numpy(docs)


def data_documents(prefix: str, T: int, first: int, count: int) -> torch.Tensor:
    """(count, T) document indices of samples first.. of a Megatron dataset, in file order."""
    from meshtron.data.sources import open_data
    src = open_data(prefix, 1 << 20, documents=True)
    return torch.from_numpy(np.stack([src.documents(i, T)[:-1] for i in range(first, first + count)]))


def kept(documents: torch.Tensor) -> float:
    """The share of causal score entries the document mask leaves, over (B, T) samples."""
    T = documents.shape[1]
    share = [float((c * (c + 1) / 2).sum()) / (T * (T + 1) / 2)
             for c in (torch.unique_consecutive(d, return_counts=True)[1].double() for d in documents.cpu())]
    return statistics.mean(share)


# ---- 1. right ----------------------------------------------------------------------

def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def check_model(model, ref_model, batch, tag: str) -> float:
    """Packed through `model` (flex, then dense) against one by one through `ref_model`
    (the same weights, eager); returns the worst relative error."""
    x, y, documents = batch
    y, inputs = document_inputs(documents, y, mask=True, positions=True, eod_mask_loss=True, ignore_index=IGNORE_INDEX)
    count = (y != IGNORE_INDEX).sum()
    total = 0.0
    for b in range(x.shape[0]):
        for d in inputs["documents"][b].unique():
            idx = (inputs["documents"][b] == d).nonzero().squeeze(1)
            total = total + F.cross_entropy(ref_model(x[b:b + 1, idx])[0].float(), y[b, idx],
                                            ignore_index=IGNORE_INDEX, reduction="sum")
    ref = total / count
    g_ref = grads_of(ref_model, ref)
    worst = 0.0
    for name, dense in (("flex BlockMask", False), ("SDPA dense mask", True)):
        model.document_mask.dense = dense   # dense: the CPU's path on this GPU (SDPA with the boolean mask)
        try:
            logits = model(x, **inputs)
        finally:
            model.document_mask.dense = False
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / count
        g = grads_of(model, loss)
        e_loss, e_grad = abs(float(loss - ref)) / float(ref), float((g - g_ref).norm() / g_ref.norm())
        worst = max(worst, e_loss, e_grad)
        print(f"{tag:28s} {name:16s} vs one by one: loss {e_loss:.2e}, gradients {e_grad:.2e}")
    return worst


def check(device, data: str | None) -> bool:
    cfg = LlamaConfig(n_layers=2, dim=128, n_heads=8, n_kv_heads=4, ffn_dim=256, vocab_size=512, max_seq_len=512,
                      rope_theta=1e4, fused_kernels=False)
    model, compiled = Llama(cfg, seed=0).to(device), Llama(cfg, seed=0).to(device)
    rng = np.random.default_rng(0)
    batches = [tuple(t.to(device) for t in packed(rng, 2, 256, mean, cfg.vocab_size)) for mean in (40.0, 25.0, 60.0)]
    worst = check_model(model, model, batches[0], "eager")
    for layer in compiled.layers.values():   # as --compile does: each block, the mask one of its inputs
        layer.compile()
    for i, batch in enumerate(batches[1:]):
        worst = max(worst, check_model(compiled, model, batch, f"compiled blocks, batch {i + 1}"))
    # the range-built BlockMask against create_block_mask's on real documents (or synthetic ones)
    from torch.nn.attention.flex_attention import create_block_mask
    documents = (data_documents(data, 8192, 0, 4) if data else packed(rng, 4, 8192, 1000.0, 2)[2][:, :-1]).to(device)
    ours = block_mask(documents)
    ref = create_block_mask(lambda b, h, q, k: (documents[b, q] == documents[b, k]) & (q >= k), documents.shape[0],
                            None, documents.shape[1], documents.shape[1], device=device)
    same = all(torch.equal(getattr(ours, n), getattr(ref, n)) for n in
               ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices"))
    print(f"block-range BlockMask equals create_block_mask's at 4 x 8192: {same}")
    ok = worst < 1e-3 and same   # fp32 (a kernel's TF32 would give ~1e-4); a wrong mask gives ~1e-1
    print(f"CHECK {'PASSED' if ok else 'FAILED'}: worst relative error {worst:.2e} (fp32; limit 1e-3)")
    return ok


# ---- 2. attention --------------------------------------------------------------------

def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _varlen():
    """torch's flash varlen attention, called the way this torch takes it, or None."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters

    def call(q, k, v, cu, max_len):   # (total, H, d) each; causal within each sequence of cu
        kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    return call


def attention_case(device, name: str, documents: torch.Tensor, H: int, KV: int, hd: int, args) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from meshtron.distributed.block_attention import _compiled_flex as _flex
    B, T = documents.shape
    torch._dynamo.reset()   # each case compiled for its own shapes
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, H, T, hd, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(B, KV, T, hd, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    share = kept(documents)
    causal_flop = 3.5 * 2 * 2 * B * H * hd * T * (T + 1) / 2    # forward 2 matmuls, backward 5: 3.5x forward
    rows = []

    def run(label, fn, flop_share, build=None):
        try:
            t = timed(fn, args.repeats)
        except Exception as e:  # noqa: BLE001 - an unsupported variant on this torch: say so, go on
            print(f"  {label:44s} failed: {type(e).__name__}: {str(e)[:160]}")
            torch.cuda.empty_cache()
            return
        b = timed(build, args.repeats) if build else 0.0
        rows.append(dict(case=name, variant=label, ms=t * 1e3, mask_build_ms=b * 1e3, kept=share,
                         tflops_kept=causal_flop * flop_share / t / 1e12))
        print(f"  {label:44s} {t * 1e3:8.2f} ms  (mask build {b * 1e3:6.2f} ms)  "
              f"{causal_flop * flop_share / t / 1e12:6.1f} TFLOP/s of the scores it needs")

    def backward(out):
        out.backward(torch.ones_like(out))

    print(f"{name}: B={B} T={T} H={H} KV={KV} hd={hd}, {int(sum(len(d.unique()) for d in documents))} document "
          f"pieces, the mask keeps {100 * share:.1f}% of causal scores")
    run("SDPA causal", lambda: backward(F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                      enable_gqa=H != KV)), 1.0)

    def mask_mod(b, h, qi, ki):
        return (documents[b, qi] == documents[b, ki]) & (qi >= ki)
    if T <= 16384:   # evaluates the mask at T^2 entries: 4 GiB tensors at 64K
        old = lambda: create_block_mask(mask_mod, B, None, T, T, device=device)   # noqa: E731
        run("flex, create_block_mask (built each call)", lambda: backward(masked_attention(q, k, v, old())), share,
            old)
    new = lambda: block_mask(documents)   # noqa: E731
    run("flex as shipped (mask built each call)", lambda: backward(masked_attention(q, k, v, new())), share, new)
    bm = new()
    run("flex as shipped (mask built once)", lambda: backward(masked_attention(q, k, v, bm)), share)
    run("flex, torch's default tiles (mask built once)",
        lambda: backward(_flex()(q, k, v, block_mask=bm, enable_gqa=H != KV)), share)
    if args.autotune and T <= 16384:   # torchtitan 0.2.2's FlexAttentionWrapper options
        tuned = torch.compile(flex_attention, options={"max_autotune": True, "coordinate_descent_tuning": True,
                                                       "triton.cudagraphs": False})
        t0 = time.perf_counter()
        run("flex max-autotune (mask built once)",
            lambda: backward(tuned(q, k, v, block_mask=bm, enable_gqa=H != KV)), share)
        print(f"    (max-autotune compile and timing: {time.perf_counter() - t0:.0f} s)")
    varlen = _varlen()
    if varlen is not None:
        vmask = varlen_mask(documents)
        qv, kv_, vv = (t.detach().requires_grad_() for t in (q, k, v))
        run("flash varlen (cu_seqlens built once)", lambda: backward(varlen_attention(varlen, qv, kv_, vv, vmask)),
            share)
    if T > 16384:   # the tiles differ at llama-1B's heads; fp32 flex at 64K takes its slowest tiles
        return rows
    # the shipped tiles compute what torch's default ones do: each against the fp32 flex result
    ref = [t.float().detach().requires_grad_() for t in (q, k, v)]
    outs = {"fp32": _grads(lambda a, b, c: _flex()(a, b, c, block_mask=bm, enable_gqa=H != KV), ref)}
    lo = [t.detach().requires_grad_() for t in (q, k, v)]
    outs["default tiles"] = _grads(lambda a, b, c: _flex()(a, b, c, block_mask=bm, enable_gqa=H != KV), lo)
    outs["shipped"] = _grads(lambda a, b, c: masked_attention(a, b, c, bm), lo)
    for label in ("default tiles", "shipped"):
        errs = [float((x.float() - r).norm() / r.norm()) for x, r in zip(outs[label], outs["fp32"])]
        print(f"  bf16 {label:14s} against fp32: out {errs[0]:.2e}, dq {errs[1]:.2e}, dk {errs[2]:.2e}, "
              f"dv {errs[3]:.2e}")
        rows.append(dict(case=name, variant=f"accuracy, {label}", rel_err_out_dq_dk_dv=errs))
    return rows


def _grads(attend, inputs) -> list[torch.Tensor]:
    """attend's output and the gradients of its inputs under a fixed random output gradient."""
    for t in inputs:
        t.grad = None
    out = attend(*inputs)
    g = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1))
    out.backward(g.to(out.dtype))
    return [out.detach().float()] + [t.grad.float() for t in inputs]


def attention(device, args) -> list[dict]:
    rows = []
    for name, T, B, H, KV, hd in (("llama-1B heads", args.seq, args.batch, 32, 8, 64),
                                  ("llama-617M cp=4 a2a, per rank", args.cp_seq, 1, 4, 4, 128)):
        if args.data:
            documents = data_documents(args.data, T, args.first_sample, B)
        else:
            documents = packed(np.random.default_rng(1), B, T, args.mean_doc, 2)[2][:, :-1]
        rows += attention_case(device, name, documents.to(device), H, KV, hd, args)
        torch.cuda.empty_cache()
    return rows


# ---- 3. a training step ----------------------------------------------------------------

class Varlen(NamedTuple):
    """The document mask as flash varlen attention takes it."""
    cu: torch.Tensor   # each document's first token in the flattened (B * T) batch, then B * T; int32
    max_len: int       # T: an upper bound (no host sync, one compiled graph)


def varlen_mask(documents: torch.Tensor) -> Varlen:
    B, T = documents.shape
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = first.flatten().nonzero().squeeze(1)
    return Varlen(torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32), T)


def varlen_attention(call, q, k, v, mask: Varlen) -> torch.Tensor:
    """(B, H, T, d) q and (B, H_kv, T, d) k, v -> (B, H, T, d), each document causal on its own."""
    B, H, T, d = q.shape
    out = call(*(t.transpose(1, 2).reshape(B * T, t.shape[1], d) for t in (q, k, v)), mask.cu, mask.max_len)
    return out.view(B, T, H, d).transpose(1, 2)


def _varlen_experiment() -> None:
    """--experiment varlen: the document mask on CUDA as flash varlen attention (each
    document a sequence of cu_seqlens over the flattened batch) instead of FlexAttention;
    one GPU only (context parallelism's a2a attention takes the BlockMask)."""
    from meshtron.models.common import documents as docs
    from meshtron.models.llama import model as llama
    call, mask_of, attend = _varlen(), docs.document_mask, docs.masked_attention
    if call is None:
        raise SystemExit("--experiment varlen: this torch has no torch.nn.attention.varlen")

    def document_mask(documents, dense=False):
        return mask_of(documents, dense) if dense or not documents.is_cuda else varlen_mask(documents)

    def masked_attention(q, k, v, mask, dropout_p=0.0):
        return varlen_attention(call, q, k, v, mask) if isinstance(mask, Varlen) else attend(q, k, v, mask, dropout_p)
    docs.document_mask, llama.masked_attention = document_mask, masked_attention


def _default_tiles() -> None:
    """--experiment default-tiles: FlexAttention with torch's default tiles everywhere (before TILES)."""
    from meshtron.models.common import documents as docs
    docs.TILES.clear()


EXPERIMENTS = {"varlen": _varlen_experiment, "default-tiles": _default_tiles}


def train(args, recipe_flags: list[str]) -> dict:
    import torch.distributed as dist

    from meshtron import Config, Trainer, models
    from meshtron.train.lifetime import init_process_group
    from meshtron.train.metrics import peak_tflops
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    for name in filter(None, args.experiment.split(",")):
        EXPERIMENTS[name]()
    init_process_group(600)
    world = dist.get_world_size()
    steps = args.warmup + args.rounds * args.window
    config = Config.from_args(["--dtype", "bf16", "--lr", "1e-4", "--no-shuffle",
                               "--steps", str(steps + args.profile_steps + 1)] + recipe_flags, models=models.PRESETS)
    trainer = Trainer(config, verbose=False)
    device = trainer.device
    T, gb = config.training.seq_len, trainer.global_batch
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
    trace = []
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        trace.append(trainer.step(*trainer.next_batch()))
    sync()
    warmup_s = time.perf_counter() - t0
    rounds = []
    for _ in range(args.rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(args.window):
            trace.append(trainer.step(*trainer.next_batch()))
        sync()
        rounds.append((time.perf_counter() - t0) / args.window)
    step_s = statistics.median(rounds) if rounds else float("nan")
    prof = None
    if args.profile_steps:   # kernel time by kind over further steps (bench_train's profile)
        from bench_train import profile
        tag = f"{config.model.model}_w{world}_{'mask' if config.data.document_mask else 'causal'}{args.experiment}"
        prof = profile(lambda i: trainer.step(*trainer.next_batch()), args.profile_steps, device,
                       os.path.join(args.out, f"profile_{tag}_r{dist.get_rank()}.txt"))
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else float("nan")
    worst = torch.tensor([0.0 if rounds == [] else step_s, mem, reserved], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    step_s, mem, reserved = worst.tolist()
    losses = [round(float(loss), 5) for loss, _ in trace]
    # the timed samples' documents (the data's boundaries, whatever the run's flags), global batches in file order
    from meshtron.data.sources import open_data
    src = open_data(config.data.data, 1 << 20, config.data.tokenizer, documents=True)
    timed_ids = range(args.warmup * gb, steps * gb)
    documents = torch.from_numpy(np.stack([src.documents(i, T)[:-1] for i in timed_ids])) if len(timed_ids) else None
    flops = trainer.model_config.flops_per_token(T)
    tps = gb * T / step_s / world if rounds else float("nan")
    peak = peak_tflops(device) if cuda else None
    result = dict(flags=" ".join(recipe_flags), experiment=args.experiment, model=config.model.model, world=world,
                  seq_len=T, global_batch=gb,
                  step_ms=step_s * 1e3, step_ms_rounds=[r * 1e3 for r in rounds], tokens_per_s_per_gpu=tps,
                  mfu=tps * flops / 1e12 / peak if peak else None, flops_per_token=flops,
                  peak_mem_gib=mem, peak_reserved_gib=reserved, warmup_s=warmup_s,
                  timed_steps=f"{args.warmup + 1}-{steps}", kept_causal_share=kept(documents) if documents is not None
                  else None, mean_doc_tokens_in_timed_samples=None, losses=losses,
                  device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__)
    if prof is not None:
        result["profile"] = prof
    if documents is not None:
        lengths = torch.cat([torch.unique_consecutive(d, return_counts=True)[1] for d in documents])
        result["mean_doc_tokens_in_timed_samples"] = float(lengths.double().mean())   # pieces cut at sample edges
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "documents.jsonl"), "a") as f:
            f.write(json.dumps(result) + "\n")
    trainer.close()
    dist.destroy_process_group()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="1: the flex path against one by one and the dense path")
    p.add_argument("--attention", action="store_true", help="2: attention forward + backward, each variant")
    p.add_argument("--train", action="store_true", help="3: the recipe's step (its flags after --)")
    p.add_argument("--data", default=None, help="a Megatron dataset prefix whose documents --check and "
                   "--attention take (default: lengths 1 + Exp(--mean-doc))")
    p.add_argument("--seq", type=int, default=8192, help="--attention: tokens per sample, llama-1B's heads")
    p.add_argument("--batch", type=int, default=2, help="--attention: samples, llama-1B's heads")
    p.add_argument("--cp-seq", type=int, default=65536, help="--attention: tokens, llama-617M's heads under cp=4")
    p.add_argument("--first-sample", type=int, default=10, help="--attention with --data: the first sample taken")
    p.add_argument("--mean-doc", type=float, default=4096, help="--attention without --data: mean document length")
    p.add_argument("--repeats", type=int, default=10, help="--attention: timed repeats (median)")
    p.add_argument("--autotune", action="store_true", help="--attention: also flex compiled with max-autotune")
    p.add_argument("--warmup", type=int, default=5, help="--train: steps before timing (compilation)")
    p.add_argument("--window", type=int, default=5, help="--train: steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="--train: timed rounds (median)")
    p.add_argument("--profile-steps", type=int, default=0, help="--train: then profile this many steps")
    p.add_argument("--experiment", default="", help=f"--train: comma list of {list(EXPERIMENTS)} (measurements only)")
    p.add_argument("--out", default=".", help="where --train and --attention write their JSON lines")
    args, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.train:
        train(args, rest)
        return
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = True
    if args.check or not args.attention:
        ok = check(device, args.data)
    if args.attention:
        rows = attention(device, args)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), torch=torch.__version__)) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
