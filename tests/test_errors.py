"""fbtrain's exception hierarchy (fbtrain.errors): a user's errors (UserError, exit 2) and
training's stops (TrainingError), each with its exit code, mapped with everything else the
CLI reports (OSError, Ctrl-C, click's usage errors, a closed pipe) in one function
(cli_errors.exit_code_for), for every command; anything else keeps its traceback."""

from __future__ import annotations

import errno
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import fbtrain
import fbtrain.train
from fbtrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fbtrain.cli import app
from fbtrain.cli_errors import click, exit_code_for
from fbtrain.config import ConfigError, config_from_dict
from fbtrain.data.errors import DataError, VocabularyError
from fbtrain.device import DeviceError
from fbtrain.errors import EXIT_USAGE, ArgumentError, FbtrainError, TrainingError, UserError
from fbtrain.models.core.native import CoreBuildError
from fbtrain.models.core.spec import CoreError
from fbtrain.rng import RngStateError
from fbtrain.startup import Stopped
from fbtrain.train import run

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models, one thread


@pytest.mark.parametrize("cls", [ConfigError, DataError, VocabularyError, CheckpointError,
                                 DeviceError, RngStateError, CoreError, CoreBuildError])
def test_every_user_facing_error_is_a_user_error_with_exit_code_2(cls: type) -> None:
    assert issubclass(cls, UserError) and cls.exit_code == EXIT_USAGE


@pytest.mark.parametrize(("error", "code"), [
    (ConfigError(["a", "b"]), 2), (ArgumentError("length = 0"), 2),
    (TrainingError("step 5: loss is nan"), 1), (TrainingError("interrupted", 143), 143),
    (OSError(errno.EROFS, "Read-only file system", "out/x"), 2), (BrokenPipeError(), 0),
    (KeyboardInterrupt(), 130), (Stopped(signal.SIGTERM), 143), (Stopped(signal.SIGHUP), 129),
    (click.exceptions.UsageError("no such option: --steps"), 2),
    (ValueError("a bug"), None), (RuntimeError("a bug"), None), (KeyError("a bug"), None)])
def test_every_exit_code_is_decided_in_one_function(error: BaseException,
                                                    code: int | None) -> None:
    assert exit_code_for(error) == code


def test_training_stops_and_user_errors_are_one_hierarchy() -> None:
    assert issubclass(TrainingError, FbtrainError) and issubclass(UserError, FbtrainError)
    assert issubclass(ArgumentError, UserError) and issubclass(ArgumentError, ValueError)
    assert not issubclass(TrainingError, UserError)  # training stopped: not the user's input
    assert fbtrain.train.TrainingError is TrainingError


@pytest.mark.parametrize("command", [["train", "--config", "configs/tiny.yaml"],
                                     ["sample", "-c", "runs/x"], ["eval", "-c", "runs/x"]])
def test_a_user_error_is_one_line_and_its_exit_code(monkeypatch: pytest.MonkeyPatch,
                                                    command: list[str]) -> None:
    """Any UserError, from any command, whatever its class: its line and its code."""

    class Refused(UserError):
        exit_code = 3

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise Refused("x.pt: refused, for a reason")

    import fbtrain.evaluate
    import fbtrain.sample
    import fbtrain.train

    for module in (fbtrain.train, fbtrain.sample, fbtrain.evaluate):
        monkeypatch.setattr(module, "run", refuse)
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 3, result.output
    assert result.stderr.splitlines() == ["error: x.pt: refused, for a reason"]


