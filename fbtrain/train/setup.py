"""Everything a run is built from, in one visible order: :func:`set_up` returns a frozen
:class:`RunParts` (data, model, optimizer, batches) and the :class:`TrainState` it starts from.

The order is part of the contract: the random streams are seeded first, the data is loaded
(its vocabulary fixed by the checkpoint when there is one), the model is initialised from
the seeded stream, and only then is a checkpoint's state (weights, optimizer, every RNG
stream, the sampler, the carried memory) put back. Same config and seed, same order, same
numbers: that is what makes resume bitwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fbtrain.checkpoint.best import heal_best
from fbtrain.checkpoint.contents import WarmStart, apply_warm_start, check_warm_start
from fbtrain.checkpoint.files import save_checkpoint
from fbtrain.checkpoint.state import (
    ModelState,
    OptimizerState,
    ScalerState,
    Stateful,
    expect_dict,
    make_checkpoint,
    refuse_other_model,
    restore_checkpoint,
)
from fbtrain.config import Config
from fbtrain.config.curriculum import Curriculum
from fbtrain.data.corpus import check_tokenizer
from fbtrain.data.samplers import BatchSampler, SegmentReader
from fbtrain.device import autocast_dtype
from fbtrain.distributed import DistContext
from fbtrain.messages import is_int, is_number
from fbtrain.models import build_model
from fbtrain.rng import GlobalRng, rank_seed, seed_everything
from fbtrain.rundir import ResumeChoice, RunDirectory, Segment
from fbtrain.rundir.history import changed_settings, describe_changes
from fbtrain.train.batches import CarriedStreams, RandomWindows
from fbtrain.train.clock import RunClock
from fbtrain.train.data import TrainData, load_data
from fbtrain.train.optim import LRSchedule, build_optimizer


@dataclass(frozen=True)
class Seams:
    """Where a run meets the world outside the process: how the data is read from disk
    into host tensors and placed on the run's device, how the model is built on that
    device, how a checkpoint file is written. The defaults are fbtrain's own; a harness
    passes others to run the real trainer on tensors that compute nothing
    (scripts/fakecuda: fake CUDA on a CPU-only torch)."""

    load_data: Callable[[Config, DistContext, list[str] | None, Path | None], TrainData] = \
        dataclasses.field(default_factory=lambda: load_data)
    build_model: Callable[[Any, int, torch.device], nn.Module] = \
        dataclasses.field(default_factory=lambda: _build_on)
    write_checkpoint: Callable[[Path, dict[str, Any]], None] = \
        dataclasses.field(default_factory=lambda: save_checkpoint)


@dataclass
class TrainState:
    """What training has done so far: the trainer's only mutable state (with the model's,
    the optimizer's and the batches' own). A part of the checkpoint, as ``progress``."""

    step: int = 0  # optimizer steps done; the next one trained has this 0-based index
    tokens: int = 0  # over all ranks
    val_loss: float | None = None
    # val_loss in bits per character: a BPE run's needs the characters its validation
    # pieces cover, which a run that is already trained (and loads no data) cannot count.
    val_bpc: float | None = None
    best_val_loss: float | None = None
    # The step of the newest evaluation that finished (None before any): a stop that cut
    # the evaluation of the step it saved short leaves it behind ``step``, and the resume
    # runs that evaluation first (the validation point is not lost).
    val_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def state_problem(self, state: Any) -> str:
        problem = expect_dict(state)
        if problem:
            return problem
        for key in ("step", "tokens"):
            if not (is_int(state.get(key)) and state[key] >= 0):
                return f"{key} is {state.get(key)!r}, not an integer >= 0"
        for key in ("val_loss", "val_bpc", "best_val_loss"):
            if state.get(key) is not None and not is_number(state[key]):
                return f"{key} is {state[key]!r}, not a number (or null)"
        val_step = state.get("val_step")
        if val_step is not None and not (is_int(val_step) and 0 <= val_step <= state["step"]):
            return f"val_step is {val_step!r}, not an integer from 0 to step (or null)"
        return ""

    def load_state_dict(self, state: Any) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.val_loss, self.best_val_loss = state.get("val_loss"), state.get("best_val_loss")
        self.val_bpc = state.get("val_bpc")  # None in checkpoints saved before it was kept
        # Saved before the marker was: taken as evaluated (nothing to catch up).
        self.val_step = state.get("val_step", self.step)


@dataclass(frozen=True)
class RunParts:
    """One run's parts, built once by :func:`set_up`."""

    cfg: Config
    ctx: DistContext
    run_dir: Path
    curriculum: Curriculum  # each step's sequence length and batch size
    data: TrainData
    raw_model: nn.Module
    model: nn.Module  # raw_model, or its DistributedDataParallel wrapper
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    sampler: BatchSampler
    batches: CarriedStreams | RandomWindows
    warm_report: WarmStart | None
    clock: RunClock  # training wall time across the run's segments
    # Lines set-up has to say: why the run resumes from where it does (if not plain),
    # a rewind's files moved aside, settings changed, data that cannot be checked.
    notes: tuple[str, ...] = ()
    segment: Segment = Segment()  # the run's id and what history.jsonl records of this start


