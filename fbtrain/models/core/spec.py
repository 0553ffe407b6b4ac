"""The feedback core's contract: its static facts (:class:`CoreSpec`), the order of its
per-layer tensors (:data:`LAYER_PARAMS`) and the calls both cores answer (:class:`Core`).

Why a core with a hand-written backward: a feedback model must run one token at a time, so
a training step is ``seq_len * n_layers`` tiny steps. Under plain autograd every tiny op
also records a graph node and replays it in the backward, and on a CPU that per-op
overhead, not arithmetic, is the cost. Here the forward runs without autograd, keeping only
what the backward needs; the backward sweeps the steps in reverse computing *activation*
gradients only, and every *weight* gradient is one large matmul over all steps at the end.
The step loops themselves are ATen calls driven from C++ (``csrc/feedback_core.cpp``, built
on first use by ``native``): that takes the interpreter out of the loop, and on a CPU it
splits the batch into one shard per thread, since a batch row never interacts with another
until the weight gradients, and runs attention over each step's window as one vectorised
loop per (row, head). Where the C++ core cannot be built or loaded, the same loops run as
PyTorch calls (``python``, slower); ``FBTRAIN_CORE`` picks (``select``).
``tests/reference.py`` checks both against a slow autograd implementation written straight
from the equations.

Shapes: B batch, T steps in this call, D model width, H heads, d_k = D / H, L layers,
F feed-forward width, S = n0 + T memory slots (n0 carried over from an earlier call),
n_kv key/value sets (1 for ``feedback_kv``, L for ``feedback``). Memory keys and values
live in preallocated buffers ``[n_kv, B*H, S, d_k]``; nothing is re-stacked per step.

This module imports nothing from fbtrain: every other part of the core builds on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor


class CoreError(OSError):
    """The feedback core cannot run as asked (one line; the CLI exits 2)."""


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
    """One implementation of the step loops: the C++ ops (``native.NativeCore``) or the
    ``python`` module. Same calls, same results to float64 rounding."""

    def core_forward(self, spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
                     layers: Sequence[Tensor], mix: Tensor, wkv: Tensor, bkv: Tensor | None,
                     keep_tape: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
        """Run T steps (without autograd recording).

        x0: [B, T, D] token embeddings. mem_k, mem_v: [n_kv, B*H, n0, d_k] carried memory.
        layers: L * 14 tensors, as ``autograd.flatten_layers`` (``rt`` [H, d_k, P], ``c``
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

        Returns d_x0 [B, T, D], the layer gradients (flat, as ``autograd.flatten_layers``),
        d_mix [L+1], d_wkv [D, 2*n_kv*D], d_bkv [2*n_kv*D], and d_mem_k, d_mem_v
        [n_kv, B*H, n0, d_k] for the carried memory's keys and values.
        """
        ...
