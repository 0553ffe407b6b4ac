"""The sequential core of the Feedback Transformer, with a hand-written backward pass.

Why hand-written: a feedback model must run one token at a time, so a training step is
``seq_len * n_layers`` tiny steps. Under plain autograd every tiny op also records a graph
node and replays it in the backward, and on a CPU that per-op overhead, not arithmetic, is
the cost. Here the forward runs without autograd, keeping only what the backward needs; the
backward sweeps the steps in reverse computing *activation* gradients only, and every
*weight* gradient is one large matmul over all steps at the end. The step loops themselves
are ATen calls driven from C++ (``csrc/feedback_core.cpp``, built on first use): that takes
the interpreter out of the loop, and on a CPU it splits the batch into one shard per thread,
since a batch row never interacts with another until the weight gradients, and runs
attention over each step's window as one vectorised loop per (row, head). Where the C++
core cannot be built or loaded, the same loops run as PyTorch calls (``python_core.py``,
slower); ``FBTRAIN_CORE`` picks (see :func:`core`). ``tests/reference.py`` checks both
against a slow autograd implementation written straight from the equations.

Shapes: B batch, T steps in this call, D model width, H heads, d_k = D / H, L layers,
F feed-forward width, S = n0 + T memory slots (n0 carried over from an earlier call),
n_kv key/value sets (1 for ``feedback_kv``, L for ``feedback``). Memory keys and values
live in preallocated buffers ``[n_kv, B*H, S, d_k]``; nothing is re-stacked per step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

try:
    import fcntl  # POSIX; elsewhere builds rely on torch's own lock alone
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

CSRC = Path(__file__).parent / "csrc" / "feedback_core.cpp"


CORE_ENV = "FBTRAIN_CORE"
CORE_CHOICES = ("auto", "native", "python")
# How much slower a training step is on the PyTorch core than on the C++ one, for the
# fallback notice: feedback_kv at the benchmark sizes (d_model 128, 4 layers, batch 16) on
# a busy 2-core CPU, two interleaved runs: 2.8x and 3.9x at length 64 (1346 vs 481 ms a
# step in the first), 4.5x and 4.7x at 256 (8562 vs 1889 ms).
PYTHON_CORE_SLOWDOWN = "3-5x"


class CoreError(OSError):
    """The feedback core cannot run as asked (one line; the CLI exits 2)."""


class CoreBuildError(CoreError):
    """The C++ core could not be compiled or loaded here."""


def _put_ninja_on_path() -> None:
    """torch builds extensions with the ``ninja`` it finds on PATH. The one from PyPI (a
    dependency of fbtrain) sits in the environment's scripts folder, which is on PATH only
    while the environment is activated: ``.venv/bin/fbtrain train ...`` must find it too.
    Appended, so it never shadows anything already on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI package: ninja.BIN_DIR holds its binary

        folders = [ninja.BIN_DIR]
    except ImportError:
        folders = []
    folders += [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    for folder in folders:
        if folder and shutil.which("ninja", path=folder):
            os.environ["PATH"] = os.pathsep.join(filter(None, (os.environ.get("PATH"), folder)))
            return


# Where the build waits, and for whom. torch serialises builds in a folder with a FileBaton:
# it creates ``lock`` there (O_EXCL) and deletes it when done, and anyone else polls until
# the file is gone. A build killed part-way (kill -9, SIGTERM, the OOM killer) never deletes
# it, so every later run would wait forever. fbtrain therefore takes a lock of its own
# around torch's, an flock, which the kernel releases when its holder dies: whoever holds
# it is the only fbtrain building in the folder, so a ``lock`` file found then is stale.
BUILD_LOCK = "fbtrain-build.lock"  # fbtrain's flock, in the build folder; holds its pid
TORCH_LOCK = "lock"  # torch's FileBaton (cpp_extension._jit_compile), same folder
LOCK_POLL_S = 0.2  # how often a waiter looks again (sleeps, so Ctrl-C interrupts it)


def _core_recipe() -> tuple[str, Path, list[str], list[str]]:
    """The C++ core's base name, source and compile/link flags on this machine."""
    # OpenMP runs the batch shards in parallel (at::parallel_for is header code, serial
    # unless the extension itself is built with it); on Linux the extension then shares
    # torch's own libgomp. Elsewhere the shards run one after another.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    # The attention loops are written for the compiler to vectorise: built for AVX2 where
    # torch itself runs AVX2 kernels (about 20% of a step at length 64), under a name of
    # its own, so a cache shared with an older CPU never loads instructions it lacks.
    capability = torch.backends.cpu.get_cpu_capability()
    avx2 = capability.startswith(("AVX2", "AVX512"))
    name = "fbtrain_core_avx2" if avx2 else "fbtrain_core"
    flags = ["-O3", *openmp, *(["-mavx2", "-mfma"] if avx2 else [])]
    return name, CSRC, flags, openmp


def extension_name(base: str, source: Path, cflags: Sequence[str],
                   ldflags: Sequence[str]) -> str:
    """``base`` and 8 hex digits of a hash of the source text, the flags and torch's version.

    torch keeps one build folder per extension name and rebuilds in it whenever the source
    or flags differ from the last build there, so two checkouts (or fbtrain versions)
    sharing a cache under one name would rebuild each time they alternate. One name per
    source gives each its own folder.
    """
    digest = hashlib.sha256(source.read_bytes())
    digest.update(json.dumps([list(cflags), list(ldflags), torch.__version__]).encode())
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


def _lock_holder(fd: int) -> int | None:
    """The pid the holder of fbtrain's build lock wrote into it (None: not written yet)."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[bool]:
    """Hold fbtrain's build lock on ``build_dir``, waiting (interruptibly) while another
    process holds it, with a line on stderr naming it. Yields whether the lock is held:
    False only where the platform or file system has no flock, and then nothing is known
    about other builders.

    An flock belongs to the open file, so the kernel drops it when the holder dies, however
    it dies; the file itself stays and only carries the holder's pid for waiters.
    """
    if fcntl is None:  # Windows: torch's own lock only
        yield False
        return
    fd = os.open(build_dir / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        shown: int | None = None
        waited = False
        while True:
            try:
                # Non-blocking, with sleeps between tries: a sleep always ends in
                # KeyboardInterrupt on Ctrl-C, and the line can follow a change of holder.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError:  # no flock on this file system: build under torch's lock only
                yield False
                return
            holder = _lock_holder(fd)
            if not waited or (holder is not None and holder != shown):
                who = f"another process (pid {holder})" if holder else "another process"
                print(f"fbtrain: waiting for {who} building the C++ core in {build_dir}",
                      file=sys.stderr, flush=True)
                waited, shown = True, holder
            time.sleep(LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield True
        finally:
            os.ftruncate(fd, 0)  # no pid of a finished build for the next waiter to name
    finally:
        os.close(fd)  # releases the flock


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
    """Remove the ``lock`` file a killed build left (call with fbtrain's lock held), once
    whatever that build left running in the folder has finished: a compile running twice
    at once into the same object file could leave it corrupt."""
    stale = build_dir / TORCH_LOCK
    if not stale.exists():
        return
    shown = None
    while builders := _builders_in(build_dir):
        if builders[0] != shown:
            pid, command = shown = builders[0]
            print(f"fbtrain: waiting for a build left running by a killed process (pid {pid}, "
                  f"{command}) in {build_dir}", file=sys.stderr, flush=True)
        time.sleep(LOCK_POLL_S)
    stale.unlink(missing_ok=True)
    print(f"fbtrain: removed the lock file a killed build left in {build_dir}",
          file=sys.stderr, flush=True)


def load_extension(base: str, source: Path, cflags: Sequence[str],
                   ldflags: Sequence[str]) -> Path:
    """Build ``source`` (first time only) and load it as a library of torch ops; returns its
    path. The build folder is ``base`` plus a hash (:func:`extension_name`), built under
    :func:`build_lock`, so builders wait their turn and a killed build's lock is cleared.
    Raises CoreBuildError (one line) where it cannot be built or loaded.
    """
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    compiler = cpp_extension.get_cxx_compiler()  # $CXX, else c++

    def failed(cause: str) -> CoreBuildError:
        return CoreBuildError(
            f"could not build fbtrain's C++ core ({source}); it needs a C++ compiler (g++) "
            f"on PATH: {cause.strip()}")

    try:
        name = extension_name(base, source, cflags, ldflags)
        build_dir = build_directory(name)
        library = build_dir / f"{name}.so"
        if not library.exists() and shutil.which(compiler) is None:
            # Say so before waiting on anyone, rather than ninja's "c++: not found".
            raise failed(f"{compiler!r} not found (set CXX to name another compiler)")
        with build_lock(build_dir) as locked:
            if locked:
                _clear_stale_torch_lock(build_dir)
            if not library.exists():
                print(f"fbtrain: compiling the C++ core into {build_dir} (once, about a "
                      "minute)", file=sys.stderr, flush=True)
            loaded = cpp_extension.load(
                name=name, sources=[str(source)], extra_cflags=list(cflags),
                extra_ldflags=list(ldflags), build_directory=str(build_dir),
                is_python_module=False, verbose=False)
    except subprocess.CalledProcessError as e:
        # torch runs the compiler (``$CXX -v``, ``--version``) to check it, outside its
        # own error handling: CXX=false ends here.
        raise failed(f"{compiler!r} does not work as a C++ compiler ({shlex.join(e.cmd)} "
                     f"exited with status {e.returncode}; set CXX to name another "
                     "compiler)") from None
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
        if isinstance(e, CoreBuildError):
            raise
        lines = str(e).splitlines() or [repr(e)]
        cause = next((ln for ln in lines if "error:" in ln), lines[0])  # the compiler's
        raise failed(cause) from None
    return Path(loaded)


@functools.cache
def native_ops():
    """The ``torch.ops.fbtrain`` namespace, compiling the C++ core on first use.

    Its ops run in inference mode, which skips version-counter and view bookkeeping on
    every small op of the loops (8-10% of a step), so what they return are inference
    tensors: fine to read and decode with, but to reach autograd they must be cloned.

    The build is cached (in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/
    torch_extensions``) in a folder named for the source and flags
    (:func:`load_extension`), so later runs load it in well under a second.
    """
    load_extension(*_core_recipe())
    return torch.ops.fbtrain


@dataclass(frozen=True)
class CoreSpec:
    """Static facts of one core call (hashable, so it can ride through autograd)."""

    n_layers: int
    n_heads: int
    shared_kv: bool
    window: int  # memory slots a step may attend to (mem_len <= max_rel_pos)
    dropout: float  # 0 when not training
    eps: float = 1e-5
    # Keys/values read LayerNorm(m_t) instead of m_t. Only the normalisation happens in the
    # core: the LayerNorm's weight and bias are folded into wkv/bkv by the model.
    memory_norm: bool = False

    def args(self) -> tuple[int, int, bool, int, float, float, bool]:
        return (self.n_layers, self.n_heads, self.shared_kv, self.window, self.dropout,
                self.eps, self.memory_norm)


# Per-layer tensors in the order the core takes them (see FeedbackTransformer.core_params).
LAYER_PARAMS = ("ln1_w", "ln1_b", "wq", "uq", "rt", "c", "wo_t", "bo",
                "ln2_w", "ln2_b", "w1_t", "b1", "w2_t", "b2")


class Core(Protocol):
    """One implementation of the step loops: the C++ ops (:class:`NativeCore`) or the
    ``python_core`` module. Same calls, same results to float64 rounding."""

    def core_forward(self, spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
                     layers: Sequence[Tensor], mix: Tensor, wkv: Tensor, bkv: Tensor | None,
                     keep_tape: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
        """Run T steps (without autograd recording).

        x0: [B, T, D] token embeddings. mem_k, mem_v: [n_kv, B*H, n0, d_k] carried memory.
        layers: L * 14 tensors, as :func:`flatten_layers` (``rt`` [H, d_k, P], ``c``
        [H, 1, P] hold the P = min(S, window) position rows a window can use, largest
        offset first). mix: [L+1] softmax memory weights. wkv: [D, 2*n_kv*D] (all keys,
        then all values); bkv: [2*n_kv*D] or None; the keys/values of step t are
        ``m_t @ wkv + bkv``, or with ``spec.memory_norm`` ``norm(m_t) @ wkv + bkv`` (norm:
        LayerNorm without affine). Returns hidden [T, L+1, B, D] (every layer's output at
        every step), the memory vectors [T, B, D] (before any norm), the key/value buffers
        [n_kv, B*H, S, d_k], and the tape the backward needs (its own kind per core; empty
        unless ``keep_tape``). Dropout masks are drawn from the global generator before the
        sweep, in the same order by both cores. Results are inference tensors: to reach
        autograd they must be cloned.
        """
        ...

    def core_backward(self, spec: CoreSpec, d_top: Tensor, hidden: Tensor, memory: Tensor,
                      keys: Tensor, values: Tensor, n0: int, layers: Sequence[Tensor],
                      mix: Tensor, wkv: Tensor, tape: Any
                      ) -> tuple[Tensor, Sequence[Tensor], Tensor, Tensor, Tensor, Tensor,
                                 Tensor]:
        """Gradients given ``d_top`` [B, T, D], the gradient of the last layer's output, and
        what the same core's :meth:`core_forward` returned.

        Returns d_x0 [B, T, D], the layer gradients (flat, as :func:`flatten_layers`),
        d_mix [L+1], d_wkv [D, 2*n_kv*D], d_bkv [2*n_kv*D], and d_mem_k, d_mem_v
        [n_kv, B*H, n0, d_k] for the carried memory's keys and values.
        """
        ...


class NativeCore:
    """The C++ core's ops (compiled on first use) behind :class:`Core`'s calls."""

    @staticmethod
    def core_forward(spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor,
                     layers: Sequence[Tensor], mix: Tensor, wkv: Tensor, bkv: Tensor | None,
                     keep_tape: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
        return native_ops().core_forward(x0, mem_k, mem_v, layers, mix, wkv, bkv, *spec.args(),
                                         keep_tape)

    @staticmethod
    def core_backward(spec: CoreSpec, d_top: Tensor, hidden: Tensor, memory: Tensor,
                      keys: Tensor, values: Tensor, n0: int, layers: Sequence[Tensor],
                      mix: Tensor, wkv: Tensor, tape: Any
                      ) -> tuple[Tensor, Sequence[Tensor], Tensor, Tensor, Tensor, Tensor,
                                 Tensor]:
        return native_ops().core_backward(d_top, hidden, memory, keys, values, tape, layers,
                                          mix, wkv, n0, *spec.args())


def core_choice() -> str:
    """``$FBTRAIN_CORE``, checked: ``auto`` (the default), ``native`` or ``python``."""
    raw = os.environ.get(CORE_ENV, "")
    choice = raw.strip().lower() or "auto"
    if choice not in CORE_CHOICES:
        raise CoreError(f"{CORE_ENV}={raw!r} is not a core; use one of {', '.join(CORE_CHOICES)}")
    return choice


def core() -> Core:
    """The core to run, as ``$FBTRAIN_CORE`` asks (read on every call, resolved once each).

    ``native``: the C++ core, or CoreBuildError. ``python``: the PyTorch core. ``auto``:
    the C++ core where it builds, else the PyTorch core, after one notice line on stderr
    (once per process) saying why, how much slower it is, and how to get the fast one.
    """
    return _resolve(core_choice())


@functools.cache
def _resolve(choice: str) -> Core:
    if choice != "python":
        try:
            native_ops()
            return NativeCore
        except CoreBuildError as e:
            if choice == "native":
                raise
            print(f"fbtrain: {e}. Running on the PyTorch core instead, about "
                  f"{PYTHON_CORE_SLOWDOWN} slower to train; install g++ for the fast core "
                  f"(or set {CORE_ENV}=python to skip this attempt)",
                  file=sys.stderr, flush=True)
    from fbtrain.models import python_core

    return python_core


def core_forward(
    spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor, layers: Sequence[Tensor],
    mix: Tensor, wkv: Tensor, bkv: Tensor | None, keep_tape: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Any]:
    """:meth:`Core.core_forward` of the :func:`core` in use."""
    return core().core_forward(spec, x0, mem_k, mem_v, layers, mix, wkv, bkv, keep_tape)


class FeedbackCoreFunction(torch.autograd.Function):
    """Autograd wrapper: inputs (spec, x0, mem_k, mem_v, mix, wkv, bkv, *layer tensors).

    Outputs the last layer's hidden states [B, T, D], the new memory keys/values (the last
    ``window`` slots) and the memory vectors [B, T, D] of this call. The latter three are
    non-differentiable: memory is carried on detached, as in truncated BPTT. The carried
    keys/values ``mem_k``, ``mem_v`` do get gradients, so a caller may project them from
    carried memory vectors with the current weights. The backward runs on the core the
    forward ran on.
    """

    @staticmethod
    def forward(ctx, spec: CoreSpec, x0: Tensor, mem_k: Tensor, mem_v: Tensor, mix: Tensor,
                wkv: Tensor, bkv: Tensor | None, *flat: Tensor):
        ctx.core = core()
        hidden, memory, keys, values, tape = ctx.core.core_forward(
            spec, x0, mem_k, mem_v, flat, mix, wkv, bkv, keep_tape=True)
        # Outputs are fresh tensors, never views of saved buffers (that would make a cycle)
        # nor inference tensors (the cores run in inference mode; see Core.core_forward).
        top = hidden[:, -1].transpose(0, 1).clone(memory_format=torch.contiguous_format)
        new_k = keys[:, :, -spec.window:].clone()
        new_v = values[:, :, -spec.window:].clone()
        new_memory = memory.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        ctx.mark_non_differentiable(new_k, new_v, new_memory)
        ctx.spec, ctx.n0, ctx.tape, ctx.has_bkv = spec, mem_k.shape[2], tape, bkv is not None
        ctx.buffers = (hidden, memory, keys, values)
        ctx.save_for_backward(mix, wkv, *flat)
        return top, new_k, new_v, new_memory

    @staticmethod
    def backward(ctx, d_top: Tensor, _dk: Tensor, _dv: Tensor, _dm: Tensor):
        mix, wkv, *flat = ctx.saved_tensors
        d_x0, flat_grads, d_mix, d_wkv, d_bkv, d_mem_k, d_mem_v = ctx.core.core_backward(
            ctx.spec, d_top.contiguous(), *ctx.buffers, ctx.n0, flat, mix, wkv, ctx.tape)
        ctx.buffers = ctx.tape = None
        d_x0, d_mem_k, d_mem_v, d_mix, d_wkv, d_bkv, *flat_grads = (  # out of inference mode
            g.clone() for g in (d_x0, d_mem_k, d_mem_v, d_mix, d_wkv, d_bkv, *flat_grads))
        return (None, d_x0, d_mem_k, d_mem_v, d_mix, d_wkv, d_bkv if ctx.has_bkv else None,
                *flat_grads)


def flatten_layers(layers: list[dict[str, Tensor]]) -> list[Tensor]:
    """Per-layer tensors as one flat list, layer by layer in LAYER_PARAMS order."""
    return [p[name] for p in layers for name in LAYER_PARAMS]
