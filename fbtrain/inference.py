"""The one inference context: every forward that does not train runs in it.

Validation during training, the samples it logs, ``fbtrain eval`` and ``fbtrain sample``
all score or generate under :func:`inference`, so the same checkpoint gets the same numbers
whichever of them runs it (``eval`` reproduces the run's validation line): eval mode (no
dropout), the run's precision (the autocast training used, :func:`fbtrain.device.autocast`),
no autograd (``torch.inference_mode``: nothing recorded, no tensor that can require a
gradient), the weights promised frozen (a feedback model folds its tables once per window
size rather than once per call) and every random stream left where it was
(:func:`fbtrain.rng.preserve_rng`). On exit the model's train/eval mode is put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fbtrain.config import RunConfig
from fbtrain.config.schema import PRECISIONS
from fbtrain.device import autocast, matmul_precision
from fbtrain.errors import ArgumentError
from fbtrain.rng import preserve_rng


@contextlib.contextmanager
def inference(model: nn.Module, precision: str, device: torch.device | str) -> Iterator[None]:
    """Run the block as inference of ``model`` on ``device`` at ``precision`` (``auto``,
    ``fp32``, ``bf16`` or ``fp16``, as ``run.precision``); restores the model's mode.
    Any other ``precision`` is an ArgumentError (autocast would read it as fp16)."""
    if precision not in PRECISIONS:
        raise ArgumentError(f"precision = {precision!r}: must be one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    was_training = model.training
    model.eval()
    frozen = getattr(model, "frozen_weights", contextlib.nullcontext)
    try:
        with preserve_rng(device), torch.inference_mode(), frozen(), \
                autocast(precision, device), matmul_precision(precision, device):
            yield
    finally:
        model.train(was_training)


def saved_precision(payload: dict[str, Any]) -> str:
    """The precision a checkpoint's run trained and validated at: its config's
    ``run.precision``, or ``run.precision``'s default for one that does not say (an old
    checkpoint, or an export of one)."""
    config = payload.get("config")
    run = config.get("run") if isinstance(config, dict) else None
    value = run.get("precision") if isinstance(run, dict) else None
    return value if value in PRECISIONS else RunConfig.precision