def _trained_run(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """A tiny run trained 2 steps, and the config (as a dict) that resumes it."""
    text = tmp_path / "text.txt"
    text.write_text("the king and the queen and my lord\n" * 40, encoding="utf-8")
    raw = {"run": {"name": "run", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
           "data": {"path": str(text)},
           "model": {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1},
           "train": {"max_steps": 2, "batch_size": 2, "eval_every": 2, "eval_windows": 2},
           "curriculum": [{"seq_len": 8}],
           "logging": {"tensorboard": False, "progress": False}}
    run_dir = run(config_from_dict(raw), quiet=True)
    raw["train"]["max_steps"] = 3
    return raw, run_dir


def test_resume_from_a_damaged_cuda_rng_state_is_one_line_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose CUDA generator state is the wrong size, resumed through the real
    CLI, ends in one ``error:`` line naming the file and exit code 2 (it was a ValueError
    that ``fbtrain train`` did not map: a traceback).

    Without a GPU the one call that needs CUDA answers as torch does on one (RuntimeError:
    the state does not fit the generator); everything else is the real CLI and trainer."""
    raw, run_dir = _trained_run(tmp_path)
    last = run_dir / "checkpoints" / "last.pt"
    payload = load_checkpoint(last)
    payload["rng"]["cuda"] = [torch.zeros(7, dtype=torch.uint8)]  # a generator holds 16
    save_checkpoint(last, payload)
    (tmp_path / "cfg.yaml").write_text(json.dumps(raw))  # JSON is YAML

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        raise RuntimeError(f"Expected a CUDA generator state of 16 bytes, got {state.numel()}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml"),
                                      "--resume", "auto", "-q"])
    assert result.exit_code == EXIT_USAGE, result.exception
    assert result.stderr.splitlines() == [
        f"error: {last}: cannot restore training state: rng: malformed RNG state: rng.cuda: "
        "Expected a CUDA generator state of 16 bytes, got 7"]


# A process that reports an error with skip_teardown, then would run Python's teardown (an
# atexit handler stands for it: the DDP Reducer's destructor that can deadlock).
SKIP_TEARDOWN_CHILD = """
import atexit, sys
from pathlib import Path
from fbtrain.cli_errors import fail
from fbtrain.distributed import PeerLost
atexit.register(lambda: Path(sys.argv[1]).write_text("teardown ran"))
print("done at step 4")
fail(PeerLost("rank 1 of 2 stopped"))
"""


def test_a_lost_peer_ends_the_process_without_pythons_teardown(tmp_path: Path) -> None:
    """PeerLost is reported (its line, stdout flushed first) and the process ends with its
    code at once: the gloo group's teardown after a peer died can hang (a killed-rank
    test hung once in CI this way), so it must not run."""
    import subprocess
    import sys

    marker = tmp_path / "teardown"
    proc = subprocess.run([sys.executable, "-c", SKIP_TEARDOWN_CHILD, str(marker)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "done at step 4\n"
    assert proc.stderr == "error: rank 1 of 2 stopped\n"
    assert not marker.exists()


def test_a_bug_inside_a_parts_restore_keeps_its_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError raised by fbtrain's own code while a part is restored is a bug: it
    reaches the caller as itself (it was 'cannot restore training state', exit 2)."""
    from fbtrain.train.clock import RunClock

    raw, _ = _trained_run(tmp_path)

    def broken(self: RunClock, state: Any) -> None:
        raise ValueError("a bug in the clock's restore")

    monkeypatch.setattr(RunClock, "load_state_dict", broken)
    with pytest.raises(ValueError, match="a bug in the clock's restore"):
        run(config_from_dict(raw), resume="auto", quiet=True)
    (tmp_path / "cfg.yaml").write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml"),
                                      "--resume", "auto", "-q"])
    assert isinstance(result.exception, ValueError) and result.exit_code == 1


def test_a_state_torch_refuses_names_its_part_and_keeps_the_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state torch's own load_state_dict refuses (one no check foresaw) is the
    checkpoint's fault: one CheckpointError naming the file and the part, the cause
    chained."""
    raw, run_dir = _trained_run(tmp_path)

    def refuse(self: torch.optim.Optimizer, state: Any) -> None:
        raise ValueError("loaded state dict contains a parameter group that doesn't match")

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", refuse)
    with pytest.raises(CheckpointError) as caught:
        run(config_from_dict(raw), resume="auto", quiet=True)
    assert str(caught.value) == (
        f"{run_dir / 'checkpoints' / 'last.pt'}: cannot restore training state: optimizer: "
        "loaded state dict contains a parameter group that doesn't match")
    assert isinstance(caught.value.__cause__.__cause__, ValueError)  # torch's own error


@pytest.mark.parametrize(("error", "code"), [
    (OSError(errno.ENOSPC, "No space left on device", "runs/x/last.pt"), EXIT_USAGE),
    (PermissionError(errno.EACCES, "Permission denied", "runs"), EXIT_USAGE),
    (OSError(errno.EROFS, "Read-only file system", "runs"), EXIT_USAGE),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "runs/x/chekpoints"), None),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), None),
    (OSError(errno.EBADF, "Bad file descriptor"), None),
], ids=["ENOSPC", "EACCES", "EROFS", "ENOENT-internal", "ENOENT-unnamed", "EBADF"])
def test_only_the_os_errors_a_user_causes_are_bad_input(error: OSError,
                                                        code: int | None) -> None:
    """A full disk, no permission, a read-only place: exit 2 and the line. A file fbtrain
    itself looked for in the wrong place is a bug and keeps its traceback."""
    assert exit_code_for(error) == code


def test_a_missing_path_the_user_named_is_bad_input_and_an_internal_one_a_bug(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Through the real CLI: a FileNotFoundError for the path given to --checkpoint is one
    line and exit 2; the same error for a path the command made itself keeps its
    traceback."""
    import fbtrain.evaluate

    named = tmp_path / "run"
    internal = tmp_path / "run" / "chekpoints" / "last.pt"

    for path, code in ((named, EXIT_USAGE), (internal, 1)):
        def missing(*args: Any, _path: Path = path, **kwargs: Any) -> None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(_path))

        monkeypatch.setattr(fbtrain.evaluate, "run", missing)
        result = CliRunner().invoke(app, ["eval", "-c", str(named)])
        assert result.exit_code == code, result.output
        if code == EXIT_USAGE:
            assert result.stderr.splitlines() == [
                f"error: [Errno 2] No such file or directory: '{named}'"]
        else:
            assert isinstance(result.exception, FileNotFoundError)


def test_exit_code_values_are_defined_in_errors_alone() -> None:
    """No module but fbtrain/errors.py gives an exit code a number: an ``EXIT_*`` name or an
    ``exit_code`` set to a literal elsewhere would let two places disagree."""
    import ast

    root = Path(fbtrain.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and \
                    isinstance(node.value, ast.Constant) and isinstance(node.value.value, int):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id if isinstance(t, ast.Name) else getattr(t, "attr", "")
                         for t in targets]
                found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                          if n.startswith("EXIT_") or n == "exit_code"]
    assert found == []
