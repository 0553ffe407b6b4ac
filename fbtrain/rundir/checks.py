"""Checks that a run directory can take what training will write, made before training.

Every file a run writes (``last.pt``, ``best.pt``, ``metrics.jsonl``, ...) was found
wanting only at its first save, after the steps since the start were trained and then
lost: a folder where ``last.pt`` goes, a ``checkpoints/`` made immutable (``chattr +i``),
a path longer than the system allows. These checks say so at the start, in one line
naming the file and what to do (a :class:`~fbtrain.config.ConfigError`, exit code 2).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import tempfile
from pathlib import Path

from fbtrain.config import ConfigError
from fbtrain.rundir_names import (
    BEST,
    CHECKPOINT_DIR,
    CONFIG,
    HISTORY,
    LAST,
    METRICS,
    VOCAB,
    numbered_step,
)

# The longest name written below a run directory: TensorBoard's event files in val/
# ("events.out.tfevents.<time>.<host>.<pid>.<n>") and the temp files of checkpoints.
_LONGEST_INSIDE = 160
_FALLBACK_PATH_MAX, _FALLBACK_NAME_MAX = 4096, 255
# Linux's FS_IOC_GETFLAGS and the two attributes (chattr +i, +a) that refuse a rename over a
# file even to root.
_FS_IOC_GETFLAGS = 0x80086601
_IMMUTABLE, _APPEND_ONLY = 0x10, 0x20
_FIX = ("make it writable (chmod u+w; chattr -i for an immutable one) or train under "
        "another run.name (--set run.name=NEW)")


def check_path_length(run_dir: Path) -> None:
    """Refuse a run directory whose path (or one of whose names) is longer than the
    system allows, before any folder is made: mkdir's "[Errno 36] File name too long"
    would print the whole path, thousands of characters."""
    full = str(run_dir.absolute())
    path_max = _limit("PC_PATH_MAX", _FALLBACK_PATH_MAX)
    name_max = _limit("PC_NAME_MAX", _FALLBACK_NAME_MAX)
    for name in run_dir.parts:
        if len(name.encode()) > name_max:
            raise ConfigError([
                f"run directory: the folder name {_short(name)} is {len(name.encode())} bytes "
                f"long, more than the {name_max} a file name may have here (NAME_MAX); use a "
                "shorter run.out_dir or run.name"])
    if len(full.encode()) + _LONGEST_INSIDE >= path_max:
        raise ConfigError([
            f"run directory {_short(full)} is {len(full.encode())} bytes long; with the "
            f"files written inside it that exceeds the {path_max} bytes a path may have here "
            f"(PATH_MAX); use a run.out_dir and run.name under "
            f"{path_max - _LONGEST_INSIDE} bytes in all"])


def check_folders(run_dir: Path) -> None:
    """Refuse, before any folder is made, a run directory (or a folder above it) that is a
    file or a symbolic link to nowhere: mkdir's "[Errno 17] File exists" said neither."""
    for folder in reversed((run_dir, *run_dir.parents)):
        if folder.is_dir() or not (folder.exists() or folder.is_symlink()):
            continue
        if folder.is_symlink() and not folder.exists():
            target = os.readlink(folder)
            if _loops(folder):  # creating the target would not help: it is the link
                what = f"is a symbolic link to {target}, which leads back to itself; remove it"
            else:
                what = f"is a symbolic link to {target}, which does not exist; create {target}"
        else:
            what = "is a file, not a folder; move it away"
        where = "run directory" if folder == run_dir else f"run directory {run_dir}: the folder"
        raise ConfigError([f"{where} {folder} {what} (or train under another run.out_dir or "
                           "run.name)"])


def _loops(path: Path) -> bool:
    """Whether resolving the symbolic link ``path`` goes round in a loop (ELOOP)."""
    try:
        path.stat()
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def check_writable(run_dir: Path, folders: tuple[str, ...] = ()) -> None:
    """Refuse, before training, a run directory where a save would fail: one of the files
    a run writes is not a plain file (a folder named ``last.pt``), one of the ``folders``
    it writes into (TensorBoard's ``val``) is not a folder, a folder where no file can be
    created, or a file an attribute keeps from being replaced or appended to. Call as the
    directory's owner (it creates and removes a temp file in each folder)."""
    for name in folders:
        folder = run_dir / name
        if not folder.is_dir() and (folder.exists() or folder.is_symlink()):
            raise ConfigError([f"{folder} is not a folder, so the run could not write into it; "
                               "move it away (or train under another run.name, "
                               "--set run.name=NEW)"])
    ckpts = run_dir / CHECKPOINT_DIR
    names = [run_dir / n for n in (CONFIG, VOCAB, METRICS, HISTORY)]
    if ckpts.is_dir():  # a checkpoints that is not a folder: fbtrain.rundir.survey says so
        names += [ckpts / n for n in (LAST, BEST)]
        names += sorted(p for p in ckpts.iterdir() if numbered_step(p.name) is not None)
    for path in names:
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError([f"{path}: cannot be checked ({e.strerror}); {_FIX}"]) from None
        if stat.S_ISLNK(mode):
            continue  # a save replaces the link itself
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a plain file"
            raise ConfigError([
                f"{path} is {kind}, so the run could not save it; move it away (or train "
                "under another run.name, --set run.name=NEW)"])
        flags = _attributes(path)
        if flags & (_IMMUTABLE | _APPEND_ONLY):
            what = "immutable" if flags & _IMMUTABLE else "append-only"
            raise ConfigError([f"{path} is {what} (chattr), so the run could not replace it; "
                               f"{_FIX}"])
    for folder in (run_dir, ckpts):
        if folder.is_dir():
            _probe(folder)
    metrics = run_dir / METRICS
    if metrics.is_file():
        try:  # appended to: open it so (writes nothing)
            with open(metrics, "ab"):
                pass
        except OSError as e:
            raise ConfigError([f"{metrics}: cannot be written ({(e.strerror or '').lower()})"
                               f"; {_FIX}"]) from None


def _probe(folder: Path) -> None:
    """Create and remove a temp file in ``folder`` (named as atomic_write's are, so a kill
    in between leaves one the next start removes)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".write-check.", suffix=".tmp")
    except OSError as e:
        raise ConfigError([f"{folder}: no file can be created in it "
                           f"({(e.strerror or str(e)).lower()}); {_FIX}"]) from None
    os.close(fd)
    os.unlink(tmp)


def _attributes(path: Path) -> int:
    """The file's ext2-style attributes (chattr's), 0 where the file system has none."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            buf = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("l", 0))
            return struct.unpack("l", buf)[0]
        finally:
            os.close(fd)
    return 0


def _limit(name: str, fallback: int) -> int:
    try:
        return os.pathconf("/", name)
    except (OSError, ValueError):
        return fallback


def _short(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:40] + "..." + text[-20:])
