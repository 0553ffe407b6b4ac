"""Deterministic loss, bits per character and perplexity (used by ``train`` and ``eval``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LN2 = math.log(2.0)


@torch.no_grad()
def mean_loss(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> float:
    """Mean cross-entropy in nats over every target of windows x, y: [N, T] (each window
    from empty memory). Runs in eval mode and restores the model's mode afterwards."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, x.shape[0], batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            logits, _ = model(xb)
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                     yb.reshape(-1), reduction="sum").item()
            count += yb.numel()
    finally:
        model.train(was_training)
    return total / count
