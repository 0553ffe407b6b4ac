"""What the terminal shows: while a run trains, the status line (tqdm's) at 80 and 120
columns, one line per evaluation, one sample at the end, the summary last, ``--quiet``; the
progress of eval, samples, downloads and waits for another process's download (a tqdm line
on a terminal, plain lines or nothing elsewhere)."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from conftest import Server
from test_sample import VOCAB, tiny_model, write_run
from test_train import CHILD_ENV, make_cfg, make_raw

from fbtrain import progress, sample
from fbtrain.config import DataConfig
from fbtrain.data import fetch
from fbtrain.data.errors import DataError
from fbtrain.data.text import load_text
from fbtrain.evaluate import evaluate_split
from fbtrain.metrics.console import plain_line, status_line
from fbtrain.train import run

POSTFIX = {"loss": 2.10344, "bpc": 3.03466, "accuracy": 0.5, "seq_len": 256, "lr": 1.2e-3,
           "tokens_per_sec": 123456.4}


def test_status_line_keeps_what_matters_at_80_columns() -> None:
    line = status_line(1200, 20000, POSTFIX, "1h05m", 80)
    assert len(line) <= 79  # the last column stays free: writing into it wraps
    assert line.startswith("step 1200/20000 6% | loss 2.1034 | 123,456 tok/s | eta 1h05m")
    wide = status_line(1200, 20000, POSTFIX, "1h05m", 120)
    assert len(wide) <= 119 and "lr 1.20e-03" in wide and "seq_len 256" in wide
    assert "bpc 3.0347" in wide
    # Whatever is left out is left out whole, never cut in half.
    for part in line.split(" | "):
        assert part in plain_line(1200, 20000, POSTFIX, "1h05m") or part == "step 1200/20000 6%"
    # A tiny terminal still gets one line, never a wrapped one.
    assert len(status_line(1200, 20000, POSTFIX, "1h05m", 30)) <= 29


def _lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.strip()]


def test_non_tty_output_is_calm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Plain output (a log file): one line per evaluation naming the fixed-window figure,
    one sample (the last), the summary last; every sample still in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(tmp_path, train={"max_steps": 6, "eval_every": 2, "log_every": 3,
                                    "sample_length": 30},
                   logging={"tensorboard": True})
    run_dir = run(cfg)
    lines = _lines(capsys.readouterr().out)
    assert sum(ln.startswith("[sample @ step") for ln in lines) == 1
    assert "[sample @ step 6]" in lines
    evaluations = [ln for ln in lines if re.match(r"step \d+: val loss", ln)]
    assert [ln.split(":")[0] for ln in evaluations] == ["step 0", "step 2", "step 4", "step 6"]
    assert all("(8 fixed windows)" in ln for ln in evaluations)
    assert sum(ln.endswith("| best") for ln in evaluations) >= 1
    assert not evaluations[0].endswith("best")  # step 0 is no candidate
    # The summary closes it: three lines within 80 columns, broken between its parts.
    summary = lines[-3:]
    assert summary[0].startswith("done at step 6 | val loss ")
    assert " tokens/s on cpu " in summary[1] and summary[2].startswith("wall ")
    assert "(bpc " in summary[0] and "8 fixed windows) | best " in summary[0]
    assert all(len(ln) <= 80 for ln in summary)
    assert "val loss below: 8 fixed windows (fbtrain eval scores the whole split)" in lines
    shown = [ln for ln in lines if ln.startswith("step ") and "tok/s" in ln]
    assert [ln.split(" |")[0] for ln in shown] == ["step 3/6", "step 6/6"]
    # An ETA from the first line on (two measured steps after the warm-up one), and no
    # carriage return anywhere: a log file reads line by line.
    assert all(re.search(r" \| eta \d+s$", ln) for ln in shown), shown
    assert "\r" not in capsys.readouterr().out
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("sample")]
    assert [e.step for e in acc.Tensors(tag)] == [0, 2, 4, 6]


def test_quiet_prints_only_the_summary(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_cfg(tmp_path, train={"max_steps": 3, "eval_every": 3})
    run(cfg, quiet=True)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 3 and out.startswith("done at step 3 | val loss ")
    assert "tokens/s on cpu" in out.splitlines()[1]
    assert err == ""


def test_terminal_run_at_80_columns(tmp_path: Path) -> None:
    """`fbtrain train` in an 80-column pseudo-terminal: the status line it leaves still
    shows tokens/s and the ETA within 79 columns, and the summary is the last line."""
    raw = make_raw(tmp_path, train={"max_steps": 6, "eval_every": 3, "log_every": 1},
                   logging={"progress": True})
    config = tmp_path / "cfg.json"  # JSON is YAML
    config.write_text(json.dumps(raw))
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in CHILD_ENV.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "fbtrain", "train", "--config", str(config)],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            pytest.fail("no output for 120 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=60) == 0
    os.close(master)
    screen = b"".join(chunks).decode().replace("\r\n", "\n")
    lines = [ln for ln in screen.split("\n") if ln.strip()]
    # What each line finally shows: the text after its last carriage return.
    shown = [ln.split("\r")[-1].replace("\x1b[K", "") for ln in lines]
    assert shown[-3].startswith("done at step 6 | val loss ") and shown[-1].startswith("wall ")
    status = shown[-4]
    assert status.startswith("step 6/6 100% | loss ") and len(status) <= 79, status
    assert "tok/s" in status and "| eta " in status
    assert re.search(r"\| eta \d\d:\d\d", status), status  # tqdm's remaining time
    assert sum(ln.startswith("[sample @ step") for ln in shown) == 1
    # The status line is tqdm's: no plain progress lines on a terminal.
    assert not [ln for ln in shown if re.match(r"step \d+/6 \|", ln)]


@pytest.mark.parametrize("columns", [0, 1])
def test_a_terminal_of_unknown_width_still_shows_the_status_line(
        monkeypatch: pytest.MonkeyPatch, columns: int) -> None:
    """A pseudo-terminal nobody sized reports 0 columns (1 is no better): the status line
    is the 80-column one. tqdm, given its width less one, drew nothing at all there (or
    its own line, with no loss)."""
    from fbtrain.metrics.console import Console

    class UnsizedTTY(FakeTTY):
        def fileno(self) -> int:
            return 1

    monkeypatch.setattr(os, "get_terminal_size",
                        lambda fd=None: os.terminal_size((columns, 0)))
    fake = UnsizedTTY()
    monkeypatch.setattr(sys, "stdout", fake)
    console = Console(total_steps=4)
    console.progress(2, {"loss": 2.5, "lr": 1e-3, "tokens_per_sec": 999.0}, 30.0)
    console.finish()
    shown = [part for part in fake.getvalue().split("\r") if part.strip()][-1]
    assert shown.startswith("step 2/4 50% | loss 2.5000 | 999 tok/s | eta 00:30 | lr "), shown


# ----------------------------------------------------------------- eval, sample, download


class FakeTTY(io.StringIO):
    """A stream that says it is a terminal (tqdm's ``disable=None`` draws on it)."""

    def isatty(self) -> bool:
        return True


def tty_stderr(monkeypatch: pytest.MonkeyPatch) -> FakeTTY:
    """Make stderr a terminal 80 columns wide, every update drawn. Called in the test
    itself: pytest sets sys.stderr again after the fixtures (to capture the test)."""
    fake = FakeTTY()
    monkeypatch.setattr(sys, "stderr", fake)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(progress, "REDRAW_EVERY", 0.0)  # every update drawn
    return fake


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, len(VOCAB), (n,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("context", ["reset", "carry"])
def test_eval_shows_its_progress_on_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                               context: str) -> None:
    err = tty_stderr(monkeypatch)
    result = evaluate_split(tiny_model(), _ids(200), 16, 4, context=context,
                            show_progress=True)
    drawn = err.getvalue()
    assert f"\reval ({context}):   0% | 0/13 windows | 00:00<?" in drawn, repr(drawn)
    assert re.search(rf"\reval \({context}\): +[1-9]\d% \| \d+/13 windows", drawn)
    assert all(len(part.rstrip()) <= 79 for part in drawn.split("\r"))  # within 80 columns
    assert result["tokens"] == 199


def test_eval_progress_stays_off_a_log_file(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    evaluate_split(tiny_model(), _ids(200), 16, 4, show_progress=True)
    assert plain.getvalue() == ""


def test_sample_names_its_checkpoint_and_shows_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which checkpoint and step, on stderr (stdout is the text alone); a progress line
    when the text goes elsewhere than the terminal (a file, or several samples)."""
    ckpt = write_run(tmp_path / "run", tiny_model(), step=7)
    out = io.StringIO()  # the text goes to a file
    fake = tty_stderr(monkeypatch)
    sample.run(str(ckpt.parent.parent), length=40, stream=out, device="cpu")
    err = fake.getvalue()
    assert err.startswith(f"sampling from {ckpt} (step 7)\n")
    assert "\rsampling: 100% | 40/40 characters | " in err, repr(err)
    assert "sampling from" not in out.getvalue()


def test_streamed_sample_on_a_terminal_draws_no_progress_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    fake = tty_stderr(monkeypatch)
    sample.run(str(ckpt), length=40, stream=FakeTTY(), device="cpu")
    assert fake.getvalue() == f"sampling from {ckpt} (step 7)\n"


TEXT = "To be, or not to be, that is the question.\n" * 50


def _data(tmp_path: Path, url: str) -> DataConfig:
    return DataConfig(dataset="tiny", url=url, sha256=hashlib.sha256(TEXT.encode()).hexdigest(),
                      cache_dir=str(tmp_path / "cache"))


def test_download_shows_its_progress_on_a_terminal(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    server.routes["/text.txt"] = TEXT.encode()
    url = server.url("/text.txt")
    fake = tty_stderr(monkeypatch)
    assert load_text(_data(tmp_path, url)) == TEXT
    err = fake.getvalue()
    assert err.startswith(f"fbtrain: downloading {url} (2.15 kB) into {tmp_path / 'cache'}")
    assert "\rdownloading tiny@" in err and ": 100% | 2.15k/2.15k B | " in err, err


def test_download_prints_plain_lines_in_a_log_file(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)  # a line per chunk
    server.routes["/text.txt"] = TEXT.encode()
    load_text(_data(tmp_path, server.url("/text.txt")))
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("fbtrain: downloading ") and "\r" not in plain.getvalue()
    assert re.fullmatch(r"downloading tiny@\w+\.txt: 100% \(2\.15 kB of 2\.15 kB\)",
                        lines[-1]), lines


def test_waiting_for_another_download_says_so_and_shows_the_time(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "LOCK_WAIT", 0.4)
    monkeypatch.setattr(fetch, "WAIT_TICK", 0.1)
    data = _data(tmp_path, server.url("/text.txt"))
    entry = fetch.cache_entry(data, ".txt")
    entry.parent.mkdir(parents=True)
    with open(entry.with_name(f".{entry.name}.lock"), "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        holder.write(f"{os.getpid()}\n")
        holder.flush()
        fake = tty_stderr(monkeypatch)
        with pytest.raises(DataError, match="still being written by another fbtrain process"):
            load_text(data)
    err = fake.getvalue()
    assert err.startswith(f"fbtrain: waiting for another process (pid {os.getpid()}) writing "
                          f"{entry}\n")
    assert err.count("fbtrain: waiting") == 1  # said once, however many polls
    assert err.count("\rwaiting for its download | 00:00") >= 3, err  # redrawn each tick


def test_progress_and_notes_never_cost_the_work_when_stderr_is_gone(
        tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Descriptor 2 closed at start (Python's sys.stderr is then None), or a reader that
    left: the download and the sample go on, and nothing lands on stdout instead."""
    ckpt = write_run(tmp_path / "run", tiny_model())
    server.routes["/text.txt"] = TEXT.encode()
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    monkeypatch.setattr(sys, "stderr", None)
    out = io.StringIO()
    texts = sample.run(str(ckpt), length=20, stream=out, device="cpu")
    assert out.getvalue() == "\n" + texts[0] + "\n"
    assert load_text(_data(tmp_path, server.url("/text.txt"))) == TEXT
    assert capsys.readouterr().out == ""  # print(file=None) would have written here

    class Gone(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", Gone())
    assert load_text(_data(tmp_path / "again", server.url("/text.txt"))) == TEXT
