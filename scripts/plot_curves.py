"""Plot accuracy (or loss) against training tokens from runs' metrics.jsonl into a PNG.

    python scripts/plot_curves.py runs/algorithmic_feedback runs/algorithmic_transformer \
        --out docs/algorithmic_curves.png

Each run directory gives two lines: validation accuracy (``val/accuracy``, solid, at every
evaluation) and training accuracy (``accuracy``, faint, a running mean over ``--smooth``
log lines). ``--metric loss`` plots the losses instead. Needs matplotlib
(``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (one JSON object a line)."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SystemExit(f"error: {path}: cannot read it ({e.strerror})") from None
    return [json.loads(line) for line in lines if line.strip()]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(tokens, values) of every record holding ``key`` and a token count."""
    pairs = [(r["tokens"], r[key]) for r in records if key in r and "tokens" in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--labels", nargs="+", help="legend names (default: folder names)")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--metric", choices=("accuracy", "loss"), default="accuracy")
    parser.add_argument("--smooth", type=int, default=10, help="train log lines averaged")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels needs one name per run ({len(args.runs)})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: matplotlib is not installed; pip install -e '.[plot]'", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    scale = 100.0 if args.metric == "accuracy" else 1.0
    for i, run in enumerate(args.runs):
        name = args.labels[i] if args.labels else run.name
        records = read_metrics(run)
        tokens, train = series(records, args.metric)
        line = None
        if train:
            smoothed = running_mean(train, args.smooth)
            (line,) = ax.plot([t / 1e6 for t in tokens], [v * scale for v in smoothed],
                              alpha=0.35, linewidth=1)
        tokens, val = series(records, f"val/{args.metric}")
        if val:
            ax.plot([t / 1e6 for t in tokens], [v * scale for v in val], marker="o",
                    markersize=3, color=line.get_color() if line else None,
                    label=f"{name} (validation)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("accuracy at print (%)" if args.metric == "accuracy" else "loss (nats)")
    if args.metric == "accuracy":
        ax.set_ylim(0, 100)
        ax.axhline(10, color="grey", linestyle=":", linewidth=1, label="chance (1 in 10)")
    if args.title:
        ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
