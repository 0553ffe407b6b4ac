"""Model kinds and ``build_model``: ``logits, state = model(tokens, state=None)``.

Which class a kind is, and what else fbtrain knows about it, is its entry in the registry
(:mod:`fbtrain.config.kinds`), which names the class by its import path: a kind's module
is imported when a model of that kind is built, not with this package.
"""

from __future__ import annotations

import importlib

from torch import nn

from fbtrain.config import ModelConfig
from fbtrain.config.kinds import ModelKind, model_kind
from fbtrain.errors import ArgumentError
from fbtrain.models.state import MemoryState

__all__ = ["MemoryState", "build_model", "count_parameters", "model_class"]


def model_class(kind: ModelKind) -> type[nn.Module]:
    """The class a registry entry names (``"module:Class"``)."""
    module, _, name = kind.model_class.partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Build the model ``cfg.kind`` names in the registry; raises ArgumentError (a
    ValueError; one line, its problems joined by "; ") on an invalid config, an unknown kind
    included (whatever made ``cfg``)."""
    problems = cfg.problems()
    if vocab_size < 1:
        problems.append(("vocab_size", vocab_size, "must be >= 1"))
    if problems:
        raise ArgumentError("; ".join(f"model.{k} = {v!r}: {msg}" for k, v, msg in problems))
    return model_class(model_kind(cfg.kind))(cfg, vocab_size)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
