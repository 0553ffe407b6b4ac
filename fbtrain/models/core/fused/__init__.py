"""The fused core: the feedback sweep as a few Triton kernels per step, for CUDA
(``FBTRAIN_CORE=fused``; off by default). The design and its cost model are in
docs/design.md ("The fused core").

A token-layer is four kernels forward (``attend``, ``out_proj``, ``ff_in``, ``ff_out``)
and four backward (``ffo_back``, ``ffi_back``, ``att_back``, ``q_back``), each a grid of
batch tiles by heads or by column tiles (``forward.py``, ``backward.py``; run or recorded
by ``launch.py``); the memory of a step is made by the next step's first ``attend`` and
its gradient by the next step's last ``q_back``, and the last step's memory is one more
``attend``. The weight gradients are a few batched
matmuls over all steps after the sweep. Dropout masks are drawn before the sweep exactly
as the PyTorch core draws them (``masks.draw_masks``), and the kernels read them.

Interface for tools (kept stable):

- :func:`compile_cases` ``(d_model, n_heads, d_ff, n_layers, batch, window, shared_kv,
  memory_norm, dropout)`` -> ``[(name, fn, signature, constexprs, grid)]``: every distinct
  kernel the core launches at those sizes (a call of ``window`` steps from empty memory,
  forward and backward), with the signature and constants it launches with, ready for
  ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))``
  with the options :func:`launch_options` gives (warps, stages, register ceiling), as the core
  launches them.
- :func:`launch_variants` (the same, plus ``dtype``) -> [:class:`CompileCase`]: the same
  kernels, one per set of 16-byte-aligned pointers as launched (what Triton's launcher
  specialises on), in float32 or float64.
- :func:`kernels_per_step` ``(spec, batch, steps, d_model, d_ff, n0=0)`` -> ``{"forward":
  n, "backward": n}``: the launches one forward (with its tape) and one backward make for
  ``steps`` steps, counted from the launches themselves without a device.

Triton is imported here: import this package only where Triton is installed
(``select.py`` checks first).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fbtrain.models.core.fused.core import FusedCore, core_launches, interpreting
from fbtrain.models.core.fused.launch import _JIT, Launch, launch_options, recording
from fbtrain.models.core.spec import LAYER_PARAMS, CoreInputs, CoreSpec

__all__ = ["CompileCase", "FusedCore", "Launch", "compile_cases", "interpreting",
           "kernels_per_step", "launch_options", "launch_variants", "meta_inputs", "recording"]


def meta_inputs(spec: CoreSpec, batch: int, steps: int, d_model: int, d_ff: int,
                n0: int = 0, dtype: torch.dtype = torch.float32) -> CoreInputs:
    """Core inputs of the right shapes on the meta device (no memory, nothing runs)."""
    D, H, L = d_model, spec.n_heads, spec.n_layers
    n_kv, n_pos = 1 if spec.shared_kv else L, min(n0 + steps, spec.window)

    def t(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta", dtype=dtype)

    shapes = {"ln1_w": (D,), "ln1_b": (D,), "wq": (D, D), "uq": (D,),
              "rt": (H, D // H, n_pos), "c": (H, 1, n_pos), "wo_t": (D, D), "bo": (D,),
              "ln2_w": (D,), "ln2_b": (D,), "w1_t": (D, d_ff), "b1": (d_ff,),
              "w2_t": (d_ff, D), "b2": (D,)}
    layers = [t(*shapes[name]) for _ in range(L) for name in LAYER_PARAMS]
    return CoreInputs(t(batch, steps, D), t(n_kv, batch * H, n0, D // H),
                      t(n_kv, batch * H, n0, D // H), t(L + 1), t(D, 2 * n_kv * D),
                      t(2 * n_kv * D), layers)


def kernels_per_step(spec: CoreSpec, batch: int, steps: int, d_model: int, d_ff: int,
                     n0: int = 0) -> dict[str, int]:
    """Kernel launches of one forward (with its tape) and one backward for ``steps`` steps:
    {"forward": n, "backward": n}, counted by recording the launches (no device needed).
    Per token-layer: divide by ``steps * spec.n_layers``."""
    forward, backward = core_launches(spec, meta_inputs(spec, batch, steps, d_model, d_ff, n0))
    return {"forward": len(forward), "backward": len(backward)}


def _signature(launch: Launch) -> dict[str, str]:
    """Triton's signature for a launch: pointer types from the tensors' dtypes, ``i32`` for
    ints, ``fp32`` for floats, ``constexpr`` for the constants."""
    types = {torch.float32: "*fp32", torch.float64: "*fp64", torch.float16: "*fp16",
             torch.bfloat16: "*bf16"}
    out = {}
    for name, value in launch.args.items():
        if isinstance(value, torch.Tensor):
            out[name] = types[value.dtype]
        elif isinstance(value, (bool, int)):
            out[name] = "i32"
        else:
            out[name] = "fp32"
    out.update({name: "constexpr" for name in launch.constexprs})
    return out


class CompileCase(NamedTuple):
    """One distinct kernel variant the core launches: its name, ``JITFunction``, Triton
    signature, constants, grid, and ``divisible``: the pointer arguments whose address is
    a multiple of 16 bytes as launched (Triton's launcher specialises on exactly that:
    ``tt.divisibility`` 16, which lets the compiler vectorise their loads)."""

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    grid: tuple[int, ...]
    divisible: tuple[str, ...]


# The caching allocator hands CUDA tensors out 512-byte aligned, so a launch argument's
# alignment is its offset in its buffer (meta tensors keep their storage offsets).
_ALLOC_ALIGN = 16


def _divisible(launch: Launch) -> tuple[str, ...]:
    """The pointer arguments of ``launch`` 16-byte aligned as the core launches them."""
    return tuple(name for name, value in launch.args.items()
                 if isinstance(value, torch.Tensor)
                 and value.storage_offset() * value.element_size() % _ALLOC_ALIGN == 0)


def launch_variants(d_model: int, n_heads: int, d_ff: int, n_layers: int, batch: int,
                    window: int, shared_kv: bool, memory_norm: bool, dropout: float,
                    dtype: torch.dtype = torch.float32) -> list[CompileCase]:
    """Every distinct kernel variant the fused core launches for a ``window``-step call
    from empty memory at these sizes in ``dtype``: one per (kernel, signature, constants,
    aligned pointers), as Triton's launcher would compile them."""
    spec = CoreSpec(n_layers=n_layers, n_heads=n_heads, shared_kv=shared_kv, window=window,
                    dropout=dropout, memory_norm=memory_norm)
    forward, backward = core_launches(
        spec, meta_inputs(spec, batch, window, d_model, d_ff, dtype=dtype))
    cases, seen = [], set()
    for launch in (*forward, *backward):
        signature = _signature(launch)
        divisible = _divisible(launch)
        key = (launch.name, tuple(signature.items()), tuple(launch.constexprs.items()),
               divisible)
        if key not in seen:
            seen.add(key)
            cases.append(CompileCase(launch.name, _JIT[launch.name], signature,
                                     dict(launch.constexprs), launch.grid, divisible))
    return cases


def compile_cases(d_model: int, n_heads: int, d_ff: int, n_layers: int, batch: int,
                  window: int, shared_kv: bool, memory_norm: bool, dropout: float
                  ) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[int, ...]]]:
    """Every distinct kernel the fused core launches for a ``window``-step call from empty
    memory at these sizes, float32: (name, JITFunction, signature, constexprs, grid), the
    alignment left out (:func:`launch_variants` has it)."""
    cases, seen = [], set()
    for c in launch_variants(d_model, n_heads, d_ff, n_layers, batch, window, shared_kv,
                             memory_norm, dropout):
        key = (c.name, tuple(c.signature.items()), tuple(c.constexprs.items()))
        if key not in seen:
            seen.add(key)
            cases.append((c.name, c.fn, c.signature, c.constexprs, c.grid))
    return cases
