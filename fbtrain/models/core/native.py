"""The C++ core: its toolchain, its build (once, under fbtrain's build lock), loading it,
and :class:`NativeCore`, its ops behind :class:`~fbtrain.models.core.spec.Core`'s calls.

The source is ``csrc/feedback_core.cpp`` (the step loops, forward and hand-written
backward; see ``spec`` for why). torch compiles it on first use with ``cpp_extension`` into
``$TORCH_EXTENSIONS_DIR``, in a folder named for the source and flags, so later runs load
it in well under a second.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from fbtrain.filelock import POLL_S, PidLock
from fbtrain.messages import first_line
from fbtrain.models.core import ninja_build
from fbtrain.models.core.spec import CoreError, CoreInputs, CoreOutputs, CoreSpec

CSRC = Path(__file__).parent / "csrc" / "feedback_core.cpp"


class CoreBuildError(CoreError):
    """The C++ core could not be compiled or loaded here; ``remedy``: what gets it (for
    the notice of a fallback to the PyTorch core)."""

    def __init__(self, message: str, remedy: str = "install g++ for the fast core"):
        super().__init__(message)
        self.remedy = remedy


# Where the build waits, and for whom. torch serialises builds in a folder with a FileBaton:
# it creates ``lock`` there (O_EXCL) and deletes it when done, and anyone else polls until
# the file is gone. A build killed part-way (kill -9, SIGTERM, the OOM killer) never deletes
# it, so every later run would wait forever. fbtrain therefore takes a lock of its own
# around torch's, a PidLock (an flock, which the kernel releases when its holder dies):
# whoever holds it is the only fbtrain building in the folder, so a ``lock`` file found
# then is stale.
BUILD_LOCK = "fbtrain-build.lock"  # fbtrain's flock, in the build folder; holds its pid
TORCH_LOCK = "lock"  # torch's FileBaton (cpp_extension._jit_compile), same folder
LOCK_POLL_S = POLL_S  # how often a waiter looks again (sleeps, so Ctrl-C interrupts it)


def _core_recipe() -> tuple[str, Path, list[str], list[str]]:
    """The C++ core's base name, source and compile/link flags on this machine."""
    # OpenMP runs the batch shards in parallel (at::parallel_for is header code, serial
    # unless the extension itself is built with it); on Linux the extension then shares
    # torch's own libgomp. Elsewhere the shards run one after another.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    # The attention loops (a fair share of a step: docs/performance.md) are written for the
    # compiler to vectorise: built for AVX2 where torch itself runs AVX2 kernels, under a
    # name of its own, so a cache shared with an older CPU never loads instructions it
    # lacks. Also where torch runs AVX-512: a build for it was no faster (docs/performance.md) and
    # sums in another order, so the same run would give other numbers there.
    capability = torch.backends.cpu.get_cpu_capability()
    avx2 = capability.startswith(("AVX2", "AVX512"))
    name = "fbtrain_core_avx2" if avx2 else "fbtrain_core"
    flags = ["-O3", *openmp, *(["-mavx2", "-mfma"] if avx2 else [])]
    return name, CSRC, flags, openmp


def build_record(source: Path, cflags: Sequence[str], ldflags: Sequence[str]
                 ) -> dict[str, object]:
    """What a build of ``source`` is made from (kept beside it, so the next build of another
    version can say what changed): the source's path and hash, the flags, torch's version."""
    return {"source": str(source.resolve()),
            "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
            "cflags": list(cflags), "ldflags": list(ldflags), "torch": torch.__version__}


def extension_name(base: str, source: Path, cflags: Sequence[str],
                   ldflags: Sequence[str]) -> str:
    """``base`` and 8 hex digits of a hash of the source text and path, the flags and torch's
    version.

    torch keeps one build folder per extension name and rebuilds in it whenever the source,
    its path (written into ``build.ninja``) or the flags differ from the last build there,
    so two checkouts (or fbtrain versions) sharing a cache under one name would rebuild each
    time they alternate. One name per source file gives each its own folder.
    """
    digest = hashlib.sha256(source.read_bytes())
    digest.update(json.dumps([str(source.resolve()), list(cflags), list(ldflags),
                              torch.__version__]).encode())
    return f"{base}_{digest.hexdigest()[:8]}"


