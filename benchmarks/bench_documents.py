"""Packed documents on one GPU: is the FlexAttention path right, and what does the
mask save in attention?

    python benchmarks/bench_documents.py [--seq 8192] [--mean-doc 1024]

1. Right: a small Llama (fp32) on a packed batch with the document mask and
   per-document positions (the BlockMask path) against the same documents run one
   by one, and against the dense-mask path (SDPA): loss and gradients, relative.
2. Speed: llama-1B's attention (32 query heads, 8 KV heads of 64, bf16) at --seq
   tokens, documents of exponentially distributed lengths with mean --mean-doc:
   forward + backward of FlexAttention with the document BlockMask (its creation
   included) against SDPA's causal kernel (the peer: stock PyTorch), medians of
   --repeats. The mask leaves sum(L_i^2)/2 of T^2/2 causal score entries.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

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


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def check(device) -> None:
    cfg = LlamaConfig(n_layers=2, dim=128, n_heads=8, n_kv_heads=4, ffn_dim=256, vocab_size=512, max_seq_len=512,
                      rope_theta=1e4, fused_kernels=False)
    model = Llama(cfg, seed=0).to(device)
    x, y, documents = (t.to(device) for t in packed(np.random.default_rng(0), 2, 256, 40.0, cfg.vocab_size))
    y, inputs = document_inputs(documents, y, mask=True, positions=True, eod_mask_loss=True, ignore_index=IGNORE_INDEX)
    count = (y != IGNORE_INDEX).sum()

    def packed_loss(dense: bool):
        if dense:   # the CPU's path on this GPU: SDPA with the boolean mask
            model.document_mask.dense = True
        try:
            logits = model(x, **inputs)
        finally:
            model.document_mask.dense = False
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / count

    total = 0.0
    for b in range(x.shape[0]):
        for d in inputs["documents"][b].unique():
            idx = (inputs["documents"][b] == d).nonzero().squeeze(1)
            total = total + F.cross_entropy(model(x[b:b + 1, idx])[0].float(), y[b, idx], ignore_index=IGNORE_INDEX,
                                            reduction="sum")
    ref = total / count
    g_ref = grads_of(model, ref)
    for name, dense in (("flex BlockMask", False), ("SDPA dense mask", True)):
        loss = packed_loss(dense)
        g = grads_of(model, loss)
        print(f"{name:16s} vs one by one: loss {abs(float(loss - ref)) / float(ref):.2e}, "
              f"gradients {float((g - g_ref).norm() / g_ref.norm()):.2e}")


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


def speed(device, T: int, mean: float, repeats: int) -> None:
    H, KV, hd = 32, 8, 64
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, H, T, hd, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, KV, T, hd, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    documents = packed(np.random.default_rng(1), 1, T, mean, 2)[2][:, :-1].to(device)
    lengths = torch.bincount(documents[0]).double()
    kept = float((lengths * (lengths + 1) / 2).sum() / (T * (T + 1) / 2))

    def causal():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    def masked():
        out = masked_attention(q, k, v, block_mask(documents))
        out.backward(torch.ones_like(out))

    t_causal, t_masked = timed(causal, repeats), timed(masked, repeats)
    print(f"attention fwd+bwd, T={T}, {len(lengths)} documents (mean {T / len(lengths):.0f} tokens), the mask "
          f"keeps {100 * kept:.1f}% of causal scores: SDPA causal {t_causal * 1e3:.2f} ms, flex document mask "
          f"{t_masked * 1e3:.2f} ms (mask built each call): {t_causal / t_masked:.2f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192, help="tokens per sample")
    p.add_argument("--mean-doc", type=float, default=1024, help="mean document length")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats (median)")
    a = p.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    check(device)
    for mean in (a.mean_doc, a.mean_doc * 4):
        speed(device, a.seq, mean, a.repeats)


if __name__ == "__main__":
    main()
