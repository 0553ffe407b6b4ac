"""One process per run directory: an advisory lock, and the clean-up only its owner may do.

Two ``fbtrain train`` processes writing one run directory would interleave ``last.pt``,
``best.pt``, numbered checkpoints and ``metrics.jsonl``. The owner holds ``fcntl.flock`` on
``<run>/.lock`` (which also records its process id, for the message the next one gets); the
kernel drops the lock when the process ends however it ends, so a kill -9 never leaves a
stale lock behind. Holding the lock also proves that no other writer is alive, so temp files
found then are leftovers of a killed save and are removed.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from fbtrain.checkpoint import CHECKPOINT_DIR
from fbtrain.config import ConfigError
from fbtrain.io import remove_stale_temps

LOCK_NAME = ".lock"


class RunDirLock:
    """``with RunDirLock(run_dir):`` owns ``run_dir`` for the block, if it exists yet.

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
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_NAME

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (the directory must exist), then remove stale temp files."""
        if not self.enabled or self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise ConfigError([
                f"run directory {self.run_dir} is in use by another fbtrain process "
                f"({'pid ' + holder if holder else 'pid unknown'}); wait for it to finish or "
                "stop it, or train under another run.name (--set run.name=NEW)"
            ]) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        for folder in (self.run_dir, self.run_dir / CHECKPOINT_DIR):
            self.removed += remove_stale_temps(folder)

    def release(self) -> None:
        """Let go (closing the descriptor drops the flock). The file stays: deleting it
        could let a third process lock a new file while a second waits on the old one."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        if self.run_dir.is_dir():
            self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    """The process id the holder wrote ('' if it has not yet, or the file is odd)."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return text if text.isdigit() else ""
