"""Data: get the text, tokenize it (characters, words or bytes), split it, draw batches.

Text comes either from a local file (``data.path``, never touches the network) or from
``data.url`` (null: the dataset's usual address, :mod:`fbtrain.sources`), downloaded once
into a cache folder and verified by sha256. A cache entry is keyed by the dataset's name
and the URL (:func:`cache_entry`), written atomically by one process at a time
(:class:`CacheLock`), and a download has a total deadline (:data:`DOWNLOAD_DEADLINE`).
The zipped benchmark corpora (enwik8, text8) are prepared in :mod:`fbtrain.archives` on
top of :func:`download`. Everything the user can get wrong here raises :class:`DataError`
with a one-line message that says which file or URL is at fault and what to do; the CLI
turns it into exit code 2.

Shapes: token ids are 1-D integer tensors (LongTensors, or uint8 for a large byte-level
corpus); batches are LongTensors ``[batch, seq_len]`` (batch first). Targets equal to
:data:`IGNORE_INDEX` are not scored (PyTorch's cross-entropy convention).
"""

from __future__ import annotations

import codecs
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NamedTuple

import requests
import torch
import urllib3

from fbtrain.config import MAX_VAL_FRACTION, DataConfig
from fbtrain.filelock import read_pid
from fbtrain.io import atomic_write, atomic_write_text
from fbtrain.sources import AUTO_SHA256, SOURCES

log = logging.getLogger(__name__)

OFFLINE_HINT = "or work offline with --set data.path=FILE pointing at a local copy of the corpus"
VOCAB_FILE = "vocab.json"
_CHUNK = 1 << 16  # bytes per streamed read: large enough to be fast, small enough to stay live
# A download's total time, retries included: enwik8's 36 MB zip at 20 KB/s. A module
# constant (not configuration) so that tests can lower it.
DOWNLOAD_DEADLINE = 30 * 60.0
# How long a process waits for another one that is filling the same cache entry: longer
# than that one's download may take (and its unzipping).
LOCK_WAIT = DOWNLOAD_DEADLINE + 10 * 60.0
_LOCK_POLL = 0.1  # seconds between looks at a lock held by another process
_MAX_LISTED = 10  # unknown characters named in an error; more would not fit on one line
# Failures worth another attempt: the network, not the request, is at fault.
_TRANSIENT = (
    requests.ConnectionError,  # includes ConnectTimeout and mid-body read timeouts
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,  # connection dropped mid-body
    requests.exceptions.ContentDecodingError,
)


IGNORE_INDEX = -100  # a target position that no loss or metric counts (F.cross_entropy's default)


class Stream(NamedTuple):
    """A split as the model sees it: ``inputs`` and ``targets``, integer tensors ``[n]``.

    ``targets[i]`` is what the model must predict after reading ``inputs[: i + 1]``;
    :data:`IGNORE_INDEX` where nothing is scored. A text corpus predicts the next token
    (:func:`next_token_stream`); a labelled dataset scores only the positions it labels.
    Any integer dtype: a 100M-token corpus stays uint8 (inputs and targets two views of one
    buffer), labelled targets need a signed one; windows are drawn with :func:`window`,
    which makes them LongTensors.
    """

    inputs: torch.Tensor
    targets: torch.Tensor


def next_token_stream(ids: torch.Tensor) -> Stream:
    """Token ids ``[n]`` -> inputs ``ids[:-1]``, targets ``ids[1:]`` (``n - 1`` predictions):
    views of ``ids``, in its dtype, so nothing is copied."""
    return Stream(ids[:-1], ids[1:])


def as_stream(data: torch.Tensor | Stream) -> Stream:
    """A :class:`Stream` as it is; a 1-D tensor of ids as its next-token stream."""
    if isinstance(data, Stream):
        if not (isinstance(data.inputs, torch.Tensor) and data.inputs.dim() == 1
                and data.inputs.shape == data.targets.shape):
            raise TypeError("a Stream needs 1-D inputs and targets of the same length")
        if data.inputs.is_floating_point() or data.targets.is_floating_point():
            raise TypeError("a Stream holds integer token ids, not floats")
        return data
    _check_data(data)
    return next_token_stream(data)


