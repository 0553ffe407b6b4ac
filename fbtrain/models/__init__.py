"""Model kinds and ``build_model``: ``logits, state = model(tokens, state=None)``."""

from __future__ import annotations

from torch import nn

from fbtrain.config import ModelConfig
from fbtrain.models.feedback import FeedbackTransformer
from fbtrain.models.state import MemoryState
from fbtrain.models.transformer import Transformer

__all__ = ["FeedbackTransformer", "MemoryState", "Transformer", "build_model", "count_parameters"]


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """Build the model ``cfg.kind`` names; raises ValueError on an invalid config."""
    problems = cfg.problems()
    if vocab_size < 1:
        problems.append(("vocab_size", vocab_size, "must be >= 1"))
    if problems:
        raise ValueError("; ".join(f"model.{k} = {v!r}: {msg}" for k, v, msg in problems))
    if cfg.kind == "transformer":
        return Transformer(cfg, vocab_size)
    return FeedbackTransformer(cfg, vocab_size)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
