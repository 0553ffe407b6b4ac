"""Building the C++ core: one build folder per source, fbtrain's build lock (waiters say
whom they wait for, Ctrl-C stops them), recovery from a build killed part-way, and a
compiler that fails torch's check.

The lock tests build a one-function C++ source (no torch headers: about a second) in a
temporary TORCH_EXTENSIONS_DIR, in subprocesses, the way a second ``fbtrain`` would.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fbtrain.models.core import native

CXX = shutil.which("c++") or shutil.which("g++")
needs_compiler = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
BASE = "fbtrain_test"

# Builds the tiny source given as argv[1] with load_extension and prints what it returns.
BUILDER = """
import ctypes, signal, sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever
# the parent did with SIGINT
from fbtrain.models.core import native
library = native.load_extension(sys.argv[2], Path(sys.argv[1]), [], [])
print(ctypes.CDLL(str(library)).fbtrain_test_answer())
"""


def _tiny_source(tmp_path: Path, answer: int = 42) -> Path:
    """A C++ file with one function; its text is unique to the test (a name of its own in
    torch's per-process registry of extensions)."""
    source = tmp_path / f"tiny_{answer}.cpp"
    source.write_text(f"// {uuid.uuid4()}\n"
                      f'extern "C" int fbtrain_test_answer() {{ return {answer}; }}\n')
    return source


def _builder(source: Path, env: dict[str, str] | None = None,
             new_session: bool = False) -> subprocess.Popen:
    """A subprocess building ``source`` (stdout: its answer; stderr: fbtrain's lines)."""
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(source), BASE],
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


@pytest.fixture
def reap() -> Iterator[Callable[[subprocess.Popen], subprocess.Popen]]:
    """Register a subprocess to be killed, with its session, at the end of the test."""
    procs: list[subprocess.Popen] = []
    yield lambda proc: procs.append(proc) or proc
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _lines(stream) -> queue.Queue:
    """The stream's lines as they come (a thread reads them), so a test can wait for one
    with a timeout."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            for line in stream:
                lines.put(line.rstrip("\n"))
        except ValueError:  # the test's teardown closed the stream (reap's communicate)
            pass
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for_line(lines: queue.Queue, pattern: str, timeout: float = 60) -> str:
    """The first line matching ``pattern``; fails after ``timeout`` s or at end of stream."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no line matching {pattern!r} within {timeout}s; saw {seen}")
        if line is None:
            pytest.fail(f"stream ended without a line matching {pattern!r}; saw {seen}")
        if re.search(pattern, line):
            return line
        seen.append(line)


