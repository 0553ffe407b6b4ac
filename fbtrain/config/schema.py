"""The config's sections: one dataclass each, every field with its default, help text and
allowed values (``metadata``, read by :func:`fbtrain.config.fields.field_problems` and
:mod:`fbtrain.config.reference`), and each section's own ``problems()``:
the checks that need only that section. Checks across sections are in validate.py.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from fbtrain.config.fields import field_problems
from fbtrain.config.fields import setting as _f  # short: nearly every line below is one
from fbtrain.config.kinds import KINDS, find_kind, kinds_help

MODEL_KINDS = tuple(KINDS)  # the registry's (config/kinds.py), in its order
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # run.precision; eval and sample's --precision
CONTEXTS = ("reset", "carry")  # train.context; eval's --context
# A corpus's splits (test: only enwik8, text8 and algorithmic have one); eval's --split.
SPLITS = ("train", "val", "test")
MAX_VAL_FRACTION = 0.5  # more held out than trained on is a mistake, not a choice
VAL_FRACTION = 0.1  # data.val_fraction's default (the only value enwik8/text8 accept)
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
# The built-in corpora, which data.url: null and data.sha256: auto stand for. Where each
# comes from is the data layer's (SOURCES in its sources.py); config needs only the names
# (and must not import the data layer), and tests/test_config.py checks that the two agree.
DOWNLOADED = ("tinyshakespeare", "enwik8", "text8")
ARCHIVED = ("enwik8", "text8")  # zip archives with fixed splits (SOURCES' archived ones)
TOKENIZERS = ("char", "byte", "bpe")  # data.tokenizer (null: the dataset's own)
# data.vocab_size's bounds: a learned vocabulary's ids fit uint16 (2 bytes a token).
MAX_BPE_VOCAB = 65_536
BPE_VOCAB = 512  # data.vocab_size's default
AUTO_SHA256 = "auto"  # data.sha256's default: the dataset's pinned checksum, if it has one
# The shortest state-tracking program that can hold a print (the only scored statement).
# The generator (the data layer's algorithmic.py) relies on it and makes it true: every
# statement but ``=`` needs an assigned variable, so a program's first statement is ``=``.
MIN_PRINTING_LEN = 2
# train.sample_length's bound. A logged sample is generated one model call a character and
# held whole (its ids and its text, about 12 bytes a character at least, as fbtrain sample
# counts them) while the run waits: a log line, not a corpus. Beyond this a sample costs
# more than the training between evaluations; fbtrain sample --length writes longer texts.
MAX_SAMPLE_LENGTH = 100_000


class Section:
    """A config section: a dataclass of :func:`~fbtrain.config.fields.setting` fields."""

    def problems(self) -> list[tuple[str, Any, str]]:
        """(key, value, what is allowed) for each problem with this section alone; here
        the checks every field's metadata asks for, and sections add their own."""
        return field_problems(self)


