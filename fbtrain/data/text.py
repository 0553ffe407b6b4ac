"""The plain-text corpora: ``data.path``, or a download kept in the cache, as UTF-8 text.

A local file never touches the network; otherwise the text comes from ``data.url`` (null:
the dataset's usual address, :mod:`fbtrain.data.sources`), downloaded once into the cache
(:mod:`fbtrain.data.fetch`) and verified by sha256. A text that is not UTF-8, or empty, is
refused with a :class:`~fbtrain.data.errors.DataError` and never kept in the cache.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fbtrain.config import DataConfig
from fbtrain.data.errors import DataError, one_line
from fbtrain.data.fetch import (
    OFFLINE_HINT,
    CacheLock,
    address,
    cache_entry,
    download,
    sha256_bytes,
)

log = logging.getLogger(__name__)


def _decode(raw: bytes, what: str, fix: str | None = None) -> str:
    """``raw`` as UTF-8 text; DataError "<what> is not valid UTF-8 / is empty; <fix>" (fix
    None: the advice for a local file)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} is not valid UTF-8 (byte {e.start}); "
                        f"{fix or 'convert it to UTF-8 text'}") from None
    if not text:
        raise DataError(f"{what} is empty; {fix or 'point it at a text file with content'}")
    return text


def _read_local(path_str: str) -> str:
    """The text of ``data.path`` (never the network); DataError naming the file otherwise."""
    path = Path(path_str).expanduser()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"data.path {path}: file not found; check the path") from None
    except IsADirectoryError:
        raise DataError(f"data.path {path} is a folder; point it at a text file") from None
    except OSError as e:
        raise DataError(
            f"data.path {path}: cannot read it ({e.strerror or one_line(str(e))})"
        ) from None
    return _decode(raw, f"data.path {path}")


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
