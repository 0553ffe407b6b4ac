"""Optimizer, learning-rate schedule and curriculum (sequence length and batch size per step)
for the trainer.

AdamW with nanoGPT's split: weight decay on weight matrices and embeddings (parameters with
``dim >= 2``), none on biases and LayerNorm gains - and none on the relative-position tables
(``r``, ``b``), the query bias ``u`` or the memory mixing weights, which are not "sizes of a
mapping" that decay should shrink but positions and mixing logits, zero-/one-initialised on
purpose (decaying ``mem_weights`` would pull the memory mix towards uniform).

The schedule is a pure function of the step index and the config (no hidden state), so a
resumed run gets exactly the learning rates of an uninterrupted one, and a run resumed with
a larger ``train.max_steps`` simply re-plans its cosine decay. So is the curriculum.

At run time this module imports nothing of fbtrain, and torch only when an optimizer is
built: the config (its memory estimate, fbtrain/config/budget.py) plans with
:class:`Curriculum`, and ``fbtrain --help`` loads the config but must not wait for torch.
The config's types are imported for type checking only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fbtrain.config.schema import CurriculumStage, TrainConfig

# Parameter names (last component) that never get weight decay, whatever their shape.
NO_DECAY_NAMES = frozenset({"r", "b", "u", "mem_weights"})


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed matrices/embeddings and everything else (no decay)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.dim() >= 2 and name.rsplit(".", 1)[-1] not in NO_DECAY_NAMES:
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`, fused (one kernel over all tensors) on the CPU and
    CUDA: on the CPU it is 3-5x faster than the per-tensor loop, which matters because the
    relative-position tables make up most of a feedback model's parameters."""
    import torch

    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=device.type in ("cpu", "cuda") or None,
    )


class LRSchedule:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``max_steps`` (or constant).

    ``lr_at(i)`` is the learning rate of the optimizer step with 0-based index ``i`` (the
    step logged as ``i + 1``). Warm-up starts at ``lr / warmup_steps``, not 0, so the first
    step already learns something.
    """

    def __init__(self, cfg: TrainConfig):
        self.kind = cfg.schedule
        self.lr = cfg.lr
        self.min_lr = cfg.min_lr
        self.warmup = cfg.warmup_steps
        self.max_steps = cfg.max_steps

    def lr_at(self, index: int) -> float:
        """The learning rate of the step with 0-based index ``index``."""
        if index < self.warmup:
            return self.lr * (index + 1) / self.warmup
        if self.kind == "constant":
            return self.lr
        span = max(1, self.max_steps - self.warmup)
        progress = min(1.0, (index - self.warmup) / span)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer, index: int) -> float:
        """Set every group's learning rate for step ``index``; returns it."""
        lr = self.lr_at(index)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        """What the schedule was (for the record; resuming recomputes it from the config)."""
        return {"kind": self.kind, "lr": self.lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup, "max_steps": self.max_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the learning rate is a function of the step and the config."""


class Planned(Protocol):
    """What :class:`Curriculum` reads of a :class:`fbtrain.config.Config` (a protocol, so
    this module needs no runtime import of the config, which imports it)."""

    @property
    def train(self) -> TrainConfig: ...

    @property
    def curriculum(self) -> Sequence[CurriculumStage]: ...


class Curriculum:
    """The curriculum's arithmetic: which stage, sequence length and batch size each
    optimizer step (0-based index) trains with, and the tokens over the whole run.

    A stage with ``until_step: 300`` holds the steps with index < 300; the last stage holds
    the rest. With ``train.constant_tokens`` a shorter stage gets a larger batch, so every
    step trains about as many tokens as one of the last stage.
    """

    def __init__(self, cfg: Planned):
        self.stages = list(cfg.curriculum)
        self.train = cfg.train

    def stage_index_at(self, step: int) -> int:
        """Index of the curriculum stage that holds ``step`` (0-based)."""
        for i, stage in enumerate(self.stages):
            if stage.until_step is None or step < stage.until_step:
                return i
        return len(self.stages) - 1

    def stage_at(self, step: int) -> CurriculumStage:
        """The curriculum stage that holds ``step`` (0-based)."""
        return self.stages[self.stage_index_at(step)]

    def seq_len_at(self, step: int) -> int:
        """Sequence length of the curriculum stage that holds ``step`` (0-based)."""
        return self.stage_at(step).seq_len

    def batch_size_at(self, step: int) -> int:
        """Batch size at ``step``: scaled up for short stages when ``constant_tokens`` is on."""
        if not self.train.constant_tokens:
            return self.train.batch_size
        tokens = self.train.batch_size * self.stages[-1].seq_len
        return max(1, tokens // self.seq_len_at(step))

    @property
    def max_seq_len(self) -> int:
        """The longest sequence of any stage."""
        return max(s.seq_len for s in self.stages)

    def total_tokens(self) -> int:
        """Training tokens over all ``max_steps`` (one rank; micro-batches included)."""
        total, start = 0, 0
        for stage in self.stages:
            end = self.train.max_steps if stage.until_step is None else min(
                stage.until_step, self.train.max_steps)
            if end > start:
                total += (end - start) * self.batch_size_at(start) * stage.seq_len
            start = max(start, end)
        return total * self.train.grad_accum
