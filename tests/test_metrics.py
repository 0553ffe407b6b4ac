"""MetricsLogger: JSONL lines, TensorBoard events read back, console output, null backend."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fbtrain.config import load_config
from fbtrain.config.curriculum import Curriculum
from fbtrain.metrics.logger import MetricsLogger
from fbtrain.metrics.tensorboard import HPARAM_METRICS, event_files, hparams_of


def _events(tb_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def test_jsonl_lines_parse_and_hold_values(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as m:
        m.log(10, {"loss": 2.5, "bpc": 3.6, "lr": 1e-3, "seq_len": 32,
                   "grad_norm": torch.tensor(0.75), "mem_weight/0": 0.25})
        # Flushed at once: readable while the logger is still open (a killed run keeps it).
        assert _records(tmp_path)[0]["loss"] == 2.5
        m.log(20, {"loss": 1.5, "bpc": 2.2}, prefix="val/")
    records = _records(tmp_path)
    assert records == [
        {"step": 10, "loss": 2.5, "bpc": 3.6, "lr": 1e-3, "seq_len": 32, "grad_norm": 0.75,
         "mem_weight/0": 0.25},
        {"step": 20, "val/loss": 1.5, "val/bpc": 2.2},
    ]
    assert not (tmp_path / "tb").exists()


def test_jsonl_survives_odd_values(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, console=False) as m:
        m.log(1, {"hist": torch.tensor([1.0, 2.0]), "device": "cpu", "path": tmp_path})
    assert _records(tmp_path) == [{"step": 1, "hist": [1.0, 2.0], "device": "cpu",
                                   "path": str(tmp_path)}]


def test_jsonl_appends_across_loggers(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as m:
        m.log(1, {"loss": 3.0})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "lo')  # a line cut short by a kill
    with MetricsLogger(tmp_path, tensorboard=False, console=False, initial_step=1) as m:
        m.log(2, {"loss": 2.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "loss": 3.0}
    assert json.loads(lines[-1]) == {"step": 2, "loss": 2.0}  # not glued to the broken line


def test_tensorboard_scalars_and_text_read_back(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, console=False) as m:
        for step in (1, 2, 3):
            m.log(step, {"loss": 4.0 - step, "tokens_per_sec": 1000.0 * step,
                         "mem_weight/0": 0.1 * step, "note": "not a number"})
        m.log(3, {"loss": 0.5}, prefix="val/")
        m.log_text(3, "sample", "ROMEO:\nO, she doth teach the torches to burn bright!")
    # The run and its val sub-run, with the same tags: TensorBoard draws train and val on
    # one card.
    train, val = _events(tmp_path), _events(tmp_path / "val")
    scalars = set(train.Tags()["scalars"])
    assert {"loss", "train/tokens_per_sec", "mem_weight/0"} <= scalars
    assert set(val.Tags()["scalars"]) == {"loss"}
    assert not any("note" in tag for tag in scalars)
    loss = train.Scalars("loss")
    assert [(e.step, e.value) for e in loss] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert val.Scalars("loss")[0].value == 0.5
    # Described once, on the first event of the tag.
    assert "softmax(w)" in train.SummaryMetadata("mem_weight/0").summary_description
    assert "validation windows" in val.SummaryMetadata("loss").summary_description
    assert "training batch" in train.SummaryMetadata("loss").summary_description
    acc = train  # the samples: in the run directory itself
    text_tags = [t for t in acc.Tags()["tensors"] if t.startswith("sample")]
    assert text_tags, acc.Tags()["tensors"]
    event = acc.Tensors(text_tags[0])[0]
    assert event.step == 3
    assert b"O, she doth teach" in event.tensor_proto.string_val[0]


def _written_earlier(run_dir: Path) -> None:
    """Date the event files back a minute, as a run resumed later (another process) finds
    them. TensorBoard reads a folder's files in name order, and a name is
    ``events.out.tfevents.<seconds>.<host>.<pid>.<counter>``: within one second of one
    process the counter decides, and ``.10`` sorts before ``.9``."""
    for events in event_files(run_dir):
        prefix, seconds, rest = re.fullmatch(r"(events\.out\.tfevents\.)(\d+)(.*)",
                                             events.name).groups()
        events.rename(events.with_name(f"{prefix}{int(seconds) - 60}{rest}"))


def test_resume_purges_later_tensorboard_steps(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, console=False) as m:
        for step in range(1, 6):
            m.log(step, {"loss": float(step)})
    _written_earlier(tmp_path)
    # Resume from a checkpoint at step 3: steps 4, 5 are logged again with new values.
    with MetricsLogger(tmp_path, console=False, initial_step=3) as m:
        m.truncate_after(3)
        for step in (4, 5):
            m.log(step, {"loss": 10.0 * step})
    events = _events(tmp_path).Scalars("loss")
    assert [(e.step, e.value) for e in events] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_truncate_after(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as m:
        for step in (10, 20, 30, 40):
            m.log(step, {"loss": step / 10})
        m.truncate_after(20)
        assert [r["step"] for r in _records(tmp_path)] == [10, 20]
        m.log(30, {"loss": 9.0})  # keeps appending after the rewrite
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [
        (10, 1.0), (20, 2.0), (30, 9.0)]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_truncate_after_without_file(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as m:
        m.truncate_after(5)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_hparams_and_layout_written_and_readable(tmp_path: Path) -> None:
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    cfg = load_config(None, ["model.d_model=16", "train.constant_tokens=false",
                             "train.init_from=runs/base", "train.max_steps=10"])
    with MetricsLogger(tmp_path, console=False) as m:
        m.start_run(hparams_of(cfg))
        m.log(5, {"loss": 1.0, "val/loss": 1.7, "val/bpc": 2.5})
        m.end_run()
    acc = _events(tmp_path)
    experiment, start, end = None, None, None
    for raw in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(raw)
        kind = data.WhichOneof("data")
        experiment = data.experiment if kind == "experiment" else experiment
        start = data.session_start_info if kind == "session_start_info" else start
        end = data.session_end_info if kind == "session_end_info" else end
    assert experiment and start and end and end.status == api_pb2.STATUS_SUCCESS
    # The metrics are the sub-runs' scalar tags themselves: no one-point hparam/* copies.
    assert [(mi.name.group, mi.name.tag) for mi in experiment.metric_infos] == list(
        HPARAM_METRICS) == [("val", "loss"), ("val", "bpc"), ("", "loss")]
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("hparam")]
    names = [info.name for info in experiment.hparam_infos]
    # The keys runs are compared by lead; TensorBoard sorts `differs` first, then by name.
    assert names[:6] == ["kind", "d_model", "n_layers", "lr", "seq_len", "tokens"]
    assert [i.name for i in experiment.hparam_infos if i.differs] == names[:6]
    assert names[6:9] == ["model.n_heads", "model.d_ff", "model.dropout"]  # then the model
    types = {info.name: info.type for info in experiment.hparam_infos}
    assert types["train.constant_tokens"] == api_pb2.DATA_TYPE_BOOL
    assert types["kind"] == types["d_model"] == api_pb2.DATA_TYPE_STRING
    assert types["lr"] == api_pb2.DATA_TYPE_FLOAT64
    got = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    # Integers as integers: TensorBoard would print the number 16 as 16.000.
    assert got["kind"] == "feedback_kv" and got["d_model"] == "16"
    assert start.hparams["train.constant_tokens"].WhichOneof("kind") == "bool_value"
    assert got["train.constant_tokens"] is False and got["train.warm_start"] is True
    assert got["model.mem_len"] == str(cfg.model.max_rel_pos)  # the window in use, not None
    assert got["lr"] == pytest.approx(2e-3) and got["seq_len"] == "64"
    assert got["tokens"] == str(10 * 16 * 32) == str(Curriculum(cfg).total_tokens())
    assert not [k for k in got if k.startswith(("data.", "checkpoint.", "logging."))
                or k.endswith(("_dir", "path", "url", "sha256", "init_from"))]
    # The Custom Scalars layout: the losses first, each chart both sub-runs' tag.
    (tag,) = acc.PluginTagToContent("custom_scalars")
    layout = layout_pb2.Layout.FromString(acc.Tensors(tag)[0].tensor_proto.string_val[0])
    loss, bpc = layout.category[0].chart[:2]
    assert layout.category[0].title == "loss"
    assert [re.match(loss.multiline.tag[0], t) is not None
            for t in ("loss", "bpc", "train/lr")] == [True, False, False]
    assert re.match(bpc.multiline.tag[0], "bpc")
    # A text run gets no accuracy chart (it would stay empty).
    assert not [c for c in layout.category[0].chart if "accuracy" in c.title]
    # A chart per memory source (Custom Scalars colours lines by run, so one chart of five
    # tags would be five lines of one colour): the embedding, then each layer, by name.
    memory = layout.category[1]
    assert memory.title == "memory" and len(memory.chart) == cfg.model.n_layers + 1
    assert memory.chart[0].title == "softmax(w): share of the embedding in memory (mem_weight/0)"
    assert memory.chart[2].title == "softmax(w): share of layer 2 in memory (mem_weight/2)"
    for i, chart in enumerate(memory.chart):
        (regex,) = chart.multiline.tag
        assert [t for t in (f"mem_weight/{j}" for j in range(8)) if re.match(regex, t)] == [
            f"mem_weight/{i}"]
    # One writer each, one events file each: the run directory and val/ (no train/).
    for folder in (tmp_path, tmp_path / "val"):
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    assert not (tmp_path / "train").exists()


def test_bookkeeping_stays_out_of_tensorboard(tmp_path: Path) -> None:
    """Batch size and tokens are exact functions of the step: smoothed, TensorBoard would
    draw ramps that never happened. They stay in metrics.jsonl."""
    with MetricsLogger(tmp_path, console=False) as m:
        m.log(1, {"loss": 1.0, "lr": 1e-3, "batch_size": 16, "tokens": 1024})
    assert set(_events(tmp_path).Tags()["scalars"]) == {"loss", "train/lr"}
    assert _records(tmp_path) == [{"step": 1, "loss": 1.0, "lr": 1e-3, "batch_size": 16,
                                   "tokens": 1024}]


def test_event_files_appear_only_with_something_to_show(tmp_path: Path) -> None:
    """TensorBoard lists every folder holding an events file as a run: a logger that
    logged nothing leaves none, and one that logged training figures only has no val/."""
    run = tmp_path / "run"
    with MetricsLogger(run, console=False):
        pass
    assert event_files(run) == []
    with MetricsLogger(run, console=False) as m:
        m.log(1, {"loss": 1.0})
    assert [f.parent for f in event_files(run)] == [run]
    assert not (run / "val").exists()


def test_layout_of_a_labelled_run_has_accuracy(tmp_path: Path) -> None:
    from fbtrain.metrics.tensorboard import chart_layout

    titles = [c.title for c in chart_layout(labelled=True).category[0].chart]
    assert any("accuracy" in t for t in titles)


def test_disabled_logger_is_silent_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    with MetricsLogger(run, enabled=False, total_steps=10) as m:
        m.log(1, {"loss": 1.0})
        m.log_text(1, "sample", "hi")
        m.progress(1, {"loss": 1.0})
        m.info("hello")
        m.truncate_after(0)
        m.start_run({"a": 1})
        m.end_run()
    assert not run.exists()
    assert capsys.readouterr() == ("", "")


def test_plain_progress_lines_when_not_a_tty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, total_steps=2000, initial_step=100) as m:
        m.info("training on cpu")
        m.progress(120, {"loss": 2.10344, "bpc": 3.03466, "seq_len": 64,
                         "tokens_per_sec": 12345.4}, remaining=192.0)
        m.log_text(120, "sample", "To be")
    out = capsys.readouterr().out
    assert "training on cpu" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("step "))
    assert line == ("step 120/2000 | loss 2.1034 | bpc 3.0347 | seq_len 64 | 12,345 tok/s"
                    " | eta 3m12s")
    assert "To be" in out and "\r" not in out  # a log file gets no carriage returns


def test_console_off_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False, total_steps=5) as m:
        m.progress(1, {"loss": 1.0})
        m.info("quiet")
        m.log(1, {"loss": 1.0})
    assert capsys.readouterr().out == ""
    assert _records(tmp_path) == [{"step": 1, "loss": 1.0}]


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal the status line is tqdm's: redrawn in place, messages above it, its
    ETA tqdm's remaining time at the rate given (2 s a step: 30 steps left, 1 minute)."""
    fake = _FakeTTY()
    monkeypatch.setattr(sys, "stdout", fake)
    monkeypatch.setenv("COLUMNS", "80")
    m = MetricsLogger(None, total_steps=50, initial_step=10)
    m.progress(20, {"loss": 1.23456, "seq_len": 16, "tokens_per_sec": 999.0}, remaining=60.0)
    assert m.console.status == ("step 20/50 40% | loss 1.2346 | 999 tok/s | eta 01:00 | "
                                "seq_len 16")
    m.info("message above the status line")
    m.progress(35, {"loss": 1.0, "tokens_per_sec": 999.0}, remaining=None)  # not measured
    assert m.console.status == "step 35/50 70% | loss 1.0000 | 999 tok/s"
    m.close()
    out = fake.getvalue()
    assert "step 20/50 |" not in out  # no plain lines when the status line is shown
    # The message is printed on a cleared line, and the status line drawn again below it.
    lines = out.split("\n")
    (message,) = [ln for ln in lines if "message above" in ln]
    assert message.split("\r")[-1].strip() == "message above the status line"
    assert lines[lines.index(message) + 1].lstrip("\r").startswith("step 20/50 40%")
    assert out.endswith("\n")  # closing leaves the status line as an ordinary line
    assert "step 35/50 70%" in lines[-2]


