"""The paper's character-level benchmarks, enwik8 and text8: fetch, unzip, check, cache.

Each is a zip archive holding one file of exactly :data:`SIZE` bytes (the first 10^8 bytes
of an English Wikipedia dump; text8 is its lowercase-letters-and-spaces cleaning). The
archive is downloaded with :func:`fbtrain.data.download` (timeout, retries, sha256 when one
is given), its file is unzipped with the standard library into the cache, size-checked,
and the archive removed: the cache holds the prepared file (``<cache>/enwik8``) or nothing.
Later runs read it straight from the cache (size checked again; a wrong size is rebuilt).

The standard split is by position: the last :data:`HELD_OUT` bytes are test, the
:data:`HELD_OUT` before them validation, the rest (90,000,000) training. The corpus is
kept as a uint8 tensor (ids < 256), never as a Python list or int64: 100 MB, not 800.

:data:`SIZE` and :data:`HELD_OUT` are module constants so that tests can shrink them
(monkeypatch); they are not configuration: a different size is not enwik8.
"""

from __future__ import annotations

import logging
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import torch

from fbtrain.config import DataConfig
from fbtrain.data import OFFLINE_HINT, DataError, address, cache_dir, cache_name, download, one_line
from fbtrain.io import atomic_write
from fbtrain.sources import SOURCES

log = logging.getLogger(__name__)

SIZE = 100_000_000  # bytes of each unzipped file
HELD_OUT = 5_000_000  # bytes of the test split, and of the validation split before it
SPLITS = ("train", "val", "test")
_CHUNK = 1 << 22  # bytes per copy/encode step: big enough to be fast, small enough to be lean


def split_bounds() -> dict[str, tuple[int, int]]:
    """``{split: (start, end)}`` byte offsets of the standard split of a :data:`SIZE` file."""
    val, test = SIZE - 2 * HELD_OUT, SIZE - HELD_OUT
    return {"train": (0, val), "val": (val, test), "test": (test, SIZE)}


def load_bytes(data_cfg: DataConfig) -> torch.Tensor:
    """The whole corpus ``data.dataset`` names, uint8 ``[SIZE]``: ``data.path`` (the unzipped
    file) if set, else the prepared cache entry, made first when missing or the wrong size."""
    name = cache_name(data_cfg)
    if data_cfg.path:
        path = Path(data_cfg.path).expanduser()
        _check_size(path, f"data.path {path}", f"point data.path at the unzipped {name}")
        return _read(path, f"data.path {path}")
    path = cache_dir(data_cfg) / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = None
    if size is not None and size != SIZE:
        log.warning("cached %s is %d bytes, not %d; preparing it again", path, size, SIZE)
    if size != SIZE:
        fetch(data_cfg, path)
    return _read(path, f"cached {path}")


def fetch(data_cfg: DataConfig, dest: Path) -> None:
    """Download the archive, unzip its file into ``dest`` (atomically, size-checked), and
    remove the archive whatever happens: a failure leaves no cache entry behind."""
    url, sha256 = address(data_cfg)
    member = SOURCES[data_cfg.dataset].member
    assert member is not None, f"{data_cfg.dataset} is not an archived corpus"
    archive = dest.with_name(dest.name + ".zip")
    try:
        download(url, archive, sha256)
        unzip(archive, member, dest, url)
    finally:
        archive.unlink(missing_ok=True)


def unzip(archive: Path, member: str, dest: Path, url: str) -> None:
    """Write ``member`` of zip ``archive`` (downloaded from ``url``) to ``dest`` atomically,
    refusing an archive that is not a whole zip, lacks ``member`` or whose member is not
    :data:`SIZE` bytes (then ``dest`` is not written)."""
    try:
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            if member not in names:
                shown = ", ".join(names[:5]) or "nothing"
                raise DataError(f"{url}: the archive holds {shown}, not {member}; check "
                                f"data.url, {OFFLINE_HINT}")
            with zf.open(member) as src:
                atomic_write(dest, lambda f: _copy_sized(src, f, f"{member} in {url}"))
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        # A truncated download has no central directory; a damaged one fails its CRC.
        raise DataError(f"{url}: not a complete zip archive ({one_line(str(e), 80)}); nothing "
                        f"was saved, run again to download it anew, {OFFLINE_HINT}") from None


