"""A resume from an earlier checkpoint of the run itself starts a new branch.

``--resume runs/x/checkpoints/step-00000010.pt`` in a run that went on to step 30: the files
of steps 11-30 belong to the branch being abandoned. Left in place they would be taken for
this branch's - a ``best.pt`` of step 30 that the new branch's step 12 then replaces (judged
against the best of steps 1-10, which the resumed checkpoint carries), a ``step-00000030.pt``
that ``--resume auto`` or ``keep_last`` would count as the newest - and deleted they would
be lost. So they are moved aside, whole, into ``checkpoints/abandoned-from-step-00000010/``
(with a copy of ``metrics.jsonl``, whose lines after step 10 the new branch drops), and
``last.pt`` becomes the checkpoint resumed, so that an interrupted new branch resumes as
itself. One line says what moved where.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fbtrain.checkpoint.files import (
    CheckpointError,
    CheckpointManager,
    atomic_copy,
    load_checkpoint,
)
from fbtrain.io import atomic_write
from fbtrain.rundir_names import ABANDONED, METRICS, numbered_step


def set_aside_abandoned(manager: CheckpointManager, resumed: Path, step: int) -> str | None:
    """Move the checkpoints of steps after ``step`` out of ``manager``'s folder (see the
    module docstring); the line that says so, or None when there were none. Call on rank 0,
    with the run directory's lock held, once the resumed checkpoint was restored."""
    newer = {p.name: p.name for p in manager.numbered()
             if (numbered_step(p.name) or 0) > step}  # numbered(): each name has one
    for special in (manager.last_path, manager.best_path):
        if special.is_file() and not _same_file(special, resumed):
            saved_at = _step_of(special)
            if saved_at > step:
                newer[special.name] = f"{special.name} (step {saved_at})"
            elif saved_at < 0:  # perhaps newer (no read permission): a save would replace it
                newer[special.name] = f"{special.name} (which cannot be read)"
    if not newer:
        return None
    folder = _free_folder(manager.dir / f"{ABANDONED}{step:08d}")
    folder.mkdir()
    moved = list(newer.values())
    metrics = manager.run_dir / METRICS
    # First: killed during the moves, the rewind run again finds nothing left to move and
    # copies nothing, and the new branch then drops these lines from metrics.jsonl.
    if metrics.is_file():
        atomic_copy(metrics, folder / metrics.name)
        moved.append(f"a copy of {metrics.name}")
    for name in newer:
        os.replace(manager.dir / name, folder / name)
    # last.pt is the branch's newest state: until its first save, the checkpoint resumed.
    with open(resumed, "rb") as source:
        atomic_write(manager.last_path, lambda f: shutil.copyfileobj(source, f, 1 << 20))
    return (f"rewound to step {step}: the abandoned branch's {', '.join(moved)} moved to "
            f"{folder}; last.pt is now the checkpoint resumed")


def _step_of(path: Path) -> int:
    """The step a checkpoint was written at (-1 when it cannot be read)."""
    try:
        step = load_checkpoint(path).get("step")
    except CheckpointError:
        return -1
    return step if isinstance(step, int) else -1


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _free_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... when an earlier rewind to the same step
    left it."""
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
