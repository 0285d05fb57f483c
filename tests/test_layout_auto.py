"""`--layout auto` (issues 43 and 58): the planner ranks the layouts that fit the device's
free memory less a margin (the layout flags given constrain them), tries the fastest few on
every rank, records the trials for its next plan and trains with the fastest measured; the
dry run prints the choice and its command; a finished run compares its training steps'
time with the planner's prediction (the line before the closing one)."""
import os
import re
import subprocess
import sys
import time

import pytest

from meshtron.cli import layout_auto
from meshtron.config import Config, ConfigError
from meshtron.models import presets
from meshtron.planner import plan, records

from harness import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "train.py")
TINY = ["--model", "llama-tiny", "--seq-len", "16", "--global-batch", "8", "--steps", "3"]
GiB = 2 ** 30


def _env(tmp_path, **extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MESHTRON_CALIBRATION_DIR=str(tmp_path / "records"), **extra)


def test_dry_run_prints_the_budget_the_choice_and_a_command_naming_each_flag_once(tmp_path):
    # the flags given constrain the choice (once refused or overridden); --compile was printed twice
    run = run_script([RECIPE, *TINY, "--tp", "2", "--micro-batch", "2", "--compile", "--layout", "auto",
                      "--dry-run", "4"], env=_env(tmp_path, MESHTRON_FREE_MEMORY_GIB="80"), cwd=ROOT)
    assert run.returncode == 0, run.stderr
    budget, choice, command = run.stdout.strip().splitlines()
    assert budget == ("layout auto: memory: 80.0 GiB a rank (set by MESHTRON_FREE_MEMORY_GIB), planned to 72.0 GiB "
                      "(a 10% margin); time: the H100's calibration (there is no CPU calibration)")
    m = re.match(r"layout auto: (.*) on 4 ranks: predicted [\d.]+ ms a step, [\d.]+ GiB on the fullest rank "
                 r"\(calibration .*h100\.json", choice)
    assert m and "--tp 2 " in m.group(1) and "--micro-batch 2 " in m.group(1), choice
    assert command.startswith("meshtron-run --nproc-per-node 4 recipes/train.py --model llama-tiny")
    assert command.endswith(m.group(1)) and "--layout" not in command and "--dry-run" not in command
    flags = [t for t in command.split() if t.startswith("--")]
    assert len(flags) == len(set(flags)), command


@pytest.mark.slow
def test_four_cpu_ranks_skip_a_failed_trial_and_train_with_the_fastest_measured(tmp_path):
    # the first candidate fails on rank 1 alone before its second step, while ranks 0, 2 and 3 wait in its
    # collectives: they are stopped, the table says so, and the job goes on to the next candidate
    run = subprocess.run([sys.executable, "-m", "meshtron.launch", "--nproc-per-node", "4", RECIPE, *TINY,
                          "--layout", "auto", "--layout-trials", "2"], capture_output=True, text=True, cwd=ROOT,
                         env=_env(tmp_path, MESHTRON_TRIAL_FAIL="1:1"), timeout=400)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    failed, tried = re.findall(r"^  (--dp .*?)  +[\d.]+  +(failed: .*|[\d.]+ .*)$", out, re.MULTILINE)
    assert failed[1] == "failed: rank 1: PlantedOutOfMemoryError: out of memory (MESHTRON_TRIAL_FAIL)", out
    chosen = re.search(r"^layout auto: (.*) on 4 ranks: predicted .*; measured [\d.]+ ms, the fastest of 1 trials; "
                       r"recorded in (.*)$", out, re.MULTILINE)
    assert chosen and chosen.group(1) == tried[0], out
    with open(chosen.group(2)) as f:
        rows = [line for line in f if line.strip()]
    assert len(rows) == 2 and '"error": "rank 1: PlantedOutOfMemoryError' in rows[0], rows
    mesh = re.search(r"\| mesh (\{.*?\})", out).group(1)
    degrees = {a: int(d) for a, d in re.findall(r"--(dp|pp|cp|tp|ep) (\d+)", chosen.group(1))}
    assert all(f"'{a}': {d}" in mesh for a, d in degrees.items()), (chosen.group(1), mesh)
    planner, closing = out.strip().splitlines()[-2:]
    assert closing.startswith("done: 3 steps"), closing
    # the CPU has no calibration: no percentage against an H100's prediction
    assert re.fullmatch(r"planner: measured [\d.]+ ms a step \(1 training steps after the first 2\); no calibration "
                        r"of the CPU: an H100's prediction, [\d.]+ ms, is no check of it", planner), planner


