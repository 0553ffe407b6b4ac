"""The optimizer and its learning-rate schedule.

AdamW with nanoGPT's split: weight decay on weight matrices and embeddings (parameters with
``dim >= 2``), none on biases and LayerNorm gains - and none on the relative-position tables
(``r``, ``b``), the query bias ``u`` or the memory mixing weights, which are not "sizes of a
mapping" that decay should shrink but positions and mixing logits, zero-/one-initialised on
purpose (decaying ``mem_weights`` would pull the memory mix towards uniform).

The schedule is a pure function of the step index and the config (no hidden state), so a
resumed run gets exactly the learning rates of an uninterrupted one, and a run resumed with
a larger ``train.max_steps`` simply re-plans its cosine decay.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fbtrain.config.schema import TrainConfig

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
    CUDA: on the CPU it is several times faster than the per-tensor loop
    (docs/performance.md), which matters because the relative-position tables make up most
    of a feedback model's parameters."""
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
