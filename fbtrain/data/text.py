"""The plain-text corpora: ``data.path``, or a download kept in the cache, as UTF-8 text.

A local file never touches the network; otherwise the text comes from ``data.url`` (null:
the dataset's usual address, :mod:`fbtrain.data.sources`), downloaded once into the cache
(:mod:`fbtrain.data.fetch`) and verified by sha256. A text that is not UTF-8, or empty, is
refused with a :class:`~fbtrain.data.errors.DataError` and never kept in the cache.
"""

from __future__ import annotations

import logging
import os
import select
import stat
from pathlib import Path
from typing import BinaryIO

from fbtrain.config import DataConfig
from fbtrain.config.budget import available_memory, format_bytes
from fbtrain.data.errors import DataError, one_line
from fbtrain.data.fetch import (
    OFFLINE_HINT,
    CacheLock,
    address,
    cache_entry,
    download,
    sha256_bytes,
)
from fbtrain.io import NotRegularFileError, open_regular
from fbtrain.progress import note

log = logging.getLogger(__name__)


BOM = "\ufeff"  # the UTF-8 byte-order mark, as decoded


def _decode(raw: bytes | bytearray, what: str, fix: str | None = None) -> str:
    """``raw`` as UTF-8 text without a leading byte-order mark; DataError "<what> is not
    valid UTF-8 / is empty; <fix>" (fix None: the advice for a local file)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} is not valid UTF-8 (byte {e.start}); "
                        f"{fix or 'convert it to UTF-8 text'}") from None
    # A byte-order mark (some editors write one) marks the encoding; it is not a character
    # of the text, and would otherwise become one of the vocabulary.
    text = text.removeprefix(BOM)
    if not text:
        raise DataError(f"{what} is empty; {fix or 'point it at a text file with content'}")
    return text


# Peak memory of reading and tokenizing a text (load_corpus), per byte of the file, as
# measured for an ASCII text (one character a byte: the most per byte; other scripts take
# less); the figures and the command that measured them: docs/datasets.md, "Memory".
# So a text this process could not hold is refused before a byte is read, not killed.
TEXT_MEMORY_PER_BYTE = 18


def read_local(path_str: str, memory_per_byte: int = TEXT_MEMORY_PER_BYTE) -> bytearray:
    """The bytes of ``data.path`` (never the network): a regular file only (``/dev/zero``
    would be read without end), and one whose ``memory_per_byte`` times its size fits the
    memory this process may use (:func:`fbtrain.config.budget.available_memory`: the
    machine's, ``ulimit -v``'s, the cgroup's); DataError naming the file otherwise."""
    path = Path(path_str).expanduser()
    try:
        with open_regular(path, pipes=True) as f:
            if stat.S_ISFIFO(os.fstat(f.fileno()).st_mode):  # <(zcat text.gz): size unknown
                return _read_pipe(f, path, memory_per_byte)
            size = os.fstat(f.fileno()).st_size
            _check_memory(path, size, memory_per_byte)
            raw = bytearray(size)
            del raw[f.readinto(raw):]  # a file cut short while read is read as it is
    except FileNotFoundError:
        raise DataError(f"data.path {path}: file not found; check the path") from None
    except NotRegularFileError as e:
        raise DataError(f"data.path {path} is {e.kind}, not a text file; point it at a text "
                        "file") from None
    except OSError as e:
        raise DataError(
            f"data.path {path}: cannot read it ({e.strerror or one_line(str(e))})"
        ) from None
    return raw


def _read_pipe(f: BinaryIO, path: Path, per_byte: int) -> bytearray:
    """All a pipe gives (``f``: opened non-blocking), up to what this process could
    tokenize; DataError past that. A named pipe no program writes to yet is waited for, and
    said so on stderr (it blocked before anything was printed)."""
    available = available_memory()
    limit = available.size // per_byte if available is not None else None
    first = f.read(_PIPE_CHUNK)  # None: a writer has it open, with nothing written yet;
    if first == b"":  # b"": no program has it open to write
        note(f"data.path {path} is a named pipe (FIFO) that no program writes to yet: "
             "waiting for one (Ctrl-C to stop)")
        # Readable once a writer has written (or come and gone): what it wrote stays in
        # the pipe for f, which held it open all along.
        select.select([f], [], [])
        first = f.read(_PIPE_CHUNK)
    os.set_blocking(f.fileno(), True)
    return _read_rest(f, bytearray(first or b""), path, per_byte, limit)


def _read_rest(f: BinaryIO, raw: bytearray, path: Path, per_byte: int, limit: int | None
               ) -> bytearray:
    """``raw`` and all that ``f`` still gives; DataError once that passes ``limit`` bytes."""
    while chunk := f.read(_PIPE_CHUNK):
        raw += chunk
        if limit is not None and len(raw) > limit:
            _check_memory(path, len(raw), per_byte)
    return raw


_PIPE_CHUNK = 1 << 20  # bytes read from a pipe at a time


def _check_memory(path: Path, size: int, per_byte: int) -> None:
    """DataError when a file of ``size`` bytes, at ``per_byte`` bytes of memory each,
    cannot fit in the memory this process may use (nothing is checked where the system
    does not say)."""
    available = available_memory()
    need = size * per_byte
    if available is not None and need > available.size:
        raise DataError(f"data.path {path} is {format_bytes(size)}: reading and tokenizing it "
                        f"needs about {format_bytes(need)} of memory ({per_byte} bytes per "
                        f"byte of the file) but {available.holder} "
                        f"{format_bytes(available.size)}{available.how}; use a smaller file")


def _read_local(path_str: str) -> str:
    """The text of ``data.path``: :func:`read_local`, decoded."""
    return _decode(read_local(path_str), f"data.path {Path(path_str).expanduser()}")


def _cached_text(dest: Path, expected: str | None, warn: bool) -> str | None:
    """The text of the cache entry ``dest`` if it is there and usable (matches ``expected``
    when given, is UTF-8 and not empty), else None; ``warn``: log why it is not usable."""
    reason = None
    try:
        raw = dest.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        reason = f"cannot be read ({one_line(str(e))})"
    else:
        if expected is not None and sha256_bytes(raw) != expected:
            reason = "does not match data.sha256"
        else:
            try:
                return _decode(raw, f"cached {dest}")
            except DataError as e:  # an older fbtrain cached downloads it then refused
                if warn:
                    log.warning("%s; downloading again", str(e).split(";")[0])
                return None
    if warn:
        log.warning("cached %s %s; downloading again", dest, reason)
    return None


def load_text(data_cfg: DataConfig) -> str:
    """The corpus as a string: ``data.path`` if set, else the cached (or fresh) download.

    The cache entry is :func:`cache_entry` (suffix ``.txt``). It is hashed on every call
    when a sha256 is expected (about 1 MB, milliseconds) and reused when it matches (or the
    check is off) and is UTF-8 text; otherwise it is downloaded again, under the entry's
    :class:`CacheLock`. A download that is not UTF-8 text is refused and not kept.
    """
    if data_cfg.path:
        return _read_local(data_cfg.path)
    url, expected = address(data_cfg)
    dest = cache_entry(data_cfg, ".txt")
    text = _cached_text(dest, expected, warn=False)
    if text is not None:
        return text
    with CacheLock(dest):
        text = _cached_text(dest, expected, warn=True)  # another process may have made it
        if text is not None:
            return text
        download(url, dest, expected)
        try:
            raw = dest.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read downloaded {dest}: {one_line(str(e))}") from None
        try:
            return _decode(raw, url, f"nothing was saved; check data.url, {OFFLINE_HINT}")
        except DataError:
            dest.unlink(missing_ok=True)  # refused content is never left in the cache
            raise
