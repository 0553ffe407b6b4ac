"""Sampling: cached incremental generation against full forwards, seeds, filters, errors."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from fbtrain import sample, sample_budget
from fbtrain.checkpoint import CheckpointError, load_model, save_checkpoint
from fbtrain.checkpoint.state import ModelState, make_checkpoint
from fbtrain.config import ModelConfig, config_from_dict
from fbtrain.config.kinds import KINDS as REGISTRY
from fbtrain.data.errors import DataError
from fbtrain.data.tokenizers import CharTokenizer
from fbtrain.models import build_model
from fbtrain.sample import filter_logits, generate

KINDS = tuple(REGISTRY)  # every kind the registry holds: a new one is sampled and scored too
VOCAB = list("\n ,.:;?ABCabcdefghijklmnop")


def tiny_model(kind: str = "feedback_kv", max_rel_pos: int = 32, seed: int = 0) -> nn.Module:
    """A d=16, 2-head, 2-layer model whose weights are all perturbed (including the position
    tables, which start at zero), so that a wrong position or a stale state shows up."""
    torch.manual_seed(seed)
    cfg = ModelConfig(kind=kind, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                      max_rel_pos=max_rel_pos)
    model = build_model(cfg, len(VOCAB))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def write_run(run_dir: Path, model: nn.Module, *, text_path: Path | None = None,
              name: str = "best.pt", step: int = 7, vocab: list[str] | None = None) -> Path:
    """Write the model-only checkpoint the real code makes (the trainer's model part and
    description, no training state) into ``<run_dir>/checkpoints/<name>``."""
    config = config_from_dict({
        "data": {"path": str(text_path) if text_path else None},
        "model": dataclasses.asdict(model.cfg),
        "curriculum": [{"seq_len": 8, "until_step": 5}, {"seq_len": 16}],
    })
    payload = make_checkpoint({"model": ModelState(model)}, model_cfg=model.cfg,
                              tokenizer=CharTokenizer(vocab or VOCAB), step=step,
                              config=config.to_dict())
    path = run_dir / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, payload)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Run this module's tiny models on one thread: a d=16 step is microseconds of work, and
    with two OpenMP threads on a busy 2-core machine the threads' hand-offs cost 10-50x more
    than the arithmetic. Restored afterwards so other modules see the usual setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer(VOCAB)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Recorder(nn.Module):
    """Wraps a model and keeps the token count and last-position logits of every call."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.calls: list[int] = []
        self.last: list[Tensor] = []

    def forward(self, tokens: Tensor, state=None):
        logits, state = self.model(tokens, state)
        self.calls.append(tokens.shape[1])
        self.last.append(logits[:, -1].clone())
        return logits, state


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_logits_equal_full_forward(kind: str, tok: CharTokenizer) -> None:
    """Each step's distribution equals a full forward over prompt + text generated so far;
    the prompt is one call and every new character one single-token call."""
    model = tiny_model(kind)
    rec = Recorder(model)
    prompt, n = "Abc, ", 20
    text = generate(rec, tok, prompt, n, temperature=1.0, generator=gen(3))[0]
    assert rec.calls == [len(prompt)] + [1] * (n - 1)  # never re-runs the prefix
    with torch.no_grad():
        full, _ = model(tok.encode(prompt + text)[None])
    expected = full[0, len(prompt) - 1:-1]  # the logits that chose each new character
    got = torch.cat(rec.last)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_is_argmax_of_full_forward(kind: str, tok: CharTokenizer) -> None:
    model = tiny_model(kind)
    prompt = "\nAb"
    text = generate(model, tok, prompt, 25, temperature=0)[0]
    ids = tok.encode(prompt + text)
    with torch.no_grad():
        full, _ = model(ids[None])
    assert torch.equal(full[0, len(prompt) - 1:-1].argmax(-1), ids[len(prompt):])


