"""The training loop and its cadence: log, evaluate, sample and checkpoint as the step
number asks; stop on a signal.

``run(cfg)`` trains into ``<run.out_dir>/<run.name>/`` and returns that folder::

    config.yaml  vocab.json  metrics.jsonl  history.jsonl  checkpoints/
    events.out.tfevents.*  val/events.out.tfevents.*

(:mod:`fbtrain.rundir` owns the folder: its lock, the checks before training, where a run
starts, its history.)

Step numbering: ``step`` counts optimizer steps done, so the first trained step is logged
and checkpointed as step 1. The step being trained has 0-based index ``step`` (= its logged
number minus one); the curriculum, the batch size and the learning rate are looked up with
that index, so ``until_step: 300`` means exactly the steps logged 1..300 run at that stage.

Where the parts live: :mod:`.setup` builds the run (in one visible order), :mod:`.step`
trains one step, :mod:`.evaluations` evaluates and samples between steps, :mod:`.signals`
decides when to stop, :mod:`.report` says what happens (the status line is
:class:`~fbtrain.metrics.console.StatusLine`), and what a checkpoint holds is named in
:func:`~.setup.state_parts`.

Exact resume: the checkpoint holds the model, optimizer, step, tokens and every random
stream (Python, torch, CUDA, the batch sampler), and in carry mode the stream cursor and
the carried memory. Evaluation and sampling run in :func:`~fbtrain.inference.inference`
(which holds :func:`~fbtrain.rng.preserve_rng`), so they never shift those streams, and the
learning rate is a pure function of the step. On the CPU, N steps + resume + N steps is
bitwise 2N straight steps.

Errors: :class:`TrainingError` carries the exit code (:data:`~fbtrain.errors.EXIT_FAILED`
for a non-finite loss or gradient norm; 128 + the signal's number for SIGHUP / SIGINT /
SIGTERM, after saving). DataError, CheckpointError,
DeviceError and ConfigError come through unchanged (the CLI makes them exit code 2).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

import fbtrain.train.report as report
from fbtrain.checkpoint.best import heal_best
from fbtrain.checkpoint.contents import summarize_names
from fbtrain.checkpoint.files import CheckpointManager
from fbtrain.config import Config
from fbtrain.config.kinds import model_kind
from fbtrain.device import matmul_precision
from fbtrain.distributed import DistContext, is_peer_failure, peer_lost, session
from fbtrain.errors import EXIT_FAILED, signal_exit_code
from fbtrain.metrics.console import Console, StatusLine
from fbtrain.metrics.logger import MetricsLogger, text_block
from fbtrain.metrics.tensorboard import SUBRUNS, hparams_of
from fbtrain.rundir import ResumeChoice, RunDirectory
from fbtrain.train.evaluations import EVAL_BATCH, Evaluator
from fbtrain.train.oom import evaluating, is_allocation_failure, out_of_memory, setting_up
from fbtrain.train.pace import Clock, Pace
from fbtrain.train.setup import (
    RunParts,
    Seams,
    TrainState,
    checkpoint_payload,
    finished,
    resume_choice,
    set_up,
)
from fbtrain.train.signals import StopSignals
from fbtrain.train.step import StepResult, TrainingError, train_step
from fbtrain.train.step_graph import graphs_requested, step_function

T = TypeVar("T")
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
    (:meth:`fbtrain.rundir.RunDirectory.choose`). ``quiet`` turns the console (progress,
    messages) off but for the one-line summary; files are written the same.
    ``on_step(step)`` runs after each trained step, before its evaluation and save (for
    tests); ``clock`` times the run for its ETA and closing line (a test's own, for costs
    it sets); ``seams``: how the data, the model and checkpoint files are made
    (:class:`Seams`; for harnesses).
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


def say_finished(cfg: Config, ctx: DistContext, manager: CheckpointManager,
                 choice: ResumeChoice, *, quiet: bool) -> None:
    """A run resumed with nothing left to train (``choice``, loaded): that it is done, and
    its closing line (no segment recorded; no file written but a best.pt put right, which a
    save that failed left behind the best the run recorded)."""
    assert choice.path is not None and choice.payload is not None
    console = Console(enabled=ctx.is_main, quiet=quiet)
    done, closing = report.finished_lines(manager.run_dir, choice.path, choice.payload,
                                          cfg.train.max_steps)
    console.info(f"run directory: {manager.run_dir}")
    progress = choice.payload.get("progress")
    best = progress.get("best_val_loss") if isinstance(progress, dict) else None
    healed = heal_best(manager, best) if ctx.is_main else None
    for line in (healed, done):
        if line:
            console.info(line)
    console.result(closing)


class Trainer:
    """One training run: :meth:`fit` owns the run directory, builds the run, trains.

    What :meth:`fit` builds, once the directory is owned: ``run`` (its parts, frozen),
    ``progress`` (the step, tokens and losses so far), ``logger`` and ``evaluator``.
    """

    run: RunParts
    progress: TrainState
    logger: MetricsLogger
    evaluator: Evaluator

    def __init__(self, cfg: Config, ctx: DistContext, *, quiet: bool = False,
                 on_step: StepHook | None = None, clock: Clock = time.perf_counter,
                 seams: Seams | None = None):
        self.cfg, self.ctx, self.quiet, self.on_step = cfg, ctx, quiet, on_step
        self.seams = seams or Seams()
        # ~ is the home folder, as in data.path (not a folder named '~' in the working one)
        self.directory = RunDirectory(Path(cfg.run.out_dir).expanduser() / cfg.run.name,
                                      cfg.checkpoint.keep_last, self.seams.write_checkpoint,
                                      owner=ctx.is_main)
        self.manager = self.directory.checkpoints
        # The status line's rate and the ETA's costs: over the steps of its last lines.
        window = report.RATE_LINES * cfg.train.log_every
        self.throughput = report.Throughput(window)
        self.pace = Pace(cfg, window, clock)  # where the time goes, and the ETA
        self.completed = False  # every step trained and the last one saved

    @property
    def run_dir(self) -> Path:
        return self.directory.path

    def fit(self, resume: str | None) -> Path:
        """Set up (fresh, resumed or warm-started), train to ``max_steps``, return the run dir.

        The run directory is created and owned (locked) first, and every decision about
        what it holds (fresh start, resume, refusal) is taken while the lock is held: a
        second process can never act on what it saw before the first one finished. A fresh
        start that fails before it wrote anything leaves no directory behind.
        """
        self.directory.open(SUBRUNS if self.cfg.logging.tensorboard else ())
        self.ctx.barrier()  # other ranks read the directory once rank 0 owns it
        wrote = False
        try:
            started = self.pace.clock()
            choice = resume_choice(self.cfg, self.directory, resume)
            if finished(self.cfg, choice):  # said before any data is loaded (or downloaded)
                say_finished(self.cfg, self.ctx, self.manager, choice, quiet=self.quiet)
                return self.run_dir
            try:
                self.parts, self.state, resume_path = set_up(
                    self.cfg, self.ctx, self.directory, resume, choice, self.seams)
            except (MemoryError, RuntimeError, SystemError, OSError) as e:
                if not is_allocation_failure(e):
                    raise
                raise setting_up(e) from None
            wrote = True
            # A resume with nothing to train leaves the directory's files as they were:
            # config.yaml describes the checkpoints it holds, not settings none was made with.
            if resume_path is None or self.state.step < self.cfg.train.max_steps:
                self.directory.start_segment(self.cfg, self.parts.data.tokenizer,
                                             self.parts.segment, start_step=self.state.step,
                                             resumed_from=resume_path)
            self.ctx.barrier()
            self.logger = MetricsLogger(
                self.run_dir, tensorboard=self.cfg.logging.tensorboard,
                console=not self.quiet, progress=self.cfg.logging.progress,
                total_steps=self.cfg.train.max_steps, initial_step=self.state.step,
                enabled=self.ctx.is_main)
            self.status = StatusLine(self.logger.progress)
            self.evaluator = Evaluator(self.parts, self.state, self.pace, self.logger)
            try:
                self._train(resume_path, started)
            finally:
                self.logger.close()
            return self.run_dir
        finally:
            self.directory.close(wrote)

    def _train(self, resume_path: Path | None, started: float) -> None:
        """Log the start, run the loop under the stop signals, log the end."""
        # Resumed: drop lines the abandoned run logged after the checkpoint. A new run (fresh,
        # or from another run's checkpoint): all, an earlier start's that saved nothing.
        new_run = self.parts.segment.new_run
        self.logger.truncate_after(-1 if new_run else self.state.step)
        if new_run:  # fresh, or from another run's checkpoint: this directory's first start
            self.logger.start_run(hparams_of(self.cfg, self.ctx.world_size),
                                  memory_weights=model_kind(self.cfg.model.kind).memory_mix,
                                  labelled=self.parts.data.labelled)
        for line in report.announcement(self.parts, self.state, resume_path,
                                        self.directory.removed):
            self.logger.info(line)
        if self.parts.warm_report is not None:
            self.logger.info(self.parts.warm_report.summary())
        with StopSignals(allow_interrupts=not self.ctx.enabled) as signals:
            self._loop(signals)
        self.completed = True
        self.logger.end_run()
        self.logger.raise_failure()
        if self.evaluator.last_sample is not None:  # the one sample the console shows
            self.logger.info(text_block("sample", *self.evaluator.last_sample))
        events = self.pace.events
        spent = report.SegmentTime(
            wall=self.pace.clock() - started, tokens=self.throughput.tokens,
            steps=self.throughput.seconds, evaluating=events["evaluation"].spent,
            sampling=events["sample"].spent)
        self.logger.result(report.summary(self.parts, self.state, spent))
        self.ctx.barrier()

    # ------------------------------------------------------------------ loop

    def _loop(self, signals: StopSignals) -> None:
        plan, progress = self.parts.curriculum, self.state
        max_steps = self.cfg.train.max_steps
        if progress.step >= max_steps:
            self.logger.info(f"nothing to train: the checkpoint is at step {progress.step} "
                             f"and train.max_steps is {max_steps}")
        prev_seq_len = plan.seq_len_at(max(0, progress.step - 1)) if progress.step else None
        if progress.step == 0 and max_steps > 0:
            self._evaluate(lambda: self.evaluator.untrained(signals), save=None)
        elif self.evaluator.missed():
            self._catch_up_evaluation(signals)
        self.logger.raise_failure()  # a log file that cannot be written: before training on
        # train_step, through whole-step CUDA graphs where $FBTRAIN_CUDA_GRAPHS asks
        step = step_function(self.parts) if progress.step < max_steps else train_step
        self.pace.start()
        while progress.step < max_steps:
            seq_len = plan.seq_len_at(progress.step)
            if prev_seq_len is not None and seq_len != prev_seq_len:
                self.logger.info(report.curriculum_line(
                    prev_seq_len, seq_len, plan.batch_size_at(progress.step), progress.step))
            prev_seq_len = seq_len
            try:
                result = step(self.parts, progress.step, signals, self.manager.last_path)
            except (MemoryError, RuntimeError) as e:
                if not is_allocation_failure(e):
                    raise
                raise out_of_memory(self.parts, progress.step) from None
            self.pace.trained(progress.step)
            self.throughput.add(result.tokens, result.seconds)
            progress.step += 1
            progress.tokens += result.tokens
            self._after_step(result, signals)
            if self.status.lacks_rate and (rate := self.throughput.recent_rate()) is not None:
                self.status.add_rate(progress.step, rate, self.pace.remaining(
                    progress.step, events_done=True))

    def _after_step(self, result: StepResult, signals: StopSignals) -> None:
        """Log, evaluate, sample and checkpoint as the step number asks; stop on a signal.

        A signal during the evaluation or the sample cuts it short (that step then logs no
        validation figure); the step itself is saved all the same."""
        cfg, step = self.cfg, self.state.step
        final = step == cfg.train.max_steps
        record: dict[str, Any] = {}
        if step % cfg.train.log_every == 0 or final:
            record.update(report.step_metrics(self.parts, result, self.state.tokens,
                                              self.throughput.window_rate()))
            self.status.show(step, record, self.throughput.recent_rate(),
                             self.pace.remaining(step))
        if self.on_step is not None:
            self.on_step(step)
        evaluated = step % cfg.train.eval_every == 0 or final
        every = step % cfg.checkpoint.every == 0
        improved, cut = self._evaluate(lambda: self.evaluator.at_step(record, signals, evaluated),
                                       save=every or final)
        # Under DDP the stop the ranks agreed on at the step; alone, any signal so far.
        stop = result.stop if self.ctx.enabled else signals.received
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
                                signal_exit_code(stop))

    # ------------------------------------------------------------------ evaluation

    def _catch_up_evaluation(self, signals: StopSignals) -> None:
        """The evaluation (and sample) of the step resumed from, which a stop cut short:
        logged at that step as the uninterrupted run would have, before training on; a new
        best is saved as best.pt, and last.pt is saved with the figure. A stop now stops
        here, before a step is trained: one cut short again is caught up by the next resume
        (a step trained past it would lose its figure for good)."""
        step = self.state.step
        self.logger.info(f"step {step}: its evaluation was cut short by the stop; "
                         "evaluating it now")
        improved, cut = self._evaluate(lambda: self.evaluator.at_step({}, signals, True),
                                       save=None)
        if self.state.val_step == step:  # evaluated now (rank 0): saved with its figure,
            # step-N.pt too where the stop's own save wrote one
            self._save(numbered=step % self.cfg.checkpoint.every == 0, best=improved)
        received = signals.received
        if received is not None and not self.ctx.enabled:  # under DDP: at the next step
            raise TrainingError(report.interrupted_line(
                step, received, self.manager.last_path,
                final=step >= self.cfg.train.max_steps, cut=cut), signal_exit_code(received))

    def _evaluate(self, evaluation: Callable[[], T], save: bool | None) -> T:
        """``evaluation()`` (the :class:`Evaluator`'s); one that runs out of memory stops the
        run with a line naming the evaluation, the step saved first (a numbered checkpoint
        where ``save``; None: nothing to save, the step is the checkpoint resumed from or
        step 0), as for a log that cannot be written."""
        try:
            return evaluation()
        except (MemoryError, RuntimeError, SystemError, OSError) as e:
            if not is_allocation_failure(e):
                raise
            if save is not None:
                self._save(numbered=save, best=False)
            raise evaluating(e, self.parts, self.state.step, self.manager.last_path,
                             EVAL_BATCH) from None

    # ------------------------------------------------------------------ checkpoints

    def _save(self, *, numbered: bool, best: bool) -> None:
        """Write last.pt (and step-N.pt / best.pt) on rank 0, never with non-finite weights.

        Every rank checks the weights (they are identical), so all stop together."""
        with torch.no_grad():  # one host sync for all parameters, not one each
            named = list(self.parts.raw_model.named_parameters())
            finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
            bad = [n for (n, _), ok in zip(named, finite, strict=True) if not ok]
        if bad:
            raise TrainingError(
                f"step {self.state.step}: weights hold non-finite values "
                f"({summarize_names(bad)}); no checkpoint written (last good: "
                f"{self.manager.last_path})", EXIT_FAILED)
        if self.ctx.is_main:
            try:
                with self.pace.timing("save"):
                    self.manager.save(self.state.step,
                                      checkpoint_payload(self.parts, self.state),
                                      numbered=numbered, best=best)
            except OSError:
                # A log write failed first (a disk full for both, most likely): that is the
                # failure reported, next; the previous checkpoint stays as it was.
                if self.logger.failure is None:
                    raise
