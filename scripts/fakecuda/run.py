"""Run fbtrain's real code on fake CUDA and print what a GPU would have seen, as JSON.

    python scripts/fakecuda/run.py train [--kind feedback_kv] [--context reset|carry]
        [--data text|bpe|algorithmic] [--precision auto|fp32] [--steps 4] [--dropout 0.1]
    python scripts/fakecuda/run.py eval   (a tiny run trained for real on the CPU first)
    python scripts/fakecuda/run.py sample [--length 5]
    python scripts/fakecuda/run.py memory --config configs/gpu.yaml [--set KEY=VALUE ...]
        [--stage N]   (the peak of one training step at each curriculum stage; minutes a
                       stage at gpu.yaml's sizes: fake CUDA pays a host cost per op)

The JSON: ``syncs`` (phase, kind, where, count: every host sync, see harness.HostSyncs),
``dtypes`` (op family, input dtypes, CUDA float32 matmul precision, where, count), and per
command what it ran (``steps``, ``evaluations``, ``checkpoints``, ``tokens``,
``off_device``). A device mismatch or an op fake CUDA cannot run raises, and the process
exits 1 with its traceback. Tiny sizes: seconds a command.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness  # noqa: I001  (first: it must load the CUDA plumbing before torch)
import torch

from fbtrain.config import config_from_dict


def tiny_config(tmp: Path, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """A run small enough for fake CUDA's per-op cost: 2 layers, width 16, 4 steps."""
    raw: dict[str, Any] = {
        "run": {"name": "fake", "out_dir": str(tmp / "runs"), "device": device, "seed": 7,
                "precision": args.precision},
        "model": {"kind": args.kind, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 2,
                  "max_rel_pos": 16, "dropout": args.dropout},
        "train": {"max_steps": args.steps, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1,
                  "eval_every": 2, "eval_windows": 2, "log_every": 1, "sample_length": 3,
                  "constant_tokens": False,
                  "context": args.context},
        "curriculum": [{"until_step": 2, "seq_len": 6}, {"seq_len": 8}],
        "checkpoint": {"every": 2, "keep_last": 2},
        "logging": {"tensorboard": False, "progress": False},
    }
    if args.data == "algorithmic":
        raw["data"] = {"dataset": "algorithmic", "variables": 2, "program_len": 6,
                       "train_programs": 40, "valid_programs": 8, "test_programs": 8}
        raw["train"]["eval_windows"] = 4
        raw["model"]["max_rel_pos"] = 24
        raw["curriculum"] = [{"until_step": 2, "seq_len": 16}, {"seq_len": 24}]
    else:
        rng = random.Random(0)
        words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
        text = "\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(200))
        (tmp / "text.txt").write_text(text)
        raw["data"] = {"path": str(tmp / "text.txt")}
        if args.data == "bpe":  # a learned vocabulary: each step counts its pieces' characters
            raw["data"].update(tokenizer="bpe", vocab_size=40, cache_dir=str(tmp / "cache"))
    return raw


def report(syncs: harness.HostSyncs, **what: Any) -> dict[str, Any]:
    return {
        "syncs": [{"phase": s.phase, "kind": s.kind, "where": s.where, "count": n}
                  for s, n in sorted(syncs.syncs.items(), key=lambda kv: kv[0].where)],
        "dtypes": [{"op": op, "dtypes": list(dt), "precision": precision, "where": where,
                    "count": n} for (op, dt, precision, where), n in syncs.dtypes.items()],
        **what,
    }


