"""Typed, self-checking configuration: defaults < YAML file < ``--set section.key=value``.

Every section is a dataclass whose fields carry their help text and allowed values in
``metadata``; :func:`load_config` maps YAML key for key onto them and reports *every*
problem at once as one line each (file, key, value, what is allowed) in a
:class:`ConfigError`. The CLI turns that into exit code 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fbtrain.algorithmic import MIN_PRINTING_LEN

# Re-exported: the defaults of configs written before data.url could be null name them.
from fbtrain.sources import (  # noqa: F401
    ARCHIVED,
    AUTO_SHA256,
    SOURCES,
    TINY_SHAKESPEARE_SHA256,
    TINY_SHAKESPEARE_URL,
)

MODEL_KINDS = ("feedback", "feedback_kv", "transformer")
# Integers are stored and used as 64-bit (torch seeds, step counters, tensor sizes).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_VAL_FRACTION = 0.5  # more held out than trained on is a mistake, not a choice
VAL_FRACTION = 0.1  # data.val_fraction's default (the only value enwik8/text8 accept)
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
# A YAML document may stand for far more values than it holds: nine levels of nine aliases
# of nine strings are 400 bytes and 387 million strings. No config comes near this.
MAX_YAML_VALUES = 100_000
MAX_SHOWN = 80  # characters of a value that an error message shows


class ConfigError(ValueError):
    """One or more configuration problems; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _f(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with its help text and checks (choices, min, max, gt) as metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: _copy(default), metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})


def _copy(value: Any) -> Any:
    """A deep copy through YAML (shared values stay shared, as aliases)."""
    return yaml.safe_load(yaml.safe_dump(value))


class _ShortRepr(reprlib.Repr):
    """repr() that stops early: a message never prints (or even walks) a huge value."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 6
        self.maxstring = self.maxlong = self.maxother = MAX_SHOWN

    def repr_dict(self, x: dict, level: int) -> str:
        """As reprlib's, but in the order the keys were written (reprlib sorts them)."""
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in list(x.items())[:self.maxdict]]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"

    def repr_int(self, x: int, level: int) -> str:
        """Digits, or past Python's 4300-digit limit for int-to-text, their count."""
        try:
            return super().repr_int(x, level)
        except ValueError:
            return f"<an integer of about {int(x.bit_length() * math.log10(2))} digits>"


_SHORT_REPR = _ShortRepr()


def _show(value: Any) -> str:
    """``repr(value)`` for an error message: at most MAX_SHOWN characters."""
    return _cut(_SHORT_REPR.repr(value))


def _cut(text: str) -> str:
    """``text`` cut to MAX_SHOWN characters (a key or value quoted in a message)."""
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


