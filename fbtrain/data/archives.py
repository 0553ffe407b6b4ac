"""The paper's character-level benchmarks, enwik8 and text8: fetch, unzip, check, cache.

Each is a zip archive holding one file of exactly :data:`SIZE` bytes (the first 10^8 bytes
of an English Wikipedia dump; text8 is its lowercase-letters-and-spaces cleaning). The
archive is downloaded with :func:`fbtrain.data.fetch.download` (timeout, deadline, retries,
sha256 when one is given), its file is unzipped with the standard library, size-checked
and (text8) checked to hold only its alphabet before it is moved into the cache, and the
archive removed: the cache holds the prepared file or nothing, never refused content.

The entry is :func:`fbtrain.data.fetch.cache_entry` (``<cache>/enwik8`` for the usual address,
``<cache>/enwik8@<url digest>`` for another ``data.url``), written under its
:class:`~fbtrain.data.fetch.CacheLock`, with a record beside it, ``<entry>.json``: the URL, the
sha256 of the archive it was unzipped from and that of the file itself. Later runs read
the entry straight from the cache (size and alphabet checked; a wrong one is rebuilt); only
when ``data.sha256`` is given is the file hashed and checked against its record.

The standard split is by position: the last :data:`HELD_OUT` bytes are test, the
:data:`HELD_OUT` before them validation, the rest (90,000,000) training. The corpus is
kept as a uint8 tensor (ids < 256), never as a Python list or int64: 100 MB, not 800.

:data:`SIZE` and :data:`HELD_OUT` are module constants so that tests can shrink them
(monkeypatch); they are not configuration: a different size is not enwik8.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from fbtrain.config import DataConfig
from fbtrain.data.errors import DataError, VocabularyError, one_line
from fbtrain.data.fetch import (
    OFFLINE_HINT,
    CacheLock,
    address,
    cache_entry,
    cache_name,
    download,
    file_sha256,
)
from fbtrain.data.sources import SOURCES, Source
from fbtrain.io import NotRegularFileError, atomic_write, atomic_write_text, open_regular

log = logging.getLogger(__name__)

SIZE = 100_000_000  # bytes of each unzipped file
HELD_OUT = 5_000_000  # bytes of the test split, and of the validation split before it
_CHUNK = 1 << 22  # bytes per copy/encode step: big enough to be fast, small enough to be lean


def split_bounds() -> dict[str, tuple[int, int]]:
    """``{split: (start, end)}`` byte offsets of the standard split of a :data:`SIZE` file."""
    val, test = SIZE - 2 * HELD_OUT, SIZE - HELD_OUT
    return {"train": (0, val), "val": (val, test), "test": (test, SIZE)}


def record_path(entry: Path) -> Path:
    """The record of cache entry ``entry``: ``<entry>.json``."""
    return entry.with_name(entry.name + ".json")


def _archive_path(entry: Path) -> Path:
    """Where the archive of ``entry`` is downloaded to (and removed from once unzipped)."""
    return entry.with_name(entry.name + ".zip")


def load_bytes(data_cfg: DataConfig) -> tuple[torch.Tensor, list[int]]:
    """The whole corpus ``data.dataset`` names, uint8 ``[SIZE]``, and the byte values in it
    (:func:`present_bytes`, computed once here: the alphabet check and the caller both need
    it). ``data.path`` (the unzipped file) if set, else the prepared cache entry, made first
    (under its lock) when missing, the wrong size, outside the alphabet, or not the archive
    ``data.sha256`` names."""
    name = cache_name(data_cfg)
    source = SOURCES[name]
    if data_cfg.path:
        path = Path(data_cfg.path).expanduser()
        what, fix = f"data.path {path}", f"point data.path at the unzipped {name}"
        _check_size(path, what, fix)
        raw = _read(path, what)
        present = present_bytes(raw)
        problem = _alphabet_problem(raw, present, source, what)
        if problem:
            raise DataError(f"{problem}; {fix}")
        return raw, present
    entry = cache_entry(data_cfg)
    _, expected = address(data_cfg)
    loaded = _cached(entry, source, expected, warn=False)
    if loaded is None:
        with CacheLock(entry, leftovers=[_archive_path(entry)]):
            # Looked at again under the lock: another process may have just made it.
            loaded = _cached(entry, source, expected, warn=True)
            if loaded is None:
                fetch(data_cfg, entry)
                raw = _read(entry, f"cached {entry}")
                loaded = raw, present_bytes(raw)
    return loaded


def _cached(entry: Path, source: Source, expected: str | None, warn: bool
            ) -> tuple[torch.Tensor, list[int]] | None:
    """The cache entry and its byte values if it is usable, else None (``warn``: log why).

    Usable: :data:`SIZE` bytes, only ``source``'s alphabet (an older fbtrain cached text8
    archives it then refused), and, only when a sha256 is ``expected``, unzipped from that
    archive by its record and unchanged since (the file is hashed, a fraction of a second
    for the 100 MB (docs/performance.md), paid only when asked for). A record naming
    another archive is the user's to resolve: DataError naming the file, the expected and
    the actual sha256.
    """
    def stale(reason: str) -> None:
        if warn:
            log.warning("cached %s %s; preparing it again", entry, reason)

    try:
        size = entry.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataError(f"cached {entry}: cannot read it ({e.strerror or one_line(str(e))})"
                        ) from None
    if size != SIZE:
        stale(f"is {size:,} bytes, not {SIZE:,}")
        return None
    if expected is not None:
        record = _read_record(entry)
        if record is None:
            stale("has no record of the archive it came from, so data.sha256 cannot be "
                  "checked")
            return None
        if record["archive_sha256"] != expected:
            raise DataError(
                f"cached {entry} was unzipped from an archive with sha256 "
                f"{record['archive_sha256']}, but data.sha256 expects {expected}; fix "
                f"data.sha256 (null skips the check), or delete {entry} to download it again")
        if file_sha256(entry) != record["sha256"]:
            stale("has changed since it was unzipped (its sha256 is not the recorded one)")
            return None
    raw = _read(entry, f"cached {entry}")
    present = present_bytes(raw)
    problem = _alphabet_problem(raw, present, source, f"cached {entry}")
    if problem:
        stale(problem.removeprefix(f"cached {entry}: "))
        return None
    return raw, present


def _read_record(entry: Path) -> dict[str, Any] | None:
    """The record :func:`fetch` wrote beside ``entry`` (None: none, or not one of ours)."""
    try:
        record = json.loads(record_path(entry).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    fields = ("archive_sha256", "sha256")
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in fields):
        return None
    return record


def fetch(data_cfg: DataConfig, dest: Path) -> None:
    """Download the archive, unzip its file into ``dest`` (atomically, checked), record
    where it came from in :func:`record_path`, and remove the archive whatever happens: a
    failure leaves no new cache entry behind. The caller holds ``dest``'s CacheLock."""
    url, sha256 = address(data_cfg)
    source = SOURCES[data_cfg.dataset]
    assert source.member is not None, f"{data_cfg.dataset} is not an archived corpus"
    archive, record = _archive_path(dest), record_path(dest)
    # Gone before dest may change, written after: a record never describes another file
    # (a kill in between leaves an entry without one, which a sha256 check then rebuilds).
    record.unlink(missing_ok=True)
    try:
        download(url, archive, sha256)
        archive_sha256 = file_sha256(archive)
        digest = unzip(archive, source, dest, url)
    finally:
        archive.unlink(missing_ok=True)
    atomic_write_text(record, json.dumps({"url": url, "archive_sha256": archive_sha256,
                                          "sha256": digest}, indent=1) + "\n")


