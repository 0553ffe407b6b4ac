"""How the fused core's kernels are launched: each kernel wrapped once for the compiler
(``_JIT``, CUDA tensors) and once for Triton's interpreter (``_INTERPRETED``, CPU tensors
under ``TRITON_INTERPRET=1``), the options they run with, and :func:`recording`, which
collects the launches instead of running them (tools count and compile them from it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from fbtrain.models.core.fused import backward, forward

# Launch options, as compiled for the resource check (scripts/fused_compile.py). No
# software pipelining: the inner loops are a few chunks long, and its staged copies of the
# chunks spilled registers. The attention kernels' window tiles want 8 warps' registers;
# q_back at 4 warps kept a 24-byte stack frame on sm_90 at D 128 (80 registers: not
# pressure; at 8 it has none).
NUM_STAGES = 1
WARPS = {"attend": 8, "att_back": 8, "q_back": 8}  # else 4
# In float64 (the exact checks gpu_check runs on the device) ff_in and ffi_back at 4 warps
# kept an 8-16 byte stack frame on sm_90 (Triton 3.6, at 64-80 registers: not pressure);
# at 8 they keep none (scripts/fused_compile.py, its fp64 variant).
WARPS_FP64 = {"ff_in": 8, "ffi_back": 8}


def launch_options(name: str, dtype: Any = None) -> dict[str, int]:
    """The Triton launch options kernel ``name`` runs with (``num_warps``, ``num_stages``)
    on tensors of ``dtype`` (a torch dtype; None: float32)."""
    warps = WARPS.get(name, 4)
    if dtype is not None and str(dtype) == "torch.float64":
        warps = WARPS_FP64.get(name, warps)
    return {"num_warps": warps, "num_stages": NUM_STAGES}


FORWARD_KERNELS = ("attend", "out_proj", "ff_in", "ff_out")
BACKWARD_KERNELS = ("ffo_back", "ffi_back", "att_back", "q_back")
KERNELS = {**{name: getattr(forward, name) for name in FORWARD_KERNELS},
           **{name: getattr(backward, name) for name in BACKWARD_KERNELS}}


def _runtime_ints(fn: Any) -> list[str]:
    """The kernel's integer arguments that change from launch to launch (not the pointers,
    not the constants): Triton would otherwise compile a variant for each value that is 1 or
    a multiple of 16, so new compiles would come at random steps (and inside a capture)."""
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    ints = {"B", "S", "lo", "ell", "n_split", "n_pos", "slot", "mem", "has_ln", "mix_at",
            "src_stride"}
    return [n for n in names if n in ints]


_JIT = {name: JITFunction(fn, do_not_specialize=_runtime_ints(fn))
        for name, fn in KERNELS.items()}
_INTERPRETED = {name: InterpretedFunction(fn) for name, fn in KERNELS.items()}


class Launch(NamedTuple):
    """One kernel launch as the core makes it: which kernel, its grid, its arguments (in
    the kernel's order, tensors for pointers) and its compile-time constants."""

    name: str
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]


# Where launches go: None runs them; a list collects them instead (compile_cases, counting).
_recording: list[Launch] | None = None


def launch(name: str, grid: tuple[int, ...], args: dict[str, Any],
            constexprs: dict[str, Any]) -> None:
    """Run kernel ``name`` (compiled on CUDA tensors, interpreted on CPU ones under
    ``TRITON_INTERPRET``), or record it while :func:`recording`."""
    if _recording is not None:
        _recording.append(Launch(name, grid, args, constexprs))
        return
    first = next(iter(args.values()))
    if first.is_cuda:
        _JIT[name][grid](**args, **constexprs, **launch_options(name, first.dtype))
    else:
        _INTERPRETED[name][grid](**args, **constexprs)


class recording:
    """Context manager: launches are collected (``with recording() as launches:``), not
    run; with meta tensors the whole host side runs without a device."""

    def __enter__(self) -> list[Launch]:
        global _recording
        self._outer, _recording = _recording, []
        return _recording

    def __exit__(self, *exc: object) -> None:
        global _recording
        _recording = self._outer
