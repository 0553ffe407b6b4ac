"""Checkpoints written before the redesign (format v1, code at bc18203, made by
tests/fixtures/make_legacy_checkpoints.py) still load, sample, and resume correctly.

The fixtures' two steps were computed on another machine (an AVX-512 CPU), so their low
bits are that machine's: the resume is checked against straight steps computed here to
:data:`RESUME_ATOL`, not bitwise. Bitwise resumption is a per-machine claim, and
test_train.py::test_resume_is_bitwise_exact makes it with both sides computed here."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fbtrain.checkpoint import load_checkpoint, load_model
from fbtrain.config import config_from_dict
from fbtrain.sample import generate
from fbtrain.train import run

FIXTURES = Path(__file__).parent / "fixtures"
WORDS = ["the", "king", "queen", "and", "to", "of", "my", "lord", "thou", "art", "good",
         "night", "sweet", "prince", "ROMEO:", "JULIET:"]


pytestmark = pytest.mark.usefixtures("one_thread")

# How far a correctly resumed run may land from straight steps (the largest absolute
# difference in any weight after 4 steps). Another CPU's kernels change the fixtures' low
# bits: with torch held to AVX2 here (ATEN_CPU_CAPABILITY=avx2) the two runs differ by at
# most 1.2e-7. A restore that loses any state changes whole AdamW updates, each about the lr
# (3e-3): measured, a zeroed first moment moves some weight by 3.9e-3, fresh optimizer state
# by 7.8e-3, a re-seeded dropout stream by 6.2e-3, and each moves every one of the 36 tensors
# by at least 6.6e-5. 1e-5 sits 80x above the first and 6x below the least of the others.
RESUME_ATOL = 1e-5


def legacy_config(tmp_path: Path, context: str, max_steps: int) -> Any:
    """The config the fixture was trained with (see make_legacy_checkpoints.py)."""
    rng = random.Random(0)
    lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(300))
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return config_from_dict({
        "run": {"name": context, "out_dir": str(tmp_path / "runs"), "device": "cpu", "seed": 7},
        "data": {"path": str(text)},
        "model": {"kind": "feedback_kv", "d_model": 16, "n_heads": 2, "d_ff": 32,
                  "n_layers": 2, "max_rel_pos": 64, "dropout": 0.1},
        "train": {"max_steps": max_steps, "batch_size": 4, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 2, "eval_every": 2, "eval_windows": 8, "log_every": 1,
                  "constant_tokens": False, "sample_length": 12, "context": context},
        "curriculum": [{"seq_len": 8}],
        "checkpoint": {"every": 2, "keep_last": 1},
        "logging": {"tensorboard": False, "progress": False},
    })


@pytest.mark.parametrize("context", ["reset", "carry"])
def test_a_legacy_checkpoint_loads_and_samples(context: str) -> None:
    model, tokenizer, payload = load_model(FIXTURES / f"legacy-v1-{context}.pt")
    assert payload["step"] == 2
    text = generate(model, tokenizer, tokenizer.start, 20,
                    generator=torch.Generator().manual_seed(0))[0]
    assert len(text) == 20


@pytest.mark.parametrize("context", ["reset", "carry"])
def test_a_legacy_checkpoint_resumes(tmp_path: Path, context: str) -> None:
    """2 steps by the old code + 2 by this one == 4 straight steps by this one, to
    RESUME_ATOL in every weight."""
    straight = run(legacy_config(tmp_path / "a", context, 4), quiet=True)
    cfg = legacy_config(tmp_path / "b", context, 4)
    last = Path(cfg.run.out_dir) / context / "checkpoints" / "last.pt"
    last.parent.mkdir(parents=True)
    shutil.copy(FIXTURES / f"legacy-v1-{context}.pt", last)
    resumed = run(cfg, resume="auto", quiet=True)
    a = load_checkpoint(straight / "checkpoints" / "last.pt")
    b = load_checkpoint(resumed / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 4
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=0,
                                   atol=RESUME_ATOL, msg=lambda m, n=name: f"{n}: {m}")
