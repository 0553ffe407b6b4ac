"""Checkpoints: round trip, refusal of bad files, atomicity, purge, lookup, RNG state."""

from __future__ import annotations

import io
import pickle
import random
import re
from pathlib import Path

import pytest
import torch

from fbtrain import checkpoint as ck
from fbtrain.checkpoint import (
    FORMAT,
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from fbtrain.checkpoint import files as ck_files
from fbtrain.checkpoint.best import heal_best
from fbtrain.checkpoint.files import atomic_copy
from fbtrain.data.errors import DataError
from fbtrain.data.samplers import BatchSampler
from fbtrain.rng import RngStateError, capture_rng, restore_rng
from fbtrain.rundir import RunDirectory


def _live_run(tmp_path: Path, steps: int = 0, **sections):
    """The run a trainer sets up (fresh, untrained) and its progress, from test_train's tiny
    config; ``steps`` > 0 trains that many steps first (the run is then set up resumed)."""
    from test_train import make_cfg

    from fbtrain.distributed import DistContext
    from fbtrain.train import run
    from fbtrain.train.setup import set_up

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = make_cfg(tmp_path, train={"max_steps": max(steps, 1)}, **sections)
    resume = None
    if steps:
        run(cfg, quiet=True)
        resume = "auto"
    directory = RunDirectory(Path(cfg.run.out_dir) / cfg.run.name, 1)
    return set_up(cfg, DistContext(device=torch.device("cpu")), directory, resume)[:2]


@pytest.fixture(scope="module")
def training_state(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A checkpoint's contents as the trainer makes them (one trained step, so AdamW's
    moments exist)."""
    from fbtrain.train.setup import checkpoint_payload

    return checkpoint_payload(*_live_run(tmp_path_factory.mktemp("state"), steps=1))


def _assert_same(a, b) -> None:
    """Deep equality that understands tensors."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


# ----------------------------------------------------------------------------- save / load


def test_round_trip_full_training_state(tmp_path: Path, training_state: dict) -> None:
    payload = training_state
    path = tmp_path / "ck.pt"
    save_checkpoint(path, payload)
    assert "format" not in payload  # the caller's dict is left alone
    loaded = load_checkpoint(path)
    assert loaded.pop("format") == FORMAT
    _assert_same(payload, loaded)
    # The states load back into the parts of a fresh run, through the real restore.
    from fbtrain.train.setup import state_parts

    run, progress = _live_run(tmp_path / "fresh")
    ck.restore_checkpoint(path, loaded, state_parts(run, progress), run.cfg.model)
    assert progress.step == 1 and progress.tokens == payload["progress"]["tokens"]
    _assert_same(run.raw_model.state_dict(), payload["model"])
    _assert_same(run.optimizer.state_dict(), payload["optimizer"])
    _assert_same(run.sampler.state_dict(), payload["sampler"])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope\.pt: checkpoint file not found"):
        load_checkpoint(tmp_path / "nope.pt")


@pytest.mark.parametrize("keep", [0.5, 0.1, 0.99])
def test_truncated_file(tmp_path: Path, keep: float, training_state: dict) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(path, training_state)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"last\.pt: checkpoint file is truncated or corrupt"):
        load_checkpoint(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"last\.pt: checkpoint file is empty"):
        load_checkpoint(path)


@pytest.mark.parametrize("content", [b"hello, I am a text file\n", pickle.dumps({"a": 1})])
def test_not_a_torch_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "notes.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"notes\.pt: not a PyTorch checkpoint file"):
        load_checkpoint(path)


def test_torch_file_without_marker(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, path)
    with pytest.raises(CheckpointError,
                       match=r"plain\.pt: not an fbtrain checkpoint \(no 'format' key\)"):
        load_checkpoint(path)


