"""`--layout auto` (issue 43): the recipe asks the planner for the layout, prints it with
its prediction and trains with it; `--dry-run` prints the choice and its command; a
finished run compares its step time with the planner's prediction (the line before
the closing one)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "llama-tiny", "--seq-len", "16", "--global-batch", "8", "--steps", "3"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _recipe(*argv, ranks: int | None = None, timeout: int = 300):
    launcher = [sys.executable, "-m", "meshtron.launch", "--nproc-per-node", str(ranks)] if ranks else \
        [sys.executable]
    return subprocess.run([*launcher, "recipes/train.py", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=ENV, timeout=timeout)


def test_dry_run_prints_the_choice_its_prediction_and_the_command():
    run = _recipe(*TINY, "--layout", "auto", "--dry-run", "4")
    assert run.returncode == 0, run.stderr
    choice, command = run.stdout.strip().splitlines()
    m = re.match(r"layout auto: (.*) on 4 ranks: predicted [\d.]+ ms a step, [\d.]+ GiB on the fullest rank "
                 r"\(calibration .*h100\.json", choice)
    assert m, choice
    assert command.startswith("meshtron-run --nproc-per-node 4 recipes/train.py --model llama-tiny")
    assert command.endswith(m.group(1)) and "--layout" not in command and "--dry-run" not in command


def test_four_cpu_ranks_train_with_the_chosen_mesh_and_close_with_the_planners_check():
    run = _recipe(*TINY, "--layout", "auto", ranks=4)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    flags = re.search(r"layout auto: (.*) on 4 ranks", out).group(1)
    mesh = re.search(r"\| mesh (\{.*?\})", out).group(1)
    degrees = {a: int(d) for a, d in re.findall(r"--(dp|pp|cp|tp|ep) (\d+)", flags)}
    assert all(f"'{a}': {d}" in mesh for a, d in degrees.items()), (flags, mesh)
    planner, closing = out.strip().splitlines()[-2:]
    assert closing.startswith("done: 3 steps"), closing
    check = r"^planner: measured [\d.]+ ms a step, predicted [\d.]+ ms on h100 .*\([+-]\d+%\)$"
    assert re.search(check, planner), planner


def test_nothing_fits_and_a_layout_of_ones_own_are_refused_in_one_line():
    big = _recipe("--model", "llama-8B", "--seq-len", "65536", "--global-batch", "1", "--layout", "auto",
                  "--dry-run", "1")
    assert big.returncode != 0 and len(big.stderr.strip().splitlines()) == 1
    assert "no layout of llama-8B" in big.stderr and "the smallest needs" in big.stderr
    own = _recipe(*TINY, "--tp", "2", "--layout", "auto", "--dry-run", "4")
    assert own.returncode != 0
    assert own.stderr.strip() == "error: --layout auto chooses the layout itself: leave out --tp"
    bare = _recipe(*TINY, "--dry-run")
    assert bare.returncode != 0 and "--dry-run needs N" in bare.stderr


def test_the_printed_command_names_each_flag_once():
    # issue 57, point 6: a flag both given and chosen (--compile) was printed twice
    from types import SimpleNamespace

    from meshtron.train import planned
    pred = SimpleNamespace(flags=lambda: "--dp 4 --zero 0 --micro-batch 2 --recompute selective --compile")
    argv = ["--model", "tiny", "--compile", "--recompute", "selective", "--micro-batch", "4", "--layout", "auto",
            "--dry-run", "4", "--steps", "3"]
    assert planned.command_line(argv, pred, 4) == ("meshtron-run --nproc-per-node 4 recipes/train.py --model tiny "
                                                   "--steps 3 --dp 4 --zero 0 --micro-batch 2 --recompute selective "
                                                   "--compile")
