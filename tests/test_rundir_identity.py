"""A run directory knows which run it holds, and says before training what it cannot take.

``--resume auto`` never takes over a step file copied in from another run, nor one whose name
says another step than it holds (both refused, naming the file, before anything moves); a
resume that changes settings names them and ``history.jsonl`` keeps each segment's; a v1
checkpoint says its data cannot be checked; a folder where ``last.pt`` goes, an immutable
folder or file, a path past PATH_MAX are refused before the first step, and a save that fails
names the real file, not its temp file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_legacy_checkpoints import FIXTURES, legacy_config
from test_rundir import _files, _trained
from test_train import make_raw
from typer.testing import CliRunner

from fbtrain.checkpoint import load_checkpoint
from fbtrain.cli import app
from fbtrain.config import ConfigError, config_from_dict
from fbtrain.io import FileWriteError
from fbtrain.train import run

pytestmark = pytest.mark.usefixtures("one_thread")


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """history.jsonl's lines (read here, not by fbtrain: the test must fail where it is not)."""
    path = run_dir / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train_cli(tmp_path: Path, raw: dict[str, Any], *args: str) -> Any:
    """``fbtrain train`` on ``raw`` (written as a config) with ``args``; the CliRunner result."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return CliRunner().invoke(app, ["train", "--config", str(cfg), "--quiet", *args])


def _one_error(result: Any) -> str:
    """The one ``error:`` line of an exit-2 result (asserted so)."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# ----------------------------------------------------------------------------- items 1, 2


def test_resume_auto_refuses_a_misnamed_step_file_before_moving_anything(
        tmp_path: Path) -> None:
    """Was: a copy of step 3 named step-00000009.pt made --resume auto move best.pt
    and step-6 aside into abandoned-from-step-3/, then fail on the file it had moved."""
    raw, ckpts = _trained(tmp_path)
    (ckpts / "last.pt").unlink()
    shutil.copy(ckpts / "step-00000003.pt", ckpts / "step-00000009.pt")
    before = _files(ckpts.parent)
    raw["train"]["max_steps"] = 10
    line = _one_error(_train_cli(tmp_path, raw, "--resume", "auto"))
    assert line.startswith(f"error: {ckpts / 'step-00000009.pt'} holds the state of step 3, "
                           "not of step 9 as its name says; move it out of "), line
    assert line.endswith("Nothing was moved or written")
    assert _files(ckpts.parent) == before  # nothing set aside, nothing written
    # The file named for what it holds... is the run's step 3 again: auto goes on from 6.
    (ckpts / "step-00000009.pt").unlink()
    run(config_from_dict(raw), resume="auto", quiet=True)
    assert load_checkpoint(ckpts / "last.pt")["step"] == 10
    assert not list(ckpts.glob("abandoned-*"))


def test_resume_auto_refuses_a_step_file_of_another_run(tmp_path: Path) -> None:
    """Was: another run's last.pt copied in as step-00000009.pt was resumed from,
    and the run's own best.pt replaced. Same model, data and seed: only the run id tells."""
    raw, ckpts = _trained(tmp_path)
    other = run(config_from_dict(make_raw(tmp_path, "other", train={"max_steps": 6})),
                quiet=True)
    ours = read_history(ckpts.parent)[0]["run_id"]
    theirs = load_checkpoint(other / "checkpoints" / "last.pt")["run_id"]
    assert ours != theirs and load_checkpoint(ckpts / "best.pt")["run_id"] == ours
    (ckpts / "last.pt").unlink()
    shutil.copy(other / "checkpoints" / "last.pt", ckpts / "step-00000009.pt")
    before = _files(ckpts.parent)
    raw["train"]["max_steps"] = 10
    foreign = (f"error: {ckpts / 'step-00000009.pt'} belongs to another run (run id {theirs}; "
               f"this run's, in its history.jsonl and checkpoints, is {ours}); move it out of ")
    line = _one_error(_train_cli(tmp_path, raw, "--resume", "auto"))
    assert line.startswith(foreign), line
    # --resume PATH of the file inside the run directory: the same test.
    line = _one_error(_train_cli(tmp_path, raw, "--resume", str(ckpts / "step-00000009.pt")))
    assert line.startswith(foreign), line
    assert _files(ckpts.parent) == before


