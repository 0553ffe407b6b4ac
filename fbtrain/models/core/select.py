"""Which core runs: ``$FBTRAIN_CORE`` (``auto``, ``native``, ``python`` or ``fused``), and
the notice when ``auto`` falls back to the PyTorch core because the C++ one cannot be built,
or when ``fused`` cannot run here (no Triton, or no CUDA device and no ``TRITON_INTERPRET``).

``fused`` (off by default, until a GPU has measured it) is the Triton core for CUDA
(``fused/``); under ``TRITON_INTERPRET=1`` it runs its kernels on CPU tensors, slowly, so
it can be checked against the reference anywhere."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from fbtrain.models.core import native, python
from fbtrain.models.core.spec import Core, CoreError, interpreting

CORE_ENV = "FBTRAIN_CORE"
CORE_CHOICES = ("auto", "native", "python", "fused")
# How much slower a training step is on the PyTorch core than on the C++ one, as the
# fallback notice says it: the rounded range of the measurement in docs/performance.md
# ("Figures the code rests on", with its command), which tests/test_docs.py holds to it.
PYTHON_CORE_SLOWDOWN = "3-5x"


def core_choice() -> str:
    """``$FBTRAIN_CORE``, checked: ``auto`` (the default), ``native``, ``python`` or
    ``fused``."""
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
    ``fused``: the Triton core where it can run (:func:`fused_unavailable`), else what
    ``auto`` gives, after one notice line saying why.
    """
    return _resolve(core_choice())


def core_label(chosen: Core) -> str:
    """The name the start line gives ``chosen``: ``C++ core``, ``PyTorch core``, ``fused
    core (Triton interpreter)`` (its kernels on the CPU, slowly) or ``fused core (Triton)``."""
    if chosen is native.NativeCore:
        return "C++ core"
    if chosen is python:
        return "PyTorch core"
    return f"fused core (Triton{' interpreter' if interpreting() else ''})"


def fused_unavailable() -> str | None:
    """Why the fused core cannot run in this process, or None: it needs Triton, and a CUDA
    device or Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton; Linux x86_64)"
    if not (torch.cuda.is_available() or interpreting()):
        return "there is no CUDA device (TRITON_INTERPRET=1 runs its kernels on the CPU, slowly)"
    return None


@functools.cache
def _resolve(choice: str) -> Core:
    """The core ``choice`` (checked) stands for; the C++ core is built here, once."""
    if choice == "fused":
        fallback = _resolve("auto")
        why = fused_unavailable()
        if why is None:
            from fbtrain.models.core.fused import FusedCore  # imports Triton: only here

            return FusedCore(fallback)
        print(f"fbtrain: {CORE_ENV}=fused, but {why}; running on the "
              f"{'C++' if fallback is native.NativeCore else 'PyTorch'} core instead",
              file=sys.stderr, flush=True)
        return fallback
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
