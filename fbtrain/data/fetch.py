"""Getting a file: download it (timeout, deadline, retries, sha256) into the cache, under a lock.

A cache entry is keyed by the dataset's name and the URL (:func:`cache_entry`), written
atomically (:func:`download`) by one process at a time (:class:`CacheLock`), and a download
has a total deadline (:data:`DOWNLOAD_DEADLINE`). The plain-text corpora are read on top of
this in :mod:`fbtrain.data.text`, the zipped benchmark corpora (enwik8, text8) prepared in
:mod:`fbtrain.data.archives`. Every failure the user can fix raises a one-line
:class:`~fbtrain.data.errors.DataError` that names the URL or file and what to do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import requests
import urllib3

from fbtrain.config import DataConfig
from fbtrain.config.schema import AUTO_SHA256
from fbtrain.data.errors import DataError, one_line
from fbtrain.data.sources import SOURCES
from fbtrain.filelock import LockHeld, PidLock, describe_holder
from fbtrain.io import atomic_write
from fbtrain.make_command import make_command
from fbtrain.progress import Progress, amount, note

log = logging.getLogger(__name__)

# With make: the command that runs this process (make quick, its variables), given DATA.
OFFLINE_HINT = ("or work offline with --set data.path=FILE pointing at a local copy of the "
                f"corpus (with make: {make_command(DATA='FILE') or 'make train DATA=FILE'})")
_CHUNK = 1 << 16  # bytes per streamed read: large enough to be fast, small enough to stay live
# A download's total time, retries included: enwik8's 36 MB zip at 20 KB/s. A module
# constant (not configuration) so that tests can lower it.
DOWNLOAD_DEADLINE = 30 * 60.0
# How long a process waits for another one that is filling the same cache entry: longer
# than that one's download may take (and its unzipping).
LOCK_WAIT = DOWNLOAD_DEADLINE + 10 * 60.0
WAIT_TICK = 1.0  # seconds between two updates of the waiting line
# Failures worth another attempt: the network, not the request, is at fault.
_TRANSIENT = (
    requests.ConnectionError,  # includes ConnectTimeout and mid-body read timeouts
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,  # connection dropped mid-body
    requests.exceptions.ContentDecodingError,
)


def cache_dir(data_cfg: DataConfig) -> Path:
    """The download cache: ``data.cache_dir``, else ``$FBTRAIN_CACHE``, else ~/.cache/fbtrain."""
    chosen = data_cfg.cache_dir or os.environ.get("FBTRAIN_CACHE") or "~/.cache/fbtrain"
    return Path(chosen).expanduser()


def sha256_bytes(data: bytes) -> str:
    """The sha256 hex digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of the file ``path``, read in chunks (never whole in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK * 16):
            digest.update(chunk)
    return digest.hexdigest()


def _describe(exc: BaseException, timeout: float) -> str:
    """A short reason for a network failure (requests' own messages run to several clauses)."""
    if isinstance(exc, requests.ConnectTimeout):
        return f"connection timed out after {timeout:g}s"
    if isinstance(exc, requests.Timeout) or "Read timed out" in str(exc):
        # A stall mid-body surfaces as ConnectionError(ReadTimeoutError), hence the text test.
        return f"no data received for {timeout:g}s (read timed out)"
    errno = re.search(r"\[Errno -?\d+\] [^'\")\]]+", str(exc))
    if errno:
        return errno.group(0).strip()
    return one_line(f"{type(exc).__name__}: {exc}")


def _late(url: str, limit: float) -> DataError:
    """The error of a download that did not finish within its total deadline."""
    return DataError(f"could not download {url}: not finished within the download deadline "
                     f"of {limit:g} s; check your connection, {OFFLINE_HINT}")


def _unwritable(path: Path, error: OSError) -> DataError:
    """The error of a cache that cannot be written."""
    return DataError(f"cannot write {path}: {one_line(str(error))}; set data.cache_dir or "
                     "FBTRAIN_CACHE to a writable folder")


