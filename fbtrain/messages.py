"""Small helpers for one-line, user-facing messages about values and errors."""

from __future__ import annotations

import numbers
from typing import Any


def a_type(value: Any) -> str:
    """``value``'s type with its article, for messages: 'an int', 'a list'."""
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def first_line(error: BaseException) -> str:
    """An error's first line (at most 160 characters), or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else type(error).__name__


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (an int, a float, a numpy scalar) that is not a bool (True is an int)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
