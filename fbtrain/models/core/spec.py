"""The feedback core's contract: its static facts (:class:`CoreSpec`), its tensors in the one
order every part of the core uses (:class:`CoreInputs`, :class:`CoreOutputs`,
:class:`BackwardInputs`, :class:`LayerTensors`), their one flat form (:func:`flatten`,
:func:`unflatten`) and the calls every core answers (:class:`Core`).

Adding a core input: a field of :class:`CoreInputs` (or :class:`LayerTensors`), the C++
ops' schema and loops, the PyTorch core's sweeps, and the model that builds the inputs
(``FeedbackTransformer.core_params``); everything that only moves the tensors around
(autograd, the gradients' order) follows from the fields here.

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

This module imports nothing from fbtrain but its error base: every other part of the core
builds on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

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
# The attention block's parameters: they get a zero gradient when no step of a call attends
# (one step from empty memory). The C++ core's zero list is held to this one by a test.
ATT_PARAMS: tuple[str, ...] = ("ln1_w", "ln1_b", "wq", "uq", "wo_t", "bo")

# Fields that hold a list of tensors; spread out in place in the flat form.
LIST_FIELDS = frozenset({"layers", "tape"})
_Record = TypeVar("_Record", bound=tuple)


def flatten(record: tuple) -> list[Any]:
    """A NamedTuple of the contract as one flat list: its :data:`LIST_FIELDS` spread out in
    place, nested contract records (``BackwardInputs.outputs``) flattened alike. The order
    the C++ ops' schemas and the autograd Function's arguments use."""
    flat: list[Any] = []
    for name, value in zip(record._fields, record, strict=True):
        if name in LIST_FIELDS:
            flat.extend(value)
        elif name in _NESTED:
            flat.extend(flatten(value))
        else:
            flat.append(value)
    return flat


def unflatten(cls: type[_Record], flat: Sequence[Any], lengths: Sequence[int] = ()
              ) -> _Record:
    """The inverse of :func:`flatten` for ``cls``: ``lengths`` gives the length of each list
    field but the last, in field order (the last takes what is left)."""
    leaves = _leaf_fields(cls)
    n_lists = sum(name in LIST_FIELDS for name in leaves)
    assert len(lengths) == n_lists - 1, f"{cls.__name__} needs {n_lists - 1} list lengths"
    sizes = [*lengths, len(flat) - (len(leaves) - n_lists) - sum(lengths)]
    assert min(sizes) >= 0, f"{len(flat)} tensors are too few for {cls.__name__}"
    items = iter(flat)

    def build(kind: type) -> tuple:
        values = []
        for name in kind._fields:
            nested = _NESTED.get(name)
            if nested is not None:
                values.append(build(nested))
            elif name in LIST_FIELDS:
                values.append(tuple(next(items) for _ in range(sizes.pop(0))))
            else:
                values.append(next(items))
        return kind(*values)

    return build(cls)


def _leaf_fields(kind: type) -> list[str]:
    """The fields of ``kind`` in flat order, nested records spread (their fields in place)."""
    out = []
    for name in kind._fields:
        nested = _NESTED.get(name)
        out += _leaf_fields(nested) if nested is not None else [name]
    return out


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
        return tuple(flatten(self))

    @classmethod
    def from_flat(cls, flat: Sequence[Tensor | None]) -> CoreInputs:
        """The inverse of :meth:`flat`."""
        return unflatten(cls, flat)


class CoreOutputs(NamedTuple):
    """What :meth:`Core.core_forward` returns, in the C++ op's order; the backward takes it
    back whole. All are inference tensors: to reach autograd they must be cloned."""

    hidden: Tensor  # [T, L+1, B, D] every layer's output (and the embedding) at every step
    memory: Tensor  # [T, B, D] the memory vectors m_t (before any norm)
    keys: Tensor  # [n_kv, B*H, S, d_k] the key buffers, carried slots first
    values: Tensor  # [n_kv, B*H, S, d_k] the value buffers
    tape: Any  # what the backward needs, its own kind per core (empty unless keep_tape)


class BackwardInputs(NamedTuple):
    """The arguments of :meth:`Core.core_backward` after the spec, in its order (so
    ``core.core_backward(spec, *inputs)``); flat (:meth:`flat`), the C++ backward op's
    schema, which a test holds to these fields. The forward must have kept its tape."""

    d_top: Tensor  # [B, T, D] gradient of the last layer's output
    outputs: CoreOutputs  # what the same core's core_forward returned
    mix: Tensor  # [L+1] the inputs the backward reads, as in CoreInputs
    wkv: Tensor  # [D, 2*n_kv*D]
    layers: Sequence[Tensor]  # L * len(LAYER_PARAMS)

    def flat(self) -> tuple[Any, ...]:
        """Every tensor, ``outputs`` and its tape spread out in place, ``layers`` last."""
        return tuple(flatten(self))


# Contract records nested in others, by field name.
_NESTED: dict[str, type] = {"outputs": CoreOutputs}


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
        """Gradients given the :class:`BackwardInputs` (``d_top`` [B, T, D], the gradient
        of the last layer's output, what the same core's :meth:`core_forward` returned with
        its tape, and the inputs the backward reads). The carried slot count n0 is
        ``S - T``. First-order only: the result is not differentiable again (the autograd
        Function is ``once_differentiable``; a double backward raises).

        Returns every input's gradient in its field of a :class:`CoreInputs`: d_mem_k and
        d_mem_v are the carried keys' and values' (for callers that projected them
        differentiably), ``bkv``'s is a tensor even where there was no bias.
        """
        ...
