"""Checks that mean something only on a CUDA GPU (``pytest -m cuda``; skipped without one):
the fused core compiled (not interpreted) against the float64 reference and against the
ATen path, and whole-step CUDA graphs against eager training bit for bit. scripts/
gpu_check.py runs these in its last section; its own sections measure the same at larger
sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SMALL = dict(d_model=64, n_heads=4, d_ff=128, n_layers=2, dropout=0.0, max_rel_pos=64)


def _fused_or_skip() -> None:
    from fbtrain.models.core.select import fused_unavailable

    why = fused_unavailable()
    if why is not None:
        pytest.skip(why)


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("kind,norm", [("feedback_kv", "none"), ("feedback", "layernorm")])
def test_fused_core_compiled_matches_the_reference_in_float64(kind, norm, monkeypatch):
    """The fused core's compiled kernels (float64 variants) on the GPU: logits, loss and
    every gradient within 1e-9 of tests/reference.py, and it was the fused core that ran."""
    _fused_or_skip()
    import benchmark

    from fbtrain.models.core import select

    monkeypatch.setenv("FBTRAIN_CORE", "fused")
    assert type(select.core()).__name__ == "FusedCore"
    diff = benchmark.check_exact(kind, device="cuda", sizes={**SMALL, "memory_norm": norm})
    assert diff < 1e-9


@cuda_only
@pytest.mark.cuda
def test_fused_core_float32_step_agrees_with_the_aten_path():
    """A float32 training step, fused core against the ATen path (same weights): logits
    within 1e-4, every gradient within 1e-4 of its largest entry."""
    _fused_or_skip()
    import gpu_check_steps

    result = gpu_check_steps.fused_agreement(torch.device("cuda"), SMALL, 16, 32)
    assert result["ok"], result


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("core,precision", [("auto", "fp32"), ("auto", "bf16"),
                                            ("fused", "fp32")])
def test_whole_step_graphs_train_as_eager_does_bitwise(core, precision, tmp_path,
                                                       monkeypatch):
    """Whole-step graphs (FBTRAIN_CUDA_GRAPHS=step) against eager training from one seed:
    captured, and every step's figures, weight and AdamW state equal bit for bit (dropout,
    clipping and a shape change included; scripts/step_graph_check.py's comparison)."""
    if core == "fused":
        _fused_or_skip()
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    import step_graph_check

    monkeypatch.setenv("FBTRAIN_CORE", core)
    row = step_graph_check.check(tmp_path, torch.device("cuda"), precision,
                                 step_graph_check.TOY)
    assert row["captured"] and row["eager_repeatable"]
    assert row["bitwise_equal"], row