@pytest.mark.parametrize("kind", KINDS)
def test_runs_past_max_rel_pos(kind: str, tok: CharTokenizer) -> None:
    """max_rel_pos 8, 30 new characters: the state keeps a sliding window, and the result is
    the same as a full (internally windowed) forward and repeatable by seed."""
    model = tiny_model(kind, max_rel_pos=8)
    rec = Recorder(model)
    a = generate(rec, tok, "ab", 30, generator=gen(5))[0]
    assert a == generate(model, tok, "ab", 30, generator=gen(5))[0]
    assert len(a) == 30
    got = torch.cat(rec.last)
    assert torch.isfinite(got).all()
    with torch.no_grad():
        full, _ = model(tok.encode("ab" + a)[None])
    torch.testing.assert_close(got, full[0, 1:-1], atol=1e-5, rtol=1e-5)


def test_same_seed_same_text_different_seed_different_text(tok: CharTokenizer) -> None:
    model = tiny_model()
    a = generate(model, tok, "A", 60, generator=gen(1))
    b = generate(model, tok, "A", 60, generator=gen(1))
    c = generate(model, tok, "A", 60, generator=gen(2))
    assert a == b
    assert a != c


def test_num_samples_batch(tok: CharTokenizer) -> None:
    model = tiny_model()
    streamed: dict[int, str] = {}

    def on_text(i: int, chunk: str) -> None:
        streamed[i] = streamed.get(i, "") + chunk

    texts = generate(model, tok, "ab", 17, num_samples=3, generator=gen(0), on_text=on_text)
    assert len(texts) == 3 and all(len(t) == 17 for t in texts)
    assert all(set(t) <= set(VOCAB) for t in texts)
    assert len(set(texts)) > 1  # independent draws, not one row copied
    assert streamed == dict(enumerate(texts))


@pytest.mark.parametrize("kind", KINDS)
def test_mode_restored_and_no_grad(kind: str, tok: CharTokenizer) -> None:
    """Generation records no autograd, even called where gradients are on: no call's logits
    can require a gradient (a graph kept across every character of a long sample would hold
    all of its activations), no parameter is given one, and the mode is put back."""
    model = tiny_model(kind).train()
    recorder = Recorder(model)
    with torch.enable_grad():
        generate(recorder, tok, "ab", 4, generator=gen(0))
    assert model.training
    assert recorder.calls == [2, 1, 1, 1]
    assert not any(t.requires_grad for t in recorder.last)
    assert all(torch.is_inference(t) for t in recorder.last)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    model.eval()
    generate(model, tok, "a", 3, generator=gen(0))
    assert not model.training


# ----------------------------------------------------------------------------- filters


def test_top_k_one_equals_greedy(tok: CharTokenizer) -> None:
    model = tiny_model()
    greedy = generate(model, tok, "ab", 30, temperature=0)
    assert generate(model, tok, "ab", 30, temperature=1.5, top_k=1, generator=gen(9)) == greedy
    tiny_p = generate(model, tok, "ab", 30, temperature=1.5, top_p=1e-6, generator=gen(9))
    assert tiny_p == greedy


@pytest.mark.parametrize(("top_k", "top_p"), [(3, None), (None, 0.3), (4, 0.5)])
def test_filters_restrict_choices(top_k, top_p, tok: CharTokenizer) -> None:
    """Every drawn character lies in the allowed set of the distribution it was drawn from."""
    model = tiny_model()
    rec = Recorder(model)
    text = generate(rec, tok, "ab", 40, temperature=2.0, top_k=top_k, top_p=top_p,
                    generator=gen(4))[0]
    allowed = torch.isfinite(filter_logits(torch.cat(rec.last) / 2.0, top_k, top_p))
    ids = tok.encode(text)
    assert allowed[torch.arange(len(ids)), ids].all()
    if top_k is not None:
        assert (allowed.sum(-1) <= top_k).all()


