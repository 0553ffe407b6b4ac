"""Progress of long work (evaluation, long samples, downloads, waiting for a lock): a calm
tqdm line on a terminal, within 80 columns; off a terminal, plain lines at most every
:data:`PLAIN_EVERY` seconds (no carriage returns), or nothing where the caller says so.

The training run's own status line is :mod:`fbtrain.metrics.console`'s; this module is for
everything else, and sits at the bottom of the import order so that the data layer (the
download) can use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from typing import IO, Any

from tqdm import tqdm

WIDTH = 80  # columns a progress line may take at most (fewer on a narrower terminal)
PLAIN_EVERY = 30.0  # seconds between two plain lines off a terminal
REDRAW_EVERY = 0.5  # seconds between two redraws of a line on a terminal (tqdm's mininterval)
# tqdm's own line without the bar graphic: the figures, calm, in a few columns.
BAR_FORMAT = "{desc}: {percentage:3.0f}% | {n_fmt}/{total_fmt} {unit} | {elapsed}<{remaining}"
OPEN_FORMAT = "{desc} | {elapsed}"  # work without a known end (a wait): the time so far


def isatty(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for anything that cannot say)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def note(message: str) -> None:
    """``message`` as a line on stderr, flushed; nothing when stderr is closed or gone
    (``2>&-``, a reader that left): a note must never cost the work it describes."""
    stream = sys.stderr
    if stream is None:  # Python's stderr when descriptor 2 was closed at start
        return
    with contextlib.suppress(OSError, ValueError):
        print(message, file=stream, flush=True)


def terminal_width(stream: Any) -> int:
    """Columns of the terminal ``stream`` is (else COLUMNS when set, else 80)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or WIDTH
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size((WIDTH, 24)).columns


def line_width(stream: Any) -> int:
    """Columns for a progress line on ``stream``: the terminal's, at most :data:`WIDTH`,
    less the last column (writing into it wraps on some terminals)."""
    return max(20, min(WIDTH, terminal_width(stream))) - 1


class Progress:
    """``with Progress(total, desc=..., unit=...) as p: p.update(n)``.

    On a terminal (``file``, default stderr) a tqdm line, removed when the work ends. Off a
    terminal: with ``plain=True`` one plain line every :data:`PLAIN_EVERY` seconds
    (``desc: 34% (12.3 of 36.0 MB)``), else nothing, so a script reading stderr sees only
    what it asked for. ``total`` None: work without a known end (a wait), shown with its
    elapsed time. ``scale``: ``n`` counts bytes, shown as kB/MB.
    """

    def __init__(self, total: int | None, *, desc: str, unit: str = "", scale: bool = False,
                 plain: bool = False, file: IO[str] | None = None):
        self.total, self.desc, self.unit, self.scale = total, desc, unit, scale
        self.file = file if file is not None else sys.stderr
        self.n = 0
        self._start = time.monotonic()
        self._plain = plain and self.file is not None and not isatty(self.file)
        self._last_plain = time.monotonic()
        self._bar: tqdm | None = None
        if isatty(self.file):
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, unit_scale=scale, file=self.file,
                leave=False, ncols=line_width(self.file), mininterval=REDRAW_EVERY,
                bar_format=BAR_FORMAT if total else OPEN_FORMAT, disable=None)

    def update(self, n: int = 1) -> None:
        """``n`` more units done (for a wait: call with 0 to refresh the elapsed time)."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            if n == 0:
                self._bar.refresh()
        elif self._plain and time.monotonic() - self._last_plain >= PLAIN_EVERY:
            self._last_plain = time.monotonic()
            try:
                self.file.write(self.plain_line() + "\n")
                self.file.flush()
            except (OSError, ValueError):  # stderr gone: the work goes on, unreported
                self._plain = False

    def plain_line(self) -> str:
        """``downloading tinyshakespeare.txt: 34% (379 kB of 1.12 MB)`` (a log file's line)."""
        if not self.total:
            waited = tqdm.format_interval(time.monotonic() - self._start)
            done = f"{amount(self.n, self.unit, self.scale)}, " if self.n else ""
            return f"{self.desc}: {done}{waited} so far"
        return (f"{self.desc}: {100 * self.n // self.total}% ("
                f"{amount(self.n, self.unit, self.scale)} of "
                f"{amount(self.total, self.unit, self.scale)})")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def amount(n: int, unit: str, scale: bool = False) -> str:
    """``1,234 windows`` or, for bytes (``scale``), ``1.2 MB`` as tqdm shows them."""
    if scale:
        if n < 1000:
            return f"{n} bytes" if unit else str(n)
        sized = tqdm.format_sizeof(n, divisor=1000)  # 1.12M
        number = sized.rstrip("kMGTPEZY")
        return f"{number} {sized[len(number):]}{unit}".rstrip()
    return f"{n:,} {unit}".rstrip()