def test_nothing_fits_and_flags_no_layout_has_are_one_line(tmp_path):
    env = _env(tmp_path, MESHTRON_FREE_MEMORY_GIB="80")
    big = run_script([RECIPE, "--model", "llama-8B", "--seq-len", "65536", "--global-batch", "1", "--layout", "auto",
                      "--dry-run", "1"], env=env, cwd=ROOT)
    assert big.returncode != 0 and len(big.stderr.strip().splitlines()) == 1, big.stderr
    assert "no layout of llama-8B" in big.stderr and "fits 72.0 GiB a rank (set by MESHTRON_FREE_MEMORY_GIB: " \
        "80.0 GiB, less 10%); the smallest needs" in big.stderr, big.stderr
    odd = run_script([RECIPE, *TINY, "--micro-batch", "3", "--layout", "auto", "--dry-run", "4"], env=env, cwd=ROOT)
    assert odd.returncode != 0 and len(odd.stderr.strip().splitlines()) == 1, odd.stderr
    assert re.search(r"none of the \d+ layouts the planner finds for llama-tiny .* has --micro-batch 3", odd.stderr)
    alone = run_script([RECIPE, *TINY, "--layout-trials", "2", "--dry-run", "4"], env=env, cwd=ROOT)
    assert "--layout-trials tries --layout auto's candidates: it needs --layout auto" in alone.stderr
    bare = run_script([RECIPE, *TINY, "--dry-run"], env=env, cwd=ROOT)
    assert bare.returncode != 0 and "--dry-run needs N" in bare.stderr


def test_the_printed_command_names_each_flag_once():
    # issue 57, point 6: a flag both given and chosen (--compile) was printed twice
    from types import SimpleNamespace
    pred = SimpleNamespace(flags=lambda: "--dp 4 --zero 0 --micro-batch 2 --recompute selective --compile")
    argv = ["--model", "tiny", "--compile", "--recompute", "selective", "--micro-batch", "4", "--layout", "auto",
            "--dry-run", "4", "--steps", "3"]
    assert layout_auto.command_line(argv, pred, 4) == ("meshtron-run --nproc-per-node 4 recipes/train.py --model "
                                                       "tiny --steps 3 --dp 4 --zero 0 --micro-batch 2 --recompute "
                                                       "selective --compile")


def _config(argv: list[str]) -> Config:
    return Config.parse(argv, None, presets.TRAINING)[0].on_device("cpu")


def test_a_layout_chosen_under_a_memory_limit_fits_it():
    config = _config(["--model", "llama-1B", "--seq-len", "2048", "--global-batch", "32", "--dtype", "bf16"])
    every, _ = layout_auto.ranked(config, 4, 4, "h100", layout_auto.Budget(None, "no limit"), [], [], "cpu")
    budget = layout_auto.Budget(every[0].memory * 0.8 / (1 - layout_auto.MARGIN), "a test's")
    fit, _ = layout_auto.ranked(config, 4, 4, "h100", budget, [], [], "cpu")
    assert fit[0].memory <= budget.limit < every[0].memory   # the limit held, and it bit
    assert fit[0] == min((p for p in every if p.memory <= budget.limit), key=lambda p: (p.step_s, p.memory))


def test_recorded_rows_set_a_measured_layouts_time_and_scale_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRON_CALIBRATION_DIR", str(tmp_path))
    config = _config(["--model", "llama-tiny", "--seq-len", "16", "--global-batch", "8"])
    before, none = layout_auto.ranked(config, 4, 4, "h100", layout_auto.Budget(None, ""), [], records.read("cpu"),
                                      "cpu")
    assert none is None
    a, b = before[0], before[1]
    records.append("cpu", [records.row(config, a, 4, 4, a.step_s * 3, 1.5, "a test"),
                           records.row(config, b, 4, 4, b.step_s * 5, 2.0, "a test")])
    after, note = layout_auto.ranked(config, 4, 4, "h100", layout_auto.Budget(None, ""), [], records.read("cpu"), "cpu")
    by_flags = {p.flags(): p for p in after}
    assert by_flags[a.flags()].step_s == pytest.approx(a.step_s * 3, rel=1e-3)
    assert by_flags[a.flags()].memory == 1.5 * GiB and by_flags[b.flags()].memory == 2.0 * GiB
    for p in before[2:]:   # the median ratio of the two rows: 4
        assert by_flags[p.flags()].step_s == pytest.approx(p.step_s * 4, rel=1e-3), p.flags()
    assert note.startswith("2 of these layouts measured on this device before"), note


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    from meshtron.train.lifetime import init_process_group
    init_process_group(600)
    yield
    dist.destroy_process_group()


