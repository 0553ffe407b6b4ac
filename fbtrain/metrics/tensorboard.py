"""TensorBoard events of a run: scalars, text samples, the chart layout, HParams.

Layout: each run is two entries in TensorBoard's run list, ``<run>`` (the run directory:
the training scalars, the text samples, the run's HParams entry and the Custom Scalars
layout) and ``<run>/val`` (its sub-run: the validation scalars), with the same tags, so
that TensorBoard's first view (Time Series) draws training and validation of a run on one
card in two colours: ``loss`` (nats per character), ``bpc`` (bits per character) and, for a
labelled dataset only, ``accuracy``; ``perplexity`` (validation). The rest of the training
figures are in the ``train`` group (``train/lr``, ``train/tokens_per_sec``, ...), the
memory weights in ``mem_weight``. Runs written before this layout have a third entry,
``<run>/train``, with the training scalars; they are read (and cleared on a fresh start)
all the same. Each events file is created when there is something to write into it, so a
run stopped before it logged anything leaves no empty run behind for TensorBoard to list.

TensorBoard smooths every curve by its own slider (0.6 by default: a 21-point validation
curve drawn visibly above its values); that is a setting of the page, not of the events,
so :data:`LOSS_URL` opens Time Series on the loss card with smoothing off, and
:data:`UNSMOOTHED_URL` the Custom Scalars view with smoothing off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fbtrain.config.curriculum import Curriculum
from fbtrain.io import FileWriteError, write_error
from fbtrain.metrics.values import is_number, plain

if TYPE_CHECKING:
    from fbtrain.config import Config

EVENTS_GLOB = "events.out.tfevents.*"  # TensorBoard's event files
# The Custom Scalars view with smoothing off: the dashboard reads _smoothingWeight from the
# page address (tensorboard/plugins/custom_scalar: getNumberInitializer('_smoothingWeight')).
UNSMOOTHED_URL = "http://localhost:6006/#custom_scalars&_smoothingWeight=0"
# Time Series (TensorBoard's first view) on the loss card (tag filter ^loss$), smoothing
# off: its address's query holds ``smoothing`` and ``tagFilter`` (tensorboard/webapp/
# metrics, MetricsDeepLinkProvider).
LOSS_URL = "http://localhost:6006/?smoothing=0&tagFilter=%5Eloss%24#timeseries"
# Bookkeeping kept in metrics.jsonl only: exact functions of the step and the config, which
# TensorBoard's smoothing would draw as ramps that never happened.
JSONL_ONLY = ("batch_size", "tokens")
TRAIN = ""  # the training scalars' "sub-run": the run directory itself
SUBRUNS = ("val",)  # sub-directories of the run directory, one TensorBoard run each
LEGACY_SUBRUNS = ("train",)  # where runs written before held their training scalars
# Metric keys (of metrics.jsonl) whose sub-run and tag are not the default ones.
TB_TAGS = {"loss": (TRAIN, "loss"), "bpc": (TRAIN, "bpc"),
           "accuracy": (TRAIN, "accuracy"), "val/perplexity": ("val", "perplexity")}
# What a chart shows, for TensorBoard's description of each (sub-run, tag) or tag group.
TB_DESCRIPTIONS = {
    (TRAIN, "loss"): "Cross-entropy of the step's training batch, nats per character.",
    ("val", "loss"): "Cross-entropy on the fixed validation windows (the same every "
                     "evaluation; `fbtrain eval` scores the whole split), nats per character.",
    "bpc": "Bits per character: nats over the characters the tokens cover, / ln 2 (the "
           "loss / ln 2 where a token is a character).",
    "accuracy": "Share of the labelled targets (a labelled dataset: the value each print "
                "must output) whose arg-max prediction is right.",
    "perplexity": "exp(validation loss).",
    "mem_weight": "softmax(w): the share of the embedding (mem_weight/0) and of each layer's "
                  "output (mem_weight/1..L) in the memory vector every layer attends to; "
                  "the shares sum to 1 and start equal, at 1/(L+1).",
}
# HParams metrics: (sub-run, tag) of scalars logged anyway (no one-point duplicates).
HPARAM_METRICS = {("val", "loss"): "val loss (nats)", ("val", "bpc"): "val bpc",
                  (TRAIN, "loss"): "train loss (nats)"}
# The hyper-parameters runs are compared by: HParams shows these columns first.
LEAD_HPARAMS = ("kind", "d_model", "n_layers", "lr", "seq_len", "tokens")
# Train keys a user compares runs by; the rest (logging cadence, paths) is left out.
_TRAIN_HPARAMS = ("min_lr", "schedule", "warmup_steps", "weight_decay", "beta1", "beta2",
                  "grad_clip", "batch_size", "grad_accum", "max_steps", "constant_tokens",
                  "context")


def tag_of(key: str) -> tuple[str, str]:
    """The sub-run ("": the run directory) and tag of a metric key: ``loss`` -> ("", loss),
    ``val/bpc`` -> (val, bpc), ``lr`` -> ("", train/lr), ``mem_weight/0`` -> ("",
    mem_weight/0)."""
    if key in TB_TAGS:
        return TB_TAGS[key]
    if key.startswith("val/"):
        return "val", key[len("val/"):]
    return TRAIN, key if "/" in key else f"train/{key}"


def event_files(run_dir: Path) -> list[Path]:
    """Every TensorBoard event file of a run (the run directory's and its sub-runs', an
    older layout's ``train/`` included)."""
    return [f for folder in (run_dir, *(run_dir / s for s in (*LEGACY_SUBRUNS, *SUBRUNS)))
            for f in folder.glob(EVENTS_GLOB)]


class TensorBoardWriter:
    """The run's SummaryWriters (the run directory and ``val/``), each opened when
    it first has something to write, so that a resume overwrites the steps it repeats
    (``purge_step``)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        self.log_dir = Path(log_dir)
        self.purge_step = purge_step
        self._writers: dict[str, Any] = {}  # "" (the run directory), "val": opened
        self._described: set[tuple[str, str]] = set()  # descriptions written
        # Each writer's events file, for error messages (asked when it opens: after close()
        # torch's SummaryWriter would open a new file to answer).
        self._files: dict[str, Path] = {}
        _quiet_writer_threads()

    @classmethod
    def open(cls, log_dir: Path, initial_step: int) -> TensorBoardWriter:
        """The writers for ``log_dir``; ImportError when TensorBoard is not installed."""
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 (checked here, once)

        # Steps up to initial_step were logged by the run being resumed (and are kept, like
        # truncate_after(initial_step) keeps them); purge_step drops events from later steps,
        # which the resumed run is about to log again, so curves don't double back.
        return cls(log_dir, initial_step + 1 if initial_step > 0 else None)

    def writer(self, subrun: str) -> Any:
        """The SummaryWriter of ``subrun`` ("" for the run directory), opened on first use
        (which creates its folder and events file)."""
        if subrun not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            folder = self.log_dir / subrun
            if subrun and not folder.is_dir() and (folder.exists() or folder.is_symlink()):
                # makedirs' "[Errno 17] File exists", which names no fix
                raise FileWriteError(errno.ENOTDIR, "not a folder", str(folder))
            self._files[subrun] = folder  # its folder, until the file exists
            with self._named(subrun):
                writer = SummaryWriter(log_dir=str(self.log_dir / subrun),
                                       purge_step=self.purge_step)
            self._writers[subrun] = writer
            self._files[subrun] = _events_file(writer)
        return self._writers[subrun]

    def add_record(self, step: int, record: dict[str, Any]) -> None:
        """One scalar per numeric value of a metrics record (``step``, text and
        :data:`JSONL_ONLY` skipped)."""
        for key, value in record.items():
            if key == "step" or key in JSONL_ONLY or not is_number(value):
                continue
            self.add_scalar(*tag_of(key), value, step)

    def add_scalar(self, subrun: str, tag: str, value: float, step: int) -> None:
        """One scalar; the first of each tag (in this writer) carries its description."""
        writer = self.writer(subrun)
        description = (TB_DESCRIPTIONS.get((subrun, tag))
                       or TB_DESCRIPTIONS.get(tag.split("/", 1)[0]))
        with self._named(subrun):
            if description is None or (subrun, tag) in self._described:
                writer.add_scalar(tag, value, step)
                return
            from torch.utils.tensorboard.summary import scalar

            summary = scalar(tag, value)
            summary.value[0].metadata.summary_description = description
            writer._get_file_writer().add_summary(summary, step)
        self._described.add((subrun, tag))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text (a sample) in the run directory's events, as a code block: TensorBoard
        renders text as markdown, and a code block keeps line breaks and spaces."""
        writer = self.writer("")
        with self._named(""):
            writer.add_text(tag, "```\n" + text + "\n```", step)

    def start_run(self, hparams: dict[str, Any], *, memory_weights: bool = True,
                  labelled: bool = False) -> None:
        """The Custom Scalars layout and the HParams entry (see MetricsLogger.start_run);
        ``memory_weights``: a chart per memory source, ``hparams["n_layers"]`` + 1 of them."""
        sources = int(hparams.get("n_layers", 0)) + 1 if memory_weights else 0
        from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

        values = {k: _hparam_value(v) for k, v in hparams.items()}
        kinds = {bool: api_pb2.DATA_TYPE_BOOL, str: api_pb2.DATA_TYPE_STRING}
        experiment = api_pb2.Experiment(
            # differs: TensorBoard sorts these first (then by name) and shows five columns.
            hparam_infos=[api_pb2.HParamInfo(
                name=k, type=kinds.get(type(v), api_pb2.DATA_TYPE_FLOAT64),
                differs=k in LEAD_HPARAMS) for k, v in values.items()],
            metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(group=group, tag=tag),
                                             display_name=name)
                          for (group, tag), name in HPARAM_METRICS.items()])
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for key, value in values.items():
            # bool before int: True is an int too, and would show as 1.0.
            field = ("bool_value" if isinstance(value, bool) else
                     "string_value" if isinstance(value, str) else "number_value")
            setattr(start.hparams[key], field, value)
        file_writer = self.writer("")._get_file_writer()
        with self._named(""):
            for summary in (_layout_summary(chart_layout(sources, labelled)),
                            _hparams_summary(experiment=experiment),
                            _hparams_summary(session_start_info=start)):
                file_writer.add_summary(summary, 0)
        self.flush()

    def end_run(self, step: int) -> None:
        """Mark the HParams session finished at ``step``."""
        from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS,
                                             end_time_secs=time.time())
        file_writer = self.writer("")._get_file_writer()
        with self._named(""):
            file_writer.add_summary(_hparams_summary(session_end_info=end), step)
        self.flush()

    def flush(self) -> None:
        for name, writer in self._writers.items():
            with self._named(name):
                writer.flush()

    def close(self) -> None:
        """Flush and close the event files (all of them, then the first error, if any)."""
        failed: OSError | None = None
        for name, writer in self._writers.items():
            try:
                with self._named(name):
                    writer.flush()  # also raises what the writer thread stored
                    writer.close()
            except OSError as e:
                failed = failed or e
                with contextlib.suppress(OSError):
                    writer.close()
        if failed is not None:
            raise failed

    @contextlib.contextmanager
    def _named(self, subrun: str) -> Iterator[None]:
        """A file-system error of ``subrun``'s events file as one line naming the file. The
        writer thread stores its own failed write and the next call here raises it, as an
        OSError naming no file ("[Errno 28] No space left on device")."""
        try:
            yield
        except OSError as e:
            failed = write_error(self._files[subrun], e)
            if failed is None:
                raise
            raise failed from None