@dataclass
class RunConfig:
    name: str = _f("tiny_shakespeare", "Run name: the run directory is <out_dir>/<name>.")
    out_dir: str = _f("runs", "Folder that holds run directories.")
    seed: int = _f(1337, "Seed for Python, torch and the batch sampler.", min=0)
    device: str = _f("auto", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N.")
    precision: str = _f(
        "auto", "auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16 or fp16.",
        choices=("auto", "fp32", "bf16", "fp16"),
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        """Field checks, and run.name: a folder name, never a path (it is joined to
        run.out_dir, and '..' or 'a/b' would put the run elsewhere)."""
        out = _field_problems(self)
        name = self.name
        if isinstance(name, str) and (name in ("", ".", "..") or
                                      any(c in name for c in ("/", "\\", "\0"))):
            out.append(("name", name, "must be a plain folder name (one path component: not "
                        "empty, '.' or '..', no / or \\ or NUL); the run directory is "
                        "<run.out_dir>/<run.name>, so put the path in run.out_dir"))
        return out


@dataclass
class DataConfig:
    dataset: str = _f("tinyshakespeare", "Name of the corpus (and of its cache file): "
                      "tinyshakespeare, enwik8 or text8 (downloaded), algorithmic (the "
                      "state-tracking programs, generated), or any name with data.url or "
                      "data.path.")
    url: str | None = _f(None, "Where to download the corpus from (null: the dataset's usual "
                         "address; enwik8/text8: a zip archive).")
    sha256: str | None = _f(AUTO_SHA256, "Expected sha256 of the download (auto: the "
                            "dataset's pinned one, tinyshakespeare's only so far; null: skip).")
    path: str | None = _f(None, "Local file to use instead of downloading: UTF-8 text, or for "
                          "enwik8/text8 the unzipped file.")
    cache_dir: str | None = _f(
        None, "Download cache; default $FBTRAIN_CACHE, else ~/.cache/fbtrain."
    )
    val_fraction: float = _f(VAL_FRACTION, "Last fraction of the text held out for "
                             "validation (not for enwik8/text8: their splits are fixed, 90M "
                             "train, 5M val, 5M test bytes).",
                             gt=0, max=MAX_VAL_FRACTION)
    # The state-tracking task (data.dataset: algorithmic; fbtrain/algorithmic.py).
    variables: int = _f(3, "algorithmic: variables per program (the first N of x y z p r).",
                        min=1, max=5)
    program_len: int = _f(100, "algorithmic: statements per program (END follows them).", min=1)
    train_min_program_len: int | None = _f(
        None, "algorithmic: train programs get lengths drawn from this..program_len (a mix of "
        "short and long ones, easier to start learning from); null: all program_len. "
        "val/test programs are always program_len long.", min=1)
    train_programs: int = _f(10000, "algorithmic: programs in the train split.", min=1)
    valid_programs: int = _f(1000, "algorithmic: programs in the val split.", min=1)
    test_programs: int = _f(1000, "algorithmic: programs in the test split.", min=1)
    seed: int = _f(0, "algorithmic: seed the programs are generated from.", min=0)

    def problems(self) -> list[tuple[str, Any, str]]:
        out = _field_problems(self)
        shortest, longest = self.train_min_program_len, self.program_len
        if isinstance(shortest, int) and isinstance(longest, int) and shortest > longest:
            out.append(("train_min_program_len", shortest,
                        f"must be at most data.program_len ({longest})"))
        known = (*SOURCES, "algorithmic")
        if self.url is None and self.path is None and self.dataset not in known:
            out.append(("dataset", self.dataset, f"has no usual address: use one of "
                        f"{', '.join(known)}, or set data.url or data.path"))
        sha = self.sha256
        if isinstance(sha, str) and sha != AUTO_SHA256 and not _HEX64.fullmatch(sha.strip()):
            out.append(("sha256", sha, f"must be {AUTO_SHA256}, null or 64 hex digits"))
        if self.dataset == "algorithmic" and isinstance(longest, int) and (
                1 <= longest < MIN_PRINTING_LEN):
            out.append(("program_len", longest, f"must be >= {MIN_PRINTING_LEN} for "
                        "data.dataset = algorithmic: a program's first statement always "
                        "assigns a variable, so a print (the only scored token) needs a "
                        "second statement; with none there is nothing to train or "
                        "validate on"))
        if self.dataset in ARCHIVED and self.val_fraction != VAL_FRACTION:
            out.append(("val_fraction", self.val_fraction, f"does not apply to {self.dataset}: "
                        "its splits are fixed (the last 5,000,000 bytes test, the 5,000,000 "
                        "before them val); remove the key"))
        return out


MEMORY_INITS = ("uniform", "embedding")
EMBEDDING_SHARE = 0.95  # memory_init: embedding: the embedding's share of m_t at step 0
POSITION_INITS = ("zero", "recency")


@dataclass
class ModelConfig:
    kind: str = _f(
        "feedback_kv",
        "feedback (per-layer key/value), feedback_kv (shared key/value) or transformer.",
        choices=MODEL_KINDS,
    )
    d_model: int = _f(128, "Width of the residual stream.", min=1)
    n_heads: int = _f(4, "Attention heads; must divide d_model.", min=1)
    d_ff: int = _f(512, "Hidden width of the feed-forward block.", min=1)
    n_layers: int = _f(4, "Number of layers.", min=1)
    dropout: float = _f(0.0, "Dropout on attention weights, residual branches and FF hidden.",
                        min=0, max=0.9)
    max_rel_pos: int = _f(4096, "Rows of the relative-position tables: the longest offset.", min=1)
    mem_len: int | None = _f(
        None, "Memory slots kept when decoding/carrying state (default max_rel_pos).", min=1
    )
    memory_norm: str = _f(
        "none",
        "none (keys/values project memory as it is: the seed's model) or layernorm (they "
        "project LayerNorm(memory), as the paper's code does).",
        choices=("none", "layernorm"),
    )
    memory_init: str = _f(
        "uniform",
        "How the memory mix softmax(w) starts (feedback kinds): uniform (the embedding and "
        "every layer alike, as the paper) or embedding (95% the embedding: memory starts as "
        "the tokens themselves; carried-memory training starts learning sooner).",
        choices=MEMORY_INITS,
    )
    position_init: str = _f(
        "zero",
        "How the position bias b starts: zero (the seed's; attention starts uniform over the "
        "window) or recency (head h of H starts at -2^(-2h/H) logits per position back, so "
        "attention starts on recent slots; carried-memory training learns faster with it).",
        choices=POSITION_INITS,
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        out = _field_problems(self)
        bad = {key for key, _, _ in out}
        if self.kind == "transformer" and self.memory_init != "uniform" and "kind" not in bad:
            out.append(("memory_init", self.memory_init,
                        "applies to the feedback kinds only (a transformer has no memory "
                        "mix); remove the key"))
        ints = isinstance(self.d_model, int) and isinstance(self.n_heads, int)
        ints = ints and not bad & {"d_model", "n_heads"}
        if ints and self.n_heads > 0 and self.d_model % self.n_heads:
            out.append(("d_model", self.d_model, f"must be divisible by n_heads ({self.n_heads})"))
        ints = isinstance(self.mem_len, int) and isinstance(self.max_rel_pos, int)
        if ints and self.mem_len > self.max_rel_pos:
            out.append(("mem_len", self.mem_len,
                        f"must be at most max_rel_pos ({self.max_rel_pos})"))
        return out

    @property
    def memory_window(self) -> int:
        return self.mem_len if self.mem_len is not None else self.max_rel_pos


@dataclass
class TrainConfig:
    max_steps: int = _f(1500, "Optimizer steps to train for.", min=1)
    batch_size: int = _f(16, "Sequences per optimizer step (per rank, before accumulation).", min=1)
    grad_accum: int = _f(1, "Micro-batches accumulated per optimizer step.", min=1)
    lr: float = _f(2e-3, "Peak learning rate (AdamW).", gt=0)
    min_lr: float = _f(1e-4, "Learning rate at the end of the cosine decay.", min=0)
    schedule: str = _f("cosine", "cosine (warm-up, then cosine to min_lr) or constant.",
                       choices=("cosine", "constant"))
    warmup_steps: int = _f(100, "Linear warm-up steps.", min=0)
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only).", min=0)
    beta1: float = _f(0.9, "AdamW beta1.", min=0, max=0.9999)
    beta2: float = _f(0.99, "AdamW beta2.", min=0, max=0.9999)
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0: off).", min=0)
    constant_tokens: bool = _f(
        True, "Scale each curriculum stage's batch so tokens per step match the last stage."
    )
    context: str = _f(
        "reset",
        "reset (every sequence starts from empty memory) or carry (batch_size contiguous "
        "streams; each step trains the next segment on the memory the last one left).",
        choices=("reset", "carry"),
    )
    eval_every: int = _f(75, "Evaluate on the fixed validation windows every N steps (and "
                         "at step 0 and the last step).", min=1)
    eval_windows: int = _f(64, "Fixed validation windows per evaluation.", min=1)
    log_every: int = _f(25, "Log train metrics every N steps.", min=1)
    sample_every: int | None = _f(
        None, "Log a generated sample every N steps and at the end (0: never; null: with "
        "every evaluation, the first and the last included).", min=0)
    sample_length: int = _f(200, "Characters in each logged sample.", min=1)
    init_from: str | None = _f(None, "Warm start: a transformer checkpoint (or run dir).")


@dataclass
class CurriculumStage:
    seq_len: int
    until_step: int | None = None


@dataclass
class CheckpointConfig:
    every: int = _f(250, "Save a numbered checkpoint and last.pt every N steps.", min=1)
    keep_last: int = _f(3, "Numbered checkpoints to keep (oldest deleted first).", min=1)


@dataclass
class LoggingConfig:
    tensorboard: bool = _f(True, "Write TensorBoard events into the run directory "
                           "(tensorboard --logdir <out_dir>).")
    progress: bool = _f(True, "Show a progress bar on a terminal (plain lines otherwise).")


DEFAULT_CURRICULUM = [{"until_step": 300, "seq_len": 32}, {"seq_len": 64}]


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    curriculum: list[CurriculumStage] = field(
        default_factory=lambda: [CurriculumStage(**s) for s in DEFAULT_CURRICULUM]
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["curriculum"] = [
            {k: v for k, v in s.items() if v is not None} for s in out["curriculum"]
        ]
        return out

    def seq_len_at(self, step: int) -> int:
        """Sequence length of the curriculum stage that holds ``step`` (0-based)."""
        return self.stage_at(step).seq_len

    def stage_at(self, step: int) -> CurriculumStage:
        return self.curriculum[self.stage_index_at(step)]

    def stage_index_at(self, step: int) -> int:
        """Index of the curriculum stage that holds ``step`` (0-based)."""
        for i, stage in enumerate(self.curriculum):
            if stage.until_step is None or step < stage.until_step:
                return i
        return len(self.curriculum) - 1

    def batch_size_at(self, step: int) -> int:
        """Batch size at ``step``: scaled up for short stages when ``constant_tokens`` is on."""
        if not self.train.constant_tokens:
            return self.train.batch_size
        tokens = self.train.batch_size * self.curriculum[-1].seq_len
        return max(1, tokens // self.seq_len_at(step))

    @property
    def max_seq_len(self) -> int:
        return max(s.seq_len for s in self.curriculum)

    def total_tokens(self) -> int:
        """Training tokens over all ``max_steps`` (one rank; micro-batches included)."""
        total, start = 0, 0
        for stage in self.curriculum:
            end = self.train.max_steps if stage.until_step is None else min(
                stage.until_step, self.train.max_steps)
            if end > start:
                total += (end - start) * self.batch_size_at(start) * stage.seq_len
            start = max(start, end)
        return total * self.train.grad_accum


SECTIONS = {
    "run": RunConfig, "data": DataConfig, "model": ModelConfig, "train": TrainConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}


# ----------------------------------------------------------------------------- checking


def _allowed_types(tp: Any) -> tuple[type, ...]:
    """The runtime types a field annotated ``tp`` accepts (``int | None`` -> (int, NoneType))."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(t for a in typing.get_args(tp) for t in _allowed_types(a))
    return (tp,)


def _type_name(types_: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types_)


def _coerce(value: Any, allowed: tuple[type, ...]) -> tuple[bool, Any]:
    """Accept ``value`` for a field of the given types; ints are fine where floats are."""
    if value is None:
        return type(None) in allowed, None
    if isinstance(value, bool):
        return bool in allowed, value
    if isinstance(value, int) and int not in allowed and float in allowed:
        return True, float(value) if abs(value) < 2**1024 else math.inf if value > 0 else -math.inf
    if isinstance(value, str) and float in allowed:
        # YAML 1.1 reads 1e-3 (no dot) as a string; take it as the number it means.
        try:
            return True, float(value)
        except ValueError:
            return False, value
    if str in allowed and isinstance(value, (int, float)):
        return True, str(value)
    return isinstance(value, tuple(t for t in allowed if t is not type(None))), value


def _field_problems(section: Any) -> list[tuple[str, Any, str]]:
    """Range/choice checks from field metadata, for values of the right type."""
    out = []
    for f in dataclasses.fields(section):
        value, meta = getattr(section, f.name), f.metadata
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        if "choices" in meta and value not in meta["choices"]:
            close = difflib.get_close_matches(str(value), meta["choices"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.append((f.name, value, f"must be one of {', '.join(meta['choices'])}{hint}"))
        if isinstance(value, str):
            continue
        unfit = _unfit_number(value)
        if unfit:
            out.append((f.name, value, unfit))
            continue
        if "min" in meta and value < meta["min"]:
            out.append((f.name, value, f"must be >= {meta['min']}"))
        if "gt" in meta and value <= meta["gt"]:
            out.append((f.name, value, f"must be > {meta['gt']}"))
        if "max" in meta and value > meta["max"]:
            out.append((f.name, value, f"must be <= {meta['max']}"))
    return out


def _unfit_number(value: int | float) -> str:
    """Why a number cannot be used at all ('' when it can): NaN, infinity, beyond int64."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number (not NaN or infinity)"
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return f"must fit in a 64-bit integer ({INT64_MIN} to {INT64_MAX})"
    return ""


def _build_section(cls: type, raw: Any, name: str, where: str, problems: list[str]) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{where}: {name} = {_show(raw)}: must be a mapping of keys to values")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {name}.{close[0]}?)" if close else ""
            problems.append(
                f"{where}: unknown key {name}.{_cut(str(key))}{hint}; allowed: "
                f"{', '.join(names)}"
            )
            continue
        allowed_types = _allowed_types(hints[key])
        ok, coerced = _coerce(value, allowed_types)
        if not ok:
            problems.append(
                f"{where}: {name}.{key} = {_show(value)}: must be {_type_name(allowed_types)}"
            )
            continue
        values[key] = coerced
    section = cls(**values)
    checker = getattr(section, "problems", None)
    found = checker() if checker else _field_problems(section)
    for key, value, message in found:
        problems.append(f"{where}: {name}.{key} = {_show(value)}: {message}")
    return section


def _build_curriculum(raw: Any, where: str, problems: list[str]) -> list[CurriculumStage]:
    """The curriculum's stages; problems go to ``problems``. Stages that have one are left
    out (and with none left, the default curriculum stands in: check nothing against it)."""
    shape = "a list of stages like [{until_step: 1000, seq_len: 32}, {seq_len: 64}]"
    if raw is None:
        raw = DEFAULT_CURRICULUM
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [{"seq_len": raw}]
    if not isinstance(raw, list) or not raw:
        problems.append(f"{where}: curriculum = {_show(raw)}: must be {shape}")
        return [CurriculumStage(**s) for s in DEFAULT_CURRICULUM]
    stages: list[CurriculumStage] = []
    previous = 0
    for i, item in enumerate(raw):
        key = f"curriculum[{i}]"
        if not isinstance(item, dict) or "seq_len" not in item:
            problems.append(f"{where}: {key} = {_show(item)}: must be "
                            "{seq_len: N[, until_step: S]}")
            continue
        unknown = set(item) - {"seq_len", "until_step"}
        if unknown:
            # str(): keys may mix types (1 and 'a'), which do not sort together.
            problems.append(f"{where}: unknown key {key}.{_cut(sorted(map(str, unknown))[0])}; "
                            "allowed: seq_len, until_step")
        seq_len, until = item["seq_len"], item.get("until_step")
        if (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1
                or seq_len > INT64_MAX):
            problems.append(f"{where}: {key}.seq_len = {_show(seq_len)}: must be an integer "
                            f">= 1 (at most {INT64_MAX})")
            continue
        last = i == len(raw) - 1
        if until is None and not last:
            problems.append(f"{where}: {key}.until_step is missing: every stage but the last "
                            "needs one")
            continue
        if until is not None:
            if (not isinstance(until, int) or isinstance(until, bool) or until <= previous
                    or until > INT64_MAX):
                problems.append(f"{where}: {key}.until_step = {_show(until)}: must be an integer "
                                f"> {previous} (stages run in order; at most {INT64_MAX})")
                continue
            previous = until
        stages.append(CurriculumStage(seq_len=seq_len, until_step=until))
    return stages or [CurriculumStage(**s) for s in DEFAULT_CURRICULUM]


def _cross_checks(cfg: Config, where: str, curriculum_ok: bool = True) -> list[str]:
    """Problems between keys of different sections. ``curriculum_ok``: the curriculum as
    written had no problem; otherwise it is only what was left of it (or the default), and
    a problem found in that would be about stages the user never wrote."""
    out = []
    stages = cfg.curriculum if curriculum_ok else []
    for i, stage in enumerate(stages):
        if stage.seq_len > cfg.model.max_rel_pos:
            out.append(f"{where}: curriculum[{i}].seq_len = {stage.seq_len}: must be <= "
                       f"model.max_rel_pos ({cfg.model.max_rel_pos})")
    lengths = {stage.seq_len for stage in stages}
    if cfg.train.context == "carry" and cfg.train.constant_tokens and len(lengths) > 1:
        out.append(f"{where}: train.context = carry with train.constant_tokens = true and "
                   f"curriculum lengths {sorted(lengths)}: carried streams keep one batch "
                   "size (train.batch_size), so set train.constant_tokens: false")
    if cfg.train.min_lr > cfg.train.lr:
        out.append(f"{where}: train.min_lr = {cfg.train.min_lr}: must be <= train.lr "
                   f"({cfg.train.lr})")
    device = cfg.run.device
    if not (device in ("auto", "cpu", "cuda") or
            (device.startswith("cuda:") and device[5:].isdigit())):
        out.append(f"{where}: run.device = {_show(device)}: must be auto, cpu, cuda or cuda:N")
    if cfg.data.dataset == "algorithmic":
        # The programs are generated: a file or address given as well would go unread.
        for key in ("path", "url"):
            value = getattr(cfg.data, key)
            if value is not None:
                out.append(f"{where}: data.{key} = {_show(value)}: does not apply to "
                           "data.dataset = algorithmic (its programs are generated from "
                           "data.seed); remove the key, or name another dataset")
    return out


def config_from_dict(raw: Any, where: str = "<config>") -> Config:
    """Build and check a :class:`Config` from a nested dict; raise ConfigError listing all."""
    problems: list[str] = []
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: the top level must be a mapping of sections, "
                           f"got {type(raw).__name__}"])
    allowed = [*SECTIONS, "curriculum"]
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{where}: unknown section {_cut(str(key))}{hint}; allowed: "
                            f"{', '.join(allowed)}")
    sections, sized = {}, True  # sized: every key the memory estimate reads is valid
    for name, cls in SECTIONS.items():
        before = len(problems)
        sections[name] = _build_section(cls, raw.get(name), name, where, problems)
        sized = sized and (name not in ("model", "train") or len(problems) == before)
    before = len(problems)
    curriculum = _build_curriculum(raw.get("curriculum"), where, problems)
    curriculum_ok = len(problems) == before
    cfg = Config(curriculum=curriculum, **sections)
    problems += _cross_checks(cfg, where, curriculum_ok)
    if sized and curriculum_ok:
        from fbtrain.budget import memory_problem

        too_big = memory_problem(cfg)
        if too_big:
            problems.append(f"{where}: {too_big}")
    if problems:
        raise ConfigError(problems)
    return cfg


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file; unreadable files and syntax errors become a one-line ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{path}: cannot read config file: {e}"]) from None
    loader = _UniqueKeyLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError([f"{path}:{line}: malformed YAML: {problem}"]) from None
    except _YAMLTooBig:
        raise ConfigError([f"{path}: {_YAMLTooBig.message('the YAML')}"]) from None
    except (ValueError, RecursionError) as e:
        raise ConfigError([f"{path}: {_yaml_failure(e)}"]) from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise ConfigError([f"{path}: {d}" for _, d in sorted(loader.duplicates)])
    return data


