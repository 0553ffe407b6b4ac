"""Which core runs: FBTRAIN_CORE, the fallback to the PyTorch core and its notice, ninja
from PyPI. (The cores' numbers are checked against the reference in test_models.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fbtrain.config import ModelConfig
from fbtrain.errors import UserError
from fbtrain.models import build_model
from fbtrain.models.core import native, python, select

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "Running on the PyTorch core instead"


@pytest.fixture
def fresh_resolution() -> Iterator[None]:
    """Forget which core each FBTRAIN_CORE value resolved to, before and after the test."""
    select._resolve.cache_clear()
    yield
    select._resolve.cache_clear()


@pytest.fixture
def broken_build(monkeypatch, fresh_resolution) -> native.CoreBuildError:
    """native_ops fails as it does without a compiler."""
    error = native.CoreBuildError(
        "could not build fbtrain's C++ core (x.cpp); it needs a C++ compiler (g++) on PATH: "
        "'c++' not found (set CXX to name another compiler)")

    def fail():
        raise error

    monkeypatch.setattr(native, "native_ops", fail)
    return error


@pytest.mark.parametrize("value", ["", "auto", "native", "python", " Python "])
def test_core_choice_accepts(value, monkeypatch):
    monkeypatch.setenv("FBTRAIN_CORE", value)
    assert select.core_choice() == (value.strip().lower() or "auto")


def test_invalid_core_choice_is_one_clear_line(monkeypatch):
    """Checked when a feedback model is built, not at its first step; a CoreError is a
    UserError, which the CLI prints as one ``error:`` line (exit 2)."""
    monkeypatch.setenv("FBTRAIN_CORE", "fast")
    with pytest.raises(select.CoreError) as info:
        build_model(ModelConfig(kind="feedback_kv", d_model=16, n_heads=2, d_ff=24,
                                n_layers=1), 11)
    assert str(info.value) == ("FBTRAIN_CORE='fast' is not a core; use one of auto, native, "
                               "python")
    assert isinstance(info.value, UserError)


def test_python_choice_never_builds(monkeypatch, broken_build, capsys):
    monkeypatch.setenv("FBTRAIN_CORE", "python")
    assert select.core() is python
    assert capsys.readouterr().err == ""


def test_auto_falls_back_with_one_notice_line_per_process(monkeypatch, broken_build, capsys):
    monkeypatch.setenv("FBTRAIN_CORE", "auto")
    assert select.core() is python
    assert select.core() is python
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count(NOTICE) == 1
    assert str(broken_build) in err  # why
    assert f"about {select.PYTHON_CORE_SLOWDOWN} slower" in err  # at what cost
    assert "install g++" in err and "FBTRAIN_CORE=python" in err  # what to do


def test_native_choice_fails_loudly(monkeypatch, broken_build, capsys):
    monkeypatch.setenv("FBTRAIN_CORE", "native")
    with pytest.raises(native.CoreBuildError, match="could not build fbtrain's C"):
        select.core()
    assert capsys.readouterr().err == ""


def test_auto_takes_the_native_core_where_it_builds(monkeypatch, fresh_resolution):
    monkeypatch.setenv("FBTRAIN_CORE", "auto")
    assert select.core() is native.NativeCore


def _no_compiler_env(tmp_path: Path, core: str) -> dict[str, str]:
    """PATH without a C++ compiler (nor anything else) and an empty extensions cache."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "FBTRAIN_CORE_ATEN")}
    env.update(PATH=str(bin_dir), FBTRAIN_CORE=core, OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    return env


def _train(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 60, encoding="utf-8")
    sets = [f"data.path={text}", f"run.out_dir={tmp_path / 'runs'}", "train.max_steps=3",
            "train.eval_every=3", "train.eval_windows=2", "checkpoint.every=3",
            "train.batch_size=4", "curriculum=8", "logging.tensorboard=false"]
    args = [sys.executable, "-m", "fbtrain", "train", "--config",
            str(ROOT / "configs" / "tiny.yaml"), "--device", "cpu", "--quiet"]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def test_trains_on_the_fallback_without_a_compiler(tmp_path):
    """A machine without g++: ``fbtrain train`` trains on the PyTorch core, after the notice
    (one line, once, although training and evaluation run the core many times)."""
    assert shutil.which("c++", path=str(tmp_path / "bin")) is None
    result = _train(tmp_path, _no_compiler_env(tmp_path, "auto"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "last.pt").is_file()
    notices = [line for line in result.stderr.splitlines() if NOTICE in line]
    assert len(notices) == 1 and result.stderr.count(NOTICE) == 1
    assert notices[0].startswith("fbtrain: could not build fbtrain's C++ core")
    assert "'c++' not found" in notices[0]


def _broken_compiler_env(tmp_path: Path, core: str) -> dict[str, str]:
    """CXX=false: a compiler that exists but fails the ``$CXX --version`` torch runs to
    check it (an empty extensions cache, so a build is attempted)."""
    env = _no_compiler_env(tmp_path, core)
    env.update(CXX="false", PATH=os.environ["PATH"])
    return env


def test_a_compiler_that_fails_its_check_falls_back_with_the_notice(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from fbtrain.models.core.select import core; "
         "print(core().__name__)"], env=_broken_compiler_env(tmp_path, "auto"),
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "fbtrain.models.core.python"
    assert "Traceback" not in result.stderr
    notices = [line for line in result.stderr.splitlines() if NOTICE in line]
    assert len(notices) == 1
    assert notices[0].startswith("fbtrain: could not build fbtrain's C++ core")
    assert "'false' does not work as a C++ compiler (false --version exited with status 1" \
        in notices[0]


@pytest.mark.parametrize("compiler, cause", [
    ("missing", "'c++' not found (set CXX to name another compiler)"),
    ("broken", "'false' does not work as a C++ compiler (false --version exited with status 1; "
               "set CXX to name another compiler)"),
])
def test_native_choice_without_a_working_compiler_exits_2(compiler, cause, tmp_path):
    """FBTRAIN_CORE=native with no compiler, or one failing torch's check: one error line
    naming the source and why, exit 2, no fallback notice."""
    env = {"missing": _no_compiler_env, "broken": _broken_compiler_env}[compiler]
    result = _train(tmp_path, env(tmp_path, "native"))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: could not build fbtrain's C++ core ({native.CSRC}); it "
                      f"needs a C++ compiler (g++) on PATH: {cause}"]
    assert NOTICE not in result.stderr and "Traceback" not in result.stderr
