"""benchmarks/RESULTS.md from the data files: per suite, the latest figure of each row on each machine.

A data file (data/<suite>.jsonl) holds every run's rows; the table shows, for each row and
machine, the record of the latest date (the later line where two share it), in the suite's
row order. The columns are the figures its rows have; a version all its rows share goes in the
suite's header, one that differs gets a column.
"""
from __future__ import annotations

import json
import os

from benchmarks.suites import SUITES

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
RESULTS = os.path.join(HERE, "RESULTS.md")


def pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def ms(v: float) -> str:
    return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}" if abs(v) < 100 else f"{v:,.1f}"


FIGURES = {   # key: (column, format), in the order columns appear
    "tokens_per_s_per_gpu": ("tokens/s/GPU", "{:,.0f}"), "step_ms": ("step ms", "{:,.1f}"), "ms": ("ms", ms),
    "mfu": ("MFU", pct),
    "peer_mfu": ("peer's MFU", pct), "peak_gib": ("peak GiB", "{:.1f}"), "reserved_gib": ("reserved GiB", "{:.1f}"),
    "compute_ms": ("compute ms", "{:.1f}"), "nccl_ms": ("NCCL ms", "{:.1f}"), "exposed_ms": ("exposed ms", "{:.1f}"),
    "load": ("load", "{:.2f}"), "load_last10": ("load, last 10 steps", "{:.2f}"),
    "router_load": ("router's own, last 10", "{:.2f}"), "bubble_predicted": ("bubble predicted", "{:.3f}"),
    "bubble_measured": ("bubble measured", "{:.2f}"), "kept": ("kept", pct), "loss": ("loss", "{:.4f}"),
    "beside_ms": ("ms beside matmuls", ms),
    "matmul_slowdown_ms": ("matmuls +ms", "{:+.2f}"), "tflops": ("TFLOP/s", "{:.0f}"),
    "dw_rel": ("weight gradient vs eager", "{:.1e}"), "in_flight_ms": ("step ms, save in flight", "{:.1f}"),
    "hold_ms": ("held ms, first save", "{:,.0f}"), "hold_later_ms": ("held ms, later saves", "{:,.0f}"),
    "write_s": ("write s", "{:.1f}"), "gb_s": ("GB/s", "{:,.0f}"), "eager_gb_s": ("eager", "{:,.0f}"),
    "compile_gb_s": ("compile", "{:,.0f}"), "liger_gb_s": ("Liger", "{:,.0f}"),
    "whole_ms": ("one GPU, whole", ms), "ideal_ms": ("ideal", ms), "p2p_ms": ("p2p", ms),
    "allgather_ms": ("allgather", ms), "a2a_ms": ("a2a", ms),
    "torch_cp_allgather_ms": ("torch CP all-gather", ms), "torch_cp_alltoall_ms": ("torch CP ring", ms),
    "of_ideal": ("of the ideal", "{:.2f}"), "balance": ("balance", "{:.3f}"),
    "step_error": ("step time error", pct), "mem_error": ("memory error", pct), "layouts": ("layouts", "{}"),
}
for n in (256, 512, 1024, 2048, 4096):
    FIGURES[f"at_{n}"] = (f"{n} an expert", "{:.2f}")
for n in (4096, 8192, 16384):
    FIGURES[f"layer_{n}"] = (f"layer, {n // 1024}K tokens", "{:.2f}")

INTRO = """# Benchmark results

Written by `python -m benchmarks report` from `benchmarks/data/<suite>.jsonl` (every run's rows: suite, row,
commit, date, machine, versions, figures, peer, ratio, command); do not edit it by hand. Each suite's table holds
the latest figure of each row on each machine; `python -m benchmarks run SUITE` measures its rows again and
appends them (rows measured before the runner carry the command recorded then). Every peer ran in the same run
on the same machine; ratio is the row's tokens/s over its peer's (a tool's suite says what its ratio is). Common to
every row: bf16 compute with fp32 master weights and fp32 gradient reduction unless the row names FP8 or fp32;
MFU against 989 TFLOP/s (dense bf16, H100 and H200 SXM) with PaLM's FLOP count; load is the MoE routing's
max/mean tokens per expert in the worst layer. How the figures are counted, what they say about where the time
goes, and what was tried: [docs/performance.md](../docs/performance.md).
"""


def read(data: str = DATA) -> dict[str, list[dict]]:
    out = {}
    for name in sorted(os.listdir(data)) if os.path.isdir(data) else []:
        if name.endswith(".jsonl"):
            with open(os.path.join(data, name)) as f:
                out[name[:-6]] = [json.loads(line) for line in f if line.strip()]
    return out


def machine(m: dict) -> str:
    return "CPU" if m["gpu"] == "cpu" else f"{m['count']} x {m['gpu'].removeprefix('NVIDIA ')}"


def latest(records: list[dict], order: list[str]) -> list[dict]:
    best = {}
    for r in records:   # a later line of the same date wins
        key = (r["row"], machine(r["machine"]))
        if key not in best or r["date"] >= best[key]["date"]:
            best[key] = r
    rank = {row: i for i, row in enumerate(order)}
    return sorted(best.values(), key=lambda r: (rank.get(r["row"], len(rank)), machine(r["machine"])))


def cell(key: str, v) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    column, fmt = FIGURES.get(key, (key, "{:.4g}"))
    return fmt(v) if callable(fmt) else fmt.format(v)


def table(rows: list[dict]) -> tuple[str, str]:
    """(the table, the versions every row shares)."""
    keys = [k for k in FIGURES if any(k in r["figures"] for r in rows)]
    keys += [k for r in rows for k in r["figures"] if k not in FIGURES and k not in keys]
    shared, columns = [], []
    for name in dict.fromkeys(k for r in rows for k in r["versions"]):
        values = {r["versions"][name] for r in rows if name in r["versions"]}
        (shared if len(values) == 1 else columns).append(name)
    head = ["row", "machine"] + [FIGURES.get(k, (k,))[0] for k in keys] + ["against", "ratio"] + columns + [
        "date", "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["row"], machine(r["machine"])] + [cell(k, r["figures"].get(k)) for k in keys] + [
            r["peer"] or "", f"{r['ratio']:.3f}x" if r["ratio"] else ""] + [
            r["versions"].get(c, "") for c in columns] + [r["date"], r["commit"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    versions = ", ".join(f"{n} {next(r['versions'][n] for r in rows if n in r['versions'])}" for n in shared)
    return "\n".join(lines), versions


def render(data: str = DATA) -> str:
    records = read(data)
    parts = [INTRO, "Suites: " + ", ".join(f"[{s}](#{s})" for s in SUITES) + ".\n"]
    for name, suite in SUITES.items():
        order = [row for j in suite.jobs for row in j.row_names()]
        rows = latest(records.get(name, []), order)
        text = f"## {name}\n{suite.about} Command: `python -m benchmarks run {name}`."
        if rows:
            body, versions = table(rows)
            text += (f" Versions (of the rows that record them): {versions}." if versions else "") + "\n\n" + body
        missing = [row for row in order if row not in {r["row"] for r in rows}]
        if missing:
            text += "\n\n" + ("Not measured yet." if not rows else "Not measured yet: " + "; ".join(missing) + ".")
        parts.append(text + "\n")
    return "\n".join(parts)