def test_torch_file_holding_a_tensor(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save(torch.zeros(2), path)
    with pytest.raises(CheckpointError, match=r"not an fbtrain checkpoint \(holds a Tensor"):
        load_checkpoint(path)


def test_wrong_format_version(tmp_path: Path) -> None:
    path = tmp_path / "v0.pt"
    torch.save({"format": "fbtrain-checkpoint-v0"}, path)
    with pytest.raises(CheckpointError, match=r"unsupported checkpoint format"):
        load_checkpoint(path)


class _Arbitrary:
    """A class the weights_only unpickler must refuse to rebuild."""


def test_refuses_arbitrary_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "obj": _Arbitrary()}, path)
    with pytest.raises(CheckpointError,
                       match=r"evil\.pt: refusing to load: it holds a .*_Arbitrary object"):
        load_checkpoint(path)


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"is a directory"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- atomicity


def test_failed_save_keeps_previous_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=3)
    mgr.save(1, {"step": 1, "w": torch.arange(10)})
    real_save = torch.save

    def half_then_crash(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        f.write(buf.getvalue()[: buf.tell() // 2])  # some bytes reach the temp file...
        raise OSError("disk full")  # ...then the write dies

    monkeypatch.setattr(ck_files.torch, "save", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        mgr.save(2, {"step": 2, "w": torch.arange(20)}, best=True)
    monkeypatch.undo()

    assert load_checkpoint(mgr.last_path)["step"] == 1
    assert [p.name for p in mgr.numbered()] == ["step-00000001.pt"]
    assert not mgr.best_path.exists()
    leftovers = [p.name for p in mgr.dir.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_failed_copy_keeps_previous_best(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=3)
    mgr.save(1, {"step": 1}, best=True)

    def crash(src, dst, length=0):
        dst.write(src.read(10))
        raise OSError("copy interrupted")

    monkeypatch.setattr(ck_files.shutil, "copyfileobj", crash)
    with pytest.raises(OSError, match="copy interrupted"):
        mgr.save(2, {"step": 2}, best=True)
    monkeypatch.undo()
    assert load_checkpoint(mgr.best_path)["step"] == 1
    assert not any(p.name.endswith(".tmp") for p in mgr.dir.iterdir())


def _evaluated(step: int, val_loss: float, best: float) -> dict:
    """A checkpoint saved right after the evaluation of its own step (loss ``val_loss``,
    the best so far then ``best``)."""
    return {"step": step, "progress": {"step": step, "tokens": 0, "val_loss": val_loss,
                                       "best_val_loss": best, "val_step": step}}


RECORDED = "the best validation loss the run recorded (3.5000)"


def test_a_stale_best_pt_is_put_right_from_the_checkpoint_that_scored_the_best(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """best.pt's copy failed at step 20 (a full disk), the step that scored the best: a
    resume reported best 3.5 while best.pt kept step 10's weights for good."""
    mgr = CheckpointManager(tmp_path / "run", keep_last=5)
    mgr.save(10, _evaluated(10, 3.7, 3.7), best=True)
    monkeypatch.setattr(ck_files, "atomic_copy", lambda src, dst: None if dst.name == "best.pt"
                        else atomic_copy(src, dst))
    mgr.save(20, _evaluated(20, 3.5, 3.5), best=True)  # best.pt not written
    monkeypatch.undo()
    mgr.save(30, _evaluated(30, 3.6, 3.5))
    assert heal_best(mgr, 3.5) == ("best.pt held step 10 (val loss 3.7000): it is now a copy "
                                   f"of step-00000020.pt (step 20), which scored {RECORDED}")
    assert mgr.best_path.read_bytes() == mgr.step_path(20).read_bytes()
    assert heal_best(mgr, 3.5) is None  # right now: nothing to say, nothing written
    assert heal_best(mgr, None) is None  # no evaluation recorded yet


def test_best_pt_missing_is_copied_from_last_pt_or_named_when_not_kept(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(20, _evaluated(20, 3.5, 3.5), numbered=False)
    assert heal_best(mgr, 3.5) == ("best.pt was missing: it is now a copy of last.pt (step "
                                   f"20), which scored {RECORDED}")
    assert load_checkpoint(mgr.best_path)["step"] == 20
    mgr.best_path.unlink()
    mgr.save(30, _evaluated(30, 3.6, 3.5))  # keep_last=1: no checkpoint of step 20 is left
    assert heal_best(mgr, 3.5) == (
        f"best.pt is missing, not the checkpoint of {RECORDED}, which was not kept (a save "
        "that failed); the next evaluation that beats it replaces best.pt")
    assert not mgr.best_path.exists()


# ----------------------------------------------------------------------------- manager


def test_manager_writes_last_best_numbered(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=2)
    assert mgr.dir == tmp_path / "run" / "checkpoints"
    written = mgr.save(7, {"step": 7}, best=True)
    assert written == mgr.dir / "step-00000007.pt"
    for p in (mgr.last_path, mgr.best_path, written):
        assert load_checkpoint(p)["step"] == 7
    assert mgr.save(8, {"step": 8}, numbered=False) == mgr.last_path
    assert load_checkpoint(mgr.last_path)["step"] == 8
    assert load_checkpoint(mgr.best_path)["step"] == 7
    assert [p.name for p in mgr.numbered()] == ["step-00000007.pt"]


def test_keep_last_purges_oldest_numbered(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=3)
    # Steps whose string order differs from numeric order would break a name sort w/o padding.
    for step in (5, 10, 50, 100, 1000, 20000):
        mgr.save(step, {"step": step}, best=step == 10)
    assert [p.name for p in mgr.numbered()] == [
        "step-00000100.pt", "step-00001000.pt", "step-00020000.pt"]
    assert load_checkpoint(mgr.last_path)["step"] == 20000
    assert load_checkpoint(mgr.best_path)["step"] == 10
    names = sorted(p.name for p in mgr.dir.iterdir())
    assert names == ["best.pt", "last.pt", "step-00000100.pt", "step-00001000.pt",
                     "step-00020000.pt"]


def test_purge_never_deletes_the_file_just_written(tmp_path: Path) -> None:
    # Resumed from step 100 while stale snapshots of steps 200 and 300 remain.
    mgr = CheckpointManager(tmp_path / "run", keep_last=2)
    for step in (100, 200, 300):
        mgr.save(step, {"step": step})
    written = mgr.save(150, {"step": 150})
    assert written.exists()
    assert load_checkpoint(mgr.last_path)["step"] == 150


def test_manager_numbered_empty_before_first_save(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "run", keep_last=1).numbered() == []


# ----------------------------------------------------------------------------- lookup


def test_resolve_file_and_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "x"
    mgr = CheckpointManager(run, keep_last=2)
    mgr.save(1, {"step": 1})
    # No best.pt yet: both preferences fall to last.pt.
    assert resolve_checkpoint(run) == mgr.last_path
    assert resolve_checkpoint(str(run)) == mgr.last_path
    assert resolve_checkpoint(mgr.dir) == mgr.last_path
    mgr.save(2, {"step": 2}, best=True)
    assert resolve_checkpoint(run) == mgr.best_path
    assert resolve_checkpoint(mgr.dir, prefer="best") == mgr.best_path
    assert resolve_checkpoint(run, prefer="last") == mgr.last_path
    numbered = mgr.numbered()[0]
    assert resolve_checkpoint(numbered) == numbered


def test_resolve_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no such checkpoint file or run directory; "
                       r"a run directory is made by training: `fbtrain train --config FILE`"):
        resolve_checkpoint(tmp_path / "runs" / "ghost")
    empty = tmp_path / "runs" / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError,
                       match=r"no checkpoint found \(looked for .*best\.pt, .*last\.pt\)"):
        resolve_checkpoint(empty)
    # A run that saved nothing yet, its checkpoints/ not even made: named where they go.
    bare = tmp_path / "runs" / "bare"
    bare.mkdir()
    looked = f"{bare / 'checkpoints' / 'best.pt'}, {bare / 'checkpoints' / 'last.pt'}"
    with pytest.raises(CheckpointError, match=rf"\(looked for {re.escape(looked)}\)"):
        resolve_checkpoint(bare)
    # A misspelt run: the runs beside it are named.
    with pytest.raises(CheckpointError, match=(
            rf"{re.escape(str(tmp_path / 'runs'))} holds {re.escape(str(empty))}\)")):
        resolve_checkpoint(tmp_path / "runs" / "emtpy")
    with pytest.raises(CheckpointError, match=r"looked for .*last\.pt\)"):
        resolve_checkpoint(empty, prefer="last")
    with pytest.raises(ValueError, match="prefer"):
        resolve_checkpoint(empty, prefer="newest")


def test_resolve_a_folder_of_runs_lists_them(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for name in ("b", "a"):
        CheckpointManager(runs / name, keep_last=1).save(1, {"step": 1})
    (runs / "not-a-run").mkdir()
    with pytest.raises(CheckpointError, match=(
            rf"^{re.escape(str(runs))}: a folder of runs, not a run; give one of them: "
            rf"{re.escape(str(runs / 'a'))}, {re.escape(str(runs / 'b'))}$")):
        resolve_checkpoint(runs)


def test_a_config_given_as_a_checkpoint_is_named_a_config(tmp_path: Path) -> None:
    """``--checkpoint configs/tiny.yaml`` (or a run's config.yaml): it says what the file
    is and what to do with it, not "not a PyTorch checkpoint file"."""
    CheckpointManager(tmp_path / "run", keep_last=1).save(1, {"step": 1})
    for config, run in ((tmp_path / "tiny.yaml", None),
                        (tmp_path / "run" / "config.yaml", tmp_path / "run")):
        config.write_text("run:\n  name: tiny\n")
        hint = f"; its run's model: --checkpoint {run}" if run else ""
        with pytest.raises(CheckpointError, match=(
                rf"^{re.escape(str(config))}: this looks like a config, not a checkpoint: "
                rf"train with it by `fbtrain train --config {re.escape(str(config))}`"
                rf"{re.escape(hint)}$")):
            load_checkpoint(config)


# ----------------------------------------------------------------------------- RNG


def _draws() -> list:
    return [
        [random.random() for _ in range(3)],
        random.gauss(0, 1),  # leaves a cached gauss_next in Python's state
        torch.rand(4).tolist(),
        torch.randint(0, 1000, (3,)).tolist(),
    ]


def test_every_stream_has_its_own_named_derivation() -> None:
    """No stream is a seed plus a step or rank: seed 7 at step 2 is not seed 8 at step 1
    (the pattern the logged samples used), and no two streams share a seed."""
    from fbtrain import rng

    assert rng.sample_seed(7, 2) != rng.sample_seed(8, 1)
    assert rng.rank_seed(7, 1) != rng.rank_seed(8, 0)
    assert rng.sampler_seed(7, 1) != rng.sampler_seed(8, 0)
    seeds = {rng.sample_seed(7, 0), rng.rank_seed(7, 0), rng.sampler_seed(7, 0),
             rng.dataset_seed(7, "0")}
    assert len(seeds) == 4


def test_capture_restore_rng_reproduces_draws() -> None:
    random.seed(1)
    torch.manual_seed(1)
    random.gauss(0, 1)  # start from a state with gauss_next set
    state = capture_rng()
    first = _draws()
    _draws()  # move everything on
    restore_rng(state)
    assert _draws() == first


def test_rng_state_survives_weights_only_load(tmp_path: Path) -> None:
    """The point of the conversion: the saved RNG dict must pass the safe unpickler."""
    random.gauss(0, 1)
    state = capture_rng()
    path = tmp_path / "rng.pt"
    torch.save({"rng": state}, path)  # plain torch.save/torch.load, no fbtrain in between
    loaded = torch.load(path, weights_only=True)["rng"]
    _assert_same(state, loaded)
    first = _draws()
    restore_rng(loaded)
    assert _draws() == first
    if torch.cuda.is_available():
        assert len(loaded["cuda"]) == torch.cuda.device_count()


def test_rng_round_trip_through_checkpoint(tmp_path: Path) -> None:
    state = capture_rng()
    expected = _draws()
    save_checkpoint(tmp_path / "c.pt", {"rng": state})
    restore_rng(load_checkpoint(tmp_path / "c.pt")["rng"])
    assert _draws() == expected


class _Payload:
    """A __reduce__ payload: unpickling it would call os.system."""

    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_refuses_reduce_payloads_in_the_same_words(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "obj": _Payload()}, path)
    with pytest.raises(CheckpointError, match=r"evil\.pt: refusing to load: it holds a "
                       r"posix\.system object, and unpickling anything but tensors and plain "
                       r"containers could run code$"):
        load_checkpoint(path)


# ----------------------------------------------------------------------------- damaged RNG


def _valid_rng() -> dict:
    return capture_rng()


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda r: r.update(python=5), r"rng\.python: is an int, not a dict"),
        (lambda r: r["python"].pop("internal"), r"rng\.python: missing internal"),
        (lambda r: r["python"].update(internal=r["python"]["internal"][:10]),
         r"rng\.python: state vector is the wrong size"),
        (lambda r: r["python"].update(gauss_next="g"),
         r"rng\.python: gauss_next is 'g', not a float or None"),
        (lambda r: r["python"].update(internal=torch.zeros(625)),
         r"rng\.python: internal is a torch\.float32 tensor"),
        (lambda r: r.update(torch=[1, 2, 3]), r"rng\.torch: is a list, not a generator state"),
        (lambda r: r.update(torch=r["torch"][:100]), r"rng\.torch: not a generator state"),
        (lambda r: r.update(cuda="no"), r"rng\.cuda: not a list of uint8 tensors"),
    ],
)
def test_restore_rng_refuses_malformed_state_and_changes_nothing(damage, match: str) -> None:
    rng = _valid_rng()
    damage(rng)
    random.seed(5)
    torch.manual_seed(5)
    expected = _draws()
    random.seed(5)
    torch.manual_seed(5)
    with pytest.raises(RngStateError, match=rf"^ck\.pt: malformed RNG state: {match}") as e:
        restore_rng(rng, path="ck.pt")
    assert "\n" not in str(e.value)
    assert _draws() == expected  # checked whole first: no generator was half restored


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda s: s.pop("generator"), r"not a dict holding the batch sampler's 'generator'"),
        (lambda s: s.update(generator=s["generator"][:-8]), r"generator: not a generator state"),
        (lambda s: s.update(generator=torch.zeros(5056)),
         r"generator: is a torch\.float32 tensor"),
        (lambda s: s.update(seed="7"), r"seed is '7', not an integer"),
    ],
)
def test_the_sampler_checks_its_own_state(damage, match: str) -> None:
    """The batch sampler owns its state's layout: rng.py knows nothing of it."""
    sampler = BatchSampler(torch.arange(100), seed=7)
    state = sampler.state_dict()
    assert BatchSampler.state_problem(state) == ""
    damage(state)
    assert re.fullmatch(match + ".*", BatchSampler.state_problem(state))
    before = sampler.generator.get_state()
    with pytest.raises(DataError, match=rf"^batch sampler state is corrupt: {match}"):
        sampler.load_state_dict(state)
    assert torch.equal(sampler.generator.get_state(), before)


