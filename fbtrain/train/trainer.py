"""The training loop and its cadence: log, evaluate, sample and checkpoint as the step
number asks; stop on a signal.

``run(cfg)`` trains into ``<run.out_dir>/<run.name>/`` and returns that folder::

    config.yaml  vocab.json  metrics.jsonl  checkpoints/
    events.out.tfevents.*  val/events.out.tfevents.*

Step numbering: ``step`` counts optimizer steps done, so the first trained step is logged
and checkpointed as step 1. The step being trained has 0-based index ``step`` (= its logged
number minus one); the curriculum, the batch size and the learning rate are looked up with
that index, so ``until_step: 300`` means exactly the steps logged 1..300 run at that stage.

Where the parts live: :mod:`.setup` builds the run (in one visible order), :mod:`.step`
trains one step, :mod:`.signals` decides when to stop, :mod:`.report` says what happens,
and what a checkpoint holds is named there too (:func:`~.setup.state_parts`).

Exact resume: the checkpoint holds the model, optimizer, step, tokens and every random
stream (Python, torch, CUDA, the batch sampler), and in carry mode the stream cursor and
the carried memory. Evaluation and sampling run in :func:`~fbtrain.inference.inference`
(which holds :func:`~fbtrain.rng.preserve_rng`), so they never shift those streams, and the
learning rate is a pure function of the step. On the CPU, N steps + resume + N steps is
bitwise 2N straight steps.

Errors: :class:`TrainingError` carries the exit code (1: non-finite loss or gradient norm;
129 / 130 / 143: SIGHUP / SIGINT / SIGTERM, after saving). DataError, CheckpointError,
DeviceError and ConfigError come through unchanged (the CLI makes them exit code 2).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fbtrain.train.report as report
from fbtrain.checkpoint.best import heal_best
from fbtrain.checkpoint.contents import summarize_names
from fbtrain.checkpoint.files import CheckpointManager
from fbtrain.config import Config, TrainConfig
from fbtrain.config.kinds import model_kind
from fbtrain.config.limits import allocation_failed
from fbtrain.device import matmul_precision
from fbtrain.distributed import DistContext, is_peer_failure, peer_lost, session
from fbtrain.errors import UserError
from fbtrain.evaluate import loss_figures
from fbtrain.inference import inference
from fbtrain.metrics.console import Console
from fbtrain.metrics.logger import MetricsLogger, text_block
from fbtrain.metrics.tensorboard import SUBRUNS, hparams_of
from fbtrain.rng import sample_generator, sample_seed
from fbtrain.rundir import ResumeChoice, RunDirLock, write_run_files
from fbtrain.rundir_checks import check_folders, check_path_length, check_writable
from fbtrain.runhistory import record_segment
from fbtrain.scoring import window_scores
from fbtrain.train.oom import is_allocation_failure, out_of_memory, setting_up
from fbtrain.train.pace import Clock, Pace
from fbtrain.train.setup import (
    Progress,
    Run,
    Seams,
    checkpoint_payload,
    finished,
    resume_choice,
    set_up,
)
from fbtrain.train.signals import EXIT_CODES, StopRequested, StopSignals
from fbtrain.train.step import EXIT_NONFINITE, StepResult, TrainingError, train_step
from fbtrain.train.step_graph import graphs_requested, step_function

EVAL_BATCH = 64  # validation windows per forward: no gradients, so wide batches are cheap

StepHook = Callable[[int], None]  # called with the step number after each step's training


def run(cfg: Config, *, resume: str | None = None, quiet: bool = False,
        on_step: StepHook | None = None, clock: Clock = time.perf_counter,
        seams: Seams | None = None) -> Path:
    """Train as ``cfg`` says and return the run directory.

    ``resume``: None starts fresh (refused with a ConfigError when the run directory already
    holds a run's checkpoints or metrics, so a trained run is never overwritten by
    accident); ``"auto"`` continues from the newest checkpoint there that loads
    (``last.pt``, else the highest step), and starts fresh only where none was saved; any
    other value is a checkpoint file or run directory to continue from
    (:func:`fbtrain.rundir.choose_resume`). ``quiet`` turns the
    console (progress, messages) off but for the one-line summary; files are written the
    same. ``on_step(step)``
    runs after each trained step, before its evaluation and save (for tests); ``clock``
    times the run for its ETA and closing line (a test's own, for costs it sets);
    ``seams``: how the data, the model and checkpoint files are made (:class:`Seams`; for
    harnesses).
    """
    graphs_requested()  # a bad $FBTRAIN_CUDA_GRAPHS is refused before anything is made
    with session(cfg.run.device) as ctx, matmul_precision(cfg.run.precision, ctx.device):
        trainer = Trainer(cfg, ctx, quiet=quiet, on_step=on_step, clock=clock, seams=seams)
        try:
            return trainer.fit(resume)
        except RuntimeError as e:
            if not (ctx.enabled and is_peer_failure(e)):
                raise
            # A rank died: one line, not gloo's traceback (torchrun shows which one failed).
            raise peer_lost(ctx, trainer.manager.last_path, trainer.completed) from None


class Trainer:
    """One training run: :meth:`fit` owns the run directory, builds the run, trains.

    What :meth:`fit` builds, once the directory is owned: ``run`` (its parts, frozen),
    ``progress`` (the step, tokens and losses so far) and ``logger``.
    """

    run: Run
    progress: Progress
    logger: MetricsLogger

    def __init__(self, cfg: Config, ctx: DistContext, *, quiet: bool = False,
                 on_step: StepHook | None = None, clock: Clock = time.perf_counter,
                 seams: Seams | None = None):
        self.cfg, self.ctx, self.quiet, self.on_step = cfg, ctx, quiet, on_step
        self.seams = seams or Seams()
        self.run_dir = Path(cfg.run.out_dir) / cfg.run.name
        self.manager = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last,
                                         self.seams.write_checkpoint)
        self.run_lock = RunDirLock(self.run_dir, enabled=ctx.is_main)
        # The status line's rate and the ETA's costs: over the steps of its last lines.
        window = report.RATE_LINES * cfg.train.log_every
        self.throughput = report.Throughput(window)
        self.pace = Pace(cfg, window, clock)  # where the time goes, and the ETA
        # (step, text) of the newest sample: samples go to TensorBoard, and the console
        # shows only this one, at the end (a sample every evaluation floods the terminal).
        self.last_sample: tuple[int, str] | None = None
        self._status_lacks_rate = False  # the status line shown has no rate yet
        self._last_shown: dict[str, Any] = {}
        self.completed = False  # every step trained and the last one saved
        self._samples_off = False  # a sample ran out of memory: no more this run

    def fit(self, resume: str | None) -> Path:
        """Set up (fresh, resumed or warm-started), train to ``max_steps``, return the run dir.

        The run directory is created and owned (locked) first, and every decision about
        what it holds (fresh start, resume, refusal) is taken while the lock is held: a
        second process can never act on what it saw before the first one finished. A fresh
        start that fails before it wrote anything leaves no directory behind.
        """
        if self.ctx.is_main:
            check_path_length(self.run_dir)  # before mkdir: its error would print it whole
            check_folders(self.run_dir)
            self.run_lock.create_and_acquire()
        self.ctx.barrier()  # other ranks read the directory once rank 0 owns it
        wrote = False
        try:
            if self.ctx.is_main:  # what a save would fail on, refused before training
                check_writable(self.run_dir, SUBRUNS if self.cfg.logging.tensorboard else ())
            started = self.pace.clock()
            choice = resume_choice(self.cfg, self.manager, resume)
            if finished(self.cfg, choice):  # said before any data is loaded (or downloaded)
                self._say_finished(choice)
                return self.run_dir
            try:
                self.run, self.progress, resume_path = set_up(
                    self.cfg, self.ctx, self.manager, resume, choice, self.seams)
            except (MemoryError, RuntimeError, SystemError, OSError) as e:
                if not is_allocation_failure(e):
                    raise
                raise setting_up(e) from None
            wrote = True
            # A resume with nothing to train leaves the directory's files as they were:
            # config.yaml describes the checkpoints it holds, not settings none was made with.
            trains = self.progress.step < self.cfg.train.max_steps
            if self.ctx.is_main and (resume_path is None or trains):
                write_run_files(self.run_dir, self.cfg, self.run.data.tokenizer,
                                fresh=resume_path is None)
                record_segment(self.run_dir, self.run.segment, start_step=self.progress.step,
                               resumed_from=None if resume_path is None else str(resume_path),
                               config=self.cfg.to_dict())
            self.ctx.barrier()
            self.logger = MetricsLogger(
                self.run_dir, tensorboard=self.cfg.logging.tensorboard,
                console=not self.quiet, progress=self.cfg.logging.progress,
                total_steps=self.cfg.train.max_steps, initial_step=self.progress.step,
                enabled=self.ctx.is_main)
            try:
                self._train(resume_path, started)
            finally:
                self.logger.close()
            return self.run_dir
        finally:
            if not wrote:
                self.run_lock.remove_created()
            self.run_lock.release()

    def _train(self, resume_path: Path | None, started: float) -> None:
        """Log the start, run the loop under the stop signals, log the end."""
        # Resumed: drop lines the abandoned run logged after the checkpoint. Fresh: all.
        self.logger.truncate_after(self.progress.step if resume_path is not None else -1)
        if resume_path is None:
            self.logger.start_run(hparams_of(self.cfg, self.ctx.world_size),
                                  memory_weights=model_kind(self.cfg.model.kind).memory_mix,
                                  labelled=self.run.data.labelled)
        for line in report.announcement(self.run, self.progress, resume_path,
                                        self.run_lock.removed):
            self.logger.info(line)
        if self.run.warm_report is not None:
            self.logger.info(self.run.warm_report.summary())
        with StopSignals(allow_interrupts=not self.ctx.enabled) as signals:
            self._loop(signals)
        self.completed = True
        self.logger.end_run()
        self.logger.raise_failure()
        if self.last_sample is not None:  # the one sample the console shows: the last
            self.logger.info(text_block("sample", *self.last_sample))
        events = self.pace.events
        spent = report.SegmentTime(
            wall=self.pace.clock() - started, tokens=self.throughput.tokens,
            steps=self.throughput.seconds, evaluating=events["evaluation"].spent,
            sampling=events["sample"].spent)
        self.logger.result(report.summary(self.run, self.progress, spent))
        self.ctx.barrier()

    def _say_finished(self, choice: ResumeChoice) -> None:
        """A run resumed with nothing left to train: that it is done, and its closing line
        (no segment recorded; no file written but a best.pt put right, which a save that
        failed left behind the best the run recorded)."""
        assert choice.path is not None and choice.payload is not None
        console = Console(enabled=self.ctx.is_main, quiet=self.quiet)
        done, closing = report.finished_lines(self.run_dir, choice.path, choice.payload,
                                              self.cfg.train.max_steps)
        console.info(f"run directory: {self.run_dir}")
        progress = choice.payload.get("progress")
        best = progress.get("best_val_loss") if isinstance(progress, dict) else None
        healed = heal_best(self.manager, best) if self.ctx.is_main else None
        if healed:
            console.info(healed)
        console.info(done)
        console.result(closing)

    # ------------------------------------------------------------------ loop

    def _loop(self, signals: StopSignals) -> None:
        plan, progress = self.run.curriculum, self.progress
        max_steps = self.cfg.train.max_steps
        if progress.step >= max_steps:
            self.logger.info(f"nothing to train: the checkpoint is at step {progress.step} "
                             f"and train.max_steps is {max_steps}")
        prev_seq_len = plan.seq_len_at(max(0, progress.step - 1)) if progress.step else None
        if progress.step == 0 and max_steps > 0:
            self._evaluate_untrained(signals)
        elif self._evaluation_missed():
            self._catch_up_evaluation(signals)
        self.logger.raise_failure()  # a log file that cannot be written: before training on
        # train_step, through whole-step CUDA graphs where $FBTRAIN_CUDA_GRAPHS asks
        step = step_function(self.run) if progress.step < max_steps else train_step
        self.pace.start()
        while progress.step < max_steps:
            seq_len = plan.seq_len_at(progress.step)
            if prev_seq_len is not None and seq_len != prev_seq_len:
                self.logger.info(report.curriculum_line(
                    prev_seq_len, seq_len, plan.batch_size_at(progress.step), progress.step))
            prev_seq_len = seq_len
            try:
                result = step(self.run, progress.step, signals, self.manager.last_path)
            except (MemoryError, RuntimeError) as e:
                if not is_allocation_failure(e):
                    raise
                raise out_of_memory(self.run, progress.step) from None
            self.pace.trained(progress.step)
            self.throughput.add(result.tokens, result.seconds)
            progress.step += 1
            progress.tokens += result.tokens
            self._after_step(result, signals)
            if self._status_lacks_rate and self.throughput.recent_rate() is not None:
                self._redraw_status()

    def _after_step(self, result: StepResult, signals: StopSignals) -> None:
        """Log, evaluate, sample and checkpoint as the step number asks; stop on a signal.

        A signal during the evaluation or the sample cuts it short (that step then logs no
        validation figure); the step itself is saved all the same."""
        cfg, step = self.cfg, self.progress.step
        final = step == cfg.train.max_steps
        record: dict[str, Any] = {}
        if step % cfg.train.log_every == 0 or final:
            record.update(self._train_metrics(result))
        if self.on_step is not None:
            self.on_step(step)
        evaluated = step % cfg.train.eval_every == 0 or final
        improved, cut = self._evaluate_and_sample(record, signals, evaluated)
        # Under DDP the stop the ranks agreed on at the step; alone, any signal so far.
        stop = result.stop if self.ctx.enabled else signals.received
        every = step % cfg.checkpoint.every == 0
        # A log file that could not be written stops the run, but the step is saved first.
        failed = self.logger.failure is not None
        if every or final or improved or stop is not None or failed:
            self._save(numbered=every or final, best=improved)
        self.logger.raise_failure()
        if final and not self.ctx.enabled:
            stop = signals.received  # one that came during the final save counts too
        if stop is not None:
            # The last step stops the same way: a signal is never answered with exit 0,
            # and a cut-short final sample must not leave an older one as "the last".
            self.ctx.barrier()  # torchrun ends every rank once one exits: let rank 0 finish
            raise TrainingError(report.interrupted_line(step, stop, self.manager.last_path,
                                                        final=final, cut=cut),
                                EXIT_CODES[stop])

    def _train_metrics(self, result: StepResult) -> dict[str, Any]:
        """The step's metrics (tokens/s since the last record), also shown on the progress
        line (tokens/s over the last steps, and the ETA)."""
        metrics = report.step_metrics(self.run, result, self.progress.tokens,
                                      self.throughput.window_rate())
        shown = {k: metrics[k] for k in ("loss", "bpc", "accuracy", "seq_len", "lr")
                 if k in metrics}
        rate = self.throughput.recent_rate()
        if rate is not None:
            shown["tokens_per_sec"] = rate
        self.logger.progress(self.progress.step, shown,
                             remaining=self.pace.remaining(self.progress.step))
        # The first steps of a process are not measured (warm-up): a line shown before any
        # was has no rate, and is redrawn with it after the next step.
        self._status_lacks_rate = rate is None
        self._last_shown = shown
        return metrics

    def _redraw_status(self) -> None:
        """The status line again, at this step, now with the rate and the ETA (its other
        figures are the last shown: a status line, not a metrics record)."""
        shown = {**self._last_shown, "tokens_per_sec": self.throughput.recent_rate()}
        self.logger.progress(self.progress.step, shown, remaining=self.pace.remaining(
            self.progress.step, events_done=True))
        self._status_lacks_rate = False

    # ------------------------------------------------------------------ evaluation, samples

    def _evaluate_untrained(self, signals: StopSignals) -> None:
        """Step 0: the untrained model's validation loss (and a sample), so every curve
        starts at the start. Not a candidate for best.pt: there is nothing to save yet."""
        record: dict[str, Any] = {}
        try:
            self._evaluate(record, signals, candidate=False)
            if record:
                self.logger.log(0, record)
            if sample_due(self.cfg.train, 0, evaluated=True):
                self._log_sample(signals)
        except StopRequested:
            received = signals.received or signal.SIGINT
            raise TrainingError(f"interrupted before the first step "
                                f"({signal.Signals(received).name}); nothing was trained, so "
                                "no checkpoint was written", EXIT_CODES[received]) from None

    def _evaluation_missed(self) -> bool:
        """Whether the checkpoint resumed from is at an evaluation step whose evaluation a
        stop cut short (:attr:`Progress.val_step` behind it)."""
        step, train = self.progress.step, self.cfg.train
        due = step > 0 and (step % train.eval_every == 0 or step == train.max_steps)
        return due and self.progress.val_step != step

    def _catch_up_evaluation(self, signals: StopSignals) -> None:
        """The evaluation (and sample) of the step resumed from, which a stop cut short:
        logged at that step as the uninterrupted run would have, before training on; a new
        best is saved as best.pt, and last.pt is saved with the figure."""
        step = self.progress.step
        self.logger.info(f"step {step}: its evaluation was cut short by the stop; "
                         "evaluating it now")
        # Stopped again, it is cut short again: the loop's first step saves and stops.
        improved, _ = self._evaluate_and_sample({}, signals, evaluated=True)
        if self.progress.val_step == step:  # evaluated now (rank 0): saved with its figure,
            # step-N.pt too where the stop's own save wrote one
            self._save(numbered=step % self.cfg.checkpoint.every == 0, best=improved)

    def _evaluate_and_sample(self, record: dict[str, Any], signals: StopSignals,
                             evaluated: bool) -> tuple[bool, str]:
        """Evaluate (``evaluated``), log ``record`` with the validation figures, then sample
        when due. A stop cuts this short; ``record`` (the step's training figures) is logged
        all the same. Returns whether the evaluation made a new best, and what a stop cut
        short: "evaluation", "sample" or ""."""
        step = self.progress.step
        improved, doing = False, ""
        try:
            if evaluated:
                doing = "evaluation"
                improved = self._evaluate(record, signals)
            if record:
                self.logger.log(step, record)
                record = {}
            if sample_due(self.cfg.train, step, evaluated):
                doing = "sample"
                self._log_sample(signals)
            doing = ""
        except StopRequested:
            pass
        if record:  # the training figures of a step whose evaluation was cut short
            self.logger.log(step, record)
        return improved, doing

    def _evaluate(self, record: dict[str, Any], signals: StopSignals,
                  candidate: bool = True) -> bool:
        """Validation loss on the fixed windows (rank 0); True when it is the best so far.

        ``candidate=False`` (step 0) logs the loss without making it the best to beat."""
        if not self.ctx.is_main:
            return False
        data, progress = self.run.data, self.progress
        # The inference context `fbtrain eval` scores in too: its figure is this one.
        with self.pace.timing("evaluation"), \
                inference(self.run.raw_model, self.cfg.run.precision, self.ctx.device), \
                signals.interruptible():
            scores = window_scores(self.run.raw_model, data.val_x, data.val_y, EVAL_BATCH)
        loss = scores.loss
        progress.val_loss = loss
        progress.val_step = progress.step
        improved = candidate and math.isfinite(loss) and (progress.best_val_loss is None
                                                          or loss < progress.best_val_loss)
        if improved:
            progress.best_val_loss = loss
        metrics = {f"val/{k}": v
                   for k, v in loss_figures(loss, data.chars_per_token[1]).items()}
        if data.labelled:
            metrics["val/accuracy"] = scores.accuracy
        record.update(metrics)
        self.logger.info(report.evaluation_line(progress.step, metrics, improved,
                                                len(data.val_x)))
        return improved

    def _log_sample(self, signals: StopSignals) -> None:
        """A short generated text for the log (rank 0), from its own seeded generator; none
        more once one ran out of memory (the process is at its limit: training comes first)."""
        if not self.ctx.is_main or self._samples_off:
            return
        from fbtrain.sample import NonFiniteLogits, generate

        model, tokenizer = self.run.raw_model, self.run.data.tokenizer
        # A sample must not cost the training run what it may meet by design (a diverging
        # model's logits, a user's limit, memory running out); anything else is a bug and
        # keeps its traceback.
        try:
            generator = sample_generator(sample_seed(self.cfg.run.seed, self.progress.step))
            # generate runs in the inference context
            with self.pace.timing("sample"), signals.interruptible():
                text = generate(model, tokenizer, tokenizer.start,
                                self.cfg.train.sample_length, generator=generator,
                                precision=self.cfg.run.precision)[0]
        except (NonFiniteLogits, UserError) as e:
            reason = str(e) or type(e).__name__
        except (MemoryError, RuntimeError, SystemError, OSError) as e:
            if not is_allocation_failure(e):  # a MemoryError says nothing of itself
                raise
            self._samples_off = True
            reason = allocation_failed(e, "", "no more samples are drawn in this run")
        else:
            self.logger.log_text(self.progress.step, "sample", text, echo=False)
            self.last_sample = (self.progress.step, text)
            return
        self.logger.info(f"warning: sampling failed at step {self.progress.step}: {reason}")

    # ------------------------------------------------------------------ checkpoints

    def _save(self, *, numbered: bool, best: bool) -> None:
        """Write last.pt (and step-N.pt / best.pt) on rank 0, never with non-finite weights.

        Every rank checks the weights (they are identical), so all stop together."""
        with torch.no_grad():  # one host sync for all parameters, not one each
            named = list(self.run.raw_model.named_parameters())
            finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
            bad = [n for (n, _), ok in zip(named, finite, strict=True) if not ok]
        if bad:
            raise TrainingError(
                f"step {self.progress.step}: weights hold non-finite values "
                f"({summarize_names(bad)}); no checkpoint written (last good: "
                f"{self.manager.last_path})", EXIT_NONFINITE)
        if self.ctx.is_main:
            try:
                with self.pace.timing("save"):
                    self.manager.save(self.progress.step,
                                      checkpoint_payload(self.run, self.progress),
                                      numbered=numbered, best=best)
            except OSError:
                # A log write failed first (a disk full for both, most likely): that is the
                # failure reported, next; the previous checkpoint stays as it was.
                if self.logger.failure is None:
                    raise


def sample_due(train: TrainConfig, step: int, evaluated: bool) -> bool:
    """A sample with every evaluation (``sample_every: null``), or every N steps and at the
    end (N > 0), or never (0)."""
    every = train.sample_every
    if every is None:
        return evaluated
    return every > 0 and (step % every == 0 or step == train.max_steps)
