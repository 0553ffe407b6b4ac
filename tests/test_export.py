"""fbtrain export: weights-only safetensors, config.json, vocab.json; sample and eval accept
the exported folder as they accept a run."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_rundir import _Disk
from test_train import make_cfg
from typer.testing import CliRunner

from fbtrain import evaluate, sample
from fbtrain.checkpoint import CheckpointError, load_checkpoint, load_model
from fbtrain.checkpoint.contents import export_model
from fbtrain.checkpoint.export import write_export
from fbtrain.cli import app
from fbtrain.config import ModelConfig
from fbtrain.device import DeviceError
from fbtrain.distributed import session
from fbtrain.models import build_model
from fbtrain.rundir import RunDirectory
from fbtrain.train import run
from fbtrain.train.setup import set_up


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained run (6 steps), shared by the tests of this file."""
    tmp = tmp_path_factory.mktemp("export")
    return run(make_cfg(tmp, train={"max_steps": 6, "eval_every": 3}), quiet=True)


def _sample(source: Path) -> str:
    out = io.StringIO()
    sample.run(str(source), length=40, seed=3, device="cpu", stream=out)
    return out.getvalue()


def test_export_then_sample_and_eval_as_from_the_run(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(trained), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"exported {trained / 'checkpoints' / 'best.pt'}\n  to {out}: " in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "vocab.json"]
    # Weights only: a fraction of best.pt, which carries the optimizer state too.
    assert (out / "model.safetensors").stat().st_size < (
        trained / "checkpoints" / "best.pt").stat().st_size / 2
    # The same text for the same seed, from the run and from the export.
    assert _sample(out) == _sample(trained)
    # Any file of the export names it (config.json or vocab.json is no checkpoint of its own).
    assert _sample(out / "config.json") == _sample(out / "vocab.json") == _sample(trained)
    from_run = evaluate.run(str(trained), device="cpu")
    from_export = evaluate.run(str(out), device="cpu")
    assert from_export["loss"] == from_run["loss"] and from_export["step"] == from_run["step"]
    assert from_export["checkpoint"] == str(out)


def test_export_loads_in_plain_python(trained: Path, tmp_path: Path) -> None:
    """What the docs' example does: safetensors + config.json + vocab.json, no fbtrain
    checkpoint code; the weights are best.pt's, bitwise."""
    from safetensors.torch import load_file

    export_model(trained, tmp_path)
    cfg = ModelConfig(**json.loads((tmp_path / "config.json").read_text()))
    vocab = json.loads((tmp_path / "vocab.json").read_text())["chars"]
    model = build_model(cfg, len(vocab))
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    best = load_checkpoint(trained / "checkpoints" / "best.pt")["model"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, best[name]), name
    loaded, tokenizer, payload = load_model(tmp_path)  # load_model's contract holds
    assert tokenizer.tokens == vocab and "optimizer" not in payload
    assert payload["step"] == load_checkpoint(trained / "checkpoints" / "best.pt")["step"]
    assert not loaded.training


