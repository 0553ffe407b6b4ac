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
from fbtrain.schedule import Curriculum


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

    # kept for train.py until the trainer split (the curriculum arithmetic is
    # fbtrain.schedule.Curriculum's; nothing else calls these)
    def seq_len_at(self, step: int) -> int:
        """See :meth:`fbtrain.schedule.Curriculum.seq_len_at`."""
        return Curriculum(self).seq_len_at(step)

    def stage_index_at(self, step: int) -> int:
        """See :meth:`fbtrain.schedule.Curriculum.stage_index_at`."""
        return Curriculum(self).stage_index_at(step)

    def batch_size_at(self, step: int) -> int:
        """See :meth:`fbtrain.schedule.Curriculum.batch_size_at`."""
        return Curriculum(self).batch_size_at(step)

    @property
    def max_seq_len(self) -> int:
        """See :attr:`fbtrain.schedule.Curriculum.max_seq_len`."""
        return Curriculum(self).max_seq_len


SECTIONS = {
    "run": RunConfig, "data": DataConfig, "model": ModelConfig, "train": TrainConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}
