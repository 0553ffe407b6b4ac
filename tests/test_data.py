"""Tests for fbtrain.data (fetch, text, tokenizers, streams, samplers): download/cache
against a real local HTTP server, tokenizer, split and batches. Offline and fast: the
server runs on 127.0.0.1 in a thread."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from conftest import Server, bounded_run

from fbtrain.config import DataConfig
from fbtrain.config.budget import format_bytes, physical_memory
from fbtrain.config.limits import MemoryLimit
from fbtrain.data import fetch
from fbtrain.data import text as text_module
from fbtrain.data.corpus import load_corpus
from fbtrain.data.errors import DataError
from fbtrain.data.fetch import cache_dir, download
from fbtrain.data.samplers import BatchSampler, SegmentReader, fixed_windows
from fbtrain.data.sources import SOURCES, Source
from fbtrain.data.streams import IGNORE_INDEX, split
from fbtrain.data.text import TEXT_MEMORY_PER_BYTE, load_text
from fbtrain.data.tokenizers import CharTokenizer

TEXT = "".join(f"Line {i}: To be, or not to be, that is the question.\n" for i in range(200))
BODY = TEXT.encode("utf-8")
SHA = hashlib.sha256(BODY).hexdigest()


@pytest.fixture
def server(server: Server) -> Server:
    """The loopback server (conftest.py) serving this file's text."""
    server.body = BODY
    server.routes["/text.txt"] = BODY
    return server


def cfg(tmp_path: Path, url: str, sha256: str | None = SHA, **kw: object) -> DataConfig:
    return DataConfig(dataset="tiny", url=url, sha256=sha256,
                      cache_dir=str(tmp_path / "cache"), **kw)


