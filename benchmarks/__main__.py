"""python -m benchmarks list | run SUITE [SUITE ...] | report

  list     every suite, what it measures, its rows and their commands
  run      runs the suites' rows on this machine's GPUs and appends them to benchmarks/data/<suite>.jsonl
           (--data DIR elsewhere: on a lent GPU machine, a folder that comes back, e.g. $OUT/data)
  report   writes benchmarks/RESULTS.md from the data files: per suite the latest figure of each row
           on each machine (--check: exit 1 where RESULTS.md is not what it would write)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import report, runner
from benchmarks.suites import SUITES


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("list", help="every suite and its rows")
    r = sub.add_parser("run", help="run suites' rows and record them")
    r.add_argument("suites", nargs="+", help=f"of: {', '.join(SUITES)}")
    r.add_argument("--pack", action="store_true", help="run jobs side by side on disjoint GPUs")
    r.add_argument("--only", default="", help="row names to run, separated by ';' (default: all)")
    r.add_argument("--extra", default="", help="more bench_train.py flags for every meshtron row")
    r.add_argument("--steps", type=int, default=30, help="the peer's steps")
    r.add_argument("--rounds", type=int, default=5, help="meshtron's timed rounds")
    r.add_argument("--round-steps", type=int, default=4, help="meshtron's steps per round")
    r.add_argument("--profile-steps", type=int, default=2, help="meshtron's profiled steps (compute, NCCL, exposed)")
    r.add_argument("--timeout", type=int, default=420, help="seconds a job may run")
    r.add_argument("--budget", type=int, default=0, help="seconds for all the jobs: a job starts only with 60 s left")
    r.add_argument("--data", default=report.DATA, help="where the rows are appended (DATA/<suite>.jsonl)")
    r.add_argument("--out", default="", help="the jobs' logs and outputs (default: $OUT, else /tmp/benchmarks)")
    r.add_argument("--commit", default="", help="the commit measured (default: git's HEAD, '+changes' if edited)")
    c = sub.add_parser("report", help="write benchmarks/RESULTS.md")
    c.add_argument("--check", action="store_true", help="exit 1 where RESULTS.md is not what report writes")
    args = p.parse_args(argv)
    if args.what == "list":
        runner.list_suites()
    elif args.what == "run":
        unknown = [s for s in args.suites if s not in SUITES]
        if unknown:
            p.error(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
        args.deadline = time.time() + args.budget if args.budget else None
        args.argv = argv
        runner.run(args.suites, args)
    else:
        text = report.render()
        if args.check:
            current = open(report.RESULTS).read() if os.path.exists(report.RESULTS) else ""
            sys.exit(0 if current == text else f"{report.RESULTS} is not current: run python -m benchmarks report")
        with open(report.RESULTS, "w") as f:
            f.write(text)
        print(f"wrote {report.RESULTS} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
