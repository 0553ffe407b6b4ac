"""Which core runs: ``$FBTRAIN_CORE`` (``auto``, ``native`` or ``python``), and the notice
when ``auto`` falls back to the PyTorch core because the C++ one cannot be built."""

from __future__ import annotations

import functools
import os
import sys

from fbtrain.models.core import native, python
from fbtrain.models.core.spec import Core, CoreError

CORE_ENV = "FBTRAIN_CORE"
CORE_CHOICES = ("auto", "native", "python")
# How much slower a training step is on the PyTorch core than on the C++ one, as the
# fallback notice says it: the rounded range of the measurement in docs/performance.md
# ("Figures the code rests on", with its command), which tests/test_docs.py holds to it.
PYTHON_CORE_SLOWDOWN = "3-5x"


def core_choice() -> str:
    """``$FBTRAIN_CORE``, checked: ``auto`` (the default), ``native`` or ``python``."""
    raw = os.environ.get(CORE_ENV, "")
    choice = raw.strip().lower() or "auto"
    if choice not in CORE_CHOICES:
        raise CoreError(f"{CORE_ENV}={raw!r} is not a core; use one of {', '.join(CORE_CHOICES)}")
    return choice


def core() -> Core:
    """The core to run, as ``$FBTRAIN_CORE`` asks (read on every call, resolved once each).

    ``native``: the C++ core, or CoreBuildError. ``python``: the PyTorch core. ``auto``:
    the C++ core where it builds, else the PyTorch core, after one notice line on stderr
    (once per process) saying why, how much slower it is, and how to get the fast one.
    """
    return _resolve(core_choice())


def core_label(chosen: Core) -> str:
    """The name the start line gives ``chosen``: ``C++ core`` or ``PyTorch core``."""
    return "C++ core" if chosen is native.NativeCore else "PyTorch core"


@functools.cache
def _resolve(choice: str) -> Core:
    """The core ``choice`` (checked) stands for; the C++ core is built here, once."""
    if choice != "python":
        try:
            native.native_ops()
            return native.NativeCore
        except native.CoreBuildError as e:
            if choice == "native":
                raise
            print(f"fbtrain: {e}. Running on the PyTorch core instead, about "
                  f"{PYTHON_CORE_SLOWDOWN} slower to train; {e.remedy} "
                  f"(or set {CORE_ENV}=python to skip this attempt)",
                  file=sys.stderr, flush=True)
    return python
