"""The config reference: every key with its default and help text, from the fields."""

from __future__ import annotations

import dataclasses

from fbtrain.config.tree import SECTIONS


def describe_fields() -> str:
    """Markdown reference of every config key (used to keep the README honest)."""
    lines = []
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{name}.{f.name}` | `{default!r}` | {f.metadata.get('help', '')} |")
    return "\n".join(lines)
