"""Which ninja builds the C++ core, and why a build is about to compile.

torch builds extensions with the ``ninja`` it finds first on PATH. A machine often has two:
the distribution's (``/usr/bin/ninja``) and the one from PyPI that fbtrain installs into
its environment. The two keep ``.ninja_log`` in formats each other discards, so a build
folder that ``make`` (PATH without the venv) and an activated shell (the venv's first)
take turns in is compiled from scratch at every switch. The build therefore always runs
with the environment's own ninja first on PATH, whatever PATH says
(:func:`environment_ninja_first`), and says before compiling why it must
(:func:`compile_reason`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NINJA_TIMEOUT_S = 30  # for ``ninja -n``: it reads the build files and stats a few more


def environment_ninja_dir() -> str | None:
    """The folder holding this Python environment's own ninja: the PyPI package's binary
    folder (``ninja.BIN_DIR``), else the environment's scripts folder or the one beside
    ``sys.executable`` where a ``ninja`` is; None where the environment has none."""
    folders: list[str] = []
    with contextlib.suppress(ImportError):
        import ninja  # the PyPI package

        folders.append(ninja.BIN_DIR)
    folders += [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    for folder in folders:
        if folder and shutil.which("ninja", path=folder):
            return folder
    return None


@contextlib.contextmanager
def environment_ninja_first() -> Iterator[str | None]:
    """PATH with the environment's ninja folder first, for the length of the block (then
    PATH as it was); yields that folder. Where the environment has no ninja, PATH stays as
    it is and torch uses whichever ninja it finds (or says it needs one)."""
    folder = environment_ninja_dir()
    before = os.environ.get("PATH")
    if folder is not None:
        os.environ["PATH"] = os.pathsep.join(filter(None, (folder, before)))
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def ninja_explains(build_dir: Path) -> list[str] | None:
    """What ``ninja -n -d explain`` (the ninja first on PATH) says it would rebuild in
    ``build_dir`` and why: its explanations, ``[]`` when there is nothing to do, None where
    it could not be asked (no ninja, no ``build.ninja``, ninja failed)."""
    ninja = shutil.which("ninja")
    if ninja is None or not (build_dir / "build.ninja").is_file():
        return None
    try:
        done = subprocess.run([ninja, "-n", "-d", "explain"], cwd=build_dir,
                              capture_output=True, text=True, timeout=NINJA_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    if "no work to do" in done.stdout:
        return []
    explained = [ln.removeprefix("ninja explain: ").strip() for ln in done.stderr.splitlines()
                 if ln.startswith("ninja explain: ")]
    return explained or ["ninja would rebuild it"]


def _reason_from_explain(explained: list[str]) -> str:
    """One reason, in a reader's words, from ninja's explanations (the first that says)."""
    for line in explained:
        if "command line changed" in line:
            # Also what a build log another ninja wrote reads as (each discards the
            # other's format), so both are named.
            return "the compiler command changed, or another ninja built it last"
        if "not found in log" in line or "no entry in log" in line:
            return ("its build log is missing or was written by another ninja "
                    f"({line})")
        if "older than most recent input" in line or "is dirty" in line:
            return "the source (or a header it includes) changed"
        if "doesn't exist" in line:
            return "part of the last build is missing"
    return explained[0]


RECORD = "fbtrain-build.json"  # in a build folder: what its build was made from


def write_record(build_dir: Path, made_from: dict[str, Any]) -> None:
    """Note in ``build_dir`` what its build was made from (source path and hash, flags,
    torch), for the reason a later build of another version gives (best effort)."""
    with contextlib.suppress(OSError):
        tmp = build_dir / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(made_from, sort_keys=True), encoding="utf-8")
        os.replace(tmp, build_dir / RECORD)


def _read_record(build_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((build_dir / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _first_build_reason(build_dir: Path, base: str, made_from: dict[str, Any]) -> str:
    """Why a folder with no build yet is built: the first use, or what differs from the
    newest other build of ``base`` from the same source file in the same cache (the
    source's text, the compiler flags, or torch)."""
    # Only ``base`` and its hash: fbtrain_core_* would also take fbtrain_core_avx2_*.
    named = re.compile(rf"{re.escape(base)}_[0-9a-f]{{8}}")
    others = sorted((d for d in build_dir.parent.glob(f"{base}_*")
                     if d != build_dir and named.fullmatch(d.name) and (d / RECORD).is_file()),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    records = [r for r in map(_read_record, others)
               if r is not None and r.get("source") == made_from["source"]]
    if not records:
        return "first use"
    last = records[0]
    changed = [what for key, what in (("cflags", "the compiler flags"),
                                      ("ldflags", "the linker flags"),
                                      ("torch", "torch's version"),
                                      ("sha256", "the source"))
               if last.get(key) != made_from[key]]
    return f"{' and '.join(changed) or 'the build'} changed since the last build"


def compile_reason(build_dir: Path, library: Path, base: str,
                   made_from: dict[str, Any]) -> str | None:
    """Why building ``library`` in ``build_dir`` will compile (a few words), or None when
    it only loads. ``made_from``: what :func:`write_record` notes. Call with the
    environment's ninja first on PATH: the one that builds."""
    if not library.exists():
        if (build_dir / "build.ninja").exists():
            return "the last build here did not finish"
        return _first_build_reason(build_dir, base, made_from)
    explained = ninja_explains(build_dir)
    if not explained:  # nothing to do, or ninja could not say: torch decides
        return None
    return _reason_from_explain(explained)
