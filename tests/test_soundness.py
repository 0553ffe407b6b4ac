"""What a hostile but fair user does to a run, for real: racing starts, resuming into another
run, a closed pipe, a closed terminal, signals at awkward moments, a sampler restored under a
changed world size, a full disk when the run directory is made.

Each test drives real processes (the CLI under ``python -m fbtrain``), real FIFOs, real pipes
and real signals; none sleeps for a fixed time.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_train import CHILD_ENV, make_raw, records, wait_for

from fbtrain.checkpoint import load_checkpoint, save_checkpoint
from fbtrain.config import ConfigError, config_from_dict
from fbtrain.config.schema import MAX_SAMPLE_LENGTH
from fbtrain.data.samplers import BatchSampler
from fbtrain.distributed import DistContext
from fbtrain.io import FileWriteError
from fbtrain.rng import rank_seed
from fbtrain.train import Trainer, run

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _restore_signals() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in SIGNALS}
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(torch_threads)
    for s, handler in before.items():
        signal.signal(s, handler)


def write_config(tmp_path: Path, raw: dict[str, Any], name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(*args: str, **popen: Any) -> subprocess.Popen:
    """``python -m fbtrain ARGS`` in a child process (one thread, this checkout)."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "fbtrain", *args], env=CHILD_ENV,
                            text=True, **popen)


def is_locked(lock: Path) -> bool:
    """True while some process holds the run directory's flock."""
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def endless(tmp_path: Path, **train: Any) -> dict[str, Any]:
    """A tiny run that trains until stopped."""
    return make_raw(tmp_path, train={"max_steps": 100_000, "eval_every": 100_000,
                                     "schedule": "constant", **train},
                    checkpoint={"every": 100_000})


# ----------------------------------------------------------------------------- the run directory


def test_a_racing_fresh_start_never_overwrites_a_finished_run(tmp_path: Path) -> None:
    """The second start blocks reading its data (a FIFO) after it checked the directory;
    the first must not slip in, finish and then be overwritten: the lock is taken first."""
    text = tmp_path / "text.txt"
    raw = make_raw(tmp_path, train={"max_steps": 2})
    fifo = tmp_path / "slow.txt"
    os.mkfifo(fifo)
    slow = {**raw, "data": {"path": str(fifo)}}
    second = cli("train", "--config", str(write_config(tmp_path, slow, "slow.yaml")), "-q")
    run_dir = tmp_path / "runs" / "run"
    try:
        wait_for(lambda: is_locked(run_dir / ".lock"), second)
        with pytest.raises(ConfigError, match="is in use by another fbtrain process"):
            run(config_from_dict(raw), quiet=True)
        assert not (run_dir / "checkpoints").exists()
        with open(fifo, "wb") as f:  # now let the second one read its data and train
            f.write(text.read_bytes())
        _, err = second.communicate(timeout=120)
    finally:
        second.kill()
    assert second.returncode == 0, err
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 2


def test_resume_from_another_run_into_a_trained_run_is_refused(tmp_path: Path) -> None:
    raw = make_raw(tmp_path, "victim", train={"max_steps": 3})
    victim = run(config_from_dict(raw), quiet=True)
    other = run(make_cfg_named(tmp_path, "other"), quiet=True)
    before = {p: p.read_bytes() for p in sorted(victim.rglob("*")) if p.is_file()}
    foreign = other / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match=rf"--resume {foreign} belongs to another run, but "
                       rf"run directory {victim} already holds its own checkpoints"):
        run(config_from_dict(raw), resume=str(foreign), quiet=True)
    assert {p: p.read_bytes() for p in sorted(victim.rglob("*")) if p.is_file()} == before
    # A checkpoint of the run itself may be resumed from (a roll-back), and a foreign one
    # into a fresh run directory (a fork).
    own = victim / "checkpoints" / "step-00000003.pt"
    run(config_from_dict({**raw, "train": {**raw["train"], "max_steps": 4}}),
        resume=str(own), quiet=True)
    fork = run(make_cfg_named(tmp_path, "fork", max_steps=4), resume=str(foreign), quiet=True)
    assert load_checkpoint(fork / "checkpoints" / "last.pt")["step"] == 4


def make_cfg_named(tmp_path: Path, name: str, max_steps: int = 3) -> Any:
    return config_from_dict(make_raw(tmp_path, name, train={"max_steps": max_steps}))


def test_a_fresh_start_that_fails_leaves_no_directory(tmp_path: Path) -> None:
    raw = make_raw(tmp_path, "nested")
    raw["run"]["out_dir"] = str(tmp_path / "a" / "b")
    raw["data"]["path"] = str(tmp_path / "missing.txt")
    from fbtrain.data.errors import DataError

    with pytest.raises(DataError):
        run(config_from_dict(raw), quiet=True)
    assert not (tmp_path / "a").exists()


