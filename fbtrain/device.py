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
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    dtype = autocast_dtype(precision, device)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield
