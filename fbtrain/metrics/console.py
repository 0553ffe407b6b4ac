"""What the terminal shows while a run trains: progress, messages, the ETA.

On a terminal one status line (a tqdm line, :class:`StatusBar`) is redrawn in place, fitted
to its width; elsewhere (a log file, a pipe) each progress call prints one plain line, no
carriage returns. Losing the console (a closed pipe, a closed terminal) never costs the run.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from fbtrain.io import write_error
from fbtrain.metrics.values import is_number, plain
from fbtrain.progress import isatty, note

# A console that is there but cannot take more: a full disk (or /dev/full), a file too big.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# Keys the console line formats specially, in this order, before any others.
_CONSOLE_ORDER = ("loss", "bpc", "seq_len", "tokens_per_sec")


class StatusBar(tqdm):
    """tqdm drawing the training status line (:func:`status_line`) at the step set by
    :meth:`show`. The ETA is tqdm's remaining time at the rate :meth:`show` is given (the
    measured rate of whole steps after warm-up), never tqdm's own guess from the first,
    slowest steps; the line is redrawn only when progress is reported (no monitor thread).
    """

    monitor_interval = 0  # no tqdm monitor thread: nothing to redraw between reports

    def __init__(self, total: int, step: int, postfix: dict[str, Any],
                 remaining: float | None, file: Any):
        self._postfix_items = dict(postfix)
        self._step_rate = _step_rate(total, step, remaining)
        super().__init__(total=total or None, initial=step, file=file, dynamic_ncols=True,
                         leave=True, mininterval=0, smoothing=0, bar_format="")

    def show(self, step: int, postfix: dict[str, Any], remaining: float | None) -> None:
        """Redraw the line at ``step``; ``remaining``: seconds left (None: not known yet)."""
        self._postfix_items = dict(postfix)
        self._step_rate = _step_rate(self.total or 0, step, remaining)
        self.n = step
        self.refresh()

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        self._unsized()  # tqdm checks the rows before it draws
        return super().display(msg, pos)

    def _unsized(self) -> None:
        """A terminal nobody sized (a bare pty) says 0 x 0, which tqdm reads as -1 x -1
        (it keeps a column and a row free) and then draws nothing, or its own line: taken
        as a terminal of unknown size instead (80 columns)."""
        if (self.ncols or 0) < 1:
            self.ncols = None
        if (self.nrows or 0) < 1:
            self.nrows = None

    @property
    def format_dict(self) -> dict[str, Any]:
        """tqdm's figures, with our rate (so ``{remaining}`` is the honest ETA) and our
        line as the format: everything but ``{remaining}`` written out."""
        d = super().format_dict
        d["rate"] = self._step_rate
        self._unsized()
        d["ncols"] = self.ncols
        total = self.total or 0
        eta = (self.format_interval(max(0, total - self.n) / self._step_rate)
               if total and self._step_rate else None)
        line = status_line(self.n, total, self._postfix_items, eta, self.ncols or 80)
        line = line.replace("{", "{{").replace("}", "}}")
        if eta is not None:
            line = line.replace(f"| eta {eta}", "| eta {remaining}", 1)
        d["bar_format"] = line
        return d


def _step_rate(total: int, step: int, remaining: float | None) -> float | None:
    """Steps per second that make tqdm's remaining time ``remaining`` (None: unknown)."""
    if remaining is None or not total:
        return None
    left = total - step
    return math.inf if left <= 0 or remaining <= 0 else left / remaining


