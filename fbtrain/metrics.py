"""Metrics behind one small interface: JSONL file, TensorBoard, progress bar / plain lines.

The trainer talks only to :class:`MetricsLogger`. With ``enabled=False`` (non-zero DDP ranks)
every method does nothing and no file is created - the "null backend" - so the training
loop never has to ask which rank it is on before logging.

Files in the run directory:

- ``metrics.jsonl``: one JSON object per :meth:`MetricsLogger.log` call, ``{"step": N, ...}``,
  flushed at once so a killed run keeps every line it logged;
- ``tb/``: TensorBoard events (scalars, text samples, hyperparameters).
"""

from __future__ import annotations

import json
import math
import numbers
import sys
import time
from pathlib import Path
from typing import IO, Any

from fbtrain.io import FileWriteError, atomic_write_text, write_error

JSONL_NAME = "metrics.jsonl"
TB_DIR = "tb"
# Keys the console line formats specially, in this order, before any others.
_CONSOLE_ORDER = ("loss", "bpc", "seq_len", "tokens_per_sec", "tok/s")


class MetricsLogger:
    """Log training metrics to ``run_dir/metrics.jsonl``, TensorBoard and the console.

    Args:
        run_dir: run directory; ``None`` logs to the console only.
        tensorboard: write TensorBoard events under ``run_dir/tb``.
        console: print progress lines and messages (a bar on a terminal).
        progress: show a tqdm bar when stdout is a terminal (plain lines otherwise).
        total_steps: the step training stops at (for the bar and the ETA); 0 if unknown.
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
        self.console = console
        self.show_progress = progress
        self.total_steps = total_steps
        self.initial_step = initial_step
        self._jsonl: IO[str] | None = None
        self._writer: Any = None
        self._bar: Any = None
        self._start = time.perf_counter()
        self._last_step = initial_step  # newest step seen; final hparams are logged there
        self._closed = False
        if enabled and tensorboard and self.run_dir is not None:
            self._writer = self._open_tensorboard()

    # ------------------------------------------------------------------ paths

    @property
    def jsonl_path(self) -> Path | None:
        return self.run_dir / JSONL_NAME if self.run_dir is not None else None

    @property
    def tb_dir(self) -> Path | None:
        return self.run_dir / TB_DIR if self.run_dir is not None else None

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "") -> None:
        """Record ``metrics`` at ``step``: one JSONL line and one TensorBoard scalar each.

        Keys are used as given (after ``prefix``); TensorBoard tags without a slash get
        ``train/`` in front (``loss`` -> ``train/loss``; ``val/loss``, ``mem_weight/0`` stay).
        Non-numeric values go to the JSONL line only.
        """
        if not self.enabled:
            return
        self._last_step = max(self._last_step, int(step))
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if f"{prefix}{key}" != "step":  # the step argument is the one source of truth
                record[f"{prefix}{key}"] = _plain(value)
        self._write_jsonl(record)
        if self._writer is not None:
            for key, value in record.items():
                if key == "step" or not _is_number(value):
                    continue
                tag = key if "/" in key else f"train/{key}"
                self._writer.add_scalar(tag, value, step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Log a text (e.g. a generated sample) to TensorBoard and print it on the console.

        Text is kept out of ``metrics.jsonl``, which stays one flat metrics record per line.
        """
        if not self.enabled:
            return
        if self._writer is not None:
            # TensorBoard renders text as markdown; a code block keeps line breaks and spaces.
            self._writer.add_text(tag, "```\n" + text + "\n```", step)
        self.info(f"[{tag} @ step {step}]\n{text}")

    def log_hparams(self, hparams: dict[str, Any], final_metrics: dict[str, Any]) -> None:
        """Record the run's hyperparameters and final metrics in TensorBoard's HPARAMS tab.

        Nested dicts are flattened with dots (``train.lr``); values that are not
        int/float/str/bool become strings. Metric keys get an ``hparam/`` prefix so their
        single point does not land on the training curves of the same name.
        """
        if not self.enabled or self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        flat = {k: _hparam_value(v) for k, v in _flatten(hparams).items()}
        metrics = {
            (k if k.startswith("hparam/") else f"hparam/{k}"): float(_plain(v))
            for k, v in final_metrics.items()
            if _is_number(_plain(v))
        }
        # SummaryWriter.add_hparams(run_name=".") would write the same summaries, but through
        # a second writer and so a second events file in tb/; writing them with our own
        # writer keeps one file per run and the hparams in the same TensorBoard run.
        # Logged at the last step, so a later resume from an earlier step purges these too.
        exp, ssi, sei = hparams_summary(flat, metrics)
        file_writer = self._writer._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary, self._last_step)
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, self._last_step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        """Keep only JSONL records with ``step <= step`` (atomic rewrite), for resuming.

        Lines that do not parse (a line cut short when a run was killed) are dropped too.
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
        for line in self.jsonl_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) \
                    and record["step"] <= step:
                kept.append(line + "\n")
        atomic_write_text(self.jsonl_path, "".join(kept))

    # ------------------------------------------------------------------ console

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        """Show progress at ``step``: move the bar on a terminal, else print one plain line.

        ``postfix`` holds what to show beside the step (loss, bpc, seq_len, tokens_per_sec,
        anything else), e.g. ``step 120/2000 | loss 2.1034 | bpc 3.0347 | seq_len 64 |
        12,345 tok/s | eta 3m12s``.
        """
        if not self.enabled or not self.console:
            return
        parts = _format_postfix(postfix)
        if self.show_progress and _isatty(sys.stdout):
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
        if not self.enabled or not self.console:
            return
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stdout)
        else:
            print(message, file=sys.stdout, flush=True)

    # ------------------------------------------------------------------ lifecycle

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the JSONL file, the TensorBoard writer and the bar (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        failed: FileWriteError | None = None
        for name, closer in (("tb", self._close_writer), (JSONL_NAME, self._close_jsonl)):
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
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.flush()
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

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is a dependency, but don't die for a plot.
            self.info(f"warning: TensorBoard logging is off ({e}); metrics.jsonl still written")
            return None
        # Steps up to initial_step were logged by the run being resumed (and are kept, like
        # truncate_after(initial_step) keeps them); purge_step drops events from later steps,
        # which the resumed run is about to log again, so curves don't double back.
        purge = self.initial_step + 1 if self.initial_step > 0 else None
        return SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge)

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        if self.jsonl_path is None:
            return
        if self._jsonl is None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            needs_newline = _ends_without_newline(self.jsonl_path)
            # Held open for the logger's life (closed in close()), not per line.
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
            if needs_newline:
                # A killed run can leave half a line; start ours on a fresh one.
                self._jsonl.write("\n")
        # default=: a stray tensor or array must cost a less tidy line, not the training run.
        try:
            self._jsonl.write(json.dumps(record, default=_json_fallback) + "\n")
            self._jsonl.flush()
        except OSError as e:  # a full disk: say which file, in one line
            raise FileWriteError(e.errno, e.strerror, str(self.jsonl_path)) from None

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


# ----------------------------------------------------------------------------- helpers


def _plain(value: Any) -> Any:
    """0-d tensors and numpy scalars -> Python numbers (JSON and TensorBoard want those)."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _json_fallback(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _format_postfix(postfix: dict[str, Any]) -> list[str]:
    keys = [k for k in _CONSOLE_ORDER if k in postfix]
    keys += [k for k in postfix if k not in keys and k != "step"]
    parts = []
    for key in keys:
        value = _plain(postfix[key])
        if key in ("tokens_per_sec", "tok/s") and _is_number(value):
            parts.append(f"{value:,.0f} tok/s")
        elif key == "lr" and _is_number(value):
            parts.append(f"lr {value:.2e}")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4f}" if math.isfinite(value) else f"{key} {value}")
        else:
            parts.append(f"{key} {value}")
    return parts


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _hparam_value(value: Any) -> int | float | str | bool:
    value = _plain(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


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