def test_restore_rng_without_path_still_one_line() -> None:
    with pytest.raises(RngStateError, match=r"^malformed RNG state: rng is a list"):
        restore_rng([1, 2])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- resume check


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A real trainer checkpoint (3 steps of a d=16 model, about a second) and its config."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import make_cfg

    from fbtrain.train import run

    tmp = tmp_path_factory.mktemp("resume")
    cfg = make_cfg(tmp, train={"max_steps": 3})
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(cfg, quiet=True)
    finally:
        torch.set_num_threads(before)
    return tmp / "runs" / "run" / "checkpoints" / "last.pt", cfg


def _fresh(path: Path, cfg):
    """A freshly set-up run of ``cfg`` (elsewhere than ``path``'s run) and its progress: the
    parts a resume of ``path`` restores."""
    from fbtrain.distributed import DistContext
    from fbtrain.train.setup import set_up

    directory = RunDirectory(path.parent.parent.parent / "elsewhere", 1)
    return set_up(cfg, DistContext(device=torch.device("cpu")), directory, None)[:2]


def test_a_trainer_checkpoint_resumes_through_its_parts(trained) -> None:
    from fbtrain.train.setup import restore

    path, cfg = trained
    payload = load_checkpoint(path)
    run, progress = _fresh(path, cfg)
    restore(run, progress, payload, path)
    assert progress.step == 3
    _assert_same(run.raw_model.state_dict(), payload["model"])