def build_directory(name: str) -> Path:
    """The folder torch builds extension ``name`` in (created): ``$TORCH_EXTENSIONS_DIR``
    (default ``~/.cache/torch_extensions/<python>_<accelerator>``) / name."""
    from torch.utils import cpp_extension

    build_dir_of = getattr(cpp_extension, "_get_build_directory", None)  # private: optional
    if build_dir_of is not None:
        return Path(build_dir_of(name, verbose=False))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _waiting_line(build_dir: Path) -> Callable[[str], None]:
    """PidLock's ``on_wait`` for the build lock: a line on stderr naming the holder when
    the wait starts, and again whenever a new holder's pid shows (a holder that has not
    written its pid yet is not news once someone was named)."""
    shown: list[str] = []  # the holders named so far

    def on_wait(holder: str) -> None:
        if shown and (not holder or holder == shown[-1]):
            return
        who = f"another process (pid {holder})" if holder else "another process"
        print(f"fbtrain: waiting for {who} building the C++ core in {build_dir}",
              file=sys.stderr, flush=True)
        shown.append(holder)

    return on_wait


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[bool]:
    """Hold fbtrain's build lock on ``build_dir``, waiting (interruptibly) while another
    process holds it, with a line on stderr naming it. Yields whether the lock is held:
    False only where the platform or file system has no flock, and then nothing is known
    about other builders (the build relies on torch's own lock alone).

    The lock is a :class:`~fbtrain.filelock.PidLock`: the kernel drops it when the holder
    dies, however it dies; the file itself stays and only carries the holder's pid for
    waiters, emptied on release so that no one names a finished build.
    """
    lock = PidLock(build_dir / BUILD_LOCK)
    lock.acquire(wait=None, on_wait=_waiting_line(build_dir))
    try:
        yield lock.held
    finally:
        lock.release(forget_pid=True)


# A shell sitting in a build folder (someone looking around) is no build: one run with no
# script and no ``-c`` is skipped.
_SHELLS = {b"sh", b"bash", b"dash", b"zsh", b"fish", b"ksh", b"mksh", b"csh", b"tcsh"}


def _builders_in(build_dir: Path) -> list[tuple[int, str]]:
    """(pid, command) of the processes at work in ``build_dir``, oldest pid first (Linux;
    elsewhere none are seen).

    torch runs ninja there, and ninja runs each compile there in a process group of its own:
    killing fbtrain, or even its whole process group, can leave a compile (or ninja itself)
    running, still writing into the folder. A zombie has no cwd, so it is skipped.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    target = os.path.realpath(build_dir)
    found = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{entry}/cwd") != target:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().rstrip(b"\0").split(b"\0")
        except OSError:  # gone, a zombie, or another user's
            continue
        command = os.path.basename(args[0]).lstrip(b"-")
        if command in _SHELLS and all(a.startswith(b"-") and a != b"-c" for a in args[1:]):
            continue
        found.append((int(entry), command.decode(errors="replace")))
    return sorted(found)


def _clear_stale_torch_lock(build_dir: Path) -> None:
    """With fbtrain's lock held: wait for whatever a killed build left running in the
    folder (a compile running twice at once into the same object file could leave it
    corrupt), then remove the ``lock`` file it left, if any. Waits even with no ``lock``
    file: torch deletes it on the way out of an interrupted build while the compiler,
    in a process group of its own, may still run."""
    stale = build_dir / TORCH_LOCK
    shown = None
    while builders := _builders_in(build_dir):
        if builders[0] != shown:
            pid, command = shown = builders[0]
            print(f"fbtrain: waiting for a build left running by a killed process (pid {pid}, "
                  f"{command}) in {build_dir}", file=sys.stderr, flush=True)
        time.sleep(LOCK_POLL_S)
    if not stale.exists():
        return
    stale.unlink(missing_ok=True)
    print(f"fbtrain: removed the lock file a killed build left in {build_dir}",
          file=sys.stderr, flush=True)


STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL, for a compile being stopped


def _stop_builders(build_dir: Path) -> None:
    """End what still runs in ``build_dir`` after this process's build was interrupted,
    before its build lock goes: SIGTERM to each process group there (the compiler driver,
    ``cc1plus``: ninja starts each compile in a group of its own, and subprocess.run has
    already SIGKILLed ninja, which would have passed the signal on), SIGKILL after
    :data:`STOP_GRACE_S`. Everything there is this build's: leftovers of another were
    waited for before it began. This process's own group only gets single signals."""
    own = os.getpgrp()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in _builders_in(build_dir):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to signal
                group = os.getpgid(pid)
                if group == own:
                    os.kill(pid, sig)
                else:
                    os.killpg(group, sig)
        give_up = time.monotonic() + STOP_GRACE_S
        while _builders_in(build_dir):
            if time.monotonic() > give_up:
                break
            time.sleep(0.02)
        else:
            return


