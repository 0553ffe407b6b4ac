"""The one flock-with-pid lock (run directory, download cache, core build)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fbtrain.filelock import LockHeld, PidLock


def test_a_held_lock_names_its_holder_then_passes_on(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    first = PidLock(path).acquire()
    assert path.read_text() == f"{os.getpid()}\n"
    second = PidLock(path)  # another open file: flock treats it as another holder
    with pytest.raises(LockHeld, match=rf"held by pid {os.getpid()}$"):
        second.acquire(wait=0)
    seen: list[str] = []
    with pytest.raises(LockHeld):
        second.acquire(wait=0.3, on_wait=seen.append)
    assert seen == [str(os.getpid())]  # told once, not at every poll
    first.release()
    with second:
        assert second.held
    assert not second.held and path.exists()  # the file stays, the flock goes


def test_release_can_forget_the_pid(tmp_path: Path) -> None:
    lock = PidLock(tmp_path / "x.lock").acquire()
    lock.release(forget_pid=True)
    assert (tmp_path / "x.lock").read_text() == ""
