"""The ETA against the time a run really takes, and the closing line's figures: a run on a
clock the test moves (each step, evaluation and sample costs what the test says), so the
check is exact and no real time is measured."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from typing import Any

import pytest

import fbtrain.sample
from fbtrain.config import config_from_dict
from fbtrain.metrics.logger import MetricsLogger
from fbtrain.train import evaluations, run, trainer
from fbtrain.train.pace import Pace
from tests.test_train import make_raw


class FakeClock:
    """A clock that moves only when told: ``advance(seconds)``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def costed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: FakeClock,
               step_cost: dict[int, float], evaluation: float, sample: float,
               **sections: Any) -> tuple[Path, list[tuple[int, float | None, float]]]:
    """Train a tiny run on ``clock``: a step at sequence length L costs ``step_cost[L]``
    seconds (also its own time, for tokens/s), an evaluation ``evaluation``, a sample
    ``sample``. Returns the run directory and every progress line's (step, ETA, time)."""
    real_step_function = trainer.step_function
    real_scores, real_generate = evaluations.window_scores, fbtrain.sample.generate

    def step_function(run_: Any) -> Any:
        step = real_step_function(run_)

        def costed(run_: Any, index: int, *args: Any) -> Any:
            result = step(run_, index, *args)
            cost = step_cost[run_.curriculum.seq_len_at(index)]
            clock.advance(cost)
            return dataclasses.replace(result, seconds=cost)
        return costed

    def scores(*args: Any, **kw: Any) -> Any:
        clock.advance(evaluation)
        return real_scores(*args, **kw)

    def generate(*args: Any, **kw: Any) -> Any:
        clock.advance(sample)
        return real_generate(*args, **kw)

    shown: list[tuple[int, float | None, float]] = []
    real_progress = MetricsLogger.progress

    def progress(self: MetricsLogger, step: int, postfix: dict[str, Any],
                 remaining: float | None = None) -> None:
        shown.append((step, remaining, clock.now))
        real_progress(self, step, postfix, remaining)

    monkeypatch.setattr(trainer, "step_function", step_function)
    monkeypatch.setattr(evaluations, "window_scores", scores)
    monkeypatch.setattr(fbtrain.sample, "generate", generate)
    monkeypatch.setattr(MetricsLogger, "progress", progress)
    run_dir = run(config_from_dict(make_raw(tmp_path, **sections)), clock=clock)
    return run_dir, shown


def test_the_eta_holds_when_the_later_stage_is_slower_and_evaluations_cost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The main job's shape: a short first stage, then a longer one whose step costs twice
    as much at the same tokens (a feedback model steps through twice the positions), an
    evaluation every 5 steps costing 6 steps' worth and a sample 2. From 20% of the run's
    time on, every ETA is within 25% of the time that really remained. Then the closing
    line: its rate is its tokens over its steps' time, and its wall time adds up."""
    clock = FakeClock()
    run_dir, shown = costed_run(
        tmp_path, monkeypatch, clock, step_cost={8: 1.0, 16: 2.0}, evaluation=6.0,
        sample=2.0, train={"max_steps": 40, "eval_every": 5, "log_every": 1,
                           "constant_tokens": True},
        curriculum=[{"until_step": 10, "seq_len": 8}, {"seq_len": 16}],
        checkpoint={"every": 10})
    end = clock.now
    # 10 steps of 1 s, 30 of 2 s, 9 evaluations (step 0 too) and their samples.
    assert end == pytest.approx(10 * 1 + 30 * 2 + 9 * (6 + 2))
    assert [step for step, _, _ in shown] == list(range(1, 41))
    checked = [(step, eta, end - now) for step, eta, now in shown if now >= 0.2 * end]
    assert checked[0][0] <= 15  # the check starts early in the slower stage
    for step, eta, left in checked:
        assert eta is not None and abs(eta - left) <= 0.25 * left, (step, eta, left)
    # The last line's ETA is exactly the final evaluation and sample still to come.
    assert shown[-1][1] == pytest.approx(6.0 + 2.0)

    closing = capsys.readouterr().out.splitlines()[-2:]
    tokens = 40 * 4 * 16
    assert closing == [
        f"{tokens:,} tokens in 1m10s of steps | {tokens / 70:,.0f} tokens/s on cpu "
        f"({closing[0].split('on cpu (', 1)[1]}",
        "wall 2m22s: 1m10s steps, 54s evaluating, 18s sampling, 0s other"], closing
    assert (run_dir / "checkpoints" / "last.pt").is_file()


