"""benchmarks/: RESULTS.md is what `python -m benchmarks report` writes from the data files, every
recorded row is a row of its suite, README's figures are among them, and the runner records a row."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import report, runner  # noqa: E402
from benchmarks.suites import SUITES, Suite, mt, tool  # noqa: E402

FIELDS = {"suite", "row", "commit", "date", "machine", "versions", "figures", "peer", "ratio", "command"}


def test_results_is_current_and_short():
    with open(report.RESULTS) as f:
        text = f.read()
    assert text == report.render(), "benchmarks/RESULTS.md is not current: run python -m benchmarks report"
    assert text.count("\n") <= 400


def test_every_record_is_a_row_of_its_suite():
    for suite, records in report.read().items():
        assert suite in SUITES, f"data/{suite}.jsonl: no such suite"
        rows = {row for j in SUITES[suite].jobs for row in j.row_names()}
        for r in records:
            assert set(r) == FIELDS and r["row"] in rows, (suite, r)
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", r["date"]) and set(r["machine"]) == {"gpu", "count"}, r
            assert r["figures"] and all(isinstance(v, (int, float)) for v in r["figures"].values()), r


def test_readme_figures_are_generated_rows():
    # README's performance table quotes the tables' figures: each tokens/s or MFU it gives is in RESULTS.md
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = readme[readme.index("| model, layout |"):]
    table = table[:table.index("\n\n")]
    with open(report.RESULTS) as f:
        results = f.read()
    quoted = re.findall(r"\| (\d{1,3},\d{3}|\d+\.\d%)", table) + re.findall(r" (\d{1,3},\d{3}|\d+\.\d%) \|", table)
    assert quoted and [q for q in quoted if f"| {q} |" not in results] == []


def test_runner_records_a_row(tmp_path):
    script = "import json, sys; json.dump({'ms': 2.5}, open(sys.argv[1] + '/r.json', 'w'))"

    def read(job, out):
        with open(os.path.join(out, "r.json")) as f:
            return {job.name: (json.load(f), "peer row", 1.25)}
    suites = {"s": Suite("a test", [tool("a row", 1, ["-c", script, "{out}"], read, launch="python"),
                                    mt("not asked for", 1, "1gpu", [])])}
    args = argparse.Namespace(only="a row", out=str(tmp_path / "out"), pack=False, steps=1, rounds=1, round_steps=1,
                              profile_steps=0, timeout=120, deadline=None, extra="", data=str(tmp_path / "data"),
                              commit="abc1234", argv=["run", "s"])
    runner.run(["s"], args, suites)
    (r,) = [json.loads(x) for x in open(tmp_path / "data" / "s.jsonl")]
    assert set(r) == FIELDS and r["row"] == "a row" and r["figures"] == {"ms": 2.5} and r["ratio"] == 1.25
    assert r["commit"] == "abc1234" and r["command"] == "python -m benchmarks run s" and "torch" in r["versions"]


def test_train_figures():
    result = {"tokens_per_s_per_gpu": 100.0, "step_ms": 10.0, "mfu": None, "peak_mem_gib": float("nan"),
              "profile": {"compute_busy_ms": 8.0, "nccl_ms": 3.0, "exposed_comm_ms": 1.0},
              "bubble_measured": [0.1, 0.3], "bubble_predicted": 0.2}
    assert runner.kept(runner.train_figures(result)) == {
        "tokens_per_s_per_gpu": 100.0, "step_ms": 10.0, "compute_ms": 8.0, "nccl_ms": 3.0, "exposed_ms": 1.0,
        "bubble_predicted": 0.2, "bubble_measured": 0.3}
