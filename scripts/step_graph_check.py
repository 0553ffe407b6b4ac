"""Whole-step CUDA graphs (FBTRAIN_CUDA_GRAPHS=1) against eager training on a GPU: one
prepared check for a first GPU run, a minute or two.

For each precision (fp32, and bf16 autocast where the GPU has it): a run trains STEPS steps
eagerly (``train_step``) and a second, from the same seed, through the step graphs
(``train_step`` with ``StepGraphs``), at the main job's widths with dropout 0.1, clipping,
a shape change after three steps and a float32-exact learning rate; the two must agree bit
for bit (every step's figures, every weight and AdamW state tensor), which also checks that
each replay advanced the dropout generator as the eager step did (a third run, eager again,
says whether eager training itself is repeatable there). Then TIMED more steps of each are
timed (ms/step), and one replayed step is profiled: the host's launch calls
(``cudaLaunchKernel`` and kin, ``cudaGraphLaunch``, ``cudaMemcpyAsync``; 5 are
designed) and the kernels the GPU ran. Exits 1 when a pair
disagrees or a capture fails.

Without CUDA it runs the same code at toy sizes on the CPU, with a stand-in for the graph
that replays the captured step into the same buffers, and says so (its figures then mean
nothing; the tests run it that way). ``--require-cuda`` makes that a failure.

    python scripts/step_graph_check.py --require-cuda --json step_graph_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fbtrain.config import config_from_dict  # noqa: E402
from fbtrain.device import autocast_dtype  # noqa: E402
from fbtrain.distributed import DistContext  # noqa: E402
from fbtrain.rundir import RunDirectory  # noqa: E402
from fbtrain.train import step_graph  # noqa: E402
from fbtrain.train.setup import RunParts, set_up  # noqa: E402
from fbtrain.train.signals import StopSignals  # noqa: E402
from fbtrain.train.step import train_step  # noqa: E402

STEPS = 6  # three at each of two lengths: a capture and two replays each
TIMED = 20  # steps timed after the comparison, at the second length
LR = 2.0 ** -9  # with a 4-step warm-up: every rate a float32 number
MAIN = dict(d_model=128, n_heads=4, d_ff=512, n_layers=4, batch=16, lengths=(32, 64))
TOY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, batch=2, lengths=(6, 8))
# Host-side CUDA runtime/driver calls that queue work, as the profiler names them.
HOST_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
              "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


class ReplayStandIn:
    """``step_graph._StepGraph`` without CUDA: the capture runs nothing; each replay runs the
    captured step on its static inputs and writes the result into the first replay's
    output, as a graph rewrites its own buffers."""

    def __init__(self, body, device, stream):
        self.body, self.out = body, None

    def replay(self) -> None:
        fresh = self.body()
        if self.out is None:
            self.out = fresh
        else:
            self.out.copy_(fresh)


def make_run(tmp: Path, name: str, device: torch.device, precision: str, sizes: dict) -> RunParts:
    """A fresh run of feedback_kv on a generated text, as the trainer builds it: ``sizes``
    as MAIN's (``dropout`` 0.1 and a window of the longest length unless it says)."""
    tmp.mkdir(parents=True, exist_ok=True)
    text = tmp / "text.txt"
    if not text.exists():
        rng = random.Random(0)
        words = ["the", "king", "queen", "and", "to", "of", "my", "lord", "ROMEO:", "JULIET:"]
        text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))
                                  for _ in range(3000)) + "\n", encoding="utf-8")
    short, long = sizes["lengths"]
    raw = {
        "run": {"name": name, "out_dir": str(tmp / "runs"), "device": str(device), "seed": 7,
                "precision": precision},
        "data": {"path": str(text)},
        "model": {"kind": "feedback_kv", "d_model": sizes["d_model"],
                  "n_heads": sizes["n_heads"], "d_ff": sizes["d_ff"],
                  "n_layers": sizes["n_layers"], "max_rel_pos": sizes.get("max_rel_pos", long),
                  "dropout": sizes.get("dropout", 0.1)},
        "train": {"max_steps": STEPS + TIMED, "batch_size": sizes["batch"], "lr": LR,
                  "warmup_steps": 4, "schedule": "constant", "grad_clip": 0.5,
                  "eval_windows": 2, "constant_tokens": False},
        "curriculum": [{"until_step": STEPS // 2, "seq_len": short}, {"seq_len": long}],
        "logging": {"tensorboard": False, "progress": False},
    }
    run, _, _ = set_up(config_from_dict(raw), DistContext(device),
                       RunDirectory(tmp / "runs" / name, 1), None)
    return run


def state_of(run: RunParts) -> list[torch.Tensor]:
    """Every weight and AdamW state tensor, on the CPU."""
    opt = run.optimizer.state_dict()
    return ([p.detach().cpu().clone() for p in run.raw_model.parameters()]
            + [v.cpu().clone() for s in opt["state"].values() for v in s.values()])


def figures(result) -> tuple:
    return (result.loss, result.grad_norm, result.memory_rms.item(), result.lr)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_calls(step, device: torch.device) -> dict[str, int]:
    """One call of ``step`` under torch.profiler: the host's queueing calls by name and the
    kernels the GPU ran (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    events = prof.key_averages()
    counts = {e.key: e.count for e in events if e.key in HOST_CALLS}
    # Each kernel is a device event; record_function spans show there too, as annotations
    # (as scripts/gpu_check.py counts them).
    kernels = sum(e.count for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")
                  and not getattr(e, "is_user_annotation", False))
    return {**counts, "host_total": sum(counts.values()), "gpu_kernels": kernels}


def check(tmp: Path, device: torch.device, precision: str, sizes: dict) -> dict[str, Any]:
    """Eager and graphed runs from one seed, compared; then timed and profiled."""
    signals, last = StopSignals(), tmp / "last.pt"
    eager = make_run(tmp, f"eager-{precision}", device, precision, sizes)
    eager_figures = [figures(train_step(eager, i, signals, last)) for i in range(STEPS)]
    eager_state = state_of(eager)
    # The control: a second eager run from the seed. Should it differ too, the device's
    # kernels are not deterministic here and a disagreement is not the graphs'.
    again = make_run(tmp, f"again-{precision}", device, precision, sizes)
    again_figures = [figures(train_step(again, i, signals, last)) for i in range(STEPS)]
    repeatable = again_figures == eager_figures and all(
        torch.equal(a, b) for a, b in zip(eager_state, state_of(again), strict=True))
    del again
    graphed = make_run(tmp, f"graphed-{precision}", device, precision, sizes)
    graphs = step_graph.StepGraphs(graphed)
    graphed_figures = [figures(train_step(graphed, i, signals, last, graphs))
                       for i in range(STEPS)]
    same_state = all(torch.equal(a, b) for a, b in zip(eager_state, state_of(graphed),
                                                       strict=True))
    row: dict[str, Any] = {"bitwise_equal": same_state and eager_figures == graphed_figures,
                           "figures_equal": eager_figures == graphed_figures,
                           "eager_repeatable": repeatable,
                           "captured": graphs.graph is not None and not graphs.failed,
                           "losses": [f[0] for f in graphed_figures]}
    for name, step in (("eager", lambda i: train_step(eager, i, signals, last)),
                       ("graphed", lambda i: train_step(graphed, i, signals, last, graphs))):
        sync(device)
        start = time.perf_counter()
        for i in range(STEPS, STEPS + TIMED):
            step(i)
        sync(device)
        row[f"{name}_ms"] = round((time.perf_counter() - start) / TIMED * 1000, 3)
    if device.type == "cuda":
        row["eager_calls"] = host_calls(lambda: train_step(eager, STEPS, signals, last),
                                        device)
        row["graphed_calls"] = host_calls(
            lambda: train_step(graphed, STEPS, signals, last, graphs), device)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--require-cuda", action="store_true",
                        help="fail at once without CUDA instead of the CPU stand-in")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.require_cuda and not cuda:
        print("error: no CUDA device; this check is for a CUDA machine", file=sys.stderr)
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    sizes = MAIN if cuda else TOY
    precisions = ["fp32"] + (["bf16"] if autocast_dtype("auto", device) else [])
    if not cuda:
        print("no CUDA: the CPU stand-in at toy sizes (its figures mean nothing)", flush=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                              "torch": torch.__version__, "sizes": sizes, "rows": {}}
    stand_in = (contextlib.nullcontext() if cuda else
                mock.patch.object(step_graph, "_StepGraph", ReplayStandIn))
    failed = False
    with stand_in, tempfile.TemporaryDirectory() as tmp:
        for precision in precisions:
            try:
                row = check(Path(tmp) / precision, device, precision, sizes)
            except Exception as e:  # a failed pair is reported, the rest still run
                row = {"error": f"{type(e).__name__}: {e}"}
            report["rows"][precision] = row
            ok = row.get("bitwise_equal") and row.get("captured")
            failed |= not ok
            print(f"{precision}: {'ok' if ok else 'FAILED'} {json.dumps(row)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
