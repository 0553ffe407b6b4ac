"""The one inference context (fbtrain.inference): eval mode and back, the run's precision,
no autograd, frozen weights, every random stream left where it was."""

from __future__ import annotations

import random

import pytest
import torch
from test_sample import KINDS, VOCAB, tiny_model  # noqa: F401 (one_thread: autouse there)

from fbtrain.inference import inference, saved_precision

CPU = torch.device("cpu")
TOKENS = torch.arange(12).view(2, 6) % len(VOCAB)


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_inside_and_the_mode_restored_after(training: bool) -> None:
    model = tiny_model().train(training)
    model.cfg.dropout = 0.5  # in train mode two calls would differ
    with inference(model, "fp32", CPU):
        assert not model.training
        first, _ = model(TOKENS)
        assert torch.equal(first, model(TOKENS)[0])
    assert model.training is training
    with pytest.raises(RuntimeError, match="stop"), inference(model, "fp32", CPU):
        raise RuntimeError("stop")
    assert model.training is training  # put back when the block fails too


def test_every_random_stream_is_left_where_it_was() -> None:
    model = tiny_model().train()
    torch.manual_seed(5)
    random.seed(5)
    expected = torch.rand(3), random.random()
    torch.manual_seed(5)
    random.seed(5)
    with inference(model, "fp32", CPU):
        torch.rand(7)
        random.random()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


@pytest.mark.parametrize("kind", KINDS)  # every kind in the registry
def test_no_autograd_is_recorded_even_where_gradients_are_on(kind: str) -> None:
    model = tiny_model(kind).train()
    with torch.enable_grad(), inference(model, "fp32", CPU):
        logits, state = model(TOKENS)
    assert not logits.requires_grad and torch.is_inference(logits)
    assert not state.keys.requires_grad
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16),
                                                  ("fp32", torch.float32),
                                                  ("auto", torch.float32)])  # auto: fp32 on CPU
def test_the_runs_precision_is_the_autocast(precision: str, dtype: torch.dtype) -> None:
    model = tiny_model("transformer")
    with inference(model, precision, CPU):
        logits, _ = model(TOKENS)
    assert logits.dtype == dtype


def test_a_feedback_model_folds_its_tables_once_inside() -> None:
    model = tiny_model("feedback_kv")
    with inference(model, "fp32", CPU):
        model(TOKENS)
        assert model._folded  # the tables of this window size, kept for the next call
    assert model._folded is None


def test_saved_precision_is_the_runs_or_the_default() -> None:
    assert saved_precision({"config": {"run": {"precision": "bf16"}}}) == "bf16"
    for payload in ({}, {"config": None}, {"config": {"run": {}}},
                    {"config": {"run": {"precision": "fp8"}}}):
        assert saved_precision(payload) == "auto"  # run.precision's default


def test_sample_and_the_trainers_samples_run_at_the_runs_precision(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fbtrain sample`` generates at the run's ``run.precision`` unless told another, and
    so do the samples training logs."""
    import io

    from fbtrain import sample
    from fbtrain.config import config_from_dict
    from fbtrain.train import run

    seen: list[str] = []
    real = sample.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["precision"])
        return real(*args, **kwargs)

    monkeypatch.setattr(sample, "generate", spy)
    text = tmp_path / "text.txt"
    text.write_text("the king and the queen\n" * 30, encoding="utf-8")
    raw = {"run": {"name": "r", "out_dir": str(tmp_path), "device": "cpu", "precision": "bf16"},
           "data": {"path": str(text)},
           "model": {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1},
           "train": {"max_steps": 1, "batch_size": 2, "eval_windows": 2, "sample_length": 4},
           "curriculum": [{"seq_len": 8}], "logging": {"tensorboard": False, "progress": False}}
    run_dir = run(config_from_dict(raw), quiet=True)
    assert seen == ["bf16", "bf16"]  # step 0 and step 1
    sample.run(str(run_dir), length=3, device="cpu", stream=io.StringIO())
    sample.run(str(run_dir), length=3, device="cpu", stream=io.StringIO(), precision="fp32")
    assert seen[2:] == ["bf16", "fp32"]


class _Spy(torch.nn.Module):
    """A model that records the mode and autograd state each forward ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(len(VOCAB)))
        self.seen: list[tuple[bool, bool, bool]] = []

    def forward(self, x: torch.Tensor, state: object = None) -> tuple[torch.Tensor, None]:
        self.seen.append((self.training, torch.is_grad_enabled(),
                          torch.is_inference_mode_enabled()))
        return self.weight.expand(*x.shape, -1), None


def test_window_scores_leaves_the_context_to_its_caller() -> None:
    """scoring.window_scores sets neither eval mode nor no_grad: the caller's inference()
    is the one place they are set (validation, eval, mean_loss hold it)."""
    from fbtrain.evaluate import mean_loss
    from fbtrain.scoring import window_scores

    spy = _Spy().train()
    window_scores(spy, TOKENS, TOKENS, batch_size=1)
    assert spy.seen == [(True, True, False)] * 2  # as it found them: no second context
    spy.seen.clear()
    mean_loss(spy, TOKENS, TOKENS, batch_size=2)  # mean_loss: through inference()
    assert spy.seen == [(False, False, True)] and spy.training


@pytest.mark.parametrize("precision", ["float32", "fp64", "FP32", ""])
def test_a_precision_that_is_none_of_the_choices_is_refused(precision: str) -> None:
    """A misspelt precision from Python (generate, evaluate.run, sample.run) is refused,
    not run as fp16 autocast and reported under the name it was given."""
    from fbtrain.data.tokenizers import CharTokenizer
    from fbtrain.errors import ArgumentError
    from fbtrain.evaluate import evaluate_split
    from fbtrain.sample import generate

    model = tiny_model()
    with pytest.raises(ArgumentError, match=rf"^precision = '{precision}': must be one of "
                                            "auto, fp32, bf16, fp16$"):
        generate(model, CharTokenizer(VOCAB), VOCAB[0], 2, precision=precision)
    with pytest.raises(ArgumentError, match="must be one of auto, fp32, bf16, fp16"):
        evaluate_split(model, torch.arange(10) % len(VOCAB), 4, 2, precision=precision)
