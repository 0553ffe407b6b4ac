"""A run directory has one owner, and nothing a killed or starved process leaves behind stays.

The lock (two processes, a kill -9 releasing it), temp files of killed saves removed at the
next start, a kill -9 loop after which every checkpoint loads, and a full disk during a save
(at the file layer in-process, and on a real 600 kB tmpfs where one can be mounted).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from test_train import CHILD_ENV, make_cfg, make_raw, records, start_driver, wait_for
from typer.testing import CliRunner

import fbtrain.io as fbio
from fbtrain.checkpoint import CheckpointManager, load_checkpoint
from fbtrain.cli import app
from fbtrain.config import ConfigError, config_from_dict
from fbtrain.io import FileWriteError, atomic_write_text, remove_stale_temps
from fbtrain.rundir.lock import RunDirLock
from fbtrain.train import run

_FDOPEN = os.fdopen  # the real one (the tests patch os.fdopen as atomic_write sees it)
DISK_FULL = "cannot write: the disk is full (no space left on device)"


# ----------------------------------------------------------------------------- the lock


def test_second_lock_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = RunDirLock(tmp_path)
    first.acquire()
    assert first.held
    with pytest.raises(ConfigError, match=rf"^run directory {tmp_path} is in use by "
                       rf"another fbtrain process \(pid {os.getpid()}\); wait"):
        RunDirLock(tmp_path).acquire()
    first.release()
    again = RunDirLock(tmp_path)
    again.acquire()  # free again once released
    assert again.held
    again.release()


def test_acquire_removes_stale_temps_only(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    stale = [ckpts / ".last.pt.a1B2c3_d.tmp", ckpts / ".step-00000035.pt.zzzzzzzz.tmp",
             tmp_path / ".config.yaml.0123abcd.tmp"]
    kept = [ckpts / "last.pt", ckpts / "notes.tmp", tmp_path / ".hidden", ckpts / "x.pt.tmp"]
    for p in stale + kept:
        p.write_bytes(b"PK\x03\x04")
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert sorted(lock.removed) == sorted(stale)
    lock.release()
    assert all(p.exists() for p in kept) and not any(p.exists() for p in stale)
    assert remove_stale_temps(tmp_path / "nowhere") == []


def test_two_train_processes_on_one_run_directory(tmp_path: Path) -> None:
    raw = make_raw(tmp_path, train={"max_steps": 100_000, "eval_every": 100_000,
                                    "schedule": "constant"},
                   checkpoint={"every": 100_000})
    first = start_driver(tmp_path, raw)
    run_dir = tmp_path / "runs" / "run"
    try:
        wait_for(lambda: any(r["step"] >= 2 for r in records(run_dir)), first)
        busy = (rf"^run directory {run_dir} is in use by another fbtrain process "
                rf"\(pid {first.pid}\)")
        # A fresh start and a --resume auto alike, before anything is read or written.
        before = sorted(p.name for p in run_dir.rglob("*"))
        for resume in (None, "auto"):
            with pytest.raises(ConfigError, match=busy):
                run(config_from_dict(raw), resume=resume, quiet=True)
        assert sorted(p.name for p in run_dir.rglob("*")) == before
        # The CLI says it in one line, exit 2.
        (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(raw))
        result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml")])
        assert result.exit_code == 2
        assert len(result.stderr.splitlines()) == 1 and "in use by" in result.stderr
        assert first.poll() is None
    finally:
        first.kill()
        first.wait(timeout=30)
    # Killed with SIGKILL: the kernel dropped its lock, so a resume just works.
    raw["train"]["max_steps"] = 1
    run(config_from_dict(raw), resume="auto", quiet=True)


# ----------------------------------------------------------------------------- kill -9


def test_kill_loop_leaves_every_checkpoint_loadable(tmp_path: Path) -> None:
    """kill -9 at short random delays while every step saves; after the next start every
    file in checkpoints/ loads and no temp file is left."""
    raw = make_raw(tmp_path, train={"max_steps": 100_000, "eval_every": 2,
                                    "schedule": "constant"},
                   checkpoint={"every": 1, "keep_last": 3})
    run_dir = tmp_path / "runs" / "run"
    ckpts = run_dir / "checkpoints"
    rng = random.Random(15)
    stale_seen = 0
    for i in range(6):
        proc = start_driver(tmp_path, raw) if i == 0 else _resume_driver(tmp_path)
        try:
            done = max((r["step"] for r in records(run_dir)), default=0)
            wait_for(lambda d=done: any(r["step"] > d for r in records(run_dir)), proc)
            # Let it run a little into its steps (and saves), then kill it mid-whatever.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=rng.uniform(0.0, 0.4))
        finally:
            proc.kill()
            proc.wait(timeout=30)
        stale_seen += sum(p.name.endswith(".tmp") for p in ckpts.iterdir())
    # And one save certainly killed half-way: a truncated temp of last.pt.
    (ckpts / ".last.pt.k1lled00.tmp").write_bytes((ckpts / "last.pt").read_bytes()[:100])
    raw["train"]["max_steps"] = load_checkpoint(ckpts / "last.pt")["step"] + 1
    run(config_from_dict(raw), resume="auto", quiet=True)
    names = sorted(p.name for p in ckpts.iterdir())
    assert not [n for n in names if n.endswith(".tmp")], (names, stale_seen)
    for name in names:
        load_checkpoint(ckpts / name)  # raises if any is unreadable
    assert {"last.pt", "best.pt"} <= set(names)


def _resume_driver(tmp_path: Path) -> subprocess.Popen:
    """The same run, continued (``--resume auto``) in a fresh process."""
    return subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cfg.json"), "auto"],
        env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


# ----------------------------------------------------------------------------- full disk


class _Disk:
    """A disk with ``free`` bytes left, at the file layer: every file atomic_write opens
    writes through it and gets ENOSPC, as from the kernel, once the space is used up."""

    def __init__(self, free: int):
        self.free = free

    def fdopen(self, fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> IO[bytes]:
        return _FullDiskFile(_FDOPEN(fd, mode, *args, **kwargs), self)


class _FullDiskFile(io.RawIOBase):
    def __init__(self, raw: IO[bytes], disk: _Disk):
        self._raw, self._disk = raw, disk

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._disk.free:
            self._raw.write(bytes(memoryview(data).cast("B")[: self._disk.free]))
            self._disk.free = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.free -= n
        return self._raw.write(data)

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        super().close()  # flushes first
        self._raw.close()


def test_full_disk_during_checkpoint_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=3)
    mgr.save(1, {"step": 1, "w": torch.arange(1000)}, best=True)
    monkeypatch.setattr(fbio.os, "fdopen", _Disk(free=3000).fdopen)
    with pytest.raises(FileWriteError) as info:
        mgr.save(2, {"step": 2, "w": torch.arange(1000)}, best=True)
    assert str(info.value) == f"{mgr.last_path}: {DISK_FULL}"
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert load_checkpoint(mgr.last_path)["step"] == 1
    assert load_checkpoint(mgr.best_path)["step"] == 1
    assert not [p for p in mgr.dir.iterdir() if p.name.endswith(".tmp")]
    # Other atomic writes say the same.
    monkeypatch.setattr(fbio.os, "fdopen", _Disk(free=0).fdopen)
    with pytest.raises(FileWriteError) as info:
        atomic_write_text(tmp_path / "c.yaml", "x: 1\n")
    assert str(info.value) == f"{tmp_path / 'c.yaml'}: {DISK_FULL}"


def test_full_disk_stops_training_with_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = make_raw(tmp_path, train={"max_steps": 10}, checkpoint={"every": 1})
    disk = _Disk(free=10**9)
    monkeypatch.setattr(fbio.os, "fdopen", disk.fdopen)
    first = run(config_from_dict(make_raw(tmp_path, "probe", train={"max_steps": 1})),
                quiet=True)
    one_save = (first / "checkpoints" / "last.pt").stat().st_size
    # Room for config, vocab and about two checkpoint saves (each writes last, step, best).
    disk.free = int(one_save * 5.5)
    (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(raw))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml"),
                                      "--quiet"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(DISK_FULL)
    assert "/checkpoints/" in lines[0]
    ckpts = tmp_path / "runs" / "run" / "checkpoints"
    assert not [p for p in ckpts.iterdir() if p.name.endswith(".tmp")]
    for p in ckpts.iterdir():
        load_checkpoint(p)
    assert load_checkpoint(ckpts / "last.pt")["step"] >= 1


MOUNT = shutil.which("unshare") and shutil.which("mount")


def _train_on_tmpfs(tmp_path: Path, size: str, sets: list[str], then: str = ""
                    ) -> tuple[Path, subprocess.CompletedProcess]:
    """``fbtrain train`` (configs/tiny.yaml on a small generated text, ``--set`` each of
    ``sets``) with run.out_dir on a private tmpfs of ``size``; ``then``: a Python script run
    after it, on the same mount. Skips the test where no tmpfs can be mounted."""
    cfg = make_cfg(tmp_path)  # writes the text file
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "full.sh"
    flags = " ".join(f"--set {s}" for s in sets)
    script.write_text(f"""