def _chunks(response: requests.Response) -> Iterator[bytes]:
    """The body of ``response`` as it arrives: each chunk is what one read of the socket
    brings (at most :data:`_CHUNK` bytes), so a caller can check a deadline between reads
    even when the server trickles. ``iter_content`` instead fills each chunk before it
    returns it, and every byte that arrives resets the read timeout: one byte every few
    seconds would then never time out. urllib3's errors become requests' (as
    ``iter_content`` does); a urllib3 without ``read1`` (< 2.3) falls back to
    ``iter_content``, where the deadline is checked per filled chunk only."""
    read1 = getattr(response.raw, "read1", None)
    if read1 is None:
        yield from response.iter_content(chunk_size=_CHUNK)
        return
    while True:
        try:
            chunk = read1(_CHUNK, decode_content=True)
        except urllib3.exceptions.ProtocolError as e:
            raise requests.exceptions.ChunkedEncodingError(e) from e
        except urllib3.exceptions.DecodeError as e:
            raise requests.exceptions.ContentDecodingError(e) from e
        except urllib3.exceptions.ReadTimeoutError as e:
            raise requests.ConnectionError(e) from e
        except urllib3.exceptions.SSLError as e:
            raise requests.exceptions.SSLError(e) from e
        if not chunk:
            return
        yield chunk


def _write_verified(
    response: requests.Response, f: IO[bytes], url: str, sha256: str | None, end: float,
    limit: float, progress: Progress | None = None,
) -> None:
    """Stream the body into ``f``, hashing as we go; raise DataError on a checksum mismatch,
    or once ``time.monotonic()`` passes ``end`` (the deadline, ``limit`` seconds long).
    ``progress`` is told the bytes of each chunk."""
    digest = hashlib.sha256()
    for chunk in _chunks(response):
        digest.update(chunk)
        f.write(chunk)
        if progress is not None:
            progress.update(len(chunk))
        if time.monotonic() > end:
            # Raised inside atomic_write, which deletes the temp file.
            raise _late(url, limit)
    actual = digest.hexdigest()
    if sha256 is not None and actual != sha256:
        # Raised inside atomic_write, which deletes the temp file: nothing bad is left behind.
        raise DataError(
            f"sha256 mismatch for {url}: expected {sha256}, got {actual}; nothing was saved. "
            f"Fix data.sha256, skip the check with --set data.sha256=null, {OFFLINE_HINT}"
        )


def download(
    url: str,
    dest: Path,
    sha256: str | None,
    *,
    timeout: float = 30.0,
    retries: int = 3,
    backoff: float = 1.0,
    deadline: float | None = None,
) -> Path:
    """Download ``url`` to ``dest`` atomically, verifying ``sha256`` (None: skip) and return it.

    The body is streamed to a temp file in ``dest``'s folder, fsynced and moved into place
    with ``os.replace``, so ``dest`` is either absent, the old file, or the complete verified
    download. ``timeout`` applies to connecting and to each read; ``deadline`` (seconds,
    None: :data:`DOWNLOAD_DEADLINE`) bounds the whole call, retries and waits included, so
    a server that trickles a byte at a time cannot hold a run forever (a read that has
    started may overrun it by up to ``timeout``). ``retries`` is the total number of
    attempts; connection errors, timeouts, 5xx, 408 and 429 are retried after
    ``backoff * 2**k`` seconds (``backoff=0`` in tests), other 4xx fail at once. A checksum
    mismatch is not retried: the same URL would give the same bytes.
    """
    dest = Path(dest)
    expected = sha256.strip().lower() if sha256 else None
    attempts = max(1, int(retries))
    limit = DOWNLOAD_DEADLINE if deadline is None else float(deadline)
    end = time.monotonic() + limit
    reason = "no attempt made"
    for attempt in range(1, attempts + 1):
        left = end - time.monotonic()
        if left <= 0:
            raise _late(url, limit)
        wait = min(timeout, left)  # no single wait may outlast the deadline
        try:
            log.info("downloading %s -> %s (attempt %d/%d)", url, dest, attempt, attempts)
            with requests.get(url, stream=True, timeout=(wait, wait)) as response:
                status = response.status_code
                if 200 <= status < 300:
                    with _download_progress(response, dest) as shown:
                        atomic_write(dest, lambda f: _write_verified(
                            response, f, url, expected, end, limit, shown))
                    return dest
                reason = f"HTTP {status} {response.reason or ''}".strip()
                if not (status >= 500 or status in (408, 429)):
                    raise DataError(
                        f"could not download {url}: {reason}; check data.url, {OFFLINE_HINT}"
                    )
        except _TRANSIENT as e:
            reason = _describe(e, wait)
        except requests.RequestException as e:  # bad URL, too many redirects: retrying won't help
            raise DataError(
                f"could not download {url}: {_describe(e, wait)}; check data.url, "
                f"{OFFLINE_HINT}"
            ) from None
        except OSError as e:  # after the requests errors: RequestException is an OSError too
            raise _unwritable(dest, e) from None
        if attempt < attempts and backoff > 0:
            time.sleep(max(0.0, min(backoff * 2 ** (attempt - 1), end - time.monotonic())))
    raise DataError(
        f"could not download {url}: {reason} (after {attempts} attempt"
        f"{'s' if attempts != 1 else ''}); check your connection, {OFFLINE_HINT}"
    )


