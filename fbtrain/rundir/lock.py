"""One process per run directory: an advisory lock, and the clean-up only its owner may do.

Two ``fbtrain train`` processes writing one run directory would interleave ``last.pt``,
``best.pt``, numbered checkpoints and ``metrics.jsonl``. The owner holds ``fcntl.flock`` on
``<run>/.lock`` (which also records its process id, for the message the next one gets); the
kernel drops the lock when the process ends however it ends, so a kill -9 never leaves a
stale lock behind. Holding the lock also proves that no other writer is alive, so temp files
found then are leftovers of a killed save and are removed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from fbtrain.config import ConfigError
from fbtrain.filelock import LockHeld, PidLock, describe_holder
from fbtrain.io import FileWriteError, remove_stale_temps, write_error
from fbtrain.rundir_names import CHECKPOINT_DIR, LOCK


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
            if e.errno == errno.ENOENT:  # a file system that makes no folders (/proc, autofs)
                raise ConfigError([f"{_file_error(self.run_dir, e)}; use another "
                                   "run.out_dir"]) from None
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
            if e.errno == errno.ENOENT and self.path.is_symlink():  # the folder it names
                raise ConfigError([
                    f"{self.path} is a symbolic link to {os.readlink(self.path)}, where no "
                    "lock file can be created; move it away (fbtrain makes its own)"]) from None
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
