"""Metrics behind one small interface: JSONL file, TensorBoard, progress bar / plain lines.

The trainer talks only to :class:`MetricsLogger`. With ``enabled=False`` (non-zero DDP ranks)
every method does nothing and no file is created - the "null backend" - so the training
loop never has to ask which rank it is on before logging.

Files in the run directory:

- ``metrics.jsonl``: one JSON object per :meth:`MetricsLogger.log` call, ``{"step": N, ...}``,
  flushed at once so a killed run keeps every line it logged;
- ``events.out.tfevents.*``: TensorBoard events (scalars, text samples, hyperparameters,
  the chart layout), in the run directory itself, so that ``tensorboard --logdir runs``
  lists each run under its own name.

TensorBoard layout. Its first view (Time Series) groups charts by the tag up to the first
``/``, in natural sort order, and opens only the first two groups; so the losses get the
groups that sort first: ``loss/train`` and ``loss/val``, then ``loss_bpc/train`` and
``loss_bpc/val`` (bits per character). Everything else of the training steps stays under
``train/`` and ``val/``, the memory weights under ``mem_weight/``. The Custom Scalars tab
(:func:`chart_layout`) draws train and validation loss on one chart, bpc on another, and
the memory weights ``softmax(w)`` as one multi-line chart; the HParams tab compares runs by
:func:`hparams_of` with the validation loss as its metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import numbers
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from fbtrain.io import FileWriteError, atomic_write_text, json_safe, write_error
from fbtrain.schedule import Curriculum

if TYPE_CHECKING:
    from fbtrain.config import Config

JSONL_NAME = "metrics.jsonl"
EVENTS_GLOB = "events.out.tfevents.*"  # TensorBoard's event files, in the run directory
# Metric keys whose TensorBoard tag is not the key itself (see the module docstring).
TB_TAGS = {"loss": "loss/train", "val/loss": "loss/val",
           "bpc": "loss_bpc/train", "val/bpc": "loss_bpc/val",
           "accuracy": "accuracy/train", "val/accuracy": "accuracy/val"}
# What a chart shows, for TensorBoard's description of each tag (by tag or tag group).
TB_DESCRIPTIONS = {
    "loss/train": "Cross-entropy of the step's training batch, nats per character.",
    "loss/val": "Cross-entropy on the fixed validation windows (the same every evaluation), "
                "nats per character.",
    "loss_bpc": "Bits per character: the loss divided by ln 2.",
    "accuracy": "Share of the labelled targets (a labelled dataset: the value each print "
                "must output) whose arg-max prediction is right.",
    "mem_weight": "softmax(w): the share of the embedding (mem_weight/0) and of each layer's "
                  "output (mem_weight/1..L) in the memory vector every layer attends to.",
}
# HParams metrics: tags that are logged as scalars anyway (no one-point duplicates).
HPARAM_METRICS = {"loss/val": "val loss (nats)", "loss_bpc/val": "val bpc",
                  "loss/train": "train loss (nats)"}
# Train keys a user compares runs by; the rest (logging cadence, paths) is left out.
_TRAIN_HPARAMS = ("lr", "min_lr", "schedule", "warmup_steps", "weight_decay", "beta1", "beta2",
                  "grad_clip", "batch_size", "grad_accum", "max_steps", "constant_tokens",
                  "context")
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
        self._described: set[str] = set()  # tags whose description was written
        if enabled and tensorboard and self.run_dir is not None:
            self._writer = self._open_tensorboard()

    # ------------------------------------------------------------------ paths

    @property
    def jsonl_path(self) -> Path | None:
        return self.run_dir / JSONL_NAME if self.run_dir is not None else None

    @property
    def tb_dir(self) -> Path | None:
        """Where the event files go: the run directory itself (see the module docstring)."""
        return self.run_dir

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: dict[str, Any], *, prefix: str = "") -> None:
        """Record ``metrics`` at ``step``: one JSONL line and one TensorBoard scalar each.

        Keys are used as given (after ``prefix``). TensorBoard tags: the losses as
        :data:`TB_TAGS` says (``loss`` -> ``loss/train``, ``val/bpc`` -> ``loss_bpc/val``),
        other keys without a slash get ``train/`` in front (``lr`` -> ``train/lr``), keys
        with one stay (``val/perplexity``, ``mem_weight/0``). Non-numeric values go to the
        JSONL line only.
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
                tag = TB_TAGS.get(key) or (key if "/" in key else f"train/{key}")
                self._add_scalar(tag, value, step)

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

    def start_run(self, hparams: dict[str, Any], *, memory_weights: bool = True) -> None:
        """Once, when a run starts afresh: the Custom Scalars layout and the HParams entry.

        ``hparams`` (see :func:`hparams_of`) become the run's session in the HParams tab,
        with the scalar tags of :data:`HPARAM_METRICS` as its metrics, so HParams shows
        the run's real (latest) validation loss. Numbers stay numbers, booleans booleans;
        any other value becomes a string. Written at step 0: a resume keeps them.
        """
        if not self.enabled or self._writer is None:
            return
        from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

        values = {k: _hparam_value(v) for k, v in hparams.items()}
        kinds = {bool: api_pb2.DATA_TYPE_BOOL, str: api_pb2.DATA_TYPE_STRING}
        experiment = api_pb2.Experiment(
            hparam_infos=[api_pb2.HParamInfo(
                name=k, type=kinds.get(type(v), api_pb2.DATA_TYPE_FLOAT64))
                for k, v in values.items()],
            metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=name)
                          for tag, name in HPARAM_METRICS.items()])
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for key, value in values.items():
            # bool before int: True is an int too, and would show as 1.0.
            field = ("bool_value" if isinstance(value, bool) else
                     "string_value" if isinstance(value, str) else "number_value")
            setattr(start.hparams[key], field, value)
        file_writer = self._writer._get_file_writer()
        for summary in (_layout_summary(chart_layout(memory_weights)),
                        _hparams_summary(experiment=experiment),
                        _hparams_summary(session_start_info=start)):
            file_writer.add_summary(summary, 0)
        self._writer.flush()

    def end_run(self) -> None:
        """Mark the HParams session finished (at the newest step, so a resume from an
        earlier one purges it along with the steps it repeats)."""
        if not self.enabled or self._writer is None:
            return
        from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS,
                                             end_time_secs=time.time())
        summary = _hparams_summary(session_end_info=end)
        self._writer._get_file_writer().add_summary(summary, self._last_step)
        self._writer.flush()

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

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        """Show progress at ``step``: move the bar on a terminal, else print one plain line.

        ``postfix`` holds what to show beside the step (loss, bpc, seq_len, tokens_per_sec,
        anything else), e.g. ``step 120/2000 | loss 2.1034 | bpc 3.0347 | seq_len 64 |
        12,345 tok/s | eta 3m12s``.
        """
        if not self.enabled or not self.console:
            return
        parts = _format_postfix(postfix)
        with self._console_guard():
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
        with self._console_guard():
            if self._bar is not None:
                from tqdm import tqdm

                tqdm.write(message, file=sys.stdout)
            else:
                print(message, file=sys.stdout, flush=True)

    @contextlib.contextmanager
    def _console_guard(self) -> Iterator[None]:
        """Losing the console never costs the run: when stdout is gone (a closed pipe such
        as ``| head``, a closed terminal) the console is switched off and training goes on,
        still writing metrics.jsonl, TensorBoard and checkpoints."""
        try:
            yield
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EIO, errno.ENXIO):
                raise
            self.console = False
            self._bar = None
            silence_stdout()

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
            with self._console_guard():
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

    def _add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar; the first of each tag (in this writer) carries its description."""
        description = TB_DESCRIPTIONS.get(tag) or TB_DESCRIPTIONS.get(tag.split("/", 1)[0])
        if description is None or tag in self._described:
            self._writer.add_scalar(tag, value, step)
            return
        from torch.utils.tensorboard.summary import scalar

        summary = scalar(tag, value)
        summary.value[0].metadata.summary_description = description
        self._writer._get_file_writer().add_summary(summary, step)
        self._described.add(tag)

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
            # json_safe: a non-finite figure is null, so every line is strict JSON.
            self._jsonl.write(json.dumps(json_safe(record), default=_json_fallback) + "\n")
            self._jsonl.flush()
        except OSError as e:  # a full disk: say which file, in one line
            failed = write_error(self.jsonl_path, e)
            if failed is None:
                raise
            raise failed from None

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


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that writes (and Python's flush at exit) to a console
    that is gone raise nothing more."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


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


def chart_layout(memory_weights: bool = True) -> Any:
    """TensorBoard's Custom Scalars layout: losses first, train and val on one chart each."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    def chart(title: str, regex: str) -> Any:
        return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(
            tag=[regex]))

    categories = [layout_pb2.Category(title="loss", chart=[
        chart("loss (nats per character): train and validation", r"^loss/(train|val)$"),
        chart("bits per character: train and validation", r"^loss_bpc/(train|val)$"),
        chart("accuracy over labelled targets: train and validation",
              r"^accuracy/(train|val)$"),
    ])]
    if memory_weights:
        categories.append(layout_pb2.Category(title="memory", chart=[chart(
            "softmax(w): share of the embedding (0) and of each layer (1..L) in memory",
            r"^mem_weight/\d+$")]))
    categories.append(layout_pb2.Category(title="training", chart=[
        chart("learning rate", r"^train/lr$"), chart("sequence length", r"^train/seq_len$"),
        chart("gradient norm (before clipping)", r"^train/grad_norm$"),
        chart("tokens/s", r"^train/tokens_per_sec$"),
    ], closed=True))
    return layout_pb2.Layout(category=categories)


