"""The validation report: a :class:`Config` from a nested dict, with every problem found
at once, one line each (file, key, value, what is allowed), raised as one ConfigError.

Each section checks itself (``problems()`` in schema.py); here are the checks of the
curriculum, those across sections, and the memory estimate (budget.py), asked last.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any

from fbtrain.config.budget import memory_problem
from fbtrain.config.errors import ConfigError, cut, show
from fbtrain.config.fields import INT64_MAX, allowed_types, coerce, decimal_hint, type_name
from fbtrain.config.schema import DEFAULT_CURRICULUM, CurriculumStage
from fbtrain.config.tree import SECTIONS, Config


def _build_section(cls: type, raw: Any, name: str, where: str, problems: list[str]) -> Any:
    """Section ``name`` (class ``cls``) from its YAML mapping ``raw``: unknown keys, values of
    the wrong type and the section's own problems go to ``problems``, keys with one are left
    at their defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{where}: {name} = {show(raw)}: must be a mapping of keys to values")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {name}.{close[0]}?)" if close else ""
            problems.append(
                f"{where}: unknown key {name}.{cut(str(key))}{hint}; allowed: "
                f"{', '.join(names)}"
            )
            continue
        accepted = allowed_types(hints[key])
        ok, coerced = coerce(value, accepted)
        if not ok:
            problems.append(
                f"{where}: {name}.{key} = {show(value)}: must be {type_name(accepted)}"
                f"{decimal_hint(value)}"
            )
            continue
        values[key] = coerced
    section = cls(**values)
    for key, value, message in section.problems():
        problems.append(f"{where}: {name}.{key} = {show(value)}: {message}")
    return section


def _build_curriculum(raw: Any, where: str, problems: list[str]) -> list[CurriculumStage]:
    """The curriculum's stages; problems go to ``problems``. Stages that have one are left
    out (and with none left, the default curriculum stands in: check nothing against it)."""
    shape = "a list of stages like [{until_step: 1000, seq_len: 32}, {seq_len: 64}]"
    if raw is None:
        raw = DEFAULT_CURRICULUM
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [{"seq_len": raw}]
    if not isinstance(raw, list) or not raw:
        problems.append(f"{where}: curriculum = {show(raw)}: must be {shape}")
        return [CurriculumStage(**s) for s in DEFAULT_CURRICULUM]
    stages: list[CurriculumStage] = []
    previous = 0
    for i, item in enumerate(raw):
        key = f"curriculum[{i}]"
        if not isinstance(item, dict) or "seq_len" not in item:
            problems.append(f"{where}: {key} = {show(item)}: must be "
                            "{seq_len: N[, until_step: S]}")
            continue
        unknown = set(item) - {"seq_len", "until_step"}
        if unknown:
            # str(): keys may mix types (1 and 'a'), which do not sort together.
            problems.append(f"{where}: unknown key {key}.{cut(sorted(map(str, unknown))[0])}; "
                            "allowed: seq_len, until_step")
        seq_len, until = item["seq_len"], item.get("until_step")
        if (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1
                or seq_len > INT64_MAX):
            problems.append(f"{where}: {key}.seq_len = {show(seq_len)}: must be an integer "
                            f">= 1 (at most {INT64_MAX}){decimal_hint(seq_len)}")
            continue
        last = i == len(raw) - 1
        if until is None and not last:
            problems.append(f"{where}: {key}.until_step is missing: every stage but the last "
                            "needs one")
            continue
        if until is not None:
            if (not isinstance(until, int) or isinstance(until, bool) or until <= previous
                    or until > INT64_MAX):
                problems.append(f"{where}: {key}.until_step = {show(until)}: must be an integer "
                                f"> {previous} (stages run in order; at most {INT64_MAX})"
                                f"{decimal_hint(until)}")
                continue
            previous = until
        stages.append(CurriculumStage(seq_len=seq_len, until_step=until))
    return stages or [CurriculumStage(**s) for s in DEFAULT_CURRICULUM]


