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
# chunks spilled registers. The attention kernels' window tiles want 8 warps' registers.
NUM_STAGES = 1
WARPS = {"attend": 8, "att_back": 8}  # else 4
# The register ceiling ptxas is given (.maxnreg): the hardware's 255 less a margin, so a
# kernel that comes to need more after a change or a Triton release spills, which the
# compile check catches, while the hardware still has room. Without a ceiling ptxas aims
# kernels at 64 or 128 registers a thread (more blocks a multiprocessor) and spills a few
# bytes to get there, differently under each Triton version: out_proj on sm_80 under
# Triton 3.7 at 64 registers and 16 bytes of stack, attend on sm_90 under 3.9 at 128 and
# 16 (scripts/fused_compile.py; docs/performance.md has the table).
MAX_REGISTERS = 232


def launch_options(name: str) -> dict[str, int]:
    """The Triton launch options kernel ``name`` runs with (``num_warps``, ``num_stages``,
    ``maxnreg``), in float32 and float64 alike."""
    return {"num_warps": WARPS.get(name, 4), "num_stages": NUM_STAGES,
            "maxnreg": MAX_REGISTERS}


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
        _JIT[name][grid](**args, **constexprs, **launch_options(name))
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