def unzip(archive: Path, source: Source, dest: Path, url: str) -> str:
    """Write ``source.member`` of zip ``archive`` (downloaded from ``url``) to ``dest``
    atomically and return its sha256, refusing an archive that is not a whole zip, lacks
    the member or whose member is not :data:`SIZE` bytes of ``source.alphabet`` (then
    ``dest`` is not written)."""
    member = source.member
    assert member is not None
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            if member not in names:
                shown = ", ".join(names[:5]) or "nothing"
                raise DataError(f"{url}: the archive holds {shown}, not {member}; check "
                                f"data.url, {OFFLINE_HINT}")
            what = f"{member} in {url}"
            with zf.open(member) as src:
                atomic_write(dest, lambda f: _copy_checked(src, f, what, source, digest.update))
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        # A truncated download has no central directory; a damaged one fails its CRC.
        raise DataError(f"{url}: not a complete zip archive ({one_line(str(e), 80)}); nothing "
                        f"was saved, run again to download it anew, {OFFLINE_HINT}") from None
    return digest.hexdigest()


def _copy_checked(src: IO[bytes], dst: IO[bytes], what: str, source: Source,
                  seen: Callable[[bytes], None]) -> None:
    """Copy ``src`` to ``dst`` in chunks, passing each to ``seen``; DataError (inside
    atomic_write: nothing is kept) unless exactly :data:`SIZE` bytes of ``source``'s
    alphabet came."""
    n = 0
    while chunk := src.read(_CHUNK):
        if source.alphabet is not None and (bad := chunk.translate(None, source.alphabet)):
            # translate keeps order, so bad[0] is the first byte outside the alphabet.
            offset = n + chunk.index(bad[:1])
            raise DataError(f"{_bad_byte(what, bad[0], offset, source)}; nothing was saved; "
                            f"check data.url, {OFFLINE_HINT}")
        n += len(chunk)
        if n > SIZE:
            break  # no need to unpack the rest of a file that is already too big
        dst.write(chunk)
        seen(chunk)
    if n != SIZE:
        size = f"more than {SIZE:,}" if n > SIZE else f"{n:,}"
        raise DataError(f"{what} is {size} bytes, not {SIZE:,}: not the standard corpus; "
                        f"nothing was saved; check data.url, {OFFLINE_HINT}")