mount -t tmpfs -o size={size} tmpfs {mnt} || exit 77
{sys.executable} -m fbtrain train --config {Path(__file__).parents[1] / 'configs' / 'tiny.yaml'} \\
  --set data.path={cfg.data.path} --set run.out_dir={mnt} {flags} --device cpu --quiet
echo "rc=$?"
{sys.executable} - <<'EOF'
{then}
EOF
""")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", str(script)],
                          env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    if proc.returncode == 77 or "unshare:" in proc.stderr[:200]:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    return mnt, proc


@pytest.mark.skipif(not MOUNT, reason="needs unshare and mount for a private tmpfs")
def test_full_disk_on_a_real_tmpfs(tmp_path: Path) -> None:
    """The reported case: run.out_dir on a 600 kB tmpfs, a checkpoint every 5 steps."""
    mnt = tmp_path / "mnt"  # (made by _train_on_tmpfs)
    _, proc = _train_on_tmpfs(tmp_path, "600k", [
        "checkpoint.every=5", "checkpoint.keep_last=100", "train.max_steps=500"], then=f"""
from pathlib import Path
from fbtrain.checkpoint import load_checkpoint
ckpts = Path("{mnt}/tiny/checkpoints")
print("files", sorted(p.name for p in ckpts.iterdir()))
print("last", load_checkpoint(ckpts / "last.pt")["step"])
for p in ckpts.iterdir():
    load_checkpoint(p)
