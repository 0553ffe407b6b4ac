"""The run directory, ``<run.out_dir>/<run.name>/``: who owns it, what it holds, where a run
starts there, and what each training segment leaves in it.

The trainer's whole surface is :class:`RunDirectory`::

    directory = RunDirectory(path, keep_last, owner=ctx.is_main)
    directory.open(folders)        # checked, created and locked (the owner)
    choice = directory.choose(resume)                  # where the run starts
    note = directory.set_aside(resumed_from, step)     # a rewind's abandoned branch
    directory.start_segment(cfg, tokenizer, segment, start_step=..., resumed_from=...)
    directory.close(wrote)         # released; a fresh start that wrote nothing leaves nothing

Its modules, one job each: :mod:`.lock` (one owner per directory), :mod:`.checks` (what a
save would fail on, refused before training), :mod:`.resume` (what the directory holds and
the checkpoint a run goes on from), :mod:`.history` (the run id and ``history.jsonl``),
:mod:`.rewind` (a resume from an earlier step moves the newer files aside). The files'
formats stay with their writers (:mod:`fbtrain.checkpoint`, :mod:`fbtrain.metrics`); the
file names (:mod:`fbtrain.rundir_names`) and the inter-process lock
(:mod:`fbtrain.filelock`) sit at the bottom of the import order, where every layer may use
them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fbtrain.checkpoint.files import CheckpointManager, save_checkpoint
from fbtrain.config import Config, save_config
from fbtrain.metrics.tensorboard import event_files
from fbtrain.rundir.checks import check_folders, check_path_length, check_writable
from fbtrain.rundir.history import Segment, record_segment
from fbtrain.rundir.lock import RunDirLock
from fbtrain.rundir.resume import ResumeChoice, choose_resume
from fbtrain.rundir.rewind import set_aside_abandoned
from fbtrain.rundir_names import CONFIG

__all__ = ["ResumeChoice", "RunDirectory", "Segment"]


class RunDirectory:
    """One run directory as a training process uses it, from :meth:`open` to :meth:`close`.

    ``checkpoints``: its checkpoint folder (:class:`~fbtrain.checkpoint.CheckpointManager`,
    which keeps ``keep_last`` numbered ones and writes through ``write_checkpoint``).
    ``owner``: whether this process writes it (False on DDP ranks other than 0, for which
    every method that writes or locks does nothing).
    """

    def __init__(self, path: str | Path, keep_last: int | None,
                 write_checkpoint: Callable[[Path, dict[str, Any]], None] = save_checkpoint,
                 *, owner: bool = True):
        self.path = Path(path)
        self.owner = owner
        self.checkpoints = CheckpointManager(self.path, keep_last, write_checkpoint)
        self.lock = RunDirLock(self.path, enabled=owner)

    @property
    def removed(self) -> list[Path]:
        """Temp files a killed save left, deleted when the lock was taken."""
        return self.lock.removed

    def open(self, folders: tuple[str, ...] = ()) -> None:
        """Check the path, create the directory and take its lock, then check that every file
        a save writes (and each of ``folders``, TensorBoard's) can be written: refused in one
        line before anything is trained. Every later decision is taken with the lock held."""
        if not self.owner:
            return
        check_path_length(self.path)  # before mkdir: its error would print it whole
        check_folders(self.path)
        self.lock.create_and_acquire()
        try:
            check_writable(self.path, folders)
        except BaseException:
            self.close(wrote=False)
            raise

    def choose(self, resume: str | None) -> ResumeChoice:
        """Where the run starts, decided from what the directory holds
        (:func:`~fbtrain.rundir.resume.choose_resume`)."""
        return choose_resume(resume, self.checkpoints)

    def set_aside(self, resumed_from: Path, step: int) -> str | None:
        """Move aside the checkpoints a resume from ``step`` abandons; the line that says
        so (:func:`~fbtrain.rundir.rewind.set_aside_abandoned`)."""
        if not self.owner:
            return None
        return set_aside_abandoned(self.checkpoints, resumed_from, step)

    def start_segment(self, cfg: Config, tokenizer: Any, segment: Segment, *,
                      start_step: int, resumed_from: Path | None) -> None:
        """What a training segment writes before its first step: ``config.yaml`` (resolved),
        ``vocab.json`` and its line in ``history.jsonl``. A new run (fresh, or from another
        run's checkpoint) also drops the TensorBoard events a start killed before its first
        checkpoint left: its curves are not this run's."""
        if not self.owner:
            return
        save_config(cfg, self.path / CONFIG)
        tokenizer.save(self.path)
        if segment.new_run:
            for events in event_files(self.path):
                events.unlink(missing_ok=True)
        record_segment(self.path, segment, start_step=start_step,
                       resumed_from=None if resumed_from is None else str(resumed_from),
                       config=cfg.to_dict())

    def close(self, wrote: bool) -> None:
        """Let the directory go; a fresh start that ``wrote`` nothing leaves no lock file or
        folder it created behind."""
        if not wrote:
            self.lock.remove_created()
        self.lock.release()
