"""What the command line sets up before anything else runs: standard streams that exist,
and SIGTERM / SIGHUP that stop a command the way Ctrl-C does.

- A command started with a standard stream closed (``fbtrain train ... >&-`` or ``2>&-``)
  has no ``sys.stdout`` (Python sets it to None) and a free descriptor 1: the first file
  opened would take that number, and everything written to "stdout" - by a compiler that
  torch runs, say - would land in it. So a closed descriptor 0, 1 or 2 is opened on
  ``/dev/null`` first, and ``sys.stdin`` / ``sys.stdout`` / ``sys.stderr`` read or write
  it: output with no reader is dropped, as a closed pipe's is.
- Python's default for SIGTERM and SIGHUP ends the process on the spot, with no clean-up
  (a run directory's lock file, a temp file, a half-built C++ core's compiler left
  running) and no word. :func:`stop_like_ctrl_c` makes them raise :class:`Stopped`, a
  KeyboardInterrupt, so every clean-up written for Ctrl-C runs for them too; the command
  line then prints one line and exits with 128 + the signal's number (143, 129). The
  training loop installs its own handlers (``fbtrain.train.signals``: save, then stop) and
  puts these back after. A signal the caller ignores (``nohup``) stays ignored.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from fbtrain.errors import signal_exit_code

STREAMS = ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w"))
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside the training loop: unwinds like Ctrl-C. ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(interrupt: BaseException | None) -> int:
    """128 + the signal's number, as shells report a process a signal ended: 130 for Ctrl-C
    (a plain KeyboardInterrupt, or None: not known which)."""
    return signal_exit_code(getattr(interrupt, "signum", signal.SIGINT))


def prepare_process() -> None:
    """Both, in the order that matters: descriptors first (nothing opened yet may take 1)."""
    reopen_closed_streams()
    stop_like_ctrl_c()


def reopen_closed_streams() -> None:
    """Open ``/dev/null`` on each of descriptors 0, 1, 2 that is closed, and point the
    ``sys`` stream of that number at it."""
    for fd, name, mode in STREAMS:
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself, if lower
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        stream = open(fd, mode, encoding="utf-8", closefd=False)  # noqa: SIM115 (for life)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def stop_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP raise :class:`Stopped` (where their handler is the default)."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _raise_stopped)


def _raise_stopped(signum: int, frame: Any) -> None:
    # Once: a second signal while the first unwinds must not cut its clean-up short.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)
