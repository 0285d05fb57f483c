"""Bad input is one clear sentence, raised on every rank before anything runs
(never a hang, never a crash inside gloo, never a silent wrong run), and the
recipe prints it once and exits non-zero."""
import json
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch.distributed as dist

from meshtron.data import load_tokens, write_token_file
from meshtron.distributed.agree import agree

from harness import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "tiny", "--seq-len", "32", "--steps", "2", "--micro-batch", "2"]


def _expect_error(rank, world, argv, exit_after=None):
    """(the error's type, its message, whether every rank found it, whether the mesh, the
    first thing that communicates, was built before it)."""
    from meshtron.train import trainer
    built = []
    init_mesh = trainer.init_mesh
    with mock.patch.object(trainer, "init_mesh", lambda **degrees: built.append(1) or init_mesh(**degrees)):
        try:
            train(rank, world, argv, exit_after)
        except (ValueError, OSError) as e:
            return type(e).__name__, str(e), getattr(e, "all_ranks", False), bool(built)
    return None


def error(pools, world, argv, exit_after=None, before_mesh=True):
    """The error every rank raised; the pool must still be healthy afterwards. `before_mesh`:
    raised before the mesh was built (no collective but the ranks' agreement ran)."""
    results = pools.run(world, _expect_error, argv, exit_after, timeout=60)
    assert all(r is not None for r in results), results
    assert len({r[1] for r in results}) == 1, results             # the same message on every rank
    assert all(r[2] for r in results)                              # marked as found on every rank
    assert not before_mesh or not any(r[3] for r in results), results
    return results[0][1]


