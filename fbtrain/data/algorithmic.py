"""The paper's state-tracking task: short programs over a few variables, written by fbtrain.

A program is ``program_len`` statements and then ``END``; tokens are the space-separated
words. Each statement is drawn with equal odds among five kinds; one that breaks a rule
is thrown away and drawn again (kind included):

- ``v = n ;``     n in 1..10, only for a variable not assigned yet (each is assigned once);
- ``v ++ ;``      not when v is 10;           ``v -- ;``  not when v is 1;
- ``print v ;``   the one labelled statement: its ``;`` must predict v's value;
- ``if v < w : S`` / ``if v > w : S``  (``<`` or ``>`` with equal odds): w is, with equal
  odds, another assigned variable or a constant 1..10, and S is one ``=``, ``++`` or ``--``
  statement (equal odds, drawn again until valid) that takes effect only when the
  condition holds.

Unassigned variables: every statement but ``=`` may only name variables that are already
assigned (v, w and the variable S changes); a draw that names another is drawn again, so
the first statement of every program is an assignment. S must be valid where it stands,
whether or not the condition holds (``if x > 3 : y ++ ;`` never appears with y = 10); an
``S = v = n ;`` whose condition fails leaves v unassigned, so a later ``=`` may assign it.
Values stay in 1..10 throughout.

Programs are a pure function of ``(seed, split)``: each split draws from its own
``random.Random`` seeded by a hash of both, so train, val and test hold different programs
and a bigger train set starts with the programs of a smaller one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from fbtrain.rng import dataset_seed

VARIABLES = ("x", "y", "z", "p", "r")
MIN_VALUE, MAX_VALUE = 1, 10
END = "END"
KINDS = ("=", "++", "--", "print", "if")
INNER_KINDS = ("=", "++", "--")  # what an if's statement may be
VALUES = tuple(str(v) for v in range(MIN_VALUE, MAX_VALUE + 1))
# Every word a program can hold; END first (the sampler's default prompt: a program starts).
VOCABULARY = (END, ";", ":", "=", "++", "--", "<", ">", "if", "print", *VARIABLES, *VALUES)


@dataclass(frozen=True)
class Statement:
    """One statement's words and, for ``print``, the value its closing ``;`` is labelled with."""

    words: tuple[str, ...]
    label: str | None = None


Program = list[Statement]  # program_len statements; END is added when the stream is built


def _simple(kind: str, rng: random.Random, names: tuple[str, ...], values: dict[str, int]
            ) -> tuple[tuple[str, ...], tuple[str, int] | None] | None:
    """An ``=``, ``++`` or ``--`` statement and its effect (variable, new value), or None
    when the draw breaks a rule."""
    if kind == "=":
        free = [v for v in names if v not in values]
        if not free:
            return None
        var, value = rng.choice(free), rng.randint(MIN_VALUE, MAX_VALUE)
        return (var, "=", str(value), ";"), (var, value)
    assigned = [v for v in names if v in values]
    if not assigned:
        return None
    var = rng.choice(assigned)
    step = 1 if kind == "++" else -1
    new = values[var] + step
    if not MIN_VALUE <= new <= MAX_VALUE:
        return None
    return (var, kind, ";"), (var, new)


def _statement(rng: random.Random, names: tuple[str, ...], values: dict[str, int]
               ) -> Statement | None:
    """Draw one top-level statement and apply it to ``values``; None (nothing changed) when
    the draw breaks a rule."""
    kind = rng.choice(KINDS)
    if kind in INNER_KINDS:
        drawn = _simple(kind, rng, names, values)
        if drawn is None:
            return None
        words, (var, value) = drawn
        values[var] = value
        return Statement(words)
    assigned = [v for v in names if v in values]
    if not assigned:
        return None
    var = rng.choice(assigned)
    if kind == "print":
        return Statement(("print", var, ";"), label=str(values[var]))
    if rng.random() < 0.5:  # compare with another variable
        others = [v for v in assigned if v != var]
        if not others:
            return None
        other = rng.choice(others)
        rhs, rhs_word = values[other], other
    else:
        rhs = rng.randint(MIN_VALUE, MAX_VALUE)
        rhs_word = str(rhs)
    op = rng.choice(("<", ">"))
    holds = values[var] < rhs if op == "<" else values[var] > rhs
    while True:  # S: drawn until valid; some ++ or -- always is, as var is assigned
        inner = _simple(rng.choice(INNER_KINDS), rng, names, values)
        if inner is not None:
            break
    words, (target, value) = inner
    if holds:
        values[target] = value
    return Statement(("if", var, op, rhs_word, ":", *words))


def generate_program(rng: random.Random, variables: int, length: int) -> Program:
    """``length`` statements over the first ``variables`` of x y z p r, drawn from ``rng``."""
    if not 1 <= variables <= len(VARIABLES):
        raise ValueError(f"variables = {variables}: must be 1..{len(VARIABLES)}")
    names = VARIABLES[:variables]
    values: dict[str, int] = {}
    program: Program = []
    while len(program) < length:
        statement = _statement(rng, names, values)
        if statement is not None:
            program.append(statement)
    return program


SPLIT_SALT = {"train": "train", "val": "valid", "test": "test"}


def split_rng(seed: int, split: str) -> random.Random:
    """The generator of one split's programs: independent of the other splits'."""
    return random.Random(dataset_seed(seed, SPLIT_SALT[split]))


def generate_split(seed: int, split: str, count: int, variables: int, length: int,
                   min_length: int | None = None) -> list[Program]:
    """``count`` programs of ``split`` (train, val or test), the same for the same arguments.

    ``min_length``: each program's length is drawn uniformly from ``min_length..length``
    (a mix of short and long programs) instead of being ``length``.
    """
    rng = split_rng(seed, split)
    if min_length is not None and not 1 <= min_length <= length:
        raise ValueError(f"min_length = {min_length}: must be 1..{length}")
    return [generate_program(rng, variables,
                             length if min_length is None else rng.randint(min_length, length))
            for _ in range(count)]


def program_words(programs: list[Program]) -> tuple[list[str], list[str | None]]:
    """The programs as one word stream (each ending in END) and its labels, one per word:
    the printed value on each ``print``'s ``;``, None elsewhere."""
    words: list[str] = []
    labels: list[str | None] = []
    for program in programs:
        for statement in program:
            words.extend(statement.words)
            labels.extend([None] * (len(statement.words) - 1) + [statement.label])
        words.append(END)
        labels.append(None)
    return words, labels


def program_size(program: Program) -> int:
    """Tokens in a program, END included."""
    return sum(len(s.words) for s in program) + 1


def program_text(program: Program) -> str:
    """A program as text: its words joined by spaces, END last."""
    return " ".join([w for s in program for w in s.words] + [END])