def test_filter_logits_nucleus_and_top_k() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda out: torch.isfinite(out)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert keep(filter_logits(logits, top_p=0.6)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.8)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.9)) == [True, True, True, False]
    assert keep(filter_logits(logits, top_p=1.0)) == [True] * 4
    assert keep(filter_logits(logits, top_k=2)) == [True, True, False, False]
    shuffled = logits[:, [2, 0, 3, 1]]  # vocabulary order is kept through the sort
    assert keep(filter_logits(shuffled, top_p=0.6)) == [False, True, False, True]


# ----------------------------------------------------------------------------- run()


def test_run_streams_prompt_and_text(tmp_path: Path) -> None:
    write_run(tmp_path / "run", tiny_model())
    out = io.StringIO()
    texts = sample.run(str(tmp_path / "run"), prompt="Ab", length=40, seed=11, device="cpu",
                       stream=out)
    assert len(texts) == 1 and len(texts[0]) == 40
    assert out.getvalue() == "Ab" + texts[0] + "\n"
    again = sample.run(str(tmp_path / "run"), prompt="Ab", length=40, seed=11, device="cpu",
                       stream=io.StringIO())
    assert again == texts


def test_run_writes_to_stdout_of_call_time(tmp_path: Path, capsys) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    texts = sample.run(str(ckpt), length=10, device="cpu")
    assert capsys.readouterr().out == "\n" + texts[0] + "\n"


def test_run_several_samples_have_headers(tmp_path: Path) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    out = io.StringIO()
    texts = sample.run(str(ckpt), length=12, num_samples=3, device="cpu", stream=out)
    assert len(texts) == 3
    expected = "".join(f"--- sample {i} ---\n\n{t}\n" for i, t in enumerate(texts, 1))
    assert out.getvalue() == expected


def test_run_prefers_best_over_last(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, tiny_model(seed=1), name="last.pt")
    write_run(run_dir, tiny_model(seed=2), name="best.pt")
    model, _, payload = load_model(run_dir)
    assert torch.equal(model.embed.weight, tiny_model(seed=2).embed.weight)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"length": 0}, "length = 0: must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature = -0.5: must be >= 0"),
        ({"temperature": float("nan")}, "temperature = nan"),
        ({"top_k": 0}, "top_k = 0: must be an integer >= 1"),
        ({"top_p": 0.0}, r"top_p = 0.0: must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p = 1.5: must be in \(0, 1\]"),
        ({"num_samples": 0}, "num_samples = 0"),
        ({"prompt": ""}, "prompt is empty"),
    ],
)
def test_run_rejects_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    out = io.StringIO()
    with pytest.raises(ValueError, match=match):
        sample.run(str(ckpt), device="cpu", stream=out, **kwargs)
    assert out.getvalue() == ""


def test_prompt_outside_vocab_is_data_error(tmp_path: Path, tok: CharTokenizer) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    out = io.StringIO()
    match = r"prompt: 2 character\(s\) not in the vocabulary: 'X', 'Z'"
    with pytest.raises(DataError, match=match):
        sample.run(str(ckpt), prompt="aXbZ", device="cpu", stream=out)
    assert out.getvalue() == ""  # nothing printed before the error
    with pytest.raises(DataError, match="'Q'"):
        generate(tiny_model(), tok, "Q", 5)


# ----------------------------------------------------------------------------- load_model


def test_load_model_round_trip(tmp_path: Path) -> None:
    model = tiny_model("feedback")
    ckpt = write_run(tmp_path / "run", model)
    loaded, tokenizer, payload = load_model(ckpt)
    assert tokenizer.chars == VOCAB and payload["step"] == 7
    assert not loaded.training and loaded.cfg == model.cfg
    x = torch.randint(0, len(VOCAB), (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x)[0], model(x)[0])


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module."])  # torch.compile, DDP
def test_load_model_strips_wrapper_prefixes(tmp_path: Path, prefix: str) -> None:
    model = tiny_model().eval()
    ckpt = write_run(tmp_path / "run", model)
    payload = torch.load(ckpt, weights_only=True)
    payload["model"] = {f"{prefix}{k}": v for k, v in payload["model"].items()}
    save_checkpoint(ckpt, payload)
    loaded, _, _ = load_model(ckpt)
    tokens = torch.randint(0, len(VOCAB), (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], rtol=0, atol=0)


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint file or run directory"):
        sample.run(str(tmp_path / "nope"), device="cpu", stream=io.StringIO())
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        sample.run(str(tmp_path / "empty_run"), device="cpu", stream=io.StringIO())


