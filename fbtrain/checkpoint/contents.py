"""What a checkpoint holds, in one place: made (:func:`make_payload`), checked for a resume
(:func:`check_resume_payload`) and for a warm start (:func:`check_warm_start`), and read back
as a model (:func:`load_model`, from a checkpoint or an exported folder), exported
(:func:`export_model`).

A training checkpoint is a plain dict::

    model, model_config, vocab, tokenizer     the weights and what rebuilds the model
    config                                    the resolved training config
    step, tokens, val_loss, best_val_loss     progress
    optimizer, scheduler, scaler              the optimizer's state (scaler: fp16 only)
    rng                                       every random stream (fbtrain.rng.capture_rng)
    streams                                   carried streams and memory (context: carry)
    curriculum_stage, world_size              where it stood

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

from fbtrain.checkpoint.export import WEIGHTS_FILE, is_export, read_export, write_export
from fbtrain.checkpoint.files import CheckpointError, load_checkpoint, resolve_checkpoint
from fbtrain.config import ModelConfig
from fbtrain.data.errors import DataError
from fbtrain.data.samplers import BatchSampler
from fbtrain.data.tokenizers import make_tokenizer
from fbtrain.messages import a_type, is_int, is_number
from fbtrain.models import build_model
from fbtrain.rng import rng_problem

# Model fields that fix the shapes of the weights; a checkpoint must agree on all of them.
ARCHITECTURE = ("kind", "d_model", "n_heads", "d_ff", "n_layers", "max_rel_pos", "memory_norm")
# What a warm start (transformer -> feedback, on purpose) must agree on: the weights' shapes.
WARM_START_ARCHITECTURE = ("d_model", "n_heads", "d_ff", "n_layers", "max_rel_pos")


def make_payload(*, model: nn.Module, model_cfg: ModelConfig, config: dict[str, Any],
                 tokenizer: Any, optimizer: torch.optim.Optimizer, scheduler: dict[str, Any],
                 rng: dict[str, Any], step: int, tokens: int, val_loss: float | None,
                 best_val_loss: float | None, curriculum_stage: int, world_size: int,
                 scaler: dict[str, Any] | None = None, streams: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """A training checkpoint's contents (see the module docstring): everything a resume
    needs, plus what sample/eval need to rebuild the model."""
    payload = {
        "model": model.state_dict(),
        "model_config": dataclasses.asdict(model_cfg),
        "vocab": list(tokenizer.tokens),
        "tokenizer": tokenizer.kind,
        "config": config,
        "step": step,
        "tokens": tokens,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler,
        "rng": rng,
        "best_val_loss": best_val_loss,
        "val_loss": val_loss,
        "curriculum_stage": curriculum_stage,
        "world_size": world_size,
    }
    if scaler is not None:
        payload["scaler"] = scaler
    if streams is not None:
        payload["streams"] = streams
    return payload


_RESUME_KEYS = ("model", "optimizer", "step", "rng", "model_config")


def check_resume_payload(
    path: str | Path, payload: dict[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Refuse a checkpoint that cannot be resumed from, before anything is restored.

    Checks what the trainer reads back: the keys it needs, ``step`` and ``tokens``
    (integers >= 0), ``val_loss`` / ``best_val_loss`` (numbers or None), ``model`` (a state
    dict of tensors, all finite), ``model_config`` (a dict), ``optimizer`` (a state dict:
    ``state`` and ``param_groups``), ``scaler`` / ``streams`` (dicts, when present) and
    ``rng`` (as :func:`rng_problem`, which also needs ``python`` and ``torch``). With
    ``optimizer`` (the one about to load the state), the saved moments must also have its
    parameters' shapes - ``load_state_dict`` does not check that, and the first step would
    fail deep inside the update. Raises one :class:`CheckpointError` line naming ``path``
    and what is wrong.
    """

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: cannot resume from it: {problem}")

    missing = [k for k in _RESUME_KEYS if k not in payload]
    if missing:
        raise refuse(f"missing {', '.join(missing)}")
    for key in ("step", "tokens"):
        if key in payload and not (is_int(payload[key]) and payload[key] >= 0):
            raise refuse(f"{key!r} is {payload[key]!r}, not an integer >= 0")
    for key in ("val_loss", "best_val_loss"):
        if payload.get(key) is not None and not is_number(payload[key]):
            raise refuse(f"{key!r} is {payload[key]!r}, not a number (or null)")
    model = payload["model"]
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and torch.is_tensor(v) for k, v in model.items()
    ):
        raise refuse("'model' is not a state dict (parameter names -> tensors)")
    bad = nonfinite_tensors(model)
    if bad:
        raise refuse(f"the weights hold NaN or inf (in {_listed(bad)})")
    if not isinstance(payload["model_config"], dict):
        raise refuse("'model_config' is not a dict of ModelConfig fields")
    problem = _optimizer_problem(payload["optimizer"], optimizer)
    if problem:
        raise refuse(problem)
    for key in ("scaler", "streams"):
        if key in payload and not isinstance(payload[key], dict):
            raise refuse(f"{key!r} is {a_type(payload[key])}, not a dict")
    rng = payload["rng"]
    needed = [k for k in ("python", "torch") if not isinstance(rng, dict) or k not in rng]
    problem = rng_problem(rng) or (f"rng lacks {', '.join(needed)}" if needed else "")
    if not problem and "sampler" in rng:
        problem = BatchSampler.state_problem(rng["sampler"])
        problem = problem and f"rng.sampler: {problem}"
    if problem:
        raise refuse(f"malformed RNG state: {problem}")