def _poison(payload: dict) -> None:
    payload["model"]["embed.weight"][0, 0] = float("nan")


def _both_steps(payload: dict, value: object) -> None:
    payload["step"] = payload["progress"]["step"] = value


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: p.pop("rng"), r"rng: missing"),
        (lambda p: p.pop("progress"), r"progress: missing"),
        (lambda p: p.pop("sampler"), r"sampler: missing"),
        (lambda p: p.update(step=-1), r"step is -1 but progress\.step is 3"),
        (lambda p: _both_steps(p, "abc"), r"progress: step is 'abc', not an integer >= 0"),
        (lambda p: _both_steps(p, True), r"progress: step is True, not an integer >= 0"),
        (lambda p: p["progress"].update(tokens=1.5), r"progress: tokens is 1\.5, not an integer"),
        (lambda p: p["progress"].update(best_val_loss="low"),
         r"progress: best_val_loss is 'low', not a number"),
        (lambda p: p.update(model=[1]), r"model: not a state dict"),
        (_poison, r"model: the weights hold NaN or inf \(in embed\.weight\)"),
        (lambda p: p["model"].pop("head.bias"),
         r"model: the weights do not fit the model: missing head\.bias"),
        (lambda p: p.update(model_config="tiny"), r"model_config: is a str, not a dict"),
        (lambda p: p.update(optimizer=[1, 2]), r"optimizer: is a list, not a dict"),
        (lambda p: p["optimizer"].pop("param_groups"), r"optimizer: not an optimizer state"),
        (lambda p: p["optimizer"]["param_groups"][0]["params"].pop(),
         r"optimizer: parameter groups of \[\d+, \d+\] parameters, but the model's are"),
        (lambda p: p.update(rng={"python": 5}), r"rng: malformed RNG state: rng\.python: is an"),
        (lambda p: p["rng"].pop("torch"), r"rng: malformed RNG state: rng lacks torch"),
        (lambda p: p["rng"]["python"].pop("gauss_next"),
         r"rng: malformed RNG state: rng\.python: missing gauss_next"),
        (lambda p: p["sampler"].update(generator=torch.zeros(3, dtype=torch.uint8)),
         r"sampler: generator: not a generator state"),
    ],
)
def test_a_damaged_checkpoint_is_refused_and_nothing_restored(trained, damage, match) -> None:
    from fbtrain.train.setup import restore

    path, cfg = trained
    payload = load_checkpoint(path)
    damage(payload)
    run, progress = _fresh(path, cfg)
    before = {k: v.clone() for k, v in run.raw_model.state_dict().items()}
    rng_before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=rf"^{path}: cannot resume from it: {match}") as e:
        restore(run, progress, payload, path)
    assert "\n" not in str(e.value)
    # Every part checked before any is loaded: nothing of the damaged checkpoint got in.
    _assert_same(run.raw_model.state_dict(), before)
    assert progress.step == 0 and torch.equal(torch.get_rng_state(), rng_before)