def test_tokens_per_second_leave_out_warm_up_and_smooth_over_the_last_steps() -> None:
    """The status line's rate is over the last steps (a window), a record's since the last
    record; both leave out the warm-up step, which the totals (the closing line's) keep. A
    load spell that makes 2 of 4 steps 4x slower halves the window's rate (a record's
    window, the 2 steps alone, falls 4x)."""
    from fbtrain.train import report

    meter = report.Throughput(window=4, warmup=1)
    meter.add(1000, 50.0)  # the warm-up step: slow, left out of both rates
    assert meter.recent_rate() is None and meter.window_rate() is None
    for _ in range(4):
        meter.add(1000, 1.0)
    assert meter.recent_rate() == pytest.approx(1000.0)
    assert meter.window_rate() == pytest.approx(1000.0) and meter.window_rate() is None
    for _ in range(2):
        meter.add(1000, 4.0)
    assert meter.window_rate() == pytest.approx(250.0)
    assert meter.recent_rate() == pytest.approx(4000 / 10)  # 2 steps of 1 s, 2 of 4 s
    for _ in range(4):  # the spell over: the window forgets it
        meter.add(1000, 1.0)
    assert meter.recent_rate() == pytest.approx(1000.0)
    assert (meter.tokens, meter.seconds) == (11_000, 50.0 + 4 + 8 + 4)