def _optimizer_problem(state: Any, optimizer: torch.optim.Optimizer | None) -> str:
    """What is wrong with a saved optimizer state dict ('' when nothing is)."""
    if not isinstance(state, dict):
        return f"'optimizer' is {a_type(state)}, not an optimizer state dict"
    groups, per_param = state.get("param_groups"), state.get("state")
    if not isinstance(per_param, dict) or not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return "'optimizer' is not an optimizer state dict ('state' and 'param_groups')"
    if not all(isinstance(v, dict) for v in per_param.values()):
        return "'optimizer' state holds entries that are not dicts of tensors"
    if optimizer is None:
        return ""
    # Saved parameter ids map onto the live parameters in group order, as load_state_dict
    # maps them; a count mismatch is load_state_dict's to report.
    saved_ids = [i for g in groups for i in g["params"]]
    live = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved_ids) != len(live):
        return ""
    for index, param in zip(saved_ids, live, strict=True):
        for name, value in per_param.get(index, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                return (f"'optimizer' state {name} of parameter {index} has shape "
                        f"{tuple(value.shape)}, but the parameter has {tuple(param.shape)}")
    return ""


def check_warm_start(source: str, model_cfg: ModelConfig) -> tuple[Path, dict[str, Any]]:
    """The ``train.init_from`` checkpoint ``source``, loaded: it must hold a model whose
    weights have the shapes ``model_cfg`` makes (the kind may differ, on purpose)."""
    path = resolve_checkpoint(source, prefer="best")
    init = load_checkpoint(path)
    if not (isinstance(init.get("model"), dict) and isinstance(init.get("vocab"), list)
            and isinstance(init.get("model_config"), dict)):
        raise CheckpointError(f"{path}: train.init_from needs a model checkpoint "
                              "(with 'model', 'model_config' and 'vocab')")
    diff = architecture_diff(init["model_config"], model_cfg, WARM_START_ARCHITECTURE)
    if diff:
        raise CheckpointError(
            f"{path}: train.init_from's model differs from model.* in the config "
            f"({'; '.join(diff)}); a warm start needs the same "
            f"{', '.join(WARM_START_ARCHITECTURE)}")
    return path, init


def architecture_diff(saved: dict[str, Any], model: ModelConfig, keys: tuple[str, ...]
                      ) -> list[str]:
    """``"key: checkpoint X, config Y"`` for each of ``keys`` where a checkpoint's
    ``model_config`` (``saved``) and ``model`` disagree; empty when they agree. A key the
    checkpoint lacks (saved before the key existed) counts as the key's default."""
    out = []
    for k in keys:
        theirs, ours = saved.get(k, getattr(ModelConfig, k, None)), getattr(model, k)
        if theirs != ours:
            out.append(f"{k}: checkpoint {theirs!r}, config {ours!r}")
    return out


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
# Prefixes torch.compile (``_orig_mod.``) and DistributedDataParallel (``module.``) put on
# parameter names; a state dict saved from a wrapped model still belongs to the bare one.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def load_model(
    path: str | Path, device: torch.device | str = "cpu", prefer: str = "best"
) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """Rebuild the model a checkpoint describes: ``(model, tokenizer, payload)``.

    ``path`` is a checkpoint file, a run directory (``best.pt`` preferred, see
    :func:`resolve_checkpoint`) or a folder written by :func:`export_model` (its
    ``payload`` then holds no optimizer, only what the folder holds). The model is built
    from ``payload["model_config"]`` and ``len(payload["vocab"])``, given the saved
    weights, put in eval mode and moved to ``device``; the tokenizer is the saved
    vocabulary's (``payload["tokenizer"]``: char, the default, or word). Anything missing
    or not matching (keys, shapes, config fields) is a one-line :class:`CheckpointError`.
    """
    file = resolve_model(path, prefer=prefer)
    if is_export(file):
        payload, file = read_export(file), file / WEIGHTS_FILE
    else:
        payload = load_checkpoint(file)
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
        model = build_model(cfg, tokenizer.vocab_size)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: bad 'model_config': {e}") from None
    state = strip_wrapper_prefixes(state)
    problem = _state_dict_mismatch(model.state_dict(), state)
    if problem:
        raise CheckpointError(f"{file}: weights do not fit model_config ({cfg.kind}): {problem}")
    bad = nonfinite_tensors(state)
    if bad:
        # Every prediction would be NaN: sampling would crash and scores would be NaN.
        raise CheckpointError(f"{file}: the weights hold NaN or inf (in {_listed(bad)}); the "
                              "checkpoint is damaged or its training diverged")
    model.load_state_dict(state)
    model.eval()
    return model.to(device), tokenizer, payload


