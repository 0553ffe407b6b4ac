"""Metric values as the backends want them: plain Python numbers."""

from __future__ import annotations

import numbers
from typing import Any


def plain(value: Any) -> Any:
    """0-d tensors and numpy scalars -> Python numbers (JSON and TensorBoard want those)."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def is_number(value: Any) -> bool:
    """A real number, and not a bool (True is an int too)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
