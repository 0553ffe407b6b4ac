"""Checkpoint files: atomic save, safe load, latest/best lookup, keep-last-N.

A checkpoint is one ``torch.save`` file holding a plain dict (model, optimizer, progress,
config, vocabulary, RNG states, ...: see :mod:`.state`) plus a ``format`` marker. It is
always loaded with ``weights_only=True``, so opening a checkpoint can never run code;
everything put into one must therefore be tensors, numbers, strings, bytes, None and
lists/tuples/dicts of those.

A run directory keeps its checkpoints in ``<run>/checkpoints/``::

    last.pt               the newest state (what ``--resume`` picks up)
    best.pt               the state with the best validation loss so far
    step-00001000.pt      numbered snapshots; only the newest ``keep_last`` are kept
"""

from __future__ import annotations

import pickle
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fbtrain.errors import UserError
from fbtrain.io import atomic_write
from fbtrain.messages import first_line
from fbtrain.rundir_names import BEST, CHECKPOINT_DIR, LAST, numbered_step, step_name

FORMAT = "fbtrain-checkpoint-v2"
# Formats still read: checkpoint.state.upgrade turns their layout into today's.
OLDER_FORMATS = ("fbtrain-checkpoint-v1",)


class CheckpointError(UserError):
    """A checkpoint cannot be found or read; the message is one user-facing line."""


# ----------------------------------------------------------------------------- save / load


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plus the format marker) to ``path`` atomically.

    The file appears complete or not at all: ``torch.save`` goes to a temp file in the same
    folder, which is fsynced and then renamed over ``path``. The caller's dict is not changed.
    """
    data = {**payload, "format": FORMAT}
    atomic_write(Path(path), lambda f: torch.save(data, f))


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (``weights_only``: runs no code).

    Every failure (missing, truncated, corrupt, not a torch file, not an fbtrain checkpoint,
    holding objects that would need code to rebuild) is a :class:`CheckpointError` that names
    the path and the problem, never a traceback.
    """
    path = Path(path)
    # Open it ourselves first: errors from here on are about the file's contents (torch's
    # reader even raises OSError for some truncated archives), errors here about access.
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file not found") from None
    except IsADirectoryError:
        raise CheckpointError(
            f"{path}: is a directory, not a checkpoint file (pass a checkpoint file, "
            "or resolve a run directory with resolve_checkpoint)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from None
    if not head:
        raise CheckpointError(f"{path}: checkpoint file is empty (was the save interrupted?)")
    try:
        with warnings.catch_warnings():
            # Harmless notice for pickles written with a newer protocol; not for users.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            data = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for bad files; all mean "unreadable".
        raise CheckpointError(f"{path}: {_why_unreadable(path, head, e)}") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path}: not an fbtrain checkpoint (holds a {type(data).__name__}, not a dict)"
        )
    if "format" not in data:
        raise CheckpointError(f"{path}: not an fbtrain checkpoint (no 'format' key)")
    if data["format"] not in (FORMAT, *OLDER_FORMATS):
        raise CheckpointError(
            f"{path}: unsupported checkpoint format {data['format']!r} "
            f"(this version of fbtrain reads {FORMAT!r})"
        )
    return data


def peek_checkpoint(path: Path) -> dict[str, Any] | None:
    """A checkpoint's entries read cheaply (memory-mapped: the tensors are not read), for
    its ``step`` and ``run_id``; None when it cannot be read that way (then
    :func:`load_checkpoint` says why, if it matters)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # unreadable in any way: not this function's to explain
        return None
    return data if isinstance(data, dict) and "format" in data else None


def _why_unreadable(path: Path, head: bytes, error: Exception) -> str:
    """Turn whatever torch.load raised into a short explanation, judged from the file's bytes."""
    if path.suffix.lower() in (".yaml", ".yml"):
        run = path.parent if (path.parent / CHECKPOINT_DIR).is_dir() else None
        return ("this looks like a config, not a checkpoint: train with it by `fbtrain train "
                f"--config {path}`" + (f"; its run's model: --checkpoint {run}" if run else ""))
    if isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error):
        if not zipfile.is_zipfile(path):
            return "not a PyTorch checkpoint file (a plain pickle or some other format)"
        # torch names what it refused: a class ("Unsupported global: GLOBAL pkg.Class was
        # not an allowed global"), a function a __reduce__ payload would call ("unsupported
        # GLOBAL posix.system whose module posix is blocked", "call reduce for unrecognized
        # function ..."). Both are the same danger and get the same words; any other
        # complaint (an unknown opcode) means damaged bytes.
        found = re.search(r"GLOBAL ([\w.]+)|reduce for unrecognized function (\S+)",
                          str(error))
        if found:
            return (
                f"refusing to load: it holds a {found.group(1) or found.group(2)} object, "
                "and unpickling anything but tensors and plain containers could run code"
            )
        detail = re.search(r"Unsupported \w+ [^\n]*", str(error))
        return "checkpoint file is corrupt (unreadable pickle data" + (
            f": {detail.group(0)[:80]})" if detail else ")"
        )
    # torch.save writes a zip archive; a zip header without a readable archive is a file
    # cut short (or damaged), anything else is some other kind of file.
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return "checkpoint file is truncated or corrupt (incomplete zip archive)"
        # torch's reader appends paragraphs of advice; its first sentence is the diagnosis.
        first = first_line(error).split(". ")[0]
        return f"checkpoint file is truncated or corrupt ({first[:100]})"
    return "not a PyTorch checkpoint file (unrecognized format, truncated or corrupt)"


