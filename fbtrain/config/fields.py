"""One config field: how it is declared (default, help text, checks as metadata), which
types it accepts, and the checks it makes on its own value.

Below the sections (schema.py), which declare their fields with :func:`setting` and run
:func:`field_problems` in their ``problems()``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any

import yaml

# Integers are stored and used as 64-bit (torch seeds, step counters, tensor sizes).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def setting(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with its help text and checks (choices, min, max, gt) as metadata."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: yaml_copy(default),
                                 metadata={"help": help, **checks})
    return dataclasses.field(default=default, metadata={"help": help, **checks})


def yaml_copy(value: Any) -> Any:
    """A deep copy through YAML (shared values stay shared, as aliases)."""
    return yaml.safe_load(yaml.safe_dump(value))


def allowed_types(tp: Any) -> tuple[type, ...]:
    """The runtime types a field annotated ``tp`` accepts (``int | None`` -> (int, NoneType))."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(t for a in typing.get_args(tp) for t in allowed_types(a))
    return (tp,)


def type_name(types_: tuple[type, ...]) -> str:
    """The types as a message names them: ``int or null``."""
    return " or ".join("null" if t is type(None) else t.__name__ for t in types_)


def coerce(value: Any, allowed: tuple[type, ...]) -> tuple[bool, Any]:
    """Accept ``value`` for a field of the given types; ints are fine where floats are."""
    if value is None:
        return type(None) in allowed, None
    if isinstance(value, bool):
        return bool in allowed, value
    if isinstance(value, int) and int not in allowed and float in allowed:
        return True, float(value) if abs(value) < 2**1024 else math.inf if value > 0 else -math.inf
    if isinstance(value, str) and float in allowed:
        # YAML 1.1 reads 1e-3 (no dot) as a string; take it as the number it means.
        try:
            return True, float(value)
        except ValueError:
            return False, value
    if str in allowed and isinstance(value, (int, float)):
        return True, str(value)
    return isinstance(value, tuple(t for t in allowed if t is not type(None))), value


# Numbers YAML 1.1 would read in a base no one means: a leading 0 (octal) or colons (base
# 60). fbtrain's loader (load.py) leaves them text; this says why such a text is refused.
_NOT_DECIMAL = re.compile(r"[-+]?(?:0[0-9_]+(?:\.[0-9_]*)?"  # 010, 010.5
                          r"|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)")  # 1:30, 1:30.5


def decimal_hint(value: Any) -> str:
    """For a text an int or float key refused, why it is not a number here ('' if that is
    not the reason): ``'; numbers are read in decimal: YAML 1.1 would read 010 as the
    octal 8; write it without the leading 0'``."""
    if not (isinstance(value, str) and _NOT_DECIMAL.fullmatch(value)):
        return ""
    yaml11 = yaml.load(value, Loader=yaml.SafeLoader)  # what PyYAML's YAML 1.1 makes of it
    if ":" in value:
        return (f"; numbers are read in decimal: YAML 1.1 would read {value} in base 60, as "
                f"{yaml11}; write it as one decimal number")
    octal = (f": YAML 1.1 would read {value} as the octal {yaml11}" if isinstance(yaml11, int)
             else "")
    return f"; numbers are read in decimal{octal}; write it without the leading 0"


def field_problems(section: Any) -> list[tuple[str, Any, str]]:
    """Range/choice checks from field metadata, for values of the right type."""
    out = []
    for f in dataclasses.fields(section):
        value, meta = getattr(section, f.name), f.metadata
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        if "choices" in meta and value not in meta["choices"]:
            close = difflib.get_close_matches(str(value), meta["choices"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.append((f.name, value, f"must be one of {', '.join(meta['choices'])}{hint}"))
        if isinstance(value, str):
            continue
        unfit = unfit_number(value)
        if unfit:
            out.append((f.name, value, unfit))
            continue
        if "min" in meta and value < meta["min"]:
            out.append((f.name, value, f"must be >= {meta['min']}"))
        if "gt" in meta and value <= meta["gt"]:
            out.append((f.name, value, f"must be > {meta['gt']}"))
        if "max" in meta and value > meta["max"]:
            out.append((f.name, value, f"must be <= {meta['max']}"))
    return out


def int_bound(value: Any) -> str:
    """The 64-bit bound an integer ``value`` exceeds ('' when it is within them): what a
    message says, rather than a lower bound the value meets."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value > INT64_MAX:
            return f"at most {INT64_MAX} (2**63 - 1)"
        if value < INT64_MIN:
            return f"at least {INT64_MIN} (-2**63)"
    return ""


def unfit_number(value: int | float) -> str:
    """Why a number cannot be used at all ('' when it can): NaN, infinity, beyond int64."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number (not NaN or infinity)"
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return f"must fit in a 64-bit integer ({INT64_MIN} to {INT64_MAX})"
    return ""
