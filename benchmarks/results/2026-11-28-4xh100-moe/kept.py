"""The share of causal attention's query-key pairs that the document mask keeps, in the samples
each side of the masked cp4 128K rows trains on (CPU, no GPU):

    .venv/bin/python benchmarks/results/2026-11-28-4xh100-moe/kept.py PREFIX [--seq 131072]

PREFIX: the Megatron dataset meshtron reads (`python -m meshtron.data.prepare .peer/data/c4_test/data.json
--output-prefix PREFIX --tokenizer .peer/tokenizer`). meshtron: bench_train's four batches (steps cycle
over them), file order (`--no-shuffle`, global batch 1), documents from the .idx. torchtitan 0.2.2: its
loader's stream, each document [BOS] + its tokens + [EOS] (meshtron's documents already end in the
end-of-text id, so [BOS] + meshtron's document), cut into windows of seq + 1 in order, re-looped with the
leftover carried; its block_causal mask splits after each EOS of a window's inputs. Steps 6-30 are its
5-step windows after the first logged ones.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from meshtron.data.loader import BatchLoader  # noqa: E402
from meshtron.data.sources import open_data  # noqa: E402
from meshtron.models.common.documents import kept_pairs  # noqa: E402

BOS, EOS = 0, 1   # the kit's tokenizer: <|begin_of_text|>, <|end_of_text|>


def share(lengths) -> float:
    lengths = np.asarray(lengths, dtype=np.float64)
    t = lengths.sum()
    return float((lengths * (lengths + 1)).sum() / (t * (t + 1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--tt-steps", type=int, default=30)
    a = ap.parse_args()
    src = open_data(a.prefix, 1 << 20, None, documents=True)
    loader = BatchLoader(src, a.seq, 1, 0, 1, 1, seed=0, shuffle=False)
    mt = []
    for _ in range(4):
        _, _, docs = loader.next_batch()
        d = docs[:, :-1]
        mt.append(kept_pairs(d))
        print(f"meshtron sample: kept {mt[-1]:.4f}, pieces {int(torch.unique_consecutive(d).numel())}, "
              f"mean piece {a.seq / torch.unique_consecutive(d).numel():,.0f} tokens")
    print(f"meshtron, bench_train's 4 batches: mean kept share {np.mean(mt):.4f}")

    tokens, starts = np.asarray(src.tokens), np.asarray(src.starts)
    ends = list(starts[1:]) + [len(tokens)]
    print(f"data: {len(starts)} documents, {len(tokens):,} tokens, last id of a document: "
          f"{sorted(set(int(tokens[e - 1]) for e in ends))[:3]}")
    stream = np.concatenate([np.concatenate([[BOS], tokens[s:e]]) for s, e in zip(starts, ends)])
    n, per = a.tt_steps * (a.seq + 1), []
    stream = np.tile(stream, n // len(stream) + 1)[:n]
    for step in range(a.tt_steps):
        x = stream[step * (a.seq + 1):(step + 1) * (a.seq + 1)][:-1]
        cut = np.flatnonzero(x == EOS) + 1            # a document ends after each EOS
        bounds = np.concatenate([[0], cut[cut < a.seq], [a.seq]])
        per.append(share(np.diff(bounds)))
    print(f"torchtitan steps 1-{a.tt_steps} kept: " + " ".join(f"{k:.4f}" for k in per))
    print(f"torchtitan steps 6-{a.tt_steps}: mean kept share {np.mean(per[5:]):.4f}; "
          f"steps 11-{a.tt_steps}: {np.mean(per[10:]):.4f}")


if __name__ == "__main__":
    main()
