"""The whole config: :class:`Config` holds one instance of every section and the
curriculum, and :data:`SECTIONS` names the sections as the YAML file does."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from fbtrain.config.schema import (
    DEFAULT_CURRICULUM,
    CheckpointConfig,
    CurriculumStage,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)


@dataclass
class Config:
    """Every section, under the name its YAML key has, and the curriculum's stages."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    curriculum: list[CurriculumStage] = field(
        default_factory=lambda: [CurriculumStage(**s) for s in DEFAULT_CURRICULUM]
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as the YAML file writes it (a stage's until_step left out when null)."""
        out = dataclasses.asdict(self)
        out["curriculum"] = [
            {k: v for k, v in s.items() if v is not None} for s in out["curriculum"]
        ]
        return out


SECTIONS = {
    "run": RunConfig, "data": DataConfig, "model": ModelConfig, "train": TrainConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}


def closest_keys(word: str) -> list[str]:
    """The config keys ``word`` most likely means, as ``section.key``: every key of that
    name (``max_steps`` -> train.max_steps; ``seed`` -> run.seed and data.seed), else the
    one closest to it (``steps`` -> train.max_steps, ``batch`` -> train.batch_size); []
    when none is close. Dashes read
    as underscores, so a flag's spelling (``--max-steps``) finds its key too."""
    name = word.strip().replace("-", "_")
    keys: dict[str, list[str]] = {"curriculum": ["curriculum"]}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            keys.setdefault(f.name, []).append(f"{section}.{f.name}")
    if name in keys:
        return keys[name]
    if name in SECTIONS:  # a section alone: no one key of it to guess
        return []
    # A key whose name holds the word (steps: max_steps, warmup_steps) before any other:
    # the closest of those, else the closest of all.
    holding = [key for key in keys if len(name) >= 3 and name in key]
    close = difflib.get_close_matches(name, holding, n=1, cutoff=0) if holding else \
        difflib.get_close_matches(name, keys, n=1)
    return keys[close[0]] if close else []
