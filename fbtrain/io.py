"""Atomic file writes (a temp file beside the target, fsync, then ``os.replace``), JSON
that strict readers accept, and opening a file for reading only when it is a regular one.

A process killed at any point leaves either the old file or the new one, never half.
The file gets the mode a plain ``open(path, "w")`` would give it (0666 less the umask), not
the 0600 of the temp file it starts as.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

# Temp files atomic_write makes: ".<name>.<8 random characters>.tmp" (tempfile.mkstemp).
_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# Errors of the file system itself; others (a network error while streaming a download into
# the file, say) say what they are about and pass through unchanged.
_FILE_SYSTEM = (*_DISK_FULL, errno.EIO, errno.EROFS)
# Linux (4.7+) reports the umask here, so it can be read without changing it.
_PROC_STATUS = "/proc/self/status"


class FileWriteError(OSError):
    """Writing ``filename`` failed; ``str()`` is one user-facing line that names the file.

    A full disk reads "<file>: cannot write: the disk is full (no space left on device)"
    rather than torch's "[enforce fail at inline_container.cc] unexpected pos" or a bare
    "[Errno 28] No space left on device" that names no file.
    """

    def __str__(self) -> str:
        if self.errno in _DISK_FULL:
            reason = "the disk is full (no space left on device)"
        else:
            reason = (self.strerror or "write failed").lower()
        return f"{self.filename}: cannot write: {reason}{_ADVICE.get(self.errno, '')}"


# What to do, for the errors of a folder or file the user can fix.
_ADVICE = {
    errno.EPERM: " (an attribute forbids it: see lsattr -d on the file and its folder; "
                 "chattr -i lifts an immutable one)",
    errno.EACCES: " (no permission: see ls -ld on the file and its folder; chmod u+w)",
    errno.EISDIR: " (a folder is in its place: move it away)",
    errno.ENOTDIR: " (a file is in its place: move it away)",
    errno.ENAMETOOLONG: " (the path is longer than the system allows: use a shorter one)",
}


def _about(path: Path, error: OSError) -> FileWriteError:
    """An error of the temp file's creation or rename (so of the file system, whatever
    its errno) as a FileWriteError about the real file ``path``: the temp file's own name
    (".last.pt.cueq0wj9.tmp") would tell the user nothing."""
    return write_error(path, error) or FileWriteError(error.errno, error.strerror or str(error),
                                                      str(path))


def write_error(path: str | Path, error: BaseException) -> FileWriteError | None:
    """The file-system error behind ``error`` (a full disk, an I/O error, a read-only file
    system: ``error`` itself or one it was raised from), as a :class:`FileWriteError` about
    ``path``; None when there is none in the chain."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, FileWriteError):
            return seen
        if isinstance(seen, OSError) and seen.errno in _FILE_SYSTEM:
            return FileWriteError(seen.errno, seen.strerror or str(seen), str(path))
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def writing(name: str) -> Iterator[None]:
    """Writes to a stream the user pointed somewhere (``name``: "stdout"), whose
    file-system failure (``> /dev/full``, a log on a full disk) becomes one line naming it;
    a closed pipe (EPIPE: the reader left) and anything else go through as they are."""
    try:
        yield
    except OSError as e:
        failed = write_error(name, e)
        if failed is None:
            raise
        raise failed from None


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temp file in ``path``'s folder, fsync it and move it into place.

    On any failure the temp file is removed and ``path`` keeps its old content; a failure
    of the file system (a full disk, say, even when torch wraps it in a RuntimeError) is
    raised as a one-line :class:`FileWriteError` naming ``path``, anything else as it is.
    """
    path = Path(path)
    tmp = write_temp(path, write)
    try:
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _about(path, e) from None
        raise
    fsync_dir(path.parent)


def write_temp(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """The first half of :func:`atomic_write`: ``write(f)`` on a new temp file beside
    ``path`` (a name :func:`remove_stale_temps` knows), fsynced, with the mode ``open()``
    would give; returns it for the caller to ``os.replace`` onto ``path`` (several files
    written first and moved into place together). Failures as in :func:`atomic_write`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # a full disk or read-only folder: one line about the target
        raise _about(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            _set_default_mode(f.fileno())
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        failed = write_error(path, e) if isinstance(e, Exception) else None
        if failed is not None:
            raise failed from None
        raise
    return Path(tmp)


def _set_default_mode(fd: int) -> None:
    """Give the open temp file ``fd`` the mode ``open()`` would have: 0666 less the umask.

    mkstemp makes it 0600 whatever the umask, but a run's config, vocabulary and
    checkpoints should be as readable as any file the user creates (a colleague sampling
    from a shared run). Best effort: a file system that keeps no modes may refuse, and the
    file then stays private, which is safe.
    """
    if not hasattr(os, "fchmod"):  # not on every platform (Windows before 3.13)
        return
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask (e.g. 0o022), read without changing it where the OS allows.

    ``os.umask`` can only be read by setting it, and while it is set to something else a
    file created by another thread would get the wrong mode; so Linux's
    ``/proc/self/status`` comes first, and setting it back at once is the fallback.
    """
    try:
        with open(_PROC_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o777
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # the most private value, for the instant it is set
    os.umask(mask)
    return mask


def remove_stale_temps(folder: str | Path, names: tuple[str, ...] | None = None
                       ) -> list[Path]:
    """Delete the temp files :func:`atomic_write` left in ``folder`` when its process was
    killed mid-write (SIGKILL, power loss); returns them. ``names``: only the temps of
    these files. Only for a folder whose writer is known to be gone (the caller holds the
    folder's lock)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in sorted(folder.iterdir()):
        ours = names is None or any(p.name.startswith(f".{name}.") for name in names)
        if ours and _TEMP.match(p.name) and p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write` of ``text`` as UTF-8."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def fsync_dir(folder: Path) -> None:
    """Make the renames in ``folder`` durable (best effort: not every platform can open a
    directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float (in nested dicts, lists, tuples) as None.

    ``json.dumps`` writes those as ``NaN`` / ``Infinity``, which are not JSON: a strict
    parser (``jq``, JavaScript's ``JSON.parse``) rejects the whole object. ``null`` says
    "no figure" in a form every parser reads; a diverged model's loss is one such case.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"))


class NotRegularFileError(OSError):
    """A path read as a file is something else; ``kind`` says what ("a character device")."""

    def __init__(self, path: str | Path, kind: str):
        super().__init__(errno.EINVAL, f"is {kind}, not a regular file", str(path))
        self.kind = kind


def open_regular(path: str | Path, *, pipes: bool = False) -> IO[bytes]:
    """``path`` opened for reading in binary, or :class:`NotRegularFileError` when it is not
    a regular file: ``/dev/zero`` or ``/dev/urandom`` would be read without end, a FIFO
    waits for a writer (unless ``pipes``). The check is made on the opened descriptor
    (opened non-blocking, so a FIFO does not wait), never on a name that could change
    between a look and a read.

    ``pipes``: a FIFO (``<(zcat text.gz)``, ``mkfifo``) is returned as it was opened, non-
    blocking and unbuffered: its reader decides whether to wait for a writer (a read that
    finds none returns b"") and bounds how much it reads.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if pipes and stat.S_ISFIFO(mode):
            return open(fd, "rb", buffering=0)  # the caller closes it (and with it fd)
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotRegularFileError(path, kind)
        os.set_blocking(fd, True)
        return open(fd, "rb")  # the caller closes it (and with it fd)
    except BaseException:
        os.close(fd)
        raise