def test_moments_of_the_wrong_shape_are_refused(trained) -> None:
    """load_state_dict does not compare shapes: the first step would fail mid-update."""
    from fbtrain.train.setup import restore

    path, cfg = trained
    payload = load_checkpoint(path)
    moments = next(s for s in payload["optimizer"]["state"].values() if "exp_avg" in s)
    moments["exp_avg"] = moments["exp_avg"].flatten()[:3]
    run, progress = _fresh(path, cfg)
    with pytest.raises(CheckpointError, match=r"cannot resume from it: optimizer: state "
                                              r"exp_avg of parameter \d+ has shape \(3,\)"):
        restore(run, progress, payload, path)


# ----------------------------------------------------------------------------- non-finite


def test_load_model_refuses_nonfinite_weights(tmp_path: Path) -> None:
    from test_sample import tiny_model, write_run

    ckpt = write_run(tmp_path / "run", tiny_model())
    payload = load_checkpoint(ckpt)
    payload["model"]["head.bias"][1] = float("inf")
    payload["model"]["embed.weight"][0, 0] = float("nan")
    save_checkpoint(ckpt, payload)
    with pytest.raises(CheckpointError, match=rf"^{ckpt}: the weights hold NaN or inf \(in "
                                              r"embed\.weight, head\.bias\); the checkpoint is "
                                              r"damaged or its training diverged$"):
        ck.load_model(ckpt)


