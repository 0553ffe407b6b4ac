"""What data a run trains and validates on, so that a resume on other data is refused.

A checkpoint's best-so-far (``best.pt``, ``best_val_loss``) is judged on one validation split.
Resumed with another ``data.path``, another ``data.val_fraction`` or a file whose text
changed, the validation split would be other text - with ``val_fraction`` raised, text the
model trained on - and the best-so-far would be compared across two different yardsticks,
in silence. :class:`DataIdentity` is a part of the checkpoint (see
:mod:`fbtrain.checkpoint.state`): it saves the ``data.*`` settings and a sha256 of the train
and val splits as the model reads them (token ids, inputs and targets), and on resume it
refuses data whose splits differ, naming the setting that changed.

Refused rather than resumed with the best-so-far started afresh: the metrics file, the
TensorBoard curves and ``best.pt`` of the run would then mix two datasets under one run
name. Continuing on other data on purpose is a warm start of a new run
(``train.init_from``), which keeps the two apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from fbtrain.config import DataConfig
from fbtrain.data.streams import Stream

# Settings that say where the data is kept, not what it is.
_WHERE = ("cache_dir",)
# The splits a training run reads.
SPLITS = ("train", "val")


def split_sha256(stream: Stream) -> str:
    """sha256 of a split's token ids, inputs then targets (their dtype's bytes)."""
    digest = hashlib.sha256()
    for part in stream:
        # .numpy() shares the memory (numpy comes with tensorboard, a dependency).
        digest.update(memoryview(part.detach().cpu().contiguous().numpy()).cast("B"))
    return digest.hexdigest()


class DataIdentity:
    """The ``data`` part of a checkpoint: ``{"settings": data.* but cache_dir, "sha256":
    {"train": ..., "val": ...}}``. Nothing to load back: the part only checks."""

    def __init__(self, data_cfg: DataConfig, splits: dict[str, Stream]):
        self.settings = self.settings_of(dataclasses.asdict(data_cfg))
        self.sha256 = {name: split_sha256(splits[name]) for name in SPLITS}

    @staticmethod
    def settings_of(data: dict[str, Any]) -> dict[str, Any]:
        """The ``data.*`` settings that say what the data is (a config's ``data`` section)."""
        return {k: v for k, v in data.items() if k not in _WHERE}

    def state_dict(self) -> dict[str, Any]:
        return {"settings": dict(self.settings), "sha256": dict(self.sha256)}

    def state_problem(self, state: Any) -> str:
        """'' when ``state`` (a checkpoint's) describes these splits; else one line naming
        what changed and how to proceed. A checkpoint without the digests (format v1) is
        compared on its settings alone, but for ``data.path``: without a digest a moved
        file cannot be told from another one."""
        if not isinstance(state, dict):
            return ""  # written before checkpoints described their data: nothing to compare
        saved = state.get("settings") if isinstance(state.get("settings"), dict) else {}
        digests = state.get("sha256")
        if isinstance(digests, dict) and digests == self.sha256:
            return ""  # the same splits (a moved file, another cache folder: fine)
        known = isinstance(digests, dict)
        changed = [f"data.{k} is {v!r}, but the checkpoint was trained with {saved[k]!r}"
                   for k, v in self.settings.items()
                   if k in saved and saved[k] != v and (known or k != "path")]
        if not changed and not known:
            return ""
        what = "; ".join(changed) or (
            f"the data ({self._source()}) holds other text than the checkpoint was trained "
            "on (the sha256 of its " + " and ".join(
                n for n in SPLITS if digests.get(n) != self.sha256[n]) + " split differs)")
        return (f"{what}; its validation loss and best.pt would be judged on other text. "
                "Resume with the checkpoint's data settings, or start a new run from its "
                "weights: --set train.init_from=<checkpoint> --set run.name=NEW")

    def unchecked_note(self, state: Any, path: Any) -> str | None:
        """The line a resume prints when checkpoint ``path``'s ``state`` (its ``data``
        entry) holds no digest of its splits (format v1): the data cannot be checked, only
        its settings (:meth:`state_problem` compared those); None when it can."""
        if isinstance(state, dict) and isinstance(state.get("sha256"), dict):
            return None
        return (f"{path}: this checkpoint (format v1) holds no digest of the data it was "
                f"trained on, so fbtrain cannot check that {self._source()} is that data; "
                "if it is not, its validation loss and best.pt are judged on other text")

    def load_state_dict(self, state: Any) -> None:
        """Nothing to restore: the data is the config's (checked by :meth:`state_problem`)."""

    def _source(self) -> str:
        path = self.settings.get("path")
        return f"data.path {path}" if path else f"data.dataset {self.settings.get('dataset')}"