def resume_choice(cfg: Config, directory: RunDirectory, resume: str | None
                  ) -> ResumeChoice:
    """Where the run starts (:meth:`~fbtrain.rundir.RunDirectory.choose`), a checkpoint of another
    model refused before anything is loaded or downloaded. Call with the run directory's
    lock held (the trainer takes it first): the choice is made from what the directory
    holds."""
    choice = directory.choose(resume)
    if choice.path is not None and choice.payload is not None:
        refuse_other_model(choice.path, choice.payload, cfg.model)
    return choice


def finished(cfg: Config, choice: ResumeChoice) -> bool:
    """Whether the run directory's own checkpoint that ``choice`` resumes from has trained
    ``train.max_steps`` (or more) and was evaluated at its step: nothing is left to do."""
    if choice.new_run:  # another run's checkpoint, into a new directory
        return False
    payload = choice.payload or {}
    step, progress = payload.get("step"), payload.get("progress")
    if not (is_int(step) and step >= cfg.train.max_steps and isinstance(progress, dict)):
        return False  # to train, or a checkpoint whose problems the resume reports
    return progress.get("val_step", step) == step


def set_up(cfg: Config, ctx: DistContext, directory: RunDirectory, resume: str | None,
           choice: ResumeChoice | None = None, seams: Seams | None = None
           ) -> tuple[RunParts, TrainState, Path | None]:
    """Build the run (fresh, resumed or warm-started): ``(run, progress, resumed_from)``.

    Call with the run directory's lock held: ``choice`` is :func:`resume_choice` of
    ``resume``, made here when not given.
    """
    clock = RunClock()  # this segment starts now
    seams = seams or Seams()
    choice = choice or resume_choice(cfg, directory, resume)
    resume_path, payload = choice.path, choice.payload
    init_path, init = warm_start_source(cfg, payload)
    seed_everything(cfg.run.seed)
    vocab = (payload or init or {}).get("vocab")
    if payload is not None or init is not None:
        check_tokenizer(cfg.data, (payload or init or {}).get("tokenizer"),
                        resume_path if payload is not None else init_path)
    data = seams.load_data(cfg, ctx, vocab, init_path if payload is None else resume_path)
    sampler, batches = make_batches(cfg, ctx, data.train_ids)
    raw_model = seams.build_model(cfg.model, data.tokenizer.vocab_size, ctx.device)
    warm_report = None
    if init is not None and init_path is not None:
        warm_report = apply_warm_start(raw_model, init["model"], init_path)
    if payload is None and ctx.rank > 0:
        # Same initial weights everywhere (seeded above), but each rank its own dropout.
        torch.manual_seed(rank_seed(cfg.run.seed, ctx.rank))
    optimizer = build_optimizer(raw_model, cfg.train, ctx.device)
    amp_dtype = autocast_dtype(cfg.run.precision, ctx.device)
    # fp16 needs loss scaling to keep small gradients from underflowing; bf16/fp32 don't.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16)
    run = RunParts(cfg=cfg, ctx=ctx, run_dir=directory.path, curriculum=Curriculum(cfg),
              data=data, raw_model=raw_model, model=raw_model,
              params=[p for p in raw_model.parameters() if p.requires_grad],
              optimizer=optimizer, schedule=LRSchedule(cfg.train), scaler=scaler,
              amp_dtype=amp_dtype, sampler=sampler, batches=batches, warm_report=warm_report,
              clock=clock)
    progress = TrainState()
    notes = (choice.note,) if choice.note else ()
    changed: dict[str, list[Any]] = {}
    if payload is not None and resume_path is not None:
        restore(run, progress, payload, resume_path)
        saved = payload.get("config")
        changed = changed_settings(saved, cfg.to_dict()) if isinstance(saved, dict) else {}
        if changed:
            notes += (describe_changes(changed, progress.step),)
        saved_ranks = payload.get("world_size", 1)
        if is_int(saved_ranks) and saved_ranks != ctx.world_size:
            changed["world_size"] = [saved_ranks, ctx.world_size]  # history.jsonl's too
            notes += (ranks_changed(run, saved_ranks, progress.step),)
        unchecked = data.identity.unchecked_note(payload.get("data"), resume_path)
        notes += (unchecked,) if unchecked else ()
        rewound = directory.set_aside(resume_path, progress.step) if ctx.is_main else None
        notes += (rewound,) if rewound else ()
        # best.pt that a failed save left behind the recorded best: put right, or named
        healed = heal_best(directory.checkpoints, progress.best_val_loss) \
            if ctx.is_main and not choice.new_run else None
        notes += (healed,) if healed else ()
    model = ctx.wrap(raw_model)  # after the restore: DDP broadcasts rank 0's weights
    model.train()
    segment = Segment(choice.run_id, choice.new_run, changed)
    return (dataclasses.replace(run, model=model, notes=notes, segment=segment), progress,
            resume_path)


