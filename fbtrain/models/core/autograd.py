"""The autograd Function around the core (:class:`FeedbackCoreFunction`) and the flat
per-layer tensor list the core takes (:func:`flatten_layers`)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fbtrain.models.core.select import core
from fbtrain.models.core.spec import (
    LAYER_PARAMS,
    BackwardInputs,
    CoreInputs,
    CoreOutputs,
    CoreSpec,
)


class FeedbackCoreFunction(torch.autograd.Function):
    """Autograd wrapper: inputs ``(spec, *CoreInputs.flat())``.

    Outputs the last layer's hidden states [B, T, D], the new memory keys/values (the last
    ``window`` slots) and the memory vectors [B, T, D] of this call. The latter three are
    non-differentiable: memory is carried on detached, as in truncated BPTT. The carried
    keys/values ``mem_k``, ``mem_v`` do get gradients, so a caller may project them from
    carried memory vectors with the current weights. The backward runs on the core the
    forward ran on.

    No double backward: the cores' backward sweeps are hand-written and run without
    autograd, so their gradients are not differentiable again (``once_differentiable``:
    ``create_graph=True`` through the core, then a second backward, raises).
    """

    @staticmethod
    def forward(ctx, spec: CoreSpec, *flat: Tensor | None):
        """Run the core with a tape; keep what the backward needs on ``ctx``."""
        inputs = CoreInputs.from_flat(flat)
        ctx.core = core()
        hidden, memory, keys, values, tape = ctx.core.core_forward(spec, inputs, keep_tape=True)
        # Outputs are fresh tensors, never views of saved buffers (that would make a cycle)
        # nor inference tensors (the cores run in inference mode; see CoreOutputs).
        top = hidden[:, -1].transpose(0, 1).clone(memory_format=torch.contiguous_format)
        new_k = keys[:, :, -spec.window:].clone()
        new_v = values[:, :, -spec.window:].clone()
        new_memory = memory.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        ctx.mark_non_differentiable(new_k, new_v, new_memory)
        ctx.spec, ctx.tape, ctx.has_bkv = spec, tape, inputs.bkv is not None
        ctx.buffers = (hidden, memory, keys, values)  # tests/test_config.py reads these two
        ctx.save_for_backward(inputs.mix, inputs.wkv, *inputs.layers)
        return top, new_k, new_v, new_memory

    @staticmethod
    @once_differentiable
    def backward(ctx, d_top: Tensor, _dk: Tensor, _dv: Tensor, _dm: Tensor):
        """Every input's gradient, in the order the inputs came (None for spec, and for bkv
        where there was none)."""
        mix, wkv, *layers = ctx.saved_tensors
        outputs = CoreOutputs(*ctx.buffers, ctx.tape)
        ctx.buffers = ctx.tape = None
        inputs = BackwardInputs(d_top.contiguous(), outputs, mix, wkv, layers)
        del outputs
        grads = ctx.core.core_backward(ctx.spec, *inputs)
        del inputs
        grads = CoreInputs.from_flat([g.clone() for g in grads.flat()])  # out of inference mode
        if not ctx.has_bkv:
            grads = grads._replace(bkv=None)
        return (None, *grads.flat())


def flatten_layers(layers: list[dict[str, Tensor]]) -> list[Tensor]:
    """Per-layer tensors as one flat list (``CoreInputs.layers``), layer by layer in
    LAYER_PARAMS order."""
    return [p[name] for p in layers for name in LAYER_PARAMS]