def test_resume_auto_refuses_another_runs_file_below_the_one_it_resumes(
        tmp_path: Path) -> None:
    """With last.pt in place auto reads no other file to choose, but a rewind may move any
    of them and keep_last delete them: each is checked all the same."""
    raw, ckpts = _trained(tmp_path)
    other = run(config_from_dict(make_raw(tmp_path, "other", train={"max_steps": 6})),
                quiet=True)
    shutil.copy(other / "checkpoints" / "best.pt", ckpts / "best.pt")
    raw["train"]["max_steps"] = 8
    with pytest.raises(Exception, match=r"best\.pt belongs to another run"):
        run(config_from_dict(raw), resume="auto", quiet=True)


# ----------------------------------------------------------------------------- item 3


def test_a_folder_as_last_pt_is_refused_before_training(tmp_path: Path) -> None:
    """Was: a folder as last.pt named as unreadable, then 10 steps trained and the first save
    failed ("[Errno 21] Is a directory"), the steps lost."""
    raw, ckpts = _trained(tmp_path)
    (ckpts / "last.pt").unlink()
    (ckpts / "last.pt").mkdir()
    before = _files(ckpts.parent)
    raw["train"]["max_steps"] = 9
    with pytest.raises(ConfigError, match=(
            rf"^{ckpts / 'last.pt'} is a folder, so the run could not save it; move it away")):
        run(config_from_dict(raw), resume="auto", quiet=True)
    assert _files(ckpts.parent) == before
    # metrics.jsonl as a folder in a fresh run directory: refused the same way.
    fresh = tmp_path / "runs" / "fresh"
    (fresh / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"metrics\.jsonl is a folder"):
        run(config_from_dict(make_raw(tmp_path, "fresh", train={"max_steps": 2})), quiet=True)
    assert sorted(p.name for p in fresh.iterdir()) == [".lock", "metrics.jsonl"]


def test_a_file_where_tensorboards_val_folder_goes_is_refused_before_training(
        tmp_path: Path) -> None:
    """A file named val in a fresh run directory: "[Errno 17] File exists" after the run's
    files were written, so the folder then needed --resume. Now refused first, naming it,
    and the same command trains once the file is moved away."""
    raw = make_raw(tmp_path, "v", train={"max_steps": 2},
                   logging={"tensorboard": True, "progress": False})
    run_dir = tmp_path / "runs" / "v"
    run_dir.mkdir(parents=True)
    (run_dir / "val").write_text("x\n")
    line = _one_error(_train_cli(tmp_path, raw))
    assert line == (f"error: {run_dir / 'val'} is not a folder, so the run could not write "
                    "into it; move it away (or train under another run.name, "
                    "--set run.name=NEW)")
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "val"]
    (run_dir / "val").unlink()
    assert _train_cli(tmp_path, raw).exit_code == 0


@pytest.mark.parametrize("kind", ["dangling link", "looping link", "file", "file above"])
def test_a_run_directory_that_is_no_folder_is_named(tmp_path: Path, kind: str) -> None:
    """A symbolic link to nowhere as the run directory said "cannot write: file exists"."""
    raw = make_raw(tmp_path, "r", train={"max_steps": 2})
    runs = tmp_path / "runs"
    runs.mkdir()
    if kind == "dangling link":
        (runs / "r").symlink_to(tmp_path / "nowhere")
        what = (f"run directory {runs / 'r'} is a symbolic link to {tmp_path / 'nowhere'}, "
                f"which does not exist; create {tmp_path / 'nowhere'}")
    elif kind == "looping link":  # it said "create r", which cannot be done
        (runs / "r").symlink_to("r")
        what = (f"run directory {runs / 'r'} is a symbolic link to r, which leads back to "
                "itself; remove it")
    elif kind == "file":
        (runs / "r").write_text("x\n")
        what = f"run directory {runs / 'r'} is a file, not a folder; move it away"
    else:
        (runs / "r").write_text("x\n")
        raw["run"]["out_dir"] = str(runs / "r" / "deeper")
        what = (f"run directory {runs / 'r' / 'deeper' / 'r'}: the folder {runs / 'r'} is a "
                "file, not a folder; move it away")
    line = _one_error(_train_cli(tmp_path, raw))
    assert line == f"error: {what} (or train under another run.out_dir or run.name)"


