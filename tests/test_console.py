"""What the terminal shows while a run trains: the status line at 80 and 120 columns, one
line per evaluation, one sample at the end, the summary last, ``--quiet``."""

from __future__ import annotations

import fcntl
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
from test_train import CHILD_ENV, make_cfg, make_raw

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
    assert lines[-1].startswith("done at step 6 | val loss ")
    assert "(bpc " in lines[-1] and "8 fixed windows) | best " in lines[-1]
    assert "val loss below: 8 fixed windows (fbtrain eval scores the whole split)" in lines
    progress = [ln for ln in lines if ln.startswith("step ") and "tok/s" in ln]
    assert [ln.split(" |")[0] for ln in progress] == ["step 3/6", "step 6/6"]
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("sample")]
    assert [e.step for e in acc.Tensors(tag)] == [0, 2, 4, 6]


def test_quiet_prints_only_the_summary(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_cfg(tmp_path, train={"max_steps": 3, "eval_every": 3})
    run(cfg, quiet=True)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and out.startswith("done at step 3 | val loss ")
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
    assert shown[-1].startswith("done at step 6 | val loss ")
    status = shown[-2]
    assert status.startswith("step 6/6 100% | loss ") and len(status) <= 79, status
    assert "tok/s" in status and "| eta " in status
    assert sum(ln.startswith("[sample @ step") for ln in shown) == 1