def _wait_until(condition: Callable[[], bool], timeout: float = 60) -> None:
    """Poll ``condition`` (every 50 ms) until it holds; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s")
        time.sleep(0.05)


def _build_dir(source: Path) -> Path:
    return native.build_directory(native.extension_name(BASE, source, [], []))


# --- one build folder per source -----------------------------------------------------------

def test_each_source_and_flag_set_gets_its_own_build_folder(tmp_path, extensions):
    """torch keeps one folder per extension name; the name carries a hash of the source,
    flags and torch version, so two checkouts sharing a cache never rebuild over each
    other."""
    a, b = _tiny_source(tmp_path, 1), _tiny_source(tmp_path, 2)
    name = native.extension_name
    assert re.fullmatch(rf"{BASE}_[0-9a-f]{{8}}", name(BASE, a, [], []))
    assert name(BASE, a, ["-O3"], []) == name(BASE, a, ["-O3"], [])  # stable
    names = {name(BASE, a, [], []), name(BASE, b, [], []), name(BASE, a, ["-O3"], []),
             name(BASE, a, [], ["-O3"]), name(BASE, a, ["-O3", "-mavx2"], [])}
    assert len(names) == 5
    folders = {native.build_directory(n) for n in names}
    assert len(folders) == 5 and all(f.parent == extensions and f.is_dir() for f in folders)


def test_the_core_is_built_in_a_folder_named_for_its_source(tmp_path):
    base, source, cflags, ldflags = native._core_recipe()
    assert source == native.CSRC and base in ("fbtrain_core", "fbtrain_core_avx2")
    name = native.extension_name(base, source, cflags, ldflags)
    assert re.fullmatch(rf"{base}_[0-9a-f]{{8}}", name)
    edited = tmp_path / "feedback_core.cpp"
    edited.write_text(source.read_text() + "\n// another version\n")
    assert native.extension_name(base, edited, cflags, ldflags) != name
    # Another checkout: the same text at another path (torch writes the path into its
    # build.ninja, so sharing a folder would rebuild at every switch).
    elsewhere = tmp_path / "other" / "feedback_core.cpp"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(source.read_bytes())
    assert native.extension_name(base, elsewhere, cflags, ldflags) != name


# --- the build lock ----------------------------------------------------------------------

@needs_compiler
def test_a_waiter_names_the_holder_then_builds_when_it_lets_go(tmp_path, extensions, reap):
    source = _tiny_source(tmp_path)
    build_dir = _build_dir(source)
    with native.build_lock(build_dir) as locked:
        assert locked
        waiter = reap(_builder(source))
        err = _lines(waiter.stderr)
        line = _wait_for_line(err, "waiting")
        assert line == (f"fbtrain: waiting for another process (pid {os.getpid()}) building "
                        f"the C++ core in {build_dir}")
        assert waiter.poll() is None  # still waiting while the lock is held
    out, _ = waiter.communicate(timeout=120)
    assert waiter.returncode == 0 and out.strip() == "42"


@needs_compiler
def test_ctrl_c_interrupts_a_waiter(tmp_path, extensions, reap):
    source = _tiny_source(tmp_path)
    with native.build_lock(_build_dir(source)):
        waiter = reap(_builder(source))
        err = _lines(waiter.stderr)
        _wait_for_line(err, "waiting for another process")
        waiter.send_signal(signal.SIGINT)
        waiter.wait(timeout=20)  # seconds, not when the lock comes free
    assert waiter.returncode in (-signal.SIGINT, 130)
    rest = []
    while (line := err.get(timeout=10)) is not None:
        rest.append(line)
    assert rest[-1] == "KeyboardInterrupt"


def _slow_compiler(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """CXX for a compiler whose compile step (``-c``) waits while a ``hold`` file exists,
    after creating ``started``: a build that stays in progress until the test lets it go.
    Named g++, which torch's compiler check accepts by name."""
    bin_dir = tmp_path / "slowbin"
    bin_dir.mkdir()
    hold, started = tmp_path / "hold", tmp_path / "started"
    wrapper = bin_dir / "g++"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -c "*)\n'
        f'  touch "{started}"; while [ -e "{hold}" ]; do sleep 0.05; done;;\n'
        "esac\n"
        f'exec "{CXX}" "$@"\n')
    wrapper.chmod(0o755)
    hold.touch()
    return {"CXX": str(wrapper)}, hold, started


@needs_compiler
def test_a_build_killed_part_way_does_not_hang_the_next(tmp_path, extensions, reap):
    """kill -9 mid-compile leaves torch's ``lock`` file behind (what made every later run
    wait forever); the next build clears it and completes."""
    source = _tiny_source(tmp_path)
    build_dir = _build_dir(source)
    env, hold, started = _slow_compiler(tmp_path)
    first = reap(_builder(source, env, new_session=True))
    _wait_until(started.exists)  # compiling: inside torch's lock and fbtrain's
    assert (build_dir / native.TORCH_LOCK).exists()
    os.killpg(first.pid, signal.SIGKILL)  # python and ninja
    first.wait(timeout=20)
    for pid, _ in native._builders_in(build_dir):  # the compile: its own group
        with contextlib.suppress(ProcessLookupError):  # it may end between list and kill
            os.kill(pid, signal.SIGKILL)
    _wait_until(lambda: not native._builders_in(build_dir), timeout=20)
    assert (build_dir / native.TORCH_LOCK).exists()  # the stale state: no one left

    second = reap(_builder(source))
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0 and out.strip() == "42", err
    assert f"fbtrain: removed the lock file a killed build left in {build_dir}" in err
    assert not (build_dir / native.TORCH_LOCK).exists()


