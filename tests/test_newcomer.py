"""What a newcomer trips on: every help line and the summary within 80
columns, a config given without --config, training without --config, the offline hint in
the form `make train` takes, `exports/` ignored by git."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_train import write_text
from typer.testing import CliRunner

from fbtrain.cli import app
from fbtrain.data.fetch import OFFLINE_HINT
from fbtrain.train import report
from fbtrain.train.clock import RunClock

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [[], ["train"], ["sample"], ["eval"], ["export"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "fbtrain")
def test_every_help_line_fits_80_columns(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    long = [ln for ln in result.output.splitlines() if len(ln) > 80]
    assert not long, long


def test_every_subcommand_is_walked() -> None:
    """The walk above covers every command there is (a new one is walked too)."""
    import typer.main

    group = typer.main.get_command(app)
    assert sorted(group.commands) == sorted(c[0] for c in COMMANDS if c)


def test_the_summary_of_a_long_run_fits_80_columns() -> None:
    """A long run's figures (step 20,000, 1,024 windows, 123,456 tokens/s, 12 hours) still
    give lines of at most 80 columns, each broken between parts; the rate is the tokens
    over the steps' time, and the wall time's parts add up."""
    data = SimpleNamespace(val_x=[0] * 1024, chars_per_token=(1.0, 1.0))
    run = SimpleNamespace(data=data, amp_dtype=None,
                          ctx=SimpleNamespace(device=torch.device("cpu")), clock=RunClock(),
                          raw_model=SimpleNamespace(core_params=()))  # a feedback kind
    progress = SimpleNamespace(step=20000, val_loss=1.60871, best_val_loss=1.60013,
                               tokens=20_480_000)
    spent = report.SegmentTime(wall=45296.0, tokens=20_480_000, steps=20_480_000 / 123456,
                               evaluating=1200.4, sampling=301.0)
    lines = report.summary(run, progress, spent).splitlines()
    assert all(len(ln) <= 80 for ln in lines), lines
    assert re.fullmatch(r"done at step 20000 \| val loss 1\.6087 \(bpc 2\.3209, 1024 fixed "
                        r"windows\) \| best 1\.6001 \| 20,480,000 tokens in 2m46s of steps "
                        r"\| 123,456 tokens/s on cpu \(\d+ threads?, fp32, [^|]*core\) \| wall "
                        r"12h34m: 2m46s steps, 20m00s evaluating, 5m01s sampling, 12h07m "
                        r"other", " | ".join(lines)), lines
    # Resumed (a third segment): the run's totals, then this segment's figures, labelled.
    run.clock = RunClock(seconds=3600.0, segments=2)
    lines = report.summary(run, progress, spent).splitlines()
    assert all(len(ln) <= 80 for ln in lines), lines
    assert re.search(r"\| run: 20,480,000 tokens, 13h34m training in 3 segments \| this "
                     r"segment: 20,480,000 tokens in 2m46s of steps \| 123,456 tokens/s on cpu "
                     r"\(\d+ threads?, fp32, [^|]*core\) \| wall 12h34m: ",
                     " | ".join(lines)), lines


def test_a_config_given_without_config_is_pointed_at_it() -> None:
    result = CliRunner().invoke(app, ["train", "configs/tiny.yaml"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: fbtrain train: got unexpected extra argument(s) (configs/tiny.yaml); did you "
        "mean --config configs/tiny.yaml?"]


def test_training_without_config_says_the_defaults_are_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The note at the start, and the refusal of a second start names what was missing and
    where the run's own settings are."""
    monkeypatch.chdir(tmp_path)
    text = write_text(tmp_path)
    args = ["train", "--set", f"data.path={text}", "--set", "train.max_steps=1",
            "--set", "model.d_model=16", "--set", "model.n_layers=1", "--set",
            "train.batch_size=2", "--set", "curriculum=[{seq_len: 8}]", "--set",
            "logging.tensorboard=false", "--set", "train.sample_every=0"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    note = "note: no --config given: training the built-in defaults into runs/tiny_shakespeare"
    assert first.stderr.splitlines()[0] == note
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2
    lines = again.stderr.splitlines()
    assert lines[0] == note and len(lines) == 2, lines
    assert lines[1].startswith("error: run directory runs/tiny_shakespeare already holds ")
    assert lines[1].endswith("(no --config was given: these are the built-in defaults; the "
                             "run's own settings are in runs/tiny_shakespeare/config.yaml)")


def test_the_offline_hint_names_the_make_form_too() -> None:
    assert "--set data.path=FILE" in OFFLINE_HINT and "make train DATA=FILE" in OFFLINE_HINT


def test_exports_are_ignored_by_git(tmp_path: Path) -> None:
    folder = ROOT / "exports" / "ts"
    probe = subprocess.run(["git", "check-ignore", "-q", str(folder / "model.safetensors")],
                           cwd=ROOT, capture_output=True, check=False)
    if probe.returncode == 128:
        pytest.skip("not a git checkout")
    assert probe.returncode == 0, "exports/ (fbtrain export's documented folder) is tracked"


def test_generate_documents_that_the_prompt_is_left_out() -> None:
    from fbtrain.sample import generate

    doc = " ".join((generate.__doc__ or "").split())
    assert "without the prompt (unlike fbtrain sample" in doc
    docs = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    assert "without the prompt (unlike `fbtrain sample`" in " ".join(docs.split())



def test_the_export_summary_fits_80_columns(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented export (runs/tiny_shakespeare into exports/ts): every line of what
    it prints within 80 columns, nothing cut off (one line of 130 was)."""
    from test_sample import tiny_model, write_run

    monkeypatch.chdir(tmp_path)
    write_run(Path("runs/tiny_shakespeare"), tiny_model(), name="best.pt")
    result = CliRunner().invoke(app, ["export", "-c", "runs/tiny_shakespeare", "-o", "exports/ts"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "exported runs/tiny_shakespeare/checkpoints/best.pt",
        f"  to exports/ts: model.safetensors ({result.stdout.split('(')[1].split(')')[0]}), "
        "config.json, vocab.json"]
    assert all(len(ln) <= 80 for ln in result.stdout.splitlines())


def test_the_other_txt_placeholder_is_explained() -> None:
    docs = " ".join((ROOT / "docs" / "commands.md").read_text(encoding="utf-8").split())
    assert "`other.txt` stands for any UTF-8 text file" in docs
