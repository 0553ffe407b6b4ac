"""Typed, self-checking configuration: defaults < YAML file < ``--set section.key=value``.

Every section is a dataclass whose fields carry their help text and allowed values in
``metadata`` (schema.py); :func:`load_config` (load.py) maps YAML key for key onto them and
the validation report (validate.py) gives *every* problem at once as one line each (file,
key, value, what is allowed) in a :class:`ConfigError`. The CLI turns that into exit code 2.
budget.py refuses a config whose training cannot fit in memory.

The bottom layer: imports nothing of fbtrain but fbtrain.io. curriculum.py holds the
curriculum's arithmetic, which the memory estimate plans with. The names below are
re-exported for the code outside the package; inside it, modules import from the module
that owns a name.
"""

from fbtrain.config.errors import ConfigError
from fbtrain.config.fields import INT64_MAX
from fbtrain.config.load import load_config, save_config
from fbtrain.config.schema import (
    MAX_VAL_FRACTION,
    MODEL_KINDS,
    CheckpointConfig,
    CurriculumStage,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from fbtrain.config.tree import SECTIONS, Config
from fbtrain.config.validate import config_from_dict

__all__ = [
    "INT64_MAX", "MAX_VAL_FRACTION", "MODEL_KINDS", "SECTIONS", "CheckpointConfig", "Config",
    "ConfigError", "CurriculumStage", "DataConfig", "LoggingConfig", "ModelConfig",
    "RunConfig", "TrainConfig", "config_from_dict", "load_config",
    "save_config",
]