CASES = {  # (world, argv, message) -- issue 11, points 4, 5, 7, 8
    "cp and the sequence": (2, ["--cp", "2", "--seq-len", "30"],
                            "cp=2 needs the sequence length 30 to be divisible by 2*cp=4"),
    "ep without experts": (2, ["--ep", "2"], "ep=2 needs a mixture-of-experts model whose expert count it divides "
                                             "(this model has 0 experts)"),
    "moe option on a dense model": (1, ["--moe-capacity", "1.0"], "--moe-capacity applies to mixture-of-experts"),
    "negative batch balance": (1, ["--model", "llama-moe-tiny", "--moe-batch-balance", "-1"],
                               "--moe-batch-balance is a number of rounds (0: off), not -1"),
    "sp without tp": (1, ["--sp"], "--sp (sequence parallelism) shards the sequence over tp ranks: it needs --tp > 1"),
    "steps 0": (1, ["--steps", "0"], "--steps must be at least 1, not 0"),
    "steps -5": (1, ["--steps", "-5"], "--steps must be at least 1, not -5"),
    "resume auto without dir": (1, ["--resume", "auto"], "--resume auto looks for checkpoints in --checkpoint-dir"),
    "keep 0": (1, ["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1, not 0"),
    "async save without dir": (2, ["--checkpoint-async"], "--checkpoint-async writes the checkpoints of "
                                                          "--checkpoint-dir in the background: give one"),
    "seq-len 0": (1, ["--seq-len", "0"], "--seq-len must be at least 1, not 0"),
    "micro-batch 0": (1, ["--micro-batch", "0"], "--micro-batch must be at least 1, not 0"),
    "log-interval 0": (1, ["--log-interval", "0"], "--log-interval must be at least 1, not 0"),
    "checkpoint-interval 0": (1, ["--checkpoint-interval", "0"], "--checkpoint-interval must be at least 1, not 0"),
    "sp with an odd sequence": (2, ["--tp", "2", "--sp", "--seq-len", "127"],
                                "sequence parallelism splits the sequence over tp=2 ranks: --seq-len 127 must be "
                                "divisible by 2"),
    "sp with seq 33": (2, ["--tp", "2", "--sp", "--seq-len", "33"], "--seq-len 33 must be divisible by 2"),
    "mesh and world": (4, ["--tp", "3"], "pp*cp*tp*ep = 1*1*3*1 = 3 does not divide the world size 4"),
    "unknown schedule pieces": (2, ["--pp", "2", "--microbatches", "1"], "needs at least pp=2 micro-batches, got 1"),
    "global batch": (2, ["--dp", "2", "--global-batch", "5"], "--global-batch 5 must be a multiple of"),
    "cuda graphs without compile": (1, ["--cuda-graphs"], "--cuda-graphs records the compiled blocks as CUDA "
                                                          "graphs: it needs --compile"),
    "cuda graphs on CPUs": (2, ["--dp", "2", "--compile", "--cuda-graphs"],
                            "--cuda-graphs records CUDA graphs: it needs GPUs, and this run's devices are CPUs"),
    "cuda graphs and zero 3": (2, ["--dp", "2", "--zero", "3", "--compile", "--cuda-graphs"],
                               "with --zero 3 would hold every block's gathered weights: use --zero 2"),
    "copy-engine collectives on CPUs": (2, ["--model", "llama-tiny", "--tp", "2", "--sp", "--tp-overlap",
                                            "--tp-overlap-comm", "copy-engine"],
                                        "--tp-overlap-comm copy-engine moves the reduce-scatter with CUDA copy "
                                        "engines over symmetric memory: it needs CUDA, not cpu"),
    "chunked tp overlap without sp": (2, ["--model", "llama-tiny", "--tp", "2", "--tp-overlap", "--tp-overlap-comm",
                                          "chunked"], "--tp-overlap-comm chunked chooses the collective of "
                                                      "--tp-overlap under --sp: it needs --tp-overlap and --sp"),
    "chunked tp overlap and rowwise fp8": (2, ["--model", "llama-tiny", "--tp", "2", "--sp", "--tp-overlap",
                                               "--tp-overlap-comm", "chunked", "--fp8", "rowwise"],
                                           "--tp-overlap-comm chunked with --fp8 rowwise is not supported"),
    "chunked tp overlap and cuda graphs": (2, ["--model", "llama-tiny", "--tp", "2", "--sp", "--tp-overlap",
                                               "--tp-overlap-comm", "chunked", "--compile", "--cuda-graphs"],
                                           "--tp-overlap-comm chunked with --cuda-graphs is not supported"),
    "chunked tp overlap on the GPT": (2, ["--tp", "2", "--sp", "--tp-overlap", "--tp-overlap-comm", "chunked"],
                                      "--tp-overlap-comm chunked cuts the Llama's local-tensor blocks"),
    "chunked tp overlap on MoE blocks": (2, ["--model", "llama-moe-tiny", "--tp", "2", "--sp", "--tp-overlap",
                                             "--tp-overlap-comm", "chunked"],
                                         "mixture-of-experts blocks keep the DTensor styles"),
    "two-batch with an odd micro-batch": (2, ["--model", "llama-moe-tiny", "--ep", "2", "--moe-two-batch",
                                              "--micro-batch", "3"],
                                          "--moe-two-batch splits each micro-batch into two halves of whole "
                                          "sequences: --micro-batch 3 must be even"),
    "two-batch without experts": (2, ["--ep", "2", "--moe-two-batch"], "--moe-two-batch overlaps the all-to-alls "
                                                                      "of mixture-of-experts blocks: this model "
                                                                      "has none"),
    "two-batch without ep": (1, ["--model", "llama-moe-tiny", "--moe-two-batch"], "it needs --ep > 1"),
    "two-batch and compile": (2, ["--model", "llama-moe-tiny", "--ep", "2", "--moe-two-batch", "--compile"],
                              "--moe-two-batch with --compile (and so --cuda-graphs) is not supported"),
    "two-batch and tp": (2, ["--model", "llama-moe-tiny", "--tp", "2", "--moe-two-batch"],
                         "--moe-two-batch with --tp 2 is not supported"),
    "split backward and zero 3": (4, ["--dp", "2", "--pp", "2", "--pp-schedule", "zbv", "--pp-virtual", "2",
                                      "--zero", "3"], "--pp-schedule zbv computes weight gradients outside FSDP's"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_arguments_are_one_clear_error_on_every_rank(pools, case):
    world, argv, message = CASES[case]
    assert message in error(pools, world, TINY + argv)


def test_bad_test_hook_values_are_errors(pools):
    # a test hook, read once the run is built
    assert "exit_after must be at least 1, not 0" in error(pools, 1, TINY, exit_after=0, before_mesh=False)


def test_data_problems_name_the_file(pools, tmp_path):
    # issue 11, points 3, 5, 8: out-of-vocabulary ids, a directory of token files, empty and odd-sized files
    oov = tmp_path / "oov.u16"
    write_token_file(str(oov), np.concatenate([np.arange(1000) % 300, [4000], np.arange(100)]))
    msg = error(pools, 2, TINY + ["--tp", "2", "--data", str(oov)])
    assert str(oov) in msg and "token id 4000" in msg and "vocabulary size 320" in msg and "position 1000" in msg
    (tmp_path / "shards").mkdir()
    write_token_file(str(tmp_path / "shards" / "a.u16"), np.arange(100))
    assert "is a directory holding token files (a.u16)" in error(pools, 1, TINY + ["--data", str(tmp_path / "shards")])
    empty = tmp_path / "empty.u16"
    empty.write_bytes(b"")
    assert f"token file {empty} is empty" in error(pools, 1, TINY + ["--data", str(empty)])
    odd = tmp_path / "odd.u16"
    odd.write_bytes(b"\x01\x00\x02")
    assert f"token file {odd} has 3 bytes, not a whole number of uint16 tokens" in error(
        pools, 1, TINY + ["--data", str(odd)])


def test_out_of_vocabulary_ids_are_caught_at_load(tmp_path):
    path = str(tmp_path / "t.u32")
    write_token_file(path, [1, 2, 500, 3])
    with pytest.raises(ValueError, match="token id 500 .* not below the model's vocabulary size 320; pass "
                                         "--vocab-size 501 or more"):
        load_tokens(path, 320)
    assert list(load_tokens(path, 501)) == [1, 2, 500, 3]


def _one_rank_fails(rank, world):
    try:
        with agree():
            if rank == world - 1:
                raise FileNotFoundError(f"rank {rank} cannot read /data/shard-{rank}")
    except FileNotFoundError as e:
        return str(e).split("\n")[0], e.all_ranks
    return None


def test_a_problem_one_rank_finds_stops_every_rank_with_its_message(pools):
    # issue 11, point 9: the others do not wait in a collective until the timeout
    results = pools.run(4, _one_rank_fails, timeout=30)
    assert results == [("rank 3 cannot read /data/shard-3", True)] * 4
    assert pools.run(4, _all_reduce_ok) == [True] * 4                # and the ranks are still in step


def _all_reduce_ok(rank, world):
    import torch
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == world


def _run_recipe(args, nproc=None, env=None, launcher="torch.distributed.run"):
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "train.py")] if nproc is None else \
        [sys.executable, "-m", launcher, "--nproc-per-node", str(nproc), "--standalone",
         os.path.join(ROOT, "recipes", "train.py")]
    return subprocess.run(cmd + args, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_the_recipe_prints_one_line_once_and_exits_non_zero():
    # issue 11, point 11: one process, then 4 ranks under torchrun
    out = _run_recipe(TINY + ["--tp", "2", "--sp"])
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "error: pp*cp*tp*ep = 1*1*2*1 = 2 does not divide the world size 1: this is one process; start 2 ranks "
        "(or a multiple) with the launcher in front of the same command, meshtron-run --nproc-per-node 2 SCRIPT "
        "FLAGS"], out.stderr
    out = _run_recipe(TINY + ["--tp", "2", "--sp", "--seq-len", "127"], nproc=4)
    assert out.returncode != 0
    ours = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: sequence parallelism splits the sequence over tp=2 ranks: --seq-len 127 must be "
                    "divisible by 2"], out.stderr
    assert "[rank" not in out.stderr and "meshtron" not in out.stderr.split("ChildFailedError")[0].replace(
        "error: ", ""), out.stderr          # no traceback of ours, no per-rank copies
    assert out.stderr.count("must be divisible by 2") <= 2    # ours, and torchrun's one-entry summary


