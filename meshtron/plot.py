"""Training curves from --metrics-file JSON lines, one or several runs side by side.

    python -m meshtron.plot run_a.jsonl run_b.jsonl -o curves.png [--labels a,b]

Four panels against step: loss (train solid, eval dashed, same colour per run),
learning rate, tokens/s per GPU and MFU (where the run had a GPU). matplotlib is
an optional extra (`pip install meshtron[plot]`).
"""
from __future__ import annotations

import argparse
import json
import os


def read_metrics(path: str) -> tuple[dict[str, list], dict[str, list]]:
    """(train, eval) series of one metrics file: {key: [(step, value), ...]}."""
    train, evals = {}, {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            target = evals if "eval_loss" in r else train
            for k, v in r.items():
                if k != "step" and isinstance(v, (int, float)):
                    target.setdefault(k, []).append((r["step"], v))
    return train, evals


def plot(paths: list[str], out: str, labels: list[str] | None = None) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("meshtron.plot needs matplotlib: pip install matplotlib") from None
    labels = labels or [os.path.splitext(os.path.basename(p))[0] for p in paths]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s_per_gpu", "tokens/s per GPU"), ("mfu", "MFU")]
    for i, (path, label) in enumerate(zip(paths, labels)):
        train, evals = read_metrics(path)
        color = f"C{i}"
        for ax, (key, title) in zip(axes.flat, panels):
            ax.set_title(title)
            ax.set_xlabel("step")
            if key in train:
                steps, values = zip(*train[key])
                ax.plot(steps, values, color=color, label=f"{label} (train)" if key == "loss" else label)
            if key == "loss" and "eval_loss" in evals:
                steps, values = zip(*evals["eval_loss"])
                ax.plot(steps, values, color=color, linestyle="--", marker="o", markersize=3, label=f"{label} (eval)")
    for ax in axes.flat:
        if ax.has_data():
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, "not in these runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="--metrics-file outputs (JSON lines)")
    p.add_argument("-o", "--out", default="curves.png", help="image file to write")
    p.add_argument("--labels", default=None, help="comma-separated run names (default: the file names)")
    args = p.parse_args(argv)
    plot(args.metrics, args.out, args.labels.split(",") if args.labels else None)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
