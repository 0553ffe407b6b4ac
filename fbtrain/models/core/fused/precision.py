"""IEEE float32 for the fused core's own torch matmuls, whatever the user's script chose.

The kernels' ``tl.dot`` is IEEE float32 (``input_precision="ieee"``), but the weight
gradients after the sweep are torch matmuls (``grads.py``), which follow the process-wide
``torch.set_float32_matmul_precision``: at "high" or "medium" cuBLAS may use TF32 (10-bit
mantissas), past the fused core's stated 1e-4 agreement with the other cores. So those
matmuls run inside :func:`ieee_float32`, which sets "highest" and puts back exactly what
was there (the legacy setting and torch's per-backend ``fp32_precision`` flags; torch
refuses a matmul when the two disagree, so both are restored together).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# torch's per-backend flags (torch 2.9 and on), from the outermost: restored in this order.
_FLAGS = (("backends",), ("backends", "cuda", "matmul"), ("backends", "mkldnn", "matmul"))


def _flag_owner(path: tuple[str, ...]) -> Any | None:
    obj: Any = torch
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj if hasattr(obj, "fp32_precision") else None


def _state() -> tuple[str | None, list[tuple[Any, str]]]:
    """The legacy precision (None where torch refuses to read it: the new flags were set
    apart from it) and each per-backend flag's value."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    flags = [(owner, owner.fp32_precision) for path in _FLAGS
             if (owner := _flag_owner(path)) is not None]
    return legacy, flags


@contextmanager
def ieee_float32() -> Iterator[None]:
    """Within: float32 matmuls in IEEE float32 (no TF32, no bf16 passes); after: the
    caller's settings, as they were."""
    legacy, flags = _state()
    if legacy == "highest" and all(v in ("ieee", "none") for _, v in flags):
        yield  # already IEEE: nothing to set or restore
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for owner, value in flags:
            if owner.fp32_precision != value:
                owner.fp32_precision = value
