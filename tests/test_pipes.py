"""A closed stdout: ``fbtrain eval ... --json | true`` and ``fbtrain export ... | true`` end
quietly with exit code 0, as cli_errors promises (typer's own handling exited 1). Real
pipes whose reading end is closed before the command writes, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_evaluate import make_text
from test_sample import tiny_model, write_run


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