print("all load")
""")
    out = proc.stdout
    assert "rc=2" in out, (out, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"error: {mnt}/tiny/") and errors[0].endswith(DISK_FULL)
    assert "all load" in out and ".tmp" not in out.split("files", 1)[1], out


@pytest.mark.skipif(not MOUNT, reason="needs unshare and mount for a private tmpfs")
def test_full_disk_while_logging_before_the_first_checkpoint(tmp_path: Path) -> None:
    """TensorBoard's events fill the disk first (a sample every step goes only there): it
    was the writer thread's traceback, then "error: [Errno 28] No space left on device"
    naming no file. Now one line naming the events file, exit 2."""
    mnt, proc = _train_on_tmpfs(tmp_path, "64k", [
        "logging.tensorboard=true", "checkpoint.every=100000", "train.max_steps=5000",
        "train.log_every=100000", "train.eval_every=100000", "train.sample_every=1",
        "train.sample_length=400"])
    assert "rc=2" in proc.stdout, (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"error: {mnt}/tiny/events\.out\.tfevents\.[\w.]+: {re.escape(DISK_FULL)}", lines[0]
    ), proc.stderr


def test_other_errors_while_writing_pass_through(tmp_path: Path) -> None:
    """Only file-system failures become FileWriteError: a network error while a download
    streams into the file must still say what it is."""

    def interrupted(f: IO[bytes]) -> None:
        f.write(b"partial")
        raise TimeoutError("read timed out")

    with pytest.raises(TimeoutError, match="^read timed out$"):
        fbio.atomic_write(tmp_path / "x.txt", interrupted)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- what it holds


def _trained(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """A run of 6 steps (step-3, step-6, best.pt and last.pt) and its checkpoints folder."""
    raw = make_raw(tmp_path, train={"max_steps": 6})
    return raw, run(config_from_dict(raw), quiet=True) / "checkpoints"


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != ".lock"}


def test_a_run_without_last_pt_is_never_started_afresh(tmp_path: Path) -> None:
    """The reported loss: with last.pt removed, a fresh start trained from step 0 over the
    run (its best.pt, metrics, config). Now it is refused, naming what the run holds."""
    raw, ckpts = _trained(tmp_path)
    (ckpts / "last.pt").unlink()
    before = _files(ckpts.parent)
    raw["train"]["max_steps"] = 2
    with pytest.raises(ConfigError, match=(
            rf"^run directory {ckpts.parent} already holds a run \(checkpoints/step-00000006"
            r"\.pt, checkpoints/step-00000003\.pt, checkpoints/best\.pt and metrics\.jsonl\); "
            r"continue it with --resume auto, or start anew")):
        run(config_from_dict(raw), quiet=True)
    assert _files(ckpts.parent) == before
    # The CLI: one line, exit 2.
    (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(raw))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml")])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.output
    assert _files(ckpts.parent) == before


def test_resume_auto_without_last_pt_continues_from_the_newest_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, ckpts = _trained(tmp_path)
    (ckpts / "last.pt").unlink()
    raw["train"]["max_steps"] = 8
    run(config_from_dict(raw), resume="auto")
    out = capsys.readouterr().out
    assert (f"resuming from step-00000006.pt (step 6), the newest checkpoint that loads: "
            f"{ckpts / 'last.pt'} is missing") in out.splitlines()
    assert load_checkpoint(ckpts / "last.pt")["step"] == 8
    assert [r["step"] for r in records(ckpts.parent) if "loss" in r] == list(range(1, 9))


def test_resume_auto_with_only_numbered_checkpoints_left(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, ckpts = _trained(tmp_path)
    (ckpts / "last.pt").unlink()
    (ckpts / "best.pt").unlink()
    raw["train"]["max_steps"] = 7
    run(config_from_dict(raw), resume="auto")
    assert f"resuming from {ckpts / 'step-00000006.pt'} at step 6" in capsys.readouterr().out
    assert [r["step"] for r in records(ckpts.parent) if "loss" in r] == list(range(1, 8))


def test_resume_auto_past_a_looping_last_pt_symlink(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, ckpts = _trained(tmp_path)
    (ckpts / "last.pt").unlink()
    os.symlink("last.pt", ckpts / "last.pt")  # a link to itself: ELOOP on open
    raw["train"]["max_steps"] = 7
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints/last\.pt, "):
        run(config_from_dict(raw), quiet=True)
    run(config_from_dict(raw), resume="auto")
    note = [line for line in capsys.readouterr().out.splitlines() if "newest" in line]
    assert note == [f"resuming from step-00000006.pt (step 6), the newest checkpoint that "
                    f"loads: {ckpts / 'last.pt'}: cannot read checkpoint: Too many levels of "
                    "symbolic links"]
    assert load_checkpoint(ckpts / "last.pt")["step"] == 7  # the link replaced by a file


def test_resume_auto_prefers_a_best_pt_newer_than_every_numbered_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """best.pt may be newer than the numbered files that are left (or older): the highest
    step that loads wins, whichever file holds it."""
    raw, ckpts = _trained(tmp_path)
    (ckpts / "last.pt").unlink()
    (ckpts / "step-00000006.pt").replace(ckpts / "best.pt")  # best at step 6, step-3 left
    (ckpts / "step-00000002.pt").write_bytes(b"PK\x03\x04 cut short")  # lower: never read
    raw["train"]["max_steps"] = 7
    run(config_from_dict(raw), resume="auto")
    out = capsys.readouterr().out
    assert f"resuming from {ckpts / 'best.pt'} at step 6" in out and "cut short" not in out
    assert [r["step"] for r in records(ckpts.parent) if "loss" in r] == list(range(1, 8))


def test_resume_auto_skips_a_truncated_last_pt_and_a_damaged_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, ckpts = _trained(tmp_path)
    last = ckpts / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    (ckpts / "step-00000006.pt").write_bytes(b"")
    (ckpts / "best.pt").unlink()
    raw["train"]["max_steps"] = 4
    run(config_from_dict(raw), resume="auto")
    out = capsys.readouterr().out
    assert (f"resuming from step-00000003.pt (step 3), the newest checkpoint that loads: "
            f"{last}: checkpoint file is truncated or corrupt (incomplete zip archive); "
            f"{ckpts / 'step-00000006.pt'}: checkpoint file is empty (was the save "
            "interrupted?)") in out.splitlines()
    assert load_checkpoint(last)["step"] == 4


@pytest.mark.parametrize("resume", ["", "  "])
def test_an_empty_resume_is_refused_not_read_as_the_working_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume: str) -> None:
    """--resume "$UNSET" from inside another run's folder would resume that run's checkpoint
    into this one (an empty path is the working folder)."""
    raw, ckpts = _trained(tmp_path)
    monkeypatch.chdir(ckpts.parent)
    raw["run"]["name"] = "other"
    (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(raw))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml"),
                                      "--resume", resume])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: --resume {resume!r}: empty; give auto, a run directory or a checkpoint file "
        "(or leave --resume out to start afresh)"]
    assert not (Path(raw["run"]["out_dir"]) / "other" / "checkpoints").exists()


def test_resume_auto_refuses_when_no_checkpoint_loads(tmp_path: Path) -> None:
    raw, ckpts = _trained(tmp_path)
    for p in ckpts.iterdir():
        p.unlink()
    os.symlink("last.pt", ckpts / "last.pt")
    (ckpts / "step-00000006.pt").write_bytes(b"not a checkpoint")
    before = _files(ckpts.parent)
    (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(raw))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml"),
                                      "--resume", "auto"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: run directory {ckpts.parent} holds checkpoints, but none can be resumed from "
        f"({ckpts / 'last.pt'}: cannot read checkpoint: Too many levels of symbolic links; "
        f"{ckpts / 'step-00000006.pt'}: not a PyTorch checkpoint file (a plain pickle or some "
        "other format)); to start afresh, train under another run.name (--set "
        "run.name=NEW) or delete that folder"]
    assert _files(ckpts.parent) == before


def test_a_file_in_place_of_checkpoints_is_refused_before_training(tmp_path: Path) -> None:
    """It used to fail only at the first save ("[Errno 17] File exists"), after training."""
    raw = make_raw(tmp_path, train={"max_steps": 3})
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoints").write_text("not a folder\n")
    for resume in (None, "auto"):
        with pytest.raises(ConfigError, match=(
                rf"^run directory {run_dir}: {run_dir / 'checkpoints'} is not a folder, so no "
                r"checkpoint could be saved there; move it away")):
            run(config_from_dict(raw), resume=resume, quiet=True)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]


def test_metrics_of_a_start_that_saved_nothing(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A run killed before its first checkpoint leaves metrics.jsonl: a plain start is
    refused; --resume auto has nothing to resume, so it starts afresh and says so."""
    raw = make_raw(tmp_path, train={"max_steps": 2})
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "val/loss": 3.2}\n')
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics\.jsonl\); "):
        run(config_from_dict(raw), quiet=True)
    run(config_from_dict(raw), resume="auto")
    assert (f"no checkpoint in {run_dir} to resume from: starting afresh (replacing the "
            "metrics and TensorBoard events of an earlier start that saved none)"
            in capsys.readouterr().out.splitlines())
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 2


