"""The autograd Function around the core (:class:`FeedbackCoreFunction`) and the flat
per-layer tensor list it takes (:func:`flatten_layers`)."""

from __future__ import annotations

import torch
from torch import Tensor

from fbtrain.models.core.select import core
from fbtrain.models.core.spec import LAYER_PARAMS, CoreSpec


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
