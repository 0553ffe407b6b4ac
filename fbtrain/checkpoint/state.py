"""A training checkpoint as a dict of parts, each of which owns its state (torchtitan's
``Stateful``): made (:func:`make_checkpoint`), checked whole and restored
(:func:`restore_checkpoint`), and read back from any layout fbtrain ever wrote
(:func:`read_checkpoint`, which upgrades the old ones).

A part is anything with ``state_dict()``, ``state_problem(state)`` ('' when ``state``
can be loaded; ``state`` is None when the checkpoint holds no entry of the part's name) and
``load_state_dict(state)``. The trainer names its parts in one place
(:func:`fbtrain.train.setup.state_parts`); the parts of torch's own objects are here
(:class:`ModelState`, :class:`OptimizerState`, :class:`ScalerState`), fbtrain's own
implement the protocol themselves (the training state, the batch sampler, the carried
streams, the global RNG streams, the data's identity, the training clock). A checkpoint
(format v2) is then::

    model, optimizer, scaler, progress,      one entry per part: its state_dict()
    sampler, streams, rng, data, clock
    model_config, vocab, tokenizer           what rebuilds the model (sample, eval, export)
    config, world_size, run_id               the run it came from (run_id: see
                                             :mod:`fbtrain.rundir.history`; absent before)
    step                                     the step of the weights (progress.step), for
                                             readers that need nothing else

Resuming checks every part's state before it loads any, so a damaged checkpoint is one
:class:`CheckpointError` line and nothing is half restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fbtrain.checkpoint.files import FORMAT, CheckpointError, load_checkpoint
from fbtrain.config import ModelConfig
from fbtrain.data.identity import DataIdentity
from fbtrain.errors import UserError
from fbtrain.messages import a_type, first_line, is_int, is_number
from fbtrain.rundir_names import CHECKPOINT_DIR, CONFIG

# Model fields that fix the shapes of the weights; a checkpoint must agree on all of them.
ARCHITECTURE = ("kind", "d_model", "n_heads", "d_ff", "n_layers", "max_rel_pos", "memory_norm")
# Prefixes torch.compile (``_orig_mod.``) and DistributedDataParallel (``module.``) put on
# parameter names; a state dict saved from a wrapped model still belongs to the bare one.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class Stateful(Protocol):
    """A part of the training state that a checkpoint saves and a resume puts back."""

    def state_dict(self) -> dict[str, Any]: ...

    def state_problem(self, state: Any) -> str: ...

    def load_state_dict(self, state: Any) -> None: ...


def expect_dict(state: Any) -> str:
    """The first check of most parts: '' for a dict, else what ``state`` is instead."""
    if state is None:
        return "missing"
    return "" if isinstance(state, dict) else f"is {a_type(state)}, not a dict"


# ----------------------------------------------------------------------------- make, restore


def make_checkpoint(parts: Mapping[str, Stateful], *, model_cfg: ModelConfig, tokenizer: Any,
                    step: int, config: dict[str, Any] | None = None, world_size: int = 1,
                    run_id: str | None = None) -> dict[str, Any]:
    """A checkpoint's contents: every part's state under its name, and what describes the
    model and the run (see the module docstring). ``parts`` may hold only ``model``: that
    is a checkpoint ``sample`` and ``eval`` read, but not one to resume from."""
    payload: dict[str, Any] = {name: part.state_dict() for name, part in parts.items()}
    payload.update(model_config=dataclasses.asdict(model_cfg), vocab=list(tokenizer.tokens),
                   tokenizer=tokenizer.kind, config=config or {}, world_size=world_size,
                   step=step)
    if run_id:
        payload["run_id"] = run_id
    return payload


def restore_checkpoint(path: Path, payload: dict[str, Any], parts: Mapping[str, Stateful],
                       model_cfg: ModelConfig) -> None:
    """Put every part of ``parts`` back from ``payload`` (read by :func:`read_checkpoint`).

    The model config is compared first (a different model is the clearer message), then
    every part checks its own state, and only when all fit is any loaded. Entries of the
    checkpoint that no part names are ignored (a GradScaler's state resumed without fp16).
    """
    refuse_other_model(path, payload, model_cfg)
    progress = payload.get("progress")
    if isinstance(progress, dict) and payload.get("step") != progress.get("step"):
        raise CheckpointError(f"{path}: cannot resume from it: step is {payload.get('step')!r}"
                              f" but progress.step is {progress.get('step')!r}")
    for name, part in parts.items():
        problem = part.state_problem(payload.get(name))
        if problem:
            raise CheckpointError(f"{path}: cannot resume from it: {name}: {problem}")
    for name, part in parts.items():
        if payload.get(name) is None:
            continue  # a part that may start afresh (its check said so)
        try:
            part.load_state_dict(payload[name])
        except UserError as e:  # what the state itself gets wrong; anything else is a bug
            raise CheckpointError(f"{path}: cannot restore training state: {name}: "
                                  f"{first_line(e)}") from e


def refuse_other_model(path: Path, payload: dict[str, Any], model_cfg: ModelConfig) -> None:
    """CheckpointError when the checkpoint ``payload`` read from ``path`` holds another model
    than ``model_cfg``, naming the run's ``config.yaml`` to resume with (beside
    ``checkpoints/``). Cheap, so a resume checks it before it loads (or downloads) data."""
    saved = payload.get("model_config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: cannot resume from it: model_config: "
                              f"{expect_dict(saved) or 'not a dict of ModelConfig fields'}")
    diff = architecture_diff(saved, model_cfg, ARCHITECTURE)
    if diff:
        config = path.parent.parent / CONFIG
        use = (f"resume with the run's own config (--config {config})"
               if path.parent.name == CHECKPOINT_DIR and config.is_file()
               else "resume with its config")
        raise CheckpointError(f"{path}: the checkpoint's model differs from model.* in the "
                              f"config ({'; '.join(diff)}); {use}")


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


# Entries every resume reads, whatever the run's parts (see resumable_problem).
RESUME_ENTRIES = ("model", "optimizer", "progress", "model_config", "rng")


def resumable_problem(payload: dict[str, Any]) -> str:
    """'' when ``payload`` (as :func:`read_checkpoint` returns it) holds what every resume
    reads, else what is wrong: the check that picks the checkpoint to go on from
    (:func:`fbtrain.rundir.resume.choose_resume`) before any part exists to check its own state.
    The parts' own checks follow in :func:`restore_checkpoint`."""
    missing = [k for k in RESUME_ENTRIES if not isinstance(payload.get(k), dict)]
    if missing:
        return f"{', '.join(missing)}: missing or not a dict"
    model = payload["model"]
    if not all(isinstance(k, str) and torch.is_tensor(v) for k, v in model.items()):
        return "model: not a state dict (parameter names -> tensors)"
    bad = nonfinite_tensors(model)
    if bad:
        return f"model: the weights hold NaN or inf (in {listed(bad)})"
    step = payload["progress"].get("step")
    if not (is_int(step) and step >= 0):
        return f"progress: step is {step!r}, not an integer >= 0"
    return ""


