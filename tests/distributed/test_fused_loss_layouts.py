"""The fused head + cross-entropy under parallel layouts against one plain process:
the reference runs F.cross_entropy on whole logits (the unfused path), the layout
runs meshtron.train.loss.FusedLoss (the model returns hidden states, the loss does the
head's matmul chunk by chunk, with chunks that do not divide the tokens). Same
loss, gathered gradients and updated weights over three AdamW steps, with ignored
labels spread over the batch: loss parallel at tp2 (the head split over the
vocabulary, one all-gather per chunk), tp2 with sequence parallelism, dp2 under
FSDP (the head's weight as FSDP's root holds it after the forward), pp2 with the
head on the last stage (tied: its copy of the embedding), and dp2 x tp2 + SP."""
import json
import os

import pytest

from meshtron import ParallelConfig
from meshtron.distributed.pipeline_parallel import split_model
from meshtron.models import GPT, gpt, gpt_config
from meshtron.train.loss import IGNORE_INDEX, FusedLoss, output_head

from harness import mesh, train
from parity import assert_parity, run_parity, tiny_batches

CHUNK = 7   # tokens per chunk: divides no micro-batch's token count here


def batches(vocab: int):
    out = []
    for i, (x, y) in enumerate(tiny_batches(vocab, steps=3, batch=8, seq=16)):
        y = y.clone()
        y[0, :11] = IGNORE_INDEX
        y[3 + i % 4, 4:] = IGNORE_INDEX
        out.append((x, y))
    return out


def _flat(pcfg, fb):
    def apply(model, me):
        gpt.SPEC.parallelize(model, me, pcfg)
        fb["loss_fn"] = FusedLoss(output_head([model]), chunk=CHUNK)
        return model
    return apply


def _pipelined(pcfg, cfg):
    def apply(model, me):
        pipe = split_model(model, me, "1f1b", 1, 4, gpt.SPEC.pipeline_split(cfg, 2))
        for part in pipe.parts:
            gpt.SPEC.parallelize(part, me, pcfg)
        head = output_head(pipe.parts)
        loss_fn = FusedLoss(head, chunk=CHUNK) if pipe.has_last else None
        assert (head is not None) == pipe.has_last   # the head lives on the last stage only
        pipe.build_schedule(loss_fn, stage_kwargs={"return_hidden": True})
        return pipe
    return apply


def _parity(rank, world, degrees, pcfg_kwargs, tied, pipelined):
    cfg = gpt_config("tiny", n_layers=2, tie_embeddings=tied)
    me, pcfg = mesh(**degrees), ParallelConfig(**pcfg_kwargs)
    fb = {"zero": pcfg.zero}
    par = _pipelined(pcfg, cfg) if pipelined else _flat(pcfg, fb)
    return run_parity(me, lambda: GPT(cfg, seed=0), par, batches(cfg.vocab_size), micro_batches=1 if pipelined else 2,
                      fb_kwargs=fb, max_norm=0.5)


CASES = [  # (world, mesh, parallel config, tied head, pipeline)
    (2, dict(dp=1, tp=2), dict(loss_parallel=True), True, False),
    (2, dict(dp=1, tp=2), dict(sp=True), False, False),
    (2, dict(dp=2), dict(zero=3), True, False),
    (2, dict(dp=1, pp=2), {}, True, True),
    (2, dict(dp=1, pp=2), {}, False, True),
    (4, dict(dp=2, tp=2), dict(sp=True, zero=3), True, False),
]


@pytest.mark.parametrize("world,degrees,pcfg,tied,pipelined", CASES,
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in c[1].items())}-{'sp-' if c[2].get('sp') else ''}"
                              f"{'tied' if c[3] else 'untied'}" for c in CASES])
@pytest.mark.fast_cases("dp1xtp2-tied", "dp2-tied", "dp1xpp2-tied")
def test_fused_loss_matches_one_plain_process(pools, world, degrees, pcfg, tied, pipelined):
    report = assert_parity(pools.run(world, _parity, degrees, pcfg, tied, pipelined, timeout=300), tol=1e-5)
    print(f"worst: loss {report.loss:.2e} grad {report.grad:.2e} param {report.param:.2e}")


RECIPE = ["--model", "tiny", "--seq-len", "32", "--steps", "4", "--log-interval", "1", "--global-batch", "8",
          "--eval-interval", "2", "--eval-steps", "2", "--lr", "3e-3", "--warmup", "2"]


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_recipe_with_fused_loss_matches_the_unfused_one_process(pools, tmp_path):
    """--fused-loss through the trainer (the model's forward with return_hidden, the
    pipeline's last stage shapes and kwargs, evaluation) gives the unfused one
    process' training and held-out losses and gradient norms."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read())
    runs = {"one unfused": (1, ["--micro-batch", "8", "--no-fused-loss"]),
            "one": (1, ["--micro-batch", "8"]),
            "tp2 sp": (2, ["--tp", "2", "--sp", "--micro-batch", "4"]),
            "pp2": (2, ["--pp", "2", "--microbatches", "4", "--micro-batch", "2"])}
    got = {}
    for name, (world, flags) in runs.items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        fused = [] if "unfused" in name else ["--fused-loss"]
        pools.run(world, train, RECIPE + flags + fused + ["--eval-data", str(held_out), "--metrics-file", str(path)],
                  timeout=600)
        got[name] = _rows(path)
    ref = got.pop("one unfused")
    assert len([r for r in ref if "loss" in r]) == 4 and len([r for r in ref if "eval_loss" in r]) == 2
    for name, rows in got.items():
        assert len(rows) == len(ref), name
        for r, q in zip(rows, ref):
            for key in ("loss", "grad_norm", "eval_loss"):
                if key in q:
                    assert r[key] == pytest.approx(q[key], rel=1e-5), (name, key, r, q)
