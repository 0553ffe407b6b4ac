"""ConfigError, and how a message shows the value it is about (short, never the whole).

The bottom of the config package: every other module here reports through these.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from fbtrain.errors import UserError

MAX_SHOWN = 80  # characters of a value that an error message shows


class ConfigError(UserError):
    """One or more configuration problems; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class _ShortRepr(reprlib.Repr):
    """repr() that stops early: a message never prints (or even walks) a huge value."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 6
        self.maxstring = self.maxlong = self.maxother = MAX_SHOWN

    def repr_dict(self, x: dict, level: int) -> str:
        """As reprlib's, but in the order the keys were written (reprlib sorts them)."""
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in list(x.items())[:self.maxdict]]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"

    def repr_int(self, x: int, level: int) -> str:
        """Digits, or past Python's 4300-digit limit for int-to-text, their count."""
        try:
            return super().repr_int(x, level)
        except ValueError:
            return f"<an integer of about {int(x.bit_length() * math.log10(2))} digits>"


_SHORT_REPR = _ShortRepr()


def show(value: Any) -> str:
    """``repr(value)`` for an error message: at most MAX_SHOWN characters."""
    return cut(_SHORT_REPR.repr(value))


def cut(text: str) -> str:
    """``text`` cut to MAX_SHOWN characters (a key or value quoted in a message)."""
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."