@needs_compiler
def test_the_next_build_waits_for_what_a_killed_build_left_running(
        tmp_path, extensions, reap):
    """kill -9 of fbtrain alone leaves its ninja finishing the compile in the build folder;
    the next build waits for them (naming one) rather than compiling over them."""
    source = _tiny_source(tmp_path)
    build_dir = _build_dir(source)
    env, hold, started = _slow_compiler(tmp_path)
    first = reap(_builder(source, env, new_session=True))
    _wait_until(started.exists)
    first.kill()  # the python process only
    first.wait(timeout=20)
    builders = native._builders_in(build_dir)
    assert "ninja" in {command for _, command in builders}

    try:
        second = reap(_builder(source))
        err = _lines(second.stderr)
        line = _wait_for_line(err, "waiting")
        pid, command = builders[0]
        assert line == (f"fbtrain: waiting for a build left running by a killed process "
                        f"(pid {pid}, {command}) in {build_dir}")
        assert second.poll() is None
        hold.unlink()  # the orphaned compile finishes, and then its ninja dies
        _wait_for_line(err, "removed the lock file")
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 0 and out.strip() == "42"
    finally:
        hold.unlink(missing_ok=True)
        for pid, _ in native._builders_in(build_dir):  # what is left of the first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@needs_compiler