def test_a_run_out_dir_under_home_is_written_there(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``run.out_dir: ~/runs`` wrote the run into a folder named '~' in the working folder
    (data.path and data.cache_dir expand '~'; out_dir did not)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    raw = make_raw(tmp_path, train={"max_steps": 1})
    raw["run"]["out_dir"] = "~/runs"
    assert run(config_from_dict(raw), quiet=True) == tmp_path / "home" / "runs" / "run"
    assert load_checkpoint(tmp_path / "home/runs/run/checkpoints/last.pt")["step"] == 1
    assert not (tmp_path / "~").exists()


def test_a_lock_file_linked_to_nowhere_is_one_line(tmp_path: Path) -> None:
    """A .lock that is a symbolic link into a folder that does not exist ended in a
    FileWriteError traceback (no such file or directory)."""
    raw = make_raw(tmp_path, train={"max_steps": 1})
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / ".lock").symlink_to(tmp_path / "gone" / "x")
    (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(raw))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml")])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: {run_dir / '.lock'} is a symbolic link to {tmp_path / 'gone' / 'x'}, where no "
        "lock file can be created; move it away (fbtrain makes its own)"]
    assert (run_dir / ".lock").is_symlink()


def test_another_runs_checkpoint_into_a_start_that_saved_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume <another run>`` into a run directory a killed start left metrics (and
    TensorBoard events) in, but no checkpoint: that start's lines up to the resumed step
    were kept, and read as the new run's first steps."""
    raw, ckpts = _trained(tmp_path)
    new_dir = tmp_path / "runs" / "new"
    new_dir.mkdir()
    (new_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n')
    (new_dir / "events.out.tfevents.1.host.1.0").write_bytes(b"\0")
    raw["run"]["name"], raw["train"]["max_steps"] = "new", 7
    run(config_from_dict(raw), resume=str(ckpts.parent))
    assert (f"{new_dir} holds no checkpoint: a new run from {ckpts / 'last.pt'} (replacing "
            "the metrics and TensorBoard events of an earlier start that saved none)"
            in capsys.readouterr().out.splitlines())
    assert [r["step"] for r in records(new_dir) if "loss" in r] == [7]
    assert not (new_dir / "events.out.tfevents.1.host.1.0").exists()


def test_a_runs_own_checkpoint_resumed_from_outside_keeps_its_metrics(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """checkpoints/ moved away and its last.pt resumed: the directory's history names the
    checkpoint's run, so it goes on as that run (its metrics and history kept)."""
    raw, ckpts = _trained(tmp_path)
    shutil.move(ckpts, tmp_path / "backup")
    backup_last = tmp_path / "backup" / "last.pt"
    result = CliRunner().invoke(app, ["train", "--config", _config_file(tmp_path, raw),
                                      "--resume", str(backup_last)])
    assert result.exit_code == 0, result.output
    assert (f"{ckpts.parent} is already trained: last.pt is at step 6 and train.max_steps "
            "is 6, so there is nothing to train (to train on: --set train.max_steps=N, more "
            f"than 6; to try it: fbtrain sample --checkpoint {backup_last})"
            ) in result.stdout.splitlines()
    raw["train"]["max_steps"] = 7
    run(config_from_dict(raw), resume=str(tmp_path / "backup" / "last.pt"))
    # No best.pt to put right: the folder was emptied by hand, no save failed.
    assert "best.pt" not in result.stdout + capsys.readouterr().out
    assert [r["step"] for r in records(ckpts.parent) if "loss" in r] == list(range(1, 8))
    history = [__import__("json").loads(line)
               for line in (ckpts.parent / "history.jsonl").read_text().splitlines()]
    assert [h["start_step"] for h in history] == [0, 6]
    assert history[0]["run_id"] == history[1]["run_id"]


def _config_file(tmp_path: Path, raw: dict[str, Any]) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(__import__("yaml").safe_dump(raw))
    return str(path)


def test_a_last_pt_that_cannot_be_read_is_set_aside_not_overwritten(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A last.pt newer than every numbered checkpoint (a run stopped by Ctrl-C) that cannot
    be read (no read permission: the file itself may be whole): --resume auto goes on from
    the newest one that loads, and its first save used to replace last.pt, the steps since
    lost for good. It is moved aside with the abandoned branch instead."""
    raw, ckpts = _trained(tmp_path)
    last = ckpts / "last.pt"
    unreadable = last.read_bytes()[:2000]  # what open() refused stands in for the file
    last.write_bytes(unreadable)
    (ckpts / "best.pt").unlink()
    raw["train"]["max_steps"] = 7
    run(config_from_dict(raw), resume="auto")
    aside = ckpts / "abandoned-from-step-00000006"
    assert (f"rewound to step 6: the abandoned branch's last.pt (which cannot be read), a "
            f"copy of metrics.jsonl moved to {aside}; last.pt is now the checkpoint resumed"
            in capsys.readouterr().out.splitlines())
    assert (aside / "last.pt").read_bytes() == unreadable
    assert load_checkpoint(last)["step"] == 7


class _Killed(BaseException):
    """Stands in for a SIGKILL: nothing of fbtrain's catches it."""


def test_a_rewind_killed_after_its_moves_keeps_the_abandoned_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewind killed after moving the abandoned branch's checkpoints but before copying
    metrics.jsonl: the rewind run again found nothing left to move, so made no copy, and
    the new branch then cut the abandoned branch's lines from metrics.jsonl: lost. The copy
    is made before anything moves."""
    import fbtrain.rundir.rewind as rewind

    raw, ckpts = _trained(tmp_path)
    to_move = {"last.pt", "step-00000006.pt"} | (
        {"best.pt"} if load_checkpoint(ckpts / "best.pt")["step"] > 3 else set())
    moved: list[str] = []

    def replace(src: Path, dst: Path) -> None:
        os.replace(src, dst)
        moved.append(Path(src).name)
        if set(moved) == to_move:
            raise _Killed

    monkeypatch.setattr(rewind, "os", type("Os", (), {"replace": staticmethod(replace)}))
    raw["train"]["max_steps"] = 5
    with pytest.raises(_Killed):
        run(config_from_dict(raw), resume=str(ckpts / "step-00000003.pt"), quiet=True)
    monkeypatch.undo()
    run(config_from_dict(raw), resume=str(ckpts / "step-00000003.pt"), quiet=True)
    kept = [r["step"] for r in records(ckpts / "abandoned-from-step-00000003") if "loss" in r]
    assert kept == list(range(1, 7))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_run_directory_where_no_folder_can_be_made_is_one_line(tmp_path: Path) -> None:
    """run.out_dir on a file system that makes no folders (/proc; an automount) ended in a
    FileWriteError traceback: mkdir's "no such file or directory" is not a user's error
    unless the command named that path itself."""
    raw = make_raw(tmp_path, train={"max_steps": 1})
    raw["run"]["out_dir"] = "/proc/fbtrain-runs"
    (tmp_path / "cfg.yaml").write_text(__import__("yaml").safe_dump(raw))
    result = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "cfg.yaml")])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "error: /proc/fbtrain-runs/run: cannot write: no such file or directory; use another "
        "run.out_dir"]
