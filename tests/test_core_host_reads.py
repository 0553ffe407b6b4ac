"""The ATen path (the C++ core's calls on any device but the CPU's loops) reads no tensor on
the host: on a GPU every such read would be a sync inside the sweeps."""

from __future__ import annotations

import pytest
import torch

from fbtrain.config import ModelConfig
from fbtrain.models import build_model
from fbtrain.models.core.autograd import flatten_layers
from fbtrain.models.core.native import NativeCore
from fbtrain.models.core.spec import CoreInputs, CoreSpec

TINY = dict(d_model=8, n_heads=2, d_ff=16, n_layers=1, max_rel_pos=16)


@pytest.mark.parametrize("kind", ["feedback_kv", "feedback"])
def test_aten_path_reads_no_tensor_on_the_host(kind):
    """The whole core (forward with dropout, backward) runs on the meta device, where any
    read of a tensor's values on the host (``.item()``, ``.cpu()``, ``data_ptr`` loops)
    fails: on a GPU each would be a sync."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind=kind, dropout=0.1, memory_norm="layernorm",
                                    **{**TINY, "n_layers": 2}), 11)
    B, T = 2, 3
    layers, wkv, bkv = model.core_params(T)
    n_kv = 1 if kind == "feedback_kv" else 2
    H, dk = TINY["n_heads"], TINY["d_model"] // TINY["n_heads"]

    def meta(t):
        return None if t is None else t.detach().to("meta")

    inputs = CoreInputs(torch.empty(B, T, 8, device="meta"),
                        torch.empty(n_kv, B * H, 0, dk, device="meta"),
                        torch.empty(n_kv, B * H, 0, dk, device="meta"),
                        meta(model.memory_weights()), meta(wkv), meta(bkv),
                        [meta(t) for t in flatten_layers(layers)])
    spec = CoreSpec(n_layers=2, n_heads=H, shared_kv=kind == "feedback_kv", window=16,
                    dropout=0.1, memory_norm=True)
    outputs = NativeCore.core_forward(spec, inputs, keep_tape=True)
    grads = NativeCore.core_backward(spec, torch.empty(B, T, 8, device="meta"), outputs,
                                     inputs.mix, inputs.wkv, inputs.layers)
    assert grads.x0.shape == (B, T, 8) and grads.x0.is_meta
    assert [g.shape for g in grads.layers] == [t.shape for t in inputs.layers]