def _bad_byte(what: str, value: int, offset: int, source: Source) -> str:
    """"<what>: byte 0x41 ('A') at offset 12 is not allowed: text8 holds only ..."."""
    shown = f"0x{value:02x}" + (f" ({chr(value)!r})" if 0x20 <= value < 0x7F else "")
    return (f"{what}: byte {shown} at offset {offset:,} is not allowed: {source.member} "
            f"holds only {source.allowed}")


def _alphabet_problem(raw: torch.Tensor, present: Sequence[int], source: Source, what: str
                      ) -> str | None:
    """Why uint8 ``raw`` (whose byte values are ``present``) is not in ``source``'s
    alphabet, naming the first byte that is not (None: it is, or any byte is allowed)."""
    if source.alphabet is None or set(present) <= set(source.alphabet):
        return None
    outside = torch.ones(256, dtype=torch.bool)
    outside[list(source.alphabet)] = False
    for start in range(0, len(raw), _CHUNK):  # a second pass, only for a file refused anyway
        hits = outside[raw[start:start + _CHUNK].long()].nonzero()
        if len(hits):
            offset = start + int(hits[0])
            return _bad_byte(what, int(raw[offset]), offset, source)
    raise AssertionError("present_bytes and the bytes disagree")  # unreachable


def _check_size(path: Path, what: str, fix: str) -> None:
    try:
        with open_regular(path) as f:  # a device or a FIFO is never read (nor waited on)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise DataError(f"{what}: file not found; check the path") from None
    except NotRegularFileError as e:
        raise DataError(f"{what} is {e.kind}, not a file; {fix}") from None
    except OSError as e:
        raise DataError(f"{what}: cannot read it ({e.strerror or one_line(str(e))})") from None
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
        raise VocabularyError(f"{what}: a vocabulary of {len(tokens)} tokens does not fit "
                              "uint8 ids")
    known = torch.zeros(256, dtype=torch.bool)
    lut = torch.zeros(256, dtype=torch.uint8)  # byte value -> id
    for i, token in enumerate(tokens):
        if len(token) == 1 and ord(token) < 256:
            known[ord(token)], lut[ord(token)] = True, i
    missing = [b for b in present if not known[b]]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:10])
        raise VocabularyError(f"{what}: {len(missing)} byte value(s) not in the vocabulary: "
                              f"{shown}")
    ids = torch.empty(len(raw), dtype=torch.uint8)
    for start in range(0, len(raw), _CHUNK):
        chunk = raw[start:start + _CHUNK]
        torch.index_select(lut, 0, chunk.int(), out=ids[start:start + len(chunk)])
    return ids
