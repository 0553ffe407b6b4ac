"""One optimizer step: forward/backward over the micro-batches, clip, agree across ranks,
check that the loss and gradient norm are finite, update.

One host sync per step, in every mode (:func:`read_figures`: the loss, gradient norm,
accuracy, memory RMS and scored count in one copy, what the non-finite check and the log
need); everything else stays on the device. Under DDP two small all-reduces: the step's
scored count before the backward (the loss is normalised by it), the figures after.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from fbtrain.config.kinds import model_kind
from fbtrain.data.streams import IGNORE_INDEX
from fbtrain.distributed import DistContext
from fbtrain.errors import EXIT_FAILED, TrainingError
from fbtrain.models.state import MemoryState
from fbtrain.scoring import count_scored, score_sums
from fbtrain.train.setup import RunParts
from fbtrain.train.signals import STOP_PRIORITY, STOPPING, StopSignals

HOST_SYNC = "fbtrain::host_sync"  # profiler mark of the step's one read on the host
FIGURES = 6  # step_body's figures, before the memory weights (with_memory_weights)


@dataclass
class StepResult:
    """One optimizer step, as agreed by all ranks: the loss and accuracy are over every
    scored target of the step, all micro-batches and ranks together."""

    loss: float
    grad_norm: float  # before clipping
    lr: float
    seq_len: int
    batch_size: int
    tokens: int  # over all ranks and micro-batches
    stop: int | None  # the signal that asks to stop after this step, if any
    memory_rms: Tensor  # RMS of the memory keys the step left (rank 0's last micro-batch;
    #                     0-dim on the CPU: read in the step's one host read)
    seconds: float  # the step's own time, for tokens/s
    accuracy: float | None = None  # over the scored targets, for a labelled dataset
    memory_weights: list[float] = field(default_factory=list)  # after the update, if mixed
    chars_per_token: float = 1.0  # characters the step's scored targets cover, per target


MicroBatch = tuple[Tensor, Tensor, MemoryState | None]  # inputs, targets [rows, T], memory
# The whole step as a CUDA graph (fbtrain.train.step_graph.StepGraphs): step_body and the
# update for a step's micro-batches at a learning rate; the figures step_body returns.
GraphedStep = Callable[[list[MicroBatch], float], Tensor]


def train_step(run: RunParts, index: int, signals: StopSignals, last: Path,
               graphs: GraphedStep | None = None) -> StepResult:
    """Train the step with 0-based ``index``. A non-finite loss stops it before the update
    (a :class:`TrainingError` naming ``last``, the newest checkpoint, if there is one).

    Eager, or through ``graphs``: the same body (:func:`step_body`), read, stop rules and
    result; the graph makes the update itself, skipped on the device on the same test
    :func:`check_finite` makes on the host."""
    seq_len, batch = run.curriculum.seq_len_at(index), run.curriculum.batch_size_at(index)
    start = time.perf_counter()
    lr = run.schedule.apply(run.optimizer, index)
    micro_batches = run.batches.micro_batches(seq_len, batch, run.ctx.device)
    stats = step_body(run, micro_batches) if graphs is None else graphs(micro_batches, lr)
    if graphs is None:
        update(run, stats)
    figures = read_figures(run, with_memory_weights(run, stats), signals)
    check_finite(run, index + 1, figures.loss, figures.grad_norm, last)
    tokens = sum(x.numel() for x, _, _ in micro_batches) * run.ctx.world_size
    return step_result(run, figures, lr, seq_len, batch, tokens, start)


def step_body(run: RunParts, micro_batches: list[MicroBatch]) -> Tensor:
    """Forward and backward over this rank's ``micro_batches`` (inputs and targets
    ``[rows, T]``, the memory each starts from), then the gradients unscaled and clipped:
    everything of a step but the update, with no read on the host.

    Returns the step's figures on the device, float32 ``[6]``: the loss (the mean over
    every scored target of the step, this rank's share of it under DDP), the gradient norm
    before clipping, the accuracy (this rank's share, as the loss), the RMS of the memory
    keys the last micro-batch left, the scored targets of the step on all ranks, and the
    characters this rank's scored targets cover (its scored count where every token is one
    character).
    """
    cfg, ctx, device = run.cfg, run.ctx, run.ctx.device
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    targets = [y for _, y, _ in micro_batches]
    own, scored = step_scored(ctx, targets)
    token_chars = run.data.token_chars  # None: every token is one character
    chars = own if token_chars is None else sum(characters_of(token_chars, y) for y in targets)
    denominator = loss_denominator(ctx, scored)
    for micro, (x, y, state) in enumerate(micro_batches):
        # DDP all-reduces gradients on the last micro-batch only.
        sync = micro == cfg.train.grad_accum - 1 or not ctx.enabled
        with contextlib.nullcontext() if sync else run.model.no_sync():
            with _autocast(run):
                logits, new_state = run.model(x, state)
            ce_sum, _, right = score_sums(logits, y)
            loss = ce_sum / denominator
            run.scaler.scale(loss).backward()
        run.batches.keep(micro, new_state)
        loss_sum += loss.detach()
        correct += right
    memory_rms = new_state.keys.detach().float().square().mean().sqrt()
    run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, clip_value(cfg.train.grad_clip))
    accuracy = correct.float() / denominator
    return torch.stack([loss_sum.float(), grad_norm.float(), accuracy.float(), memory_rms,
                        scored.float(), chars.float()])


def characters_of(token_chars: Tensor, targets: Tensor) -> Tensor:
    """The characters the scored ``targets`` ``[rows, T]`` cover (0-dim int64, on the
    device, no host read), each target's count read from ``token_chars`` ``[vocab]``."""
    return torch.where(targets != IGNORE_INDEX, token_chars[targets.clamp(min=0)], 0).sum()


