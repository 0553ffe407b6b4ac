"""Shared test helpers: the import path, and a loopback HTTP server for download tests."""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# tests/reference.py is imported by several test files and by scripts/benchmark.py.
sys.path.insert(0, str(Path(__file__).parent))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# A shell without job control starts a background job (`make test &`, `( ... & )`) with
# SIGINT ignored, and every process it starts inherits that: the CLI children of the
# Ctrl-C tests would then ignore the SIGINT they are sent (one hung for its 600 s timeout).
# As the tests' own process would at a terminal, take Ctrl-C again: a Python handler is
# reset to the default in each child, where an ignored signal stays ignored.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _stop_signals_as_they_were() -> Iterator[None]:
    """A run stopped by a signal in-process ignores further signals until the process
    exits (train/signals.py): put the handlers back after every test, so no later test
    (whichever shares the process, as under pytest-xdist) starts children that ignore
    Ctrl-C."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, handler in before.items():
        if handler is not None:  # None: set outside Python, left as it is
            signal.signal(s, handler)


@dataclass
class Server:
    """A local HTTP server; ``hits[path]`` counts requests, ``release`` ends stalls.

    ``routes[path]`` is served as it is; ``body`` is what /flaky, /stall-body, /short
    and /gate send. /trickle sends ``trickle`` one byte every 0.2 s. /gate sets ``at_gate`` once its
    headers are out, then holds the body back until ``gate`` is set.
    """

    base: str
    hits: Counter = field(default_factory=Counter)
    release: threading.Event = field(default_factory=threading.Event)
    flaky_failures: int = 1  # /flaky answers 500 this many times, then the body
    body: bytes = b""
    routes: dict[str, bytes] = field(default_factory=dict)
    trickle: bytes = b"x" * 20  # 4 s at a byte per 0.2 s: longer than any test's deadline
    gate: threading.Event = field(default_factory=threading.Event)
    at_gate: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str) -> str:
        return self.base + path


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """A real HTTP server on 127.0.0.1 in a thread: downloads are tested offline."""
    # A proxy from the environment would swallow requests to 127.0.0.1.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    lock = threading.Lock()
    state: dict[str, Server] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def _send(self, code: int, body: bytes = b"") -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            srv = state["srv"]
            with lock:
                srv.hits[self.path] += 1
                count = srv.hits[self.path]
            if self.path in srv.routes:
                self._send(200, srv.routes[self.path])
            elif self.path == "/error":
                self._send(500, b"boom")
            elif self.path == "/flaky":
                self._send(500 if count <= srv.flaky_failures else 200, srv.body)
            elif self.path == "/stall":  # never sends headers
                srv.release.wait(5)
            elif self.path == "/stall-body":  # headers and half the body, then nothing
                self.send_response(200)
                self.send_header("Content-Length", str(len(srv.body)))
                self.end_headers()
                self.wfile.write(srv.body[: len(srv.body) // 2])
                self.wfile.flush()
                srv.release.wait(5)
            elif self.path == "/short":  # half the body, then the connection closes
                self.send_response(200)
                self.send_header("Content-Length", str(len(srv.body)))
                self.end_headers()
                self.wfile.write(srv.body[: len(srv.body) // 2])
                self.close_connection = True
            elif self.path == "/trickle":  # every byte resets a per-read timeout
                self.send_response(200)
                self.send_header("Content-Length", str(len(srv.trickle)))
                self.end_headers()
                try:
                    for i in range(len(srv.trickle)):
                        self.wfile.write(srv.trickle[i:i + 1])
                        self.wfile.flush()
                        if srv.release.wait(0.2):
                            break
                except OSError:  # the client gave up and closed the connection
                    pass
            elif self.path == "/gate":
                self.send_response(200)
                self.send_header("Content-Length", str(len(srv.body)))
                self.end_headers()
                self.wfile.flush()
                srv.at_gate.set()
                srv.gate.wait(5)
                self.wfile.write(srv.body)
            else:
                self._send(404, b"not here")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    state["srv"] = srv = Server(base=f"http://127.0.0.1:{httpd.server_address[1]}")
    # A short poll interval keeps shutdown() (hence each test's teardown) quick.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.gate.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def bounded_run(args: list[str], memory: int = 4 << 30, timeout: float = 120
                ) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in a subprocess with at most ``memory`` bytes of address space and
    ``timeout`` seconds: a read of /dev/zero or /dev/urandom that a regression lets through
    fails (MemoryError, TimeoutExpired) instead of taking the machine's memory or the suite."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit)


@pytest.fixture
def refused_url() -> str:
    """A URL on a port where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/text.txt"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run faster (and steadier on a busy machine) on one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def extensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty TORCH_EXTENSIONS_DIR, here and for subprocesses."""
    root = tmp_path / "extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.delenv("CXX", raising=False)
    return root
