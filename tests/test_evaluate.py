"""Evaluation: every character scored once, losses checked by hand, reset vs carry, errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from test_sample import KINDS, VOCAB, one_thread, tiny_model, write_run  # noqa: F401

from fbtrain import evaluate
from fbtrain.checkpoint import CheckpointError
from fbtrain.data.errors import DataError
from fbtrain.data.streams import split
from fbtrain.data.tokenizers import CharTokenizer
from fbtrain.errors import ArgumentError
from fbtrain.evaluate import evaluate_split, format_result, mean_loss
from fbtrain.io import json_safe


def make_text(n: int = 700, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(VOCAB) for _ in range(n))


def ids_of(text: str) -> torch.Tensor:
    return CharTokenizer(VOCAB).encode(text)


def hand_loss(model, ids: torch.Tensor, windows: list[tuple[int, int]]) -> float:
    """Mean over windows [a, b) of -log p(ids[i+1] | ids[a..i]) from log_softmax, in Python."""
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in windows:
            logits, _ = model(ids[a:b][None])
            logp = torch.log_softmax(logits[0].double(), -1)
            for i in range(b - a):
                total -= logp[i, ids[a + i + 1]].item()
                count += 1
    return total / count


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("context", ["reset", "carry"])
def test_every_character_scored_once(kind: str, context: str) -> None:
    model = tiny_model(kind)
    ids = ids_of(make_text(101))
    result = evaluate_split(model, ids, seq_len=16, batch_size=4, context=context)
    # 100 predictions: six windows of 16 run in batches, the short last one (4) alone.
    assert result["tokens"] == 100 and result["scored"] == 100
    assert result["seq_len"] == 16 and result["context"] == context
    assert math.isfinite(result["loss"])
    assert result["bpc"] == pytest.approx(result["loss"] / math.log(2))
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_windows_history_is_read_but_not_scored(kind: str) -> None:
    """With ``history`` each reset window first runs the tokens before it, unscored: every
    prediction is still scored once, batched windows and the ones run alone alike."""
    model = tiny_model(kind)
    ids = ids_of(make_text(101))
    result = evaluate_split(model, ids, seq_len=16, batch_size=4, history=5)
    assert result["tokens"] == 100 and result["scored"] == 100 and result["history"] == 5


@pytest.mark.parametrize("kind", KINDS)
def test_reset_loss_matches_hand_computation(kind: str) -> None:
    model = tiny_model(kind)
    ids = ids_of(make_text(75))
    # 74 predictions in windows of 16: four full ones (batched 3 + 1) and one of 10.
    windows = [(a, min(a + 16, 74)) for a in range(0, 74, 16)]
    result = evaluate_split(model, ids, seq_len=16, batch_size=3, context="reset")
    assert result["loss"] == pytest.approx(hand_loss(model, ids, windows), rel=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_carry_loss_matches_one_long_forward(kind: str) -> None:
    """Carrying memory across 16-character chunks equals one call over the whole split (the
    model windows its memory to mem_len = max_rel_pos = 32 either way)."""
    model = tiny_model(kind)
    ids = ids_of(make_text(90))
    result = evaluate_split(model, ids, seq_len=16, batch_size=8, context="carry")
    assert result["loss"] == pytest.approx(hand_loss(model, ids, [(0, 89)]), rel=1e-6)


def test_carry_and_reset_differ_unless_one_window() -> None:
    model = tiny_model()
    ids = ids_of(make_text(120))
    reset = evaluate_split(model, ids, seq_len=8, batch_size=4, context="reset")
    carry = evaluate_split(model, ids, seq_len=8, batch_size=4, context="carry")
    assert math.isfinite(reset["loss"]) and math.isfinite(carry["loss"])
    assert reset["loss"] != pytest.approx(carry["loss"], rel=1e-6)
    long_reset = evaluate_split(model, ids, seq_len=119, batch_size=4, context="reset")
    long_carry = evaluate_split(model, ids, seq_len=500, batch_size=4, context="carry")
    assert long_reset["loss"] == pytest.approx(long_carry["loss"], rel=1e-6)


def test_reset_agrees_with_mean_loss_on_full_windows() -> None:
    model = tiny_model().train()
    ids = ids_of(make_text(65))  # 64 predictions: exactly 4 windows of 16
    x, y = ids[:-1].view(4, 16), ids[1:].view(4, 16)
    result = evaluate_split(model, ids, seq_len=16, batch_size=3)
    assert model.training  # mode restored
    assert result["loss"] == pytest.approx(mean_loss(model, x, y, batch_size=2), rel=1e-6)


def test_deterministic_and_batch_size_independent() -> None:
    model = tiny_model("feedback")
    ids = ids_of(make_text(150))
    a = evaluate_split(model, ids, seq_len=10, batch_size=2)
    b = evaluate_split(model, ids, seq_len=10, batch_size=64)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # summation order differs
    assert evaluate_split(model, ids, seq_len=10, batch_size=2) == a


def test_bad_arguments() -> None:
    model = tiny_model()
    ids = ids_of(make_text(20))
    with pytest.raises(ValueError, match="context = 'both'"):
        evaluate_split(model, ids, 8, 4, context="both")
    with pytest.raises(ValueError, match="seq_len = 0"):
        evaluate_split(model, ids, 0, 4)
    with pytest.raises(ValueError, match="at least 2 token ids"):
        evaluate_split(model, ids[:1], 8, 4)


@pytest.mark.parametrize("context", ["reset", "carry"])
def test_reports_the_seq_len_it_used(context: str) -> None:
    """A split shorter than one window is scored as one shorter window, and says so."""
    model = tiny_model("feedback_kv")
    ids = ids_of(make_text(11))
    result = evaluate_split(model, ids, seq_len=64, batch_size=4, context=context)
    assert result["tokens"] == 10 and result["seq_len"] == 10
    assert result["loss"] == pytest.approx(hand_loss(model, ids, [(0, 10)]), rel=1e-6)


def test_a_window_longer_than_the_split_allocates_nothing_for_its_length() -> None:
    """--seq-len 99999999999 built arange(history + seq_len) before any clamp: an 800 GB
    allocation and the allocator's traceback. A window longer than the split is the split."""
    model = tiny_model("feedback_kv")
    ids = ids_of(make_text(40))
    whole = evaluate_split(model, ids, seq_len=39, batch_size=4, history=2)
    huge = evaluate_split(model, ids, seq_len=99_999_999_999, batch_size=4, history=2)
    assert huge == whole and huge["seq_len"] == 39