def key(name: str, url: str) -> str:
    """The cache entry of dataset ``name`` downloaded from a URL other than its usual one
    (the layout the docs describe: name, "@", 16 hex digits of the URL's sha256)."""
    return f"{name}@{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def listing(folder: Path) -> list[str]:
    """What ``folder`` holds, temp files included, less the entries' lock files (which
    stay, like a run directory's .lock)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


# ----------------------------------------------------------------------------- download


def test_download_then_cache_hit(tmp_path: Path, server: Server) -> None:
    c = cfg(tmp_path, server.url("/text.txt"))
    assert load_text(c) == TEXT
    assert server.hits["/text.txt"] == 1
    assert listing(tmp_path / "cache") == [key("tiny", server.url("/text.txt")) + ".txt"]
    assert load_text(c) == TEXT  # served from the cache: no second request
    assert server.hits["/text.txt"] == 1


def test_cache_without_checksum_is_reused(tmp_path: Path, server: Server) -> None:
    c = cfg(tmp_path, server.url("/text.txt"), sha256=None)
    (tmp_path / "cache").mkdir()
    entry = tmp_path / "cache" / (key("tiny", server.url("/text.txt")) + ".txt")
    entry.write_text("already here\n", encoding="utf-8")
    assert load_text(c) == "already here\n"
    assert server.hits["/text.txt"] == 0


def test_corrupt_cache_is_downloaded_again(tmp_path: Path, server: Server) -> None:
    c = cfg(tmp_path, server.url("/text.txt"))
    (tmp_path / "cache").mkdir()
    entry = tmp_path / "cache" / (key("tiny", server.url("/text.txt")) + ".txt")
    entry.write_text("truncated", encoding="utf-8")
    assert load_text(c) == TEXT
    assert server.hits["/text.txt"] == 1
    assert entry.read_bytes() == BODY


def test_checksum_mismatch_names_both_hashes_and_leaves_nothing(
    tmp_path: Path, server: Server
) -> None:
    wrong = "0" * 64
    with pytest.raises(DataError, match=f"expected {wrong}, got {SHA}") as info:
        load_text(cfg(tmp_path, server.url("/text.txt"), sha256=wrong))
    assert "\n" not in str(info.value)
    assert listing(tmp_path / "cache") == []  # no file, no temp file
    assert server.hits["/text.txt"] == 1  # a mismatch is not retried


def test_404_fails_at_once(tmp_path: Path, server: Server) -> None:
    with pytest.raises(DataError, match=r"could not download .*/nope: HTTP 404.*data\.path"):
        download(server.url("/nope"), tmp_path / "x.txt", None, retries=3, backoff=0)
    assert server.hits["/nope"] == 1
    assert list(tmp_path.iterdir()) == []


def test_500_is_retried_then_fails(tmp_path: Path, server: Server) -> None:
    with pytest.raises(DataError, match=r"HTTP 500.*after 3 attempts.*--set data\.path=FILE"):
        download(server.url("/error"), tmp_path / "x.txt", None, retries=3, backoff=0.01)
    assert server.hits["/error"] == 3
    assert list(tmp_path.iterdir()) == []


def test_transient_500_then_success(tmp_path: Path, server: Server) -> None:
    dest = download(server.url("/flaky"), tmp_path / "x.txt", SHA, retries=3, backoff=0)
    assert dest.read_bytes() == BODY
    assert server.hits["/flaky"] == 2
    assert list(tmp_path.iterdir()) == [dest]


def test_connection_refused(tmp_path: Path, refused_url: str) -> None:
    with pytest.raises(DataError, match=r"could not download .*refused.*--set data\.path=FILE"):
        download(refused_url, tmp_path / "x.txt", None, retries=2, backoff=0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", ["/stall", "/stall-body"])
def test_stalled_server_times_out(tmp_path: Path, server: Server, path: str) -> None:
    with pytest.raises(DataError, match=r"timed out.*after 2 attempts"):
        download(server.url(path), tmp_path / "x.txt", None, timeout=0.2, retries=2, backoff=0)
    assert server.hits[path] == 2
    assert list(tmp_path.iterdir()) == []  # the half-written temp file is gone


def test_bad_url_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="could not download not-a-url"):
        download("not-a-url", tmp_path / "x.txt", None, backoff=0)


# ----------------------------------------------------------------------------- local files, cache


def test_local_path_never_touches_network(tmp_path: Path, server: Server) -> None:
    local = tmp_path / "mine.txt"
    local.write_text("hello world\n", encoding="utf-8")
    c = cfg(tmp_path, server.url("/text.txt"), path=str(local))
    assert load_text(c) == "hello world\n"
    assert sum(server.hits.values()) == 0
    assert not (tmp_path / "cache").exists()


def test_local_path_with_unreachable_url(tmp_path: Path, refused_url: str) -> None:
    local = tmp_path / "mine.txt"
    local.write_text("offline\n", encoding="utf-8")
    assert load_text(cfg(tmp_path, refused_url, path=str(local))) == "offline\n"


def test_a_byte_order_mark_is_not_a_character_of_the_text(tmp_path: Path, server: Server,
                                                          refused_url: str) -> None:
    """A UTF-8 file an editor began with a byte-order mark: U+FEFF became a character of
    the vocabulary, without a word. It marks the encoding and is dropped, local or
    downloaded; a file of a mark alone is empty."""
    local = tmp_path / "bom.txt"
    local.write_bytes(b"\xef\xbb\xbf" + BODY)
    assert load_text(cfg(tmp_path, refused_url, path=str(local))) == TEXT
    server.routes["/bom.txt"] = b"\xef\xbb\xbf" + BODY
    assert load_text(cfg(tmp_path, server.url("/bom.txt"), sha256=None)) == TEXT
    local.write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(DataError, match=f"data.path {local} is empty"):
        load_text(cfg(tmp_path, refused_url, path=str(local)))
    local.write_text("\ufeffa\ufeffb\n")  # only the first one marks the encoding
    assert load_text(cfg(tmp_path, refused_url, path=str(local))) == "a\ufeffb\n"


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "file not found"), (b"", "is empty"), (b"ok\xff\xfe", "not valid UTF-8"),
     ("dir", "is a folder")],
)
def test_local_path_problems_name_the_file(
    tmp_path: Path, refused_url: str, content: bytes | str | None, match: str
) -> None:
    local = tmp_path / "input.txt"
    if content == "dir":
        local.mkdir()
    elif content is not None:
        local.write_bytes(content)
    with pytest.raises(DataError, match=f"data.path {local}.*{match}"):
        load_text(cfg(tmp_path, refused_url, path=str(local)))


# load_text(data.path=argv[1], data.url=argv[2]) in a subprocess; prints the DataError.
_LOAD_TEXT = ("import sys\nfrom fbtrain.config import DataConfig\n"
              "from fbtrain.data.errors import DataError\nfrom fbtrain.data.text import load_text\n"
              "try:\n    load_text(DataConfig(path=sys.argv[1], url=sys.argv[2]))\n"
              "except DataError as e:\n    print(e)\n")


@pytest.mark.parametrize(("where", "kind"), [("/dev/zero", "a character device"),
                                             ("/dev/urandom", "a character device")])
def test_local_path_that_is_not_a_regular_file_is_refused_at_once(
    tmp_path: Path, refused_url: str, where: str, kind: str
) -> None:
    """/dev/zero was read until a MemoryError; a FIFO would wait for a writer for ever (in a
    subprocess with a timeout, so a regression fails instead of hanging the suite)."""
    path = Path(where) if where.startswith("/") else tmp_path / where
    if where == "fifo":
        os.mkfifo(path)
    if not path.exists():
        pytest.skip(f"{path} does not exist here")
    result = bounded_run([sys.executable, "-c", _LOAD_TEXT, str(path), refused_url])
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"data.path {path} is {kind}, not a text file; point it at a text "
                             "file\n")


def test_local_path_may_be_a_pipe(tmp_path: Path, refused_url: str) -> None:
    """``--set data.path=<(zcat text.gz)``: a FIFO is waited on and read to its end."""
    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(b"piped text\n",))
    writer.start()
    try:
        assert load_text(cfg(tmp_path, refused_url, path=str(fifo))) == "piped text\n"
    finally:
        writer.join(30)


_PRINT_TEXT = ("import sys\nfrom fbtrain.config import DataConfig\n"
               "from fbtrain.data.text import load_text\n"
               "print(repr(load_text(DataConfig(path=sys.argv[1], url=sys.argv[2]))))\n")


def test_a_named_pipe_without_a_writer_says_it_waits_for_one(
        tmp_path: Path, refused_url: str) -> None:
    """mkfifo as data.path, no program writing it: the process blocked before printing
    anything. Now one line says it waits for a writer; the writer comes, the text is read.
    (A subprocess: a regression that blocks fails at the deadline, not the suite.)"""
    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", _PRINT_TEXT, str(fifo), refused_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 120)
        assert ready, "no word on stderr: still blocked?"
        assert proc.stderr.readline() == (
            f"data.path {fifo} is a named pipe (FIFO) that no program writes to yet: waiting "
            "for one (Ctrl-C to stop)\n")
        fifo.write_bytes(b"piped text\n")  # returns once the waiting reader has it open
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert (out, err, proc.returncode) == ("'piped text\\n'\n", "", 0)
    # A pipe with its writer already there (`printf ... | fbtrain`) is read without a word.
    piped = subprocess.run(["sh", "-c", f'printf "more\\n" | {sys.executable} -c '
                            f'"$0" /dev/stdin {refused_url}', _PRINT_TEXT],
                           capture_output=True, text=True, timeout=120)
    assert (piped.stdout, piped.stderr) == ("'more\\n'\n", "")


def test_local_text_larger_than_memory_is_refused_before_reading(tmp_path: Path,
                                                                  refused_url: str) -> None:
    """A sparse file the size of this machine's memory: reading it as text needs 18 times
    that (measured: docs/datasets.md), so it is refused from its size alone, in no time and
    no memory. In a subprocess with a real address-space limit (4 GiB), which is the limit
    the message names: a regression that reads it fails, the machine stays."""
    memory = physical_memory()
    if memory is None:
        pytest.skip("this system does not say how much memory it has")
    local = tmp_path / "huge.txt"
    with local.open("wb") as f:
        f.truncate(memory)
    result = bounded_run([sys.executable, "-c", _LOAD_TEXT, str(local), refused_url])
    assert result.returncode == 0, result.stderr
    size = format_bytes(memory)
    assert re.fullmatch(
        rf"data\.path {re.escape(str(local))} is {re.escape(size)}: reading and tokenizing it "
        rf"needs about {re.escape(format_bytes(TEXT_MEMORY_PER_BYTE * memory))} of memory "
        rf"\({TEXT_MEMORY_PER_BYTE} bytes per byte of the file\) but this process may use "
        r"[\d.]+ [MG]iB \(its address-space limit, RLIMIT_AS / ulimit -v, less what it has "
        r"mapped already\); use a smaller file\n", result.stdout), result.stdout


def test_a_text_is_held_against_what_the_process_may_use(
        tmp_path: Path, refused_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its memory limit (the least of the machine's, ulimit -v's and the cgroup's), not the
    machine's alone: a 2 GB sparse file under ulimit -v passed the check, then the kernel
    killed the process with no word."""
    local = tmp_path / "text.txt"
    local.write_bytes(b"x" * 1000)
    limit = MemoryLimit(1000 * TEXT_MEMORY_PER_BYTE - 1, "this process's cgroup allows",
                        " (memory.max)")
    monkeypatch.setattr(text_module, "available_memory", lambda: limit)
    need = format_bytes(1000 * TEXT_MEMORY_PER_BYTE)
    refusal = (f"data.path {local} is 1000 bytes: reading and tokenizing it needs about {need} "
               f"of memory ({TEXT_MEMORY_PER_BYTE} bytes per byte of the file) but this "
               f"process's cgroup allows {format_bytes(limit.size)} (memory.max); use a "
               "smaller file")
    with pytest.raises(DataError, match=f"^{re.escape(refusal)}$"):
        load_text(cfg(tmp_path, refused_url, path=str(local)))
    monkeypatch.setattr(text_module, "available_memory", lambda: MemoryLimit(10**6, "x"))
    assert load_text(cfg(tmp_path, refused_url, path=str(local))) == "x" * 1000


