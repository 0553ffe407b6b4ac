"""A run stopped and resumed reports the run, not its last segment: the closing line's
totals (tokens, training time over the segments, this segment's rate labelled), a status
line with the rate and ETA as soon as the resumed segment has measured one, the interrupt
line's resume command, and a stop on an evaluation step that loses no validation point."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fbtrain.checkpoint import load_checkpoint
from fbtrain.config import config_from_dict
from fbtrain.make_command import MAKE_TARGET_ENV, make_command
from fbtrain.train import TrainingError, run
from fbtrain.train.report import resume_hint
from tests.test_train import assert_same_tensors, make_raw, records


@pytest.fixture
def own_sigint() -> Iterator[None]:
    """SIGINT as pytest had it, after a test that stops a run with one (the run leaves it
    ignored, as a process on its way out)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def _stop_at(step: int):
    """An ``on_step`` hook that sends this process SIGINT after step ``step``'s training,
    before its evaluation: the evaluation is cut short, the step saved."""
    def hook(at: int) -> None:
        if at == step:
            os.kill(os.getpid(), signal.SIGINT)
    return hook


def test_a_stop_on_an_evaluation_step_still_logs_that_validation_point(tmp_path, own_sigint):
    """Ctrl-C landing on step 2 (an evaluation step) used to lose its ``val/loss`` for good;
    the resume now evaluates step 2 before training on: the same figure as the run that
    was never stopped, and the same weights after."""
    # A constant rate high enough that step 4 evaluates worse than step 2: best.pt is then
    # step 2's, which in the stopped run only the catch-up evaluation's save writes.
    train = {"max_steps": 4, "eval_every": 2, "lr": 0.2, "schedule": "constant",
             "warmup_steps": 0}
    straight = run(config_from_dict(make_raw(tmp_path, "straight", train=train,
                                             checkpoint={"every": 4})), quiet=True)
    raw = make_raw(tmp_path, "stopped", train=train, checkpoint={"every": 4})
    with pytest.raises(TrainingError, match="interrupted at step 2"):
        run(config_from_dict(raw), quiet=True, on_step=_stop_at(2))
    stopped = tmp_path / "runs" / "stopped"
    assert not any("val/loss" in r for r in records(stopped) if r["step"] == 2)  # cut short
    assert load_checkpoint(stopped / "checkpoints" / "last.pt")["progress"]["val_step"] == 0
    run(config_from_dict(raw), resume="auto", quiet=True)

    def validation(run_dir: Path) -> dict[int, float]:
        return {r["step"]: r["val/loss"] for r in records(run_dir) if "val/loss" in r}

    assert validation(stopped) == validation(straight)
    assert sorted(validation(stopped)) == [0, 2, 4]
    assert load_checkpoint(straight / "checkpoints" / "best.pt")["step"] == 2
    for name in ("last.pt", "best.pt"):
        want, got = (load_checkpoint(d / "checkpoints" / name) for d in (straight, stopped))
        assert got["step"] == want["step"], name
        assert_same_tensors(want["model"], got["model"])