def _download_progress(response: requests.Response, dest: Path) -> Progress:
    """The progress of one download (its size from Content-Length, when sent): a line on
    a terminal, a plain line every 30 s in a log file (a download can take half an hour)."""
    try:
        size: int | None = int(response.headers.get("Content-Length", ""))
    except ValueError:
        size = None
    size = size if size and size > 0 else None
    sized = f" ({amount(size, 'B', scale=True)})" if size else ""
    note(f"fbtrain: downloading {response.url}{sized} into {dest}")
    return Progress(size, desc=f"downloading {dest.name}", unit="B", scale=True, plain=True)


def address(data_cfg: DataConfig) -> tuple[str, str | None]:
    """Where to download ``data.dataset`` from and the sha256 to expect (None: no check).

    ``data.url`` null is the dataset's usual address; ``data.sha256: auto`` its pinned
    checksum (none for a dataset without one, or a name fbtrain does not know).
    """
    source = SOURCES.get(data_cfg.dataset)
    url = data_cfg.url or (source.url if source else None)
    if url is None:
        raise DataError(f"data.dataset = {data_cfg.dataset!r} has no usual address; set "
                        f"data.url, {OFFLINE_HINT}")
    sha = data_cfg.sha256
    if sha == AUTO_SHA256:
        sha = source.sha256 if source else None
    return url, sha.strip().lower() if sha else None


def cache_name(data_cfg: DataConfig) -> str:
    """``data.dataset``, checked to be a plain file name (it names the cache entries)."""
    name = str(data_cfg.dataset)
    if not name or Path(name).name != name or name in (".", ".."):
        raise DataError(f"data.dataset = {name!r} must be a plain name (it names the cache file)")
    return name


def cache_entry(data_cfg: DataConfig, suffix: str = "") -> Path:
    """The cache file for what ``data_cfg`` downloads: ``<cache>/<dataset><suffix>`` for the
    dataset's usual address, ``<cache>/<dataset>@<16 hex digits><suffix>`` for any other
    ``data.url`` (the digits begin the sha256 of the URL).

    The URL is part of the key, so changing ``data.url`` fetches the new address instead
    of reusing what the old one gave. The usual address keeps the plain name, so entries
    made before URLs were keyed are still used for it (nothing is downloaded again).
    """
    name = cache_name(data_cfg)
    url, _ = address(data_cfg)
    source = SOURCES.get(name)
    if source is None or url != source.url:
        name += "@" + sha256_bytes(url.encode("utf-8"))[:16]
    return cache_dir(data_cfg) / (name + suffix)