# a step of short sequences is mostly each micro-batch's host time: the four layouts differ clearly
ONE = ["--model", "llama-tiny", "--seq-len", "4", "--global-batch", "16", "--recompute", "none", "--layout", "auto"]


def _auto(trials: int):
    said = []
    config, pred = layout_auto.auto(Config.parse(ONE, None, presets.TRAINING)[0], ONE, trials, presets.TRAINING,
                                    say=said.append)
    return records.flags(config, pred), said


def test_trials_choose_the_fastest_measured_and_catch_a_planner_that_ranks_wrong(world_of_one, monkeypatch, tmp_path):
    real = plan.step_time
    broken = {"the slowest first": lambda t, hw: (1 / real(t, hw)[0], 0.0), "a constant": lambda t, hw: (1.0, 0.0)}
    # every layout of the job (--recompute none, one rank: five micro-batch sizes) tried here, the planner
    # made to predict a constant: the trials alone choose, and their rows are the truth below
    monkeypatch.setenv("MESHTRON_CALIBRATION_DIR", str(tmp_path / "tried"))
    with monkeypatch.context() as m:
        m.setattr(plan, "step_time", broken["a constant"])
        chosen, said = _auto(5)
    measured = {r["flags"]: r["step_ms"] for r in records.read("cpu")}
    assert len(measured) == 5, said
    fastest, slowest = min(measured.values()), max(measured.values())
    assert measured[chosen] == fastest and slowest > 3 * fastest, said

    def good(flags: str) -> bool:   # nearer the fastest than the slowest
        return measured[flags] < (fastest * slowest) ** 0.5
    # the prediction alone (--layout-trials 0, no records): the planner's choice is among the fastest, and the
    # same check fails a planner that puts the slowest first or predicts a constant
    monkeypatch.setenv("MESHTRON_CALIBRATION_DIR", str(tmp_path / "none"))
    assert good(_auto(0)[0]), measured
    for name, variant in broken.items():
        with monkeypatch.context() as m:
            m.setattr(plan, "step_time", variant)
            assert not good(_auto(0)[0]), name
    # with the trials recorded, the next plan takes their times: even the backward planner now chooses right
    monkeypatch.setenv("MESHTRON_CALIBRATION_DIR", str(tmp_path / "tried"))
    with monkeypatch.context() as m:
        m.setattr(plan, "step_time", broken["the slowest first"])
        chosen, said = _auto(0)
    assert measured[chosen] == fastest and said[1].startswith("layout auto: 5 of these layouts measured"), said


def test_a_trial_whose_peak_passes_the_memory_limit_is_not_chosen(world_of_one, monkeypatch, tmp_path):
    # the prediction fits (a tiny model's bytes), the measured peak does not (a process's RSS): the measure decides
    monkeypatch.setenv("MESHTRON_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.setenv("MESHTRON_FREE_MEMORY_GIB", "0.1")
    with pytest.raises(ConfigError, match=r"no trial ran within the budget \(the first: over the budget: a peak of "
                                          r"[\d.]+ GiB, 0.09 GiB planned to\)"):
        _auto(1)
    assert records.read("cpu")[0]["step_ms"] > 0   # measured all the same, for the next plan


@pytest.mark.slow
def test_the_closing_line_times_the_training_steps_alone(monkeypatch, tmp_path, capsys):
    # with --checkpoint-interval 1 it read -98%: the saves were timed as steps
    from meshtron.cli import train as cli
    from meshtron.train import checkpoint
    save = checkpoint.save

    def slow_save(*args, **kwargs):
        time.sleep(1.0)
        return save(*args, **kwargs)
    monkeypatch.setattr(checkpoint, "save", slow_save)
    cli.main(["--model", "llama-tiny", "--seq-len", "16", "--global-batch", "8", "--steps", "5", "--checkpoint-dir",
              str(tmp_path / "ck"), "--checkpoint-interval", "1"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("planner:"))
    m = re.fullmatch(r"planner: measured ([\d.]+) ms a step \(3 training steps after the first 2\); no calibration "
                     r"of the CPU: an H100's prediction, [\d.]+ ms, is no check of it", line)
    assert m and float(m.group(1)) < 500, line
