"""The first GPU check: one command that answers, within one budget, what decides fbtrain's
GPU design. On a lent machine as it is (its own python3, nothing installed, no network):

    python3 scripts/gpu_check.py --out DIR                 # from the repo root
    python3 scripts/gpu_check.py --out DIR --budget 420 --require-cuda

Sections, in the order of what they decide (docs/performance.md, "First GPU check", says
what each one decides):

  a_env          GPU, clocks, driver, torch, CUDA; a large copy's bandwidth, a large bf16
                 matmul's rate, an empty kernel's cost eager and as a graph node; the C++
                 core's build (gpu_check_env.py)
  b_correctness  float64 against tests/reference.py on the ATen path; whole-step CUDA
                 graphs against eager training, bit for bit (gpu_check_steps.py)
  c_speed        ms/step, tokens/s, host launches and kernels per step at the main job's
                 and gpu.yaml's sizes, batch 32 and 512, bf16 and fp32, the trainer's
                 step eager and graphed (gpu_check_steps.py)
  d_train        200 steps of configs/gpu.yaml in bf16 on generated text: the loss falls
  e_cuda_tests   ``pytest -m cuda`` (tests/test_on_cuda.py and every other cuda test)

The budget (``--budget``, seconds) is hard: every section asks it before each unit of work
and records ``skipped: budget`` for what does not fit, and a watchdog ends the run at the
budget whatever it is doing, writing the section in progress as ``cut: budget``. Each
section's results go to ``DIR/<section>.json`` (written atomically) the moment it ends, with
one line printed; the last lines printed are the summary table (``DIR/summary.json``). A
run killed at any point leaves every finished section's file whole.

Needs only torch (2.5 or newer) and fbtrain's dependencies, not fbtrain installed: the repo
root goes on sys.path first. The C++ core builds into ``$TORCH_EXTENSIONS_DIR`` where that
is set, else into a temporary folder (/tmp/fbtrain-gpu-check/, kept for a second run),
never into the home cache. Without CUDA each section runs a toy version on the CPU (the
figures mean nothing; the code paths run), unless ``--require-cuda``. Exit status: 0 all
checks passed, 1 one failed, 2 bad arguments, 3 the budget cut the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# fbtrain from this checkout, before anything imports it (bench scripts included): the
# lent machine has the dependencies but not fbtrain installed.
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
BUILD_ROOT = Path(tempfile.gettempdir()) / "fbtrain-gpu-check"
BUDGET_S = 420.0  # 7 minutes: a margin under a 10-minute command limit
TRAIN_STEPS = 200
TOY_TRAIN_STEPS = 6
# On a GPU, the seconds kept for sections d (200 steps) and e (the CUDA tests) when section
# c's rows start: c's rows are many, and the budget cuts them rather than the later sections.
LATER_SECTIONS_S = 150.0


def _set_build_folder() -> None:
    """The C++ core's build outside the home folder, unless chosen already (set before torch
    reads it)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(BUILD_ROOT / "torch_extensions"))


def generated_text(path: Path, chars: int = 400_000, seed: int = 0) -> Path:
    """A text with learnable structure (words from a small lexicon, in lines), for training
    where no data file is given (the check must not need the network)."""
    rng = random.Random(seed)
    words = ["the", "king", "shall", "speak", "of", "love", "and", "war", "my", "lord",
             "to", "be", "or", "not", "good", "night", "sweet", "prince", "what", "is"]
    lines, size = [], 0
    while size < chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 10))).capitalize()
        lines.append(line + rng.choice([".", ",", "!", "?"]))
        size += len(lines[-1]) + 1
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


ENV_AT_START = dict(os.environ)  # before this script sets anything


def child_env() -> dict[str, str]:
    """The environment of a subprocess: as this run started, with the build folder, and this
    checkout's fbtrain first on its path."""
    env = dict(ENV_AT_START)
    env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return env