def test_a_full_disk_when_the_run_directory_is_made_names_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    run_dir = tmp_path / "runs" / "run"
    with pytest.raises(FileWriteError, match=rf"^{run_dir / '.lock'}: cannot write: the disk "
                       r"is full"):
        run(config_from_dict(make_raw(tmp_path)), quiet=True)
    assert not (tmp_path / "runs").exists()  # no lock file, no folder left behind


# ----------------------------------------------------------------------------- the console


def test_training_survives_a_closed_stdout(tmp_path: Path) -> None:
    """``fbtrain train ... | head -c 200``: the reader goes, training goes on to the end."""
    raw = make_raw(tmp_path, train={"max_steps": 30, "eval_every": 10, "sample_every": 0})
    proc = cli("train", "--config", str(write_config(tmp_path, raw)), stdout=subprocess.PIPE)
    try:
        proc.stdout.read(200)
        proc.stdout.close()  # what `head` does once it has its bytes
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err
    assert load_checkpoint(tmp_path / "runs" / "run" / "checkpoints" / "last.pt")["step"] == 30


def test_sample_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    run_dir = run(config_from_dict(make_raw(tmp_path, train={"max_steps": 2})), quiet=True)
    proc = cli("sample", "--checkpoint", str(run_dir), "--length", "100000",
               stdout=subprocess.PIPE)
    try:
        proc.stdout.read(10)
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    # Quietly: no error, only the line naming the checkpoint that sample always prints.
    assert (proc.returncode, err) == (0, f"sampling from {run_dir / 'checkpoints' / 'best.pt'} "
                                         "(step 2)\n")


def test_sighup_saves_and_exits_129(tmp_path: Path) -> None:
    """A closed terminal (or SSH session) stops the run like SIGTERM: saved, resumable."""
    proc = cli("train", "--config", str(write_config(tmp_path, endless(tmp_path))))
    run_dir = tmp_path / "runs" / "run"
    try:
        wait_for(lambda: any(r["step"] >= 2 for r in records(run_dir)), proc)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 129, err
    step = load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"]
    assert f"interrupted at step {step} (SIGHUP)" in err


# ----------------------------------------------------------------------------- signals


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_changes_nothing(tmp_path: Path, second: signal.Signals) -> None:
    """Ctrl-C twice, or Ctrl-C then SIGTERM, a moment apart: the first signal's code and
    message, a checkpoint, and no traceback from the process's shutdown."""
    proc = cli("train", "--config", str(write_config(tmp_path, endless(tmp_path))))
    run_dir = tmp_path / "runs" / "run"
    try:
        wait_for(lambda: any(r["step"] >= 2 for r in records(run_dir)), proc)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(second)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "(SIGINT)" in err and "Traceback" not in err
    assert (run_dir / "checkpoints" / "last.pt").is_file()


def test_ctrl_c_cuts_a_long_sample_short(tmp_path: Path) -> None:
    """A step-0 sample of the longest length allowed takes many seconds; Ctrl-C during it
    stops the run at once (nothing trained: no checkpoint), rather than after it."""
    raw = make_raw(tmp_path, train={"max_steps": 5, "sample_length": MAX_SAMPLE_LENGTH})
    proc = cli("train", "--config", str(write_config(tmp_path, raw)))
    run_dir = tmp_path / "runs" / "run"
    try:  # the step-0 validation line is logged just before the sample starts
        wait_for(lambda: any("val/loss" in r for r in records(run_dir)), proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted before the first step (SIGINT)" in err
    assert not (run_dir / "checkpoints" / "last.pt").exists()


def open_writer_once_read(fifo: Path, proc: subprocess.Popen) -> int:
    """Open ``fifo`` for writing as soon as ``proc`` has opened it for reading (the
    handshake: before that, a non-blocking open fails with ENXIO); fail if ``proc`` ends
    first. Nothing is written: the reader then blocks in its read, however slow the
    machine was to get there."""
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        if proc.poll() is not None:
            pytest.fail(f"fbtrain exited before it read its data ({proc.returncode}): "
                        f"{proc.stderr.read()}")
        time.sleep(0.02)


def test_ctrl_c_while_data_loads(tmp_path: Path) -> None:
    """Blocked reading its data (a FIFO it has opened and nobody writes): Ctrl-C ends it,
    exit 130, one line, and the fresh run leaves no directory behind. The signal is sent
    once the run has opened the FIFO, whatever time that took: no wait is timed."""
    fifo = tmp_path / "never.txt"
    os.mkfifo(fifo)
    raw = make_raw(tmp_path)
    raw["data"]["path"] = str(fifo)
    proc = cli("train", "--config", str(write_config(tmp_path, raw)))
    writer = None
    try:
        writer = open_writer_once_read(fifo, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)  # only against a hang: it exits at once
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)
    *before, last = err.strip().splitlines()
    assert (proc.returncode, last) == (130, "interrupted")
    # Said first when the run read the FIFO before the writer above opened it:
    assert before in ([], [f"data.path {fifo} is a named pipe (FIFO) that no program writes "
                           "to yet: waiting for one (Ctrl-C to stop)"]), err
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- the sampler


