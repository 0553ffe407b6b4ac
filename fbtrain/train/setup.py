"""Everything a run is built from, in one visible order: :func:`set_up` returns a frozen
:class:`Run` (data, model, optimizer, batches) and the :class:`Progress` it starts from.

The order is part of the contract: the random streams are seeded first, the data is loaded
(its vocabulary fixed by the checkpoint when there is one), the model is initialised from
the seeded stream, and only then is a checkpoint's state (weights, optimizer, every RNG
stream, the sampler, the carried memory) put back. Same config and seed, same order, same
numbers: that is what makes resume bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fbtrain.checkpoint.contents import (
    ARCHITECTURE,
    WarmStart,
    apply_warm_start,
    architecture_diff,
    check_resume_payload,
    check_warm_start,
    strip_wrapper_prefixes,
)
from fbtrain.checkpoint.files import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    resolve_checkpoint,
)
from fbtrain.config import Config, ConfigError
from fbtrain.data.corpus import Corpus, load_corpus
from fbtrain.data.errors import DataError, VocabularyError
from fbtrain.data.samplers import BatchSampler, SegmentReader, fixed_windows
from fbtrain.data.streams import require_tokens
from fbtrain.device import autocast_dtype
from fbtrain.distributed import DistContext
from fbtrain.models import build_model
from fbtrain.rng import rank_seed, restore_rng, seed_everything
from fbtrain.schedule import Curriculum, LRSchedule, build_optimizer
from fbtrain.train.batches import CarriedStreams, RandomWindows


@dataclass
class Progress:
    """What training has done so far: the trainer's only mutable state (with the model's,
    the optimizer's and the batches' own)."""

    step: int = 0  # optimizer steps done; the next one trained has this 0-based index
    tokens: int = 0  # over all ranks
    val_loss: float | None = None
    best_val_loss: float | None = None


@dataclass(frozen=True)
class TrainData:
    """The dataset as training uses it: the tokenizer, the training stream and the fixed
    validation windows ``val_x``, ``val_y`` ``[windows, length]`` (on the device)."""

    tokenizer: Any  # CharTokenizer, ByteTokenizer or WordTokenizer
    labelled: bool  # targets only where labelled (an ignore marker elsewhere)
    train_ids: Any  # the training split's stream (inputs, targets)
    val_x: Tensor
    val_y: Tensor
    n_tokens: tuple[int, int]  # tokens (characters, bytes or words) in the train and val splits


@dataclass(frozen=True)
class Run:
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


def set_up(cfg: Config, ctx: DistContext, manager: CheckpointManager, resume: str | None
           ) -> tuple[Run, Progress, Path | None]:
    """Build the run (fresh, resumed or warm-started): ``(run, progress, resumed_from)``.

    Call with the run directory's lock held (the trainer takes it first): which checkpoint
    to continue from is decided from what the directory holds.
    """
    resume_path = choose_resume(resume, manager)
    payload = load_checkpoint(resume_path) if resume_path else None
    init_path, init = warm_start_source(cfg, payload)
    seed_everything(cfg.run.seed)
    vocab = (payload or init or {}).get("vocab")
    data = load_data(cfg, ctx, vocab, init_path if payload is None else resume_path)
    sampler, batches = make_batches(cfg, ctx, data.train_ids)
    raw_model = build_model(cfg.model, data.tokenizer.vocab_size).to(ctx.device)
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
    progress = Progress()
    if payload is not None and resume_path is not None:
        progress = restore(payload, resume_path, cfg, ctx, raw_model, optimizer, scaler,
                           sampler, batches, data.train_ids)
    model = ctx.wrap(raw_model)
    model.train()
    run = Run(cfg=cfg, ctx=ctx, run_dir=manager.run_dir, curriculum=Curriculum(cfg),
              data=data, raw_model=raw_model, model=model,
              params=[p for p in raw_model.parameters() if p.requires_grad],
              optimizer=optimizer, schedule=LRSchedule(cfg.train), scaler=scaler,
              amp_dtype=amp_dtype, sampler=sampler, batches=batches, warm_report=warm_report)
    return run, progress, resume_path


# ----------------------------------------------------------------------------- what to resume


def choose_resume(resume: str | None, manager: CheckpointManager) -> Path | None:
    """The checkpoint to continue from (None: a fresh start).

    ``resume``: None starts fresh (refused when the run directory already holds ``last.pt``,
    so a trained run is never overwritten by accident); ``"auto"`` continues from
    ``last.pt`` when it exists; anything else is a checkpoint file or run directory, refused
    when it belongs to another run and this directory already holds checkpoints of its own.
    """
    run_dir, last = manager.run_dir, manager.last_path
    if resume is None:
        if last.is_file():
            raise ConfigError([
                f"run directory {run_dir} already holds {last}; continue it with "
                "--resume auto, or start anew under another run.name (--set run.name=NEW)"
                " or after deleting that folder"
            ])
        return None
    if resume == "auto":
        return last if last.is_file() else None
    path = resolve_checkpoint(resume, prefer="last")
    theirs = [p for p in (last, manager.best_path, *manager.numbered()) if p.is_file()]
    if theirs and not path.resolve().is_relative_to(run_dir.resolve()):
        # Resuming writes last.pt, best.pt and metrics.jsonl here: another run's would
        # be overwritten. (A checkpoint of this run itself, say step-N.pt, is fine.)
        raise ConfigError([
            f"--resume {path} belongs to another run, but run directory {run_dir} "
            f"already holds its own checkpoints ({theirs[0].name}, ...); resume into "
            f"another run.name (--set run.name=NEW), or use --resume auto to continue "
            f"{run_dir.name}"
        ])
    return path


def warm_start_source(cfg: Config, payload: dict | None) -> tuple[Path | None, dict | None]:
    """The ``train.init_from`` checkpoint, loaded and checked (only when starting fresh)."""
    if not cfg.train.init_from or payload is not None:
        return None, None
    return check_warm_start(cfg.train.init_from, cfg.model)


# ----------------------------------------------------------------------------- data


def load_data(cfg: Config, ctx: DistContext, vocab: list[str] | None,
              vocab_source: Path | None) -> TrainData:
    """The dataset's train/val streams (``corpus.py``) and the fixed validation windows.

    The vocabulary comes from the checkpoint being resumed or warm-started from (its
    embedding rows are indexed by it), else from the data.
    """
    try:
        corpus = _main_rank_first(cfg, ctx, lambda: load_corpus(cfg.data, vocab))
    except VocabularyError as e:  # about the checkpoint; other data problems are the data's
        raise DataError(f"vocabulary of checkpoint {vocab_source}: {e}") from None
    train_ids, val_ids = corpus.splits["train"], corpus.splits["val"]
    # Checked now, before anything is written (the sampler would only at step 1).
    max_seq_len = Curriculum(cfg).max_seq_len
    require_tokens(len(train_ids.inputs) + 1, max_seq_len, "training text")
    carry = cfg.train.context == "carry"
    # Computed once: every evaluation scores the same windows, so curves are comparable.
    # With carried memory each scored window runs on a full memory window of context.
    # A labelled dataset may need more context to be scored exactly (corpus.history).
    context = max(cfg.model.memory_window, corpus.history) if carry else 0
    # Carried segments are often short (16 tokens): windows of one segment would score
    # a few hundred tokens, too few to compare runs or pick best.pt by, so each window
    # scores at least a memory window's worth.
    scored = max_seq_len
    if carry:
        scored = max(scored, cfg.model.memory_window)
    val_x, val_y = fixed_windows(val_ids, scored, cfg.train.eval_windows, context=context)
    return TrainData(tokenizer=corpus.tokenizer, labelled=corpus.labelled, train_ids=train_ids,
                     val_x=val_x.to(ctx.device), val_y=val_y.to(ctx.device),
                     n_tokens=(len(train_ids.inputs), len(val_ids.inputs)))


def _main_rank_first(cfg: Config, ctx: DistContext, load: Callable[[], Corpus]) -> Corpus:
    # Under DDP rank 0 fills the download cache first, so ranks don't all download
    # (or unzip: the other ranks then read the prepared enwik8/text8 from the cache).
    downloads = cfg.data.path is None and ctx.enabled
    if downloads and not ctx.is_main:
        ctx.barrier()
    corpus = load()
    if downloads and ctx.is_main:
        ctx.barrier()
    return corpus


def make_batches(cfg: Config, ctx: DistContext, train_ids: Any
                 ) -> tuple[BatchSampler, CarriedStreams | RandomWindows]:
    """The batch sampler (its state is checkpointed) and where each step's batches come
    from: random windows (``train.context: reset``) or carried streams (``carry``)."""
    train = cfg.train
    sampler = BatchSampler(train_ids, cfg.run.seed, rank=ctx.rank)
    if train.context == "carry":
        layout = SegmentReader(train_ids, train.batch_size * train.grad_accum, ctx.rank,
                              ctx.world_size)
        return sampler, CarriedStreams(layout, train.grad_accum)
    return sampler, RandomWindows(sampler, train.grad_accum)


# ----------------------------------------------------------------------------- restore


def restore(payload: dict[str, Any], path: Path, cfg: Config, ctx: DistContext,
            model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
            sampler: BatchSampler, batches: CarriedStreams | RandomWindows,
            train_ids: Any) -> Progress:
    """Put back model, optimizer, counters and every RNG stream from a checkpoint (checked
    whole first: a damaged one is one CheckpointError line, and nothing is restored)."""
    saved = payload.get("model_config")  # a different model is the clearer message
    diff = architecture_diff(saved, cfg.model, ARCHITECTURE) if isinstance(saved, dict) else []
    if diff:
        raise CheckpointError(f"{path}: the checkpoint's model differs from model.* in the "
                              f"config ({'; '.join(diff)}); resume with its config")
    check_resume_payload(path, payload, optimizer)
    try:
        model.load_state_dict(strip_wrapper_prefixes(payload["model"]))
        optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot restore training state: {first}") from None
    if scaler.is_enabled() and "scaler" in payload:
        scaler.load_state_dict(payload["scaler"])
    progress = Progress(step=int(payload["step"]), tokens=int(payload.get("tokens", 0)),
                        val_loss=payload.get("val_loss"),
                        best_val_loss=payload.get("best_val_loss"))
    rng = payload["rng"]
    restore_rng(rng, path)
    same_world = payload.get("world_size", 1) == ctx.world_size
    if isinstance(batches, CarriedStreams):
        if "streams" not in payload:
            raise CheckpointError(f"{path}: cannot resume with train.context = carry: the "
                                  "checkpoint holds no carried streams (it was trained "
                                  "with context reset)")
        # Only rank 0's memory is saved: other ranks go on from empty memory.
        batches.load_state_dict(payload["streams"], ctx.device, memory=ctx.rank == 0)
    if ctx.rank == 0 and same_world and "sampler" in rng:
        sampler.load_state_dict(rng["sampler"])
    else:
        # The checkpoint holds rank 0's streams only: other ranks (or a changed world
        # size) continue on fresh streams of their own rather than replay rank 0's.
        seed = rank_seed(cfg.run.seed, ctx.rank, progress.step)
        # Reseeded in place: the batches already draw from this sampler object, and
        # the checkpoint saves its state (a new object would leave both stale).
        fresh = BatchSampler(train_ids, seed, rank=ctx.rank)
        sampler.load_state_dict(fresh.state_dict())
        sampler.seed = seed
        torch.manual_seed(seed)
    return progress
