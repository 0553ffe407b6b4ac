"""Compile guard.cpp against the installed torch, once per torch build and source.

Importable before torch (it finds torch's headers without importing it), so that a process
can build the library, load it and only then import torch. The library lands in
``$FBTRAIN_FAKE_CUDA_DIR`` (default ``~/.cache/fbtrain/fake-cuda``), under a name that
holds the torch version and the source's hash; a lock keeps two processes from compiling
it at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("guard.cpp")


class NoCompiler(RuntimeError):
    """No C++ compiler here: the fake-CUDA harness cannot run (and its tests skip)."""


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else c++ or g++), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def cuda_build() -> bool:
    """Whether the installed torch is a CUDA build (it has the plumbing already)."""
    return any((_torch_dir() / "lib").glob("libtorch_cuda*"))


def library_path() -> Path:
    """Where the library for this torch and source is (built or not)."""
    version = importlib.metadata.version("torch")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("FBTRAIN_FAKE_CUDA_DIR",
                               Path.home() / ".cache" / "fbtrain" / "fake-cuda"))
    return root / f"libfakecuda-torch{version}-{digest}.so"


def build() -> Path:
    """The library's path, compiled first if it is not there (a few seconds)."""
    out = library_path()
    if out.is_file():
        return out
    cxx = compiler()
    if cxx is None:
        raise NoCompiler("no C++ compiler (c++ or g++; or set CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_dir = _torch_dir()
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():  # another process built it while this one waited
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, "-shared", "-fPIC", "-std=c++20", "-O1", "-w",
               "-isystem", str(torch_dir / "include"),
               "-isystem", str(torch_dir / "include/torch/csrc/api/include"),
               str(SOURCE), f"-L{torch_dir / 'lib'}", f"-Wl,-rpath,{torch_dir / 'lib'}",
               "-lc10", "-ltorch_cpu", "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, out)
    return out


if __name__ == "__main__":
    print(build())