def test_the_eta_counts_an_unreached_stage_by_its_tokens(tmp_path: Path) -> None:
    """Before a stage's first step its step is costed at the measured stage's cost per
    token: a stage of twice the tokens a step, twice the seconds."""
    clock = FakeClock()
    cfg = config_from_dict(make_raw(tmp_path, train={
        "max_steps": 20, "eval_every": 100, "sample_every": 0, "constant_tokens": False},
        curriculum=[{"until_step": 10, "seq_len": 8}, {"seq_len": 16}],
        checkpoint={"every": 100}))
    pace = Pace(cfg, window=8, clock=clock)
    assert pace.remaining(0) is None  # nothing measured yet
    pace.start()
    for index in range(4):
        clock.advance(3.0 if index == 0 else 1.0)  # the first step: warm-up, left out
        pace.trained(index)
    # 6 steps of stage 0 at 1 s, 10 of stage 1 (16 tokens a row, not 8) at 2 s, and the
    # last step's evaluation and save, not yet measured: 0.
    assert pace.remaining(4) == pytest.approx(6 * 1.0 + 10 * 2.0)


def test_a_stage_costs_what_its_last_steps_cost(tmp_path: Path) -> None:
    """A shared machine's load changes: the cost a step is the mean of the stage's last
    ``window`` steps, so the ETA follows a slow-down within a window's steps."""
    clock = FakeClock()
    cfg = config_from_dict(make_raw(tmp_path, train={
        "max_steps": 100, "eval_every": 1000, "sample_every": 0},
        curriculum=[{"seq_len": 8}], checkpoint={"every": 1000}))
    pace = Pace(cfg, window=4, clock=clock)
    pace.start()
    for index, cost in enumerate([3.0] + [1.0] * 4 + [2.0] * 3):
        clock.advance(cost)
        pace.trained(index)
    assert pace.remaining(8) == pytest.approx(92 * (1.0 + 3 * 2.0) / 4)
    clock.advance(2.0)
    pace.trained(8)
    assert pace.remaining(9) == pytest.approx(91 * 2.0)  # the window holds the slow steps


@pytest.mark.parametrize(("eval_every", "save_every", "sample_every", "max_steps"),
                         list(itertools.product([1, 3, 5], [2, 3, 7], [None, 0, 4], [9, 15])))
def test_the_evaluations_samples_and_saves_due_are_the_trainers(
        tmp_path: Path, eval_every: int, save_every: int, sample_every: int | None,
        max_steps: int) -> None:
    """Counted as the trainer's cadence fires them, step by step (evaluations.sample_due):
    an evaluation every eval_every steps and at the last, a save at each evaluation (a
    possible best), each checkpoint.every steps and the last."""
    cfg = config_from_dict(make_raw(tmp_path, train={
        "max_steps": max_steps, "eval_every": eval_every, "sample_every": sample_every},
        checkpoint={"every": save_every}))
    pace = Pace(cfg, window=8)
    for first in range(1, max_steps + 2):
        steps = range(first, max_steps + 1)
        evaluated = [s for s in steps if s % eval_every == 0 or s == max_steps]
        want = {"evaluation": len(evaluated),
                "sample": sum(evaluations.sample_due(cfg.train, s, s in evaluated) for s in steps),
                "save": sum(s in evaluated or s % save_every == 0 for s in steps)}
        assert pace._events_due(first) == want, first


def test_the_closing_line_of_a_short_run_shows_tenths(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Under a minute of wall time whole seconds would read "0s of steps" beside a rate:
    tenths, which add up too."""
    run(config_from_dict(make_raw(tmp_path, train={"max_steps": 4})))
    closing = capsys.readouterr().out.splitlines()[-2:]
    steps = re.fullmatch(r"([\d,]+) tokens in (\d+\.\d)s of steps \| ([\d,]+) tokens/s on "
                         r"cpu \(.*\)", closing[0])
    assert steps, closing
    wall = re.fullmatch(r"wall (\d+\.\d)s: (\d+\.\d)s steps, (\d+\.\d)s evaluating, "
                        r"(?:(\d+\.\d)s sampling, )?(\d+\.\d)s other", closing[1])
    assert wall, closing
    shown = [float(x) for x in wall.groups() if x is not None]
    assert shown[0] == pytest.approx(sum(shown[1:]))
    assert wall.group(2) == steps.group(2)
