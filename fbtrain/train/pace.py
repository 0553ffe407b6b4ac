"""How long the rest of a run will take: the ETA of the status line.

A run's time goes to its steps, whose cost depends on the curriculum stage, and to its
evaluations, samples and checkpoint saves, which cost seconds each whatever the stage. The
ETA adds up what is left of each:

- the steps left in each stage, at that stage's measured cost a step: the wall time from
  the end of one step's training to the end of the next one's, less the evaluations,
  samples and saves timed in between (so logging and fetching batches count), averaged
  over the stage's last ``window`` steps (the load of a shared machine changes). A stage not
  reached yet is costed per token at the rate of the nearest stage before it that was
  measured. That is exact for a model whose step costs what its tokens do (the parallel
  transformer); a feedback model steps through its sequence one position at a time, so a
  later, longer stage costs somewhat more per token, and the ETA is that much short until
  the stage's first step is measured;
- the evaluations, samples and saves still due, at the measured mean of each (every
  evaluation scores the same fixed windows; a save is counted at every evaluation, as if it
  made a new best, and at every ``checkpoint.every`` steps and the last one).

The first measurement of each kind in a process (a stage's first step, the untrained model's
evaluation) also pays for allocations and first calls that later ones do not: it stands in
until another is measured, then is left out. Every time comes from one clock,
``time.perf_counter`` unless a caller (a test) passes its own.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from fbtrain.config import Config
from fbtrain.config.curriculum import Curriculum

Clock = Callable[[], float]
EVENTS = ("evaluation", "sample", "save")  # the work between steps that the ETA counts


class Mean:
    """Seconds a piece of work takes: the mean of its last ``window`` measurements (on a
    shared machine the load of the last minutes says more about the next ones than that
    of the run's start), the first one kept apart (warm-up)."""

    def __init__(self, window: int):
        self.first: float | None = None
        self.recent: deque[float] = deque(maxlen=window)
        self.spent = 0.0  # seconds of every measurement, the first included

    def add(self, seconds: float) -> None:
        self.spent += seconds
        if self.first is None:
            self.first = seconds
        else:
            self.recent.append(seconds)

    @property
    def seconds(self) -> float | None:
        """The mean of the recent measurements; the first while it is the only one."""
        return sum(self.recent) / len(self.recent) if self.recent else self.first


class Pace:
    """Measures where a run's time goes and predicts the rest (:meth:`remaining`).

    The trainer calls :meth:`start` as its loop starts, :meth:`trained` as each step's
    training ends, and wraps each evaluation, sample and save in :meth:`timing`. Each cost
    is the mean of its last ``window`` measurements.
    """

    def __init__(self, cfg: Config, window: int, clock: Clock = time.perf_counter):
        self.clock, self.window = clock, window
        self.curriculum = Curriculum(cfg)
        self.train = cfg.train
        self.save_every = cfg.checkpoint.every
        self.steps: dict[int, Mean] = {}  # a step's seconds, by curriculum stage index
        self.events = {kind: Mean(window) for kind in EVENTS}
        self._mark = clock()  # the end of the last step's training (or the loop's start)
        self._in_events = 0.0  # seconds of the events timed since the mark

    def start(self) -> None:
        """The training loop starts now (set-up and any evaluation before it are behind)."""
        self._mark = self.clock()
        self._in_events = 0.0

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Time one evaluation, sample or save (counted as that, not as the step's)."""
        start = self.clock()
        try:
            yield
        finally:
            seconds = self.clock() - start
            self.events[kind].add(seconds)
            self._in_events += seconds

    def trained(self, index: int) -> None:
        """The training of the step with 0-based ``index`` ended now: record its cost."""
        now = self.clock()
        seconds = now - self._mark - self._in_events
        stage = self.curriculum.stage_index_at(index)
        self.steps.setdefault(stage, Mean(self.window)).add(seconds)
        self._mark, self._in_events = now, 0.0

    def remaining(self, step: int, *, events_done: bool = False) -> float | None:
        """Seconds left after ``step`` steps: the steps still to train, and the
        evaluations, samples and saves still due, those of ``step`` itself too unless
        ``events_done``. None before any step was measured."""
        costs = self._stage_costs()
        if costs is None:
            return None
        seconds = sum(costs[i] * n for i, n in self._steps_left(step).items())
        for kind, count in self._events_due(step + 1 if events_done else step).items():
            seconds += count * (self.events[kind].seconds or 0.0)
        return seconds

    # ------------------------------------------------------------------ the plan

    def _stage_costs(self) -> dict[int, float] | None:
        """Seconds a step of every stage: measured, or costed per token at the nearest
        measured stage before it (after it, for a stage resumed past)."""
        stages = self.curriculum.stages
        measured = {i: m.seconds for i, m in self.steps.items() if m.seconds is not None}
        if not measured:
            return None
        costs = {}
        for i in range(len(stages)):
            if i in measured:
                costs[i] = measured[i]
                continue
            before = [j for j in measured if j < i]
            j = max(before) if before else min(measured)
            costs[i] = measured[j] * self._tokens_of(i) / self._tokens_of(j)
        return costs

    def _tokens_of(self, stage: int) -> int:
        """Tokens a step of ``stage`` trains (per rank and micro-batch: only ratios count)."""
        start = self._stage_start(stage)
        return self.curriculum.batch_size_at(start) * self.curriculum.stages[stage].seq_len

    def _stage_start(self, stage: int) -> int:
        return 0 if stage == 0 else (self.curriculum.stages[stage - 1].until_step or 0)

    def _steps_left(self, step: int) -> dict[int, int]:
        """Steps still to train in each stage, from 0-based index ``step`` on."""
        stages, end = self.curriculum.stages, self.train.max_steps
        left: dict[int, int] = {}
        for i, stage in enumerate(stages):
            until = end if stage.until_step is None else min(stage.until_step, end)
            if i == len(stages) - 1:
                until = end
            n = until - max(step, self._stage_start(i))
            if n > 0:
                left[i] = n
        return left

    def _events_due(self, first: int) -> dict[str, int]:
        """How many evaluations, samples and saves are due at steps ``first`` .. the last."""
        train, last = self.train, self.train.max_steps
        if first > last:
            return dict.fromkeys(EVENTS, 0)
        evaluations = _multiples(train.eval_every, first, last)
        every = train.sample_every
        samples = (evaluations if every is None
                   else 0 if every == 0 else _multiples(every, first, last))
        # A save at each evaluation step and each checkpoint.every step: the steps both
        # count (multiples of both, and the last) once.
        both = _multiples(math.lcm(train.eval_every, self.save_every), first, last)
        saves = evaluations + _multiples(self.save_every, first, last) - both
        return {"evaluation": evaluations, "sample": samples, "save": saves}


def _multiples(n: int, first: int, last: int) -> int:
    """Steps from ``first`` to ``last`` (both included) that are multiples of ``n``, and
    ``last`` itself (every cadence fires at the last step)."""
    count = last // n - (first - 1) // n
    return count + (0 if last % n == 0 else 1)