def test_console_only_logger_without_run_dir(capsys: pytest.CaptureFixture[str]) -> None:
    with MetricsLogger(None, total_steps=0) as m:
        m.log(1, {"loss": 1.0})
        m.progress(1, {"loss": 1.0})
    assert "step 1 | loss 1.0000" in capsys.readouterr().out


def test_resume_drops_lines_that_are_not_utf8(tmp_path: Path) -> None:
    """A hand-damaged metrics.jsonl (bytes that are not UTF-8) is cut like a torn line."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe{"step": 2}\n{"step": 3, "loss": 1.0}\n')
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.truncate_after(2)
    assert path.read_text(encoding="utf-8") == '{"step": 1, "loss": 2.0}\n'


def test_non_finite_figures_are_written_as_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(5, {"val/loss": float("nan"), "val/perplexity": float("inf"), "bpc": 1.5})
    line = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8")
    assert json.loads(line) == {"step": 5, "val/loss": None, "val/perplexity": None,
                                "bpc": 1.5}
    assert "NaN" not in line and "Infinity" not in line


def test_the_docs_say_what_each_entry_is_and_link_the_unsmoothed_views() -> None:
    """docs/commands.md names the two entries a run has and what each holds, and gives the
    addresses that open TensorBoard unsmoothed (Time Series on the loss card, and Custom
    Scalars), as the README's TensorBoard section does."""
    from fbtrain.metrics.tensorboard import LOSS_URL, UNSMOOTHED_URL

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "commands.md").read_text(encoding="utf-8")
    section = page.split("## TensorBoard", 1)[1]
    assert LOSS_URL in section and UNSMOOTHED_URL in section
    assert "- `<run>` (the run directory)" in section
    assert "- `<run>/val` (the sub-run in `val/`)" in section
    assert LOSS_URL in (root / "README.md").read_text(encoding="utf-8")