class _YAMLTooBig(Exception):
    """The document stands for more than MAX_YAML_VALUES values once aliases are expanded."""

    @staticmethod
    def message(what: str) -> str:
        """The problem, said of ``what`` (the YAML, the value)."""
        return (f"{what} expands to more than {MAX_YAML_VALUES:,} values through its aliases "
                "(each *name repeats everything &name anchors); a config holds a few dozen: "
                "write the values out instead")


def _yaml_failure(e: ValueError | RecursionError) -> str:
    """One line for what PyYAML raises outside its own errors: a value its constructors
    cannot build (a 5000-digit number, the date 2024-13-45) or nesting past the stack."""
    if isinstance(e, RecursionError):
        return ("malformed YAML: lists or mappings nested too deeply (thousands of levels); "
                "a config needs three at most")
    first = str(e).splitlines()[0] if str(e) else repr(e)
    return f"malformed YAML: a value cannot be read: {_cut(first)}"


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Values (nodes) the document ``root`` stands for with every alias expanded, counted
    up to just past ``limit``. An alias is the anchored node itself in the composed graph,
    so sizes are memoised per node: the count costs one visit per distinct node however
    often it is repeated. A node inside itself (``&a [*a]``) expands without end."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            return limit + 1
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        total = 1
        for child in children:
            total += size(child)
            if total > limit:
                break
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