@pytest.mark.parametrize("failure", [
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                 "allocate memory: you tried to allocate 800000000 bytes. Error code 12"),
], ids=["MemoryError", "allocator"])
def test_running_out_of_memory_while_tokenizing_is_one_line(
        tmp_path: Path, refused_url: str, monkeypatch: pytest.MonkeyPatch,
        failure: BaseException) -> None:
    """A text that passes the size check whose tokenizing still fails to allocate (a limit
    lowered meanwhile, other memory in use) was a MemoryError traceback from list(text)."""
    local = tmp_path / "text.txt"
    local.write_text("to be or not to be\n")

    def encode(self: CharTokenizer, text: str) -> torch.Tensor:
        raise failure

    monkeypatch.setattr(CharTokenizer, "encode", encode)
    asked = " (it asked for 762.9 MiB)" if isinstance(failure, RuntimeError) else ""
    with pytest.raises(DataError, match=(
            rf"^data\.path {re.escape(str(local))}: out of memory reading and tokenizing "
            rf"it{re.escape(asked)}: .+; use a smaller file$")):
        load_corpus(cfg(tmp_path, refused_url, path=str(local)))
    failure = RuntimeError("a bug that is no allocation")  # keeps its traceback
    with pytest.raises(RuntimeError, match="^a bug that is no allocation$"):
        load_corpus(cfg(tmp_path, refused_url, path=str(local)))


