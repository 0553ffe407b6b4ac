"""Checks that mean something only on a CUDA GPU (``pytest -m cuda``; skipped without one):
whole-step CUDA graphs against eager training bit for bit. scripts/gpu_check.py runs these
in its last section; its own sections measure the same at larger sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_whole_step_graphs_train_as_eager_does_bitwise(precision, tmp_path):
    """Whole-step graphs (FBTRAIN_CUDA_GRAPHS=1) against eager training from one seed:
    captured, and every step's figures, weight and AdamW state equal bit for bit (dropout,
    clipping and a shape change included; scripts/step_graph_check.py's comparison)."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    import step_graph_check

    row = step_graph_check.check(tmp_path, torch.device("cuda"), precision,
                                 step_graph_check.TOY)
    assert row["captured"] and row["eager_repeatable"]
    assert row["bitwise_equal"], row
