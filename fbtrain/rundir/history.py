"""A run's identity and its past: ``runs/<name>/history.jsonl``, one line per training segment.

A run gets a ``run_id`` when it starts afresh (random, from the OS: it draws nothing from the
seeded streams), kept in every line of ``history.jsonl`` and in every checkpoint it saves
(the payload's ``run_id``). A checkpoint found in the run's ``checkpoints/`` whose
``run_id`` is another one was copied in from another run, and ``--resume`` refuses it
(:func:`fbtrain.rundir.resume.choose_resume`).

``config.yaml`` always holds the current settings; the history keeps the past. Each
segment (a fresh start, or a resume that trains) appends one line::

    {"run_id": "...", "start_step": 40, "resumed_from": "checkpoints/last.pt",
     "changed": {"train.lr": [0.003, 0.01]}, "started": "2026-12-03T07:40:00Z",
     "config": {...the resolved config of this segment...}}

``changed`` holds the settings that differ from the ones the resumed checkpoint was
trained with (old, new). The file is rewritten atomically, so it is never half a line.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fbtrain.io import atomic_write_text, json_safe
from fbtrain.rundir_names import HISTORY


@dataclass(frozen=True)
class Segment:
    """What the history records of the segment being trained, known once set-up chose
    where to start: the run's id, whether the history starts anew (the directory held no
    checkpoint), and the settings changed from the checkpoint's (key -> [old, new])."""

    run_id: str = ""
    new_run: bool = True
    changed: dict[str, list[Any]] = field(default_factory=dict)


def new_run_id() -> str:
    """A fresh run id: 16 hex digits from ``uuid4`` (os.urandom; no seeded stream moves)."""
    return uuid.uuid4().hex[:16]


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The segments recorded in ``run_dir``'s history, oldest first; lines that are not
    JSON objects are skipped, an unreadable or missing file is no history."""
    try:
        text = (run_dir / HISTORY).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def recorded_run_id(run_dir: Path) -> str | None:
    """The run id ``run_dir``'s history names (its newest segment's), None without one."""
    for entry in reversed(read_history(run_dir)):
        if isinstance(entry.get("run_id"), str) and entry["run_id"]:
            return entry["run_id"]
    return None


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """``{"train.lr": [old, new], ...}``: the dotted keys present in both configs (as
    ``Config.to_dict`` gives them) whose values differ. A key only one side has (a key
    added by a later fbtrain) is not a change the user made, so it is left out."""
    flat_old, flat_new = _flatten(old), _flatten(new)
    return {k: [flat_old[k], v] for k, v in flat_new.items()
            if k in flat_old and flat_old[k] != v}


def describe_changes(changed: dict[str, list[Any]], step: int) -> str:
    """The line a resume with changed settings prints (one entry per key)."""
    listed = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in changed.items())
    return (f"settings changed from what the checkpoint (step {step}) trained with: {listed} "
            f"(config.yaml now holds the new ones; history.jsonl keeps each segment's)")


def record_segment(run_dir: Path, segment: Segment, *, start_step: int,
                   resumed_from: str | None, config: dict[str, Any]) -> None:
    """Append ``segment``'s line to the history (a new run's history starts anew). Call as
    the run directory's owner."""
    entry = {"run_id": segment.run_id, "start_step": start_step,
             "resumed_from": resumed_from, "changed": segment.changed,
             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": config}
    line = json.dumps(json_safe(entry), default=str) + "\n"
    path = run_dir / HISTORY
    before = ""
    if not segment.new_run:
        with contextlib.suppress(FileNotFoundError):
            before = path.read_text(encoding="utf-8", errors="replace")
        if before and not before.endswith("\n"):
            before += "\n"
    atomic_write_text(path, before + line)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
