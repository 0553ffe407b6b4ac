"""The sequential core of the Feedback Transformer, with a hand-written backward pass.

Why hand-written: a feedback model must run one token at a time, so a training step is
``seq_len * n_layers`` tiny steps. Under plain autograd every tiny op also records a graph
node and replays it in the backward, and on a CPU that per-op overhead, not arithmetic, is
the cost. Here the forward runs without autograd, keeping only what the backward needs; the
backward sweeps the steps in reverse computing *activation* gradients only, and every
*weight* gradient is one large matmul over all steps at the end. The step loops themselves
are ATen calls driven from C++ (``csrc/feedback_core.cpp``, built on first use): that takes
the interpreter out of the loop, and on a CPU it splits the batch into one shard per thread,
since a batch row never interacts with another until the weight gradients, and runs
attention over each step's window as one vectorised loop per (row, head). Where the C++
core cannot be built or loaded, the same loops run as PyTorch calls (``python_core.py``,
slower); ``FBTRAIN_CORE`` picks (see :func:`core`). ``tests/reference.py`` checks both
against a slow autograd implementation written straight from the equations.

Shapes: B batch, T steps in this call, D model width, H heads, d_k = D / H, L layers,
F feed-forward width, S = n0 + T memory slots (n0 carried over from an earlier call),
n_kv key/value sets (1 for ``feedback_kv``, L for ``feedback``). Memory keys and values
live in preallocated buffers ``[n_kv, B*H, S, d_k]``; nothing is re-stacked per step.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

CSRC = Path(__file__).parent / "csrc" / "feedback_core.cpp"


CORE_ENV = "FBTRAIN_CORE"
CORE_CHOICES = ("auto", "native", "python")
# How much slower a training step is on the PyTorch core than on the C++ one, for the
# fallback notice: feedback_kv at the benchmark sizes (d_model 128, 4 layers, batch 16) on
# a busy 2-core CPU, two interleaved runs: 2.8x and 3.9x at length 64 (1346 vs 481 ms a
# step in the first), 4.5x and 4.7x at 256 (8562 vs 1889 ms).
PYTHON_CORE_SLOWDOWN = "3-5x"


class CoreError(OSError):
    """The feedback core cannot run as asked (one line; the CLI exits 2)."""


class CoreBuildError(CoreError):
    """The C++ core could not be compiled or loaded here."""


def _put_ninja_on_path() -> None:
    """torch builds extensions with the ``ninja`` it finds on PATH. The one from PyPI (a
    dependency of fbtrain) sits in the environment's scripts folder, which is on PATH only
    while the environment is activated: ``.venv/bin/fbtrain train ...`` must find it too.
    Appended, so it never shadows anything already on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI package: ninja.BIN_DIR holds its binary

        folders = [ninja.BIN_DIR]
    except ImportError:
        folders = []
    folders += [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    for folder in folders:
        if folder and shutil.which("ninja", path=folder):
            os.environ["PATH"] = os.pathsep.join(filter(None, (os.environ.get("PATH"), folder)))
            return


@functools.cache
def native_ops():
    """The ``torch.ops.fbtrain`` namespace, compiling the C++ core on first use.

    Its ops run in inference mode, which skips version-counter and view bookkeeping on
    every small op of the loops (8-10% of a step), so what they return are inference
    tensors: fine to read and decode with, but to reach autograd they must be cloned.

    torch caches the build (in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/
    torch_extensions``) keyed on the source, so later runs load it in well under a second.
    """
    from torch.utils import cpp_extension

    # OpenMP runs the batch shards in parallel (at::parallel_for is header code, serial
    # unless the extension itself is built with it); on Linux the extension then shares
    # torch's own libgomp. Elsewhere the shards run one after another.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    # The attention loops are written for the compiler to vectorise: built for AVX2 where
    # torch itself runs AVX2 kernels (about 20% of a step at length 64), under a name of
    # its own, so a cache shared with an older CPU never loads instructions it lacks.
    capability = torch.backends.cpu.get_cpu_capability()
    avx2 = capability.startswith(("AVX2", "AVX512"))
    name = "fbtrain_core_avx2" if avx2 else "fbtrain_core"
    flags = ["-O3", *openmp, *(["-mavx2", "-mfma"] if avx2 else [])]
    build_dir_of = getattr(cpp_extension, "_get_build_directory", None)  # private: optional
    build_dir = Path(build_dir_of(name, verbose=False)) if build_dir_of else None
    _put_ninja_on_path()

    def failed(cause: str) -> CoreBuildError:
        return CoreBuildError(
            f"could not build fbtrain's C++ core ({CSRC}); it needs a C++ compiler (g++) "
            f"on PATH: {cause.strip()}")

    if build_dir is None or not (build_dir / f"{name}.so").exists():
        compiler = cpp_extension.get_cxx_compiler()  # $CXX, else c++
        if shutil.which(compiler) is None:  # say so, rather than ninja's "c++: not found"
            raise failed(f"{compiler!r} not found (set CXX to name another compiler)")
        if build_dir is not None:
            print(f"fbtrain: compiling the C++ core into {build_dir} (once, about a minute)",
                  file=sys.stderr, flush=True)
    try:
        cpp_extension.load(name=name, sources=[str(CSRC)], extra_cflags=flags,
                           extra_ldflags=openmp, is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        lines = str(e).splitlines() or [repr(e)]
        cause = next((ln for ln in lines if "error:" in ln), lines[0])  # the compiler's
        raise failed(cause) from None
    return torch.ops.fbtrain


@dataclass(frozen=True)
class CoreSpec:
    """Static facts of one core call (hashable, so it can ride through autograd)."""

    n_layers: int
    n_heads: int
    shared_kv: bool
    window: int  # memory slots a step may attend to (mem_len <= max_rel_pos)
    dropout: float  # 0 when not training
    eps: float = 1e-5
    # Keys/values read LayerNorm(m_t) instead of m_t. Only the normalisation happens in the
    # core: the LayerNorm's weight and bias are folded into wkv/bkv by the model.
    memory_norm: bool = False

    def args(self) -> tuple[int, int, bool, int, float, float, bool]:
        return (self.n_layers, self.n_heads, self.shared_kv, self.window, self.dropout,
                self.eps, self.memory_norm)


# Per-layer tensors in the order the core takes them (see FeedbackTransformer.core_params).
LAYER_PARAMS = ("ln1_w", "ln1_b", "wq", "uq", "rt", "c", "wo_t", "bo",
                "ln2_w", "ln2_b", "w1_t", "b1", "w2_t", "b2")


class Core(Protocol):
    """One implementation of the step loops: the C++ ops (:class:`NativeCore`) or the
    ``python_core`` module. Same calls, same results to float64 rounding."""

    def core_forward(self, spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
                     layers: Sequence[Tensor], mix: Tensor, wkv: Tensor, bkv: Tensor | None,
                     keep_tape: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
        """Run T steps (without autograd recording).

        x0: [B, T, D] token embeddings. mem_k, mem_v: [n_kv, B*H, n0, d_k] carried memory.
        layers: L * 14 tensors, as :func:`flatten_layers` (``rt`` [H, d_k, P], ``c``
        [H, 1, P] hold the P = min(S, window) position rows a window can use, largest
        offset first). mix: [L+1] softmax memory weights. wkv: [D, 2*n_kv*D] (all keys,
        then all values); bkv: [2*n_kv*D] or None; the keys/values of step t are
        ``m_t @ wkv + bkv``, or with ``spec.memory_norm`` ``norm(m_t) @ wkv + bkv`` (norm:
        LayerNorm without affine). Returns hidden [T, L+1, B, D] (every layer's output at
        every step), the memory vectors [T, B, D] (before any norm), the key/value buffers
        [n_kv, B*H, S, d_k], and the tape the backward needs (its own kind per core; empty
        unless ``keep_tape``). Dropout masks are drawn from the global generator before the
        sweep, in the same order by both cores. Results are inference tensors: to reach
        autograd they must be cloned.
        """
        ...

    def core_backward(self, spec: CoreSpec, d_top: Tensor, hidden: Tensor, memory: Tensor,
                      keys: Tensor, values: Tensor, n0: int, layers: Sequence[Tensor],
                      mix: Tensor, wkv: Tensor, tape: Any
                      ) -> tuple[Tensor, Sequence[Tensor], Tensor, Tensor, Tensor, Tensor,
                                 Tensor]:
        """Gradients given ``d_top`` [B, T, D], the gradient of the last layer's output, and
        what the same core's :meth:`core_forward` returned.

        Returns d_x0 [B, T, D], the layer gradients (flat, as :func:`flatten_layers`),
        d_mix [L+1], d_wkv [D, 2*n_kv*D], d_bkv [2*n_kv*D], and d_mem_k, d_mem_v
        [n_kv, B*H, n0, d_k] for the carried memory's keys and values.
        """
        ...


class NativeCore:
    """The C++ core's ops (compiled on first use) behind :class:`Core`'s calls."""

    @staticmethod
    def core_forward(spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
                     layers: Sequence[Tensor], mix: Tensor, wkv: Tensor, bkv: Tensor | None,
                     keep_tape: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
        return native_ops().core_forward(x0, mem_k, mem_v, layers, mix, wkv, bkv, *spec.args(),
                                         keep_tape)

    @staticmethod
    def core_backward(spec: CoreSpec, d_top: Tensor, hidden: Tensor, memory: Tensor,
                      keys: Tensor, values: Tensor, n0: int, layers: Sequence[Tensor],
                      mix: Tensor, wkv: Tensor, tape: Any
                      ) -> tuple[Tensor, Sequence[Tensor], Tensor, Tensor, Tensor, Tensor,
                                 Tensor]:
        return native_ops().core_backward(d_top, hidden, memory, keys, values, tape, layers,
                                          mix, wkv, n0, *spec.args())


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


@functools.cache
def _resolve(choice: str) -> Core:
    if choice != "python":
        try:
            native_ops()
            return NativeCore
        except CoreBuildError as e:
            if choice == "native":
                raise
            print(f"fbtrain: {e}. Running on the PyTorch core instead, about "
                  f"{PYTHON_CORE_SLOWDOWN} slower to train; install g++ for the fast core "
                  f"(or set {CORE_ENV}=python to skip this attempt)",
                  file=sys.stderr, flush=True)
    from fbtrain.models import python_core

    return python_core


def core_forward(
    spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor, layers: Sequence[Tensor],
    mix: Tensor, wkv: Tensor, bkv: Tensor | None, keep_tape: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
    """:meth:`Core.core_forward` of the :func:`core` in use."""
    return core().core_forward(spec, x0, mem_k, mem_v, layers, mix, wkv, bkv, keep_tape)


class FeedbackCoreFunction(torch.autograd.Function):
    """Autograd wrapper: inputs (spec, x0, mem_k, mem_v, mix, wkv, bkv, *layer tensors).

    Outputs the last layer's hidden states [B, T, D], the new memory keys/values (the last
    ``window`` slots) and the memory vectors [B, T, D] of this call. The latter three are
    non-differentiable: memory is carried on detached, as in truncated BPTT. The carried
    keys/values ``mem_k``, ``mem_v`` do get gradients, so a caller may project them from
    carried memory vectors with the current weights. The backward runs on the core the
    forward ran on.
    """

    @staticmethod
    def forward(ctx, spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor, mix: Tensor,
                wkv: Tensor, bkv: Tensor | None, *flat: Tensor):
        ctx.core = core()
        hidden, memory, keys, values, tape = ctx.core.core_forward(
            spec, x0, mem_k, mem_v, flat, mix, wkv, bkv, keep_tape=True)
        # Outputs are fresh tensors, never views of saved buffers (that would make a cycle)
        # nor inference tensors (the cores run in inference mode; see Core.core_forward).
        top = hidden[:, -1].transpose(0, 1).clone(memory_format=torch.contiguous_format)
        new_k = keys[:, :, -spec.window:].clone()
        new_v = values[:, :, -spec.window:].clone()
        new_memory = memory.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        ctx.mark_non_differentiable(new_k, new_v, new_memory)
        ctx.spec, ctx.n0, ctx.tape, ctx.has_bkv = spec, mem_k.shape[2], tape, bkv is not None
        ctx.buffers = (hidden, memory, keys, values)
        ctx.save_for_backward(mix, wkv, *flat)
        return top, new_k, new_v, new_memory

    @staticmethod
    def backward(ctx, d_top: Tensor, _dk: Tensor, _dv: Tensor, _dm: Tensor):
        mix, wkv, *flat = ctx.saved_tensors
        d_x0, flat_grads, d_mix, d_wkv, d_bkv, d_mem_k, d_mem_v = ctx.core.core_backward(
            ctx.spec, d_top.contiguous(), *ctx.buffers, ctx.n0, flat, mix, wkv, ctx.tape)
        ctx.buffers = ctx.tape = None
        d_x0, d_mem_k, d_mem_v, d_mix, d_wkv, d_bkv, *flat_grads = (  # out of inference mode
            g.clone() for g in (d_x0, d_mem_k, d_mem_v, d_mix, d_wkv, d_bkv, *flat_grads))
        return (None, d_x0, d_mem_k, d_mem_v, d_mix, d_wkv, d_bkv if ctx.has_bkv else None,
                *flat_grads)


def flatten_layers(layers: list[dict[str, Tensor]]) -> list[Tensor]:
    """Per-layer tensors as one flat list, layer by layer in LAYER_PARAMS order."""
    return [p[name] for p in layers for name in LAYER_PARAMS]
