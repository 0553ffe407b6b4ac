"""The training loop: curriculum, AdamW + schedule, clipping, evaluation, checkpoints, signals.

``run(cfg)`` trains into ``<run.out_dir>/<run.name>/`` and returns that folder::

    config.yaml  vocab.json  metrics.jsonl  tb/  checkpoints/{last,best,step-00001000}.pt

Step numbering: ``step`` counts optimizer steps done, so the first trained step is logged
and checkpointed as step 1. The step being trained has 0-based index ``step`` (= its logged
number minus one); the curriculum, the batch size and the learning rate are looked up with
that index (``cfg.seq_len_at(index)``), so ``until_step: 300`` means exactly the steps
logged 1..300 run at that stage.

Context: ``train.context: reset`` trains on random windows from empty memory;
``carry`` trains on contiguous streams with the memory carried from step to step
(``batches.py``).

Exact resume: the checkpoint holds the model, optimizer, step, tokens and every random
stream (Python, torch, CUDA, the batch sampler), and in carry mode the stream cursor and
the carried memory. Evaluation and sampling run under
:func:`preserve_rng`, so they never shift those streams, and the learning rate is a pure
function of the step. On the CPU, N steps + resume + N steps is bitwise 2N straight steps.

Errors: :class:`TrainingError` carries the exit code (1: non-finite loss or gradient norm;
130 / 143: SIGINT / SIGTERM, after saving). DataError, CheckpointError, DeviceError and
ConfigError come through unchanged (the CLI makes them exit code 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fbtrain.batches import CarriedStreams, RandomWindows
from fbtrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng,
    load_checkpoint,
    resolve_checkpoint,
    restore_rng,
    strip_wrapper_prefixes,
)
from fbtrain.config import Config, ConfigError, ModelConfig, save_config
from fbtrain.data.corpus import Corpus, load_corpus
from fbtrain.data.errors import DataError
from fbtrain.data.samplers import BatchSampler, SegmentReader, fixed_windows
from fbtrain.data.streams import require_tokens
from fbtrain.device import autocast, autocast_dtype
from fbtrain.distributed import DistContext, rank_seed, session
from fbtrain.evaluate import LN2, loss_figures
from fbtrain.metrics import EVENTS_GLOB, MetricsLogger, format_duration, hparams_of
from fbtrain.models import build_model, count_parameters
from fbtrain.rundir import RunDirLock
from fbtrain.schedule import LRSchedule, build_optimizer
from fbtrain.scoring import count_scored, score_sums, window_scores

EXIT_NONFINITE = 1
# 128 + signal number, as shells do. SIGHUP: the terminal (or SSH session) was closed.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
# Under DDP a rank that received no signal stops for the most final one another rank got.
STOP_PRIORITY = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
EVAL_BATCH = 64  # validation windows per forward: no gradients, so wide batches are cheap
WARMUP_STEPS = 1  # steps of each process left out of tokens/s (allocations, first kernels)
# Model fields that fix the shapes of the weights; a checkpoint must agree on all of them.
ARCHITECTURE = ("kind", "d_model", "n_heads", "d_ff", "n_layers", "max_rel_pos", "memory_norm")
# What a warm start (transformer -> feedback, on purpose) must agree on: the weights' shapes.
WARM_START_ARCHITECTURE = ("d_model", "n_heads", "d_ff", "n_layers", "max_rel_pos")


class TrainingError(Exception):
    """Training stopped; ``exit_code`` is what the CLI exits with (1, 130 or 143)."""

    def __init__(self, message: str, exit_code: int = EXIT_NONFINITE):
        super().__init__(message)
        self.exit_code = exit_code


def run(cfg: Config, *, resume: str | None = None, quiet: bool = False) -> Path:
    """Train as ``cfg`` says and return the run directory.

    ``resume``: None starts fresh (refused with a ConfigError when the run directory already
    holds ``last.pt``, so a trained run is never overwritten by accident); ``"auto"``
    continues from ``<run>/checkpoints/last.pt`` when it exists, else starts fresh; any other
    value is a checkpoint file or run directory to continue from. ``quiet`` turns the
    console (progress bar, messages) off; files are written the same.
    """
    with session(cfg.run.device) as ctx:
        return Trainer(cfg, ctx, quiet=quiet).fit(resume)


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def preserve_rng(device: torch.device) -> Iterator[None]:
    """Run a block (evaluation, sampling) without moving Python's, torch's or CUDA's RNG."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(state)


class StopRequested(BaseException):
    """Raised by :class:`StopSignals` inside an interruptible block (evaluation, sampling).

    A BaseException, like KeyboardInterrupt: no ``except Exception`` may swallow it."""