def test_a_resume_puts_a_stale_best_pt_right(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """best.pt left at a worse step than the best the run recorded (its copy failed on a
    full disk): the summary said the best loss while sample used the stale file. A resume
    (even one with nothing to train) puts the checkpoint that scored the best back."""
    raw = make_raw(tmp_path, train={"max_steps": 9, "eval_every": 3},
                   checkpoint={"every": 3, "keep_last": 5})
    ckpts = run(config_from_dict(raw), quiet=True) / "checkpoints"
    losses = {p: load_checkpoint(p)["progress"]["val_loss"] for p in ckpts.glob("step-*.pt")}
    best = min(losses, key=losses.__getitem__)
    worst = max(losses, key=losses.__getitem__)
    shutil.copyfile(worst, ckpts / "best.pt")
    capsys.readouterr()
    run(config_from_dict(raw), resume="auto")
    out = capsys.readouterr().out
    worst_step, best_step = (load_checkpoint(p)["step"] for p in (worst, best))
    assert (f"best.pt held step {worst_step} (val loss {losses[worst]:.4f}): it is now a copy "
            f"of {'last.pt' if best_step == 9 else best.name} (step {best_step}), which scored "
            f"the best validation loss the run recorded ({losses[best]:.4f})") in out
    assert (ckpts / "best.pt").read_bytes() == best.read_bytes()


# ----------------------------------------------------------------------------- items 4, 5


def test_a_resume_with_changed_settings_names_them_and_keeps_the_history(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was: --set train.lr=0.01 on resume was applied in silence, and config.yaml
    rewritten as if the whole run had used it."""
    raw, ckpts = _trained(tmp_path)
    capsys.readouterr()
    raw["train"].update(max_steps=8, lr=0.01)
    run(config_from_dict(raw), resume="auto")
    out = capsys.readouterr().out.splitlines()
    assert ("settings changed from what the checkpoint (step 6) trained with: "
            "train.max_steps 6 -> 8, train.lr 0.003 -> 0.01 (config.yaml now holds the new ones; "
            "history.jsonl keeps each segment's)") in out
    history = read_history(ckpts.parent)
    assert [h["start_step"] for h in history] == [0, 6]
    assert history[0]["run_id"] == history[1]["run_id"] == load_checkpoint(
        ckpts / "last.pt")["run_id"]
    assert history[0]["resumed_from"] is None and history[0]["changed"] == {}
    assert history[0]["config"]["train"]["lr"] == 0.003
    assert history[1]["resumed_from"] == str(ckpts / "last.pt")
    assert history[1]["changed"] == {"train.lr": [0.003, 0.01], "train.max_steps": [6, 8]}
    assert history[1]["config"]["train"]["lr"] == 0.01
    assert yaml.safe_load((ckpts.parent / "config.yaml").read_text())["train"]["lr"] == 0.01
    # A resume that changes nothing says nothing about settings.
    raw["train"]["max_steps"] = 8
    run(config_from_dict(raw), resume="auto")
    assert "settings changed" not in capsys.readouterr().out
    assert len(read_history(ckpts.parent)) == 2  # nothing trained: no segment


def test_a_v1_checkpoint_resumed_says_its_data_cannot_be_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was: a v1 checkpoint holds no digest of its data, so other data (here, the
    same words in another order) resumed in silence; a v2 one is refused."""
    cfg = legacy_config(tmp_path, "reset", 3)
    text = Path(cfg.data.path)
    lines = text.read_text().splitlines()
    text.write_text("\n".join(reversed(lines)) + "\n")
    last = Path(cfg.run.out_dir) / "reset" / "checkpoints" / "last.pt"
    last.parent.mkdir(parents=True)
    shutil.copy(FIXTURES / "legacy-v1-reset.pt", last)
    run(cfg, resume="auto")
    assert (f"{last}: this checkpoint (format v1) holds no digest of the data it was trained "
            f"on, so fbtrain cannot check that data.path {text} is that data; if it is not, "
            "its validation loss and best.pt are judged on other text"
            ) in capsys.readouterr().out.splitlines()
    assert load_checkpoint(last)["step"] == 3
    assert "sha256" in load_checkpoint(last)["data"]  # from now on it can


# ----------------------------------------------------------------------------- item 10


def test_an_overlong_run_directory_is_one_short_line(tmp_path: Path) -> None:
    """Was: "[Errno 36] File name too long: '<5,000 characters>'"."""
    deep = tmp_path / "/".join(["d" * 200] * 25)  # 5,000 characters
    line = _one_error(_train_cli(tmp_path, make_raw(tmp_path, run={
        "name": "r", "out_dir": str(deep), "device": "cpu", "seed": 7})))
    assert len(line) < 300 and "(PATH_MAX); use a run.out_dir and run.name under" in line, line
    long_name = make_raw(tmp_path, run={"name": "n" * 300, "out_dir": str(tmp_path / "runs"),
                                        "device": "cpu", "seed": 7})
    line = _one_error(_train_cli(tmp_path, long_name))
    assert len(line) < 300 and "is 300 bytes long, more than the 255" in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / ("d" * 200)).exists()


@contextmanager
def _immutable(path: Path) -> Iterator[None]:
    """``chattr +i path`` for the block (skipped where the file system or user cannot),
    always undone."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr here")
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i not supported here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_an_immutable_checkpoints_folder_or_metrics_is_refused_before_training(
        tmp_path: Path) -> None:
    """Was: chattr +i on checkpoints/ cost 10 steps and ended on
    "[Errno 1] Operation not permitted: '.../.last.pt.cueq0wj9.tmp'"."""
    raw, ckpts = _trained(tmp_path)
    raw["train"]["max_steps"] = 9
    before = _files(ckpts.parent)
    with _immutable(ckpts):
        line = _one_error(_train_cli(tmp_path, raw, "--resume", "auto"))
    assert line.startswith(f"error: {ckpts}: no file can be created in it (operation not "
                           "permitted); make it writable"), line
    metrics = ckpts.parent / "metrics.jsonl"
    with _immutable(metrics):
        line = _one_error(_train_cli(tmp_path, raw, "--resume", "auto"))
    assert line.startswith(f"error: {metrics} is immutable (chattr), so the run could not "), line
    assert _files(ckpts.parent) == before


def test_a_save_that_fails_names_the_real_file(tmp_path: Path) -> None:
    """Made immutable after the start's checks (at step 2), checkpoints/ fails the step-3
    save: the error names last.pt and what to do, not '.last.pt.<random>.tmp'."""
    raw = make_raw(tmp_path, train={"max_steps": 4})
    ckpts = tmp_path / "runs" / "run" / "checkpoints"
    chattr_ok = shutil.which("chattr") is not None
    if not chattr_ok:
        pytest.skip("no chattr here")

    def freeze(step: int) -> None:
        if step == 2:
            ckpts.mkdir(exist_ok=True)
            done = subprocess.run(["chattr", "+i", str(ckpts)], capture_output=True)
            if done.returncode != 0:
                pytest.skip("chattr +i not supported here")

    try:
        with pytest.raises(FileWriteError) as info:
            run(config_from_dict(raw), quiet=True, on_step=freeze)
    finally:
        subprocess.run(["chattr", "-i", str(ckpts)], capture_output=True)
    assert str(info.value) == (
        f"{ckpts / 'last.pt'}: cannot write: operation not permitted (an attribute forbids "
        "it: see lsattr -d on the file and its folder; chattr -i lifts an immutable one)")
    assert json.loads((ckpts.parent / "history.jsonl").read_text())["start_step"] == 0


def test_a_rename_onto_a_folder_names_the_file_and_what_to_do(tmp_path: Path) -> None:
    """A folder made where best.pt goes after the start's checks: the rename failed with
    "[Errno 21] Is a directory: '.best.pt.<random>.tmp' -> '.../best.pt'"."""
    from fbtrain.io import atomic_write_text

    (tmp_path / "best.pt").mkdir()
    with pytest.raises(FileWriteError) as info:
        atomic_write_text(tmp_path / "best.pt", "x")
    assert str(info.value) == (f"{tmp_path / 'best.pt'}: cannot write: is a directory (a "
                               "folder is in its place: move it away)")
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"]  # no temp file left


def test_without_history_checkpoints_of_two_runs_are_refused(tmp_path: Path) -> None:
    """history.jsonl (which names the run) deleted too: the checkpoints' own run ids show
    two runs, and nothing tells which is this one's."""
    raw, ckpts = _trained(tmp_path)
    other = run(config_from_dict(make_raw(tmp_path, "other", train={"max_steps": 6})),
                quiet=True)
    (ckpts.parent / "history.jsonl").unlink()
    (ckpts / "last.pt").unlink()
    shutil.copy(other / "checkpoints" / "last.pt", ckpts / "step-00000009.pt")
    before = _files(ckpts.parent)
    raw["train"]["max_steps"] = 10
    with pytest.raises(Exception, match=(
            rf"^{ckpts} holds checkpoints of 2 runs \(run id \w+: step-00000009\.pt; run id "
            r"\w+: step-00000006\.pt, step-00000003\.pt, best\.pt\) and .*history\.jsonl, "
            "which names this run's, is missing")):
        run(config_from_dict(raw), resume="auto", quiet=True)
    assert _files(ckpts.parent) == before
    # Only the run's own files left: it goes on, and its history starts again.
    (ckpts / "step-00000009.pt").unlink()
    run(config_from_dict(raw), resume="auto", quiet=True)
    assert load_checkpoint(ckpts / "last.pt")["run_id"] == read_history(ckpts.parent)[0][
        "run_id"] == load_checkpoint(ckpts / "best.pt")["run_id"]


def test_a_checkpoints_folder_linked_elsewhere_is_still_the_runs_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """checkpoints/ as a link to a folder on a bigger disk: ``--resume <run>`` and a rewind
    to its own step file were refused as another run's checkpoints (the path resolved
    outside the run directory)."""
    raw, ckpts = _trained(tmp_path)
    elsewhere = tmp_path / "big-disk" / "ckpts"
    elsewhere.parent.mkdir()
    shutil.move(ckpts, elsewhere)
    ckpts.symlink_to(elsewhere)
    raw["train"]["max_steps"] = 7
    run(config_from_dict(raw), resume=str(ckpts.parent))
    assert load_checkpoint(ckpts / "last.pt")["step"] == 7
    run(config_from_dict(raw), resume=str(ckpts / "step-00000006.pt"))
    assert "rewound to step 6" in capsys.readouterr().out
    assert load_checkpoint(elsewhere / "last.pt")["step"] == 7
    moved = {p.name for p in elsewhere.glob("abandoned-from-step-00000006/*.pt")}
    assert {"last.pt", "step-00000007.pt"} <= moved


def test_a_branch_set_aside_by_a_rewind_is_resumed_only_into_another_run(
        tmp_path: Path) -> None:
    """Resuming a checkpoint from checkpoints/abandoned-from-step-N/ in place mixed two
    branches: metrics.jsonl kept the new branch's steps up to the resumed one (and lost the
    old branch's), its step files stayed beside the old branch's. Refused before anything is
    written; into another run.name it trains on."""
    raw, ckpts = _trained(tmp_path)
    raw["train"]["max_steps"] = 5
    run(config_from_dict(raw), resume=str(ckpts / "step-00000003.pt"), quiet=True)
    set_aside = ckpts / "abandoned-from-step-00000003" / "last.pt"
    raw["train"]["max_steps"] = 8
    before = _files(ckpts.parent)
    line = _one_error(_train_cli(tmp_path, raw, "--resume", str(set_aside)))
    assert line == (
        f"error: --resume {set_aside} is in abandoned-from-step-00000003/, a branch set aside "
        f"by an earlier rewind; {ckpts} and {ckpts.parent / 'metrics.jsonl'} now hold the "
        "branch that replaced it, which a resume here would mix with its steps; resume it "
        f"into another run.name (--set run.name=NEW --resume {set_aside})")
    assert _files(ckpts.parent) == before
    raw["run"]["name"] = "back"
    run(config_from_dict(raw), resume=str(set_aside), quiet=True)
    assert load_checkpoint(tmp_path / "runs/back/checkpoints/last.pt")["step"] == 8
    # A copy of the run's own checkpoint kept in a folder of the user's is a plain rewind.
    raw["run"]["name"] = "run"
    (ckpts / "keep").mkdir()
    shutil.copy(ckpts / "step-00000003.pt", ckpts / "keep" / "three.pt")
    run(config_from_dict(raw), resume=str(ckpts / "keep" / "three.pt"), quiet=True)
    assert load_checkpoint(ckpts / "last.pt")["step"] == 8
