"""The dry run's collectives equal the planner's under pipeline x TP with sequence
parallelism (issue 57): pp 2 and 4, tp 2 and 4, with and without dp, 1F1B and
interleaved, on the tiny Llama and GPT and on llama-1B. The dry run counted a
pipelined step after its uncounted first one without clearing that step's
gradients: without FSDP (fp32, no dp) SP's norm gradients then arrived Partial
into Replicate ones and their all-reduce over tp never ran. The real step starts
from none (zero_grad), and gloo counts that all-reduce as the planner does."""
import dataclasses
import itertools
import os

import pytest

from meshtron.config import Config
from meshtron.models import PRESETS
from meshtron.planner import dry_run
from meshtron.planner.comm_model import step_collectives
from meshtron.train.layout import resolve_layout

from harness import DryRuns


def _layouts():
    for model, pp, tp, dp, schedule in itertools.product(("llama-tiny", "tiny", "llama-1B"), (2, 4), (2, 4), (1, 2),
                                                         ("1f1b", "interleaved-1f1b")):
        interleaved = schedule != "1f1b"
        if model != "llama-1B" and pp == 4 and interleaved:
            continue   # 4 layers make no 8 stages
        if model == "llama-1B" and not (pp == 4 and interleaved and tp == 4 and dp == 2):
            continue   # 8 s a layout: its deepest split, where every rank holds two stages, on 32 ranks
        if model == "tiny" and dp == 2:
            continue   # the GPT where the bug was, without FSDP; the Llama covers FSDP's bf16 path
        argv = ["--model", model, "--pp", str(pp), "--tp", str(tp), "--dp", str(dp), "--sp",
                "--pp-schedule", schedule, "--global-batch", str(2 * pp * dp), "--micro-batch", "1"]
        if model != "llama-1B" and dp == 1:   # no FSDP: the path without it; else the dry run's default, bf16
            argv += ["--dtype", "fp32"]
        yield pp * tp * dp, argv + (["--pp-virtual", "2"] if interleaved else []) + ["--seq-len", "16"]
    # the command at fp32, where it differed
    yield 4, ["--model", "llama-1B", "--pp", "2", "--tp", "2", "--sp", "--seq-len", "2048", "--micro-batch", "4",
              "--global-batch", "32", "--dtype", "fp32"]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA = ["--steps", "1", "--max-norm", "1.0"]


@pytest.fixture(scope="module")
def dry_counts(request):
    """(world, argv) -> {rank: the dry run's collectives} for the first and the last rank (the first
    stage and the last, where the embedding and the head sit) of every layout this session tests,
    resolved as on the GPU run they stand for (the llama-1B layouts take seconds a rank)."""
    tested = [(item.callspec.params["world"], item.callspec.params["argv"] + EXTRA) for item in request.session.items
              if "dry_counts" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")]
    runs = DryRuns([(world, argv, [0, world - 1], "cuda") for world, argv in tested], ROOT)
    yield lambda world, argv: {rank: counted for rank, (_, counted) in runs(world, argv).items()}
    runs.close()


@pytest.mark.parametrize("world,argv", list(_layouts()), ids=lambda v: " ".join(v).replace("--", "")
                         if isinstance(v, list) else str(v))
@pytest.mark.fast_cases("4-model tiny pp 2 tp 2 dp 1 sp pp-schedule 1f1b global-batch 4 micro-batch 1 dtype fp32 "
                        "seq-len 16")
def test_the_dry_runs_collectives_equal_the_planners_under_pipeline_tp_and_sp(dry_counts, world, argv):
    # the dry run's own resolution: the run it stands for is a GPU one
    config = Config.from_args(argv + EXTRA, models=PRESETS).on_device("cuda")
    spec, cfg, degrees, microbatches, _ = resolve_layout(config, world)
    par, tr = dataclasses.replace(config.parallel, **degrees), config.training
    for rank, counted in dry_counts(world, argv + EXTRA).items():
        _, planned = step_collectives(spec, cfg, par, tr.micro_batch, microbatches, tr.seq_len, rank, device="cpu")
        assert counted == planned, f"rank {rank}: {dry_run.differences(counted, planned)}"


def test_a_difference_prints_only_its_entries_with_both_values():
    counted = {("all_reduce", "tp"): 4, ("all_gather", "tp"): 10, ("send", "pp"): 2}
    planned = {("all_reduce", "tp"): 163_844, ("all_gather", "tp"): 10, ("all_to_all", "ep"): 8}
    assert dry_run.differences(counted, planned) == (
        "all_reduce over tp: dry run 4, planner 163,844; all_to_all over ep: dry run none, planner 8; "
        "send over pp: dry run 2, planner none")
    assert dry_run.differences(counted, planned, [("all_to_all", "ep"), ("send", "pp")]) == \
        "all_reduce over tp: dry run 4, planner 163,844"
    assert dry_run.differences({"grads": 1}, {"grads": 2}) == "grads: dry run 1, planner 2"