class _BoundedLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses, before building anything, a document whose aliases
    expand past MAX_YAML_VALUES values (PyYAML would build it as shared references, but
    copying or printing it walks every one: minutes, then a MemoryError)."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            raise _YAMLTooBig()
        self.before_construct(node)
        return self.construct_document(node)

    def before_construct(self, node: yaml.Node) -> None:
        """A look at the composed document before it is built (nothing here)."""


def _load_yaml_value(text: str) -> Any:
    """yaml.safe_load of one --set value, under the same bound as a file."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


_STR_TAG, _NULL_TAG = "tag:yaml.org,2002:str", "tag:yaml.org,2002:null"


class _UniqueKeyLoader(_BoundedLoader):
    """The config file's loader: notes every key given twice in one mapping (YAML keeps the
    last silently, so a second ``lr:`` further down would quietly win over the first), and
    reads each text field's plain scalar as the text written (see :meth:`before_construct`)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.duplicates: list[tuple[int, str]] = []  # (line, message)

    def before_construct(self, node: yaml.Node) -> None:
        """Text fields (run.name, data.path, ...) keep the text written: YAML 1.1 would read
        ``name: 007`` as 7, ``yes`` as True and ``2024-06-01`` as a date. Only plain
        (unquoted) scalars that would not be null change; as --set does (apply_overrides)."""
        if not isinstance(node, yaml.MappingNode):
            return
        for section_node, body in node.value:
            if not (isinstance(section_node, yaml.ScalarNode)
                    and isinstance(body, yaml.MappingNode)):
                continue
            for i, (key_node, value_node) in enumerate(body.value):
                if (isinstance(key_node, yaml.ScalarNode)
                        and isinstance(value_node, yaml.ScalarNode)
                        and value_node.style is None
                        and value_node.tag not in (_STR_TAG, _NULL_TAG)
                        and _is_text_field(section_node.value, key_node.value)):
                    # A new node, not a retagged one: an alias elsewhere keeps its type.
                    text = yaml.ScalarNode(_STR_TAG, value_node.value, value_node.start_mark,
                                           value_node.end_mark, style=None)
                    body.value[i] = (key_node, text)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    self.duplicates.append((line, f"duplicate key {_show(key)} at line {line} "
                                            f"(first given at line {first_line[key]}); "
                                            "give each key once"))
                else:
                    first_line[key] = line
            except TypeError:  # an unhashable key: construct_mapping below reports it
                pass
        return super().construct_mapping(node, deep=deep)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (values parsed as YAML scalars) to a nested dict."""
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"--set {_show(item)}: must look like section.key=value")
            continue
        try:
            value = _load_yaml_value(text) if text.strip() else None
        except _YAMLTooBig:
            problems.append(f"--set {_show(item)}: {_YAMLTooBig.message('the value')}")
            continue
        except (ValueError, RecursionError) as e:
            problems.append(f"--set {_show(item)}: {_yaml_failure(e)}")
            continue
        except yaml.YAMLError:
            problems.append(f"--set {_show(item)}: value {_show(text)} is not valid YAML")
            continue
        parts = key.split(".")
        if parts == ["curriculum"]:
            raw["curriculum"] = value
            continue
        if len(parts) != 2:
            problems.append(f"--set {_show(item)}: key must be section.key (or curriculum)")
            continue
        section = raw.setdefault(parts[0], {})
        if not isinstance(section, dict):
            problems.append(f"--set {_show(item)}: {parts[0]} is not a section")
            continue
        if (_is_text_field(parts[0], parts[1])
                and isinstance(value, (int, float, datetime.date))):
            # run.name=007 stays "007" (not the integer 7), 2024-06-01 too (not a date).
            value = text.strip()
        section[parts[1]] = value
    if problems:
        raise ConfigError(problems)
    return raw


def _is_text_field(section: str, key: str) -> bool:
    cls = SECTIONS.get(section)
    if cls is None or key not in {f.name for f in dataclasses.fields(cls)}:
        return False
    allowed = _allowed_types(typing.get_type_hints(cls)[key])
    return str in allowed and not {int, float, bool} & set(allowed)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file at ``path`` (optional) < ``overrides``; raises ConfigError."""
    raw = read_yaml(path) if path is not None else {}
    if raw is None:
        raw = {}
    where = str(path) if path is not None else "<defaults>"
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: the top level must be a mapping of sections"])
    raw = _copy(raw)
    # A section the file gets wrong is the file's problem, whatever --set adds to it.
    file_problems = []
    for name in SECTIONS:
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            file_problems.append(f"{where}: {name} = {_show(raw[name])}: must be a mapping of "
                                 "keys to values")
            raw[name] = {}
    try:
        raw = apply_overrides(raw, list(overrides))
        cfg = config_from_dict(raw, where + (" (with --set)" if overrides else ""))
    except ConfigError as e:
        raise ConfigError(file_problems + e.problems) from None
    if file_problems:
        raise ConfigError(file_problems)
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    from fbtrain.io import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def describe_fields() -> str:
    """Markdown reference of every config key (used to keep the README honest)."""
    lines = []
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{name}.{f.name}` | `{default!r}` | {f.metadata.get('help', '')} |")
    return "\n".join(lines)
