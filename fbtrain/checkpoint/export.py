"""An exported model: a folder of weights to share, in the formats the ecosystem uses.

``fbtrain export`` writes::

    model.safetensors   the weights only (no optimizer state), safetensors format
    config.json         the model config (fbtrain.config.ModelConfig's fields)
    vocab.json          the vocabulary, as in a run directory

The safetensors header's metadata also holds where the weights came from
(``fbtrain.step``) and the run's training config (``fbtrain.config``, JSON), so that
``fbtrain eval`` finds the data and the sequence length as it does for a run. This module
reads and writes the folder; :func:`fbtrain.checkpoint.contents.load_model` checks what it
read, as for a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fbtrain.checkpoint.files import CHECKPOINT_DIR, CheckpointError
from fbtrain.data.errors import DataError
from fbtrain.data.tokenizers import VOCAB_FILE, Tokenizer
from fbtrain.io import atomic_write, atomic_write_text

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_FILES = (WEIGHTS_FILE, CONFIG_FILE, VOCAB_FILE)


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is an exported model's folder (it holds ``model.safetensors``)."""
    return (Path(path) / WEIGHTS_FILE).is_file()


def write_export(out: Path, state: dict[str, torch.Tensor], model_config: dict[str, Any],
                 tokenizer: Tokenizer, *, step: Any = None,
                 config: dict[str, Any] | None = None) -> list[Path]:
    """Write the three files into ``out`` (created if needed; each file atomically).

    Returns the files written. ``out`` must be a folder (or not exist yet)."""
    from safetensors.torch import save

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder; give a folder to export into")
    if (out / CHECKPOINT_DIR).is_dir():
        # sample/eval would then read the export, not the run's checkpoints, from that folder
        raise CheckpointError(f"{out}: is a run directory (it has {CHECKPOINT_DIR}/); export "
                              "into a folder of its own")
    # contiguous() and clone(): safetensors refuses views and tensors sharing memory.
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}
    metadata = {"format": "pt", "fbtrain.step": json.dumps(step),
                "fbtrain.config": json.dumps(config or {})}
    data = save(tensors, metadata)
    atomic_write(out / WEIGHTS_FILE, lambda f: f.write(data))
    atomic_write_text(out / CONFIG_FILE, json.dumps(model_config, indent=2) + "\n")
    tokenizer.save(out / VOCAB_FILE)
    return [out / name for name in EXPORT_FILES]


def read_export(folder: str | Path) -> dict[str, Any]:
    """An exported folder as a checkpoint-shaped dict (``model``, ``model_config``,
    ``vocab``, ``tokenizer``, ``config``, ``step``): what ``load_model`` checks and uses.

    Every problem is a one-line :class:`CheckpointError` naming the file."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    weights, config_file = folder / WEIGHTS_FILE, folder / CONFIG_FILE
    for needed in (config_file, folder / VOCAB_FILE):
        if not needed.is_file():
            raise CheckpointError(f"{folder}: an exported model needs {needed.name} beside "
                                  f"{WEIGHTS_FILE} (fbtrain export writes both)")
    try:
        with safe_open(str(weights), framework="pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    try:
        model_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file}: not readable JSON ({e})") from None
    try:
        step = json.loads(metadata.get("fbtrain.step", "null"))
        config = json.loads(metadata.get("fbtrain.config", "{}"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{weights}: bad fbtrain metadata ({e})") from None
    try:
        tokenizer = Tokenizer.load(folder)
    except DataError as e:
        raise CheckpointError(str(e)) from None
    return {"model": state, "model_config": model_config, "vocab": list(tokenizer.tokens),
            "tokenizer": tokenizer.kind, "config": config, "step": step}