def test_truncated_checkpoint(tmp_path: Path) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        sample.run(str(ckpt), device="cpu", stream=io.StringIO())


def test_not_an_fbtrain_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"state_dict": tiny_model().state_dict()}, path)
    with pytest.raises(CheckpointError, match="not an fbtrain checkpoint"):
        sample.run(str(path), device="cpu", stream=io.StringIO())


def test_checkpoint_without_model_is_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    save_checkpoint(path, {"step": 3, "vocab": VOCAB})
    with pytest.raises(CheckpointError, match=r"not a model checkpoint \(missing 'model', "
                                              r"'model_config'\)"):
        load_model(path)


def test_weights_that_do_not_fit_config(tmp_path: Path) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    payload = torch.load(ckpt, weights_only=True)
    payload["model_config"]["d_model"] = 32  # config says 32 wide, weights are 16 wide
    payload["model_config"]["d_ff"] = 32
    save_checkpoint(ckpt, payload)
    with pytest.raises(CheckpointError, match="weights do not fit model_config") as info:
        load_model(ckpt)
    assert "\n" not in str(info.value) and "wrong shape embed.weight" in str(info.value)

    payload["model_config"] = {**dataclasses.asdict(tiny_model().cfg), "kind": "feedback"}
    save_checkpoint(ckpt, payload)  # feedback_kv weights under a feedback config
    with pytest.raises(CheckpointError, match=r"missing layers\.0\.attn\.key\.weight"):
        load_model(ckpt)

    payload["model_config"] = {**dataclasses.asdict(tiny_model().cfg), "n_hedas": 2}
    save_checkpoint(ckpt, payload)
    with pytest.raises(CheckpointError, match="bad 'model_config'.*n_hedas"):
        load_model(ckpt)


# ----------------------------------------------------------------------------- damaged models


def _huge(model: nn.Module) -> nn.Module:
    """Finite weights whose logits overflow float32: every head weight is 3e38."""
    with torch.no_grad():
        model.head.weight.fill_(3e38)
    return model


def test_run_refuses_nonfinite_weights_at_load(tmp_path: Path) -> None:
    model = tiny_model()
    with torch.no_grad():
        model.head.bias[3] = float("nan")
    ckpt = write_run(tmp_path / "run", model)
    out = io.StringIO()
    with pytest.raises(CheckpointError, match=rf"^{ckpt}: the weights hold NaN or inf \(in "
                                              r"head\.bias\)"):
        sample.run(str(ckpt), length=5, device="cpu", stream=out)
    assert out.getvalue() == ""


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_run_refuses_logits_that_overflow(tmp_path: Path, temperature: float) -> None:
    """Finite but huge weights: one line, not torch.multinomial's 'probability tensor
    contains either inf, nan or element < 0' traceback (nor NaN text when greedy)."""
    ckpt = write_run(tmp_path / "run", _huge(tiny_model()))
    with pytest.raises(CheckpointError, match=rf"^{ckpt}: cannot sample from it: the model's "
                                              r"predictions are NaN or inf") as e:
        sample.run(str(ckpt), length=5, temperature=temperature, device="cpu",
                   stream=io.StringIO())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-30])
def test_tiny_temperature_is_greedy(tmp_path: Path, temperature: float) -> None:
    """logits / T overflows float32 (1e-45 is subnormal, 1e-300 rounds to 0): the limit of
    softmax(logits / T) as T -> 0, the argmax, instead of NaN probabilities."""
    ckpt = write_run(tmp_path / "run", tiny_model())
    greedy = sample.run(str(ckpt), prompt="Ab", length=30, temperature=0.0, device="cpu",
                        stream=io.StringIO())
    tiny = sample.run(str(ckpt), prompt="Ab", length=30, temperature=temperature,
                      num_samples=2, device="cpu", stream=io.StringIO())
    assert tiny == greedy * 2