def _build_on(model_cfg: Any, vocab_size: int, device: torch.device) -> nn.Module:
    """The model, initialised (on the CPU: the same numbers whatever the device) and moved
    to ``device``."""
    return build_model(model_cfg, vocab_size).to(device)


def ranks_changed(run: RunParts, saved_ranks: int, step: int) -> str:
    """The line a resume on another number of DDP ranks than the checkpoint's prints: a
    step trains every rank's batch, so the sequences per step change with it."""
    cfg, ranks = run.cfg, run.ctx.world_size
    per_rank = run.curriculum.batch_size_at(step) * cfg.train.grad_accum
    return (f"DDP ranks changed from what the checkpoint (step {step}) trained with: "
            f"world_size {saved_ranks} -> {ranks}, so a step now trains {ranks * per_rank:,} "
            f"sequences ({ranks} x train.batch_size x train.grad_accum), not "
            f"{saved_ranks * per_rank:,} (history.jsonl records it)")


# ----------------------------------------------------------------------------- what to resume


def warm_start_source(cfg: Config, payload: dict | None) -> tuple[Path | None, dict | None]:
    """The ``train.init_from`` checkpoint, loaded and checked (only when starting fresh)."""
    if not cfg.train.init_from or payload is not None:
        return None, None
    return check_warm_start(cfg.train.init_from, cfg.model)


# ----------------------------------------------------------------------------- batches


def make_batches(cfg: Config, ctx: DistContext, train_ids: Any
                 ) -> tuple[BatchSampler, CarriedStreams | RandomWindows]:
    """The batch sampler (its state is checkpointed) and where each step's batches come
    from: random windows (``train.context: reset``) or carried streams (``carry``)."""
    train = cfg.train
    sampler = BatchSampler(train_ids, cfg.run.seed, rank=ctx.rank)
    if train.context == "carry":
        layout = SegmentReader(train_ids, train.batch_size * train.grad_accum, ctx.rank,
                              ctx.world_size)
        # Only rank 0's carried memory is saved (the other ranks resume on empty memory).
        return sampler, CarriedStreams(layout, train.grad_accum, ctx.device,
                                       restores_memory=ctx.rank == 0)
    return sampler, RandomWindows(sampler, train.grad_accum)


# ----------------------------------------------------------------------------- checkpoint


def state_parts(run: RunParts, progress: TrainState) -> dict[str, Stateful]:
    """Every part of the training state a checkpoint holds, by name: the one list a new
    piece of resumable state joins (its class implements ``state_dict``,
    ``state_problem`` and ``load_state_dict``; :mod:`fbtrain.checkpoint.state` does the
    rest)."""
    parts: dict[str, Stateful] = {
        "model": ModelState(run.raw_model),
        "optimizer": OptimizerState(run.optimizer),
        "progress": progress,
        "sampler": run.sampler,
        "rng": GlobalRng(),
        "data": run.data.identity,
        "clock": run.clock,
    }
    if run.scaler.is_enabled():  # fp16's loss scale
        parts["scaler"] = ScalerState(run.scaler)
    if isinstance(run.batches, CarriedStreams):
        parts["streams"] = run.batches
    return parts


def checkpoint_payload(run: RunParts, progress: TrainState) -> dict[str, Any]:
    """The checkpoint of ``run`` at ``progress``: its parts, and what describes the model and
    the run (:func:`fbtrain.checkpoint.state.make_checkpoint`)."""
    return make_checkpoint(state_parts(run, progress), model_cfg=run.cfg.model,
                           tokenizer=run.data.tokenizer, step=progress.step,
                           config=run.cfg.to_dict(), world_size=run.ctx.world_size,
                           run_id=run.segment.run_id)


def restore(run: RunParts, progress: TrainState, payload: dict[str, Any], path: Path) -> None:
    """Put every part back from a checkpoint (checked whole first: a damaged one is one
    CheckpointError line, and nothing is restored).

    The checkpoint holds rank 0's batch sampler only: the other ranks (and every rank when
    the number of ranks changed) go on from fresh streams of their own rather than replay
    rank 0's."""
    cfg, ctx = run.cfg, run.ctx
    own_sampler = ctx.rank == 0 and payload.get("world_size", 1) == ctx.world_size
    parts = state_parts(run, progress)
    if not own_sampler:
        del parts["sampler"]
    restore_checkpoint(path, payload, parts, cfg.model)
    if not own_sampler:
        seed = rank_seed(cfg.run.seed, ctx.rank, progress.step)
        # Reseeded in place: the batches already draw from this sampler object, and
        # the checkpoint saves its state (a new object would leave both stale).
        fresh = BatchSampler(run.data.train_ids, seed, rank=ctx.rank)
        run.sampler.load_state_dict(fresh.state_dict())
        run.sampler.seed = seed
        torch.manual_seed(seed)