# ----------------------------------------------------------------------------- old layouts

_V1 = "fbtrain-checkpoint-v1"


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """:func:`load_checkpoint`, then :func:`upgrade`: every reader sees today's layout."""
    return upgrade(load_checkpoint(Path(path)))


def upgrade(payload: dict[str, Any]) -> dict[str, Any]:
    """Today's layout (format v2) from any fbtrain checkpoint; the caller's dict is left as
    it was.

    v1 (until the parts owned their state) kept the progress as top-level ``step``,
    ``tokens``, ``val_loss`` and ``best_val_loss``, the sampler inside ``rng``, no digest of
    its data (``data`` gets the config's ``data`` settings alone) and two entries nothing
    read (``scheduler``: the learning rate is a function of the step and the config;
    ``curriculum_stage``: likewise). Entries of the wrong type are carried over as they
    are, for the parts' checks to name.
    """
    if payload.get("format") != _V1:
        return payload
    out = {k: v for k, v in payload.items() if k not in ("scheduler", "curriculum_stage")}
    out["progress"] = {"step": payload.get("step"), "tokens": payload.get("tokens", 0),
                       "val_loss": payload.get("val_loss"),
                       "best_val_loss": payload.get("best_val_loss")}
    for key in ("tokens", "val_loss", "best_val_loss"):
        out.pop(key, None)
    rng = payload.get("rng")
    if isinstance(rng, dict) and "sampler" in rng:
        out["rng"] = {k: v for k, v in rng.items() if k != "sampler"}
        out["sampler"] = rng["sampler"]
    config = payload.get("config")
    if isinstance(config, dict) and isinstance(config.get("data"), dict):
        out["data"] = {"settings": DataIdentity.settings_of(config["data"])}
    out["format"] = FORMAT
    return out