class StopSignals:
    """SIGINT / SIGTERM / SIGHUP ask the run to stop; it saves and exits with the first one's
    code (130 / 143 / 129).

    By default a signal only sets ``received``, and the loop stops at the end of the step,
    so an optimizer step or a save is never cut in half. Inside :meth:`interruptible`
    (evaluation and sampling: read-only work that can take long), the first signal also
    raises :class:`StopRequested` at once, and the loop saves and stops from there.

    Repeated signals change nothing: under torchrun every worker gets Ctrl-C twice (from the
    terminal and forwarded by the agent), and the save must still happen. After a stop the
    three signals stay ignored until the process exits: a second Ctrl-C while it shuts down
    (TensorBoard's writer threads, atexit) must neither print a traceback nor change the
    exit code. Without a signal the previous handlers are put back on exit.
    (SIGKILL remains for a user who cannot wait one step.) Handlers are only installed from
    the main thread (Python allows no other).
    """

    def __init__(self, *, allow_interrupts: bool = True) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        # Off under DDP: a rank leaving its evaluation early would reach the step's
        # collectives out of turn with the others; there every stop waits for the step.
        self._allow = allow_interrupts
        self._interruptible = False

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in EXIT_CODES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._interruptible = False
        for sig, handler in self._previous.items():
            # After a stop the process is on its way out with the first signal's code:
            # later signals are ignored until it exits (no KeyboardInterrupt traceback in
            # a writer thread's shutdown, no SIGTERM default turning 130 into 143).
            signal.signal(sig, handler if self.received is None else signal.SIG_IGN)
        self._previous.clear()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block a signal may cut short with :class:`StopRequested` (also one that came
        before the block began)."""
        if not self._allow:
            yield
            return
        if self.received is not None:
            raise StopRequested
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            return
        self.received = signum
        if self._interruptible:
            self._interruptible = False
            raise StopRequested


class Throughput:
    """Tokens per second of whole training steps (their own time, not eval or saving).

    The first ``WARMUP_STEPS`` steps of a process are left out: they pay for allocations
    and first-call setup that the rest of the run does not.
    """

    def __init__(self, warmup: int = WARMUP_STEPS):
        self._skip = warmup
        self._window = [0, 0.0]  # tokens, seconds since the last window_rate()
        self.tokens, self.seconds = 0, 0.0  # whole run (of this process)

    def add(self, tokens: int, seconds: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        self._window[0] += tokens
        self._window[1] += seconds
        self.tokens += tokens
        self.seconds += seconds

    def window_rate(self) -> float | None:
        """Tokens/s since the previous call (None when no measured step), then reset."""
        tokens, seconds = self._window
        self._window = [0, 0.0]
        return tokens / seconds if seconds > 0 else None

    @property
    def overall_rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class WarmStart:
    """What :func:`apply_warm_start` did, by parameter name."""

    source: Path
    loaded: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # in the checkpoint, absent or reshaped here

    def summary(self) -> str:
        lines = [f"warm start from {self.source}: loaded {len(self.loaded)} tensors: "
                 f"{summarize_names(self.loaded)}",
                 f"  freshly initialised {len(self.fresh)}: {summarize_names(self.fresh)}"]
        if self.unused:
            lines.append(f"  not used from the checkpoint {len(self.unused)}: "
                         f"{summarize_names(self.unused)}")
        return "\n".join(lines)


def apply_warm_start(model: nn.Module, state: dict[str, Any], source: Path) -> WarmStart:
    """Copy every tensor of ``state`` whose name and shape match into ``model``."""
    state = strip_wrapper_prefixes(state)
    own = model.state_dict()
    report = WarmStart(source=Path(source))
    matched = {}
    for name, tensor in state.items():
        if name in own and torch.is_tensor(tensor) and tensor.shape == own[name].shape:
            matched[name] = tensor
        else:
            report.unused.append(name)
    model.load_state_dict(matched, strict=False)
    report.loaded = [n for n in own if n in matched]
    report.fresh = [n for n in own if n not in matched]
    return report


def architecture_diff(saved: dict[str, Any], model: ModelConfig, keys: tuple[str, ...]
                      ) -> list[str]:
    """``"key: checkpoint X, config Y"`` for each of ``keys`` where a checkpoint's
    ``model_config`` (``saved``) and ``model`` disagree; empty when they agree. A key the
    checkpoint lacks (saved before the key existed) counts as the key's default."""
    out = []
    for k in keys:
        theirs, ours = saved.get(k, getattr(ModelConfig, k, None)), getattr(model, k)
        if theirs != ours:
            out.append(f"{k}: checkpoint {theirs!r}, config {ours!r}")
    return out


_LAYER = re.compile(r"^(.*?layers)\.(\d+)\.(.+)$")