def test_a_v1_checkpoint_is_upgraded_to_the_layout_of_parts() -> None:
    """Format v1 (tests/fixtures, written before the parts owned their state): progress at
    the top level, the sampler inside rng, and two entries nothing read."""
    path = Path(__file__).parent / "fixtures" / "legacy-v1-carry.pt"
    old = load_checkpoint(path)
    assert old["format"] == "fbtrain-checkpoint-v1" and "sampler" in old["rng"]
    new = ck.read_checkpoint(path)
    assert new["format"] == FORMAT
    assert new["progress"] == {"step": 2, "tokens": old["tokens"], "val_loss": old["val_loss"],
                               "best_val_loss": old["best_val_loss"]}
    _assert_same(new["sampler"], old["rng"]["sampler"])
    assert set(new["rng"]) == {"python", "torch"}
    assert not {"scheduler", "curriculum_stage", "tokens", "val_loss"} & set(new)
    _assert_same(new["streams"], old["streams"])
    assert ck.upgrade(new) is new  # today's layout passes through


def test_a_v1_checkpoint_is_checked_on_its_data_settings_but_the_path() -> None:
    """v1 saved no digest of its splits: its data.* settings are compared, but for the path
    (a moved file and another one look alike without a digest)."""
    from fbtrain.config import DataConfig
    from fbtrain.data.identity import DataIdentity
    from fbtrain.data.streams import next_token_stream

    saved = ck.read_checkpoint(Path(__file__).parent / "fixtures" / "legacy-v1-reset.pt")["data"]
    settings = saved["settings"]
    assert "sha256" not in saved and "cache_dir" not in settings
    splits = {"train": next_token_stream(torch.arange(20)), "val": next_token_stream(
        torch.arange(5))}

    def identity(**change) -> DataIdentity:
        return DataIdentity(DataConfig(**{**settings, "path": "/moved.txt", **change}), splits)

    assert identity().state_problem(saved) == ""
    assert identity(val_fraction=0.5).state_problem(saved).startswith(
        f"data.val_fraction is 0.5, but the checkpoint was trained with "
        f"{settings['val_fraction']!r}; its validation loss")
    today = identity().state_dict()
    assert identity().state_problem(today) == ""
    assert identity(path="/other.txt").state_problem(today) == ""  # the same splits
