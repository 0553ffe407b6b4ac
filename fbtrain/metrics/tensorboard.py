"""TensorBoard events of a run: scalars, text samples, the chart layout, HParams.

Events go into the run directory itself, so that ``tensorboard --logdir runs`` lists each
run under its own name.

Layout. TensorBoard's first view (Time Series) groups charts by the tag up to the first
``/``, in natural sort order, and opens only the first two groups; so the losses get the
groups that sort first: ``loss/train`` and ``loss/val``, then ``loss_bpc/train`` and
``loss_bpc/val`` (bits per character). Everything else of the training steps stays under
``train/`` and ``val/``, the memory weights under ``mem_weight/``. The Custom Scalars tab
(:func:`chart_layout`) draws train and validation loss on one chart, bpc on another, and
the memory weights ``softmax(w)`` as one multi-line chart; the HParams tab compares runs by
:func:`hparams_of` with the validation loss as its metric.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fbtrain.metrics.values import is_number, plain
from fbtrain.schedule import Curriculum

if TYPE_CHECKING:
    from fbtrain.config import Config

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


def tag_of(key: str) -> str:
    """The TensorBoard tag of a metric key: the losses as :data:`TB_TAGS` says, other keys
    without a slash under ``train/`` (``lr`` -> ``train/lr``), keys with one as they are."""
    return TB_TAGS.get(key) or (key if "/" in key else f"train/{key}")


class TensorBoardWriter:
    """One SummaryWriter for the run directory, opened so that a resume overwrites the
    steps it repeats (``purge_step``)."""

    def __init__(self, log_dir: Path, writer: Any):
        self.log_dir = log_dir
        self._writer = writer
        self._described: set[str] = set()  # tags whose description was written

    @classmethod
    def open(cls, log_dir: Path, initial_step: int) -> TensorBoardWriter:
        """A writer for ``log_dir``; ImportError when TensorBoard is not installed."""
        from torch.utils.tensorboard import SummaryWriter

        # Steps up to initial_step were logged by the run being resumed (and are kept, like
        # truncate_after(initial_step) keeps them); purge_step drops events from later steps,
        # which the resumed run is about to log again, so curves don't double back.
        purge = initial_step + 1 if initial_step > 0 else None
        return cls(log_dir, SummaryWriter(log_dir=str(log_dir), purge_step=purge))

    def add_record(self, step: int, record: dict[str, Any]) -> None:
        """One scalar per numeric value of a metrics record (``step`` and text skipped)."""
        for key, value in record.items():
            if key == "step" or not is_number(value):
                continue
            self.add_scalar(tag_of(key), value, step)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
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

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text (a sample), as a code block: TensorBoard renders text as markdown, and a
        code block keeps line breaks and spaces."""
        self._writer.add_text(tag, "```\n" + text + "\n```", step)

    def start_run(self, hparams: dict[str, Any], *, memory_weights: bool = True) -> None:
        """The Custom Scalars layout and the HParams entry (see MetricsLogger.start_run)."""
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

    def end_run(self, step: int) -> None:
        """Mark the HParams session finished at ``step``."""
        from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS,
                                             end_time_secs=time.time())
        self._writer._get_file_writer().add_summary(_hparams_summary(session_end_info=end),
                                                    step)
        self._writer.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.flush()
        self._writer.close()


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
    value = plain(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
