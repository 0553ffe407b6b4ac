"""The core's argument order is written once, in ``fbtrain/models/core/spec.py``; the C++
source follows it (its per-layer ``enum Param`` and its ops' schemas), and these tests hold
the two together, so a reordering on one side fails here rather than as wrong numbers."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from fbtrain.config import ModelConfig
from fbtrain.models import build_model
from fbtrain.models.core import native
from fbtrain.models.core.spec import (
    ATT_PARAMS,
    LAYER_PARAMS,
    BackwardInputs,
    CoreInputs,
    CoreOutputs,
    CoreSpec,
    flatten,
)

# The C++ source calls the position bias ``c`` CPOS (``c`` is a LayerNorm's output there).
CPP_NAMES = {"c": "CPOS"}


def cpp_enum(name: str, source: str) -> list[str]:
    """The members of ``enum name { ... }`` in C++ ``source``, in order."""
    match = re.search(rf"\benum {name} \{{([^}}]*)\}}", source)
    assert match, f"no enum {name} in the C++ source"
    return [member.strip() for member in match.group(1).split(",") if member.strip()]


def test_cpp_param_enum_follows_layer_params():
    members = cpp_enum("Param", native.CSRC.read_text())
    assert members[-1] == "N_PARAMS"
    assert members[:-1] == [CPP_NAMES.get(name, name.upper()) for name in LAYER_PARAMS]


def test_the_enum_check_sees_a_reordering():
    """The parse is not vacuous: two members swapped in the source text fail the check."""
    source = native.CSRC.read_text().replace("WQ, UQ,", "UQ, WQ,", 1)
    members = cpp_enum("Param", source)
    assert members[:-1] != [CPP_NAMES.get(name, name.upper()) for name in LAYER_PARAMS]


def test_cpp_ops_take_the_tensors_in_core_inputs_order():
    """The ops' schemas: CoreInputs, then the CoreSpec fields (CoreSpec.args' order); the
    backward takes what the forward returned (CoreOutputs) and returns CoreInputs' fields."""
    ops = native.native_ops()
    spec_fields = [f.name for f in dataclasses.fields(CoreSpec)]
    forward = ops.core_forward.default._schema
    backward = ops.core_backward.default._schema
    assert [a.name for a in forward.arguments] == [*CoreInputs._fields, *spec_fields,
                                                   "keep_tape"]
    nested = {"outputs": CoreOutputs._fields}
    backward_fields = [f for name in BackwardInputs._fields for f in nested.get(name, [name])]
    assert [a.name for a in backward.arguments] == [*backward_fields, *spec_fields]
    lists = ["List[Tensor]" if name in ("layers", "tape") else "Tensor"
             for name in (*CoreInputs._fields, *CoreOutputs._fields)]
    n_in = len(CoreInputs._fields)
    assert [str(r.type) for r in forward.returns] == lists[n_in:]
    assert [str(r.type) for r in backward.returns] == lists[:n_in]


def test_spec_args_are_its_fields_in_order():
    spec = CoreSpec(n_layers=2, n_heads=4, shared_kv=True, window=8, dropout=0.1, eps=1e-6,
                    memory_norm=True)
    assert spec.args() == tuple(getattr(spec, f.name) for f in dataclasses.fields(CoreSpec))


def test_core_inputs_flat_round_trip():
    """``flat`` is the autograd Function's argument list; ``from_flat`` undoes it."""
    t = [torch.full((1,), float(i)) for i in range(9)]
    inputs = CoreInputs(*t[:5], None, tuple(t[5:]))
    flat = inputs.flat()
    assert len(flat) == 6 + 4 and flat[5] is None and flat[6] is t[5]
    assert CoreInputs.from_flat(flat) == inputs


def test_cpp_zero_list_is_att_params():
    """The attention parameters that get a zero gradient when no step attends: the C++
    core's list (``for (int k : {...}) gl[k] = at::zeros_like``) is spec.ATT_PARAMS."""
    match = re.search(r"for \(int k : \{([^}]*)\}\) gl\[k\] = at::zeros_like",
                      native.CSRC.read_text())
    assert match, "no zero list in the C++ source"
    members = [m.strip() for m in match.group(1).split(",")]
    assert members == [CPP_NAMES.get(name, name.upper()) for name in ATT_PARAMS]
    assert set(ATT_PARAMS) <= set(LAYER_PARAMS)


def test_backward_inputs_flat_form():
    """BackwardInputs' flat form is the C++ backward's argument order with the tape and
    layers spread."""
    t = [torch.full((1,), float(i)) for i in range(12)]
    outputs = CoreOutputs(*t[1:5], [t[5], t[6]])
    inputs = BackwardInputs(t[0], outputs, t[7], t[8], (t[9], t[10], t[11]))
    assert list(inputs.flat()) == t and flatten(inputs) == t


def test_no_double_backward_through_the_core():
    """The core's backward is hand-written and first-order only: a second derivative
    through it raises instead of silently being zero."""
    model = build_model(ModelConfig(kind="feedback_kv", d_model=8, n_heads=2, d_ff=8,
                                    n_layers=1), 5)
    logits, _ = model(torch.randint(0, 5, (1, 3)))
    weight = next(model.parameters())
    (grad,) = torch.autograd.grad(logits.square().sum(), weight, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()