def window(ids: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """``ids[index]`` as a new LongTensor (what embeddings and cross-entropy take), never a
    view of ``ids``: only the drawn windows of a compact (uint8) split are widened, and a
    caller may write into the result (e.g. :data:`IGNORE_INDEX`)."""
    return ids[index].to(torch.long, copy=True)


class DataError(Exception):
    """A user-facing data problem; the message is one line naming the file/URL and the fix."""


# ----------------------------------------------------------------------------- getting text


def cache_dir(data_cfg: DataConfig) -> Path:
    """The download cache: ``data.cache_dir``, else ``$FBTRAIN_CACHE``, else ~/.cache/fbtrain."""
    chosen = data_cfg.cache_dir or os.environ.get("FBTRAIN_CACHE") or "~/.cache/fbtrain"
    return Path(chosen).expanduser()


def _sha256_bytes(data: bytes) -> str:
    """The sha256 hex digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of the file ``path``, read in chunks (never whole in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK * 16):
            digest.update(chunk)
    return digest.hexdigest()


def one_line(text: str, limit: int = 200) -> str:
    """``text`` with its whitespace runs collapsed, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    limit: float,
) -> None:
    """Stream the body into ``f``, hashing as we go; raise DataError on a checksum mismatch,
    or once ``time.monotonic()`` passes ``end`` (the deadline, ``limit`` seconds long)."""
    digest = hashlib.sha256()
    for chunk in _chunks(response):
        digest.update(chunk)
        f.write(chunk)
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
                    atomic_write(dest, lambda f: _write_verified(response, f, url, expected,
                                                                 end, limit))
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
        name += "@" + _sha256_bytes(url.encode("utf-8"))[:16]
    return cache_dir(data_cfg) / (name + suffix)


