"""A training step (or the set-up before it) that runs out of memory: one line naming the
batch and what fits, exit 2.

The config's memory estimate (:mod:`fbtrain.config.budget`) refuses only what cannot fit
(it is a lower bound); a batch it lets through can still fail to allocate. The allocator's
own report is a traceback ending in ``DefaultCPUAllocator: can't allocate memory`` (or
``torch.OutOfMemoryError`` on CUDA): this turns it into the user's error it is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fbtrain.config.budget import available_memory, estimate
from fbtrain.config.limits import MemoryLimit, allocation_failed, is_allocation_failure
from fbtrain.errors import OutOfMemory
from fbtrain.messages import format_bytes

if TYPE_CHECKING:
    from fbtrain.config import Config
    from fbtrain.train.setup import RunParts

__all__ = ["OutOfMemory", "evaluating", "is_allocation_failure", "out_of_memory", "setting_up"]


def device_limit(device: torch.device) -> MemoryLimit | None:
    """The memory training on ``device`` may use: the card's, or (CPU) the process's."""
    if device.type == "cuda":
        return MemoryLimit(int(torch.cuda.get_device_properties(device).total_memory),
                           f"{device} has")
    return available_memory()


def largest_batch(cfg: Config, size: int) -> int:
    """The largest ``train.batch_size`` whose estimated step fits in ``size`` bytes (0 when
    none does). The estimate is a lower bound, so this is an upper bound on what fits."""
    def fits(batch: int) -> bool:
        smaller = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                     batch_size=batch))
        return estimate(smaller).total <= size

    low, high = 0, cfg.train.batch_size  # fits(low), and high did not (it ran out)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def out_of_memory(run: RunParts, index: int) -> OutOfMemory:
    """The error for step ``index`` (0-based) running out of memory: its batch, the limit
    it met, and the largest train.batch_size the estimate lets through (at most)."""
    cfg = run.cfg
    seq_len, batch = run.curriculum.seq_len_at(index), run.curriculum.batch_size_at(index)
    accum = cfg.train.grad_accum
    micro = f" in {accum} micro-batches" if accum > 1 else ""
    what = (f"step {index + 1}: out of memory training {batch:,} sequences of {seq_len:,} "
            f"tokens{micro} (train.batch_size = {cfg.train.batch_size})")
    limit = device_limit(run.ctx.device)
    if limit is None:
        return OutOfMemory(f"{what}; lower train.batch_size")
    fits = largest_batch(cfg, limit.size)
    # The estimate counts the least a step keeps, not its temporaries: half the memory by
    # it leaves room for them.
    roomy = largest_batch(cfg, limit.size // 2)
    if not roomy:
        hint = "; even one sequence leaves no room by fbtrain's estimate: make the model smaller"
    else:
        hint = (f"; by fbtrain's estimate, which counts only the least a step keeps, at most "
                f"{fits:,} fit, and {roomy:,} leave room for the rest; train.grad_accum "
                "keeps the tokens per step")
    return OutOfMemory(f"{what}, but {limit.holder} {format_bytes(limit.size)}{limit.how}: "
                       f"lower train.batch_size{hint}")


def evaluating(error: BaseException, run: RunParts, step: int, saved: Path,
               batch: int) -> OutOfMemory:
    """The error for the evaluation of step ``step`` running out of memory (``error``: the
    allocation that failed): the step is saved as ``saved`` (before the line, or when the
    run was resumed from it), or nothing was trained yet; ``batch``: the validation
    windows scored at once (at most)."""
    windows, length = run.data.val_x.shape
    doing = (f"at step {step} evaluating {windows:,} validation windows of {length:,} tokens, "
             f"{min(batch, windows):,} at a time (train.eval_windows = "
             f"{run.cfg.train.eval_windows})")
    fewer = f"lower train.eval_windows (the windows scored at once are at most {batch})"
    fix = (f"step {step} is saved ({saved}); {fewer} and resume with --resume auto"
           if saved.is_file() else f"nothing was trained yet; {fewer}")
    return OutOfMemory(allocation_failed(error, doing, fix))


def setting_up(error: BaseException) -> OutOfMemory:
    """The error for the set-up (data, model, optimizer: before the first step) running out
    of memory (``error``: the allocation that failed, :func:`is_allocation_failure`)."""
    return OutOfMemory(allocation_failed(error, "setting up the run (data, model, optimizer)",
                                         "make the model or the data smaller, or give the "
                                         "process more memory"))
