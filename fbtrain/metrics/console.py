"""What the terminal shows while a run trains: progress, messages, the ETA.

On a terminal a tqdm bar moves; elsewhere (a log file, a pipe) each progress call prints one
plain line. Losing the console (a closed pipe, a closed terminal) never costs the run.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from fbtrain.metrics.values import is_number, plain

# Keys the console line formats specially, in this order, before any others.
_CONSOLE_ORDER = ("loss", "bpc", "seq_len", "tokens_per_sec", "tok/s")


class Console:
    """Progress and messages on stdout.

    Args:
        enabled: print anything at all (False: ``--quiet``, or a DDP rank other than 0).
        progress: show a tqdm bar when stdout is a terminal (plain lines otherwise).
        total_steps: the step training stops at (for the bar and the ETA); 0 if unknown.
        initial_step: the step a resumed run starts from (0 for a fresh run).
    """

    def __init__(self, *, enabled: bool = True, progress: bool = True, total_steps: int = 0,
                 initial_step: int = 0):
        self.enabled = enabled
        self.show_progress = progress
        self.total_steps = total_steps
        self.initial_step = initial_step
        self._bar: Any = None
        self._start = time.perf_counter()

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        """Show progress at ``step``: move the bar on a terminal, else print one plain line.

        ``postfix`` holds what to show beside the step (loss, bpc, seq_len, tokens_per_sec,
        anything else), e.g. ``step 120/2000 | loss 2.1034 | bpc 3.0347 | seq_len 64 |
        12,345 tok/s | eta 3m12s``.
        """
        if not self.enabled:
            return
        parts = format_postfix(postfix)
        with self._guard():
            if self.show_progress and isatty(sys.stdout):
                bar = self._get_bar()
                if step >= bar.n:
                    bar.update(step - bar.n)  # update() (not n=) keeps tqdm's rate estimate.
                else:
                    bar.n = step
                bar.set_postfix_str(" | ".join(parts), refresh=True)
                return
            total = f"/{self.total_steps}" if self.total_steps else ""
            line = " | ".join([f"step {step}{total}", *parts])
            eta = self._eta(step)
            if eta is not None:
                line += f" | eta {eta}"
            print(line, file=sys.stdout, flush=True)

    def info(self, message: str) -> None:
        """Print a message (above the bar when one is shown) unless the console is off."""
        if not self.enabled:
            return
        with self._guard():
            if self._bar is not None:
                from tqdm import tqdm

                tqdm.write(message, file=sys.stdout)
            else:
                print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Close the bar, if one is shown (idempotent)."""
        if self._bar is not None:
            with self._guard():
                self._bar.close()
            self._bar = None

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
            self._bar = None
            silence_stdout()

    def _get_bar(self) -> Any:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_steps or None, initial=self.initial_step, unit="step",
                file=sys.stdout, dynamic_ncols=True,
            )
        return self._bar

    def _eta(self, step: int) -> str | None:
        done = step - self.initial_step
        if not self.total_steps or done <= 0:
            return None
        per_step = (time.perf_counter() - self._start) / done
        return format_duration(max(0, self.total_steps - step) * per_step)


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that writes (and Python's flush at exit) to a console
    that is gone raise nothing more."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def format_postfix(postfix: dict[str, Any]) -> list[str]:
    """The parts of a progress line: known keys first, each formatted for reading."""
    keys = [k for k in _CONSOLE_ORDER if k in postfix]
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