def test_resume_under_a_changed_world_size_draws_from_the_saved_sampler(
        tmp_path: Path) -> None:
    """A checkpoint of 2 ranks resumed by 1: rank 0 goes on with fresh windows seeded by
    (seed, rank, step), drawn by the very sampler the next checkpoint saves."""
    raw = make_raw(tmp_path, train={"max_steps": 3, "eval_every": 100},
                   curriculum=[{"seq_len": 8}])
    run_dir = run(config_from_dict(raw), quiet=True)
    last = run_dir / "checkpoints" / "last.pt"
    payload = load_checkpoint(last)
    save_checkpoint(last, {**payload, "world_size": 2})  # as if two ranks had trained it

    raw["train"]["max_steps"] = 5
    trainer = Trainer(config_from_dict(raw), DistContext(device=torch.device("cpu")),
                      quiet=True)
    trainer.fit("auto")
    expected = BatchSampler(trainer.parts.data.train_ids, rank_seed(7, 0, 3))
    for _ in range(2):  # the two resumed steps, one micro-batch each
        expected.sample(4, 8)
    assert trainer.parts.batches.sampler is trainer.parts.sampler
    saved = load_checkpoint(last)["sampler"]["generator"]
    assert torch.equal(saved, expected.generator.get_state())


def test_ddp_resume_draws_each_rank_from_its_own_restored_sampler(tmp_path: Path) -> None:
    """Two gloo ranks train, resume, and each dumps the sampler its batches came from."""
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SAMPLER_DRIVER)
    raw = make_raw(tmp_path, train={"max_steps": 2, "eval_every": 100},
                   curriculum=[{"seq_len": 8}])
    (tmp_path / "cfg.json").write_text(json.dumps(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(tmp_path / "cfg.json"), str(tmp_path)],
        env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        dump = torch.load(tmp_path / f"rank{rank}.pt")
        assert dump["same_object"], rank
        assert torch.equal(dump["drawn_from"], dump["expected"]), rank


DDP_SAMPLER_DRIVER = """
import json, sys
import torch
torch.set_num_threads(1)
from fbtrain.checkpoint import load_checkpoint
from fbtrain.config import config_from_dict
from fbtrain.data.samplers import BatchSampler
from fbtrain.distributed import session
from fbtrain.rng import rank_seed
from fbtrain.train import Trainer
raw = json.loads(open(sys.argv[1]).read())
with session("cpu") as ctx:
    Trainer(config_from_dict(raw), ctx, quiet=True).fit(None)
    saved = load_checkpoint(f"{raw['run']['out_dir']}/run/checkpoints/last.pt")
    raw["train"]["max_steps"] += 2
    trainer = Trainer(config_from_dict(raw), ctx, quiet=True)
    trainer.fit("auto")
    if ctx.rank == 0:  # rank 0 goes on with the sampler the checkpoint saved
        expected = BatchSampler(trainer.parts.data.train_ids, 7, rank=0)
        expected.load_state_dict(saved["sampler"])
    else:  # the others with fresh streams of their own, seeded by (seed, rank, step)
        expected = BatchSampler(trainer.parts.data.train_ids, rank_seed(7, ctx.rank, 2),
                                rank=ctx.rank)
    for _ in range(2):
        expected.sample(4, 8)
    torch.save({"same_object": trainer.parts.batches.sampler is trainer.parts.sampler,
                "drawn_from": trainer.parts.batches.sampler.generator.get_state(),
                "expected": expected.generator.get_state()},
               f"{sys.argv[2]}/rank{ctx.rank}.pt")
"""


@pytest.mark.parametrize("damage", [{"step": "abc"}, {"rng": {"python": 5}}])
def test_resume_from_a_hand_damaged_checkpoint_is_one_line(tmp_path: Path,
                                                          damage: dict[str, Any]) -> None:
    raw = make_raw(tmp_path, train={"max_steps": 2})
    last = run(config_from_dict(raw), quiet=True) / "checkpoints" / "last.pt"
    save_checkpoint(last, {**load_checkpoint(last), **damage})
    for other in last.parent.glob("[bs]*.pt"):  # else --resume auto goes on from those
        other.unlink()
    raw["train"]["max_steps"] = 3
    from fbtrain.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=rf"^{last}: cannot resume from it: "):
        run(config_from_dict(raw), resume="auto", quiet=True)


def test_resume_with_a_missing_data_file_says_only_that(tmp_path: Path) -> None:
    """Not "the vocabulary of checkpoint ...: not found": only a vocabulary mismatch is
    about the checkpoint."""
    raw = make_raw(tmp_path, train={"max_steps": 2})
    run(config_from_dict(raw), quiet=True)
    raw["data"]["path"] = str(tmp_path / "gone.txt")
    raw["train"]["max_steps"] = 4  # to train on (a finished run reads no data)
    from fbtrain.data.errors import DataError

    with pytest.raises(DataError) as info:
        run(config_from_dict(raw), resume="auto", quiet=True)
    assert "gone.txt" in str(info.value) and "vocabulary" not in str(info.value)