def summarize_names(names: list[str]) -> str:
    """Parameter names, compactly: ``embed.weight, layers.0-3.{ln1.weight, attn.r}``.

    Names that differ only in the layer index are merged; names present in the same layers
    share one brace group. "none" for an empty list.
    """
    if not names:
        return "none"
    plain: list[str] = []
    layers: dict[tuple[str, str], list[int]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            layers.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
        else:
            plain.append(name)
    groups: dict[tuple[str, str], list[str]] = {}
    for (prefix, rest), indices in layers.items():
        groups.setdefault((prefix, _ranges(indices)), []).append(rest)
    parts = list(plain)
    for (prefix, span), rests in groups.items():
        inner = rests[0] if len(rests) == 1 else "{" + ", ".join(rests) + "}"
        parts.append(f"{prefix}.{span}.{inner}")
    return ", ".join(parts)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass
class StepResult:
    """One optimizer step, as agreed by all ranks (loss averaged over them)."""

    loss: float
    grad_norm: float  # before clipping
    lr: float
    seq_len: int
    batch_size: int
    tokens: int  # over all ranks and micro-batches
    stop: int | None  # the signal that asks to stop after this step, if any
    memory_rms: Tensor  # RMS of the memory keys the step left (rank 0's last micro-batch)
    accuracy: float | None = None  # over the scored targets, for a labelled dataset


# ----------------------------------------------------------------------------- trainer


class Trainer:
    """One training run; :meth:`fit` does everything (``run`` is the public entry point)."""

    def __init__(self, cfg: Config, ctx: DistContext, *, quiet: bool = False):
        self.cfg = cfg
        self.ctx = ctx
        self.device = ctx.device
        self.quiet = quiet
        self.run_dir = Path(cfg.run.out_dir) / cfg.run.name
        self.manager = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last)
        self.run_lock = RunDirLock(self.run_dir, enabled=ctx.is_main)
        self.step = 0
        self.tokens = 0
        self.val_loss: float | None = None
        self.best_val_loss: float | None = None
        self.last_loss: float | None = None
        self.throughput = Throughput()
        self.logger = MetricsLogger(None, enabled=False)  # replaced in fit()

    # ------------------------------------------------------------------ setup

    def fit(self, resume: str | None) -> Path:
        """Set up (fresh, resumed or warm-started), train to ``max_steps``, return the run dir.

        The run directory is created and owned (locked) first, and every decision about
        what it holds (fresh start, resume, refusal) is taken while the lock is held: a
        second process can never act on what it saw before the first one finished. A fresh
        start that fails before it wrote anything leaves no directory behind.
        """
        self._own_run_dir()
        wrote = False
        try:
            started = time.perf_counter()
            resume_path = self._resume_path(resume)
            payload = load_checkpoint(resume_path) if resume_path else None
            init_path, init = self._warm_start_source(payload)
            self._seed_everything()
            vocab = (payload or init or {}).get("vocab")
            self._setup_data(vocab, init_path if payload is None else resume_path)
            self._build(payload, resume_path, init, init_path)
            wrote = True
            return self._train(payload, resume_path, started)
        finally:
            if not wrote:
                self.run_lock.remove_created()
            self.run_lock.release()

    def _own_run_dir(self) -> None:
        """Create the run directory (rank 0) and take its lock. Other ranks wait until rank
        0 holds it, then read what it holds."""
        if self.ctx.is_main:
            self.run_lock.create_and_acquire()
        self.ctx.barrier()

    def _train(self, payload: dict | None, resume_path: Path | None, started: float) -> Path:
        """Write the run's files, log, train and finish (the set-up is done)."""
        self._prepare_run_dir(fresh=payload is None)
        self.logger = MetricsLogger(
            self.run_dir, tensorboard=self.cfg.logging.tensorboard, console=not self.quiet,
            progress=self.cfg.logging.progress, total_steps=self.cfg.train.max_steps,
            initial_step=self.step, enabled=self.ctx.is_main,
        )
        try:
            # Resumed: drop lines the abandoned run logged after the checkpoint. Fresh: all.
            self.logger.truncate_after(self.step if payload is not None else -1)
            if payload is None:
                self.logger.start_run(hparams_of(self.cfg, self.ctx.world_size),
                                      memory_weights=hasattr(self.raw_model, "memory_weights"))
            self._announce(resume_path)
            if self.warm_report is not None:
                self.logger.info(self.warm_report.summary())
            with StopSignals(allow_interrupts=not self.ctx.enabled) as signals:
                self._loop(signals)
            self._finish(started)
        finally:
            self.logger.close()
        return self.run_dir

    def _resume_path(self, resume: str | None) -> Path | None:
        """The checkpoint to continue from (None: a fresh start), decided under the lock."""
        last = self.manager.last_path
        if resume is None:
            if last.is_file():
                raise ConfigError([
                    f"run directory {self.run_dir} already holds {last}; continue it with "
                    "--resume auto, or start anew under another run.name (--set run.name=NEW)"
                    " or after deleting that folder"
                ])
            return None
        if resume == "auto":
            return last if last.is_file() else None
        path = resolve_checkpoint(resume, prefer="last")
        theirs = [p for p in (self.manager.last_path, self.manager.best_path,
                              *self.manager.numbered()) if p.is_file()]
        if theirs and not path.resolve().is_relative_to(self.run_dir.resolve()):
            # Resuming writes last.pt, best.pt and metrics.jsonl here: another run's would
            # be overwritten. (A checkpoint of this run itself, say step-N.pt, is fine.)
            raise ConfigError([
                f"--resume {path} belongs to another run, but run directory {self.run_dir} "
                f"already holds its own checkpoints ({theirs[0].name}, ...); resume into "
                f"another run.name (--set run.name=NEW), or use --resume auto to continue "
                f"{self.run_dir.name}"
            ])
        return path

    def _warm_start_source(self, payload: dict | None) -> tuple[Path | None, dict | None]:
        """The ``train.init_from`` checkpoint, loaded (only when starting fresh)."""
        source = self.cfg.train.init_from
        if not source or payload is not None:
            return None, None
        path = resolve_checkpoint(source, prefer="best")
        init = load_checkpoint(path)
        if not (isinstance(init.get("model"), dict) and isinstance(init.get("vocab"), list)
                and isinstance(init.get("model_config"), dict)):
            raise CheckpointError(f"{path}: train.init_from needs a model checkpoint "
                                  "(with 'model', 'model_config' and 'vocab')")
        diff = architecture_diff(init["model_config"], self.cfg.model, WARM_START_ARCHITECTURE)
        if diff:
            raise CheckpointError(
                f"{path}: train.init_from's model differs from model.* in the config "
                f"({'; '.join(diff)}); a warm start needs the same "
                f"{', '.join(WARM_START_ARCHITECTURE)}")
        return path, init

    def _seed_everything(self) -> None:
        """Python and torch (CPU and every CUDA device) from ``run.seed``; nothing in fbtrain
        draws from numpy."""
        seed = self.cfg.run.seed
        random.seed(seed)
        torch.manual_seed(seed)

    def _setup_data(self, vocab: list[str] | None, vocab_source: Path | None) -> None:
        """The dataset's train/val streams (``corpus.py``), the sampler and the fixed
        validation windows.

        The vocabulary comes from the checkpoint being resumed or warm-started from (its
        embedding rows are indexed by it), else from the data.
        """
        try:
            corpus = self._main_rank_first(lambda: load_corpus(self.cfg.data, vocab))
        except DataError as e:
            if not vocab:
                raise
            raise DataError(f"vocabulary of checkpoint {vocab_source}: {e}") from None
        self.tokenizer, self.labelled = corpus.tokenizer, corpus.labelled
        self.train_ids, val_ids = corpus.splits["train"], corpus.splits["val"]
        # Checked now, before the run directory is made (the sampler would only at step 1).
        require_tokens(len(self.train_ids.inputs) + 1, self.cfg.max_seq_len, "training text")
        train = self.cfg.train
        self.sampler = BatchSampler(self.train_ids, self.cfg.run.seed, rank=self.ctx.rank)
        carry = train.context == "carry"
        self.batches: CarriedStreams | RandomWindows
        if carry:
            layout = SegmentReader(self.train_ids, train.batch_size * train.grad_accum,
                                  self.ctx.rank, self.ctx.world_size)
            self.batches = CarriedStreams(layout, train.grad_accum)
        else:
            self.batches = RandomWindows(self.sampler, train.grad_accum)
        # Computed once: every evaluation scores the same windows, so curves are comparable.
        # With carried memory each scored window runs on a full memory window of context.
        # A labelled dataset may need more context to be scored exactly (corpus.history).
        context = max(self.cfg.model.memory_window, corpus.history) if carry else 0
        # Carried segments are often short (16 tokens): windows of one segment would score
        # a few hundred tokens, too few to compare runs or pick best.pt by, so each window
        # scores at least a memory window's worth.
        scored = self.cfg.max_seq_len
        if carry:
            scored = max(scored, self.cfg.model.memory_window)
        val_x, val_y = fixed_windows(val_ids, scored, train.eval_windows, context=context)
        self.val_x, self.val_y = val_x.to(self.device), val_y.to(self.device)
        self.n_chars = (len(self.train_ids.inputs), len(val_ids.inputs))

    def _main_rank_first(self, load: Callable[[], Corpus]) -> Corpus:
        # Under DDP rank 0 fills the download cache first, so ranks don't all download
        # (or unzip: the other ranks then read the prepared enwik8/text8 from the cache).
        downloads = self.cfg.data.path is None and self.ctx.enabled
        if downloads and not self.ctx.is_main:
            self.ctx.barrier()
        corpus = load()
        if downloads and self.ctx.is_main:
            self.ctx.barrier()
        return corpus

    def _build(self, payload: dict | None, resume_path: Path | None,
               init: dict | None, init_path: Path | None) -> None:
        """Model, optimizer, schedule and scaler; then restored or warm-started state."""
        cfg = self.cfg
        self.raw_model = build_model(cfg.model, self.tokenizer.vocab_size).to(self.device)
        self.warm_report: WarmStart | None = None
        if init is not None and init_path is not None:
            self.warm_report = apply_warm_start(self.raw_model, init["model"], init_path)
        if payload is None and self.ctx.rank > 0:
            # Same initial weights everywhere (seeded above), but each rank its own dropout.
            torch.manual_seed(rank_seed(cfg.run.seed, self.ctx.rank))
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.raw_model, cfg.train, self.device)
        self.schedule = LRSchedule(cfg.train)
        self.amp_dtype = autocast_dtype(cfg.run.precision, self.device)
        # fp16 needs loss scaling to keep small gradients from underflowing; bf16/fp32 don't.
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.amp_dtype == torch.float16)
        if payload is not None and resume_path is not None:
            self._restore(payload, resume_path)
        self.model = self.ctx.wrap(self.raw_model)
        self.model.train()

    def _restore(self, payload: dict[str, Any], path: Path) -> None:
        """Put back model, optimizer, counters and every RNG stream from a checkpoint."""
        missing = [k for k in ("model", "optimizer", "step", "rng", "model_config")
                   if k not in payload]
        if missing:
            raise CheckpointError(f"{path}: cannot resume from it: missing "
                                  f"{', '.join(missing)}")
        diff = architecture_diff(payload["model_config"], self.cfg.model, ARCHITECTURE)
        if diff:
            raise CheckpointError(f"{path}: the checkpoint's model differs from model.* in the "
                                  f"config ({'; '.join(diff)}); resume with its config")
        try:
            self.raw_model.load_state_dict(strip_wrapper_prefixes(payload["model"]))
            self.optimizer.load_state_dict(payload["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{path}: cannot restore training state: {first}") from None
        if self.scaler.is_enabled() and "scaler" in payload:
            self.scaler.load_state_dict(payload["scaler"])
        self.step = int(payload["step"])
        self.tokens = int(payload.get("tokens", 0))
        self.val_loss = payload.get("val_loss")
        self.best_val_loss = payload.get("best_val_loss")
        rng = payload["rng"]
        restore_rng(rng)
        same_world = payload.get("world_size", 1) == self.ctx.world_size
        if isinstance(self.batches, CarriedStreams):
            if "streams" not in payload:
                raise CheckpointError(f"{path}: cannot resume with train.context = carry: the "
                                      "checkpoint holds no carried streams (it was trained "
                                      "with context reset)")
            # Only rank 0's memory is saved: other ranks go on from empty memory.
            self.batches.load_state_dict(payload["streams"], self.device,
                                         memory=self.ctx.rank == 0)
        if self.ctx.rank == 0 and same_world and "sampler" in rng:
            self.sampler.load_state_dict(rng["sampler"])
        else:
            # The checkpoint holds rank 0's streams only: other ranks (or a changed world
            # size) continue on fresh streams of their own rather than replay rank 0's.
            seed = rank_seed(self.cfg.run.seed, self.ctx.rank, self.step)
            # Reseeded in place: the batches already draw from this sampler object, and
            # the checkpoint saves its state (a new object would leave both stale).
            fresh = BatchSampler(self.train_ids, seed, rank=self.ctx.rank)
            self.sampler.load_state_dict(fresh.state_dict())
            self.sampler.seed = seed
            torch.manual_seed(seed)

    def _prepare_run_dir(self, *, fresh: bool) -> None:
        """config.yaml and vocab.json (rank 0); a fresh start also drops old TensorBoard runs."""
        if self.ctx.is_main:
            save_config(self.cfg, self.run_dir / "config.yaml")
            self.tokenizer.save(self.run_dir)
            if fresh:
                # Left by a run killed before its first checkpoint: its curves are not ours.
                for events in self.run_dir.glob(EVENTS_GLOB):
                    events.unlink(missing_ok=True)
        self.ctx.barrier()

    def _announce(self, resume_path: Path | None) -> None:
        cfg, log = self.cfg, self.logger.info
        log(f"run directory: {self.run_dir}")
        if self.run_lock.removed:
            log(f"removed {len(self.run_lock.removed)} temp file(s) left by an interrupted "
                f"save: {', '.join(p.name for p in self.run_lock.removed)}")
        log(f"model: {cfg.model.kind}, {count_parameters(self.raw_model):,} parameters "
            f"(d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, "
            f"{cfg.model.n_heads} heads)")
        ranks = f" x {self.ctx.world_size} ranks (DDP)" if self.ctx.enabled else ""
        log(f"device: {self._device_text()}{ranks}")
        log(f"data: {self.n_chars[0]:,} train / {self.n_chars[1]:,} val {self.tokenizer.unit}s"
            + (" (targets only where labelled; accuracy reported)" if self.labelled else "")
            + ", "
            f"vocabulary {self.tokenizer.vocab_size}, {len(self.val_x)} validation windows")
        if isinstance(self.batches, CarriedStreams):
            streams = self.batches.layout
            log(f"context: carry ({len(streams.starts)} streams of {streams.length:,} tokens "
                f"per rank, memory carried across segments; validation windows after "
                f"{self.val_x.shape[1] - self.cfg.max_seq_len} tokens of context)")
        if resume_path is not None:
            log(f"resuming from {resume_path} at step {self.step}")
            if cfg.train.init_from:
                log("train.init_from is ignored when resuming (the checkpoint has the weights)")
        if self.cfg.logging.tensorboard:
            log(f"tensorboard --logdir {self.run_dir.parent}")

    def _device_text(self) -> str:
        dtype = {None: "fp32", torch.bfloat16: "bf16 autocast",
                 torch.float16: "fp16 autocast"}[self.amp_dtype]
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)}, {dtype})"
        threads = torch.get_num_threads()
        return f"cpu ({threads} thread{'s' if threads != 1 else ''}, {dtype})"

    # ------------------------------------------------------------------ loop

    def _loop(self, signals: StopSignals) -> None:
        cfg = self.cfg.train
        if self.step >= cfg.max_steps:
            self.logger.info(f"nothing to train: the checkpoint is at step {self.step} and "
                             f"train.max_steps is {cfg.max_steps}")
        prev_seq_len = self.cfg.seq_len_at(max(0, self.step - 1)) if self.step else None
        if self.step == 0 and cfg.max_steps > 0:
            self._evaluate_untrained(signals)
        while self.step < cfg.max_steps:
            seq_len = self.cfg.seq_len_at(self.step)
            if prev_seq_len is not None and seq_len != prev_seq_len:
                self.logger.info(f"curriculum: seq_len {prev_seq_len} -> {seq_len} "
                                 f"(batch {self.cfg.batch_size_at(self.step)}) "
                                 f"from step {self.step + 1}")
            prev_seq_len = seq_len
            result = self._train_step(signals)
            self.step += 1
            self.tokens += result.tokens
            self.last_loss = result.loss
            self._after_step(result, signals)

    def _train_step(self, signals: StopSignals) -> StepResult:
        """Forward/backward over ``grad_accum`` micro-batches, clip, check, optimizer step.

        One host sync per step (the loss and gradient norm, needed for the non-finite check);
        everything else stays on the device.
        """
        cfg, index = self.cfg, self.step
        seq_len, batch = cfg.seq_len_at(index), cfg.batch_size_at(index)
        accum = cfg.train.grad_accum
        start = time.perf_counter()
        lr = self.schedule.apply(self.optimizer, index)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        tokens = 0
        micro_batches = self.batches.micro_batches(seq_len, batch, self.device)
        # The step's loss is the mean over every scored target of all its micro-batches
        # (all targets for a text; the labelled ones for a labelled dataset).
        scored = sum(count_scored(y) for _, y, _ in micro_batches)
        denominator = scored.clamp(min=1).float()
        for micro, (x, y, state) in enumerate(micro_batches):
            # DDP all-reduces gradients on the last micro-batch only.
            sync = micro == accum - 1 or not self.ctx.enabled
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with autocast(cfg.run.precision, self.device):
                    logits, new_state = self.model(x, state)
                ce_sum, _, right = score_sums(logits, y)
                loss = ce_sum / denominator
                self.scaler.scale(loss).backward()
            self.batches.keep(micro, new_state)
            loss_sum += loss.detach()
            correct += right
            tokens += x.numel()
        memory_rms = new_state.keys.detach().float().square().mean().sqrt()
        self.scaler.unscale_(self.optimizer)
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        accuracy = correct.float() / denominator
        loss_value, norm_value, accuracy_value, stop = self._agree(loss_sum, grad_norm, accuracy,
                                                                   signals)
        self._check_finite(index + 1, loss_value, norm_value)
        self.scaler.step(self.optimizer)  # skips the step if fp16 gradients overflowed
        self.scaler.update()
        tokens *= self.ctx.world_size
        self.throughput.add(tokens, time.perf_counter() - start)
        return StepResult(loss_value, norm_value, lr, seq_len, batch, tokens, stop, memory_rms,
                          accuracy_value if self.labelled else None)

    def _agree(self, loss: Tensor, grad_norm: Tensor, accuracy: Tensor, signals: StopSignals
               ) -> tuple[float, float, float, int | None]:
        """Loss and accuracy (means over ranks), gradient norm and stop signal, the same on
        every rank.

        One small all-reduce under DDP, so that every rank stops at the same step (a rank
        leaving alone would hang the others in their next collective).
        """
        if not self.ctx.enabled:
            loss_value, norm_value, acc_value = torch.stack(
                [loss.float(), grad_norm.float(), accuracy.float()]).tolist()
            return loss_value, norm_value, acc_value, signals.received
        # One flag per signal; a stop any rank was asked for stops every rank.
        flags = torch.tensor([float(signals.received == sig) for sig in EXIT_CODES],
                             device=self.device)
        stats = torch.cat([torch.stack([loss.float(), grad_norm.float(), accuracy.float()]),
                           flags])
        loss_sum, norm_sum, acc_sum, *counts = self.ctx.all_reduce_sum(stats).tolist()
        asked = {sig for sig, n in zip(EXIT_CODES, counts, strict=True) if n}
        # This rank's own signal when it has one (its exit code must match what it says).
        stop = signals.received or next((s for s in STOP_PRIORITY if s in asked), None)
        # Every rank holds the same (all-reduced) gradients, hence the same norm.
        n = self.ctx.world_size
        return loss_sum / n, norm_sum / n, acc_sum / n, stop

    def _check_finite(self, step: int, loss: float, grad_norm: float) -> None:
        """Stop before the optimizer step on a non-finite loss or gradient norm.

        With fp16 loss scaling an overflowing gradient is routine (the scaler skips that
        step and lowers the scale), so only the loss counts there.
        """
        if math.isfinite(loss) and (math.isfinite(grad_norm) or self.scaler.is_enabled()):
            return
        what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", grad_norm)
        last = self.manager.last_path
        good = f"last good: {last}" if last.is_file() else "no checkpoint was saved yet"
        hint = "a lower train.lr" + (" or train.grad_clip > 0" if not self.cfg.train.grad_clip
                                     else "")
        raise TrainingError(
            f"step {step}: {what} is {value}; stopped before the optimizer step, no checkpoint "
            f"written ({good}); try {hint}",
            EXIT_NONFINITE,
        )

    def _after_step(self, result: StepResult, signals: StopSignals) -> None:
        """Log, evaluate, sample and checkpoint as the step number asks; stop on a signal.

        A signal during the evaluation or the sample cuts it short (that step then logs no
        validation figure); the step itself is saved all the same."""
        cfg, step = self.cfg, self.step
        final = step == cfg.train.max_steps
        record: dict[str, Any] = {}
        if step % cfg.train.log_every == 0 or final:
            record.update(self._train_metrics(result))
        improved = False
        evaluated = step % cfg.train.eval_every == 0 or final
        try:
            if evaluated:
                improved = self._evaluate(record, signals)
            if record:
                self.logger.log(step, record)
                record = {}
            if self._sample_due(evaluated):
                self._log_sample(signals)
        except StopRequested:
            pass
        if record:  # the training figures of a step whose evaluation was cut short
            self.logger.log(step, record)
        # Under DDP the stop the ranks agreed on at the step; alone, any signal so far.
        stop = result.stop if self.ctx.enabled else signals.received
        every = step % cfg.checkpoint.every == 0
        if every or final or improved or stop is not None:
            self._save(numbered=every or final, best=improved)
        if stop is not None and not final:
            self.ctx.barrier()  # torchrun ends every rank once one exits: let rank 0 finish
            raise TrainingError(
                f"interrupted at step {step} ({signal.Signals(stop).name}); saved "
                f"{self.manager.last_path}; resume with --resume auto",
                EXIT_CODES[stop],
            )

    def _train_metrics(self, result: StepResult) -> dict[str, Any]:
        """The step's metrics (the loss of this step, not an average: exact under resume)."""
        rate = self.throughput.window_rate()
        metrics: dict[str, Any] = {
            "loss": result.loss, "bpc": result.loss / LN2, "lr": result.lr,
            "grad_norm": result.grad_norm, "tokens_per_sec": rate, "seq_len": result.seq_len,
            "batch_size": result.batch_size, "tokens": self.tokens,
            # Bounded when the memory recursion is stable; growing without end, it is not.
            "memory_rms": result.memory_rms.item(),
        }
        if result.accuracy is not None:
            metrics["accuracy"] = result.accuracy
        if hasattr(self.raw_model, "memory_weights"):
            with torch.no_grad():
                weights = self.raw_model.memory_weights().float().tolist()
            metrics.update({f"mem_weight/{i}": w for i, w in enumerate(weights)})
        if self.device.type == "cuda":
            metrics["peak_mem_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        shown = {k: metrics[k] for k in ("loss", "bpc", "accuracy", "seq_len", "lr")
                 if k in metrics}
        if rate is not None:
            shown["tokens_per_sec"] = rate
        self.logger.progress(self.step, shown)
        return metrics

    def _evaluate_untrained(self, signals: StopSignals) -> None:
        """Step 0: the untrained model's validation loss (and a sample), so every curve
        starts at the start. Not a candidate for best.pt: there is nothing to save yet."""
        record: dict[str, Any] = {}
        try:
            self._evaluate(record, signals, candidate=False)
            if record:
                self.logger.log(0, record)
            if self._sample_due(evaluated=True):
                self._log_sample(signals)
        except StopRequested:
            name = signal.Signals(signals.received or signal.SIGINT).name
            raise TrainingError(f"interrupted before the first step ({name}); nothing was "
                                "trained, so no checkpoint was written",
                                EXIT_CODES[signals.received or signal.SIGINT]) from None

    def _sample_due(self, evaluated: bool) -> bool:
        """A sample with every evaluation (``sample_every: null``), or every N steps and at
        the end (N > 0), or never (0)."""
        every, step = self.cfg.train.sample_every, self.step
        if every is None:
            return evaluated
        return every > 0 and (step % every == 0 or step == self.cfg.train.max_steps)

    def _evaluate(self, record: dict[str, Any], signals: StopSignals,
                  candidate: bool = True) -> bool:
        """Validation loss on the fixed windows (rank 0); True when it is the best so far.

        ``candidate=False`` (step 0) logs the loss without making it the best to beat."""
        if not self.ctx.is_main:
            return False
        with signals.interruptible(), preserve_rng(self.device), \
                autocast(self.cfg.run.precision, self.device):
            scores = window_scores(self.raw_model, self.val_x, self.val_y, EVAL_BATCH)
        loss = scores.loss
        self.val_loss = loss
        improved = candidate and math.isfinite(loss) and (self.best_val_loss is None
                                                          or loss < self.best_val_loss)
        if improved:
            self.best_val_loss = loss
        metrics = {f"val/{k}": v for k, v in loss_figures(loss).items()}
        accuracy = ""
        if self.labelled:
            metrics["val/accuracy"] = scores.accuracy
            accuracy = f" | accuracy {100 * scores.accuracy:.2f}%"
        record.update(metrics)
        best = " (best)" if improved else ""
        self.logger.info(f"step {self.step}: val loss {loss:.4f} | bpc {metrics['val/bpc']:.4f}"
                         f" | ppl {metrics['val/perplexity']:.2f}{accuracy}{best}")
        return improved

    def _log_sample(self, signals: StopSignals) -> None:
        """A short generated text for the log (rank 0), from its own seeded generator."""
        if not self.ctx.is_main:
            return
        try:
            from fbtrain.sample import generate

            generator = torch.Generator().manual_seed(self.cfg.run.seed + self.step)
            with signals.interruptible(), preserve_rng(self.device), \
                    autocast(self.cfg.run.precision, self.device):
                text = generate(self.raw_model, self.tokenizer, self.tokenizer.start,
                                self.cfg.train.sample_length, generator=generator)[0]
        except Exception as e:  # a failed sample must not cost the training run
            self.logger.info(f"warning: sampling failed at step {self.step}: {e}")
            return
        finally:
            self.raw_model.train()
        self.logger.log_text(self.step, "sample", text)

    # ------------------------------------------------------------------ checkpoints

    def _payload(self) -> dict[str, Any]:
        """Everything a resume needs, plus what sample/eval need to rebuild the model."""
        payload = {
            "model": self.raw_model.state_dict(),
            "model_config": dataclasses.asdict(self.cfg.model),
            "vocab": list(self.tokenizer.tokens),
            "tokenizer": self.tokenizer.kind,
            "config": self.cfg.to_dict(),
            "step": self.step,
            "tokens": self.tokens,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
            "rng": capture_rng(self.sampler.state_dict()),
            "best_val_loss": self.best_val_loss,
            "val_loss": self.val_loss,
            # the stage of the last trained step (0 before any)
            "curriculum_stage": self.cfg.stage_index_at(max(0, self.step - 1)),
            "world_size": self.ctx.world_size,
        }
        if self.scaler.is_enabled():
            payload["scaler"] = self.scaler.state_dict()
        if isinstance(self.batches, CarriedStreams):
            payload["streams"] = self.batches.state_dict()
        return payload

    def _save(self, *, numbered: bool, best: bool) -> None:
        """Write last.pt (and step-N.pt / best.pt) on rank 0, never with non-finite weights.

        Every rank checks the weights (they are identical), so all stop together."""
        with torch.no_grad():
            bad = [n for n, p in self.raw_model.named_parameters()
                   if not torch.isfinite(p).all()]
        if bad:
            raise TrainingError(
                f"step {self.step}: weights hold non-finite values ({summarize_names(bad)}); "
                f"no checkpoint written (last good: {self.manager.last_path})", EXIT_NONFINITE)
        if self.ctx.is_main:
            self.manager.save(self.step, self._payload(), numbered=numbered, best=best)

    # ------------------------------------------------------------------ end

    def _finish(self, started: float) -> None:
        """Close the run's HParams session in TensorBoard, and a summary line."""
        self.logger.end_run()
        parts = [f"done at step {self.step}"]
        if self.val_loss is not None:
            parts.append(f"val loss {self.val_loss:.4f} (bpc {self.val_loss / LN2:.4f})")
        if self.best_val_loss is not None:
            parts.append(f"best val loss {self.best_val_loss:.4f} "
                         f"(bpc {self.best_val_loss / LN2:.4f})")
        rate = self.throughput.overall_rate
        if rate is not None:
            parts.append(f"{rate:,.0f} tokens/s on {self._device_text()}")
        parts.append(f"wall {format_duration(time.perf_counter() - started)}")
        self.logger.info(" | ".join(parts))
        self.ctx.barrier()
