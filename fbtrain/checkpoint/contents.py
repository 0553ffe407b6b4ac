"""A checkpoint read back as a model (:func:`load_model`, from a checkpoint or an exported
folder), checked for a warm start (:func:`check_warm_start`, :func:`apply_warm_start`) and
exported (:func:`export_model`). What a training checkpoint holds and how it is made and
resumed from is :mod:`fbtrain.checkpoint.state`'s.

``sample`` and ``eval`` need only ``model``, ``model_config`` and ``vocab``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fbtrain.checkpoint.export import (
    WEIGHTS_FILE,
    export_folder,
    is_export,
    read_export,
    write_export,
)
from fbtrain.checkpoint.files import CheckpointError, resolve_checkpoint
from fbtrain.checkpoint.state import (
    architecture_diff,
    listed,
    nonfinite_tensors,
    read_checkpoint,
    state_dict_mismatch,
    strip_wrapper_prefixes,
)
from fbtrain.config import ModelConfig
from fbtrain.data.errors import DataError
from fbtrain.data.tokenizers import make_tokenizer
from fbtrain.device import resolve_device
from fbtrain.errors import ArgumentError
from fbtrain.models import build_model

# What a warm start (transformer -> feedback, on purpose) must agree on: the weights' shapes.
WARM_START_ARCHITECTURE = ("d_model", "n_heads", "d_ff", "n_layers", "max_rel_pos")


def check_warm_start(source: str, model_cfg: ModelConfig) -> tuple[Path, dict[str, Any]]:
    """The ``train.init_from`` checkpoint ``source`` (a file, a run directory or an export:
    only the weights are needed), loaded: it must hold a model whose weights are finite and
    have the shapes ``model_cfg`` makes (the kind may differ, on purpose)."""
    # ~ is the home folder, as in data.path and run.out_dir (a config has no shell to expand it)
    path = resolve_model(Path(source).expanduser(), prefer="best")
    init = read_export(path) if is_export(path) else read_checkpoint(path)
    if not (isinstance(init.get("model"), dict) and isinstance(init.get("vocab"), list)
            and isinstance(init.get("model_config"), dict)):
        raise CheckpointError(f"{path}: train.init_from needs a model checkpoint "
                              "(with 'model', 'model_config' and 'vocab')")
    bad = nonfinite_tensors(init["model"])
    if bad:  # step 1 would say "loss is nan ... try a lower train.lr"
        raise CheckpointError(f"{path}: train.init_from's weights hold NaN or inf (in "
                              f"{listed(bad)}); the checkpoint is damaged or its training "
                              "diverged")
    diff = architecture_diff(init["model_config"], model_cfg, WARM_START_ARCHITECTURE)
    if diff:
        raise CheckpointError(
            f"{path}: train.init_from's model differs from model.* in the config "
            f"({'; '.join(diff)}); a warm start needs the same "
            f"{', '.join(WARM_START_ARCHITECTURE)}")
    return path, init


@dataclass
class WarmStart:
    """What :func:`apply_warm_start` did, by parameter name."""

    source: Path
    loaded: list[str] = dataclasses.field(default_factory=list)
    fresh: list[str] = dataclasses.field(default_factory=list)
    unused: list[str] = dataclasses.field(default_factory=list)  # absent or reshaped here

    def summary(self) -> str:
        lines = [f"warm start from {self.source}: loaded {len(self.loaded)} tensors: "
                 f"{summarize_names(self.loaded)}",
                 f"  freshly initialised {len(self.fresh)}: {summarize_names(self.fresh)}"]
        if self.unused:
            lines.append(f"  not used from the checkpoint {len(self.unused)}: "
                         f"{summarize_names(self.unused)}")
        return "\n".join(lines)


def apply_warm_start(model: nn.Module, state: dict[str, Any], source: Path) -> WarmStart:
    """Copy every tensor of ``state`` whose name and shape match into ``model``."""
    state = strip_wrapper_prefixes(state)
    own = model.state_dict()
    report = WarmStart(source=Path(source))
    matched = {}
    for name, tensor in state.items():
        if name in own and torch.is_tensor(tensor) and tensor.shape == own[name].shape:
            matched[name] = tensor
        else:
            report.unused.append(name)
    model.load_state_dict(matched, strict=False)
    report.loaded = [n for n in own if n in matched]
    report.fresh = [n for n in own if n not in matched]
    return report


_LAYER = re.compile(r"^(.*?layers)\.(\d+)\.(.+)$")


def summarize_names(names: list[str]) -> str:
    """Parameter names, compactly: ``embed.weight, layers.0-3.{ln1.weight, attn.r}``.

    Names that differ only in the layer index are merged; names present in the same layers
    share one brace group. "none" for an empty list.
    """
    if not names:
        return "none"
    plain: list[str] = []
    layers: dict[tuple[str, str], list[int]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            layers.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
        else:
            plain.append(name)
    groups: dict[tuple[str, str], list[str]] = {}
    for (prefix, rest), indices in layers.items():
        groups.setdefault((prefix, _ranges(indices)), []).append(rest)
    parts = list(plain)
    for (prefix, span), rests in groups.items():
        inner = rests[0] if len(rests) == 1 else "{" + ", ".join(rests) + "}"
        parts.append(f"{prefix}.{span}.{inner}")
    return ", ".join(parts)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


_MODEL_KEYS = ("model", "model_config", "vocab")


def load_model(
    path: str | Path, device: torch.device | str = "cpu", prefer: str = "best"
) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """Rebuild the model a checkpoint describes: ``(model, tokenizer, payload)``.

    ``path`` is a checkpoint file, a run directory (``best.pt`` preferred, see
    :func:`resolve_checkpoint`) or a folder written by :func:`export_model` (its
    ``payload`` then holds no optimizer, only what the folder holds). The model is built
    from ``payload["model_config"]`` and ``len(payload["vocab"])``, given the saved
    weights (built on ``device``: its initial weights are never made on the host only to
    be copied over) and put in eval mode; the tokenizer is the saved
    vocabulary's (``payload["tokenizer"]``: char, the default, or word). Anything missing
    or not matching (keys, shapes, config fields) is a one-line :class:`CheckpointError`; a
    device name this machine lacks (``"cuda"`` without CUDA), a one-line DeviceError.
    """
    if isinstance(device, str):  # "auto" too, as the commands take it
        device = resolve_device(device)
    file = resolve_model(path, prefer=prefer)
    if is_export(file):
        payload, file = read_export(file), file / WEIGHTS_FILE
    else:
        payload = read_checkpoint(file)
    missing = [k for k in _MODEL_KEYS if k not in payload]
    if missing:
        raise CheckpointError(
            f"{file}: not a model checkpoint (missing {', '.join(repr(k) for k in missing)})"
        )
    raw_cfg, vocab, state = payload["model_config"], payload["vocab"], payload["model"]
    if not isinstance(raw_cfg, dict):
        raise CheckpointError(f"{file}: 'model_config' must be a dict of ModelConfig fields")
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: 'model' must be a state dict of tensors")
    try:
        tokenizer = make_tokenizer(vocab, payload.get("tokenizer"))
    except (DataError, TypeError) as e:
        raise CheckpointError(f"{file}: bad 'vocab': {e}") from None
    try:
        cfg = ModelConfig(**raw_cfg)
        with torch.device(device):
            model = build_model(cfg, tokenizer.vocab_size)
    except (TypeError, ArgumentError) as e:  # a key ModelConfig lacks; a value it refuses
        raise CheckpointError(f"{file}: bad 'model_config': {e}") from None
    state = strip_wrapper_prefixes(state)
    problem = state_dict_mismatch(model.state_dict(), state)
    if problem:
        raise CheckpointError(f"{file}: weights do not fit model_config ({cfg.kind}): {problem}")
    bad = nonfinite_tensors(state)
    if bad:
        # Every prediction would be NaN: sampling would crash and scores would be NaN.
        raise CheckpointError(f"{file}: the weights hold NaN or inf (in {listed(bad)}); the "
                              "checkpoint is damaged or its training diverged")
    model.load_state_dict(state)
    model.eval()
    return model, tokenizer, payload


def resolve_model(path: str | Path, prefer: str = "best") -> Path:
    """What ``path`` names to load a model from: an exported folder (given as the folder or
    its weights file), else the checkpoint file :func:`resolve_checkpoint` finds."""
    return export_folder(path) or resolve_checkpoint(path, prefer=prefer)


def export_model(source: str | Path, out: str | Path) -> tuple[Path, list[Path]]:
    """``fbtrain export``: the weights of ``source`` (a run directory: its best.pt, else
    last.pt; a checkpoint file; an export) written to the folder ``out`` as safetensors,
    with config.json and vocab.json (see :mod:`fbtrain.checkpoint.export`).

    The checkpoint is checked as ``load_model`` checks it (weights that fit the config,
    finite), so an export always loads. Returns the file read and the files written."""
    if not str(out).strip():  # Path("") is the current folder: its config.json replaced
        raise ArgumentError(f"--out {str(out)!r}: empty; give the folder to export into")
    file = resolve_model(source)
    model, tokenizer, payload = load_model(file)
    config = payload.get("config") if isinstance(payload.get("config"), dict) else {}
    written = write_export(Path(out), model.state_dict(), payload["model_config"], tokenizer,
                           step=payload.get("step"), config=config, data=payload.get("data"))
    return file, written