def test_ctrl_c_mid_compile_leaves_no_compiler_running(tmp_path, extensions, reap):
    """Ctrl-C during the first compile: subprocess.run SIGKILLs ninja, and the compile, in a
    process group of its own, went on writing into the folder after fbtrain had exited
    (and let go of the build lock). Now it is stopped before fbtrain exits."""
    source = _tiny_source(tmp_path)
    build_dir = _build_dir(source)
    env, hold, started = _slow_compiler(tmp_path)
    try:
        first = reap(_builder(source, env))
        _wait_until(started.exists)  # compiling
        assert native._builders_in(build_dir)
        first.send_signal(signal.SIGINT)  # to fbtrain alone, as a terminal's Ctrl-C reaches
        first.wait(timeout=60)  # ninja, which subprocess.run then kills anyway
        assert first.returncode in (-signal.SIGINT, 1, 130)
        assert native._builders_in(build_dir) == []
    finally:
        hold.unlink(missing_ok=True)
        for pid, _ in native._builders_in(build_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@needs_compiler
def test_the_next_build_waits_for_a_compile_left_running_without_a_lock_file(
        tmp_path, extensions, reap):
    """torch deletes its ``lock`` on the way out of an interrupted build; a compile still
    running in the folder (here: a process there until ``hold`` goes) is waited for all
    the same, not compiled over."""
    source = _tiny_source(tmp_path)
    build_dir = _build_dir(source)
    hold = tmp_path / "hold"
    hold.touch()
    left = reap(subprocess.Popen(["sh", "-c", f'while [ -e "{hold}" ]; do sleep 0.05; done'],
                                 cwd=build_dir))
    try:
        second = reap(_builder(source))
        err = _lines(second.stderr)
        line = _wait_for_line(err, "waiting")
        assert line == (f"fbtrain: waiting for a build left running by a killed process "
                        f"(pid {left.pid}, sh) in {build_dir}")
        assert second.poll() is None and not list(build_dir.glob("*.so"))
        hold.unlink()
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 0 and out.strip() == "42"
    finally:
        hold.unlink(missing_ok=True)


def test_a_build_folder_that_is_a_file_or_read_only_is_named(tmp_path, monkeypatch):
    """Not "it needs a C++ compiler (g++)": the folder, what is wrong with it, and the
    variable that moves it."""
    source = _tiny_source(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(a_file))
    with pytest.raises(native.CoreBuildError) as info:
        native.load_extension(BASE, source, [], [])
    assert str(info.value) == (
        f"could not build fbtrain's C++ core ({source}): TORCH_EXTENSIONS_DIR={a_file} is not "
        f"a folder, or lies under a file (cannot make "
        f"{a_file / native.extension_name(BASE, source, [], [])}); set TORCH_EXTENSIONS_DIR "
        "to a folder fbtrain can write")
    assert info.value.remedy.startswith("point TORCH_EXTENSIONS_DIR at a folder")
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    if subprocess.run(["chattr", "+i", str(frozen)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i does not work here (a read-only folder needs it as root)")
    try:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(frozen))
        with pytest.raises(native.CoreBuildError, match=(
                rf"^could not build fbtrain's C\+\+ core \({source}\): "
                rf"TORCH_EXTENSIONS_DIR={frozen} cannot be written \(operation not permitted: "
                rf"{frozen}/{BASE}_[0-9a-f]{{8}}\); set TORCH_EXTENSIONS_DIR to a folder")):
            native.load_extension(BASE, source, [], [])
    finally:
        subprocess.run(["chattr", "-i", str(frozen)], check=True)


# --- a compiler that fails torch's check ---------------------------------------------------

def test_a_compiler_that_fails_its_check_is_a_core_build_error(tmp_path, extensions,
                                                               monkeypatch):
    """CXX=false exists, but fails the ``$CXX --version`` torch runs to check it: one line,
    not the CalledProcessError's traceback."""
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(native.CoreBuildError,
                       match=r"^could not build fbtrain's C\+\+ core .*: 'false' does not work "
                             r"as a C\+\+ compiler \(false --version exited with status 1; "
                             r"set CXX to name another compiler\)$"):
        native.load_extension(BASE, _tiny_source(tmp_path), [], [])


@needs_compiler
def test_a_source_that_does_not_compile_names_the_compilers_error(tmp_path, extensions):
    """A working compiler that rejects the source (an old g++, missing Python headers)
    gives the compiler's first error line, not a claim that no compiler is there."""
    source = tmp_path / "broken.cpp"
    source.write_text(f"// {uuid.uuid4()}\nint broken( {{ return 0; }}\n")
    with pytest.raises(native.CoreBuildError) as info:
        native.load_extension(BASE, source, [], [])
    message = str(info.value)
    assert message.startswith(f"could not build fbtrain's C++ core ({source}): the "
                              "compiler failed: ")
    assert "broken.cpp:2:" in message and "error:" in message
    assert "\n" not in message and "needs a C++ compiler" not in message


@needs_compiler
def test_the_core_loads_past_the_lock_a_killed_build_left(tmp_path):
    """The reported hang: after a killed first build every run printed "compiling the C++
    core" and waited forever. The core's build (copied from this session's cache, so
    nothing compiles) with the ``lock`` file a killed build leaves loads within seconds."""
    native.native_ops()  # this session's build, made here if not yet
    recipe = native._core_recipe()
    name = native.extension_name(*recipe)
    root = tmp_path / "extensions"
    shutil.copytree(native.build_directory(name), root / name)  # keeps the mtimes
    (root / name / native.TORCH_LOCK).touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "FBTRAIN_CORE": "native",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", "from fbtrain.models.core.select import core; "
         "print(core().__name__)"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "NativeCore"
    assert result.stderr.splitlines() == [
        f"fbtrain: removed the lock file a killed build left in {root / name}"]


def test_the_waiting_line_names_each_new_holder_once(tmp_path, capsys):
    """PidLock reports every change of holder, even to one that has not written its pid
    yet; the build lock's line names the first holder (or nobody) and then each new pid,
    as its own flock loop did before PidLock."""
    on_wait = native._waiting_line(tmp_path)
    for holder in ["", "123", "", "123", "456"]:
        on_wait(holder)
    where = f"building the C++ core in {tmp_path}"
    assert capsys.readouterr().err.splitlines() == [
        f"fbtrain: waiting for another process {where}",
        f"fbtrain: waiting for another process (pid 123) {where}",
        f"fbtrain: waiting for another process (pid 456) {where}"]