def test_tokenizing_keeps_no_object_per_character() -> None:
    """encode held list(text): 8 bytes a character, and past U+00FF a string object of its
    own for each (about 80 bytes): a 20 MB Greek text peaked at 52 bytes per byte. Now the
    ids' list is the only Python object per character (measured by tracemalloc: exact)."""
    text = "".join(chr(0x391 + i % 25) for i in range(200_000))  # Greek letters
    tokenizer = CharTokenizer.from_text(text)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        ids = tokenizer.encode(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tokenizer.decode(ids) == text
    assert peak < 12 * len(text), peak / len(text)  # the ids' list: 8 bytes a character


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FBTRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir(DataConfig()) == tmp_path / "home" / ".cache" / "fbtrain"
    monkeypatch.setenv("FBTRAIN_CACHE", str(tmp_path / "env"))
    assert cache_dir(DataConfig()) == tmp_path / "env"
    assert cache_dir(DataConfig(cache_dir=str(tmp_path / "cfg"))) == tmp_path / "cfg"


def test_fbtrain_cache_env_is_used_for_downloads(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FBTRAIN_CACHE", str(tmp_path / "env"))
    c = DataConfig(dataset="tiny", url=server.url("/text.txt"), sha256=SHA)
    assert load_text(c) == TEXT
    assert (tmp_path / "env" / (key("tiny", server.url("/text.txt")) + ".txt")).read_bytes() == BODY


# ------------------------------------------------------------------- cache key, lock, deadline


def test_changing_the_url_downloads_from_the_new_one(tmp_path: Path, server: Server) -> None:
    other = "A different corpus altogether.\n" * 20
    server.routes["/other.txt"] = other.encode()
    assert load_text(cfg(tmp_path, server.url("/text.txt"))) == TEXT
    assert load_text(cfg(tmp_path, server.url("/other.txt"), sha256=None)) == other
    assert server.hits["/other.txt"] == 1
    # Both stay cached, each under its own key: going back downloads nothing.
    assert load_text(cfg(tmp_path, server.url("/text.txt"))) == TEXT
    assert load_text(cfg(tmp_path, server.url("/other.txt"), sha256=None)) == other
    assert dict(server.hits) == {"/text.txt": 1, "/other.txt": 1}


def test_cache_made_before_urls_were_keyed_serves_the_usual_address(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A regression guard (it passes on the old layout too): the usual address keeps the
    plain name, so nobody downloads Tiny Shakespeare again after upgrading."""
    monkeypatch.setitem(SOURCES, "tinyshakespeare", Source(server.url("/text.txt"), SHA, "char"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tinyshakespeare.txt").write_bytes(BODY)
    for url in (None, server.url("/text.txt")):  # null, or the usual address spelled out
        assert load_text(DataConfig(url=url, cache_dir=str(tmp_path / "cache"))) == TEXT
    assert sum(server.hits.values()) == 0


def test_download_that_is_not_text_is_refused_and_not_cached(tmp_path: Path, server: Server
                                                             ) -> None:
    url = server.url("/latin1.txt")
    server.routes["/latin1.txt"] = b"caf\xe9\n"
    with pytest.raises(DataError, match=rf"^{url} is not valid UTF-8 \(byte 3\); nothing was "
                       r"saved; check data.url, or work offline with --set data.path=FILE"):
        load_text(cfg(tmp_path, url, sha256=None))
    assert listing(tmp_path / "cache") == []
    server.routes["/latin1.txt"] = "café\n".encode()  # fixed upstream: the next run gets it
    assert load_text(cfg(tmp_path, url, sha256=None)) == "café\n"
    assert server.hits["/latin1.txt"] == 2


def test_refused_text_cached_by_older_versions_is_downloaded_again(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(SOURCES, "tinyshakespeare", Source(server.url("/text.txt"), SHA, "char"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tinyshakespeare.txt").write_bytes(b"caf\xe9\n")  # refused each run
    assert load_text(DataConfig(sha256=None, cache_dir=str(tmp_path / "cache"))) == TEXT
    assert server.hits["/text.txt"] == 1


def test_stale_temp_files_of_the_entry_are_removed(tmp_path: Path, server: Server) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = key("tiny", server.url("/text.txt")) + ".txt"
    (cache / f".{entry}.k9x_2ab7.tmp").write_bytes(BODY[:100])  # a kill -9 mid-download
    (cache / ".other.txt.k9x_2ab7.tmp").write_bytes(b"x")  # another entry's: may be live
    assert load_text(cfg(tmp_path, server.url("/text.txt"))) == TEXT
    assert listing(cache) == [".other.txt.k9x_2ab7.tmp", entry]


def test_entry_being_downloaded_elsewhere_is_waited_for_and_left_alone(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "LOCK_WAIT", 0.3)
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = key("tiny", server.url("/text.txt")) + ".txt"
    temp = cache / f".{entry}.k9x_2ab7.tmp"  # the live download's file
    temp.write_bytes(BODY[:100])
    with open(cache / f".{entry}.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        holder.write(f"{os.getpid()}\n")
        holder.flush()
        with pytest.raises(DataError, match=rf"^cache entry {cache / entry} is still being "
                           rf"written by another fbtrain process \(pid {os.getpid()}\) after "
                           r"0.3 s of waiting; wait for it or stop it, or set data.cache_dir"):
            load_text(cfg(tmp_path, server.url("/text.txt")))
    assert temp.exists() and server.hits["/text.txt"] == 0


def test_cache_on_a_file_system_without_flock_is_written_unlocked(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some network mounts refuse flock: the download goes ahead without the lock (as a run
    directory's does), and as nothing proves the entry's writers gone, their temp files
    stay (one may be a live download's)."""
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    cache = tmp_path / "cache"
    cache.mkdir()
    entry = key("tiny", server.url("/text.txt")) + ".txt"
    temp = cache / f".{entry}.k9x_2ab7.tmp"
    temp.write_bytes(BODY[:100])
    assert load_text(cfg(tmp_path, server.url("/text.txt"))) == TEXT
    assert temp.exists() and server.hits["/text.txt"] == 1


def test_two_downloads_of_one_entry_at_once_fetch_it_once(
    tmp_path: Path, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    waiting = threading.Event()

    class Spot(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("waiting for pid"):
                waiting.set()

    spot = Spot()
    logging.getLogger("fbtrain.data").addHandler(spot)
    caplog.set_level(logging.INFO, logger="fbtrain.data")
    c = cfg(tmp_path, server.url("/gate"))
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(load_text(c))) for _ in range(2)]
    try:
        threads[0].start()
        assert server.at_gate.wait(5)  # the first is mid-download, holding the lock
        threads[1].start()
        waiting.wait(5)  # the second waits for it (an unlocked one would reach the gate)
        server.gate.set()
        for t in threads:
            t.join(5)
    finally:
        logging.getLogger("fbtrain.data").removeHandler(spot)
    assert results == [TEXT, TEXT]
    assert server.hits["/gate"] == 1
    assert listing(tmp_path / "cache") == [key("tiny", server.url("/gate")) + ".txt"]


def test_trickling_server_meets_the_download_deadline(
    tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "DOWNLOAD_DEADLINE", 1.0)
    url = server.url("/trickle")
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"^could not download {url}: not finished within the "
                       r"download deadline of 1 s; check your connection, or work offline"):
        load_text(cfg(tmp_path, url, sha256=None))
    assert time.monotonic() - start < 3  # the trickle alone would take 4 s
    assert server.hits["/trickle"] == 1  # not retried: the deadline is for the whole download
    assert listing(tmp_path / "cache") == []


def test_body_cut_short_is_not_accepted(tmp_path: Path, server: Server) -> None:
    """A regression guard for reading the body as it arrives: a connection closed before
    Content-Length bytes came is a failed attempt, not a short file."""
    with pytest.raises(DataError, match=r"IncompleteRead.*after 2 attempts"):
        download(server.url("/short"), tmp_path / "x.txt", None, retries=2, backoff=0)
    assert server.hits["/short"] == 2 and list(tmp_path.iterdir()) == []


def test_deadline_bounds_the_retries_too(tmp_path: Path, server: Server) -> None:
    start = time.monotonic()
    with pytest.raises(DataError, match=r"not finished within the download deadline of 0.5 s"):
        download(server.url("/stall"), tmp_path / "x.txt", None, timeout=0.2, retries=100,
                 backoff=0, deadline=0.5)
    assert time.monotonic() - start < 2 and server.hits["/stall"] <= 4
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip() -> None:
    tok = CharTokenizer.from_text(TEXT)
    assert tok.chars == sorted(set(TEXT))
    assert tok.vocab_size == len(set(TEXT))
    ids = tok.encode(TEXT)
    assert ids.dtype == torch.long and ids.shape == (len(TEXT),)
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids.tolist()[:10]) == TEXT[:10]


def test_unknown_characters_are_named() -> None:
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(DataError, match=r"2 character\(s\) not in the vocabulary: 'é', 'ü'"):
        tok.encode("abcéüé")
    many = "".join(chr(0x4E00 + i) for i in range(15))
    with pytest.raises(DataError, match="and 5 more"):
        tok.encode(many)


def test_decode_rejects_out_of_range_ids() -> None:
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(DataError, match="token id -1"):
        tok.decode([0, -1])


def test_vocab_save_load(tmp_path: Path) -> None:
    tok = CharTokenizer.from_text("hello\nworld é")
    written = tok.save(tmp_path)  # a folder: vocab.json inside it
    assert written == tmp_path / "vocab.json"
    assert json.loads(written.read_text(encoding="utf-8")) == {"chars": tok.chars}
    assert CharTokenizer.load(tmp_path) == tok
    assert CharTokenizer.load(written).chars == tok.chars
    assert CharTokenizer.from_dict(tok.to_dict()) == tok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vocab.json"]  # no temp file left


def test_vocab_load_problems(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="vocabulary file not found"):
        CharTokenizer.load(tmp_path / "vocab.json")
    (tmp_path / "vocab.json").write_text('{"chars": ["a", "a"]}', encoding="utf-8")
    with pytest.raises(DataError, match="repeated characters"):
        CharTokenizer.load(tmp_path / "vocab.json")


# ----------------------------------------------------------------------------- split


def test_split_sizes() -> None:
    ids = torch.arange(1000)
    train, val = split(ids, 0.1)
    assert (len(train), len(val)) == (900, 100)
    assert torch.equal(torch.cat([train, val]), ids)
    for frac in (0.05, 0.2, 0.25, 0.3, 0.5):
        train, val = split(torch.arange(1000), frac)
        assert (len(train), len(val)) == (round(1000 * (1 - frac)), round(1000 * frac))


def test_split_tiny_shakespeare_arithmetic() -> None:
    train, val = split(torch.zeros(1_115_394, dtype=torch.long), 0.1)
    assert (len(train), len(val)) == (1_003_854, 111_540)


def test_split_too_short() -> None:
    with pytest.raises(DataError, match="text too short to split: 10 tokens"):
        split(torch.arange(10), 0.1)


def test_a_text_too_short_to_split_is_named(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("abcdefghij", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^data.path {re.escape(str(path))}: text too short "
                                        r"to split: 10 tokens"):
        load_corpus(DataConfig(path=str(path)))


# ----------------------------------------------------------------------------- batches


def test_batch_shapes_and_shift() -> None:
    data = torch.arange(500)
    x, y = BatchSampler(data, seed=0).sample(8, 16, "cpu")
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)  # contiguous windows of arange, shifted by one
    assert int(y.max()) < 500


def test_batches_deterministic_and_rank_specific() -> None:
    data = torch.arange(10_000)

    def draw(seed: int, rank: int = 0) -> list[torch.Tensor]:
        s = BatchSampler(data, seed=seed, rank=rank)
        return [s.sample(4, 8, "cpu")[0] for _ in range(3)]

    a, b = draw(1), draw(1)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(draw(1)[0], draw(2)[0])
    assert not torch.equal(draw(1, rank=0)[0], draw(1, rank=1)[0])


def test_sampler_state_restores_next_batches(tmp_path: Path) -> None:
    data = torch.arange(10_000)
    s = BatchSampler(data, seed=3)
    s.sample(4, 8, "cpu")
    torch.save(s.state_dict(), tmp_path / "state.pt")
    expected = [s.sample(4, 8, "cpu") for _ in range(3)]
    other = BatchSampler(data, seed=99)
    other.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for (x, y), (ex, ey) in zip((other.sample(4, 8, "cpu") for _ in range(3)), expected,
                                strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_sampler_does_not_use_global_rng() -> None:
    data = torch.arange(1000)
    torch.manual_seed(0)
    a = BatchSampler(data, seed=5).sample(4, 8, "cpu")[0]
    torch.manual_seed(123)
    torch.rand(10)
    b = BatchSampler(data, seed=5).sample(4, 8, "cpu")[0]
    assert torch.equal(a, b)


def test_sampler_text_too_short() -> None:
    s = BatchSampler(torch.arange(16), seed=0)
    s.sample(2, 15, "cpu")  # 16 tokens are exactly enough for seq_len 15
    with pytest.raises(DataError, match="too short for seq_len 16"):
        s.sample(2, 16, "cpu")


def test_fixed_windows() -> None:
    data = torch.arange(1000)
    x, y = fixed_windows(data, 10, 5)
    x2, y2 = fixed_windows(data, 10, 5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == y.shape == (5, 10)
    assert torch.equal(y, x + 1)
    starts = x[:, 0].tolist()
    assert starts[0] == 0 and int(y[-1, -1]) == 999  # spans the whole split
    assert all(b - a >= 10 for a, b in zip(starts[:-1], starts[1:], strict=True))  # no overlap
    x, _ = fixed_windows(data, 100, 1000)  # asks for more than fit
    assert x.shape == (9, 100)  # (1000 - 1) // 100
    with pytest.raises(DataError, match="too short for seq_len 1000"):
        fixed_windows(data, 1000, 1)


def test_fixed_windows_with_context_ignore_the_context_targets() -> None:
    data = torch.arange(1000)
    x, y = fixed_windows(data, 10, 5, context=20)
    assert x.shape == y.shape == (5, 30)
    assert (y[:, :20] == IGNORE_INDEX).all() and torch.equal(y[:, 20:], x[:, 20:] + 1)
    starts = x[:, 0].tolist()
    assert all(b - a >= 30 for a, b in zip(starts[:-1], starts[1:], strict=True))
    with pytest.raises(DataError, match=r"validation text \(with 990 tokens of context\) too "
                                        r"short for seq_len 1000"):
        fixed_windows(data, 10, 1, context=990)


@pytest.mark.parametrize("seq_len", [1, 4, 7, 40])
def test_stream_layout_reads_every_token_once_per_pass_across_ranks(seq_len: int) -> None:
    """2 ranks x 3 streams over 100 tokens: streams of 16 inputs, disjoint, covering tokens
    0..95 once per pass; targets are the next tokens; at the end they wrap, fresh."""
    data = torch.arange(100) * 10  # values != positions, so a shifted index would show
    seen: list[int] = []
    for rank in range(2):
        layout = SegmentReader(data, n_streams=3, rank=rank, world_size=2)
        assert layout.length == 16
        rows: list[list[int]] = [[], [], []]
        fresh = []
        while True:
            x, y, starts = layout.segment(seq_len)
            fresh.append(starts)
            assert x.shape == y.shape and x.shape[0] == 3 and 1 <= x.shape[1] <= seq_len
            assert torch.equal(y, x + 10)
            for row, values in zip(rows, x.tolist(), strict=True):
                row.extend(values)
            if layout.cursor == 0:
                break
        assert fresh[0] and not any(fresh[1:])
        assert [len(r) for r in rows] == [16] * 3  # whole streams, each contiguous
        assert all(r == list(range(r[0], r[0] + 160, 10)) for r in rows)
        seen += [v for r in rows for v in r]
        x, _, starts = layout.segment(seq_len)  # the next pass starts again, fresh
        assert starts and x[:, 0].tolist() == [r[0] for r in rows]
    assert sorted(seen) == list(range(0, 960, 10))  # no overlap, nothing skipped


def test_stream_layout_state_and_problems() -> None:
    layout = SegmentReader(torch.arange(50), n_streams=2)
    layout.segment(5)
    other = SegmentReader(torch.arange(50), n_streams=2)
    other.load_state_dict(layout.state_dict())
    assert torch.equal(other.segment(5)[0], layout.segment(5)[0])
    with pytest.raises(DataError, match="carried streams of length 24 do not fit"):
        SegmentReader(torch.arange(80), n_streams=2).load_state_dict(layout.state_dict())
    with pytest.raises(DataError, match="too short for 8 streams: 8 tokens, need at least 9"):
        SegmentReader(torch.arange(8), n_streams=4, rank=1, world_size=2)


# ----------------------------------------------------------------------------- window lengths


@pytest.mark.parametrize(("sets", "message"), [
    (["train.context=carry", "model.max_rel_pos=200"],
     "validation text too short: 300 tokens, but each validation window reads 200 of carried "
     "context (the memory window) and 200 scored (with train.context carry, a memory window) "
     "tokens, so it needs at least 401 (the memory window is model.max_rel_pos = 200, as "
     "model.mem_len is null); use a smaller model.mem_len, a larger data.val_fraction or a "
     "longer text"),
    (["train.context=carry", "model.max_rel_pos=200", "model.mem_len=150",
      "curriculum=[{seq_len: 180}]"],
     "validation text too short: 300 tokens, but each validation window reads 150 of carried "
     "context (the memory window) and 180 scored (the longest curriculum seq_len) tokens, so it "
     "needs at least 331 (the memory window is model.mem_len = 150); use a smaller "
     "model.mem_len, a shorter curriculum seq_len, a larger data.val_fraction or a longer text"),
    (["model.max_rel_pos=400", "curriculum=[{seq_len: 400}]"],
     "validation text too short: 300 tokens, but each validation window reads 400 scored (the "
     "longest curriculum seq_len) tokens, so it needs at least 401; use a shorter curriculum "
     "seq_len, a larger data.val_fraction or a longer text"),
])
def test_short_validation_text_names_the_keys_of_its_window(tmp_path: Path, sets: list[str],
                                                             message: str) -> None:
    """It said "too short for seq_len 400 ... use a shorter curriculum seq_len" for a length
    that came from model.max_rel_pos (200 of context + 200 scored), configured nowhere."""
    from typer.testing import CliRunner

    from fbtrain.cli import app

    text = tmp_path / "small.txt"
    text.write_text("".join(chr(97 + i % 26) for i in range(3000)), encoding="utf-8")
    args = ["train", "--config", str(Path(__file__).parent.parent / "configs" / "tiny.yaml"),
            "--device", "cpu", "--set", f"data.path={text}", "--set",
            f"run.out_dir={tmp_path / 'runs'}", *sum((["--set", s] for s in sets), [])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {message}\n"


def test_the_split_loses_no_token_to_float_noise() -> None:
    """90 * (1 - 0.3) is 62.99999... in floating point: the training split still gets 63."""
    train, val = split(torch.arange(90), 0.3)
    assert (len(train), len(val)) == (63, 27)
