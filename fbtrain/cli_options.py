"""The flags several ``fbtrain`` commands share (their types, choices and help), and the
option callbacks that apply the library's own rules to a flag's value as click parses it:
a bad value is then click's one line, exit 2, naming the flag.

Light on purpose, as cli.py: the rules' modules (which import torch) are imported when a
flag is checked, not when ``fbtrain --help`` runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any

import typer

from fbtrain.config.schema import CONTEXTS, SPLITS  # light: no torch
from fbtrain.errors import ArgumentError

Split = Enum("Split", {name: name for name in SPLITS}, type=str)  # eval's --split
Context = Enum("Context", {name: name for name in CONTEXTS}, type=str)  # eval's --context


class Precision(str, Enum):  # run.precision's choices (config.schema.PRECISIONS)
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


def device_named(value: str | None) -> str | None:
    """--device's callback: an empty value (an unset shell variable) is refused, not taken
    as the default."""
    if value is not None and not value.strip():
        raise typer.BadParameter("empty; give auto, cpu, cuda or cuda:N (or leave --device "
                                 "out)")
    return value


DeviceOption = Annotated[
    str | None,
    typer.Option(
        "--device", metavar="auto|cpu|cuda|cuda:N", callback=device_named,
        help="Where to run: auto (CUDA when available, else CPU), cpu, cuda or cuda:N.",
        show_default=False,
    ),
]
PrecisionOption = Annotated[
    Precision | None,
    typer.Option(
        "--precision", show_default="the run's run.precision",
        help="Autocast to run the model at: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 "
        "or fp16. The default, the run's own, is what its validation was scored at.",
    ),
]
CheckpointOption = Annotated[
    str,
    typer.Option(
        "--checkpoint", "-c", metavar="PATH|RUN_DIR",
        help="A checkpoint file, a run directory (its best.pt, else last.pt), or a folder "
        "written by fbtrain export.",
    ),
]


def library_rule(module: str, checker: str, name: str) -> Callable[[Any], Any]:
    """Option callback applying the library's own rule for argument ``name``
    (``fbtrain.<module>.<checker>(name, value)``, imported on use so ``--help`` stays
    fast): each rule is written once, there. None (a flag not given) passes."""

    def check(value: Any) -> Any:
        if value is not None:
            rule = getattr(importlib.import_module(f"fbtrain.{module}"), checker)
            try:
                rule(name, value)
            except ArgumentError as e:
                raise typer.BadParameter(str(e)) from None
        return value

    return check


def sampling_rule(name: str) -> Callable[[Any], Any]:
    return library_rule("sample", "check_argument", name)


def count_rule(name: str) -> Callable[[Any], Any]:
    return library_rule("evaluate", "check_count", name)
