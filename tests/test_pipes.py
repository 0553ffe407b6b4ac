"""A closed stdout: ``fbtrain eval ... --json | true`` and ``fbtrain export ... | true`` end
quietly with exit code 0, as cli_errors promises (typer's own handling exited 1). Real
pipes whose reading end is closed before the command writes, in a subprocess. A full one
(``> /dev/full``): one line naming stdout and exit 2, but training goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_evaluate import make_text
from test_sample import tiny_model, write_run
from test_train import CHILD_ENV, make_raw

FULL = Path("/dev/full")
STDOUT_FULL = "error: stdout: cannot write: the disk is full (no space left on device)"


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m fbtrain ARGS`` with stdout a pipe nobody reads (its read end closed)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "fbtrain", *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pipes")
    text = tmp / "text.txt"
    text.write_text(make_text(400), encoding="utf-8")
    write_run(tmp / "run", tiny_model(), text_path=text)
    return tmp / "run"


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_eval_into_a_closed_pipe_exits_0_quietly(run_dir: Path, json_flag: list[str]) -> None:
    result = run_into_closed_pipe("eval", "-c", str(run_dir), "--device", "cpu", *json_flag)
    assert (result.returncode, result.stderr) == (0, "")


def test_export_into_a_closed_pipe_exits_0_quietly(run_dir: Path, tmp_path: Path) -> None:
    result = run_into_closed_pipe("export", "-c", str(run_dir), "--out", str(tmp_path / "x"))
    assert (result.returncode, result.stderr) == (0, "")
    assert (tmp_path / "x" / "model.safetensors").is_file()  # the work itself was done


def run_into_full(*args: str, stream: str = "stdout") -> subprocess.CompletedProcess[str]:
    """``python -m fbtrain ARGS`` with ``stream`` (stdout or stderr) on /dev/full, where
    every write fails with ENOSPC; the other stream captured."""
    with open(FULL, "w") as full:
        where = {"stdout": full} if stream == "stdout" else {"stderr": full}
        other = {"stderr": subprocess.PIPE} if stream == "stdout" else {"stdout": subprocess.PIPE}
        return subprocess.run([sys.executable, "-m", "fbtrain", *args], text=True, timeout=300,
                              env=CHILD_ENV, **where, **other)


needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")


@needs_dev_full
@pytest.mark.parametrize("command", [["eval", "--json"], ["eval"], ["export"], ["sample"],
                                     ["sample", "--num-samples", "2"]],
                         ids=lambda c: " ".join(c))
def test_a_full_stdout_is_one_line_naming_it_and_exit_2(
        run_dir: Path, tmp_path: Path, command: list[str]) -> None:
    """> /dev/full: eval and export ended in an OSError traceback, sample in "[Errno 28] No
    space left on device" naming nothing."""
    extra = {"export": ["--out", str(tmp_path / "x")], "sample": ["--length", "5"]}
    result = run_into_full(command[0], "-c", str(run_dir), *command[1:],
                           *extra.get(command[0], []), *(["--device", "cpu"]
                                                         if command[0] != "export" else []))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == STDOUT_FULL, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    if command[0] == "export":
        assert (tmp_path / "x" / "model.safetensors").is_file()  # the work itself was done


@needs_dev_full
def test_a_full_stderr_keeps_the_exit_code(tmp_path: Path) -> None:
    """2>/dev/full: the error line cannot be written, and the exit was 1, not the 2 of the
    error it could not report."""
    result = run_into_full("eval", "-c", str(tmp_path / "nonexist"), stream="stderr")
    assert (result.returncode, result.stdout) == (2, "")


@needs_dev_full
def test_training_goes_on_when_its_console_is_full(tmp_path: Path) -> None:
    """fbtrain train > /dev/full stopped at its first line with "[Errno 28] No space left
    on device", nothing trained; a closed stdout lets it go on. The console is a view of
    the run's files: it says so once on stderr, and the run trains and saves to the end."""
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(make_raw(tmp_path, train={"max_steps": 4})))
    result = run_into_full("train", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ("warning: stdout: cannot write: the disk is full (no space left on "
                             "device); training goes on without console output (the run's "
                             "files are written as before)\n")
    from fbtrain.checkpoint import load_checkpoint

    assert load_checkpoint(tmp_path / "runs" / "run" / "checkpoints" / "last.pt")["step"] == 4
