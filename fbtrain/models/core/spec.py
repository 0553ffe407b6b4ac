"""The feedback core's contract: its static facts (:class:`CoreSpec`), its tensors in the one
order every part of the core uses (:class:`CoreInputs`, :class:`CoreOutputs`,
:class:`LayerTensors`) and the calls both cores answer (:class:`Core`).

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
from typing import Any, NamedTuple, Protocol

from torch import Tensor

from fbtrain.errors import UserError


class CoreError(UserError):
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
        """The fields in order, as the C++ ops take them after the tensors."""
        return (self.n_layers, self.n_heads, self.shared_kv, self.window, self.dropout,
                self.eps, self.memory_norm)


class LayerTensors(NamedTuple):
    """One layer's tensors as the core takes them; the field order is the core's (the C++
    ``enum Param`` follows it, and a test holds the two together). Built from the model's
    parameters with constants folded in (``FeedbackTransformer.core_params``)."""

    ln1_w: Tensor  # [D] pre-attention LayerNorm
    ln1_b: Tensor  # [D]
    wq: Tensor  # [D, D] query projection, 1/sqrt(d_k) folded in
    uq: Tensor  # [D] query bias u, scaled alike
    rt: Tensor  # [H, d_k, P] position offsets r, largest offset first
    c: Tensor  # [H, 1, P] position biases (b - u.r) / sqrt(d_k), ordered alike
    wo_t: Tensor  # [D, D] attention output projection (transposed)
    bo: Tensor  # [D]
    ln2_w: Tensor  # [D] pre-feed-forward LayerNorm
    ln2_b: Tensor  # [D]
    w1_t: Tensor  # [D, F]
    b1: Tensor  # [F]
    w2_t: Tensor  # [F, D]
    b2: Tensor  # [D]


LAYER_PARAMS: tuple[str, ...] = LayerTensors._fields  # the names, in the core's order


class CoreInputs(NamedTuple):
    """The tensors of one core call, in the one order all of the core uses: the
    :class:`Core` calls, the C++ ops' schema, the autograd Function's arguments, and the
    gradients :meth:`Core.core_backward` returns (each input's gradient in its own field).
    A test holds the C++ schema to these fields."""

    x0: Tensor  # [B, T, D] token embeddings
    mem_k: Tensor  # [n_kv, B*H, n0, d_k] keys of the carried memory
    mem_v: Tensor  # [n_kv, B*H, n0, d_k] its values
    mix: Tensor  # [L+1] softmax memory weights
    wkv: Tensor  # [D, 2*n_kv*D] memory key/value projection: all keys, then all values
    bkv: Tensor | None  # [2*n_kv*D] its bias, or None
    layers: Sequence[Tensor]  # L * len(LAYER_PARAMS), layer by layer as LayerTensors

    def flat(self) -> tuple[Tensor | None, ...]:
        """The fields with ``layers`` spread out, last: the autograd Function's arguments."""
        return (*self[:-1], *self.layers)

    @classmethod
    def from_flat(cls, flat: Sequence[Tensor | None]) -> CoreInputs:
        """The inverse of :meth:`flat`."""
        n = len(cls._fields) - 1
        return cls(*flat[:n], tuple(flat[n:]))


class CoreOutputs(NamedTuple):
    """What :meth:`Core.core_forward` returns, in the C++ op's order; the backward takes it
    back whole. All are inference tensors: to reach autograd they must be cloned."""

    hidden: Tensor  # [T, L+1, B, D] every layer's output (and the embedding) at every step
    memory: Tensor  # [T, B, D] the memory vectors m_t (before any norm)
    keys: Tensor  # [n_kv, B*H, S, d_k] the key buffers, carried slots first
    values: Tensor  # [n_kv, B*H, S, d_k] the value buffers
    tape: Any  # what the backward needs, its own kind per core (empty unless keep_tape)


class Core(Protocol):
    """One implementation of the step loops: the C++ ops (``native.NativeCore``) or the
    ``python`` module. Same calls, same results to float64 rounding."""

    def core_forward(self, spec: CoreSpec, inputs: CoreInputs,
                     keep_tape: bool = False) -> CoreOutputs:
        """Run T steps (without autograd recording).

        ``layers`` hold P = min(S, window) position rows in ``rt`` and ``c``: those a window
        can use. The keys/values of step t are ``m_t @ wkv + bkv``, or with
        ``spec.memory_norm`` ``norm(m_t) @ wkv + bkv`` (norm: LayerNorm without affine).
        Dropout masks are drawn from the global generator before the sweep, in the same
        order by both cores.
        """
        ...

    def core_backward(self, spec: CoreSpec, d_top: Tensor, outputs: CoreOutputs,
                      mix: Tensor, wkv: Tensor, layers: Sequence[Tensor]) -> CoreInputs:
        """Gradients given ``d_top`` [B, T, D], the gradient of the last layer's output,
        what the same core's :meth:`core_forward` returned (with its tape), and the inputs
        the backward reads (in :class:`CoreInputs` order). The carried slot count n0 is
        ``S - T``.

        Returns every input's gradient in its field of a :class:`CoreInputs`: d_mem_k and
        d_mem_v are the carried keys' and values' (for callers that projected them
        differentiably), ``bkv``'s is a tensor even where there was no bias.
        """
        ...