def test_export_errors_are_one_line(trained: Path, tmp_path: Path) -> None:
    target = tmp_path / "a_file"
    target.write_text("x")
    result = CliRunner().invoke(app, ["export", "-c", str(trained), "--out", str(target)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {target}: exists and is not a folder; give a "
                                     "folder to export into")
    with pytest.raises(CheckpointError, match=r"is a run directory \(it has checkpoints/\); "
                                              r"export into a folder of its own"):
        export_model(trained, trained)
    assert not (trained / "model.safetensors").exists()
    folder = tmp_path / "exp"
    export_model(trained, folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"exp: an exported model needs config.json "
                                              r"beside model.safetensors"):
        load_model(folder)
    export_model(trained, folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors"):
        sample.run(str(folder), length=5, device="cpu", stream=io.StringIO())
    export_model(trained, folder)
    (folder / "config.json").write_text(json.dumps({"kind": "feedback_kv", "d_model": 8}))
    with pytest.raises(CheckpointError, match=r"exp: config.json is not the one exported with "
                                              r"model.safetensors \(an export that failed "):
        load_model(folder)
    _drop_file_record(folder)  # as an export made before the record: the shapes still say
    with pytest.raises(CheckpointError, match=r"model.safetensors: weights do not fit "
                                              r"model_config"):
        load_model(folder)


def _drop_file_record(folder: Path) -> None:
    """Rewrite the weights without the sha256 record of the other two files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        metadata = {k: v for k, v in (f.metadata() or {}).items() if k != "fbtrain.files"}
    save_file(tensors, str(folder / "model.safetensors"), metadata)


def test_python_example_of_the_docs(trained: Path, tmp_path: Path) -> None:
    """The docs' Python example, as written there: load, generate, score a text."""
    import math

    from fbtrain.evaluate import mean_loss
    from fbtrain.sample import generate

    export_model(trained, tmp_path / "exported")
    # --- the example
    model, tokenizer, _ = load_model(tmp_path / "exported")  # or a run directory
    text = generate(model, tokenizer, "the ", 50, temperature=0.8,
                    generator=torch.Generator().manual_seed(0))[0]
    ids = tokenizer.encode("the cat sat on the mat")[None]  # [1, T]
    loss = mean_loss(model, ids[:, :-1], ids[:, 1:], batch_size=1)  # nats per character
    bpc = loss / math.log(2)
    # ---
    assert len(text) == 50 and math.isfinite(bpc) and 0 < bpc < 10


# ----------------------------------------------------------------------------- one set


def _other_model(trained: Path) -> tuple[dict[str, torch.Tensor], dict, Any]:
    """Model B: the run's architecture with fresh weights and the vocabulary reversed, so
    B's weights fit A's vocabulary (the same size): a mix would load without a word."""
    from fbtrain.data.tokenizers import make_tokenizer

    payload = load_checkpoint(trained / "checkpoints" / "best.pt")
    tokenizer = make_tokenizer(list(reversed(payload["vocab"])), payload.get("tokenizer"))
    torch.manual_seed(5)
    model = build_model(ModelConfig(**payload["model_config"]), tokenizer.vocab_size)
    return model.state_dict(), payload["model_config"], tokenizer


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_an_export_whose_third_file_fails_is_refused_not_loaded_wrong(
        trained: Path, tmp_path: Path) -> None:
    """The reported case: vocab.json made immutable (chattr +i) under export A, then B
    exported over it: B's weights and config sat with A's vocabulary and sampled garbage."""
    mix = tmp_path / "mix"
    export_model(trained, mix)
    vocab = mix / "vocab.json"
    if subprocess.run(["chattr", "+i", str(vocab)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i does not work here")
    try:
        state, model_config, tokenizer = _other_model(trained)
        with pytest.raises(CheckpointError, match=(
                rf"^{vocab}: cannot replace it \(operation not permitted\); {mix} now holds the "
                r"new model.safetensors and config.json beside an older vocab.json, a set "
                r"that sample and eval refuse: export again once vocab.json can be written$")):
            write_export(mix, state, model_config, tokenizer)
        for command in (["sample", "-c", str(mix), "-n", "5"], ["eval", "-c", str(mix)]):
            result = _cli(*command)
            assert result.exit_code == 2, result.output
            assert result.stderr.splitlines() == [
                f"error: {mix}: vocab.json is not the one exported with model.safetensors (an "
                "export that failed part-way, or files mixed by hand); export into it again"]
        assert not [p for p in mix.iterdir() if p.name.endswith(".tmp")]
    finally:
        subprocess.run(["chattr", "-i", str(vocab)], check=True)


def test_a_full_disk_during_an_export_leaves_the_previous_one(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fbtrain.io as fbio

    mix = tmp_path / "mix"
    export_model(trained, mix)
    before = {p.name: p.read_bytes() for p in mix.iterdir()}
    state, model_config, tokenizer = _other_model(trained)
    write_export(tmp_path / "scratch", state, model_config, tokenizer)
    weights = (tmp_path / "scratch" / "model.safetensors").stat().st_size
    monkeypatch.setattr(fbio.os, "fdopen", _Disk(free=weights + 10).fdopen)  # room for those
    with pytest.raises(OSError, match=rf"^{mix / 'config.json'}: cannot write: the disk is full"):
        write_export(mix, state, model_config, tokenizer)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in mix.iterdir()} == before
    assert _sample(mix) == _sample(trained)


def test_temp_files_of_a_killed_export_go_at_the_next(trained: Path, tmp_path: Path) -> None:
    """SIGTERM or kill -9 mid-export leaves .model.safetensors.XXXXXXXX.tmp (114 MB for a
    28.5M-parameter model); the next export into the folder removes those, and only those."""
    mix = tmp_path / "mix"
    mix.mkdir()
    ours = [mix / ".model.safetensors.k1lled00.tmp", mix / ".vocab.json.a1B2c3_d.tmp"]
    theirs = [mix / ".notes.txt.abcdefgh.tmp", mix / "model.safetensors.tmp", mix / "README"]
    for p in ours + theirs:
        p.write_bytes(b"x" * 100)
    export_model(trained, mix)
    assert not [p for p in ours if p.exists()] and all(p.exists() for p in theirs)


def test_files_mixed_by_hand_or_missing_are_refused_in_one_line(
        trained: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    export_model(trained, a)
    write_export(b, *_other_model(trained))
    (a / "vocab.json").write_bytes((b / "vocab.json").read_bytes())
    result = _cli("eval", "-c", str(a))
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: {a}: vocab.json is not the one exported with model.safetensors (an export "
        "that failed part-way, or files mixed by hand); export into it again"]
    (b / "model.safetensors").unlink()
    result = _cli("sample", "-c", str(b))
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: {b}: an exported model needs model.safetensors beside config.json and "
        "vocab.json (fbtrain export writes all three; did one fail part-way?)"]


# ----------------------------------------------------------------------------- weights only


def _exported(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ex"
    export_model(trained, out)
    return out


def test_a_run_directory_holding_an_export_is_read_as_the_run(trained: Path,
                                                              tmp_path: Path) -> None:
    """model.safetensors (and config.json, vocab.json) copied into a run directory beside
    checkpoints/: sample and eval said an exported model needs config.json (or read the
    export), instead of using the run's best.pt."""
    out = _exported(trained, tmp_path)
    mixed = tmp_path / "mixed"
    shutil.copytree(trained, mixed)
    from_run = _sample(trained)
    for name in ("model.safetensors", "config.json"):  # the weights alone, then with config
        shutil.copy(out / name, mixed / name)
        result = evaluate.run(str(mixed), device="cpu")
        assert result["checkpoint"] == str(mixed / "checkpoints" / "best.pt")
        assert _sample(mixed) == from_run


def test_an_export_is_taken_as_the_weights_it_holds(trained: Path, tmp_path: Path) -> None:
    """Its weights file given for the folder (-c ex/model.safetensors) was "not an fbtrain
    checkpoint (no 'format' key)"."""
    out = _exported(trained, tmp_path)
    assert _sample(out / "model.safetensors") == _sample(out)
    assert evaluate.run(str(out / "model.safetensors"), device="cpu")["checkpoint"] == str(out)


@pytest.mark.parametrize("given", ["folder", "weights file"])
def test_an_export_as_init_from_warm_starts_from_its_weights(
        trained: Path, tmp_path: Path, given: str) -> None:
    """train.init_from=<export> said "no checkpoint found (looked for .../best.pt,
    .../last.pt)": a warm start needs only the weights, which an export holds."""
    out = _exported(trained, tmp_path)
    source = out if given == "folder" else out / "model.safetensors"
    cfg = make_cfg(tmp_path, "warm", train={"max_steps": 1, "init_from": str(source)})
    with session("cpu") as ctx:  # the run as set up, before its first step
        built, _, _ = set_up(cfg, ctx, RunDirectory(tmp_path / "runs" / "warm", 2), None)
    assert built.warm_report is not None and not built.warm_report.fresh
    weights, exported = built.raw_model.state_dict(), load_model(out)[0].state_dict()
    assert weights.keys() == exported.keys()
    assert all(torch.equal(weights[name], exported[name]) for name in exported)
    assert run(cfg, quiet=True).is_dir()  # and it trains


def test_an_export_as_resume_is_named_as_weights_alone(trained: Path, tmp_path: Path) -> None:
    """--resume <export> said "no checkpoint found (looked for .../last.pt)", with no word
    that an export holds weights only, or that init_from could take them."""
    out = _exported(trained, tmp_path)
    cfg = make_cfg(tmp_path, "again", train={"max_steps": 8})
    for source in (out, out / "model.safetensors"):
        with pytest.raises(CheckpointError) as info:
            run(cfg, resume=str(source), quiet=True)
        assert str(info.value) == (
            f"--resume {source}: an exported model holds the weights alone (no optimizer "
            "state, step or random streams), which a resume needs; to train on from its "
            f"weights, start a run with --set train.init_from={source}")
    assert not (tmp_path / "runs" / "again").exists()


def test_init_from_weights_that_hold_nan_is_refused_by_name(trained: Path,
                                                           tmp_path: Path) -> None:
    """They were loaded and training failed at step 1 ("loss is nan ... try a lower
    train.lr"), where sample, eval, export and resume refuse the same file by name."""
    payload = load_checkpoint(trained / "checkpoints" / "best.pt")
    payload["model"]["head.bias"][0] = float("nan")
    damaged = tmp_path / "nan.pt"
    torch.save(payload, damaged)
    cfg = make_cfg(tmp_path, "warm", train={"max_steps": 1, "init_from": str(damaged)})
    with pytest.raises(CheckpointError) as info:
        run(cfg, quiet=True)
    assert str(info.value) == (f"{damaged}: train.init_from's weights hold NaN or inf (in "
                               "head.bias); the checkpoint is damaged or its training diverged")


def test_an_empty_out_is_refused_not_the_current_folder(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out ""`` (an unset shell variable) is refused: Path("") is the current folder,
    whose own config.json the export would replace."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text('{"a project": "file"}')
    result = CliRunner().invoke(app, ["export", "-c", str(trained), "--out", ""])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == "error: --out '': empty; give the folder to export into\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert (tmp_path / "config.json").read_text() == '{"a project": "file"}'


def test_eval_of_an_export_checks_the_data_as_of_the_run(tmp_path: Path) -> None:
    """An export carries the sha256 of the splits its run trained on, so eval of the export
    refuses a data.path that now holds other text (an edited file; a relative path read from
    another folder), as eval of the run does, instead of scoring it as the run's split."""
    from fbtrain.data.errors import DataError

    trained_here = run(make_cfg(tmp_path, train={"max_steps": 1, "eval_every": 1}), quiet=True)
    out = tmp_path / "exported"
    export_model(trained_here, out)
    again = tmp_path / "again"
    export_model(out, again)  # an export of an export keeps it too
    before = [evaluate.run(str(p), device="cpu")["loss"] for p in (trained_here, out, again)]
    assert before[0] == before[1] == before[2]
    text = tmp_path / "text.txt"
    text.write_text(text.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    for source in (trained_here, out, again):
        with pytest.raises(DataError, match=r"holds other text than checkpoint .* was trained "
                                            r"on \(the sha256 of its val split differs"):
            evaluate.run(str(source), device="cpu")
    assert evaluate.run(str(out), data_path=str(text), device="cpu")["loss"] != before[1]


def test_load_model_names_a_device_this_machine_lacks(trained: Path) -> None:
    """From Python as from the commands: "cuda" without CUDA is one line, "auto" a device."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="device 'cuda': CUDA is not available"):
        load_model(trained, device="cuda")
    model, _, _ = load_model(trained, device="auto")
    assert next(model.parameters()).device.type == "cpu"