class CacheLock:
    """``with CacheLock(entry):`` the sole right to write the cache entry ``entry`` (and its
    temp files and ``leftovers``) for the block.

    The holder keeps a :class:`~fbtrain.filelock.PidLock` on ``<folder>/.<entry name>.lock``
    (which also records its process id), as :class:`fbtrain.rundir.lock.RunDirLock` does for a
    run directory: the kernel drops it when the process ends however it ends. A second
    process wanting the same entry waits (polling) for up to ``wait`` seconds (None:
    :data:`LOCK_WAIT`), then gives up with a DataError naming the holder; once it holds the
    lock it must look at the cache again, as the first may have filled it. Holding the lock
    proves that no writer of this entry is alive, so the temp files of its downloads found
    then (left by a kill -9) and ``leftovers`` are deleted; ``removed`` lists them. On a file
    system without flock nothing is held, so nothing is deleted either (a live download's
    temp file may be among them). Readers take no lock: entries are replaced atomically, so
    a reader sees the old file or the new one. The lock file stays after the block, as
    RunDirLock's does (deleting it would let two processes lock two different files).
    """

    def __init__(self, entry: Path, leftovers: Sequence[Path] = (), wait: float | None = None):
        self.entry = Path(entry)
        self.leftovers = [Path(p) for p in leftovers]
        self.wait = wait
        self.removed: list[Path] = []
        self._lock = PidLock(self.path)

    @property
    def path(self) -> Path:
        return self.entry.with_name(f".{self.entry.name}.lock")

    def __enter__(self) -> CacheLock:
        """Wait for the lock (which records this process's id), delete the leftovers."""
        limit = LOCK_WAIT if self.wait is None else self.wait
        try:
            self.entry.parent.mkdir(parents=True, exist_ok=True)
            self._acquire(limit)
        except LockHeld as e:
            raise DataError(
                f"cache entry {self.entry} is still being written by another fbtrain "
                f"process ({describe_holder(e.holder)}) after {limit:g} s of waiting; wait for "
                "it or stop it, or set data.cache_dir to another folder") from None
        except OSError as e:
            raise _unwritable(self.entry.parent, e) from None
        try:
            if self._lock.held:
                self.removed = self._remove_leftovers()
        except OSError as e:
            self._lock.release()
            raise _unwritable(self.entry.parent, e) from None
        except BaseException:
            self._lock.release()
            raise
        if self.removed:
            log.info("removed leftovers of an interrupted download: %s",
                     ", ".join(p.name for p in self.removed))
        return self

    def _acquire(self, limit: float) -> None:
        """Take the lock within ``limit`` seconds (LockHeld past it). While waiting, the
        wait shows: a line on stderr naming the holder, then the time waited (a tqdm line
        on a terminal, a plain line every 30 s elsewhere), as the wait may be long."""
        give_up = time.monotonic() + limit
        self._shown: list[str] = []  # the holders named so far
        self._wait: Progress | None = None
        try:
            while True:
                try:
                    tick = max(0.0, min(WAIT_TICK, give_up - time.monotonic()))
                    self._lock.acquire(wait=tick, on_wait=self._waiting)
                    return
                except LockHeld:
                    if time.monotonic() >= give_up:
                        raise
                    if self._wait is not None:
                        self._wait.update(0)
        finally:
            if self._wait is not None:
                self._wait.close()

    def _waiting(self, holder: str) -> None:
        """Say who is writing the entry this process waits for (and again if that changes)."""
        if self._shown and (not holder or holder == self._shown[-1]):
            return
        self._shown.append(holder)
        log.info("waiting for %s, which is writing %s", describe_holder(holder), self.entry)
        if self._wait is not None:
            self._wait.close()
        note(f"fbtrain: waiting for another process ({describe_holder(holder)}) writing "
             f"{self.entry}")
        self._wait = Progress(None, desc="waiting for its download", plain=True)

    def _remove_leftovers(self) -> list[Path]:
        """Delete the entry's temp files and ``leftovers`` (only while holding the lock)."""
        # The temp names atomic_write gives the entry, its archive and its record.
        temp = re.compile(rf"^\.{re.escape(self.entry.name)}(\.zip|\.json)?"
                          r"\.[A-Za-z0-9_]{8}\.tmp$")
        stale = sorted(p for p in self.entry.parent.iterdir() if temp.match(p.name))
        removed = []
        for p in stale + [p for p in self.leftovers if p.exists()]:
            p.unlink(missing_ok=True)
            removed.append(p)
        return removed

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Let go (closing the descriptor drops the flock)."""
        self._lock.release()
