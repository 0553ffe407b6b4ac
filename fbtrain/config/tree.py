"""The whole config: :class:`Config` holds one instance of every section and the
curriculum, and :data:`SECTIONS` names the sections as the YAML file does."""

from __future__ import annotations

import dataclasses
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
