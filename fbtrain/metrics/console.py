"""What the terminal shows while a run trains: progress, messages, the ETA.

On a terminal one status line is redrawn in place, fitted to its width; elsewhere (a log
file, a pipe) each progress call prints one plain line. Losing the console (a closed pipe,
a closed terminal) never costs the run.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

from fbtrain.metrics.values import is_number, plain

# Keys the console line formats specially, in this order, before any others.
_CONSOLE_ORDER = ("loss", "bpc", "seq_len", "tokens_per_sec", "tok/s")
_CLEAR_TO_END = "\x1b[K"  # ANSI: erase from the cursor to the end of the line


class Console:
    """Progress and messages on stdout.

    On a terminal the progress is one status line, redrawn in place and fitted to the
    terminal's width (:func:`status_line`); messages are printed above it. Elsewhere each
    progress call prints one plain line (:func:`plain_line`).

    Args:
        enabled: print anything at all (False: a DDP rank other than 0).
        quiet: print only results (:meth:`result`): no progress, no messages (``--quiet``).
        progress: redraw a status line when stdout is a terminal (plain lines otherwise).
        total_steps: the step training stops at (for the ETA); 0 if unknown.
        initial_step: the step a resumed run starts from (0 for a fresh run).
    """

    def __init__(self, *, enabled: bool = True, quiet: bool = False, progress: bool = True,
                 total_steps: int = 0, initial_step: int = 0):
        self.enabled = enabled
        self.quiet = quiet
        self.show_progress = progress
        self.total_steps = total_steps
        self.initial_step = initial_step
        self._status = ""  # the status line now on the terminal ("" when none)
        self._start = time.perf_counter()

    @property
    def talks(self) -> bool:
        """Whether progress and messages are printed (not quiet, not a silent rank)."""
        return self.enabled and not self.quiet

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        """Show progress at ``step``: redraw the status line on a terminal, else print a
        plain line. ``postfix`` holds what to show beside the step (loss, bpc, seq_len,
        tokens_per_sec, lr, anything else)."""
        if not self.talks:
            return
        eta = self._eta(step)
        with self._guard():
            if self.show_progress and isatty(sys.stdout):
                self._status = status_line(step, self.total_steps, postfix, eta,
                                           terminal_width())
                sys.stdout.write("\r" + self._status + _CLEAR_TO_END)
                sys.stdout.flush()
                return
            print(plain_line(step, self.total_steps, postfix, eta), file=sys.stdout,
                  flush=True)

    def info(self, message: str) -> None:
        """Print a message (above the status line when one is shown) unless quiet."""
        if self.talks:
            self._print(message)

    def result(self, message: str) -> None:
        """Print a result (the run's summary): shown even when quiet, as the last line."""
        if self.enabled:
            self.finish()
            self._print(message)

    def finish(self) -> None:
        """Leave the status line on the terminal as an ordinary line (idempotent)."""
        if self._status:
            with self._guard():
                sys.stdout.write("\n")
                sys.stdout.flush()
            self._status = ""

    def close(self) -> None:
        """End the console: the status line, if one is shown, stays as a line."""
        if self.enabled:
            self.finish()

    def _print(self, message: str) -> None:
        with self._guard():
            if self._status:  # clear the status line, print, then draw it again below
                sys.stdout.write("\r" + _CLEAR_TO_END + message + "\n" + self._status)
                sys.stdout.flush()
            else:
                print(message, file=sys.stdout, flush=True)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Losing the console never costs the run: when stdout is gone (a closed pipe such
        as ``| head``, a closed terminal) the console is switched off and training goes on,
        still writing metrics.jsonl, TensorBoard and checkpoints."""
        try:
            yield
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EIO, errno.ENXIO):
                raise
            self.enabled = False
            self._status = ""
            silence_stdout()

    def _eta(self, step: int) -> str | None:
        done = step - self.initial_step
        if not self.total_steps or done <= 0:
            return None
        per_step = (time.perf_counter() - self._start) / done
        return format_duration(max(0, self.total_steps - step) * per_step)


def plain_line(step: int, total: int, postfix: dict[str, Any], eta: str | None) -> str:
    """``step 120/2000 | loss 2.1034 | bpc 3.0347 | seq_len 64 | 12,345 tok/s | eta 3m12s``:
    one line of a log file, everything in it."""
    line = " | ".join([f"step {step}/{total}" if total else f"step {step}",
                       *format_postfix(postfix)])
    return line + (f" | eta {eta}" if eta is not None else "")


def status_line(step: int, total: int, postfix: dict[str, Any], eta: str | None,
                width: int) -> str:
    """The terminal's status line, at most ``width - 1`` characters (the last column is
    left free: writing into it wraps on some terminals).

    ``step 120/2000 6% | loss 2.1034 | 12,345 tok/s | eta 3m12s | lr 1.20e-03 | seq_len 64``.
    Step, loss, tokens/s and the ETA come first and stay; what does not fit (bpc first,
    then the sequence length, then the learning rate) is left out, never cut in half.
    """
    head = f"step {step}/{total} {100 * step // total}%" if total else f"step {step}"
    known = {k: v for k, v in postfix.items() if k != "step"}
    keep = [k for k in ("loss", "tokens_per_sec", "tok/s") if k in known]
    optional = [k for k in ("accuracy", "lr", "seq_len", "bpc") if k in known]
    optional += [k for k in known if k not in keep and k not in optional]

    def text(keys: list[str]) -> str:
        parts = [head, *format_postfix({k: known[k] for k in keep})]
        if eta is not None:
            parts.append(f"eta {eta}")
        parts += format_postfix({k: known[k] for k in keys}, ordered=False)
        return " | ".join(parts)

    while optional and len(text(optional)) > width - 1:
        optional.pop()  # the least wanted is last
    return text(optional)[:max(1, width - 1)]


def terminal_width() -> int:
    """Columns of the terminal stdout is (COLUMNS when set, else 80 when unknown)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size((80, 24)).columns


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that writes (and Python's flush at exit) to a console
    that is gone raise nothing more."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def format_postfix(postfix: dict[str, Any], *, ordered: bool = True) -> list[str]:
    """The parts of a progress line, each formatted for reading; ``ordered``: the keys of
    ``_CONSOLE_ORDER`` first (else as given)."""
    keys = [k for k in _CONSOLE_ORDER if k in postfix] if ordered else []
    keys += [k for k in postfix if k not in keys and k != "step"]
    parts = []
    for key in keys:
        value = plain(postfix[key])
        if key in ("tokens_per_sec", "tok/s") and is_number(value):
            parts.append(f"{value:,.0f} tok/s")
        elif key == "lr" and is_number(value):
            parts.append(f"lr {value:.2e}")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4f}" if math.isfinite(value) else f"{key} {value}")
        else:
            parts.append(f"{key} {value}")
    return parts


def format_duration(seconds: float) -> str:
    """``42s``, ``3m12s``, ``2h05m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def isatty(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for anything that cannot say)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
