"""The one metrics facade the trainer talks to, and ``metrics.jsonl``.

:class:`MetricsLogger` sends each record to the JSONL file, to TensorBoard
(:mod:`.tensorboard`) and to the console (:mod:`.console`). With ``enabled=False`` (non-zero
DDP ranks) every method does nothing and no file is created - the "null backend" - so the
training loop never has to ask which rank it is on before logging.

Files in the run directory:

- ``metrics.jsonl``: one JSON object per :meth:`MetricsLogger.log` call, ``{"step": N, ...}``,
  written at once so a killed run keeps every line it logged, and whole or not at all (a
  disk that fills mid-line leaves no half line);
- ``events.out.tfevents.*`` in the run directory and in its ``val/``
  sub-runs: TensorBoard events (see :mod:`.tensorboard` for the layout).

A file write that fails (a full disk, a file where TensorBoard's ``val/`` folder goes) does
not raise at once: it is kept as :attr:`MetricsLogger.failure`, nothing more is written to
the files, and the trainer saves the step it has just trained before it reports the failure
(:meth:`MetricsLogger.raise_failure`), so a log that cannot be written never costs a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fbtrain.io import FileWriteError, atomic_write_text, json_safe, write_error
from fbtrain.metrics.console import Console
from fbtrain.metrics.tensorboard import TensorBoardWriter
from fbtrain.metrics.values import plain
from fbtrain.rundir_names import METRICS


class MetricsLogger:
    """Log training metrics to ``run_dir/metrics.jsonl``, TensorBoard and the console.

    Args:
        run_dir: run directory; ``None`` logs to the console only.
        tensorboard: write TensorBoard events (the run directory and ``val/``).
        console: print progress and messages; False (``--quiet``) prints only results.
        progress: redraw one status line when stdout is a terminal (plain lines otherwise).
        total_steps: the step training stops at (for the ETA); 0 if unknown.
        initial_step: the step a resumed run starts from (0 for a fresh run).
        enabled: False makes every method a no-op (non-zero DDP ranks).
    """

    def __init__(
        self,
        run_dir: Path | None,
        *,
        tensorboard: bool = True,
        console: bool = True,
        progress: bool = True,
        total_steps: int = 0,
        initial_step: int = 0,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.console = Console(enabled=enabled, quiet=not console, progress=progress,
                               total_steps=total_steps, initial_step=initial_step)
        self.initial_step = initial_step
        self._jsonl: IO[bytes] | None = None
        self._tb: TensorBoardWriter | None = None
        # The first file write that failed; none is tried after it (see the module's doc).
        self.failure: OSError | None = None
        self._last_step = initial_step  # newest step seen; final hparams are logged there
        self._closed = False
        if enabled and tensorboard and self.run_dir is not None:
            try:
                self._tb = TensorBoardWriter.open(self.run_dir, initial_step)
            except ImportError as e:  # tensorboard is a dependency, but don't die for a plot
                self.info(f"warning: TensorBoard logging is off ({e}); metrics.jsonl still "
                          "written")

    @property
    def jsonl_path(self) -> Path | None:
        return self.run_dir / METRICS if self.run_dir is not None else None

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "") -> None:
        """Record ``metrics`` at ``step``: one JSONL line and one TensorBoard scalar each.

        Keys are used as given (after ``prefix``); their TensorBoard tags are
        :func:`fbtrain.metrics.tensorboard.tag_of`'s. Non-numeric values go to the JSONL
        line only.
        """
        if not self.enabled:
            return
        self._last_step = max(self._last_step, int(step))
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if f"{prefix}{key}" != "step":  # the step argument is the one source of truth
                record[f"{prefix}{key}"] = plain(value)
        self._write(self._write_jsonl, record)
        if self._tb is not None:
            self._write(self._tb.add_record, int(step), record)

    def log_text(self, step: int, tag: str, text: str, *, echo: bool = True) -> None:
        """Log a text (e.g. a generated sample) to TensorBoard; ``echo``: print it too.

        Text is kept out of ``metrics.jsonl``, which stays one flat metrics record per line.
        """
        if not self.enabled:
            return
        if self._tb is not None:
            self._write(self._tb.add_text, tag, text, step)
        if echo:
            self.info(text_block(tag, step, text))

    def start_run(self, hparams: dict[str, Any], *, memory_weights: bool = True,
                  labelled: bool = False) -> None:
        """Once, when a run starts afresh: the Custom Scalars layout and the HParams entry.

        ``hparams`` (see :func:`~fbtrain.metrics.tensorboard.hparams_of`) become the run's
        session in the HParams tab, with the scalar tags of ``HPARAM_METRICS`` as its
        metrics, so HParams shows the run's real (latest) validation loss. Floats stay
        numbers, booleans booleans; integers and any other value become strings. Written
        at step 0: a resume keeps them. ``labelled``: the data has accuracy to chart.
        """
        tb = self._tb
        if self.enabled and tb is not None:
            self._write(lambda: tb.start_run(hparams, memory_weights=memory_weights,
                                             labelled=labelled))

    def end_run(self) -> None:
        """Mark the HParams session finished (at the newest step, so a resume from an
        earlier one purges it along with the steps it repeats)."""
        if self.enabled and self._tb is not None:
            self._write(self._tb.end_run, self._last_step)

    def raise_failure(self) -> None:
        """Raise :attr:`failure`, the file write that failed, if one did: the trainer calls
        this once the step it trained is saved."""
        if self.failure is not None:
            raise self.failure

    def truncate_after(self, step: int) -> None:
        """Keep only JSONL records with ``step <= step`` (atomic rewrite), for resuming.

        Lines that do not parse (a line cut short when a run was killed, bytes that are not
        UTF-8) are dropped too.
        TensorBoard needs no help: the writer is opened with ``purge_step``.
        """
        if not self.enabled or self.jsonl_path is None:
            return
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if not self.jsonl_path.exists():
            return
        kept = []
        for raw in self.jsonl_path.read_bytes().splitlines():
            try:
                line = raw.decode("utf-8")
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):  # damaged: dropped like cut ones
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) \
                    and record["step"] <= step:
                kept.append(line + "\n")
        atomic_write_text(self.jsonl_path, "".join(kept))

    # ------------------------------------------------------------------ console

    def progress(self, step: int, postfix: dict[str, Any],
                 remaining: float | None = None) -> None:
        """Show progress at ``step``, ``remaining`` seconds left (see
        :meth:`.console.Console.progress`)."""
        self.console.progress(step, postfix, remaining)

    def info(self, message: str) -> None:
        """Print a message unless the console is off."""
        self.console.info(message)

    def result(self, message: str) -> None:
        """Print a result (the run's summary) as the last line, even with the console off."""
        self.console.result(message)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Flush and close the JSONL file, the TensorBoard writer and the bar (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.console.close()
        failed: FileWriteError | None = None
        for name, closer in (("tb", self._close_writer), (METRICS, self._close_jsonl)):
            try:
                closer()
            except Exception as e:  # a full disk: close the rest, then say so in one line
                failed = failed or write_error(self.run_dir / name if self.run_dir else name, e)
                if failed is None:
                    raise
        # Closing in a `finally` while another error (say, the full disk that stopped a
        # checkpoint save) unwinds: that error is the one to report, not this echo of it.
        if failed is not None and sys.exc_info()[1] is None:
            raise failed

    def _close_writer(self) -> None:
        writer, self._tb = self._tb, None
        if writer is not None:
            writer.close()

    def _close_jsonl(self) -> None:
        jsonl, self._jsonl = self._jsonl, None
        if jsonl is not None:
            jsonl.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _write(self, write: Callable[..., None], *args: Any) -> None:
        """``write(*args)`` to a file; its failure is kept as :attr:`failure`, not raised,
        and after one nothing more is written (see the module's docstring)."""
        if self.failure is not None:
            return
        try:
            write(*args)
        except OSError as e:
            self.failure = e

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        if self.jsonl_path is None:
            return
        # default=: a stray tensor or array must cost a less tidy line, not the training run.
        # json_safe: a non-finite figure is null, so every line is strict JSON.
        line = (json.dumps(json_safe(record), default=_json_fallback) + "\n").encode("utf-8")
        try:
            if self._jsonl is None:
                self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
                if _ends_without_newline(self.jsonl_path):
                    # A killed run can leave half a line; start ours on a fresh one.
                    line = b"\n" + line
                # Held open for the logger's life (closed in close()), not per line;
                # unbuffered, so nothing is left to write at close.
                self._jsonl = open(self.jsonl_path, "ab", buffering=0)  # noqa: SIM115
            append_whole(self._jsonl, line)
        except OSError as e:  # a full disk: say which file, in one line
            failed = write_error(self.jsonl_path, e)
            if failed is None:
                raise
            raise failed from None


def append_whole(f: IO[bytes], data: bytes) -> None:
    """Append ``data`` to the unbuffered file ``f`` whole or not at all: a write cut short
    (a disk that fills mid-line) is cut off the file again before the error is raised."""
    start = os.fstat(f.fileno()).st_size
    view = memoryview(data)
    try:
        while view:  # a regular file takes some bytes each call, or raises
            view = view[f.write(view) or 0:]
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(f.fileno(), start)
        raise


def text_block(tag: str, step: int, text: str) -> str:
    """A logged text as the console shows it: ``[sample @ step 300]`` and the text."""
    return f"[{tag} @ step {step}]\n{text}"


def _json_fallback(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _ends_without_newline(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False