@pytest.mark.parametrize("bad,message", [
    (["--zero", "4"], "error: argument --zero: invalid choice: 4 (choose from 0, 1, 2, 3) (see --help)"),
    (["--steps", "two"], "error: argument --steps: invalid int value: 'two' (see --help)")])
@pytest.mark.slow
def test_a_command_line_mistake_under_the_launcher_is_one_line_once(bad, message):
    # issue 36, point 1: not argparse's usage block on every rank and a summary that names nothing. The
    # README's launcher, meshtron-run (torchrun's agent), ends in one line naming the failure; plain
    # torchrun prints the same error once, then its own traceback and summary box (tested above)
    out = _run_recipe(["--model", "tiny", *bad], nproc=2, launcher="meshtron.launch")
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    # issue 57, point 6: the rank's error file carries its message to the launcher's line, which alone prints it
    assert lines == [f"meshtron-run: {os.path.join(ROOT, 'recipes', 'train.py')} failed on rank 0 "
                     f"(exit code 1): {message}"], out.stderr


# `python recipes/train.py ARGS`, which at its end says whether torch was imported: the recipe ends
# by os._exit (lifetime.one_line_errors), which runs no `finally` and no atexit, so the line is printed there
_SAYS_IMPORTS = ("import os, runpy, sys\n"
                 "_exit = os._exit\n"
                 "def say_and_exit(code):\n"
                 "    print('imported:', 'torch' in sys.modules, 'torch.distributed' in sys.modules, flush=True)\n"
                 "    _exit(code)\n"
                 "os._exit = say_and_exit\n"
                 "sys.argv = sys.argv[1:]\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _run_recipe_saying_imports(args):
    return subprocess.run([sys.executable, "-c", _SAYS_IMPORTS, os.path.join(ROOT, "recipes", "train.py"), *args],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("bad,message", [
    (["--zero", "4"], "error: argument --zero: invalid choice: 4 (choose from 0, 1, 2, 3) (see --help)"),
    (["--model", "gpt5"], "error: argument --model: invalid choice: 'gpt5' (choose from 'tiny', '125M',"),
    (["--steps", "0"], "error: --steps must be at least 1, not 0"),
    (["--tp", "2"], "error: pp*cp*tp*ep = 1*1*2*1 = 2 does not divide the world size 1: this is one process"),
    # issue 57, point 6: how to start the ranks, not a --dp that fits one process
    (["--dp", "2"], "error: mesh dp*pp*cp*tp*ep = 2*1*1*1*1 = 2 does not equal the world size 1: this is one "
                    "process; start 2 ranks with the launcher in front of the same command, meshtron-run "
                    "--nproc-per-node 2 SCRIPT FLAGS"),
])
def test_a_command_line_mistake_is_reported_before_torch_is_imported(bad, message):
    # issue 44: importing torch takes seconds on every rank, which a mistake in the flags (argparse's,
    # or Config.validate's against the world size) need not wait for
    out = _run_recipe_saying_imports(TINY + bad)
    assert out.returncode == 1 and out.stdout == "imported: False False\n", (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr


def test_a_good_command_trains_after_the_check():
    out = _run_recipe_saying_imports(TINY)
    assert out.returncode == 0, out.stderr
    assert "done: 2 steps" in out.stdout and out.stdout.endswith("imported: True True\n"), out.stdout


def test_a_resume_at_another_default_global_batch_says_why_once_and_what_to_pass(pools, tmp_path):
    # the default global batch is --micro-batch x the data-parallel ranks: dp2 makes 4, tp2 on the same
    # two ranks 2. One line, the launcher's, with rank 0's message (every rank found it).
    ck = str(tmp_path / "ck")
    pools.run(2, train, TINY + ["--dp", "2", "--checkpoint-dir", ck, "--checkpoint-interval", "2"])
    out = _run_recipe(TINY + ["--tp", "2", "--checkpoint-dir", ck, "--resume", "auto"], nproc=2,
                      launcher="meshtron.launch")
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtron-run: "), out.stderr
    message = lines[0].split(" (exit code 1): ", 1)[1]
    assert message.startswith("error: the checkpoint's data position is 2 batches of 4 x 32 tokens; this run uses "
                              "2 x 32 (the default: --micro-batch 2 x 1 data-parallel rank (dp x ep), so the other "
                              "axes' degrees change it), which cannot continue the same sample order: pass "
                              "--global-batch 4 to continue it, or --data-rebatch"), lines[0]


def test_metrics_file_has_one_json_line_per_logged_step_and_appends_on_resume(pools, tmp_path):
    # issue 11, point 13
    path, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    argv = TINY + ["--steps", "4", "--log-interval", "2", "--metrics-file", str(path), "--checkpoint-dir", str(ck),
                   "--checkpoint-interval", "2"]
    first = pools.run(2, train, argv + ["--dp", "2"], 2)[0]
    second = pools.run(2, train, argv + ["--dp", "2", "--resume", "auto"])[0]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]        # step 1, the interval, the first step of the resumed run
    assert [r["loss"] for r in rows] == [first[0], first[1], second[0], second[1]]   # full precision
    for r in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu",
                "peak_mem_gib", "step_time_s"} <= set(r), r
        assert "mfu" not in r            # no GPU here: no peak to divide by