def train_run(report, device, data: Path | None, steps: int, toy: bool) -> dict:
    """``python -m fbtrain train --config configs/gpu.yaml`` for ``steps`` steps (bf16
    where the GPU has it: the config's ``precision: auto``): the logged losses."""
    import subprocess

    from gpu_check_steps import GPU_CONFIG, TOY_SIZES

    with tempfile.TemporaryDirectory() as tmp:
        text = data or generated_text(Path(tmp) / "text.txt", 40_000 if toy else 400_000)
        sets = [f"data.path={text}", f"run.out_dir={tmp}/runs", f"train.max_steps={steps}",
                # 10% warm-up: the config's 200 would be the whole run
                f"train.warmup_steps={max(1, steps // 10)}", f"train.eval_every={steps}",
                "train.eval_windows=8", f"checkpoint.every={steps}",
                "logging.tensorboard=false", f"train.log_every={max(1, steps // 20)}"]
        if toy:
            sets += [f"model.{k}={v}" for k, v in TOY_SIZES.items()]
            sets += ["train.batch_size=2", "curriculum=8"]
        cmd = [sys.executable, "-m", "fbtrain", "train", "--config", str(GPU_CONFIG),
               "--device", str(device), "--quiet"]
        for item in sets:
            cmd += ["--set", item]
        try:
            proc = report.run_child(cmd, report.budget.timeout(), cwd=ROOT, env=child_env())
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "timed out (budget)"}
        if proc.returncode != 0:
            return {"ok": False, "error": proc.stderr.strip().splitlines()[-3:]}
        records = [json.loads(line) for line in
                   (Path(tmp) / "runs" / "gpu" / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec") is not None]
    return {"ok": last < first, "first": [first_step, first], "last": [last_step, last],
            "tokens_per_sec": statistics.median(rates) if rates else None,
            "data": str(data) if data else "generated", "steps": steps}


def cuda_tests(report, cuda: bool) -> tuple[str, str, dict]:
    """``pytest -m cuda tests`` in a subprocess: status, summary, details."""
    import subprocess

    if not cuda:
        return "needs CUDA", "pytest -m cuda: every test there needs CUDA", {}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q",
           "tests"]
    try:
        proc = report.run_child(cmd, report.budget.timeout(), cwd=ROOT, env=child_env())
    except subprocess.TimeoutExpired:
        return "cut: budget", "pytest -m cuda timed out", {}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    # Exit 5: nothing selected is not a failure.
    ok = proc.returncode in (0, 5)
    return ("PASS" if ok else "FAIL"), summary, {"exit_code": proc.returncode,
                                                 "tail": lines[-30:]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for the sections' JSON files (created)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds, hard (default {BUDGET_S:.0f})")
    parser.add_argument("--data", type=Path, help="text to train on (default: generated)")
    parser.add_argument("--steps", type=int, default=TRAIN_STEPS,
                        help=f"training steps of section e (default {TRAIN_STEPS})")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per speed row")
    parser.add_argument("--require-cuda", action="store_true",
                        help="fail at once without CUDA instead of running the CPU stand-in")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget {args.budget:g}: must be a positive number of seconds")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gpu_check_report import Budget, Report

    budget = Budget(args.budget)  # from the start: importing torch counts too
    _set_build_folder()
    import torch

    cuda = torch.cuda.is_available()
    if args.require_cuda and not cuda:
        print(f"error: no CUDA device (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}); this check is for a CUDA machine",
              file=sys.stderr)
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    where = (f"CUDA: {torch.cuda.get_device_name(device)}" if cuda else
             "no CUDA: a toy run on the CPU (same code paths; the figures mean nothing)")
    print(f"fbtrain GPU check: {where}; torch {torch.__version__}; budget "
          f"{args.budget:.0f} s; writing {args.out}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, budget, where)
    report.start_watchdog()
    import gpu_check_env
    import gpu_check_steps

    data = report.begin("a_env", "environment and ceilings")
    report.end(*gpu_check_env.run(data, device, budget))

    data = report.begin("b_correctness", "float64 vs reference, graphed vs eager")
    report.end(*gpu_check_steps.run_correctness(data, device, budget))

    data = report.begin("c_speed", "ms/step and tokens/s, eager and graphed")
    # What sections d and e need after it, held back from c's rows.
    report.end(*gpu_check_steps.run_speed(data, device, budget, args.repeats if cuda else 1,
                                          reserve_s=LATER_SECTIONS_S if cuda else 0.0))

    steps = args.steps if cuda else min(args.steps, TOY_TRAIN_STEPS)
    data = report.begin("d_train", f"{steps} steps of configs/gpu.yaml")
    if budget.allows(30.0 if cuda else 5.0):
        train = train_run(report, device, args.data, steps, not cuda)
        data.update(train)
        if "first" in train:
            line = (f"loss {train['first'][1]:.3f} at step {train['first'][0]} -> "
                    f"{train['last'][1]:.3f} at step {train['last'][0]}, "
                    f"{train['tokens_per_sec'] or 0:.0f} tokens/s")
        else:
            line = f"failed: {train['error']}"
        report.end("PASS" if train["ok"] else "FAIL", line)
    else:
        report.end("skipped: budget", "not run")

    data = report.begin("e_cuda_tests", "pytest -m cuda")
    if budget.allows(20.0 if cuda else 0.0):
        status, line, details = cuda_tests(report, cuda)
        data.update(details)
        report.end(status, line)
    else:
        report.end("skipped: budget", "not run")
    return report.close()


if __name__ == "__main__":
    sys.exit(main())
