"""The command line: help, version, flag parsing, dispatch, and how errors become exit codes.

Most tests replace ``train.run`` / ``sample.run`` / ``evaluate.run`` with fakes, so they check
the CLI alone and take milliseconds; ``test_end_to_end`` runs the real thing, small.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from fbtrain import __version__, evaluate, sample, train
from fbtrain.checkpoint import CheckpointError
from fbtrain.cli import app
from fbtrain.data.errors import DataError
from fbtrain.device import DeviceError
from fbtrain.errors import ArgumentError
from fbtrain.models.core.native import CoreBuildError

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")

runner = CliRunner()
# The real functions, taken before any test replaces them, to compare defaults with.
SAMPLE_RUN, EVAL_RUN = sample.run, evaluate.run


def defaults_of(fn) -> dict[str, Any]:
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if p.default is not p.empty}


def invoke(*args: str):
    return runner.invoke(app, list(args))


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- help, version


def test_help_lists_commands():
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    assert "Usage: fbtrain" in result.output
    for command in ("train", "sample", "eval"):
        assert f"  {command}  " in result.output
    assert "Examples:" in result.output


def test_no_arguments_shows_help():
    result = invoke()
    assert "Usage: fbtrain" in result.output and "train" in result.output


def test_help_gives_the_main_jobs_work_and_points_at_the_eta():
    """The help's figure is the main job's token budget (its config): change the config and
    the help has to follow. Its time is the status line's ETA, not a figure in the code."""
    m = re.search(r"# the main job: ([\d.]+)M tokens; its status line shows the ETA",
                  invoke("--help").output)
    assert m, invoke("--help").output
    raw = yaml.safe_load((ROOT / "configs" / "tiny_shakespeare.yaml").read_text())
    assert raw["train"]["constant_tokens"]  # every step trains batch_size x the last length
    train = raw["train"]
    tokens = train["max_steps"] * train["batch_size"] * raw["curriculum"][-1]["seq_len"]
    assert m.group(1) == f"{tokens / 1e6:.1f}"


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("train", ["--config", "--set", "--resume", "--device", "--quiet", "--print-config"]),
        ("sample", ["--checkpoint", "--prompt", "--length", "--temperature", "--top-k",
                    "--top-p", "--num-samples", "--seed", "--device"]),
        ("eval", ["--checkpoint", "--split", "--seq-len", "--batch-size", "--data-path",
                  "--context", "--device", "--json"]),
    ],
)
def test_command_help(command: str, flags: list[str]):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert f"Usage: fbtrain {command}" in result.output
    for flag in flags:
        assert flag in result.output
    assert "Examples:" in result.output and f"fbtrain {command} " in result.output


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"fbtrain {__version__}\n"