@dataclass
class RunConfig(Section):
    name: str = _f("tiny_shakespeare", "Run name: the run directory is <out_dir>/<name>.")
    out_dir: str = _f("runs", "Folder that holds run directories.")
    seed: int = _f(1337, "Seed for Python, torch and the batch sampler.", min=0)
    device: str = _f("auto", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N.")
    precision: str = _f(
        "auto", "auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16 or fp16.",
        choices=PRECISIONS,
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        """Field checks, and run.name: a folder name, never a path (it is joined to
        run.out_dir, and '..' or 'a/b' would put the run elsewhere; a newline or an escape
        would split or garble every line that names the run directory)."""
        out = super().problems()
        name = self.name
        if isinstance(name, str) and (name in ("", ".", "..") or
                                      any(c in "/\\" or _control(c) for c in name)):
            out.append(("name", name, "must be a plain folder name (one path component: not "
                        "empty, '.' or '..', no / or \\ or control character); the run "
                        "directory is <run.out_dir>/<run.name>, so put the path in "
                        "run.out_dir"))
        return out


def _control(char: str) -> bool:
    """A control character (NUL, a newline, an escape) or a line or paragraph separator."""
    return unicodedata.category(char) in ("Cc", "Zl", "Zp")


@dataclass
class DataConfig(Section):
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
    tokenizer: str | None = _f(None, "What a token is: char (a character), byte (a byte of "
                               "the UTF-8 text) or bpe (a byte-level BPE vocabulary of "
                               "data.vocab_size pieces, learned from the training split); "
                               "null: the dataset's own (char; enwik8 byte; algorithmic "
                               "its words).", choices=TOKENIZERS)
    vocab_size: int = _f(BPE_VOCAB, "bpe: pieces in the learned vocabulary, the text's "
                         "distinct bytes included.", min=2, max=MAX_BPE_VOCAB)
    # The state-tracking task (data.dataset: algorithmic; fbtrain/data/algorithmic.py).
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
        """Field checks, and what holds between data's keys: program lengths in order, an
        address for every dataset, a checksum that is one, val_fraction only where the
        splits are not fixed."""
        out = super().problems()
        shortest, longest = self.train_min_program_len, self.program_len
        if isinstance(shortest, int) and isinstance(longest, int) and shortest > longest:
            out.append(("train_min_program_len", shortest,
                        f"must be at most data.program_len ({longest})"))
        if isinstance(self.path, str) and not self.path.strip():  # read as no file at all
            out.append(("path", self.path, "must name a file (null: the dataset's own data)"))
        known = (*DOWNLOADED, "algorithmic")
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
        out.extend(self._tokenizer_problems())
        return out

    def _tokenizer_problems(self) -> list[tuple[str, Any, str]]:
        """data.tokenizer only where the data is text to cut, data.vocab_size only for bpe."""
        out = []
        own = {"algorithmic": "word", "enwik8": "byte", "text8": "char"}.get(self.dataset)
        if self.tokenizer is not None and own is not None and self.tokenizer != own:
            out.append(("tokenizer", self.tokenizer, f"does not apply to data.dataset = "
                        f"{self.dataset} (its tokens are {own}s); remove the key"))
        size = self.vocab_size  # out of its range it has its own problem already
        if self.tokenizer != "bpe" and size != BPE_VOCAB and (
                isinstance(size, int) and 2 <= size <= MAX_BPE_VOCAB):
            out.append(("vocab_size", size, "applies only to data.tokenizer = bpe "
                        "(other vocabularies are what the data holds); remove the key"))
        return out


MEMORY_INITS = ("uniform", "embedding")
POSITION_INITS = ("zero", "recency")


@dataclass
class ModelConfig(Section):
    kind: str = _f("feedback_kv", kinds_help(), choices=MODEL_KINDS)
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
        """Field checks, and what holds between model's keys (only for keys that passed
        their own checks: one problem is reported once)."""
        out = super().problems()
        bad = {key for key, _, _ in out}
        kind = find_kind(self.kind) if "kind" not in bad else None
        if kind is not None and not kind.memory_mix and self.memory_init != "uniform":
            out.append(("memory_init", self.memory_init,
                        f"applies to the feedback kinds only (a {kind.name} has no memory "
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
        """Memory slots in use: mem_len, or where it is null max_rel_pos."""
        return self.mem_len if self.mem_len is not None else self.max_rel_pos


@dataclass
class TrainConfig(Section):
    max_steps: int = _f(1500, "Optimizer steps to train for.", min=1)
    batch_size: int = _f(16, "Sequences per optimizer step (per rank, before accumulation).", min=1)
    grad_accum: int = _f(1, "Micro-batches accumulated per optimizer step.", min=1)
    lr: float = _f(2e-3, "Peak learning rate (AdamW).", gt=0)
    min_lr: float = _f(1e-4, "Learning rate at the end of the cosine decay.", min=0)
    schedule: str = _f("cosine", "cosine (warm-up, then cosine to min_lr) or constant.",
                       choices=("cosine", "constant"))
    warmup_steps: int = _f(100, "Linear warm-up steps.", min=0)
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only); train.lr x "
                             "weight_decay must be < 1.", min=0)
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
        choices=CONTEXTS,
    )
    eval_every: int = _f(75, "Evaluate on the fixed validation windows every N steps (and "
                         "at step 0 and the last step).", min=1)
    eval_windows: int = _f(64, "Fixed validation windows per evaluation.", min=1)
    log_every: int = _f(25, "Log train metrics every N steps.", min=1)
    sample_every: int | None = _f(
        None, "Log a generated sample every N steps and at the end (0: never; null: with "
        "every evaluation, the first and the last included).", min=0)
    sample_length: int = _f(200, "Characters in each logged sample (at most 100,000; "
                            "longer texts: fbtrain sample).", min=1, max=MAX_SAMPLE_LENGTH)
    init_from: str | None = _f(None, "Warm start: a transformer checkpoint (or run dir, or "
                               "export).")


@dataclass
class CurriculumStage:
    """One curriculum stage: sequences of ``seq_len`` tokens until step ``until_step``
    (0-based, exclusive; None: to the end of training)."""

    seq_len: int
    until_step: int | None = None


@dataclass
class CheckpointConfig(Section):
    every: int = _f(250, "Save a numbered checkpoint and last.pt every N steps.", min=1)
    keep_last: int = _f(3, "Numbered checkpoints to keep (oldest deleted first).", min=1)


@dataclass
class LoggingConfig(Section):
    tensorboard: bool = _f(True, "Write TensorBoard events into the run directory "
                           "(tensorboard --logdir <out_dir>).")
    progress: bool = _f(True, "Redraw one status line on a terminal (plain lines otherwise).")


DEFAULT_CURRICULUM = [{"until_step": 300, "seq_len": 32}, {"seq_len": 64}]
