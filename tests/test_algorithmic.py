"""The state-tracking programs (fbtrain/data/algorithmic.py, fbtrain/data/corpus.py): the generator
checked by an interpreter written here from the task's rules, labelled targets, masked
loss and accuracy, and train / eval --split test / sample end to end."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typer.testing import CliRunner

from fbtrain.cli import app
from fbtrain.config import DataConfig
from fbtrain.config.schema import MIN_PRINTING_LEN
from fbtrain.data import algorithmic
from fbtrain.data.corpus import load_corpus
from fbtrain.data.samplers import BatchSampler, SegmentReader, fixed_windows
from fbtrain.data.streams import IGNORE_INDEX, Stream
from fbtrain.evaluate import evaluate_split
from fbtrain.scoring import score_sums, window_scores

NAMES = ("x", "y", "z", "p", "r")
NUMBERS = {str(n) for n in range(1, 11)}


class RuleBroken(AssertionError):
    pass


def check(ok: bool, what: str, statement: list[str]) -> None:
    if not ok:
        raise RuleBroken(f"{what}: {' '.join(statement)}")


def interpret(words: list[str], variables: int, seen: Counter | None = None) -> list[str | None]:
    """Run a word stream of programs by the task's rules, independently of the generator.

    Returns the label each word should carry (the printed value on a print's ';', None
    elsewhere); raises RuleBroken on any statement the rules forbid. ``seen`` counts which
    rules were exercised.
    """
    seen = Counter() if seen is None else seen
    names = NAMES[:variables]
    labels: list[str | None] = []
    env: dict[str, int] = {}
    i = 0

    def simple(stmt: list[str], apply: bool) -> None:
        """v = n ; | v ++ ; | v -- ; (checked against env, applied when ``apply``)."""
        check(len(stmt) in (3, 4) and stmt[-1] == ";", "malformed", stmt)
        var, op = stmt[0], stmt[1]
        check(var in names, "unknown variable", stmt)
        if op == "=":
            check(len(stmt) == 4 and stmt[2] in NUMBERS, "bad assignment", stmt)
            check(var not in env, "assigned twice", stmt)
            seen["=" + (" (if, applied)" if apply and nested else " (if, skipped)"
                        if nested else "")] += 1
            if apply:
                env[var] = int(stmt[2])
            return
        check(len(stmt) == 3 and op in ("++", "--"), "bad statement", stmt)
        check(var in env, "used before assignment", stmt)
        new = env[var] + (1 if op == "++" else -1)
        check(1 <= new <= 10, "value leaves 1..10", stmt)
        seen[op] += 1
        if new in (1, 10):
            seen[f"{op} to the edge"] += 1
        if apply:
            env[var] = new

    while i < len(words):
        if words[i] == "END":
            check(bool(env) or True, "", [])
            labels.append(None)
            env = {}
            seen["programs"] += 1
            i += 1
            continue
        end = words.index(";", i)
        stmt = words[i:end + 1]
        labels.extend([None] * len(stmt))
        nested = False
        if stmt[0] == "print":
            check(len(stmt) == 3 and stmt[1] in names, "bad print", stmt)
            check(stmt[1] in env, "print before assignment", stmt)
            labels[-1] = str(env[stmt[1]])
            seen["print"] += 1
        elif stmt[0] == "if":
            check(len(stmt) >= 8 and stmt[2] in ("<", ">") and stmt[4] == ":", "bad if", stmt)
            var, rhs = stmt[1], stmt[3]
            check(var in env, "if on an unassigned variable", stmt)
            if rhs in NUMBERS:
                value = int(rhs)
                seen["if against a constant"] += 1
            else:
                check(rhs in env and rhs != var, "if against a bad variable", stmt)
                value = env[rhs]
                seen["if against a variable"] += 1
            holds = env[var] < value if stmt[2] == "<" else env[var] > value
            seen[f"if {stmt[2]} {'holds' if holds else 'fails'}"] += 1
            nested = True
            simple(stmt[5:], holds)
        else:
            simple(stmt, True)
        check(all(1 <= v <= 10 for v in env.values()), "value out of range", stmt)
        i = end + 1
    return labels


def words_of(programs: list[algorithmic.Program]) -> tuple[list[str], list[str | None]]:
    return algorithmic.program_words(programs)


# ----------------------------------------------------------------------------- generator


@pytest.mark.parametrize("variables", [3, 5])
def test_labels_match_an_independent_interpreter(variables: int) -> None:
    seen: Counter = Counter()
    for seed in range(20):
        programs = algorithmic.generate_split(seed, "train", 5, variables, 100)
        assert all(len(p) == 100 for p in programs)
        words, labels = words_of(programs)
        assert interpret(words, variables, seen) == labels
        kinds = Counter(s.words[0] if s.words[0] in ("if", "print") else s.words[1]
                        for p in programs for s in p)
        # Equal odds, before redraws: every kind is common.
        assert all(kinds[k] > 0.1 * sum(kinds.values()) for k in ("if", "print", "++", "--"))
    for rule in ("print", "++", "--", "=", "++ to the edge", "-- to the edge",
                 "if against a constant", "if against a variable", "if < holds", "if < fails",
                 "if > holds", "if > fails", "= (if, applied)", "= (if, skipped)"):
        assert seen[rule] > 0, f"rule never exercised: {rule} ({dict(seen)})"
    assert seen["programs"] == 100


def test_every_statement_kind_of_an_if_takes_effect_or_not() -> None:
    """Conditionals whose statement changes a value only when the condition holds."""
    effects: Counter = Counter()
    for program in algorithmic.generate_split(1, "val", 50, 3, 100):
        env: dict[str, int] = {}
        for s in program:
            w = s.words
            if w[0] == "if":
                value = int(w[3]) if w[3] in NUMBERS else env[w[3]]
                holds = env[w[1]] < value if w[2] == "<" else env[w[1]] > value
                target, before = w[5], env.get(w[5])
                interpret_one(env, w[5:], holds)
                effects[(w[6], holds, env.get(target) != before)] += 1
            elif w[0] != "print":
                interpret_one(env, list(w), True)
    for op in ("++", "--", "="):
        assert effects[(op, True, True)] > 0 and effects[(op, False, False)] > 0
        assert effects[(op, False, True)] == 0 and effects[(op, True, False)] == 0


def interpret_one(env: dict[str, int], stmt: list[str], apply: bool) -> None:
    if not apply:
        return
    if stmt[1] == "=":
        env[stmt[0]] = int(stmt[2])
    else:
        env[stmt[0]] += 1 if stmt[1] == "++" else -1


def test_one_variable_and_the_variable_names() -> None:
    programs = algorithmic.generate_split(0, "train", 20, 1, 30)
    words, labels = words_of(programs)
    assert interpret(words, 1) == labels
    assert {w for w in words if w in NAMES} == {"x"}
    assert all(p[0].words[1] == "=" for p in programs)  # nothing else is valid first
    words5, _ = words_of(algorithmic.generate_split(0, "train", 20, 5, 100))
    assert {w for w in words5 if w in NAMES} == set(NAMES)
    with pytest.raises(ValueError, match="variables = 6: must be 1..5"):
        algorithmic.generate_program(random.Random(0), 6, 10)


@pytest.mark.parametrize("variables", [1, 5])
def test_the_shortest_program_that_can_print(variables: int) -> None:
    """MIN_PRINTING_LEN, which the config holds data.program_len to: shorter programs never
    print (nothing to score), programs of that length can."""
    shortest = MIN_PRINTING_LEN
    for length in range(1, shortest):
        programs = algorithmic.generate_split(0, "val", 500, variables, length)
        assert not any(s.label for p in programs for s in p)
    programs = algorithmic.generate_split(0, "val", 500, variables, shortest)
    assert any(s.label for p in programs for s in p)


def test_a_setting_with_nothing_to_score_is_refused() -> None:
    from fbtrain.config import ConfigError, load_config

    sets = ["data.dataset=algorithmic", "data.variables=1", "data.program_len=1"]
    with pytest.raises(ConfigError, match=r"^<defaults> \(with --set\): data\.program_len = 1: "
                       r"must be >= 2 for data\.dataset = algorithmic: a program's first "
                       r"statement always assigns a variable"):
        load_config(None, sets)
    assert load_config(None, [*sets[:2], "data.program_len=2"]).data.program_len == 2
    # Only the algorithmic task reads the key.
    assert load_config(None, ["data.program_len=1"]).data.program_len == 1


def test_deterministic_and_splits_differ() -> None:
    def text(seed: int, split: str, count: int = 30) -> list[str]:
        return [algorithmic.program_text(p)
                for p in algorithmic.generate_split(seed, split, count, 3, 20)]

    assert text(0, "train") == text(0, "train")
    assert text(0, "train") != text(1, "train")
    train, val, test = text(0, "train"), text(0, "val"), text(0, "test")
    assert not set(train) & set(val) and not set(train) & set(test) and not set(val) & set(test)
    assert text(0, "train", 10) == train[:10]  # a bigger set extends a smaller one


# ----------------------------------------------------------------------------- corpus


def small_cfg(**kw) -> DataConfig:
    values = dict(dataset="algorithmic", variables=3, program_len=12, train_programs=40,
                  valid_programs=8, test_programs=8, seed=0)
    values.update(kw)
    return DataConfig(**values)


def test_corpus_streams_label_only_prints() -> None:
    corpus = load_corpus(small_cfg())
    assert corpus.labelled and set(corpus.splits) == {"train", "val", "test"}
    tok = corpus.tokenizer
    for name, count in (("train", 40), ("val", 8), ("test", 8)):
        inputs, targets = corpus.splits[name]
        words = tok.decode(inputs).split()
        assert words.count("END") == count
        expected = interpret(words, 3)
        got = [None if t == IGNORE_INDEX else tok.tokens[t] for t in targets.tolist()]
        assert got == expected
        assert sum(label is not None for label in got) == words.count("print")
    longest = max(algorithmic.program_size(p)
                  for split, count in (("train", 40), ("val", 8), ("test", 8))
                  for p in algorithmic.generate_split(0, split, count, 3, 12))
    assert corpus.history == longest
    with pytest.raises(ValueError, match="split = 'dev': this data has the splits train, val"):
        corpus.stream("dev")


def test_batches_and_windows_carry_targets_with_inputs() -> None:
    stream = Stream(torch.arange(100), torch.arange(100) * 2)
    x, y = BatchSampler(stream, seed=0).sample(4, 10)
    assert torch.equal(y, x * 2)
    layout = SegmentReader(stream, n_streams=3)
    x, y, fresh = layout.segment(7)
    assert fresh and torch.equal(y, x * 2) and x[1, 0] == 33
    x, y = fixed_windows(stream, 10, 4, context=5)
    assert torch.equal(x[:, 5:] * 2, y[:, 5:]) and (y[:, :5] == IGNORE_INDEX).all()


# ----------------------------------------------------------------------------- scoring


def test_masked_loss_and_accuracy_by_hand() -> None:
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [1.0, 1.0, 0.0]],
                           [[0.0, 0.0, 5.0], [0.5, 0.0, 0.0], [0.0, 2.0, 1.0]]])
    targets = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX], [0, IGNORE_INDEX, 2]])
    ce, count, correct = score_sums(logits, targets)

    def nll(row: list[float], t: int) -> float:
        return -(row[t] - math.log(sum(math.exp(v) for v in row)))

    hand = nll([0.0, 1.0, 3.0], 2) + nll([0.0, 0.0, 5.0], 0) + nll([0.0, 2.0, 1.0], 2)
    assert ce.item() == pytest.approx(hand, rel=1e-6) and count.item() == 3
    # Right at (0, 1) only; (0, 0) and (1, 1) would be right but are not labelled.
    assert correct.item() == 1
    # The training loss is the mean over labelled targets: cross_entropy's own masking.
    mean = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert (ce / count).item() == pytest.approx(mean.item(), rel=1e-6)


class Oracle(nn.Module):
    """Reads each window like the interpreter and puts all its logit mass on the value of
    the variable a print names, at that print's ';'; elsewhere (and for a variable it has
    not seen assigned) it says 1. Right everywhere iff each program is wholly in view."""

    def __init__(self, tokens: list[str]):
        super().__init__()
        self.tokens = tokens
        self.weight = nn.Parameter(torch.zeros(1))  # gives evaluate a device

    def forward(self, x: Tensor, state: object = None) -> tuple[Tensor, None]:
        V = len(self.tokens)
        out = torch.full((*x.shape, V), -10.0)
        for b, row in enumerate(x.tolist()):
            words = [self.tokens[i] for i in row]
            env: dict[str, int] = {}
            for t, w in enumerate(words):
                guess = "1"
                if w == "END":
                    env = {}
                elif w == ";":
                    start = t
                    while start > 0 and words[start - 1] not in (";", "END"):
                        start -= 1
                    stmt = words[start:t + 1]
                    if stmt[0] == "print":
                        guess = str(env.get(stmt[1], 1))
                    elif stmt[0] == "if" and len(stmt) >= 8:
                        if stmt[1] in env and (stmt[3] in NUMBERS or stmt[3] in env):
                            value = int(stmt[3]) if stmt[3] in NUMBERS else env[stmt[3]]
                            holds = env[stmt[1]] < value if stmt[2] == "<" else \
                                env[stmt[1]] > value
                            if stmt[5] in env or stmt[6] == "=":
                                interpret_one(env, stmt[5:], holds)
                    elif len(stmt) in (3, 4) and stmt[1] in ("=", "++", "--") and (
                            stmt[0] in env or stmt[1] == "="):
                        interpret_one(env, stmt, True)
                out[b, t, self.tokens.index(guess)] = 10.0
        return out, None


def test_a_model_right_everywhere_scores_100_percent() -> None:
    corpus = load_corpus(small_cfg())
    oracle = Oracle(corpus.tokenizer.tokens)
    test = corpus.stream("test")
    exact = evaluate_split(oracle, test, 16, 8, history=corpus.history)
    assert exact["accuracy"] == 1.0 and exact["scored"] == int((test.targets >= 0).sum())
    assert exact["loss"] < 1e-3
    # Without the history windows start mid-program and the oracle must guess.
    assert evaluate_split(oracle, test, 16, 8)["accuracy"] < 1.0
    # Validation windows with that much context score exactly too.
    x, y = fixed_windows(corpus.stream("val"), 16, 4, context=corpus.history)
    assert window_scores(oracle, x, y, 2).accuracy == 1.0


# ----------------------------------------------------------------------------- end to end


def test_train_eval_test_and_sample_end_to_end(tmp_path: Path) -> None:
    runner = CliRunner()
    overrides = [
        "run.name=alg", f"run.out_dir={tmp_path}", "data.dataset=algorithmic",
        "data.program_len=8", "data.train_programs=30", "data.valid_programs=6",
        "data.test_programs=6", "model.kind=feedback", "model.d_model=16", "model.n_heads=2",
        "model.d_ff=32", "model.n_layers=2", "model.max_rel_pos=16",
        "model.memory_norm=layernorm", "train.context=carry", "train.max_steps=6",
        "train.batch_size=4", "train.constant_tokens=false", "train.eval_every=3",
        "train.eval_windows=4", "train.log_every=3", "train.warmup_steps=1",
        "checkpoint.every=3", "curriculum=16", "logging.tensorboard=false",
    ]
    args = ["train", "-q"] + [a for o in overrides for a in ("--set", o)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "alg"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["accuracy"] <= 1 for r in records if "loss" in r)
    assert any("val/accuracy" in r for r in records)
    assert json.loads((run_dir / "vocab.json").read_text())["words"][0] == "END"

    result = runner.invoke(app, ["eval", "-c", str(run_dir), "--split", "test", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["split"] == "test" and 0 <= figures["accuracy"] <= 1
    assert figures["scored"] > 0 and figures["history"] > 0
    result = runner.invoke(app, ["eval", "-c", str(run_dir), "--split", "test"])
    assert result.exit_code == 0 and "accuracy" in result.stdout
    # A file in place of generated programs would be ignored: refused in one line.
    result = runner.invoke(app, ["eval", "-c", str(run_dir), "--data-path", "t.txt"])
    assert result.exit_code == 2 and "leave --data-path out" in result.stderr
    assert len(result.stderr.splitlines()) == 1

    result = runner.invoke(app, ["sample", "-c", str(run_dir), "--length", "12"])
    assert result.exit_code == 0, result.output
    words = result.stdout.split()
    assert words[0] == "END" and len(words) == 13
    assert set(words) <= set(algorithmic.VOCABULARY)
    result = runner.invoke(app, ["sample", "-c", str(run_dir), "--prompt", "x = 3 ; print x",
                                 "--length", "2", "-t", "0"])
    assert result.exit_code == 0 and result.stdout.startswith("x = 3 ; print x ")
    result = runner.invoke(app, ["sample", "-c", str(run_dir), "--prompt", "x = 11 ;"])
    assert result.exit_code == 2 and "prompt: 1 word(s) not in the vocabulary: '11'" in \
        result.stderr


def test_a_text_checkpoint_has_no_test_split(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 60)
    runner = CliRunner()
    args = ["train", "-q", "--config", "configs/tiny.yaml", "--set", f"data.path={text}",
            "--set", f"run.out_dir={tmp_path}", "--set", "train.max_steps=2",
            "--set", "logging.tensorboard=false"]
    assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, ["eval", "-c", str(tmp_path / "tiny"), "--split", "test"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: split = 'test': this data has the splits train, val (data.path {text})"]
    figures = json.loads(runner.invoke(app, ["eval", "-c", str(tmp_path / "tiny"),
                                             "--json"]).stdout)
    assert "accuracy" not in figures


def test_train_programs_of_mixed_lengths_only_in_train() -> None:
    corpus = load_corpus(small_cfg(program_len=12, train_min_program_len=2, train_programs=60))
    words = corpus.tokenizer.decode(corpus.stream("train").inputs).split()
    lengths = []
    for program in " ".join(words).split("END")[:-1]:
        lengths.append(program.count(";"))  # one ';' per statement, if or not
    assert min(lengths) < 12 and max(lengths) <= 12 and min(lengths) >= 2 and len(lengths) == 60
    for split in ("val", "test"):
        text = corpus.tokenizer.decode(corpus.stream(split).inputs)
        assert all(p.count(";") == 12 for p in text.split("END")[:-1])
    assert interpret(words, 3) == [None if t == IGNORE_INDEX else corpus.tokenizer.tokens[t]
                                   for t in corpus.stream("train").targets.tolist()]


# ----------------------------------------------------------------------------- unlabelled windows


def _train_tiny_programs(tmp_path: Path, *sets: str):
    """Train 4 steps of windows of 4 words over two-statement programs (a print is rare)."""
    from typer.testing import CliRunner

    from fbtrain.cli import app

    base = ["data.program_len=2", "data.train_programs=50", "data.test_programs=5",
            "model.d_model=16", "model.d_ff=32", "model.n_layers=1", "train.max_steps=4",
            "train.log_every=1", "train.eval_every=2", "train.context=reset", "curriculum=4",
            "train.batch_size=2", "logging.tensorboard=false", f"run.out_dir={tmp_path}",
            "run.name=r"]
    config = Path(__file__).parent.parent / "configs" / "algorithmic_feedback.yaml"
    args = ["train", "--config", str(config), "--device", "cpu", "--quiet",
            *sum((["--set", s] for s in [*base, *sets]), [])]
    return CliRunner().invoke(app, args)


def test_validation_windows_without_a_label_are_refused_up_front(tmp_path: Path) -> None:
    """Such a run trained on with 'val loss nan' and never wrote best.pt."""
    result = _train_tiny_programs(tmp_path, "data.valid_programs=3", "train.eval_windows=2")
    assert result.exit_code == 2
    assert result.stderr == (
        "error: the 2 validation windows (4 tokens each) hold no labelled target (a print's ;), "
        "so validation has nothing to score; use a longer curriculum seq_len, more "
        "train.eval_windows, or more data.valid_programs or a longer data.program_len\n")
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_step_without_a_labelled_target_logs_null_not_zero(tmp_path: Path) -> None:
    """Loss, bpc, accuracy and grad norm were 0.0 for a batch with nothing scored."""
    result = _train_tiny_programs(tmp_path, "data.valid_programs=30", "train.eval_windows=20")
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "r" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    steps = [record for record in map(json.loads, lines) if "loss" in record]
    empty = [r for r in steps if r["loss"] is None]
    assert empty and len(empty) < len(steps)  # these programs leave some batches unlabelled
    for record in empty:
        assert record["bpc"] is record["accuracy"] is record["grad_norm"] is None
    for record in steps:
        assert (record["loss"] is None) == (record["accuracy"] is None)
        assert record["loss"] is None or record["loss"] > 0
