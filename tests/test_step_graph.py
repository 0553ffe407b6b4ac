"""Whole-step CUDA graphs (fbtrain/train/step_graph.py), on the CPU with a stand-in for the
graph that replays the captured step into the same buffers, as a CUDA graph does.

The graphed step runs the eager step's own body (train/step.py's step_body), and must give
the eager step's numbers bit for bit where the learning rate is a float32 number (and the
float32-rounded rate's numbers otherwise), across a change of shape, with dropout and
clipping; it must stop before the update on a non-finite loss; and where it cannot run it
says why in one line.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from fbtrain.config import config_from_dict
from fbtrain.distributed import DistContext
from fbtrain.rundir import RunDirectory
from fbtrain.train import step, step_graph
from fbtrain.train.setup import RunParts, set_up
from fbtrain.train.signals import StopSignals
from fbtrain.train.step import TrainingError, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from step_graph_check import ReplayStandIn  # noqa: E402  (scripts/: the check's stand-in)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread

STEPS = 6  # three at length 8, three at length 12: a capture each, two replays each
LR = 2.0 ** -8  # and its warm-up fractions 1/4 .. 4/4: all float32 numbers


class ReplayingStepGraph(ReplayStandIn):
    """scripts/step_graph_check.py's CPU stand-in for ``step_graph._StepGraph`` (each
    replay runs the captured step on the static inputs and writes its result into the
    first replay's output tensor, so later replays overwrite what earlier ones returned),
    counting its instances and replays."""

    made: list[ReplayingStepGraph] = []

    def __init__(self, body, device, stream):
        super().__init__(body, device, stream)
        self.replays = 0
        ReplayingStepGraph.made.append(self)

    def replay(self) -> None:
        super().replay()
        self.replays += 1


def write_text(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["the", "king", "queen", "and", "to", "of", "my", "lord", "ROMEO:", "JULIET:"]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))
                              for _ in range(200)) + "\n", encoding="utf-8")
    return path


def make_run(tmp_path: Path, lr: float = LR, precision: str = "fp32", **train: Any) -> RunParts:
    """A fresh run of a tiny feedback_kv model with dropout and clipping; the curriculum
    lengthens from 8 to 12 after three steps."""
    raw = {
        "run": {"name": "run", "out_dir": str(tmp_path / "runs"), "device": "cpu", "seed": 5,
                "precision": precision},
        "data": {"path": str(write_text(tmp_path / "text.txt"))},
        "model": {"kind": "feedback_kv", "d_model": 16, "n_heads": 2, "d_ff": 32,
                  "n_layers": 2, "max_rel_pos": 16, "dropout": 0.1},
        "train": {"max_steps": STEPS, "batch_size": 3, "lr": lr, "warmup_steps": 4,
                  "schedule": "constant", "grad_clip": 0.05, "eval_windows": 2,
                  "constant_tokens": False, **train},
        "curriculum": [{"until_step": 3, "seq_len": 8}, {"seq_len": 12}],
        "logging": {"tensorboard": False, "progress": False},
    }
    run, _, _ = set_up(config_from_dict(raw), DistContext(torch.device("cpu")),
                       RunDirectory(tmp_path / "runs" / "run", 1), None)
    return run


def state_of(run: RunParts) -> list[torch.Tensor]:
    """Every parameter and every optimizer state tensor (step counts included)."""
    opt = run.optimizer.state_dict()
    return ([p.detach().clone() for p in run.raw_model.parameters()]
            + [v.clone() for s in opt["state"].values() for v in s.values()])


def figures(result) -> tuple:
    """A StepResult without its timing."""
    return (result.loss, result.grad_norm, result.lr, result.seq_len, result.batch_size,
            result.tokens, result.stop, result.memory_rms.item(), result.accuracy)


@pytest.fixture
def stand_in(monkeypatch) -> type[ReplayingStepGraph]:
    monkeypatch.setattr(step_graph, "_StepGraph", ReplayingStepGraph)
    monkeypatch.setattr(ReplayingStepGraph, "made", [])
    return ReplayingStepGraph


def eager_and_graphed(tmp_path: Path, lr: float = LR, precision: str = "fp32"
                      ) -> tuple[list, list, RunParts, RunParts]:
    """STEPS steps of one run eagerly and of a second, from the same seed, graphed."""
    # One after the other: set-up seeds the process's generators, which dropout draws from.
    eager = make_run(tmp_path / "eager", lr, precision)
    eager_results = [train_step(eager, i, StopSignals(), tmp_path / "last.pt")
                     for i in range(STEPS)]
    graphed = make_run(tmp_path / "graphed", lr, precision)
    step_graphs = step_graph.StepGraphs(graphed)
    graphed_results = [train_step(graphed, i, StopSignals(), tmp_path / "last.pt", step_graphs)
                       for i in range(STEPS)]
    return eager_results, graphed_results, eager, graphed


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphed_steps_are_the_eager_steps_bit_for_bit(tmp_path, stand_in, precision):
    """Six steps, a shape change after three: the same figures, weights and AdamW state as
    eager training, bit for bit; the first step of each shape runs eagerly and is captured,
    the other two replay (and each replay overwrote the graph's one output). In bf16 the
    graphs' autocast keeps no cache of cast weights, and casts the same values."""
    eager_results, graphed_results, eager, graphed = eager_and_graphed(tmp_path,
                                                                       precision=precision)
    assert (graphed.amp_dtype is torch.bfloat16) == (precision == "bf16")
    assert [figures(r) for r in graphed_results] == [figures(r) for r in eager_results]
    for a, b in zip(state_of(eager), state_of(graphed), strict=True):
        assert torch.equal(a, b)
    assert [g.replays for g in stand_in.made] == [2, 2]
    # The groups keep float rates outside the step: what a checkpoint saves is eager's.
    assert graphed.optimizer.state_dict()["param_groups"] == \
        eager.optimizer.state_dict()["param_groups"]


def test_graphed_steps_use_the_learning_rate_rounded_to_float32(tmp_path, stand_in,
                                                                 monkeypatch):
    """A rate that is not a float32 number (1e-3) is read as float32 on the device, as CUDA's
    fused AdamW reads a tensor rate: the graphed steps are eager's at that rounded rate,
    and not eager's at the exact one."""
    _, _, exact, graphed = eager_and_graphed(tmp_path, lr=1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(state_of(exact), state_of(graphed),
                                                     strict=True))
    rounded = make_run(tmp_path / "rounded", lr=1e-3)
    lr_at = rounded.schedule.lr_at
    monkeypatch.setattr(rounded.schedule, "lr_at",
                        lambda i: torch.tensor(lr_at(i), dtype=torch.float32).item())
    for i in range(STEPS):
        train_step(rounded, i, StopSignals(), tmp_path / "last.pt")
    for a, b in zip(state_of(rounded), state_of(graphed), strict=True):
        assert torch.equal(a, b)


def test_a_non_finite_replayed_step_stops_before_its_update(tmp_path, stand_in, monkeypatch):
    """An infinite loss in a replayed step: the step stops with train_step's message, and
    the weights and AdamW's state (its step counts too) are those the step started from -
    the graph skipped the update on the device."""
    run = make_run(tmp_path)
    step_graphs = step_graph.StepGraphs(run)
    for i in range(2):  # the capture, and one replay
        train_step(run, i, StopSignals(), tmp_path / "last.pt", step_graphs)
    before = state_of(run)
    score_sums = step.score_sums

    def infinite(logits, y):
        ce, count, correct = score_sums(logits, y)
        return ce * float("inf"), count, correct

    monkeypatch.setattr(step, "score_sums", infinite)  # the body the graph replays
    with pytest.raises(TrainingError, match=r"^step 3: loss is inf; stopped before the "
                                            r"optimizer step, no checkpoint written"):
        train_step(run, 2, StopSignals(), tmp_path / "last.pt", step_graphs)
    assert stand_in.made[0].replays == 2  # it was a replay that stopped
    for a, b in zip(before, state_of(run), strict=True):
        assert torch.equal(a, b)


def test_step_graphs_say_in_one_line_why_they_cannot_run(tmp_path, monkeypatch, capsys):
    """Asked for on the CPU, the trainer's step is train_step after one line naming why;
    not asked for, train_step without a word; and each thing a capture cannot hold is
    named (here with the device taken as CUDA)."""
    run = make_run(tmp_path)
    assert step_graph.step_function(run) is train_step
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(step_graph.GRAPHS_ENV, "1")
    assert step_graph.step_function(run) is train_step
    assert capsys.readouterr().err.splitlines() == [
        "fbtrain: FBTRAIN_CUDA_GRAPHS is set, but the device is cpu, not CUDA; the step runs "
        "eagerly"]
    cuda = DistContext(types.SimpleNamespace(type="cuda"))
    cases = {
        "DDP's gradient all-reduces cannot be captured with the step":
            dict(ctx=DistContext(cuda.device, world_size=2)),
        "train.grad_accum is 2 (only 1 is captured)":
            dict(cfg=dataclasses.replace(run.cfg, train=dataclasses.replace(
                run.cfg.train, grad_accum=2))),
        "fp16 loss scaling decides on the host whether to step (use bf16 or fp32)":
            dict(scaler=types.SimpleNamespace(is_enabled=lambda: True)),
        "train.context carry's memory changes shape between segments":
            dict(cfg=dataclasses.replace(run.cfg, train=dataclasses.replace(
                run.cfg.train, context="carry"))),
        "the optimizer is not fused AdamW (it must read the learning rate on the device)":
            dict(optimizer=torch.optim.SGD(run.params, lr=0.1)),
    }
    assert step_graph.step_graph_problem(dataclasses.replace(run, ctx=cuda)) == ""
    for why, change in cases.items():
        assert step_graph.step_graph_problem(
            dataclasses.replace(run, **{"ctx": cuda, **change})) == why
    monkeypatch.setenv("FBTRAIN_CORE", "python")
    assert step_graph.step_graph_problem(dataclasses.replace(run, ctx=cuda)) == (
        "the PyTorch core syncs with the host (it needs the C++ core)")
    # A model that runs no core (the transformer) does not need a capturable one.
    coreless = dataclasses.replace(run, ctx=cuda, raw_model=torch.nn.Linear(2, 2))
    assert step_graph.step_graph_problem(coreless) == ""


def test_the_trainer_trains_through_step_graphs_where_they_run(tmp_path, stand_in,
                                                               monkeypatch, capsys):
    """``FBTRAIN_CUDA_GRAPHS=1`` where a capture can run (the device check waived for
    the stand-in): the trainer's steps go through the graphs, after the one notice line,
    and its loss log is eager training's."""
    import json

    from fbtrain import train

    def losses(name: str) -> list:
        cfg = make_run(tmp_path / name).cfg
        train.run(cfg, quiet=True)
        lines = (Path(cfg.run.out_dir) / cfg.run.name / "metrics.jsonl").read_text()
        return [(r.get("step"), r.get("loss"), r.get("val/loss"))
                for r in map(json.loads, lines.splitlines())]

    eager = losses("eager")
    monkeypatch.setenv(step_graph.GRAPHS_ENV, "1")
    monkeypatch.setattr(step_graph, "step_graph_problem", lambda run: "")
    capsys.readouterr()
    assert losses("graphed") == eager
    assert step_graph.GRAPHS_NOTICE in capsys.readouterr().err.splitlines()
    assert [g.replays for g in stand_in.made] == [2, 2]


def test_the_gpu_check_script_runs_on_its_cpu_stand_in(tmp_path, monkeypatch, capsys):
    """scripts/step_graph_check.py, the prepared check for a first GPU run, on the CPU: the
    eager and graphed pairs agree bit for bit (exit 0, its JSON says so); at a learning
    rate that is not a float32 number they do not, while eager repeats itself (exit 1)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import step_graph_check

    out = tmp_path / "check.json"
    assert step_graph_check.main(["--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"]["fp32"]
    assert row["bitwise_equal"] and row["captured"] and row["eager_repeatable"]
    assert row["graphed_ms"] > 0 and row["eager_ms"] > 0
    monkeypatch.setattr(step_graph_check, "LR", 1e-3)
    assert step_graph_check.main(["--json", str(out)]) == 1
    row = json.loads(out.read_text())["rows"]["fp32"]
    assert row["eager_repeatable"] and row["captured"] and not row["bitwise_equal"]
    assert "fp32: FAILED" in capsys.readouterr().out
    assert step_graph_check.main(["--require-cuda"]) == 1
    assert capsys.readouterr().err == "error: no CUDA device; this check is for a CUDA machine\n"


def test_a_failed_capture_runs_every_step_eagerly_after_one_line(tmp_path, monkeypatch,
                                                                 capsys):
    """A capture that fails: one notice line, the step it followed already trained eagerly,
    every later step eager too (no capture tried again), and the numbers are eager
    training's."""
    tried = []

    def failing(body, device, stream):
        tried.append(body)
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(step_graph, "_StepGraph", failing)
    eager_results, graphed_results, eager, graphed = eager_and_graphed(tmp_path)
    assert [figures(r) for r in graphed_results] == [figures(r) for r in eager_results]
    for a, b in zip(state_of(eager), state_of(graphed), strict=True):
        assert torch.equal(a, b)
    assert len(tried) == 1
    assert capsys.readouterr().err.splitlines() == [
        "fbtrain: CUDA graph capture of the training step failed (operation not permitted "
        "when stream is capturing); running it eagerly from now on"]