# ----------------------------------------------------------------------------- torch's parts


class ModelState:
    """The weights of ``model`` (the bare module: DDP's and compile's prefixes are dropped
    from a saved state dict)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def state_problem(self, state: Any) -> str:
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()
        ):
            return "missing" if state is None else "not a state dict (parameter names -> tensors)"
        bad = nonfinite_tensors(state)
        if bad:
            return f"the weights hold NaN or inf (in {listed(bad)})"
        problem = state_dict_mismatch(self.model.state_dict(), strip_wrapper_prefixes(state))
        return f"the weights do not fit the model: {problem}" if problem else ""

    def load_state_dict(self, state: Any) -> None:
        with torch_refusal():
            self.model.load_state_dict(strip_wrapper_prefixes(state))


class OptimizerState:
    """An optimizer's moments and hyper-parameters; the moments must have the shapes of the
    parameters they belong to (``load_state_dict`` does not check, and the first step would
    fail deep inside the update)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def state_problem(self, state: Any) -> str:
        problem = expect_dict(state)
        if problem:
            return problem
        groups, per_param = state.get("param_groups"), state.get("state")
        if not isinstance(per_param, dict) or not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
        ):
            return "not an optimizer state dict ('state' and 'param_groups')"
        if not all(isinstance(v, dict) for v in per_param.values()):
            return "its state holds entries that are not dicts of tensors"
        sizes = [len(g["params"]) for g in groups]
        live_sizes = [len(g["params"]) for g in self.optimizer.param_groups]
        if sizes != live_sizes:
            return f"parameter groups of {sizes} parameters, but the model's are {live_sizes}"
        # Saved parameter ids map onto the live parameters in group order, as
        # load_state_dict maps them.
        saved_ids = [i for g in groups for i in g["params"]]
        live = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, param in zip(saved_ids, live, strict=True):
            for name, value in per_param.get(index, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    return (f"state {name} of parameter {index} has shape "
                            f"{tuple(value.shape)}, but the parameter has {tuple(param.shape)}")
        return ""

    def load_state_dict(self, state: Any) -> None:
        with torch_refusal():
            self.optimizer.load_state_dict(state)


class ScalerState:
    """fp16's loss scale (a GradScaler's state). A checkpoint without one (trained in bf16
    or fp32) resumes in fp16 with a fresh scale."""

    KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def state_problem(self, state: Any) -> str:
        if state is None:
            return ""
        problem = expect_dict(state)
        if problem:
            return problem
        bad = [k for k in self.KEYS if not is_number(state.get(k))]
        return f"{', '.join(bad)} missing or not numbers" if bad else ""

    def load_state_dict(self, state: Any) -> None:
        with torch_refusal():
            self.scaler.load_state_dict(state)


class StateMismatch(UserError):
    """A saved state torch's own ``load_state_dict`` refused (one its part's
    ``state_problem`` did not foresee): the checkpoint's fault, not fbtrain's."""


@contextlib.contextmanager
def torch_refusal() -> Iterator[None]:
    """Around a torch object's ``load_state_dict``: the errors it refuses a state with
    (``RuntimeError``, ``ValueError``, ``KeyError``) become a :class:`StateMismatch`, the
    cause kept. Only torch's call goes inside: fbtrain's own code raising these is a bug."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError) as e:
        raise StateMismatch(first_line(e)) from e


# ----------------------------------------------------------------------------- helpers


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


def listed(keys: list[str]) -> str:
    """The first three of ``keys`` and how many more: a list that stays on one line."""
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def state_dict_mismatch(expected: dict[str, torch.Tensor], got: dict[str, Any]) -> str:
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
        parts.append(f"missing {listed(missing)}")
    if unexpected:
        parts.append(f"unexpected {listed(unexpected)}")
    if wrong:
        parts.append(f"wrong shape {listed(wrong)}")
    return "; ".join(parts)
