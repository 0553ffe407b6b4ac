"""The one inter-process lock fbtrain uses: an ``fcntl.flock`` on a file that names its holder.

Three things must have one writer at a time: a run directory (``rundir.lock.RunDirLock``), a
download-cache entry (``data``'s cache lock) and the C++ core's build folder. Each holds a
:class:`PidLock`. An flock belongs to the open file, so the kernel drops it the moment its
holder dies, however it dies (kill -9, the OOM killer): there is never a stale lock to
clear. The file itself stays (deleting it could let a third process lock a new file while a
second one waits on the old) and holds the holder's process id, for the message a waiter
prints.

Waiting polls with short sleeps rather than blocking in the kernel, so Ctrl-C always ends a
wait with KeyboardInterrupt, and the waiting line can follow a change of holder.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows has no flock
    fcntl = None  # type: ignore[assignment]

POLL_S = 0.2  # between tries while another process holds the lock


class LockHeld(Exception):
    """The lock is held by another process (``holder``: its pid, '' when unknown)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by {describe_holder(holder)}")
        self.path, self.holder = path, holder


def describe_holder(holder: str) -> str:
    """'pid 123', or 'pid unknown' when the holder has not written its pid (yet)."""
    return f"pid {holder}" if holder else "pid unknown"


class PidLock:
    """``flock`` on ``path`` (created if need be), with this process's id written into it.

    :meth:`acquire` takes it, waiting up to ``wait`` seconds (0: not at all; None: for as
    long as it takes) and calling ``on_wait(holder)`` when it starts to wait and whenever
    the holder changes; past ``wait`` it raises :class:`LockHeld`. File-system errors
    (a full disk, a read-only folder) come through as OSError. ``supported`` is False where
    the platform or the file system has no flock; then :meth:`acquire` holds nothing.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.supported = fcntl is not None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait: float | None = 0,
                on_wait: Callable[[str], None] | None = None) -> PidLock:
        if self._fd is not None or not self.supported:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._take(fd, wait, on_wait)
            if not self.supported:
                os.close(fd)
                return self
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # also drops the flock, if it was taken
            raise
        self._fd = fd
        return self

    def _take(self, fd: int, wait: float | None,
              on_wait: Callable[[str], None] | None) -> None:
        give_up = None if wait is None else time.monotonic() + wait
        shown: str | None = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                holder = read_pid(fd)
            except OSError:  # a file system without flock (some network mounts)
                self.supported = False
                return
            if give_up is not None and time.monotonic() >= give_up:
                raise LockHeld(self.path, holder)
            if on_wait is not None and holder != shown:
                on_wait(holder)
                shown = holder
            time.sleep(POLL_S)

    def release(self, *, forget_pid: bool = False) -> None:
        """Let go (closing the descriptor drops the flock). ``forget_pid``: empty the file
        first, so a later waiter does not name a process that finished."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if forget_pid:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    def __enter__(self) -> PidLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def read_pid(fd: int) -> str:
    """The process id the holder wrote ('' if it has not yet, or the file is odd)."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return text if text.isdigit() else ""