def _hparams_summary(**data: Any) -> Any:
    """A Summary holding one HParams plugin message (experiment, session start or end).

    Built here because tensorboard's own helpers for this need TensorFlow, and torch's
    ``add_hparams`` stores booleans as numbers and writes through a second events file.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    (kind,) = data
    tag = {"experiment": metadata.EXPERIMENT_TAG,
           "session_start_info": metadata.SESSION_START_INFO_TAG,
           "session_end_info": metadata.SESSION_END_INFO_TAG}[kind]
    content = plugin_data_pb2.HParamsPluginData(**data)
    return Summary(value=[Summary.Value(tag=tag, tensor=metadata.NULL_TENSOR,
                                        metadata=metadata.create_summary_metadata(content))])


def _layout_summary(layout: Any) -> Any:
    """A Summary holding a Custom Scalars layout (tensorboard's helper needs TensorFlow)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.types_pb2 import DT_STRING
    from tensorboard.plugins.custom_scalar import metadata

    tensor = TensorProto(dtype=DT_STRING, string_val=[layout.SerializeToString()])
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME)
    return Summary(value=[Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor,
                                        metadata=SummaryMetadata(plugin_data=plugin))])


def hparams_of(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """The hyper-parameters runs are compared by: every model key, the optimizer and
    schedule keys, the final sequence length and the token budget (over all ranks).

    No paths, URLs or hashes; ``model.mem_len`` is the window in use (an int, never None);
    ``train.init_from`` only says whether the run was warm-started.
    """
    model = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()}
    model["model.mem_len"] = cfg.model.memory_window
    train = {f"train.{k}": getattr(cfg.train, k) for k in _TRAIN_HPARAMS
             if hasattr(cfg.train, k)}
    return {**model, **train,
            "train.warm_start": cfg.train.init_from is not None,
            "seq_len": cfg.curriculum[-1].seq_len,
            "curriculum_stages": len(cfg.curriculum),
            "tokens": Curriculum(cfg).total_tokens() * world_size,
            "run.seed": cfg.run.seed,
            "run.precision": cfg.run.precision}


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