def _cross_checks(cfg: Config, where: str, curriculum_ok: bool = True) -> list[str]:
    """Problems between keys of different sections. ``curriculum_ok``: the curriculum as
    written had no problem; otherwise it is only what was left of it (or the default), and
    a problem found in that would be about stages the user never wrote."""
    out = []
    stages = cfg.curriculum if curriculum_ok else []
    for i, stage in enumerate(stages):
        if stage.seq_len > cfg.model.max_rel_pos:
            out.append(f"{where}: curriculum[{i}].seq_len = {stage.seq_len}: must be <= "
                       f"model.max_rel_pos ({cfg.model.max_rel_pos})")
    lengths = {stage.seq_len for stage in stages}
    if cfg.train.context == "carry" and cfg.train.constant_tokens and len(lengths) > 1:
        out.append(f"{where}: train.context = carry with train.constant_tokens = true and "
                   f"curriculum lengths {sorted(lengths)}: carried streams keep one batch "
                   "size (train.batch_size), so set train.constant_tokens: false")
    if cfg.train.min_lr > cfg.train.lr:
        out.append(f"{where}: train.min_lr = {cfg.train.min_lr}: must be <= train.lr "
                   f"({cfg.train.lr})")
    lr, weight_decay = cfg.train.lr, cfg.train.weight_decay
    decay = lr * weight_decay if math.isfinite(lr) and math.isfinite(weight_decay) else 0
    if decay >= 1:  # (a NaN or infinity has its own line already)
        # AdamW scales every decayed matrix by (1 - lr x weight_decay) each step (the peak
        # lr; the schedule never goes above it): at 1 the weights are zeroed, above it
        # their sign flips and they grow, and the run ends on a NaN loss blamed on the lr.
        out.append(f"{where}: train.lr = {lr} and train.weight_decay = {weight_decay}: "
                   f"their product ({decay:g}) must be < 1 (AdamW multiplies the weights "
                   "by 1 - lr x weight_decay each step); lower train.weight_decay (usually "
                   "0 to 0.1) or train.lr")
    device = cfg.run.device
    if not (device in ("auto", "cpu", "cuda") or
            (device.startswith("cuda:") and device[5:].isdigit())):
        out.append(f"{where}: run.device = {show(device)}: must be auto, cpu, cuda or cuda:N")
    if cfg.data.dataset == "algorithmic":
        # The programs are generated: a file or address given as well would go unread.
        for key in ("path", "url"):
            value = getattr(cfg.data, key)
            if value is not None:
                out.append(f"{where}: data.{key} = {show(value)}: does not apply to "
                           "data.dataset = algorithmic (its programs are generated from "
                           "data.seed); remove the key, or name another dataset")
    return out


def config_from_dict(raw: Any, where: str = "<config>") -> Config:
    """Build and check a :class:`Config` from a nested dict; raise ConfigError listing all."""
    problems: list[str] = []
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: the top level must be a mapping of sections, "
                           f"got {type(raw).__name__}"])
    allowed = [*SECTIONS, "curriculum"]
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{where}: unknown section {cut(str(key))}{hint}; allowed: "
                            f"{', '.join(allowed)}")
    sections, sized = {}, True  # sized: every key the memory estimate reads is valid
    for name, cls in SECTIONS.items():
        before = len(problems)
        sections[name] = _build_section(cls, raw.get(name), name, where, problems)
        sized = sized and (name not in ("model", "train") or len(problems) == before)
    before = len(problems)
    curriculum = _build_curriculum(raw.get("curriculum"), where, problems)
    curriculum_ok = len(problems) == before
    cfg = Config(curriculum=curriculum, **sections)
    problems += _cross_checks(cfg, where, curriculum_ok)
    if sized and curriculum_ok:
        too_big = memory_problem(cfg)
        if too_big:
            problems.append(f"{where}: {too_big}")
    if problems:
        raise ConfigError(problems)
    return cfg