class CacheLock:
    """``with CacheLock(entry):`` the sole right to write the cache entry ``entry`` (and its
    temp files and ``leftovers``) for the block.

    The holder keeps ``fcntl.flock`` on ``<folder>/.<entry name>.lock`` (which also records
    its process id), as :class:`fbtrain.rundir.RunDirLock` does for a run directory: the
    kernel drops it when the process ends however it ends. A second process wanting the same
    entry waits (polling) for up to ``wait`` seconds (None: :data:`LOCK_WAIT`), then gives up
    with a DataError naming the holder; once it holds the lock it must look at the cache
    again, as the first may have filled it. Holding the lock proves that no writer of this
    entry is alive, so the temp files of its downloads found then (left by a kill -9) and
    ``leftovers`` are deleted; ``removed`` lists them. Readers take no lock: entries are
    replaced atomically, so a reader sees the old file or the new one.
    """

    def __init__(self, entry: Path, leftovers: Sequence[Path] = (), wait: float | None = None):
        self.entry = Path(entry)
        self.leftovers = [Path(p) for p in leftovers]
        self.wait = wait
        self.removed: list[Path] = []
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.entry.with_name(f".{self.entry.name}.lock")

    def __enter__(self) -> CacheLock:
        """Wait for the lock, record this process's id, delete the leftovers."""
        try:
            self.entry.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _unwritable(self.entry.parent, e) from None
        try:
            self._wait(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            # The temp names atomic_write gives the entry, its archive and its record.
            temp = re.compile(rf"^\.{re.escape(self.entry.name)}(\.zip|\.json)?"
                              r"\.[A-Za-z0-9_]{8}\.tmp$")
            stale = sorted(p for p in self.entry.parent.iterdir() if temp.match(p.name))
            for p in stale + [p for p in self.leftovers if p.exists()]:
                p.unlink(missing_ok=True)
                self.removed.append(p)
        except OSError as e:
            os.close(fd)
            raise _unwritable(self.entry.parent, e) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        if self.removed:
            log.info("removed leftovers of an interrupted download: %s",
                     ", ".join(p.name for p in self.removed))
        return self

    def _wait(self, fd: int) -> None:
        """Take the flock on ``fd``, polling while another process holds it; DataError
        naming the holder once ``wait`` seconds have gone by."""
        limit = LOCK_WAIT if self.wait is None else self.wait
        give_up = time.monotonic() + limit
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pid = read_pid(fd)
                holder = f"pid {pid}" if pid else "pid unknown"
            if time.monotonic() >= give_up:
                raise DataError(
                    f"cache entry {self.entry} is still being written by another fbtrain "
                    f"process ({holder}) after {limit:g} s of waiting; wait for it or stop it, "
                    "or set data.cache_dir to another folder")
            if not waited:
                log.info("waiting for %s, which is writing %s", holder, self.entry)
                waited = True
            time.sleep(_LOCK_POLL)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Let go (closing the descriptor drops the flock); the lock file stays, as
        RunDirLock's does (deleting it would let two processes lock two different files)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
        if expected is not None and _sha256_bytes(raw) != expected:
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


# ----------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """Maps each token of a fixed vocabulary to its index in ``tokens``; subclasses say
    what a token is (:meth:`pieces`) and how decoded tokens are joined (``joiner``)."""

    kind = ""  # the name saved in checkpoints (``"char"`` or ``"word"``)
    key = "tokens"  # the list's key in vocab.json (``"chars"`` or ``"words"``)
    unit = "token"  # what error messages call one token
    joiner = ""  # between decoded tokens
    start = "\n"  # the default prompt of ``fbtrain sample``

    def __init__(self, tokens: Sequence[str]):
        tokens = list(tokens)
        bad = [t for t in tokens if not self._valid(t)]
        if bad:
            raise DataError(f"vocabulary entries must be {self._what_valid}, got {bad[:3]!r}")
        if len(set(tokens)) != len(tokens):
            raise DataError(f"vocabulary has repeated {self.unit}s; it must list each one once")
        self.tokens: list[str] = tokens
        self._index = {t: i for i, t in enumerate(tokens)}

    _what_valid = "strings"

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str)

    def pieces(self, text: str) -> list[str]:
        """``text`` cut into tokens (not yet checked against the vocabulary)."""
        raise NotImplementedError

    @staticmethod
    def _show(token: str) -> str:
        """A token as an error message names it."""
        return repr(token)

    def text_stream(self) -> TextStream:
        """A decoder for ids that arrive one at a time (``fbtrain sample`` prints as it goes)."""
        return TextStream(self)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> LongTensor ``[tokens in text]``; unknown tokens raise DataError."""
        pieces = self.pieces(text)
        try:
            ids = [self._index[c] for c in pieces]
        except KeyError:
            missing = sorted(set(pieces) - self._index.keys())
            shown = ", ".join(self._show(c) for c in missing[:_MAX_LISTED])
            more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
            raise DataError(
                f"{len(missing)} {self.unit}(s) not in the vocabulary: {shown}{more}; "
                "the vocabulary comes from the training data"
            ) from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Ids (list or 1-D tensor) -> text (tokens joined by ``joiner``)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        n = len(self.tokens)
        # Checked up front: a negative id would otherwise index from the end silently.
        bad = [i for i in values if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise DataError(f"token id {bad[0]!r} is outside the vocabulary (0..{n - 1})")
        return self.joiner.join(self.tokens[i] for i in values)

    def to_dict(self) -> dict[str, list[str]]:
        return {self.key: list(self.tokens)}

    @classmethod
    def from_dict(cls, d: Any) -> Tokenizer:
        """A vocabulary dict, ``{"chars": [...]}``, ``{"words": [...]}`` or
        ``{"bytes": [...]}``, as its tokenizer (the one it names when called on
        :class:`Tokenizer` itself)."""
        classes = [cls] if cls is not Tokenizer else list(TOKENIZERS.values())
        for klass in classes:
            if isinstance(d, dict) and isinstance(d.get(klass.key), list):
                return klass(d[klass.key])
        shapes = " or ".join(f'{{"{k.key}": [...]}}' for k in classes)
        raise DataError(f"a vocabulary must look like {shapes}")

    def save(self, path: str | Path) -> Path:
        """Write ``vocab.json`` atomically; ``path`` is the file or a folder to put it in."""
        path = Path(path)
        if path.is_dir():
            path = path / VOCAB_FILE
        atomic_write_text(path, json.dumps(self.to_dict(), ensure_ascii=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a vocabulary written by :meth:`save` (the file, or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / VOCAB_FILE
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(f"{path}: vocabulary file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: cannot read vocabulary ({one_line(str(e))})") from None
        try:
            return cls.from_dict(d)
        except DataError as e:
            raise DataError(f"{path}: {e}") from None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.tokens == other.tokens  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.kind, tuple(self.tokens)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class CharTokenizer(Tokenizer):
    """One token per character (the text corpora)."""

    kind, key, unit, joiner, start = "char", "chars", "character", "", "\n"
    _what_valid = "single characters"

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str) and len(token) == 1

    @property
    def chars(self) -> list[str]:
        return self.tokens

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary of the sorted distinct characters of ``text`` (65 for Tiny Shakespeare)."""
        return cls(sorted(set(text)))

    def pieces(self, text: str) -> list[str]:
        return list(text)


class WordTokenizer(Tokenizer):
    """One token per whitespace-separated word; decoding joins words with single spaces."""

    kind, key, unit, joiner = "word", "words", "word", " "
    _what_valid = "words without whitespace"

    def __init__(self, tokens: Sequence[str]):
        super().__init__(tokens)
        self.start = self.tokens[0] if self.tokens else ""  # e.g. END: a new program starts

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str) and bool(token) and token.split() == [token]

    def pieces(self, text: str) -> list[str]:
        return text.split()


class ByteTokenizer(Tokenizer):
    """One token per byte (enwik8: bits per character are bits per byte, as published).

    A token is the byte ``b`` as the one-character string ``chr(b)`` (its latin-1 reading),
    so vocab.json and checkpoints keep a list of strings like the other tokenizers. Bytes
    go in and come out unchanged, invalid UTF-8 included (:meth:`decode_bytes`); text
    (a prompt) is encoded as UTF-8, and :meth:`decode` reads the bytes as UTF-8 with
    U+FFFD for what is not.
    """

    kind, key, unit, joiner, start = "byte", "bytes", "byte", "", "\n"
    _what_valid = "single characters below U+0100 (one per byte value)"

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str) and len(token) == 1 and ord(token) < 256

    @staticmethod
    def _show(token: str) -> str:
        return f"0x{ord(token):02x}"

    @classmethod
    def from_bytes(cls, data: bytes) -> ByteTokenizer:
        """Vocabulary of the sorted distinct bytes of ``data``."""
        return cls([chr(b) for b in sorted(set(data))])

    def pieces(self, text: str | bytes) -> list[str]:  # type: ignore[override]
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return [chr(b) for b in raw]

    def decode_bytes(self, ids: torch.Tensor | Sequence[int]) -> bytes:
        """Ids -> the exact bytes they stand for."""
        return super().decode(ids).encode("latin-1")

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Ids -> text: the bytes read as UTF-8, U+FFFD where they are not valid UTF-8."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def text_stream(self) -> TextStream:
        return Utf8Stream(self)


class TextStream:
    """Decodes ids one at a time into the text they continue (one per generated sample)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def feed(self, token_id: int) -> str:
        """The text token ``token_id`` adds (joined as :meth:`Tokenizer.decode` joins)."""
        return self.tokenizer.joiner + self.tokenizer.tokens[token_id]

    def end(self) -> str:
        """Text still held back when the ids stop (none here)."""
        return ""


class Utf8Stream(TextStream):
    """Bytes to text as they arrive: a character split over several bytes is written once
    it is whole, so the streamed text equals :meth:`ByteTokenizer.decode` of all the ids."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._decoder.decode(bytes([ord(self.tokenizer.tokens[token_id])]))

    def end(self) -> str:
        return self._decoder.decode(b"", final=True)


TOKENIZERS: dict[str, type[Tokenizer]] = {"char": CharTokenizer, "word": WordTokenizer,
                                          "byte": ByteTokenizer}


def make_tokenizer(tokens: Sequence[str], kind: str | None = "char") -> Tokenizer:
    """The tokenizer a checkpoint saved: its ``vocab`` list and ``tokenizer`` kind (absent in
    checkpoints from before word vocabularies: ``char``)."""
    klass = TOKENIZERS.get(kind or "char")
    if klass is None:
        raise DataError(f"unknown tokenizer kind {kind!r}; known: {', '.join(TOKENIZERS)}")
    return klass(tokens)


# ----------------------------------------------------------------------------- split, batches


def split(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``int(n * (1 - val_fraction))`` ids for training, the rest for validation.

    Tiny Shakespeare (1,115,394 chars) with 0.1 gives 1,003,854 / 111,540. The tiny epsilon
    keeps float noise (e.g. 0.7 * 10 = 6.9999...) from losing a token; it never rounds up
    a genuine fraction, which is what the documented split relies on.
    """
    if not 0 < val_fraction <= MAX_VAL_FRACTION:  # also refuses NaN
        raise DataError(f"data.val_fraction = {val_fraction}: must be > 0 and <= "
                        f"{MAX_VAL_FRACTION}")
    n = len(ids)
    n_train = min(n, max(0, math.floor(n * (1 - val_fraction) + 1e-9)))
    train, val = ids[:n_train], ids[n_train:]
    if len(train) < 2 or len(val) < 2:
        raise DataError(
            f"text too short to split: {n} tokens with data.val_fraction = {val_fraction} "
            f"gives {len(train)} train / {len(val)} validation; each needs at least 2"
        )
    return train, val


def _check_data(data: torch.Tensor) -> None:
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise TypeError("data must be a 1-D tensor of token ids")


def require_tokens(n: int, seq_len: int, what: str) -> None:
    """Raise DataError unless ``n`` tokens hold one window of ``seq_len`` inputs + target."""
    if n < seq_len + 1:
        raise DataError(
            f"{what} too short for seq_len {seq_len}: {n} tokens, need at least {seq_len + 1};"
            " use a shorter curriculum seq_len or a longer text"
        )


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from its parts whose stream is unrelated to other parts' streams.

    Hashing, because seed + rank would make rank 1 of seed s replay rank 0 of seed s + 1.
    """
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class BatchSampler:
    """Random training windows from one split, reproducible from ``(seed, rank)``.

    ``data`` is a :class:`Stream` (inputs and targets) or a 1-D tensor of ids (its
    next-token stream). It owns a CPU ``torch.Generator`` (not the global RNG), so model
    code that draws random numbers (dropout) cannot shift which batches come next, and
    saving its state is enough to resume the exact batch sequence.
    """

    def __init__(self, data: torch.Tensor | Stream, seed: int, rank: int = 0):
        self.stream = as_stream(data)
        self.seed = int(seed)
        self.rank = int(rank)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(derived_seed("fbtrain", self.seed, self.rank))

    def sample(
        self, batch_size: int, seq_len: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs x and targets y, LongTensors ``[batch_size, seq_len]`` (for a text, y is x
        shifted by one)."""
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        n = len(self.stream.inputs)  # predictions (a text: tokens - 1)
        require_tokens(n + 1, seq_len, "training text")
        starts = torch.randint(0, n - seq_len + 1, (batch_size,), generator=self.generator)
        index = starts[:, None] + torch.arange(seq_len)
        # One host->device copy; x and y are made contiguous on the device so that callers
        # may .view() them (e.g. flattening targets for cross-entropy).
        inputs, targets = self.stream
        pair = torch.stack([window(inputs, index), window(targets, index)])
        x, y = pair.to(device, non_blocking=True)
        return x.contiguous(), y.contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Generator state (uint8 tensor) plus seed/rank: safe for ``torch.load(weights_only)``."""
        return {"generator": self.generator.get_state(), "seed": self.seed, "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next batches equal those after it was taken."""
        gen = state["generator"]
        if not isinstance(gen, torch.Tensor):
            raise DataError("batch sampler state is corrupt: 'generator' is not a tensor")
        # A checkpoint loaded with map_location='cuda' moves it; the generator needs CPU bytes.
        self.generator.set_state(gen.detach().to("cpu", torch.uint8))


def fixed_windows(
    data: torch.Tensor | Stream, seq_len: int, count: int, context: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic evaluation windows: x, y ``[count', context + seq_len]`` spread evenly
    over ``data`` (a :class:`Stream`, or ids: their next-token stream), the first
    ``context`` targets of each set to :data:`IGNORE_INDEX`.

    With ``context`` > 0 every scored prediction runs on memory filled by ``context``
    earlier tokens, as in training with carried memory. ``count' = min(count, n // (context
    + seq_len))`` for ``n`` predictions: the number of windows that do not overlap. Starts
    run from the first prediction to the last possible one, so the windows sample the whole
    split and every call (and every run) sees the same ones.
    """
    stream = as_stream(data)
    if count < 1 or seq_len < 1 or context < 0:
        raise ValueError(f"count and seq_len must be >= 1 and context >= 0, got {count}, "
                         f"{seq_len}, {context}")
    n, span = len(stream.inputs), context + seq_len
    what = "validation text" + (f" (with {context} tokens of context)" if context else "")
    require_tokens(n + 1, span, what)
    k = min(count, n // span)
    last = n - span
    # Integer spacing: floor(i * last / (k - 1)); consecutive starts differ by >= span.
    starts = torch.tensor([i * last // (k - 1) for i in range(k)] if k > 1 else [0])
    index = starts[:, None] + torch.arange(span)
    x, y = window(stream.inputs, index), window(stream.targets, index)
    y[:, :context] = IGNORE_INDEX
    return x, y


class StreamLayout:
    """The split cut into contiguous streams, for training with carried memory.

    ``n_streams * world_size`` streams of ``length`` inputs each; rank r owns streams
    ``[r * n_streams, (r + 1) * n_streams)``, so ranks never share a token. Stream s reads
    inputs ``data[s * length : (s + 1) * length]`` and their next tokens as targets (the
    one after its last input is the next stream's first), so one pass over all streams
    feeds every token of ``data[: n_streams * world_size * length]`` exactly once; the
    fewer than ``n_streams * world_size + 1`` tokens left at the end are never read.
    :meth:`segment` walks all streams together; at the end of the streams it wraps to
    their start, and the caller resets the memory there. The layout is a function of the
    data and the rank alone: its only state is the cursor.
    """

    def __init__(self, data: torch.Tensor | Stream, n_streams: int, rank: int = 0,
                 world_size: int = 1):
        stream = as_stream(data)
        if n_streams < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need n_streams >= 1 and 0 <= rank < world_size, got "
                             f"{n_streams}, {rank}, {world_size}")
        total = n_streams * world_size
        self.length = len(stream.inputs) // total
        if self.length < 1:
            raise DataError(f"training text too short for {total} streams: "
                            f"{len(stream.inputs) + 1} tokens, need at least {total + 1}; "
                            "use a smaller train.batch_size")
        self.stream = stream
        self.starts = (rank * n_streams + torch.arange(n_streams)) * self.length  # [n_streams]
        self.cursor = 0

    def segment(self, seq_len: int, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The next ``seq_len`` inputs and targets of every stream, x, y ``[n_streams, T]``
        (``T`` shorter at the end of the streams), and whether they start the streams (the
        carried memory must then be empty)."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        begin = self.cursor
        end = min(begin + seq_len, self.length)
        self.cursor = end % self.length
        index = self.starts[:, None] + torch.arange(begin, end)
        x, y = torch.stack([window(self.stream.inputs, index),
                            window(self.stream.targets, index)]).to(device)
        return x.contiguous(), y.contiguous(), begin == 0

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; refuses a state made for streams of another length."""
        if state.get("length") != self.length:
            raise DataError(f"carried streams of length {state.get('length')} do not fit this "
                            f"data and batch (streams of {self.length} tokens); resume with "
                            "the same data, batch size and number of ranks")
        self.cursor = int(state["cursor"])
