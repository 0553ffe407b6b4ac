"""A process's own edges, tested for real: started with a standard stream closed, stopped
by SIGTERM before training began; a log file that cannot be
written after a step (the step is saved first)."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Server
from test_train import CHILD_ENV, make_raw, records

import fbtrain.metrics.logger as logger_module
from fbtrain.checkpoint import load_checkpoint
from fbtrain.config import config_from_dict
from fbtrain.io import FileWriteError
from fbtrain.metrics.tensorboard import TensorBoardWriter
from fbtrain.models.core import native
from fbtrain.train import run

REPO = Path(__file__).resolve().parents[1]


def _copied_core(tmp_path: Path) -> dict[str, str]:
    """A TORCH_EXTENSIONS_DIR of its own holding this session's build of the core (copied:
    nothing compiles, but torch still runs its ninja over it, as on a first use)."""
    native.native_ops()  # this session's build, made here if not yet
    name = native.extension_name(*native._core_recipe())
    root = tmp_path / "extensions"
    shutil.copytree(native.build_directory(name), root / name)  # keeps the mtimes
    return {**CHILD_ENV, "TORCH_EXTENSIONS_DIR": str(root), "FBTRAIN_CORE": "native"}


def test_training_with_stdout_or_stderr_closed(tmp_path: Path) -> None:
    """`fbtrain train ... >&-` (and `2>&-`) on a first use of the core ended in torch's
    `sys.stdout.flush()` on None (AttributeError, exit 1, nothing trained)."""
    env = _copied_core(tmp_path)
    for name, closing in (("out", ">&-"), ("err", "2>&-")):
        raw = make_raw(tmp_path, name, train={"max_steps": 2})
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        command = (f"exec {sys.executable} -m fbtrain train --config {tmp_path / name}.yaml "
                   f"{closing}")
        proc = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert proc.returncode == 0, (closing, proc.stdout, proc.stderr)
        assert (tmp_path / "runs" / name / "checkpoints" / "last.pt").is_file()
        # The closed stream stayed closed to the reader: nothing arrived there, and the
        # descriptor was no file's (a lock file, a checkpoint) in between.
        assert (proc.stdout if closing == ">&-" else proc.stderr) == ""
        assert "Traceback" not in proc.stderr + proc.stdout


def test_sigterm_while_the_data_downloads_cleans_up_like_ctrl_c(
        tmp_path: Path, server: Server) -> None:
    """SIGTERM during the data load exited 143 with no word, leaving runs/<name>/.lock
    (SIGINT at the same point said "interrupted" and left nothing)."""
    raw = make_raw(tmp_path, "dl")
    raw["data"] = {"dataset": "stalled", "url": server.url("/stall"), "sha256": None,
                   "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    for sig, code, line in ((signal.SIGTERM, 143, "interrupted (SIGTERM)"),
                            (signal.SIGINT, 130, "interrupted")):
        hits = server.hits["/stall"]
        proc = subprocess.Popen([sys.executable, "-m", "fbtrain", "train", "--config",
                                 str(tmp_path / "cfg.yaml")], env=CHILD_ENV, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while server.hits["/stall"] == hits:  # until it waits on the download
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.05)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == code, err
        assert err.splitlines()[-1] == line and "Traceback" not in err, err
        assert not (tmp_path / "runs").exists(), sorted(map(str, (tmp_path / "runs").rglob("*")))
        assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()
                    and not p.name.endswith(".lock")]


# ----------------------------------------------------------------------------- a log that fails


def _resumed_with(tmp_path: Path, on_step: Callable[[int], None]) -> tuple[Path, BaseException]:
    """A run trained to step 2, resumed to 6 with ``on_step``: evaluations at 4 and 6, a
    checkpoint only at the end (and at 2), a line of figures every step; the error the
    resume ends with."""
    raw = make_raw(tmp_path, train={"max_steps": 2, "eval_every": 2},
                   checkpoint={"every": 100}, logging={"tensorboard": True, "progress": False})
    run_dir = run(config_from_dict(raw), quiet=True)
    raw["train"]["max_steps"] = 6
    with pytest.raises(OSError) as info:
        run(config_from_dict(raw), resume="auto", quiet=True, on_step=on_step)
    return run_dir, info.value


def test_a_tensorboard_write_that_fails_after_a_step_saves_the_step_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 3's figures cannot be written to TensorBoard (no checkpoint is due at step 3):
    the write's error stopped the run and steps since the last checkpoint were lost; now
    step 3 is saved, then the error is reported."""
    real_add = TensorBoardWriter.add_record
    events = tmp_path / "events.out.tfevents.x"

    def add_record(self: TensorBoardWriter, step: int, record: dict[str, Any]) -> None:
        if step == 3:
            raise FileWriteError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(events))
        real_add(self, step, record)

    monkeypatch.setattr(TensorBoardWriter, "add_record", add_record)
    run_dir, error = _resumed_with(tmp_path, lambda step: None)
    assert str(error) == f"{events}: cannot write: the disk is full (no space left on device)"
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 3
    assert max(r["step"] for r in records(run_dir)) == 3  # its line is in metrics.jsonl


def test_a_file_where_tensorboards_val_folder_goes_is_named(tmp_path: Path) -> None:
    """A file where TensorBoard's val/ goes (put there while the run trains): step 4's
    validation figure cannot be written. It was "[Errno 17] File exists" and the steps since
    the last checkpoint lost; now step 4 is saved, then one line names the folder."""
    run_dir = tmp_path / "runs" / "run"

    def file_for_folder(step: int) -> None:
        if step == 3:  # the resumed process opens val/ at its first evaluation, step 4
            shutil.rmtree(run_dir / "val")
            (run_dir / "val").write_text("x\n")

    _, error = _resumed_with(tmp_path, file_for_folder)
    assert str(error) == (f"{run_dir / 'val'}: cannot write: not a folder (a file is in its "
                          "place: move it away)")
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 4


def test_a_disk_that_fills_mid_line_leaves_no_half_line_and_the_step_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """metrics.jsonl's append cut short by a full disk at step 3's line: the half line
    stayed until the next resume rewrote the file (and step 3 was not saved); now it is cut
    off again, step 3 is saved, and one line names metrics.jsonl."""
    real_open = open

    def filling_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == "metrics.jsonl" and "a" in mode:
            return _FillsAt(path, b'"step": 3,')
        return real_open(path, mode, *args, **kwargs)

    run_dir = tmp_path / "runs" / "run"

    def fill_disk(step: int) -> None:
        if step == 3:  # before its line: the resumed process opens the file for it
            monkeypatch.setattr(logger_module, "open", filling_open, raising=False)

    _, error = _resumed_with(tmp_path, fill_disk)
    assert str(error) == (f"{run_dir / 'metrics.jsonl'}: cannot write: the disk is full (no "
                          "space left on device)")
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("}\n") and all(json.loads(line) for line in text.splitlines())
    assert max(json.loads(line)["step"] for line in text.splitlines()) == 2
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 3


class _FillsAt(io.FileIO):
    """An appended file whose disk fills in the middle of the write holding ``marker``:
    part of it lands, then ENOSPC, as from the kernel."""

    def __init__(self, path: Any, marker: bytes):
        super().__init__(path, "ab")
        self.marker = marker

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        if self.marker in chunk:
            super().write(chunk[:len(chunk) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(chunk)