# ----------------------------------------------------------------------------- lookup


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """Find the checkpoint file meant by ``path``.

    - a file: returned as is;
    - a run directory ``runs/<name>/`` or its ``checkpoints/`` folder: ``best.pt`` when
      ``prefer == "best"`` and it exists, else ``last.pt``.

    Raises :class:`CheckpointError` listing what was looked for when nothing is there.
    """
    if prefer not in ("best", "last"):
        raise ValueError(f"prefer must be 'best' or 'last', got {prefer!r}")
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        around = _runs_in(path.parent)
        raise CheckpointError(
            f"{path}: no such checkpoint file or run directory"
            + (f" ({path.parent} holds {around})" if around else "")
            + "; a run directory is made by training: `fbtrain train --config FILE` writes "
            "runs/<run.name> (`make train`: runs/tiny_shakespeare)")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint file or run directory")
    names = [BEST, LAST] if prefer == "best" else [LAST]
    inside = path / CHECKPOINT_DIR
    # A run directory's checkpoints are in checkpoints/; a folder of .pt files works too.
    for folder in (inside, path) if path.name != CHECKPOINT_DIR else (path,):
        for candidate in (folder / name for name in names):
            if candidate.is_file():
                return candidate
    runs = _runs_in(path)
    if runs and not inside.is_dir():
        raise CheckpointError(f"{path}: a folder of runs, not a run; give one of them: {runs}")
    folder = path if path.name == CHECKPOINT_DIR else inside
    looked = ", ".join(str(folder / name) for name in names)
    raise CheckpointError(f"{path}: no checkpoint found (looked for {looked}); a run saves "
                          "one every checkpoint.every steps, at each evaluation and when "
                          "stopped")


def _runs_in(folder: Path, shown: int = 5) -> str:
    """The run directories in ``folder`` (those with a ``checkpoints/``), listed as
    paths: ``runs/quick, runs/tiny_shakespeare``; "" when there are none."""
    try:
        runs = sorted(d for d in folder.iterdir() if (d / CHECKPOINT_DIR).is_dir())
    except OSError:
        return ""
    listed = ", ".join(str(d) for d in runs[:shown])
    return listed + (f" and {len(runs) - shown} more" if len(runs) > shown else "")


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Writes ``last.pt``, ``best.pt`` and numbered snapshots of one run; purges old ones.

    Only one process (rank 0) should save into a run directory at a time.
    """

    def __init__(self, run_dir: Path, keep_last: int,
                 write: Callable[[Path, dict[str, Any]], None] | None = None):
        """``write(path, payload)`` writes one checkpoint file (:func:`save_checkpoint`
        unless given: a harness whose tensors cannot be serialized passes its own)."""
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINT_DIR
        self.keep_last = keep_last
        self.write = write or save_checkpoint

    @property
    def last_path(self) -> Path:
        return self.dir / LAST

    @property
    def best_path(self) -> Path:
        return self.dir / BEST

    def step_path(self, step: int) -> Path:
        return self.dir / step_name(step)

    def entries(self) -> list[Path]:
        """What ``checkpoints/`` holds under a checkpoint's name (``last.pt``, ``best.pt``,
        ``step-N.pt``), whatever each is: a file, a dangling or looping link, a folder.
        The newest first as far as names tell: ``last.pt``, the numbered steps from the
        highest, ``best.pt`` (whose step only its contents say)."""
        if not self.dir.is_dir():
            return []
        names = {p.name: p for p in self.dir.iterdir()}
        steps = sorted((n, p) for name, p in names.items()
                       if (n := numbered_step(name)) is not None)
        return ([names[LAST]] if LAST in names else []) + [p for _, p in reversed(steps)] \
            + ([names[BEST]] if BEST in names else [])

    def numbered(self) -> list[Path]:
        """Numbered snapshots present on disk, oldest step first."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            n = numbered_step(p.name)
            if n is not None and p.is_file():
                found.append((n, p))
        return [p for _, p in sorted(found)]

    def save(
        self, step: int, payload: dict[str, Any], *, numbered: bool = True, best: bool = False
    ) -> Path:
        """Save ``payload`` as ``last.pt`` and, as asked, ``step-N.pt`` and ``best.pt``.

        Serializes once, then copies: each copy goes through its own temp file and rename,
        so every file is complete at every instant. ``last.pt`` is written first, so after a
        crash part-way it is never older than a numbered snapshot. Returns the path of the
        numbered file when one was written, else ``last.pt``.
        """
        self.write(self.last_path, payload)
        written = self.last_path
        if numbered:
            written = self.step_path(step)
            atomic_copy(self.last_path, written)
        if best:
            atomic_copy(self.last_path, self.best_path)
        self.purge(keep=written)
        return written

    def purge(self, keep: Path | None = None) -> list[Path]:
        """Delete numbered snapshots beyond the newest ``keep_last`` (by step number).

        ``last.pt`` and ``best.pt`` are never touched, nor ``keep`` (the file just written:
        after resuming from an older snapshot, stale higher-numbered files from the abandoned
        run must not push out the new one). Returns the deleted paths.
        """
        files = self.numbered()
        doomed = files[: max(0, len(files) - self.keep_last)]
        removed = []
        for p in doomed:
            if keep is not None and p == keep:
                continue
            p.unlink(missing_ok=True)
            removed.append(p)
        return removed


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` over ``dst`` atomically (a temp file beside it, then a rename)."""
    with open(src, "rb") as source:
        atomic_write(dst, lambda f: shutil.copyfileobj(source, f, 1 << 20))