@pytest.mark.parametrize("max_steps", [4, 2], ids=["mid-run", "last-step"])
def test_a_stop_during_the_catch_up_evaluation_stops_before_training_on(
        tmp_path, monkeypatch, own_sigint, max_steps):
    """Ctrl-C again while the resume evaluates step 2 (cut short by the first stop): the
    run stops there, exit 130, and the next resume evaluates step 2 after all. It used to
    train step 3 before stopping (step 2's figure then lost for good), and, step 2 being
    the last, exit 0 closing with the untrained model's validation loss."""
    import fbtrain.train.evaluations as evaluations

    train = {"max_steps": max_steps, "eval_every": 2, "schedule": "constant"}
    straight = run(config_from_dict(make_raw(tmp_path, "straight", train=train)), quiet=True)
    raw = make_raw(tmp_path, "stopped", train=train)
    with pytest.raises(TrainingError, match="interrupted at step 2"):
        run(config_from_dict(raw), quiet=True, on_step=_stop_at(2))
    real_scores = evaluations.window_scores

    def scores_then_sigint(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # lands in the evaluation: cuts it short
        return real_scores(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(evaluations, "window_scores", scores_then_sigint)
        with pytest.raises(TrainingError, match=r"^interrupted at step 2 \(SIGINT\)") as stop:
            run(config_from_dict(raw), resume="auto", quiet=True)
    assert stop.value.exit_code == 130
    stopped = tmp_path / "runs" / "stopped"
    assert load_checkpoint(stopped / "checkpoints" / "last.pt")["step"] == 2
    assert max(r["step"] for r in records(stopped)) == 2  # no step trained after the stop
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the stopped run ignores it
    run(config_from_dict(raw), resume="auto", quiet=True)

    def validation(run_dir: Path) -> dict[int, float]:
        return {r["step"]: r["val/loss"] for r in records(run_dir) if "val/loss" in r}

    assert validation(stopped) == validation(straight)
    assert sorted(validation(stopped)) == sorted({0, 2, max_steps})


def test_a_resumed_run_closes_with_the_runs_totals(tmp_path, capsys, own_sigint):
    """The closing line of a resumed run: every token of the run, the training time of
    both segments, and this segment's rate, labelled; the checkpoint counts segments."""
    raw = make_raw(tmp_path, train={"max_steps": 8, "eval_every": 8, "log_every": 4},
                   checkpoint={"every": 8})
    with pytest.raises(TrainingError) as stop:
        run(config_from_dict(raw), on_step=_stop_at(3))
    first = load_checkpoint(tmp_path / "runs" / "run" / "checkpoints" / "last.pt")
    assert first["clock"]["segments"] == 1 and first["clock"]["seconds"] > 0
    assert "resume with --resume auto (or run `make train` again" in str(stop.value)
    capsys.readouterr()
    run_dir = run(config_from_dict(raw), resume="auto")
    out = capsys.readouterr().out
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert last["clock"]["segments"] == 2 and last["clock"]["seconds"] > first["clock"]["seconds"]
    tokens = last["progress"]["tokens"]
    closing = " | ".join(out.splitlines()[-5:])
    assert re.search(rf"\| run: {tokens:,} tokens, \d+s training in 2 segments \| this "
                     rf"segment: {tokens - first['progress']['tokens']:,} tokens in [\d.]+s of "
                     r"steps \| [\d,]+ tokens/s on cpu \([^)]*\) \| wall [\d.]+s: ",
                     closing), closing
    # The resumed segment's first status line (step 4, its first step: not yet measured)
    # has no rate; the next step redraws it with the rate and the ETA.
    steps = [ln for ln in out.splitlines() if ln.startswith("step ") and "/8" in ln]
    assert steps[0].startswith("step 4/8 |") and "tok/s" not in steps[0]
    assert steps[1].startswith("step 5/8 |") and "tok/s" in steps[1] and "| eta " in steps[1]


def test_an_uninterrupted_run_keeps_its_closing_line(tmp_path, capsys):
    """One segment: the closing line as before (rate, wall), no totals to tell apart."""
    run(config_from_dict(make_raw(tmp_path, train={"max_steps": 2})))
    out = capsys.readouterr().out
    assert "segment" not in out and re.search(r"tokens/s on cpu .*\nwall [\d.]+s: ", out)


def under_make(monkeypatch: pytest.MonkeyPatch, target: str, makeflags: str = "") -> None:
    """This process as the Makefile's ``target`` recipe runs it, make given ``makeflags``."""
    monkeypatch.setenv("MAKELEVEL", "1")
    monkeypatch.setenv(MAKE_TARGET_ENV, target)
    monkeypatch.setenv("MAKEFLAGS", makeflags)
    for name in ("DATA", "CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_the_interrupt_line_names_the_make_command_under_make(monkeypatch):
    under_make(monkeypatch, "quick")
    assert resume_hint() == "run `make quick` again to resume (it passes --resume auto)"
    monkeypatch.delenv("MAKELEVEL")  # the variable inherited, but no make running it
    assert "--resume auto" in resume_hint() and "`make train`" in resume_hint()


def test_the_interrupt_line_repeats_the_make_variables(monkeypatch):
    """``make train DATA='my text.txt' CONFIG=c.yaml``, as make passes it on (MAKEFLAGS:
    spaces escaped, ``$`` doubled), and DATA from the environment (make reads it too)."""
    under_make(monkeypatch, "train", "s -- CONFIG=c.yaml DATA=my\\ text.txt")
    assert resume_hint() == ("run `make train CONFIG=c.yaml DATA='my text.txt'` again to "
                             "resume (it passes --resume auto)")
    under_make(monkeypatch, "quick", " -j2 --jobserver-auth=3,4 -- JOBS=4")
    monkeypatch.setenv("DATA", "in.txt")
    assert "`make quick JOBS=4 DATA=in.txt`" in resume_hint()
    assert make_command(DATA="FILE") == "make quick JOBS=4 DATA=FILE"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_following_the_interrupt_line_resumes_on_the_same_data(tmp_path, monkeypatch,
                                                               own_sigint):
    """A run started by ``make quick DATA=FILE`` and stopped names ``make quick DATA=FILE``;
    that command (the Makefile's own recipe, dry-run) trains on FILE again: no download."""
    raw = make_raw(tmp_path, train={"max_steps": 4})
    data = raw["data"]["path"]
    under_make(monkeypatch, "quick", f" -- DATA={data.replace(' ', chr(92) + ' ')}")
    with pytest.raises(TrainingError) as stop:
        run(config_from_dict(raw), quiet=True, on_step=_stop_at(2))
    hint = re.search(r"run `(make [^`]*)` again", str(stop.value))
    assert hint and hint.group(1) == f"make quick DATA={shlex.quote(data)}", str(stop.value)
    root = Path(__file__).resolve().parents[1]
    monkeypatch.delenv("MAKEFLAGS")
    monkeypatch.delenv("MAKELEVEL")
    dry = subprocess.run([*shlex.split(hint.group(1)), "-n", "VENV=/nonexistent/venv"],
                         cwd=root, capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.replace("\\\n", " ").splitlines()  # the recipe's continued lines joined
    [command] = [shlex.split(line) for line in lines if "fbtrain train" in line]
    assert f"data.path={data}" in command and "--resume" in command, dry.stdout
    assert command[command.index(f"data.path={data}") - 1] == "--set"
    assert command[command.index("--resume") + 1] == "auto"


def test_a_failed_download_under_make_names_the_make_target(tmp_path):
    """Offline, ``make quick`` (no DATA) fails to download: the way out it names is
    ``make quick DATA=FILE``, not ``make train``."""
    env = {**os.environ, "MAKELEVEL": "1", MAKE_TARGET_ENV: "quick", "MAKEFLAGS": ""}
    env.pop("DATA", None)
    shown = subprocess.run([sys.executable, "-c",
                            "from fbtrain.data.fetch import OFFLINE_HINT; print(OFFLINE_HINT)"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip().endswith("(with make: make quick DATA=FILE)"), shown


def test_the_makefile_names_its_targets():
    """``make train`` and ``make quick`` tell the run which command resumes it."""
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    for target in ("train", "quick"):
        recipe = makefile.split(f"\n{target}: install\n", 1)[1].split("\n\n", 1)[0]
        assert f"{MAKE_TARGET_ENV}={target} $(BIN)/fbtrain train" in recipe
