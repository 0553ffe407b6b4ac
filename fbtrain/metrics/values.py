"""Metric values as the backends want them: plain Python numbers."""

from __future__ import annotations

from typing import Any

from fbtrain.messages import is_number

__all__ = ["is_number", "plain"]  # is_number: the one in messages, here for the backends


def plain(value: Any) -> Any:
    """0-d tensors and numpy scalars -> Python numbers (JSON and TensorBoard want those)."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value