def test_next_tokens_overflowing_row_is_greedy_others_sampled() -> None:
    # Logits a sane model makes (huge ones are refused: test_next_tokens_refuses_...), at a
    # temperature so small that the first row's overflow float32 once divided by it.
    t = 1e-39
    logits = torch.tensor([[0.0, 3.0, 1.0, -3.0],  # / t overflows: greedy, token 1
                           [0.0, 1e-40, 2e-40, 3e-40]])  # / t stays finite: sampled
    picks = {tuple(sample.next_tokens(logits, t, generator=gen(s))[1].tolist())
             for s in range(40)}
    assert {p[0] for p in picks} == {1}
    assert len({p[1] for p in picks}) > 1
    # The greedy row still takes its draw: the other rows get the draws they would get if
    # it had not overflowed.
    tame = torch.tensor([[0.0, 3e-39, 1e-39, -3e-39], [0.0, 1e-40, 2e-40, 3e-40]])
    for s in range(20):
        assert (sample.next_tokens(logits, t, generator=gen(s))[1][1]
                == sample.next_tokens(tame, t, generator=gen(s))[1][1])


def test_next_tokens_refuses_logits_whose_loss_overflows() -> None:
    """Finite logits 6e38 apart: a log-probability of -inf (eval's loss would be inf)."""
    with pytest.raises(sample.NonFiniteLogits, match="NaN or inf"):
        sample.next_tokens(torch.tensor([[0.0, 3e38, 1e38, -3e38]]), 1.0)


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("kwargs", [{"num_samples": 2**63 - 1}, {"length": 2**63 - 1},
                                    {"num_samples": 2**32, "length": 2**32}])
def test_run_refuses_what_cannot_fit_in_memory(tmp_path: Path, kwargs: dict) -> None:
    ckpt = write_run(tmp_path / "run", tiny_model())
    args = {"num_samples": 1, "length": 500, **kwargs}
    out = io.StringIO()
    match = (rf"^num_samples = {args['num_samples']} x length = {args['length']}: sampling "
             r"needs about [\d.e+]+ [KMGTPEZY]i?B of memory, more than the [\d.]+ [KMGTPE]iB of "
             r"this machine; lower num_samples or length$")
    with pytest.raises(ValueError, match=match):
        sample.run(str(ckpt), device="cpu", stream=out, **kwargs)
    assert out.getvalue() == ""


def test_memory_check_counts_each_samples_model_state(monkeypatch, tok: CharTokenizer) -> None:
    model = tiny_model("transformer")  # 2 layers x 32 slots x d=16 of keys and values
    host, per_model = sample_budget.sampling_bytes(model, tok, 1, 1000, 1)
    assert host == 1000 * (8 + 4) and per_model >= 1000 * 2 * 2 * 32 * 16 * 4
    monkeypatch.setattr(sample_budget, "memory_bytes", lambda device="cpu": 1 << 20)
    with pytest.raises(ValueError, match=r"num_samples = 1000 x length = 1: .* 1\.0 MiB"):
        generate(model, tok, "a", 1, num_samples=1000)
    assert len(generate(model, tok, "a", 1, num_samples=10)) == 10  # well within 1 MiB


@pytest.mark.parametrize("kind", KINDS)
def test_the_prompts_cost_grows_as_its_pass_does(kind: str, tok: CharTokenizer) -> None:
    """The estimate took every prompt position's attention over the whole prompt (its
    square) for every kind: a 50 KB prompt was refused as needing 55.9 GiB, where a
    feedback model reads it a token at a time and really took 275 MB. Its cost is now the
    kind's own, linear for each: the feedback models read the prompt a token at a time,
    the transformer attends a block of query rows at a time over the slots they see
    (scripts/sample_memory.py holds both to the real peak)."""
    model = tiny_model(kind)
    cost = [sample_budget.sampling_bytes(model, tok, p, 1, 10)[1] for p in (10**4, 2 * 10**4,
                                                                      3 * 10**4)]
    assert cost[2] - cost[1] == cost[1] - cost[0] > 0