def _events_file(writer: Any) -> Path:
    """The events file a SummaryWriter writes (its folder, where torch hides the name)."""
    event_writer = getattr(writer._get_file_writer(), "event_writer", None)
    name = getattr(event_writer, "_file_name", None)  # tensorboard's EventFileWriter
    return Path(name) if name else Path(writer.log_dir)


def _quiet_writer_threads() -> None:
    """Keep TensorBoard's writer threads from printing a traceback for a failed write
    (once per process). The thread stores the error, and the next call in the main thread
    raises it, which fbtrain reports in one line naming the file (:meth:`TensorBoardWriter.
    _named`); the thread's own report would be a second one, naming nothing."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard layout: its tracebacks stay
        return
    previous = threading.excepthook
    if getattr(previous, "fbtrain_quiet", False):
        return

    def hook(args: Any) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.fbtrain_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def chart_layout(memory_sources: int = 0, labelled: bool = False) -> Any:
    """TensorBoard's Custom Scalars layout: the losses first (each chart: the run's training
    curve and its val sub-run's), accuracy only for a labelled dataset (no empty charts),
    then one chart per memory source (``memory_sources``: the embedding and each layer; 0:
    none).

    Custom Scalars colours a line by its run, not its tag, so five memory weights in one
    chart would be five lines of one colour; a chart each names its source instead."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    def chart(title: str, regex: str) -> Any:
        return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(
            tag=[regex]))

    losses = [chart("loss (nats per character): train and validation", r"^loss$"),
              chart("bits per character: train and validation", r"^bpc$")]
    if labelled:
        losses.append(chart("accuracy over labelled targets: train and validation",
                            r"^accuracy$"))
    losses.append(chart("validation perplexity", r"^perplexity$"))
    categories = [layout_pb2.Category(title="loss", chart=losses)]
    if memory_sources:
        names = ["the embedding", *(f"layer {i}" for i in range(1, memory_sources))]
        categories.append(layout_pb2.Category(title="memory", chart=[
            chart(f"softmax(w): share of {name} in memory (mem_weight/{i})",
                  rf"^mem_weight/{i}$") for i, name in enumerate(names)]))
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
    """The hyper-parameters runs are compared by, :data:`LEAD_HPARAMS` first (the model
    kind and size, the learning rate, the final sequence length, the token budget over all
    ranks), then every other model key, the optimizer and schedule keys.

    No paths, URLs or hashes; ``model.mem_len`` is the window in use (an int, never None);
    ``train.init_from`` only says whether the run was warm-started.
    """
    lead = {"kind": cfg.model.kind, "d_model": cfg.model.d_model,
            "n_layers": cfg.model.n_layers, "lr": cfg.train.lr,
            "seq_len": cfg.curriculum[-1].seq_len,
            "tokens": Curriculum(cfg).total_tokens() * world_size}
    model = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()
             if k not in lead}
    model["model.mem_len"] = cfg.model.memory_window
    train = {f"train.{k}": getattr(cfg.train, k) for k in _TRAIN_HPARAMS
             if hasattr(cfg.train, k)}
    return {**lead, **model, **train,
            "train.warm_start": cfg.train.init_from is not None,
            "curriculum_stages": len(cfg.curriculum),
            "run.seed": cfg.run.seed,
            "run.precision": cfg.run.precision}


def _hparam_value(value: Any) -> float | str | bool:
    """A value as HParams shows it: integers as text (TensorBoard prints every number with
    five significant digits: 16 as 16.000), floats as numbers, booleans as booleans."""
    value = plain(value)
    return value if isinstance(value, bool | float | str) else str(value)