def _autocast(run: RunParts) -> contextlib.AbstractContextManager:
    """The run's autocast, without its cache of cast weights: the graphed step captures
    this body, and cast copies cached during a capture would be the graph's, freed under it
    (PyTorch's CUDA graph notes). The casts give the same values either way."""
    if run.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(run.ctx.device.type, dtype=run.amp_dtype, cache_enabled=False)


def clip_value(grad_clip: float) -> float:
    """The gradient norm clipping clips to: ``train.grad_clip``, or no clipping at 0 (the
    norm is still computed: it is logged and checked)."""
    return grad_clip if grad_clip > 0 else math.inf


def step_scored(ctx: DistContext, targets: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The scored targets of this rank's micro-batches (``targets``) and of the whole step
    on every rank (0-dim integer tensors) - all targets for a text, the labelled ones for
    a labelled dataset, which are spread unevenly - the second summed over ranks by one
    all-reduce before the backward (as torchtitan does); the same tensor alone."""
    own = sum(count_scored(y) for y in targets)
    return own, (ctx.all_reduce_sum(own.clone()) if ctx.enabled else own)


def loss_denominator(ctx: DistContext, scored: Tensor) -> Tensor:
    """What each micro-batch's summed cross-entropy is divided by (a 0-dim float tensor),
    given the step's global count ``scored`` (:func:`step_scored`).

    The step's loss is the mean over every scored target of the whole step, so the divisor
    is that count, over the world size because DDP averages the ranks' gradients. A rank's
    own count would make the loss a mean of per-rank means, which is not the loss of one
    process on the same global batch when the ranks score different numbers of targets.

    Alone, or with equal counts on every rank, this is the rank's own count exactly (the
    global count over a power-of-two world size, or the count itself, is exact in float32),
    so a text's steps keep their numbers bit for bit.
    """
    total = scored.clamp(min=1).float()
    return total / ctx.world_size if ctx.enabled else total


def update(run: RunParts, stats: Tensor) -> None:
    """AdamW's step, skipped on the device where :func:`step_body`'s ``stats`` hold a
    non-finite loss or gradient norm (the test :func:`check_finite` then makes on the host
    and stops on): so the step's one host read can come after the update and carry what
    the update made (the memory weights the log records), and a refused step still leaves
    the weights as they were. The optimizer is fused AdamW (``found_inf`` is how it takes
    such a gate, as from GradScaler). Under fp16 loss scaling the scaler gates instead: it
    skips a step whose gradients overflowed, which a non-finite loss makes them."""
    if run.scaler.is_enabled():
        run.scaler.step(run.optimizer)
        run.scaler.update()
        return
    finite = torch.isfinite(stats[0]) & torch.isfinite(stats[1])
    run.optimizer.found_inf = (~finite).float()
    try:
        run.optimizer.step()
    finally:
        del run.optimizer.found_inf


def with_memory_weights(run: RunParts, stats: Tensor) -> Tensor:
    """``stats`` and, for a model that mixes its memory, its memory weights after the
    update (``[L+1]``, float32): what the step's record logs, read with its figures."""
    if not model_kind(run.cfg.model.kind).memory_mix:
        return stats
    with torch.no_grad():
        return torch.cat([stats, run.raw_model.memory_weights().float()])


