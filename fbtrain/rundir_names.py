"""The names of the files in a run directory, spelled once.

A low module with no imports of fbtrain's own, so every layer may use it (the run
directory's lock, the config and vocabulary writers, the metrics logger, checkpoints,
the rewind of a resume) without an import cycle::

    runs/<name>/
      config.yaml  vocab.json  metrics.jsonl  history.jsonl  .lock
      checkpoints/  last.pt  best.pt  step-00000250.pt ...  abandoned-from-step-N/
"""

from __future__ import annotations

import re

CONFIG = "config.yaml"  # the resolved config
VOCAB = "vocab.json"  # the vocabulary (also in an export folder)
METRICS = "metrics.jsonl"  # one JSON object per log step
HISTORY = "history.jsonl"  # one JSON object per training segment (fbtrain.rundir.history)
LOCK = ".lock"  # held by the training process (its pid inside)
CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"  # the newest state
BEST = "best.pt"  # the best validation loss so far
ABANDONED = "abandoned-from-step-"  # + the step: where a rewind sets a branch aside
_NUMBERED = re.compile(r"^step-(\d+)\.pt$")


def step_name(step: int) -> str:
    """The numbered checkpoint's file name: ``step-00001000.pt``."""
    return f"step-{step:08d}.pt"


def numbered_step(name: str) -> int | None:
    """The step in a numbered checkpoint's file name, None when ``name`` is not one."""
    m = _NUMBERED.match(name)
    return int(m.group(1)) if m else None
