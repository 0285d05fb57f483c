"""meshtron's benchmarks: named suites of rows (suites.py), run on GPUs (runner.py), recorded in
data/<suite>.jsonl and reported as RESULTS.md (report.py). `python -m benchmarks --help`."""
