"""fbtrain export: weights-only safetensors, config.json, vocab.json; sample and eval accept
the exported folder as they accept a run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from test_train import make_cfg
from typer.testing import CliRunner

from fbtrain import evaluate, sample
from fbtrain.checkpoint import CheckpointError, load_checkpoint, load_model
from fbtrain.checkpoint.contents import export_model
from fbtrain.cli import app
from fbtrain.config import ModelConfig
from fbtrain.models import build_model
from fbtrain.train import run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained run (6 steps), shared by the tests of this file."""
    tmp = tmp_path_factory.mktemp("export")
    return run(make_cfg(tmp, train={"max_steps": 6, "eval_every": 3}), quiet=True)


def _sample(source: Path) -> str:
    out = io.StringIO()
    sample.run(str(source), length=40, seed=3, device="cpu", stream=out)
    return out.getvalue()


def test_export_then_sample_and_eval_as_from_the_run(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(trained), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"exported {trained / 'checkpoints' / 'best.pt'}\n  to {out}: " in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "vocab.json"]
    # Weights only: a fraction of best.pt, which carries the optimizer state too.
    assert (out / "model.safetensors").stat().st_size < (
        trained / "checkpoints" / "best.pt").stat().st_size / 2
    # The same text for the same seed, from the run and from the export.
    assert _sample(out) == _sample(trained)
    from_run = evaluate.run(str(trained), device="cpu")
    from_export = evaluate.run(str(out), device="cpu")
    assert from_export["loss"] == from_run["loss"] and from_export["step"] == from_run["step"]
    assert from_export["checkpoint"] == str(out)


def test_export_loads_in_plain_python(trained: Path, tmp_path: Path) -> None:
    """What the docs' example does: safetensors + config.json + vocab.json, no fbtrain
    checkpoint code; the weights are best.pt's, bitwise."""
    from safetensors.torch import load_file

    export_model(trained, tmp_path)
    cfg = ModelConfig(**json.loads((tmp_path / "config.json").read_text()))
    vocab = json.loads((tmp_path / "vocab.json").read_text())["chars"]
    model = build_model(cfg, len(vocab))
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    best = load_checkpoint(trained / "checkpoints" / "best.pt")["model"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, best[name]), name
    loaded, tokenizer, payload = load_model(tmp_path)  # load_model's contract holds
    assert tokenizer.tokens == vocab and "optimizer" not in payload
    assert payload["step"] == load_checkpoint(trained / "checkpoints" / "best.pt")["step"]
    assert not loaded.training


def test_export_errors_are_one_line(trained: Path, tmp_path: Path) -> None:
    target = tmp_path / "a_file"
    target.write_text("x")
    result = CliRunner().invoke(app, ["export", "-c", str(trained), "--out", str(target)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {target}: exists and is not a folder; give a "
                                     "folder to export into")
    with pytest.raises(CheckpointError, match=r"is a run directory \(it has checkpoints/\); "
                                              r"export into a folder of its own"):
        export_model(trained, trained)
    assert not (trained / "model.safetensors").exists()
    folder = tmp_path / "exp"
    export_model(trained, folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"exp: an exported model needs config.json "
                                              r"beside model.safetensors"):
        load_model(folder)
    export_model(trained, folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors"):
        sample.run(str(folder), length=5, device="cpu", stream=io.StringIO())
    export_model(trained, folder)
    (folder / "config.json").write_text(json.dumps({"kind": "feedback_kv", "d_model": 8}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: weights do not fit "
                                              r"model_config"):
        load_model(folder)


def test_python_example_of_the_docs(trained: Path, tmp_path: Path) -> None:
    """The docs' Python example, as written there: load, generate, score a text."""
    import math

    from fbtrain.evaluate import mean_loss
    from fbtrain.sample import generate

    export_model(trained, tmp_path / "exported")
    # --- the example
    model, tokenizer, _ = load_model(tmp_path / "exported")  # or a run directory
    text = generate(model, tokenizer, "the ", 50, temperature=0.8,
                    generator=torch.Generator().manual_seed(0))[0]
    ids = tokenizer.encode("the cat sat on the mat")[None]  # [1, T]
    loss = mean_loss(model, ids[:, :-1], ids[:, 1:], batch_size=1)  # nats per character
    bpc = loss / math.log(2)
    # ---
    assert len(text) == 50 and math.isfinite(bpc) and 0 < bpc < 10
