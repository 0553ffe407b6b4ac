"""One process per run directory: an advisory lock, and the clean-up only its owner may do.

Two ``fbtrain train`` processes writing one run directory would interleave ``last.pt``,
``best.pt``, numbered checkpoints and ``metrics.jsonl``. The owner holds ``fcntl.flock`` on
``<run>/.lock`` (which also records its process id, for the message the next one gets); the
kernel drops the lock when the process ends however it ends, so a kill -9 never leaves a
stale lock behind. Holding the lock also proves that no other writer is alive, so temp files
found then are leftovers of a killed save and are removed.

What the directory holds decides how a run may start there (:func:`choose_resume`): one
that holds a run's checkpoints or metrics is never a fresh start, and ``--resume auto``
continues from the newest checkpoint that loads, saying so when that is not ``last.pt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fbtrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    resolve_checkpoint,
)
from fbtrain.checkpoint.state import read_checkpoint, resumable_problem
from fbtrain.config import Config, ConfigError, save_config
from fbtrain.filelock import LockHeld, PidLock, describe_holder
from fbtrain.io import FileWriteError, remove_stale_temps, write_error
from fbtrain.metrics.tensorboard import event_files
from fbtrain.rundir_names import BEST, CHECKPOINT_DIR, CONFIG, LAST, LOCK, METRICS

_LISTED = 3  # checkpoints named in a refusal; more are counted


class RunDirLock:
    """Owns ``run_dir`` from :meth:`acquire` (or :meth:`create_and_acquire`) to :meth:`release`.

    :meth:`acquire` (idempotent) takes the lock once the directory exists (call it after
    creating the directory); a second process is refused with a :class:`ConfigError` naming
    the directory and the holder's process id. ``enabled=False`` (DDP ranks other than 0,
    which write nothing) makes every method a no-op. ``removed`` lists the stale temp files
    deleted when the lock was taken.
    """

    def __init__(self, run_dir: str | Path, *, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.removed: list[Path] = []
        self.created: list[Path] = []  # folders create_and_acquire made, deepest first
        self._lock = PidLock(self.run_dir / LOCK)

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK

    @property
    def held(self) -> bool:
        return self._lock.held

    def create_and_acquire(self) -> None:
        """Create the run directory (and its parents) if need be, then :meth:`acquire`.

        A file-system error (a full disk, a read-only folder) is one line naming the path;
        a lock file this call created is not left behind when it fails.
        """
        if not self.enabled:
            return
        missing = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _file_error(self.run_dir, e) from None
        self.created = missing
        try:
            self.acquire()
        except BaseException:
            self._remove_created_folders()  # refused or failed: leave nothing behind
            raise

    def acquire(self) -> None:
        """Take the lock (the directory must exist), then remove stale temp files."""
        if not self.enabled or self._lock.held:
            return
        existed = self.path.exists()
        try:
            self._lock.acquire(wait=0)
        except LockHeld as e:
            raise ConfigError([
                f"run directory {self.run_dir} is in use by another fbtrain process "
                f"({describe_holder(e.holder)}); wait for it to finish or stop it, or train "
                "under another run.name (--set run.name=NEW)"
            ]) from None
        except OSError as e:  # a full disk: no pid to record, and no lock to leave behind
            if not existed:
                self.path.unlink(missing_ok=True)
            raise _file_error(self.path, e) from None
        for folder in (self.run_dir, self.run_dir / CHECKPOINT_DIR):
            self.removed += remove_stale_temps(folder)

    def remove_created(self) -> None:
        """Undo :meth:`create_and_acquire` for a fresh start that failed before it wrote
        anything: the lock file and the folders it created go, as long as they hold
        nothing else. Only while the lock is held."""
        if not self._lock.held or not self.created:
            return
        if any(p.name != LOCK for p in self.run_dir.iterdir()):
            return
        self.path.unlink(missing_ok=True)
        self.release()
        self._remove_created_folders()

    def _remove_created_folders(self) -> None:
        for folder in self.created:  # deepest first; a folder something else uses stays
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = []

    def release(self) -> None:
        """Let go. The file stays (see :mod:`fbtrain.filelock`)."""
        self._lock.release()


def _file_error(path: Path, error: OSError) -> FileWriteError:
    """``error`` as one line naming ``path`` (a full disk says so in words)."""
    return write_error(path, error) or FileWriteError(error.errno, error.strerror or str(error),
                                                      str(path))


def write_run_files(run_dir: Path, cfg: Config, tokenizer: Any, *, fresh: bool) -> None:
    """``config.yaml`` (resolved) and ``vocab.json``; a fresh start also drops the
    TensorBoard events a run killed before its first checkpoint left: its curves are not
    this run's. Call as the directory's owner."""
    save_config(cfg, run_dir / CONFIG)
    tokenizer.save(run_dir)
    if fresh:
        for events in event_files(run_dir):
            events.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- what it holds


@dataclass(frozen=True)
class RunContents:
    """What a run directory holds of a run that trained there."""

    checkpoints: list[Path]  # CheckpointManager.entries(): readable or not, newest first
    metrics: Path | None  # metrics.jsonl, when it holds anything
    events: list[Path]  # TensorBoard event files

    @property
    def trained(self) -> bool:
        """Whether a run left its results here: a checkpoint (readable or not) or logged
        metrics. TensorBoard events alone are not: every figure goes to metrics.jsonl too,
        so events beside no metrics hold only what a writer puts there when it opens (the
        header, the chart layout) - a run that failed before its first figure."""
        return bool(self.checkpoints or self.metrics)

    def describe(self, run_dir: Path) -> str:
        """'checkpoints/best.pt, checkpoints/step-00000020.pt, metrics.jsonl and 3
        TensorBoard event files', say."""
        names = [str(p.relative_to(run_dir)) for p in self.checkpoints[:_LISTED]]
        if len(self.checkpoints) > _LISTED:
            names.append(f"{len(self.checkpoints) - _LISTED} more checkpoints")
        if self.metrics is not None:
            names.append(self.metrics.name)
        if self.events:
            names.append(f"{len(self.events)} TensorBoard event file"
                         f"{'s' if len(self.events) > 1 else ''}")
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def survey(manager: CheckpointManager) -> RunContents:
    """What ``manager``'s run directory holds. Refuses (ConfigError) a ``checkpoints``
    that is not a folder: every save would fail there, so say it before training."""
    folder = manager.dir
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise ConfigError([
            f"run directory {manager.run_dir}: {folder} is not a folder, so no checkpoint "
            "could be saved there; move it away (or train under another run.name, "
            "--set run.name=NEW)"])
    metrics = manager.run_dir / METRICS
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    return RunContents(checkpoints=manager.entries(), metrics=metrics if has_metrics else None,
                       events=event_files(manager.run_dir))


