"""Device and precision choice, shared by train, sample and eval."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fbtrain.errors import UserError


class DeviceError(UserError):
    """A device the user asked for does not exist here (one line; the CLI exits 2)."""


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cpu``, ``cuda``, ``cuda:N`` as asked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r}: must be auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r}: CUDA is not available on this machine; "
                              "use --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {name!r}: only {torch.cuda.device_count()} CUDA "
                              "device(s) here")
    elif device.type != "cpu":
        raise DeviceError(f"device {name!r}: must be auto, cpu, cuda or cuda:N")
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device``, or None for plain fp32.

    ``auto`` means bf16 on CUDA (when that GPU has bf16 arithmetic: torch emulates it on
    older ones, slower than fp32) and fp32 on the CPU, where autocast's casts cost more
    than they save at these sizes.
    """
    if precision == "fp32":
        return None
    if precision == "auto":
        if device.type == "cuda":
            with torch.cuda.device(device):  # the check reads the current device
                if torch.cuda.is_bf16_supported(including_emulation=False):
                    return torch.bfloat16
        return None
    return torch.bfloat16 if precision == "bf16" else torch.float16


@contextlib.contextmanager
def matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    """Within: CUDA's float32 matmuls at ``precision``; after: the setting as it was.

    Everything but ``fp32`` lets cuBLAS use TF32 tensor cores for float32 matmuls (inputs
    rounded to a 10-bit mantissa, products accumulated in float32; what nanoGPT and
    torchtitan enable): the feedback core keeps float32 tensors even under autocast (its
    hand-written backward and the memory it accumulates want one precision), and without
    TF32 a Hopper GPU runs its matmuls on the non-tensor-core path. ``fp32`` is IEEE
    float32. A CPU's matmuls are left as they are (the CUDA flag does not reach them).
    """
    if device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    value = "ieee" if precision == "fp32" else "tf32"
    if hasattr(flags, "fp32_precision"):  # torch 2.9 and on
        before, flags.fp32_precision = flags.fp32_precision, value
    else:
        before, flags.allow_tf32 = flags.allow_tf32, value == "tf32"
    try:
        yield
    finally:
        if hasattr(flags, "fp32_precision"):
            flags.fp32_precision = before
        else:
            flags.allow_tf32 = before


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    dtype = autocast_dtype(precision, device)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield
