"""Atomic writes: files get the mode the umask gives (not mkstemp's 0600)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fbtrain import io as fio
from fbtrain.checkpoint import CheckpointManager, save_checkpoint
from fbtrain.config import Config, save_config
from fbtrain.data.tokenizers import CharTokenizer
from fbtrain.io import atomic_write, atomic_write_text, current_umask


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """Run the block under ``mask``; the test process's own umask is put back after."""
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "expected"),
                         [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
def test_every_run_file_gets_the_umask_mode(tmp_path: Path, mask: int, expected: int) -> None:
    """config.yaml, vocab.json, every checkpoint (last, best, numbered: written and copied)
    and any atomic_write (downloads, metrics.jsonl rewritten on resume)."""
    run_dir = tmp_path / "run"
    with umask(mask):
        save_config(Config(), run_dir / "config.yaml")
        vocab = CharTokenizer(list("ab\n")).save(run_dir)
        CheckpointManager(run_dir, keep_last=2).save(3, {"step": 3}, best=True)
        save_checkpoint(tmp_path / "other.pt", {"w": torch.zeros(2)})
        atomic_write_text(run_dir / "metrics.jsonl", "{}\n")
        atomic_write(tmp_path / "cache" / "input.txt", lambda f: f.write(b"text"))
    files = [run_dir / "config.yaml", vocab, run_dir / "checkpoints" / "last.pt",
             run_dir / "checkpoints" / "best.pt", run_dir / "checkpoints" / "step-00000003.pt",
             tmp_path / "other.pt", run_dir / "metrics.jsonl", tmp_path / "cache" / "input.txt"]
    assert {f.name: oct(mode(f)) for f in files} == {f.name: oct(expected) for f in files}


def test_overwrite_takes_the_current_umask(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    with umask(0o077):
        atomic_write_text(path, "private")
    assert mode(path) == 0o600
    with umask(0o022):
        atomic_write_text(path, "shared")
    assert mode(path) == 0o644 and path.read_text() == "shared"


@pytest.mark.parametrize("proc", [True, False])
def test_current_umask_reads_it_and_leaves_it(monkeypatch: pytest.MonkeyPatch, proc: bool,
                                              tmp_path: Path) -> None:
    if not proc:  # no /proc (macOS, old Linux): the set-and-restore fallback
        monkeypatch.setattr(fio, "_PROC_STATUS", str(tmp_path / "no-such-file"))
    elif not Path(fio._PROC_STATUS).exists():
        pytest.skip("no /proc/self/status here")
    with umask(0o027):
        assert current_umask() == 0o027
        assert current_umask() == 0o027  # reading it did not change it


def test_a_full_disk_when_the_temp_file_is_made_names_the_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import tempfile

    from fbtrain.io import FileWriteError, atomic_write_text

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", full)
    target = tmp_path / "config.yaml"
    with pytest.raises(FileWriteError, match=rf"^{target}: cannot write: the disk is full"):
        atomic_write_text(target, "x")
