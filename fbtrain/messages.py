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


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units, one decimal: 1.5 GiB, 8.0 TiB."""
    try:
        value = float(n)
    except OverflowError:  # past 10^308: only the exponent means anything
        return f"about 10^{len(str(n)) - 1} bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"):
        if value < 1024 or unit == "YiB":
            break
        value /= 1024
    if unit == "bytes":
        return f"{n} bytes"
    if value >= 1024:  # beyond yobibytes: the exponent says more than the digits
        return f"{float(n):.1e} bytes"
    return f"{value:.1f} {unit}"