def load_extension(base: str, source: Path, cflags: Sequence[str],
                   ldflags: Sequence[str]) -> Path:
    """Build ``source`` (first time only) and load it as a library of torch ops; returns its
    path. The build folder is ``base`` plus a hash (:func:`extension_name`), built under
    :func:`build_lock`, so builders wait their turn and a killed build's lock is cleared.
    Raises CoreBuildError (one line) where it cannot be built or loaded.
    """
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()  # $CXX, else c++

    def failed(cause: str) -> CoreBuildError:
        return CoreBuildError(
            f"could not build fbtrain's C++ core ({source}); it needs a C++ compiler (g++) "
            f"on PATH: {cause.strip()}")

    def compile_failed(cause: str) -> CoreBuildError:
        return CoreBuildError(
            f"could not build fbtrain's C++ core ({source}): the compiler failed: "
            f"{cause.strip()}")

    try:
        name = extension_name(base, source, cflags, ldflags)
        build_dir = build_directory(name)
        library = build_dir / f"{name}.so"
        if not library.exists() and shutil.which(compiler) is None:
            # Say so before waiting on anyone, rather than ninja's "c++: not found".
            raise failed(f"{compiler!r} not found (set CXX to name another compiler)")
        made_from = build_record(source, cflags, ldflags)
        # The environment's ninja, whatever PATH says: two ninjas discard each other's
        # build log, so alternating them would compile at every switch (ninja_build).
        with build_lock(build_dir) as locked, ninja_build.environment_ninja_first():
            if locked:
                _clear_stale_torch_lock(build_dir)
            why = ninja_build.compile_reason(build_dir, library, base, made_from)
            if why is not None:
                print(f"fbtrain: compiling the C++ core (about a minute): {why}; into "
                      f"{build_dir}", file=sys.stderr, flush=True)
            try:
                loaded = cpp_extension.load(
                    name=name, sources=[str(source)], extra_cflags=list(cflags),
                    extra_ldflags=list(ldflags), build_directory=str(build_dir),
                    is_python_module=False, verbose=False)
            except BaseException:  # Ctrl-C, SIGTERM: no compile may outlive the lock
                _stop_builders(build_dir)
                raise
            if why is not None:
                ninja_build.write_record(build_dir, made_from)
    except subprocess.CalledProcessError as e:
        # torch runs the compiler (``$CXX -v``, ``--version``) to check it, outside its
        # own error handling: CXX=false ends here.
        raise failed(f"{compiler!r} does not work as a C++ compiler ({shlex.join(e.cmd)} "
                     f"exited with status {e.returncode}; set CXX to name another "
                     "compiler)") from None
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
        if isinstance(e, CoreBuildError):
            raise
        folder = _build_folder_problem(e) if isinstance(e, OSError) else None
        if folder is not None:
            raise CoreBuildError(f"could not build fbtrain's C++ core ({source}): {folder}",
                                 remedy="point TORCH_EXTENSIONS_DIR at a folder fbtrain can "
                                 "write for the fast core") from None
        cause = next((ln for ln in str(e).splitlines() if "error:" in ln), None)  # the compiler's
        if cause is not None:
            raise compile_failed(cause) from None
        raise failed(first_line(e)) from None
    return Path(loaded)


def _build_folder_problem(error: OSError) -> str | None:
    """What is wrong with the folder torch builds in, when ``error`` is about it (a path
    inside the extensions root that cannot be made or written); else None. Such a folder is
    no missing compiler, and says which variable moves it."""
    from torch.utils import cpp_extension

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = os.path.abspath(chosen or cpp_extension.get_default_build_root())
    if error.filename is None or not Path(os.path.abspath(error.filename)).is_relative_to(root):
        return None
    where = f"TORCH_EXTENSIONS_DIR={chosen}" if chosen else f"its build folder {root}"
    reason = (error.strerror or str(error)).lower()
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        why = f"{where} is not a folder, or lies under a file (cannot make {error.filename})"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"{where} cannot be written ({reason}: {error.filename})"
    else:
        why = f"{where}: {reason}: {error.filename}"
    return f"{why}; set TORCH_EXTENSIONS_DIR to a folder fbtrain can write"


@functools.cache
def native_ops():
    """The ``torch.ops.fbtrain`` namespace, compiling the C++ core on first use.

    Its ops run in inference mode, which skips version-counter and view bookkeeping on
    every small op of the loops (docs/performance.md), so what they return are inference
    tensors: fine to read and decode with, but to reach autograd they must be cloned.

    The build is cached (in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/
    torch_extensions``) in a folder named for the source and flags
    (:func:`load_extension`), so later runs load it in well under a second.
    """
    load_extension(*_core_recipe())
    return torch.ops.fbtrain


class NativeCore:
    """The C++ core's ops (compiled on first use) behind ``spec.Core``'s calls. The ops take
    the tensors in :class:`CoreInputs` order, then the :class:`CoreSpec` fields."""

    @staticmethod
    def core_forward(spec: CoreSpec, inputs: CoreInputs, keep_tape: bool = False
                     ) -> CoreOutputs:
        """``spec.Core.core_forward`` on the C++ op."""
        return CoreOutputs(*native_ops().core_forward(*inputs, *spec.args(), keep_tape))

    @staticmethod
    def core_backward(spec: CoreSpec, d_top: Tensor, outputs: CoreOutputs, mix: Tensor,
                      wkv: Tensor, layers: Sequence[Tensor]) -> CoreInputs:
        """``spec.Core.core_backward`` on the C++ op."""
        return CoreInputs(*native_ops().core_backward(d_top, *outputs, mix, wkv, layers,
                                                      *spec.args()))