class Figures(NamedTuple):
    """A step's figures on the host, the same on every rank (:func:`read_figures`)."""

    loss: float
    grad_norm: float  # before clipping
    accuracy: float
    memory_rms: Tensor  # 0-dim float32 on the CPU: rank 0's (StepResult.memory_rms)
    scored: bool  # whether the step scored any target, on any rank
    stop: int | None  # the signal that asks to stop after this step, if any
    memory_weights: list[float]  # after the update (empty unless the model mixes memory)
    chars_per_token: float  # characters the step's scored targets cover, per target


def read_figures(run: RunParts, stats: Tensor, signals: StopSignals) -> Figures:
    """The step's one host read: :func:`step_body`'s figures ``stats`` copied to the host,
    agreed across ranks. The non-finite stop, the nothing-scored rule and the log all read
    them from here.

    Under DDP the copy is of one small all-reduce, so that every rank stops at the same step
    (a rank leaving alone would hang the others in their next collective): the loss and
    accuracy are means over ranks of shares that :func:`loss_denominator` scaled to make
    that mean the step's, every rank holds the same (all-reduced) gradients and so the same
    norm, the scored count is the same global one on every rank (summed, it is zero only
    where it is zero), and the memory RMS is rank 0's (every other rank adds 0, exactly).
    """
    ctx = run.ctx
    n_weights = len(stats) - FIGURES  # with_memory_weights
    if ctx.enabled:
        # One flag per signal; a stop any rank was asked for stops every rank.
        flags = torch.tensor([float(signals.received == sig) for sig in STOPPING],
                             device=ctx.device)
        stats = torch.cat([stats, flags])
        if not ctx.is_main:  # rank 0's memory RMS and weights (the others add 0, exactly)
            stats[3] = 0.0
            stats[FIGURES:FIGURES + n_weights] = 0.0
        ctx.all_reduce_sum(stats)
    with torch.profiler.record_function(HOST_SYNC):
        host = stats.to("cpu", copy=True)
    loss, norm, accuracy, _, scored, chars, *rest = host.tolist()
    weights, counts = rest[:n_weights], rest[n_weights:]
    stop = signals.received
    if ctx.enabled:
        n = ctx.world_size
        loss, norm, accuracy, scored = loss / n, norm / n, accuracy / n, scored / n
        asked = {sig for sig, count in zip(STOPPING, counts, strict=True) if count}
        # This rank's own signal when it has one (its exit code must match what it says).
        stop = stop or next((s for s in STOP_PRIORITY if s in asked), None)
    return Figures(loss, norm, accuracy, host[3], scored > 0, stop, weights,
                   chars / scored if scored > 0 else 1.0)


def step_result(run: RunParts, figures: Figures, lr: float, seq_len: int, batch: int,
                tokens: int, start: float) -> StepResult:
    """The trainer's record of a step that passed :func:`check_finite`, begun at ``start``
    (``time.perf_counter()``) and training ``tokens`` over all ranks."""
    loss, norm, accuracy = figures.loss, figures.grad_norm, figures.accuracy
    if run.data.labelled and not figures.scored:
        # No labelled target in the whole step: its loss, accuracy and gradient are not 0
        # but undefined, so they are logged as null (as validation logs them); the update
        # was made as ever (a zero gradient), so training numbers do not change.
        loss = norm = accuracy = math.nan
    return StepResult(loss, norm, lr, seq_len, batch, tokens, figures.stop, figures.memory_rms,
                      time.perf_counter() - start, accuracy if run.data.labelled else None,
                      figures.memory_weights, figures.chars_per_token)


def check_finite(run: RunParts, step: int, loss: float, grad_norm: float, last: Path) -> None:
    """Stop before the optimizer step on a non-finite loss or gradient norm.

    With fp16 loss scaling an overflowing gradient is routine (the scaler skips that
    step and lowers the scale), so only the loss counts there.
    """
    if math.isfinite(loss) and (math.isfinite(grad_norm) or run.scaler.is_enabled()):
        return
    what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", grad_norm)
    good = f"last good: {last}" if last.is_file() else "no checkpoint was saved yet"
    hint = "a lower train.lr" + (" or train.grad_clip > 0" if not run.cfg.train.grad_clip
                                 else "")
    raise TrainingError(
        f"step {step}: {what} is {value}; stopped before the optimizer step, no checkpoint "
        f"written ({good}); try {hint}",
        EXIT_FAILED,
    )
