"""What a run leaves behind besides the model: evaluation on held-out data at any
layout, TensorBoard event files, and the plot of one or several runs."""
import json
import os

import pytest

from harness import train

ARGS = ["--model", "tiny", "--seq-len", "32", "--steps", "4", "--log-interval", "2", "--global-batch", "8",
        "--eval-interval", "2", "--eval-steps", "2", "--lr", "3e-3"]


def evals(path):
    return [r for r in map(json.loads, open(path)) if "eval_loss" in r]


@pytest.mark.slow
def test_eval_loss_is_the_same_under_every_layout(pools, tmp_path):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read())
    runs = {"one": (1, ["--micro-batch", "8"]), "dp2": (2, ["--dp", "2", "--zero", "3", "--micro-batch", "4"]),
            "tp2 sp": (2, ["--tp", "2", "--sp", "--micro-batch", "8"]),
            "pp2": (2, ["--pp", "2", "--microbatches", "4", "--micro-batch", "2"]),
            "cp2": (2, ["--cp", "2", "--micro-batch", "8"])}
    got = {}
    for name, (world, flags) in runs.items():
        path = tmp_path / f"{name}.jsonl"
        pools.run(world, train, ARGS + flags + ["--eval-data", str(held_out), "--metrics-file", str(path)])
        got[name] = evals(path)
    ref = got.pop("one")
    assert [r["step"] for r in ref] == [2, 4] and ref[1]["eval_loss"] < ref[0]["eval_loss"]
    for name, rows in got.items():
        for r, q in zip(rows, ref):
            assert r["eval_loss"] == pytest.approx(q["eval_loss"], rel=1e-5), name
            assert r["eval_ppl"] == pytest.approx(q["eval_ppl"], rel=1e-5), name


def test_tensorboard_and_plot(pools, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from meshtron.plot import main as plot
    paths = []
    for lr in ("3e-3", "1e-3"):
        path = tmp_path / f"lr{lr}.jsonl"
        pools.run(1, train, ARGS + ["--lr", lr, "--metrics-file", str(path), "--tensorboard", str(tmp_path / lr),
                                    "--eval-data", os.path.join(os.path.dirname(__file__), "..", "README.md")])
        paths.append(str(path))
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / lr))
    plot(paths + ["-o", str(tmp_path / "curves.png")])
    with open(tmp_path / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_evaluation_right_before_a_checkpoint_at_zero1(pools, tmp_path):
    # zero 1 keeps weights gathered after a forward until the backward; evaluation has none,
    # so the modules must be resharded or the checkpoint sees tensors the optimizer does not own
    readme = os.path.join(os.path.dirname(__file__), "..", "README.md")
    argv = ARGS + ["--dp", "2", "--zero", "1", "--micro-batch", "4", "--eval-data", readme, "--checkpoint-dir",
                   str(tmp_path / "ck"), "--checkpoint-interval", "2"]
    straight = pools.run(2, train, ARGS + ["--dp", "2", "--zero", "1", "--micro-batch", "4"])[0]
    first = pools.run(2, train, argv, 2)[0]
    second = pools.run(2, train, argv + ["--resume", "auto"])[0]
    assert first + second == pytest.approx(straight, rel=1e-5)


@pytest.mark.parametrize("flags,says", [
    ([], "fp32 compute, fp32 master weights, fp32 gradient reduction"),
    (["--fp8", "tensorwise"], "bf16 compute with FP8 matmuls (tensorwise, emulated on the CPU)"),
])
def test_the_start_up_line_names_the_compute_dtype(flags, says):
    pytest.importorskip("torchao") if flags else None
    from harness import run_script
    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "train.py")
    r = run_script([recipe, *ARGS[:6], "--steps", "1", "--micro-batch", "8", *flags])
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("meshtron |"))
    assert f"| {says}" in line, line


def test_the_start_up_line_says_micro_batch_in_the_singular_for_one():
    # issue 57, point 6: "1 micro-batch of 8", not "1 micro-batches of 8"
    from harness import run_script
    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "train.py")
    for micro, says in (("8", ", 1 micro-batch of 8 |"), ("4", ", 2 micro-batches of 4 |")):
        r = run_script([recipe, *ARGS[:6], "--steps", "1", "--global-batch", "8", "--micro-batch", micro])
        assert r.returncode == 0, r.stderr
        line = next(line for line in r.stdout.splitlines() if line.startswith("meshtron |"))
        assert says in line, line