class Console:
    """Progress and messages on stdout.

    On a terminal the progress is one status line (:class:`StatusBar`), redrawn in place
    and fitted to the terminal's width; messages are printed above it. Elsewhere each
    progress call prints one plain line (:func:`plain_line`).

    Args:
        enabled: print anything at all (False: a DDP rank other than 0).
        quiet: print only results (:meth:`result`): no progress, no messages (``--quiet``).
        progress: redraw a status line when stdout is a terminal (plain lines otherwise).
        total_steps: the step training stops at (the status line's total); 0 if unknown.
        initial_step: the step a resumed run starts from (0 for a fresh run).
    """

    def __init__(self, *, enabled: bool = True, quiet: bool = False, progress: bool = True,
                 total_steps: int = 0, initial_step: int = 0):
        self.enabled = enabled
        self.quiet = quiet
        self.show_progress = progress
        self.total_steps = total_steps
        self.initial_step = initial_step
        self._bar: StatusBar | None = None  # the status line now on the terminal

    @property
    def talks(self) -> bool:
        """Whether progress and messages are printed (not quiet, not a silent rank)."""
        return self.enabled and not self.quiet

    @property
    def status(self) -> str:
        """The status line now shown on the terminal ("" when none)."""
        return str(self._bar).rstrip() if self._bar is not None else ""

    def progress(self, step: int, postfix: dict[str, Any],
                 remaining: float | None = None) -> None:
        """Show progress at ``step``: redraw the status line on a terminal, else print a
        plain line. ``postfix`` holds what to show beside the step (loss, bpc, seq_len,
        tokens_per_sec, lr, anything else); ``remaining`` the seconds left (the ETA; None
        while not yet measured)."""
        if not self.talks:
            return
        with self._guard():
            if self.show_progress and isatty(sys.stdout):
                if self._bar is None:
                    self._bar = StatusBar(self.total_steps, step, postfix, remaining,
                                          sys.stdout)
                else:
                    self._bar.show(step, postfix, remaining)
                return
            eta = format_duration(remaining) if remaining is not None else None
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
        if self._bar is not None:
            with self._guard():
                self._bar.close()
            self._bar = None

    def close(self) -> None:
        """End the console: the status line, if one is shown, stays as a line."""
        if self.enabled:
            self.finish()

    def _print(self, message: str) -> None:
        with self._guard():
            if self._bar is not None:  # tqdm clears the line, prints, draws it again below
                StatusBar.write(message, file=sys.stdout)
                sys.stdout.flush()
            else:
                print(message, file=sys.stdout, flush=True)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Losing the console never costs the run: when stdout is gone (a closed pipe such
        as ``| head``, a closed terminal) or full (``> /dev/full``, a log on a full disk:
        said once on stderr) the console is switched off and training goes on, still
        writing metrics.jsonl, TensorBoard and checkpoints (whose own failure stops it)."""
        try:
            yield
        except OSError as e:
            full = write_error("stdout", e) if e.errno in _FULL else None
            if e.errno not in (errno.EPIPE, errno.EIO, errno.ENXIO) and full is None:
                raise
            if full is not None:
                note(f"warning: {full}; training goes on without console output (the run's "
                     "files are written as before)")
            self.enabled = False
            if self._bar is not None:
                self._bar.disable = True  # closing it must not write to the lost console
                self._bar = None
            silence_stdout()


class StatusLine:
    """The training run's status line: the figures of a logged step (:attr:`SHOWN`), the
    recent tokens/s and the time left, drawn by ``draw(step, figures, remaining)``.

    A process's first steps are not measured (warm-up), so a line drawn before any rate was
    has none; :meth:`add_rate` draws it again with the rate once there is one (its other
    figures the last shown: a status line, not a metrics record).
    """

    SHOWN = ("loss", "bpc", "accuracy", "seq_len", "lr")

    def __init__(self, draw: Callable[[int, dict[str, Any], float | None], None]):
        self._draw = draw
        self._shown: dict[str, Any] = {}
        self.lacks_rate = False  # the line shown has no rate yet

    def show(self, step: int, metrics: dict[str, Any], rate: float | None,
             remaining: float | None) -> None:
        """Draw ``metrics``' shown figures at ``step`` with ``rate`` (None: not measured
        yet) and ``remaining`` seconds."""
        shown = {k: metrics[k] for k in self.SHOWN if k in metrics}
        if rate is not None:
            shown["tokens_per_sec"] = rate
        self._draw(step, shown, remaining)
        self._shown, self.lacks_rate = shown, rate is None

    def add_rate(self, step: int, rate: float, remaining: float | None) -> None:
        """The line shown again at ``step``, now with ``rate`` and ``remaining``."""
        self._draw(step, {**self._shown, "tokens_per_sec": rate}, remaining)
        self.lacks_rate = False


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
    keep = [k for k in ("loss", "tokens_per_sec") if k in known]
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
        if key == "tokens_per_sec" and is_number(value):
            parts.append(f"{value:,.0f} tok/s")
        elif key == "lr" and is_number(value):
            parts.append(f"lr {value:.2e}")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4f}" if math.isfinite(value) else f"{key} {value}")
        else:
            parts.append(f"{key} {value}")
    return parts


def fit_parts(parts: list[str], width: int = 80) -> list[str]:
    """``parts`` joined by `` | `` into lines of at most ``width`` columns, broken only
    between parts (a part longer than a line gets a line of its own)."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " | " + part
        else:
            lines.append(part)
    return lines


def format_duration(seconds: float) -> str:
    """``42s``, ``3m12s``, ``2h05m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
