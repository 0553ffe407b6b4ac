"""Reproduce the Tiny Shakespeare results table (README, docs/results.md): train each
shipped Tiny Shakespeare config, then score it with ``fbtrain eval`` on the whole
validation split.

    python scripts/results.py --data tinyshakespeare.txt      # a local copy of the corpus
    python scripts/results.py --data input.txt --configs configs/tiny_shakespeare.yaml

Each config trains into ``<out>/<config stem>`` (an existing run is evaluated, not
retrained, unless --retrain). Prints a markdown table (and writes it with --markdown):
validation loss and bits per character with windows of 64 characters from empty memory
(``--context reset``), the same with memory carried across windows for the feedback
models (``--context carry``), parameters, training tokens, wall time, training tokens/s;
then the machine the figures are from (commit, CPU, torch's kernel dispatch, threads),
since training is bitwise reproducible on one machine only (docs/results.md, "Across CPU
kinds").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIGS = [
    "configs/tiny_shakespeare.yaml",
    "configs/tiny_shakespeare_feedback.yaml",
    "configs/tiny_shakespeare_transformer.yaml",
    "configs/tiny_shakespeare_fixed.yaml",
    "configs/tiny_shakespeare_carry.yaml",
]


def fbtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fbtrain", *args], check=True,
                          capture_output=True, text=True)


def train(config: str, data: str, out: Path, retrain: bool) -> float | None:
    """Train ``config`` into out/<stem>; return the wall time in seconds (None if reused)."""
    run_dir = out / Path(config).stem
    if (run_dir / "checkpoints" / "last.pt").exists() and not retrain:
        return None
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fbtrain", "train", "--config", config,
                    "--set", f"data.path={data}", "--set", f"run.out_dir={out}", "--quiet"],
                   check=True)
    return time.perf_counter() - start


def evaluate(run_dir: Path, data: str, context: str) -> dict:
    out = fbtrain("eval", "--checkpoint", str(run_dir), "--data-path", data, "--seq-len", "64",
                  "--context", context, "--json")
    return json.loads(out.stdout)


def summarize(config: str, data: str, out: Path, wall: float | None) -> dict:
    import torch

    run_dir = out / Path(config).stem
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu",
                      weights_only=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    row = {
        "config": config, "kind": ckpt["model_config"]["kind"],
        "params": sum(t.numel() for t in ckpt["model"].values()),
        "tokens": ckpt["tokens"], "steps": ckpt["step"],
        "tokens_per_sec": sum(speeds) / len(speeds) if speeds else None,
        "wall_s": wall, "reset": evaluate(run_dir, data, "reset"),
    }
    if row["kind"] != "transformer":
        row["carry"] = evaluate(run_dir, data, "carry")
    return row


def machine() -> dict:
    """Where the figures come from: commit, CPU model, torch's dispatch (AVX512, AVX2, ...,
    as ATEN_CPU_CAPABILITY may hold it) and thread count, as the training runs see them."""
    import torch

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parent)
    return {"commit": git.stdout.strip() or "unknown", "cpu": cpu,
            "dispatch": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def describe(m: dict) -> str:
    return (f"Measured at commit {m['commit']} on {m['cpu']} (torch dispatch {m['dispatch']}, "
            f"{m['threads']} threads).")


def table(rows: list[dict]) -> str:
    lines = [
        "| config | kind | val loss (nats) | val bpc | carried-memory bpc | params | "
        "train tokens | wall time | train tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        carry = f"{r['carry']['bpc']:.3f}" if "carry" in r else "n/a"
        wall = f"{r['wall_s'] / 60:.1f} min" if r["wall_s"] else "(reused)"
        speed = f"{r['tokens_per_sec']:,.0f}" if r["tokens_per_sec"] else "?"
        lines.append(
            f"| `{r['config']}` | {r['kind']} | {r['reset']['loss']:.4f} | "
            f"{r['reset']['bpc']:.3f} | {carry} | {r['params']:,} | {r['tokens']:,} | "
            f"{wall} | {speed} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="local copy of Tiny Shakespeare")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--out", type=Path, default=Path("runs/results"))
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    rows = []
    for config in args.configs:
        print(f"== {config}", flush=True)
        wall = train(config, args.data, args.out, args.retrain)
        rows.append(summarize(config, args.data, args.out, wall))
        print(table(rows[-1:]), flush=True)
    where = machine()
    text = table(rows) + "\n\n" + describe(where)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"machine": where, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
