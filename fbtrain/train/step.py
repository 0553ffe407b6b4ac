"""One optimizer step: forward/backward over the micro-batches, clip, agree across ranks,
check that the loss and gradient norm are finite, update.

One host sync per step (the loss and gradient norm, needed for the non-finite check);
everything else stays on the device. Under DDP two small all-reduces: the step's scored
count before the backward (the loss is normalised by it), the figures after.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fbtrain.device import autocast
from fbtrain.distributed import DistContext
from fbtrain.errors import EXIT_FAILED, TrainingError
from fbtrain.scoring import count_scored, score_sums
from fbtrain.train.setup import Run
from fbtrain.train.signals import EXIT_CODES, STOP_PRIORITY, StopSignals

EXIT_NONFINITE = EXIT_FAILED  # a non-finite loss or gradient norm


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
    memory_rms: Tensor  # RMS of the memory keys the step left (rank 0's last micro-batch)
    seconds: float  # the step's own time, for tokens/s
    accuracy: float | None = None  # over the scored targets, for a labelled dataset


def train_step(run: Run, index: int, signals: StopSignals, last: Path) -> StepResult:
    """Train the step with 0-based ``index``. A non-finite loss stops it before the update
    (a :class:`TrainingError` naming ``last``, the newest checkpoint, if there is one)."""
    cfg, ctx, device = run.cfg, run.ctx, run.ctx.device
    seq_len, batch = run.curriculum.seq_len_at(index), run.curriculum.batch_size_at(index)
    accum = cfg.train.grad_accum
    start = time.perf_counter()
    lr = run.schedule.apply(run.optimizer, index)
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    tokens = 0
    micro_batches = run.batches.micro_batches(seq_len, batch, device)
    scored = step_scored(ctx, [y for _, y, _ in micro_batches])
    denominator = loss_denominator(ctx, scored)
    for micro, (x, y, state) in enumerate(micro_batches):
        # DDP all-reduces gradients on the last micro-batch only.
        sync = micro == accum - 1 or not ctx.enabled
        with contextlib.nullcontext() if sync else run.model.no_sync():
            with autocast(cfg.run.precision, device):
                logits, new_state = run.model(x, state)
            ce_sum, _, right = score_sums(logits, y)
            loss = ce_sum / denominator
            run.scaler.scale(loss).backward()
        run.batches.keep(micro, new_state)
        loss_sum += loss.detach()
        correct += right
        tokens += x.numel()
    memory_rms = new_state.keys.detach().float().square().mean().sqrt()
    run.scaler.unscale_(run.optimizer)
    clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, clip)
    accuracy = correct.float() / denominator
    loss_value, norm_value, accuracy_value, stop = agree(run, loss_sum, grad_norm, accuracy,
                                                         signals)
    check_finite(run, index + 1, loss_value, norm_value, last)
    if run.data.labelled and not bool(scored):
        # No labelled target in the whole step: its loss, accuracy and gradient are not 0
        # but undefined, so they are logged as null (as validation logs them); the update
        # below is made as ever (a zero gradient), so training numbers do not change.
        loss_value = norm_value = accuracy_value = math.nan
    run.scaler.step(run.optimizer)  # skips the step if fp16 gradients overflowed
    run.scaler.update()
    return StepResult(loss_value, norm_value, lr, seq_len, batch, tokens * ctx.world_size, stop,
                      memory_rms, time.perf_counter() - start,
                      accuracy_value if run.data.labelled else None)


def step_scored(ctx: DistContext, targets: list[Tensor]) -> Tensor:
    """The scored targets of the whole step (a 0-dim integer tensor): all its micro-batches
    (``targets``, this rank's) on every rank - all targets for a text, the labelled ones for
    a labelled dataset, which are spread unevenly - summed over ranks by one all-reduce
    before the backward (as torchtitan does)."""
    scored = sum(count_scored(y) for y in targets)
    return ctx.all_reduce_sum(scored.clone()) if ctx.enabled else scored


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


def agree(run: Run, loss: Tensor, grad_norm: Tensor, accuracy: Tensor, signals: StopSignals
          ) -> tuple[float, float, float, int | None]:
    """Loss and accuracy (means over ranks of shares that :func:`loss_denominator` scaled
    to make that mean the step's), gradient norm and stop signal, the same on every rank.

    One small all-reduce under DDP, so that every rank stops at the same step (a rank
    leaving alone would hang the others in their next collective).
    """
    ctx = run.ctx
    if not ctx.enabled:
        loss_value, norm_value, acc_value = torch.stack(
            [loss.float(), grad_norm.float(), accuracy.float()]).tolist()
        return loss_value, norm_value, acc_value, signals.received
    # One flag per signal; a stop any rank was asked for stops every rank.
    flags = torch.tensor([float(signals.received == sig) for sig in EXIT_CODES],
                         device=ctx.device)
    stats = torch.cat([torch.stack([loss.float(), grad_norm.float(), accuracy.float()]),
                       flags])
    loss_sum, norm_sum, acc_sum, *counts = ctx.all_reduce_sum(stats).tolist()
    asked = {sig for sig, n in zip(EXIT_CODES, counts, strict=True) if n}
    # This rank's own signal when it has one (its exit code must match what it says).
    stop = signals.received or next((s for s in STOP_PRIORITY if s in asked), None)
    # Every rank holds the same (all-reduced) gradients, hence the same norm.
    n = ctx.world_size
    return loss_sum / n, norm_sum / n, acc_sum / n, stop


def check_finite(run: Run, step: int, loss: float, grad_norm: float, last: Path) -> None:
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
        EXIT_NONFINITE,
    )