def test_python_dash_m_version():
    out = subprocess.run([sys.executable, "-m", "fbtrain", "--version"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fbtrain 0.1.0"


# ----------------------------------------------------------------------------- train: config


def test_bad_config_exits_2_with_every_problem(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_modle: 64\ntrain:\n  lr: 0.0\n  min_lr: 0.0\n")
    result = invoke("train", "--config", str(path))
    assert result.exit_code == 2
    lines = error_lines(result)
    assert lines == [
        f"error: {path}: unknown key model.d_modle (did you mean model.d_model?); allowed: "
        "kind, d_model, n_heads, d_ff, n_layers, dropout, max_rel_pos, mem_len, memory_norm, "
        "memory_init, position_init",
        f"error: {path}: train.lr = 0.0: must be > 0",
    ]
    assert "Traceback" not in result.output


def test_missing_config_exits_2(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    result = invoke("train", "--config", str(missing))
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {missing}: config file not found"]


def test_malformed_config_exits_2(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  d_model: 64\n n_heads: 4\n")
    result = invoke("train", "--config", str(path))
    assert result.exit_code == 2
    assert "line 3, column 2: malformed YAML" in result.stderr


def test_bad_set_exits_2():
    result = invoke("train", "--config", TINY, "--set", "train.max_steps")
    assert result.exit_code == 2
    assert "error: --set 'train.max_steps': must look like section.key=value" in result.stderr


@pytest.mark.parametrize("empty", ["''", "' '"])
def test_an_empty_data_path_is_refused_not_read_as_no_file(empty: str):
    """data.path '' is refused: an empty path read as none, and training went on with the
    dataset's download (tinyshakespeare) instead of the file meant."""
    result = invoke("train", "--config", TINY, "--set", f"data.path={empty}", "--print-config")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (f"error: {TINY} (with --set): data.path = {empty}: must name a "
                             "file (null: the dataset's own data)\n")


@pytest.mark.parametrize("value", ["#1 notes.txt", "my #1.txt", "'my #1.txt'"])
def test_a_hash_in_a_set_path_is_part_of_the_path(value: str):
    """--set data.path='#1 notes.txt' is that file: YAML reads an unquoted # after a space
    (or at the start) as a comment, so the path was cut to 'my', or to null: the download,
    trained on in silence. Text fields keep the text written, as they keep run.name=007."""
    result = invoke("train", "--config", TINY, "--set", f"data.path={value}",
                    "--set", "train.max_steps=5 # a number's comment is still one",
                    "--print-config")
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert printed["data"]["path"] == value.strip("'")
    assert printed["train"]["max_steps"] == 5


def test_bad_device_exits_2():
    result = invoke("train", "--config", TINY, "--device", "tpu")
    assert result.exit_code == 2
    assert "run.device = 'tpu': must be auto, cpu, cuda or cuda:N" in result.stderr


def test_print_config_applies_precedence():
    result = invoke("train", "--config", TINY, "--set", "train.max_steps=7", "-s",
                    "model.dropout=0.1", "--device", "cpu", "--print-config")
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert printed["train"]["max_steps"] == 7
    assert printed["model"]["dropout"] == 0.1
    assert printed["model"]["d_model"] == 16  # from the file
    assert printed["run"]["device"] == "cpu"
    assert printed["run"]["name"] == "tiny"


def test_print_config_without_config_uses_defaults():
    from fbtrain.config import load_config

    result = invoke("train", "--print-config")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == load_config(None).to_dict()


# ----------------------------------------------------------------------------- suggestions
# Each slip a newcomer makes gets the command they meant, in the one error line.


@pytest.mark.parametrize(("args", "meant"), [
    (["--set", "train.max_steps", "100"], "--set train.max_steps=100"),
    (["-s", "train.lr=1e-3", "-s", "train.max_steps", "100"], "--set train.max_steps=100"),
    ([TINY], f"--config {TINY}"),  # a config given as an argument (train takes none)
])
def test_an_extra_argument_suggests_what_it_was_meant_for(args: list[str], meant: str):
    result = invoke("train", *args)
    assert result.exit_code == 2
    assert error_lines(result)[-1].endswith(f"; did you mean {meant}?"), result.stderr
    assert len(error_lines(result)) == 1


def test_a_key_without_its_section_suggests_the_key():
    result = invoke("train", "--set", "max_steps=100")
    assert result.exit_code == 2
    assert error_lines(result) == ["error: --set 'max_steps=100': key must be section.key (or "
                                   "curriculum); did you mean train.max_steps=100?"]


def test_a_missing_config_suggests_the_close_file_in_its_folder(tmp_path: Path):
    (tmp_path / "tiny_shakespeare.yaml").write_text("run: {}\n")
    result = invoke("train", "--config", str(tmp_path / "tinyshakespeare.yaml"))
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {tmp_path / 'tinyshakespeare.yaml'}: config file "
                                   f"not found; did you mean {tmp_path / 'tiny_shakespeare.yaml'}?"]


@pytest.mark.parametrize(("args", "meant"), [
    (["--steps", "100"], "--set train.max_steps=100"),
    (["--steps=100"], "--set train.max_steps=100"),
    (["--max-steps", "5"], "--set train.max_steps=5"),
    (["--batch-size"], "--set train.batch_size=VALUE"),
    (["--seed", "4"], "--set run.seed=4 or --set data.seed=4"),
])
def test_a_config_key_given_as_a_flag_suggests_set(args: list[str], meant: str):
    result = invoke("train", *args)
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: fbtrain train: no such option: {args[0].split('=')[0]}"
                                   f"; did you mean {meant}?"]


def test_a_misspelt_flag_keeps_clicks_suggestion():
    result = invoke("train", "--devic", "cpu")  # a flag's typo: the flag, not run.device
    assert error_lines(result) == ["error: fbtrain train: no such option: --devic (Possible "
                                   "options: --device)"]


def test_help_shows_every_commands_summary_whole():
    """``fbtrain --help`` on an 80-column terminal lists each command's first docstring line
    uncut (click cuts a long one with '...'). Run as a process: click's test runner formats
    help 2 columns wider than a terminal does."""
    shown = subprocess.run([sys.executable, "-m", "fbtrain", "--help"], capture_output=True,
                           text=True, env={**os.environ, "COLUMNS": "80"}, check=True).stdout
    for name, command in app_commands().items():
        summary = command.help.strip().splitlines()[0]
        assert re.search(rf"^  {name} +{re.escape(summary)}$", shown, re.MULTILINE), summary


def app_commands() -> dict[str, Any]:
    import typer.main

    group = typer.main.get_command(app)
    return dict(group.commands)


def test_list_keys_fits_80_columns():
    result = invoke("train", "--list-keys")
    assert result.exit_code == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_print_config_refuses_a_device_that_is_not_there_as_train_does(
        monkeypatch: pytest.MonkeyPatch):
    import torch

    from fbtrain.device import DeviceError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError) as refusal:  # what train's setup says
        resolve_device("cuda")
    result = invoke("train", "--config", TINY, "--device", "cuda", "--print-config")
    assert result.exit_code == 2 and result.stdout == ""
    assert error_lines(result) == [f"error: {refusal.value}"]


# ----------------------------------------------------------------------------- train: dispatch


@pytest.fixture
def fake_train(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, Any] = {}

    def fake_run(cfg, *, resume=None, quiet=False):
        calls.update(cfg=cfg, resume=resume, quiet=quiet)
        if "raise" in calls:
            raise calls["raise"]
        return Path(cfg.run.out_dir) / cfg.run.name

    monkeypatch.setattr(train, "run", fake_run)
    return calls


def test_train_dispatch(fake_train: dict[str, Any]):
    result = invoke("train", "--config", TINY, "--set", "train.max_steps=3",
                    "--resume", "auto", "--device", "cpu", "--quiet")
    assert result.exit_code == 0, result.output
    cfg = fake_train["cfg"]
    assert (cfg.train.max_steps, cfg.run.device, cfg.model.d_model) == (3, "cpu", 16)
    assert fake_train["resume"] == "auto" and fake_train["quiet"] is True


def test_train_dispatch_defaults(fake_train: dict[str, Any]):
    result = invoke("train")
    assert result.exit_code == 0, result.output
    assert fake_train["resume"] is None and fake_train["quiet"] is False
    assert fake_train["cfg"].run.device == "auto"


@pytest.mark.parametrize("code", [1, 130, 143])
def test_training_error_exit_code(fake_train: dict[str, Any], code: int):
    fake_train["raise"] = train.TrainingError(f"stopped at step 5 (code {code})", code)
    result = invoke("train", "--config", TINY)
    assert result.exit_code == code
    assert f"stopped at step 5 (code {code})" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("error", [DataError("input.txt: no such file"),
                                   CheckpointError("x.pt: truncated"),
                                   DeviceError("device 'cuda': CUDA is not available"),
                                   CoreBuildError("could not build fbtrain's C++ core")])
def test_train_user_errors_exit_2(fake_train: dict[str, Any], error: Exception):
    fake_train["raise"] = error
    result = invoke("train", "--config", TINY)
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {error}"]


def test_train_bug_is_not_hidden(fake_train: dict[str, Any]):
    fake_train["raise"] = ValueError("a bug, not bad input")
    result = invoke("train", "--config", TINY)
    assert isinstance(result.exception, ValueError)  # a traceback, not "error: ..." + exit 2


# ----------------------------------------------------------------------------- sample


@pytest.fixture
def fake_sample(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, Any] = {}

    def fake_run(checkpoint, **kwargs):
        calls.update(checkpoint=checkpoint, **kwargs)
        if "raise" in calls:
            raise calls["raise"]
        kwargs["stream"].write("ROMEO: hi\n")
        return ["hi"]

    monkeypatch.setattr(sample, "run", fake_run)
    return calls


def test_sample_dispatch(fake_sample: dict[str, Any]):
    result = invoke("sample", "-c", "runs/x", "--prompt", "ROMEO:", "--length", "9",
                    "--temperature", "0.5", "--top-k", "5", "--top-p", "0.9",
                    "--num-samples", "2", "--seed", "7", "--device", "cpu",
                    "--precision", "bf16")
    assert result.exit_code == 0, result.output
    assert result.stdout == "ROMEO: hi\n"
    assert {k: v for k, v in fake_sample.items() if k != "stream"} == dict(
        checkpoint="runs/x", prompt="ROMEO:", length=9, temperature=0.5, top_k=5, top_p=0.9,
        num_samples=2, seed=7, device="cpu", precision="bf16")


def test_sample_defaults_match_sample_run(fake_sample: dict[str, Any]):
    assert invoke("sample", "--checkpoint", "runs/x").exit_code == 0
    defaults = defaults_of(SAMPLE_RUN)
    assert set(defaults) == set(fake_sample) - {"checkpoint"}
    assert {k: fake_sample[k] for k in defaults if k != "stream"} == {
        k: v for k, v in defaults.items() if k != "stream"}


@pytest.mark.parametrize("error", [ArgumentError("top_p = 0.0: must be in (0, 1] (or unset)"),
                                   DataError("prompt: 1 character(s) not in the vocabulary"),
                                   CheckpointError("runs/x: no such checkpoint"),
                                   DeviceError("device 'cuda:3': only 1 CUDA device(s) here")])
def test_sample_user_errors_exit_2(fake_sample: dict[str, Any], error: Exception):
    fake_sample["raise"] = error
    result = invoke("sample", "--checkpoint", "runs/x")
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {error}"]
    assert result.stdout == ""


def test_sample_interrupt_exits_130(fake_sample: dict[str, Any]):
    fake_sample["raise"] = KeyboardInterrupt()
    result = invoke("sample", "--checkpoint", "runs/x")
    assert result.exit_code == 130
    assert "Traceback" not in result.output


@pytest.mark.parametrize("bug", [RuntimeError("a bug"), ValueError("a bug, not bad input")])
@pytest.mark.parametrize("command", ["sample", "eval"])
def test_sample_and_eval_bugs_are_not_hidden(fake_sample: dict[str, Any],
                                             fake_eval: dict[str, Any], command: str,
                                             bug: Exception):
    """A ValueError is not bad input by its type: only fbtrain's named UserErrors are."""
    (fake_sample if command == "sample" else fake_eval)["raise"] = bug
    result = invoke(command, "--checkpoint", "runs/x")
    assert result.exit_code == 1 and result.exception is bug
    assert "error:" not in result.stderr


@pytest.mark.parametrize("args", [["--length", "0"], ["--num-samples", "0"], ["--top-k", "0"],
                                  ["--temperature", "-1"], ["--seed", "-1"], ["--length", "x"],
                                  ["--seed", "99999999999999999999"], ["--temperature", "inf"],
                                  ["--temperature", "nan"], ["--top-p", "nan"],
                                  ["--top-p", "0"], ["--top-p", "1.5"],
                                  ["--length", str(2**63)], ["--top-k", str(2**64)]])
def test_sample_flag_validation_exits_2(fake_sample: dict[str, Any], args: list[str]):
    result = invoke("sample", "--checkpoint", "runs/x", *args)
    assert result.exit_code == 2
    assert "checkpoint" not in fake_sample  # refused before sample.run
    # One line naming the option, like every other bad input; no usage block.
    assert len(error_lines(result)) == 1, result.stderr
    assert error_lines(result)[0].startswith(f"error: fbtrain sample: invalid value for "
                                             f"'{args[0]}'"), result.stderr
    assert result.stdout == ""


def test_sample_needs_checkpoint():
    result = invoke("sample")
    assert result.exit_code == 2
    assert error_lines(result) == ["error: fbtrain sample: missing option '--checkpoint' / '-c'"]


def test_unknown_option_and_command_are_one_line():
    for args, line in ((["eval", "-c", "x", "--bogus"], "error: fbtrain eval: no such option: "
                                                        "--bogus"),
                       (["bogus"], "error: fbtrain: no such command 'bogus'")):
        result = invoke(*args)
        assert result.exit_code == 2 and error_lines(result) == [line], result.output


# ----------------------------------------------------------------------------- eval

RESULT = {"loss": 1.5, "bpc": 1.5 / 0.6931471805599453, "perplexity": 4.4817, "tokens": 1000,
          "seq_len": 64, "context": "reset", "split": "val",
          "checkpoint": "runs/x/checkpoints/best.pt", "step": 10}


@pytest.fixture
def fake_eval(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, Any] = {}

    def fake_run(checkpoint, **kwargs):
        calls.update(checkpoint=checkpoint, **kwargs)
        if "raise" in calls:
            raise calls["raise"]
        return dict(RESULT)

    monkeypatch.setattr(evaluate, "run", fake_run)
    return calls


def test_eval_json(fake_eval: dict[str, Any]):
    result = invoke("eval", "--checkpoint", "runs/x", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == RESULT
    assert fake_eval == {"checkpoint": "runs/x", **defaults_of(EVAL_RUN)}


def test_eval_table(fake_eval: dict[str, Any]):
    result = invoke("eval", "-c", "runs/x", "--split", "train", "--seq-len", "128",
                    "--batch-size", "8", "--data-path", "t.txt", "--context", "carry",
                    "--device", "cpu", "--precision", "fp16")
    assert result.exit_code == 0, result.output
    assert result.stdout == evaluate.format_result(RESULT) + "\n"
    assert fake_eval == dict(checkpoint="runs/x", split="train", seq_len=128, batch_size=8,
                             data_path="t.txt", context="carry", device="cpu",
                             precision="fp16")


@pytest.mark.parametrize("args", [["--split", "dev"], ["--context", "keep"],
                                  ["--seq-len", "0"], ["--batch-size", "0"],
                                  ["--seq-len", str(2**63)], ["--batch-size", "x"]])
def test_eval_flag_validation_exits_2(fake_eval: dict[str, Any], args: list[str]):
    result = invoke("eval", "--checkpoint", "runs/x", *args)
    assert result.exit_code == 2
    assert "checkpoint" not in fake_eval
    assert len(error_lines(result)) == 1, result.stderr
    assert error_lines(result)[0].startswith(f"error: fbtrain eval: invalid value for "
                                             f"'{args[0]}'"), result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("error", [ArgumentError("seq_len = 0: must be an integer >= 1"),
                                   CheckpointError("runs/x: no checkpoint found"),
                                   DataError("t.txt: no such file")])
def test_eval_user_errors_exit_2(fake_eval: dict[str, Any], error: Exception):
    fake_eval["raise"] = error
    result = invoke("eval", "--checkpoint", "runs/x", "--json")
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: {error}"]
    assert result.stdout == ""


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = ["First Citizen:", "Before we proceed any further, hear me speak.", "",
             "All:", "Speak, speak.", ""]
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("\n".join(lines * 40), encoding="utf-8")
    return path



@pytest.mark.usefixtures("one_thread")
def test_end_to_end(tmp_path: Path, text_file: Path):
    out = tmp_path / "runs"
    result = invoke(
        "train", "--config", TINY, "--device", "cpu", "--quiet",
        "--set", f"data.path={text_file}", "--set", f"run.out_dir={out}",
        "--set", "train.max_steps=4", "--set", "train.eval_every=2",
        "--set", "train.eval_windows=2", "--set", "checkpoint.every=2",
        "--set", "train.batch_size=4", "--set", "curriculum=8",
        "--set", "logging.tensorboard=false",
    )
    assert result.exit_code == 0, result.output
    run_dir = out / "tiny"
    assert (run_dir / "checkpoints" / "last.pt").is_file()

    result = invoke("sample", "--checkpoint", str(run_dir), "--prompt", "All:",
                    "--length", "20", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("All:") and len(result.stdout) == len("All:") + 20 + 1

    result = invoke("eval", "--checkpoint", str(run_dir), "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)
    assert scores["split"] == "val" and scores["seq_len"] == 8 and scores["step"] == 4
    assert 0 < scores["bpc"] < 10 and scores["tokens"] > 0

    # Training into the same run again without --resume is refused, not overwritten.
    result = invoke("train", "--config", TINY, "--set", f"data.path={text_file}",
                    "--set", f"run.out_dir={out}", "--quiet")
    assert result.exit_code == 2
    assert "--resume" in result.stderr

    result = invoke("eval", "--checkpoint", str(tmp_path / "nowhere"))
    assert result.exit_code == 2
    assert error_lines(result) == [
        f"error: {tmp_path / 'nowhere'}: no such checkpoint file or run directory; a run "
        "directory is made by training: `fbtrain train --config FILE` writes runs/<run.name> "
        "(`make train`: runs/tiny_shakespeare)"]
    result = invoke("sample", "--checkpoint", str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


@pytest.mark.parametrize("target", ["train", "quick"])
@pytest.mark.parametrize("data", ["my text.txt", "it's here.txt"])
def test_make_passes_data_as_one_word(tmp_path: Path, target: str, data: str):
    """``make train DATA='my text.txt'`` hands fbtrain the path as one --set value; split at
    the space it was refused as an extra argument ('did you mean --config text.txt?')."""
    import shlex
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make here")
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # newer than pyproject.toml: install has nothing to do
    proc = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}",
                           f"DATA={data}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout.replace("\\\n", " "))
    assert words[-2:] == ["--set", f"data.path={data}"]


@pytest.mark.parametrize("command", [["train"], ["sample", "--checkpoint", "runs/x"],
                                     ["eval", "--checkpoint", "runs/x"]])
def test_an_empty_device_is_refused_not_taken_as_auto(command: list[str]):
    result = invoke(*command, "--device", " ")
    assert result.exit_code == 2
    assert error_lines(result) == [f"error: fbtrain {command[0]}: invalid value for '--device': "
                                   "empty; give auto, cpu, cuda or cuda:N (or leave --device "
                                   "out)"]