@dataclass(frozen=True)
class ResumeChoice:
    """Where a run starts: ``path`` and its loaded ``payload`` (None, None: afresh), and
    ``note``, a line to print when the choice is not the obvious one."""

    path: Path | None = None
    payload: dict[str, Any] | None = None
    note: str | None = None


def choose_resume(resume: str | None, manager: CheckpointManager) -> ResumeChoice:
    """The checkpoint to continue from, loaded, decided from what the directory holds.

    ``resume``: None starts afresh, refused when the directory already holds a run
    (:attr:`RunContents.trained`), naming what it holds; ``"auto"`` continues from the
    newest checkpoint that loads and passes the resume checks (``last.pt``, else the
    highest step among ``step-N.pt`` and ``best.pt``; refused when none does), and starts
    afresh only where no checkpoint was ever saved; anything else is a checkpoint file or
    run directory, refused when it belongs to another run and this directory holds
    checkpoints of its own. Call as the directory's owner.
    """
    run_dir = manager.run_dir
    held = survey(manager)
    if resume is None:
        if held.trained:
            raise ConfigError([
                f"run directory {run_dir} already holds a run ({held.describe(run_dir)}); "
                "continue it with --resume auto, or start anew under another run.name "
                "(--set run.name=NEW) or after deleting that folder"])
        return ResumeChoice()
    if resume == "auto":
        if not held.checkpoints:
            if held.metrics is None:
                return ResumeChoice()
            return ResumeChoice(note=f"no checkpoint in {run_dir} to resume from: starting "
                                "afresh (replacing the metrics and TensorBoard events of an "
                                "earlier start that saved none)")
        return _newest_loadable(run_dir, held.checkpoints)
    path = resolve_checkpoint(resume, prefer="last")
    if held.checkpoints and not path.resolve().is_relative_to(run_dir.resolve()):
        # Resuming writes last.pt, best.pt and metrics.jsonl here: another run's would
        # be overwritten. (A checkpoint of this run itself, say step-N.pt, is fine.)
        raise ConfigError([
            f"--resume {path} belongs to another run, but run directory {run_dir} "
            f"already holds its own checkpoints ({held.checkpoints[0].name}, ...); resume "
            f"into another run.name (--set run.name=NEW), or use --resume auto to continue "
            f"{run_dir.name}"
        ])
    return ResumeChoice(path, read_checkpoint(path))


def _newest_loadable(run_dir: Path, entries: list[Path]) -> ResumeChoice:
    """The checkpoint of the highest step among ``entries`` (newest first by name) that
    loads and passes the resume checks. ``best.pt`` only says its step once loaded, so it
    is loaded first when ``last.pt`` fails, and wins over every step-N.pt below it."""
    problems: list[str] = []

    def load(path: Path) -> dict[str, Any] | None:
        try:
            payload = read_checkpoint(path)
            problem = resumable_problem(payload)
            if problem:
                raise CheckpointError(f"{path}: cannot resume from it: {problem}")
        except CheckpointError as e:
            problems.append(str(e))
            return None
        return payload

    by_name = {p.name: p for p in entries}
    last = run_dir / CHECKPOINT_DIR / LAST
    if LAST not in by_name:
        problems.append(f"{last} is missing")
    elif (payload := load(last)) is not None:
        return ResumeChoice(last, payload)  # the usual case: nothing to say
    best = by_name.get(BEST)
    best_payload = load(best) if best is not None else None
    chosen = None
    for path in (p for p in entries if p.name not in (LAST, BEST)):  # highest step first
        if best_payload is not None and best_payload["step"] > _step_of(path):
            break
        if (payload := load(path)) is not None:
            chosen = (path, payload)
            break
    if chosen is None and best is not None and best_payload is not None:
        chosen = (best, best_payload)
    if chosen is None:
        afresh = "to start afresh, train under another run.name (--set run.name=NEW) or delete"
        if len(entries) == 1:
            raise CheckpointError(f"{problems[-1]}; {afresh} {run_dir}")
        raise CheckpointError(
            f"run directory {run_dir} holds checkpoints, but none can be resumed from "
            f"({'; '.join(problems)}); {afresh} that folder")
    path, payload = chosen
    return ResumeChoice(path, payload, note=(
        f"resuming from {path.name} (step {payload['step']}), the newest checkpoint that "
        f"loads: {'; '.join(problems)}"))


def _step_of(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])