def _copy_sized(src: IO[bytes], dst: IO[bytes], what: str) -> None:
    """Copy ``src`` to ``dst`` in chunks; DataError (inside atomic_write: nothing is kept)
    unless exactly :data:`SIZE` bytes came."""
    n = 0
    while chunk := src.read(_CHUNK):
        n += len(chunk)
        if n > SIZE:
            break  # no need to unpack the rest of a file that is already too big
        dst.write(chunk)
    if n != SIZE:
        size = f"more than {SIZE:,}" if n > SIZE else f"{n:,}"
        raise DataError(f"{what} is {size} bytes, not {SIZE:,}: not the standard corpus; "
                        f"nothing was saved; check data.url, {OFFLINE_HINT}")


def _check_size(path: Path, what: str, fix: str) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{what}: file not found; check the path") from None
    except OSError as e:
        raise DataError(f"{what}: cannot read it ({e.strerror or one_line(str(e))})") from None
    if path.is_dir():
        raise DataError(f"{what} is a folder; {fix}")
    if size != SIZE:
        zipped = " (a zip archive: unzip it first)" if zipfile.is_zipfile(path) else ""
        raise DataError(f"{what} is {size:,} bytes, not {SIZE:,}{zipped}; {fix}")


def _read(path: Path, what: str) -> torch.Tensor:
    """The file as uint8 ``[SIZE]``, memory-mapped (copy-on-write: the file is never changed;
    pages are read as they are touched)."""
    try:
        return torch.from_file(str(path), shared=False, size=SIZE, dtype=torch.uint8)
    except (OSError, RuntimeError) as e:
        raise DataError(f"{what}: cannot read it ({one_line(str(e), 120)})") from None


def present_bytes(raw: torch.Tensor) -> list[int]:
    """The byte values that occur in uint8 ``raw`` ``[n]``, ascending (one pass)."""
    counts = torch.zeros(256, dtype=torch.long)
    for start in range(0, len(raw), _CHUNK):
        counts += torch.bincount(raw[start:start + _CHUNK], minlength=256)
    return counts.nonzero().flatten().tolist()


def encode_bytes(raw: torch.Tensor, tokens: Sequence[str], present: Sequence[int],
                 what: str) -> torch.Tensor:
    """uint8 bytes ``[n]`` -> uint8 ids ``[n]`` in vocabulary ``tokens`` (byte ``b`` is the
    token ``chr(b)``); ``present`` is :func:`present_bytes` of ``raw`` (the caller has it
    already); DataError naming the bytes the vocabulary lacks.

    Works chunk by chunk, so only one chunk at a time is widened (to the int32 index
    ``index_select`` takes: faster than int64 and half the size).
    """
    if len(tokens) > 256:
        raise DataError(f"{what}: a vocabulary of {len(tokens)} tokens does not fit uint8 ids")
    known = torch.zeros(256, dtype=torch.bool)
    lut = torch.zeros(256, dtype=torch.uint8)  # byte value -> id
    for i, token in enumerate(tokens):
        if len(token) == 1 and ord(token) < 256:
            known[ord(token)], lut[ord(token)] = True, i
    missing = [b for b in present if not known[b]]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:10])
        raise DataError(f"{what}: {len(missing)} byte value(s) not in the vocabulary: {shown}")
    ids = torch.empty(len(raw), dtype=torch.uint8)
    for start in range(0, len(raw), _CHUNK):
        chunk = raw[start:start + _CHUNK]
        torch.index_select(lut, 0, chunk.int(), out=ids[start:start + len(chunk)])
    return ids
