"""The recipe as a user runs it: the tiny GPT with tied embeddings gives the same
per-step losses (full precision, read from --metrics-file) at one process and
under every layout, and a checkpoint saved under any layout resumes under any
other with the losses of an uninterrupted run."""
import json

import pytest

from harness import train

COMMON = ["--seq-len", "32", "--global-batch", "8", "--log-interval", "1", "--warmup", "2",
          "--seed", "3", "--lr", "3e-3"]
LAYOUTS = {  # name: (world, flags)
    "one process": (1, ["--micro-batch", "8"]),
    "dp2 zero0": (2, ["--dp", "2", "--zero", "0", "--micro-batch", "2"]),
    "dp2 zero1": (2, ["--dp", "2", "--zero", "1", "--micro-batch", "2"]),
    "dp2 zero2": (2, ["--dp", "2", "--zero", "2", "--micro-batch", "2"]),
    "dp2 zero3": (2, ["--dp", "2", "--zero", "3", "--micro-batch", "4"]),
    "tp2": (2, ["--tp", "2", "--micro-batch", "8"]),
    "tp2 sp": (2, ["--tp", "2", "--sp", "--micro-batch", "4"]),
    "pp2 1f1b": (2, ["--pp", "2", "--microbatches", "4", "--micro-batch", "2"]),
    "pp2 interleaved": (2, ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2",
                            "--microbatches", "4", "--micro-batch", "2"]),
    "pp2 x tp2, dp1": (4, ["--pp", "2", "--tp", "2", "--sp", "--dp", "1", "--microbatches", "2", "--micro-batch", "4"]),
    "dp2 x pp2 x tp2": (8, ["--dp", "2", "--pp", "2", "--tp", "2", "--sp", "--zero", "3", "--microbatches", "2",
                            "--micro-batch", "2"]),
}
TOL = 1e-5   # relative, fp32; AdamW (eps 1e-8) turns rounding in near-zero gradient entries into ~1e-6 weight changes


def metrics(path) -> dict[int, dict]:
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def run(pools, name, tmp_path, *extra, exit_after=None, tag="", model="tiny"):
    world, flags = LAYOUTS[name]
    path = tmp_path / f"{model}-{name.replace(' ', '_')}{tag}.jsonl"
    argv = ["--model", model] + COMMON + flags + ["--metrics-file", str(path)] + list(extra)
    returned = pools.run(world, train, argv, exit_after, timeout=600)[0]
    return returned, metrics(path)


@pytest.mark.parametrize("model,layouts", [("tiny", list(LAYOUTS)),
                                           ("llama-tiny", ["dp2 zero3", "tp2", "tp2 sp", "pp2 1f1b", "pp2 x tp2, dp1",
                                                          "dp2 x pp2 x tp2"])])
@pytest.mark.slow
def test_recipe_losses_do_not_depend_on_the_layout(pools, tmp_path, model, layouts):
    ref_returned, ref = run(pools, "one process", tmp_path, "--steps", "4", model=model)
    assert [ref[s]["loss"] for s in sorted(ref)] == ref_returned          # the file holds the full-precision losses
    for name in layouts:
        _, got = run(pools, name, tmp_path, "--steps", "4", model=model)
        assert sorted(got) == [1, 2, 3, 4], (name, sorted(got))
        for s in got:
            assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=TOL), (name, s, got[s]["loss"], ref[s]["loss"])
            assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=TOL), (name, s)


@pytest.mark.slow
def test_a_checkpoint_resumes_under_any_other_layout(pools, tmp_path):
    """One step under each layout in turn, each resuming the previous one's
    checkpoint: every layout saves once and loads once (dp/ZeRO, TP, SP, pipelines
    with a tied head copy on the last stage, 3-D), against one straight run."""
    names = list(LAYOUTS)
    steps = str(len(names))
    straight, _ = run(pools, "one process", tmp_path, "--steps", steps, tag="straight")
    ck = tmp_path / "ck"
    chained = []
    for i, name in enumerate(names):
        resume = ["--resume", "auto"] if i else []
        losses, _ = run(pools, name, tmp_path, "--steps", steps, "--checkpoint-dir", str(ck),
                        "--checkpoint-interval", "1", "--keep-checkpoints", "2", *resume, exit_after=1, tag="chain")
        chained += losses
    assert chained == pytest.approx(straight, rel=TOL), list(zip(names, chained, straight))