def resolve_model(path: str | Path, prefer: str = "best") -> Path:
    """What ``path`` names to load a model from: an exported folder as it is, else the
    checkpoint file :func:`resolve_checkpoint` finds."""
    return Path(path) if is_export(path) else resolve_checkpoint(path, prefer=prefer)


def export_model(source: str | Path, out: str | Path) -> tuple[Path, list[Path]]:
    """``fbtrain export``: the weights of ``source`` (a run directory: its best.pt, else
    last.pt; a checkpoint file; an export) written to the folder ``out`` as safetensors,
    with config.json and vocab.json (see :mod:`fbtrain.checkpoint.export`).

    The checkpoint is checked as ``load_model`` checks it (weights that fit the config,
    finite), so an export always loads. Returns the file read and the files written."""
    file = resolve_model(source)
    model, tokenizer, payload = load_model(file)
    config = payload.get("config") if isinstance(payload.get("config"), dict) else {}
    written = write_export(Path(out), model.state_dict(), payload["model_config"], tokenizer,
                           step=payload.get("step"), config=config)
    return file, written


def strip_wrapper_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """Drop the ``module.`` (DDP) / ``_orig_mod.`` (torch.compile) prefix on every name."""
    for prefix in _WRAPPER_PREFIXES:
        if state and all(isinstance(k, str) and k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def nonfinite_tensors(state: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors in ``state`` that hold a NaN or an infinity."""
    return [name for name, value in state.items()
            if torch.is_tensor(value) and (value.is_floating_point() or value.is_complex())
            and not bool(torch.isfinite(value).all())]


def _listed(keys: list[str]) -> str:
    """The first three of ``keys`` and how many more: a list that stays on one line."""
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _state_dict_mismatch(expected: dict[str, torch.Tensor], got: dict[str, Any]) -> str:
    """One line naming missing/unexpected keys and wrong shapes ('' when all fit).

    Checked here rather than left to ``load_state_dict``, whose error runs to many lines.
    """
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    wrong = [
        f"{k} {tuple(got[k].shape) if torch.is_tensor(got[k]) else type(got[k]).__name__}"
        f" (expected {tuple(v.shape)})"
        for k, v in expected.items()
        if k in got and (not torch.is_tensor(got[k]) or got[k].shape != v.shape)
    ]
    parts = []
    if missing:
        parts.append(f"missing {_listed(missing)}")
    if unexpected:
        parts.append(f"unexpected {_listed(unexpected)}")
    if wrong:
        parts.append(f"wrong shape {_listed(wrong)}")
    return "; ".join(parts)
