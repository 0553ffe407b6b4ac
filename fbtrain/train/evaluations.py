"""What a training run measures between steps: the validation loss on the fixed windows and
the logged samples (rank 0 does both; the other ranks wait at the next collective).

Both run in :func:`~fbtrain.inference.inference` (no gradients, eval mode, the random
streams preserved), so neither moves a number training draws, and under
:meth:`~fbtrain.train.signals.StopSignals.interruptible`, so a signal cuts them short.
"""

from __future__ import annotations

import math
import signal
from typing import Any

import fbtrain.train.report as report
from fbtrain.config import TrainConfig
from fbtrain.config.limits import allocation_failed
from fbtrain.errors import UserError, signal_exit_code
from fbtrain.evaluate import loss_figures
from fbtrain.inference import inference
from fbtrain.metrics.logger import MetricsLogger
from fbtrain.rng import sample_generator, sample_seed
from fbtrain.scoring import window_scores
from fbtrain.train.oom import is_allocation_failure
from fbtrain.train.pace import Pace
from fbtrain.train.setup import RunParts, TrainState
from fbtrain.train.signals import StopRequested, StopSignals
from fbtrain.train.step import TrainingError

EVAL_BATCH = 64  # validation windows per forward: no gradients, so wide batches are cheap


class Evaluator:
    """Evaluates and samples the run's ``parts`` at ``state``'s step, timed by ``pace`` and
    logged by ``logger``. ``last_sample``: (step, text) of the newest sample, which the
    console shows at the end (samples go to TensorBoard; one each evaluation would flood
    the terminal)."""

    def __init__(self, parts: RunParts, state: TrainState, pace: Pace, logger: MetricsLogger):
        self.parts, self.state, self.pace, self.logger = parts, state, pace, logger
        self.last_sample: tuple[int, str] | None = None
        self._samples_off = False  # a sample ran out of memory: no more this run

    def untrained(self, signals: StopSignals) -> None:
        """Step 0: the untrained model's validation loss (and a sample), so every curve
        starts at the start. Not a candidate for best.pt: there is nothing to save yet."""
        record: dict[str, Any] = {}
        try:
            self.evaluate(record, signals, candidate=False)
            if record:
                self.logger.log(0, record)
            if sample_due(self.parts.cfg.train, 0, evaluated=True):
                self.sample(signals)
        except StopRequested:
            received = signals.received or signal.SIGINT
            raise TrainingError(f"interrupted before the first step "
                                f"({signal.Signals(received).name}); nothing was trained, so "
                                "no checkpoint was written", signal_exit_code(received)) from None

    def missed(self) -> bool:
        """Whether the checkpoint resumed from is at an evaluation step whose evaluation a
        stop cut short (:attr:`TrainState.val_step` behind it)."""
        step, train = self.state.step, self.parts.cfg.train
        due = step > 0 and (step % train.eval_every == 0 or step == train.max_steps)
        return due and self.state.val_step != step

    def at_step(self, record: dict[str, Any], signals: StopSignals, evaluated: bool
                ) -> tuple[bool, str]:
        """Evaluate (``evaluated``), log ``record`` with the validation figures, then sample
        when due. A stop cuts this short; ``record`` (the step's training figures) is logged
        all the same. Returns whether the evaluation made a new best, and what a stop cut
        short: "evaluation", "sample" or ""."""
        step = self.state.step
        improved, doing = False, ""
        try:
            if evaluated:
                doing = "evaluation"
                improved = self.evaluate(record, signals)
            if record:
                self.logger.log(step, record)
                record = {}
            if sample_due(self.parts.cfg.train, step, evaluated):
                doing = "sample"
                self.sample(signals)
            doing = ""
        except StopRequested:
            pass
        finally:  # the training figures of a step whose evaluation was cut short (or failed)
            if record:
                self.logger.log(step, record)
        return improved, doing

    def evaluate(self, record: dict[str, Any], signals: StopSignals,
                 candidate: bool = True) -> bool:
        """Validation loss on the fixed windows (rank 0), added to ``record`` and said in
        one line; True when it is the best so far. ``candidate=False`` (step 0) logs the
        loss without making it the best to beat."""
        parts, state = self.parts, self.state
        if not parts.ctx.is_main:
            return False
        data = parts.data
        # The inference context `fbtrain eval` scores in too: its figure is this one.
        with self.pace.timing("evaluation"), \
                inference(parts.raw_model, parts.cfg.run.precision, parts.ctx.device), \
                signals.interruptible():
            scores = window_scores(parts.raw_model, data.val_x, data.val_y, EVAL_BATCH)
        loss = scores.loss
        state.val_loss = loss
        state.val_step = state.step
        improved = candidate and math.isfinite(loss) and (state.best_val_loss is None
                                                          or loss < state.best_val_loss)
        if improved:
            state.best_val_loss = loss
        metrics = {f"val/{k}": v
                   for k, v in loss_figures(loss, data.chars_per_token[1]).items()}
        state.val_bpc = metrics["val/bpc"]
        if data.labelled:
            metrics["val/accuracy"] = scores.accuracy
        record.update(metrics)
        self.logger.info(report.evaluation_line(state.step, metrics, improved,
                                                len(data.val_x)))
        return improved

    def sample(self, signals: StopSignals) -> None:
        """A short generated text for the log (rank 0), from its own seeded generator; none
        more once one ran out of memory (the process is at its limit: training comes
        first)."""
        parts, step = self.parts, self.state.step
        if not parts.ctx.is_main or self._samples_off:
            return
        from fbtrain.sample import NonFiniteLogits, generate

        tokenizer = parts.data.tokenizer
        # A sample must not cost the training run what it may meet by design (a diverging
        # model's logits, a user's limit, memory running out); anything else is a bug and
        # keeps its traceback.
        try:
            generator = sample_generator(sample_seed(parts.cfg.run.seed, step))
            # generate runs in the inference context
            with self.pace.timing("sample"), signals.interruptible():
                text = generate(parts.raw_model, tokenizer, tokenizer.start,
                                parts.cfg.train.sample_length, generator=generator,
                                precision=parts.cfg.run.precision)[0]
        except (NonFiniteLogits, UserError) as e:
            reason = str(e) or type(e).__name__
        except (MemoryError, RuntimeError, SystemError, OSError) as e:
            if not is_allocation_failure(e):  # a MemoryError says nothing of itself
                raise
            self._samples_off = True
            reason = allocation_failed(e, "", "no more samples are drawn in this run")
        else:
            self.logger.log_text(step, "sample", text, echo=False)
            self.last_sample = (step, text)
            return
        self.logger.info(f"warning: sampling failed at step {step}: {reason}")


def sample_due(train: TrainConfig, step: int, evaluated: bool) -> bool:
    """A sample with every evaluation (``sample_every: null``), or every N steps and at the
    end (N > 0), or never (0)."""
    every = train.sample_every
    if every is None:
        return evaluated
    return every > 0 and (step % every == 0 or step == train.max_steps)