def train(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from fbtrain.train import trainer

    cfg = config_from_dict(tiny_config(tmp, args, "cuda"))
    checkpoints, steps = harness.Checkpoints(), []
    syncs = harness.HostSyncs()
    with harness.fake_cuda() as mode, syncs:
        run_dir = trainer.run(cfg, quiet=True, on_step=steps.append,
                              seams=harness.seams(mode, checkpoints))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return report(syncs, steps=steps, checkpoints=checkpoints.steps,
                  off_device=checkpoints.off_device,
                  evaluations=sum("val/loss" in m for m in metrics),
                  logged=sum("loss" in m for m in metrics))


def real_run(args: argparse.Namespace, tmp: Path) -> Path:
    """A tiny run trained for real on the CPU: what eval and sample start from."""
    from fbtrain.train import trainer

    return trainer.run(config_from_dict(tiny_config(tmp, args, "cpu")), quiet=True)


def evaluate(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from fbtrain import evaluate as evaluation
    from fbtrain.data import corpus, identity

    run_dir = real_run(args, tmp)
    syncs = harness.HostSyncs()
    # The text is read, tokenized and checked against the run's digest for real, on the
    # CPU, as the trainer's data seam does (evaluate imports both when it runs).
    with harness.for_real(corpus, "load_corpus"), harness.for_real(identity, "split_sha256"), \
            harness.fake_cuda(), syncs:
        result = evaluation.run(str(run_dir), device="cuda", batch_size=2)
    return report(syncs, tokens=result["tokens"])


def sample(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from fbtrain import sample as sampling

    run_dir = real_run(args, tmp)
    syncs = harness.HostSyncs()
    with harness.fake_cuda(), syncs:
        sampling.run(str(run_dir), length=args.length, device="cuda", stream=io.StringIO())
    return report(syncs, length=args.length)


def memory(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The peak device memory of one training step (AdamW, as the trainer runs it) at
    each curriculum stage of ``--config``, by torch's MemTracker under fake CUDA: what
    ``torch.cuda.max_memory_allocated`` would report for the step, less the CUDA context
    and the allocator's rounding and caching."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from fbtrain.config.curriculum import Curriculum
    from fbtrain.config.load import load_config
    from fbtrain.distributed import DistContext
    from fbtrain.rundir import RunDirectory
    from fbtrain.train import setup
    from fbtrain.train.signals import StopSignals
    from fbtrain.train.step import train_step

    # A text of Tiny Shakespeare's vocabulary size (65), long enough for the config's
    # validation windows: the step's memory depends on the vocabulary, not the text.
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(33, 98)]
    (tmp / "text.txt").write_text("".join(rng.choice(alphabet) for _ in range(600_000)))
    overrides = [*args.set, f"data.path={tmp / 'text.txt'}", f"run.out_dir={tmp}/runs",
                 "logging.tensorboard=false", "logging.progress=false"]
    cfg = load_config(args.config, overrides)
    curriculum = Curriculum(cfg)
    firsts = [0] + [s.until_step for s in curriculum.stages[:-1]]
    stages = range(len(firsts)) if args.stage is None else [args.stage]
    rows = []
    for stage in stages:
        index = firsts[stage]
        with harness.fake_cuda() as mode:
            ctx = DistContext(device=harness.DEVICE)
            directory = RunDirectory(Path(tmp) / "runs" / f"stage{stage}", 0)
            run, _, _ = setup.set_up(cfg, ctx, directory, None,
                                     seams=harness.seams(mode, harness.Checkpoints()))
            # AdamW's moments as after a first step (a step's peak holds them), made
            # before the tracker starts so that it counts them as the optimizer's.
            for p in run.params:
                p.grad = torch.zeros_like(p)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            tracker = MemTracker()
            tracker.track_external(run.raw_model, run.optimizer)
            with harness.HostSyncs(), tracker:  # the step's one read answered
                train_step(run, index, StopSignals(), directory.checkpoints.last_path)
            peak = tracker.get_tracker_snapshot("peak")[harness.DEVICE]
        rows.append({"stage": stage, "seq_len": curriculum.seq_len_at(index),
                     "batch_size": curriculum.batch_size_at(index),
                     "peak_bytes": peak["Total"],
                     "by_kind": {str(k).rsplit(".", 1)[-1].lower(): v
                                 for k, v in peak.items() if k != "Total"}})
        print(f"stage {stage}: seq_len {rows[-1]['seq_len']} batch {rows[-1]['batch_size']}: "
              f"peak {peak['Total'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return {"config": args.config, "set": args.set, "stages": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("train", "eval", "sample", "memory"))
    parser.add_argument("--config", default="configs/gpu.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--stage", type=int, default=None, help="one curriculum stage")
    parser.add_argument("--kind", default="feedback_kv")
    parser.add_argument("--context", default="reset", choices=("reset", "carry"))
    parser.add_argument("--data", default="text", choices=("text", "bpe", "algorithmic"))
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--length", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fbtrain-fake-cuda-") as tmp:
        command = {"train": train, "eval": evaluate, "sample": sample,
                   "memory": memory}[args.command]
        result = command(args, Path(tmp))
    print(json.dumps(result))  # the last line of the output
    return 0


if __name__ == "__main__":
    sys.exit(main())