# ----------------------------------------------------------------------------- run()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    text_path = tmp_path / "text.txt"
    text_path.write_text(make_text(400), encoding="utf-8")
    write_run(tmp_path / "run", tiny_model(), text_path=text_path)
    return tmp_path / "run"


def test_run_uses_checkpoint_data_split_and_seq_len(run_dir: Path, tmp_path: Path) -> None:
    result = evaluate.run(str(run_dir), device="cpu")
    train_ids, val_ids = split(ids_of(make_text(400)), 0.1)
    assert result["split"] == "val" and result["tokens"] == len(val_ids) - 1
    assert result["seq_len"] == 16  # the last curriculum stage's
    assert result["step"] == 7 and result["checkpoint"].endswith("best.pt")
    expected = evaluate_split(tiny_model(), val_ids, 16, 64)
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)

    train = evaluate.run(str(run_dir), split="train", seq_len=12, context="carry", device="cpu")
    assert train["tokens"] == len(train_ids) - 1 and train["seq_len"] == 12

    text = format_result(result)
    assert "bpc" in text and f"{result['bpc']:.4f}" in text and "best.pt" in text


def test_run_with_data_path(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.txt"
    other.write_text(make_text(300, seed=5), encoding="utf-8")
    result = evaluate.run(str(run_dir), data_path=str(other), device="cpu")
    assert result["tokens"] == len(split(ids_of(make_text(300, seed=5)), 0.1)[1]) - 1


def test_vocab_not_covering_text(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.txt"
    other.write_text("abc XYZ abc", encoding="utf-8")
    with pytest.raises(DataError, match=r"vocabulary of checkpoint .*best\.pt: 3 character\(s\) "
                                        r"not in the vocabulary: 'X', 'Y', 'Z'"):
        evaluate.run(str(run_dir), data_path=str(other), device="cpu")


def test_run_bad_arguments(run_dir: Path) -> None:
    with pytest.raises(ValueError, match="split = 'test'"):
        evaluate.run(str(run_dir), split="test", device="cpu")
    with pytest.raises(DataError, match="file not found"):
        evaluate.run(str(run_dir), data_path=str(run_dir / "missing.txt"), device="cpu")


def test_cross_entropy_sanity() -> None:
    """An untrained-but-uniform model scores ln(V) per character."""
    model = tiny_model()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    result = evaluate_split(model, ids_of(make_text(50)), 7, 3)
    assert result["loss"] == pytest.approx(math.log(len(VOCAB)), rel=1e-6)
    assert result["perplexity"] == pytest.approx(len(VOCAB), rel=1e-6)


# ----------------------------------------------------------------------------- errors, JSON


def test_missing_data_path_is_only_not_found(run_dir: Path) -> None:
    """Not 'does not fit the vocabulary of checkpoint ...': the vocabulary is not the issue."""
    missing = run_dir / "missing.txt"
    with pytest.raises(DataError, match=rf"^--data-path {missing}: file not found; check the "
                                        r"path$"):
        evaluate.run(str(run_dir), data_path=str(missing), device="cpu")


def test_json_safe_maps_nonfinite_floats_to_null() -> None:
    result = {"loss": math.nan, "bpc": math.inf, "perplexity": -math.inf, "tokens": 3,
              "checkpoint": "a.pt", "step": None, "nested": [1.5, (math.nan, 2)]}
    safe = json_safe(result)
    assert safe == {"loss": None, "bpc": None, "perplexity": None, "tokens": 3,
                    "checkpoint": "a.pt", "step": None, "nested": [1.5, [None, 2]]}
    assert json.loads(json.dumps(safe, allow_nan=False)) == safe
    assert math.isnan(result["loss"])  # the caller's dict is left alone


def test_nan_loss_has_nan_perplexity() -> None:
    assert math.isnan(evaluate.loss_figures(math.nan)["perplexity"])
    assert evaluate.loss_figures(800.0)["perplexity"] == math.inf
    assert evaluate.loss_figures(1.0)["perplexity"] == pytest.approx(math.e)


@pytest.fixture
def huge_run(tmp_path: Path) -> Path:
    """A run whose finite but huge head weights make every logit overflow: loss NaN."""
    text_path = tmp_path / "text.txt"
    text_path.write_text(make_text(200), encoding="utf-8")
    model = tiny_model()
    with torch.no_grad():
        model.head.weight.fill_(3e38)
    write_run(tmp_path / "huge", model, text_path=text_path)
    return tmp_path / "huge"


def test_eval_of_a_diverged_model_is_refused(huge_run: Path) -> None:
    """It printed 'loss nan' and exited 0 where sample refuses the same checkpoint."""
    best = huge_run / "checkpoints" / "best.pt"
    with pytest.raises(CheckpointError, match=rf"^{best}: cannot score it: the loss is nan, as "
                       r"the model's predictions are NaN or inf \(its weights are so large "
                       r"that the logits overflow\)$"):
        evaluate.run(str(huge_run), device="cpu")


def test_cli_eval_of_a_diverged_model_is_one_line_and_exit_2(huge_run: Path) -> None:
    from typer.testing import CliRunner

    from fbtrain.cli import app

    result = CliRunner().invoke(app, ["eval", "-c", str(huge_run), "--json", "--device", "cpu"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {huge_run / 'checkpoints' / 'best.pt'}: cannot score it: the loss is nan, as "
        "the model's predictions are NaN or inf (its weights are so large that the logits "
        "overflow)"]


@pytest.mark.parametrize("context", ["reset", "carry"])
def test_cli_eval_that_runs_out_of_memory_is_one_line_naming_its_flags(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch, context: str) -> None:
    """A long --seq-len or wide -b under ulimit -v: a MemoryError or the allocator's
    RuntimeError from the model's forward, as a traceback. Now one line naming the windows
    and the flags to lower, exit 2 (the allocator's failure injected: a real one needs a
    limit set just so)."""
    from typer.testing import CliRunner

    from fbtrain.cli import app

    def forward(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 3221225472 bytes.")

    monkeypatch.setattr(type(tiny_model()), "forward", forward)
    result = CliRunner().invoke(app, ["eval", "-c", str(run_dir), "--seq-len", "30", "-b", "8",
                                      "--context", context, "--device", "cpu"])
    assert result.exit_code == 2, result.output
    windows, flags = ((", 8 at a time", "--seq-len or --batch-size") if context == "reset"
                      else (", memory carried", "--seq-len"))
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: out of memory scoring windows of 30 tokens{windows} (it "
                           "asked for 3.0 GiB): this ")
    assert line.endswith(f"; lower {flags}")


def test_cli_eval_of_a_text_too_big_for_the_process_is_refused_naming_the_flag(
        run_dir: Path, tmp_path: Path) -> None:
    """eval --data-path on a 2 GB sparse file under ulimit -v: a MemoryError traceback.
    Refused now from its size, against the process's address-space limit (a real one, 4
    GiB, in a subprocess), naming the flag it came from."""
    import re
    import sys

    from conftest import bounded_run

    from fbtrain.data.text import TEXT_MEMORY_PER_BYTE
    from fbtrain.messages import format_bytes

    sparse = tmp_path / "sparse.txt"
    with sparse.open("wb") as f:
        f.truncate(2 * 10**9)
    result = bounded_run([sys.executable, "-m", "fbtrain", "eval", "-c", str(run_dir),
                          "--data-path", str(sparse), "--device", "cpu"])
    assert result.returncode == 2, result.stderr
    need = format_bytes(TEXT_MEMORY_PER_BYTE * 2 * 10**9)
    assert re.fullmatch(
        rf"error: --data-path {re.escape(str(sparse))} is 1\.9 GiB: reading and tokenizing it "
        rf"needs about {re.escape(need)} of memory \({TEXT_MEMORY_PER_BYTE} bytes per byte of "
        r"the file\) but this process may use [\d.]+ [MG]iB \(its address-space limit, "
        r"RLIMIT_AS / ulimit -v, less what it has mapped already\); use a smaller file\n",
        result.stderr), result.stderr


# ----------------------------------------------------------------------------- the run's line


def text_whose_val_split_is_whole_windows(seq_len: int) -> str:
    """A text whose validation split holds a whole number of ``seq_len``-prediction windows,
    so the run's fixed validation windows (spread evenly, not overlapping) are exactly the
    consecutive windows ``eval`` scores."""
    for n in range(1600, 1800):
        if (len(split(torch.zeros(n), 0.1)[1]) - 1) % seq_len == 0:
            return make_text(n, seed=3)
    raise AssertionError("no such length")


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny run trained and validated at precision bf16 on the CPU; its validation
    windows cover the whole val split."""
    from fbtrain.config import config_from_dict
    from fbtrain.train import run

    tmp = tmp_path_factory.mktemp("bf16")
    text = tmp / "text.txt"
    text.write_text(text_whose_val_split_is_whole_windows(16), encoding="utf-8")
    raw = {"run": {"name": "bf16", "out_dir": str(tmp), "device": "cpu", "precision": "bf16"},
           "data": {"path": str(text)},
           "model": {"kind": "feedback_kv", "d_model": 16, "n_heads": 2, "d_ff": 32,
                     "n_layers": 2, "max_rel_pos": 32},
           "train": {"max_steps": 3, "batch_size": 4, "eval_every": 3, "eval_windows": 64,
                     "sample_every": 0},
           "curriculum": [{"seq_len": 16}],
           "logging": {"tensorboard": False, "progress": False}}
    return run(config_from_dict(raw), quiet=True)


def test_eval_reproduces_the_validation_line_of_its_run(bf16_run: Path) -> None:
    """``fbtrain eval`` of the last checkpoint gives the loss the run logged at its last
    validation, at the run's own precision (bf16 here, on the CPU): the same model, the
    same windows, the same inference context. Measured equal to the last bit (3.252400207519531
    both); asserted to 1e-9 relative, room only for a summation order. At fp32 the figure
    moves by 8.8e-6 (the head runs in bf16 under the run's autocast; the feedback core stays
    fp32), a thousand times the tolerance: the precision is what makes them agree."""
    lines = [json.loads(line) for line in (bf16_run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in lines if "val/loss" in r][-1]
    assert logged["step"] == 3
    last = str(bf16_run / "checkpoints" / "last.pt")
    result = evaluate.run(last, device="cpu")
    assert result["precision"] == "bf16" and result["step"] == 3
    assert result["tokens"] == 16 * 10  # ten windows: every one the run validated on
    assert result["loss"] == pytest.approx(logged["val/loss"], rel=1e-9)
    fp32 = evaluate.run(last, device="cpu", precision="fp32")
    assert fp32["precision"] == "fp32"
    assert abs(fp32["loss"] - logged["val/loss"]) > 1e-6  # 8.8e-6: the head's bf16 matmul


def test_cli_eval_precision_flag_overrides_the_runs(bf16_run: Path) -> None:
    from typer.testing import CliRunner

    from fbtrain.cli import app
    from fbtrain.cli_options import Precision
    from fbtrain.config.schema import PRECISIONS

    assert tuple(p.value for p in Precision) == PRECISIONS  # the flag's choices are the key's
    last = str(bf16_run / "checkpoints" / "last.pt")
    figures = {}
    for flag in ([], ["--precision", "fp32"], ["--precision", "bf16"]):
        result = CliRunner().invoke(app, ["eval", "-c", last, "--json", "--device", "cpu",
                                          *flag])
        assert result.exit_code == 0, result.output
        parsed = json.loads(result.stdout)
        figures[parsed["precision"] + ("" if flag else " (default)")] = parsed["loss"]
    assert figures["bf16 (default)"] == figures["bf16"] != figures["fp32"]
    refused = CliRunner().invoke(app, ["eval", "-c", last, "--precision", "fp8"])
    assert refused.exit_code == 2 and "fp8" in refused.stderr


def test_cli_eval_user_mistakes_one_line_a_bug_its_traceback(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A split the data lacks is the user's mistake (ArgumentError: one line, exit 2); a
    ValueError from anywhere else in eval is a bug and keeps its traceback (exit 1)."""
    from typer.testing import CliRunner

    from fbtrain.cli import app

    args = ["eval", "-c", str(run_dir), "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--split", "test"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: split = 'test': this data has the splits "
                                          f"train, val (data.path {run_dir.parent / 'text.txt'})"]

    def bug(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug in eval, not bad input")

    monkeypatch.setattr(evaluate, "evaluate_split", bug)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)
    assert "error:" not in result.stderr


def test_eval_refuses_a_data_path_that_now_reads_other_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's relative data.path read from another folder (or its file edited since) is
    other text: eval refuses to score it as the run's own split (the checkpoint records the
    sha256 of the splits it trained on), naming the path and --data-path, which scores it
    on purpose."""
    from test_train import make_cfg

    from fbtrain.train import run

    monkeypatch.chdir(tmp_path)  # make_cfg writes tmp_path/text.txt, read as text.txt
    run_dir = run(make_cfg(tmp_path, data={"path": "text.txt"},
                           train={"max_steps": 2, "eval_every": 2}), quiet=True)
    (tmp_path / "b").mkdir()
    reversed_text = (tmp_path / "text.txt").read_text(encoding="utf-8")[::-1]  # same vocab
    (tmp_path / "b" / "text.txt").write_text(reversed_text, encoding="utf-8")
    own = evaluate.run(str(run_dir), device="cpu")
    assert evaluate.run(str(run_dir), split="train", device="cpu")["tokens"] > own["tokens"]

    monkeypatch.chdir(tmp_path / "b")
    for split_name in ("val", "train"):
        with pytest.raises(DataError, match=rf"^data\.path text\.txt holds other text than "
                           rf"checkpoint .*best\.pt was trained on \(the sha256 of its "
                           rf"{split_name} split differs.*pass it as --data-path$"):
            evaluate.run(str(run_dir), split=split_name, device="cpu")
    other = evaluate.run(str(run_dir), data_path="text.txt", device="cpu")
    assert other["loss"] != own["loss"]


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_data_path_is_refused_not_read_as_the_dataset(
        run_dir: Path, empty: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--data-path ""`` (an unset shell variable) is refused: as data.path an empty
    string means no file, so eval would score the dataset's download under its name."""
    import fbtrain.data.corpus as corpus

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was read")

    monkeypatch.setattr(corpus, "_read_corpus", no_reading)
    with pytest.raises(ArgumentError, match=rf"^--data-path '{empty}': empty; give a text "
                                            "file, or leave the flag out"):
        evaluate.run(str(run_dir), data_path=empty, device="cpu")
