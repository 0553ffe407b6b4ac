"""Stopping a run on a signal: SIGINT (Ctrl-C), SIGTERM and SIGHUP save, then exit.

The loop asks :class:`StopSignals` at the end of each step whether to stop; evaluation and
sampling, which can take long and change nothing, run in :meth:`StopSignals.interruptible`
blocks that a signal cuts short at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

# The signals that stop a run (each exits with fbtrain.errors.signal_exit_code). SIGHUP:
# the terminal (or SSH session) was closed.
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Under DDP a rank that received no signal stops for the most final one another rank got.
STOP_PRIORITY = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class StopRequested(BaseException):
    """Raised by :class:`StopSignals` inside an interruptible block (evaluation, sampling).

    A BaseException, like KeyboardInterrupt: no ``except Exception`` may swallow it."""


class StopSignals:
    """SIGINT / SIGTERM / SIGHUP ask the run to stop; it saves and exits with the first one's
    code (130 / 143 / 129).

    By default a signal only sets ``received``, and the loop stops at the end of the step,
    so an optimizer step or a save is never cut in half. Inside :meth:`interruptible`
    (evaluation and sampling: read-only work that can take long), the first signal also
    raises :class:`StopRequested` at once, and the loop saves and stops from there.

    Repeated signals change nothing: under torchrun every worker gets Ctrl-C twice (from the
    terminal and forwarded by the agent), and the save must still happen. After a stop the
    three signals stay ignored until the process exits: a second Ctrl-C while it shuts down
    (TensorBoard's writer threads, atexit) must neither print a traceback nor change the
    exit code. Without a signal the previous handlers are put back on exit.
    (SIGKILL remains for a user who cannot wait one step.) Handlers are only installed from
    the main thread (Python allows no other).
    """

    def __init__(self, *, allow_interrupts: bool = True) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        # Off under DDP: a rank leaving its evaluation early would reach the step's
        # collectives out of turn with the others; there every stop waits for the step.
        self._allow = allow_interrupts
        self._interruptible = False

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOPPING:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._interruptible = False
        for sig, handler in self._previous.items():
            # After a stop the process is on its way out with the first signal's code:
            # later signals are ignored until it exits (no KeyboardInterrupt traceback in
            # a writer thread's shutdown, no SIGTERM default turning 130 into 143).
            signal.signal(sig, handler if self.received is None else signal.SIG_IGN)
        self._previous.clear()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block a signal may cut short with :class:`StopRequested` (also one that came
        before the block began)."""
        if not self._allow:
            yield
            return
        if self.received is not None:
            raise StopRequested
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            return
        self.received = signum
        if self._interruptible:
            self._interruptible = False
            raise StopRequested