def test_a_long_prompt_is_sampled_from_or_named_when_it_cannot_fit(
        monkeypatch: pytest.MonkeyPatch, tok: CharTokenizer) -> None:
    prompt = "abc " * 12_500  # 50,000 characters
    monkeypatch.setattr(sample_budget, "memory_bytes", lambda device="cpu": 1 << 30)
    assert len(generate(tiny_model(), tok, prompt, 3, generator=gen(0))[0]) == 3
    monkeypatch.setattr(sample_budget, "memory_bytes", lambda device="cpu": 1 << 20)
    with pytest.raises(ValueError, match=(
            r"^a prompt of 50,000 characters x num_samples = 1: sampling needs about [\d.]+ "
            r"MiB of memory, more than the 1\.0 MiB of this machine; shorten the prompt$")):
        generate(tiny_model(), tok, prompt, 3)


def test_memory_check_allows_ordinary_requests(tok: CharTokenizer) -> None:
    sample_budget.check_memory(tiny_model(), tok, 100, 64, 100_000, "cpu")  # ~80 MB: fine


# ----------------------------------------------------------------------------- CLI


def _cli(*args: str):
    from typer.testing import CliRunner

    from fbtrain.cli import app

    return CliRunner().invoke(app, ["sample", *args])


def test_cli_sample_extremes(tmp_path: Path) -> None:
    ckpt = str(write_run(tmp_path / "run", tiny_model()))
    result = _cli("-c", ckpt, "--num-samples", str(2**63 - 1), "--device", "cpu")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: num_samples = 9223372036854775807 x length = 500:")
    assert len(result.stderr.splitlines()) == 1

    greedy = _cli("-c", ckpt, "-n", "20", "--temperature", "0", "--device", "cpu")
    tiny = _cli("-c", ckpt, "-n", "20", "--temperature", "1e-45", "--device", "cpu")
    assert tiny.exit_code == 0 and tiny.stdout == greedy.stdout

    huge = str(write_run(tmp_path / "huge", _huge(tiny_model())))
    result = _cli("-c", huge, "-n", "20", "--device", "cpu")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"sampling from {huge} (step 7)",
                                          f"error: {huge}: cannot sample from it: the model's "
                                          "predictions are NaN or inf (its weights are so "
                                          "large that the logits overflow)"]


@pytest.mark.parametrize(("args", "line"), [
    (["--prompt", ""], "error: prompt is empty: give at least one character (e.g. a newline)"),
    (["--num-samples", str(2**62), "-n", "4"], "error: num_samples = 4611686018427387904 x "
                                               "length = 4: sampling needs about"),
])
def test_cli_sample_user_mistakes_are_one_line_exit_2(tmp_path: Path, args: list[str],
                                                      line: str) -> None:
    """fbtrain's own checks raise a named UserError (ArgumentError) where they check: one
    line, exit 2, nothing on stdout."""
    result = _cli("-c", str(write_run(tmp_path / "run", tiny_model())), "--device", "cpu",
                  *args)
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(line)


def test_cli_a_bug_inside_sample_keeps_its_traceback(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError raised inside sampling that no check of fbtrain's raised (here the
    top-k/top-p filter failing) is a bug: it escapes with its traceback (exit 1), never
    'error: ...' and exit 2 as if the user had typed something wrong."""
    ckpt = str(write_run(tmp_path / "run", tiny_model()))

    def bug(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug in sampling, not bad input")

    monkeypatch.setattr(sample, "filter_logits", bug)
    result = _cli("-c", ckpt, "-n", "3", "--device", "cpu")
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)
    assert "error:" not in result.stderr
