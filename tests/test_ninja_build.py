"""The C++ core's build runs with the environment's own ninja whatever PATH says (a build
made from ``make`` loads, without compiling, in an activated shell whose PATH has another
ninja first), and says why whenever it compiles.

The builds are of a one-function C++ source (no torch headers: about a second) in a
temporary TORCH_EXTENSIONS_DIR, as in test_build.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fbtrain.models.core import native, ninja_build
from tests.test_build import BASE, BUILDER, _build_dir, _tiny_source, needs_compiler

ENV_NINJA = ninja_build.environment_ninja_dir()
COMPILING = "fbtrain: compiling the C++ core (about a minute): "


def _other_ninja() -> Path | None:
    """A ninja on PATH that is not this environment's (a distribution's, say); else None."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("ninja", path=folder) if folder else None
        if found and ENV_NINJA and Path(folder).resolve() != Path(ENV_NINJA).resolve():
            return Path(found)
    return None


OTHER_NINJA = _other_ninja()


def _build(source: Path, path: str) -> subprocess.CompletedProcess:
    """Build (or load) ``source`` in a subprocess whose PATH is ``path``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}
    return subprocess.run([sys.executable, "-c", BUILDER, str(source), BASE], env=env,
                          capture_output=True, text=True, timeout=120)


@needs_compiler
@pytest.mark.skipif(ENV_NINJA is None or OTHER_NINJA is None,
                    reason="needs the environment's ninja and another one on PATH")
def test_a_build_loads_without_compiling_with_another_ninja_first_on_path(
        tmp_path, extensions, monkeypatch, capsys):
    """The reported 18 builds: ``make`` (PATH without the venv) and an activated shell (the
    venv's ninja first) took turns with two ninjas, each discarding the other's build log.
    A build made here (PATH as the tests run) loads, in fresh processes, with the other
    ninja first and with the environment's first, without compiling."""
    source = _tiny_source(tmp_path)
    other_first = os.pathsep.join([str(OTHER_NINJA.parent), os.environ["PATH"]])
    env_first = os.pathsep.join([str(ENV_NINJA), os.environ["PATH"]])
    native.load_extension(BASE, source, [], [])
    assert capsys.readouterr().err.startswith(f"{COMPILING}first use")
    obj = next(_build_dir(source).glob("*.o"))
    built = obj.stat().st_mtime_ns
    for path in (env_first, other_first):
        again = _build(source, path)
        assert again.returncode == 0 and again.stdout.strip() == "42", again.stderr
        assert again.stderr == ""  # nothing compiled, nothing said
        assert obj.stat().st_mtime_ns == built


def test_the_environment_ninja_goes_first_for_the_build_only(monkeypatch, tmp_path):
    """PATH gets the environment's ninja folder first inside the block (even when PATH has
    another ninja, or none), and is as it was after."""
    if ENV_NINJA is None:
        pytest.skip("the environment has no ninja")
    monkeypatch.setenv("PATH", str(tmp_path))
    with ninja_build.environment_ninja_first() as folder:
        assert folder == ENV_NINJA
        assert os.environ["PATH"].split(os.pathsep) == [ENV_NINJA, str(tmp_path)]
        assert Path(shutil.which("ninja")).parent == Path(ENV_NINJA)
    assert os.environ["PATH"] == str(tmp_path)


@needs_compiler
def test_every_compile_says_why(tmp_path, extensions, capsys):
    """One line before each compile, with its reason: the first use, the source edited in
    place (ninja's own explanation), other flags, another text of the same file; a load
    that compiles nothing says nothing."""
    source = _tiny_source(tmp_path)

    def build(cflags: list[str]) -> list[str]:
        native.load_extension(BASE, source, cflags, [])
        return capsys.readouterr().err.splitlines()

    first = build([])
    assert first == [f"{COMPILING}first use; into {_build_dir(source)}"]
    assert build([]) == []  # loads
    stamp = source.stat().st_mtime + 5  # the same text, newer: ninja rebuilds it
    os.utime(source, (stamp, stamp))
    assert build([]) == [f"{COMPILING}the source (or a header it includes) changed; into "
                         f"{_build_dir(source)}"]
    [line] = build(["-O1"])
    assert line.startswith(f"{COMPILING}the compiler flags changed since the last build")
    source.write_text(source.read_text() + "// edited\n")
    [line] = build(["-O1"])
    assert line.startswith(f"{COMPILING}the source changed since the last build")
