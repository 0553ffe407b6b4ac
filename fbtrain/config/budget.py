"""A lower bound on the memory one training step takes, to refuse sizes that cannot fit.

``model.d_model=1048576`` or ``train.batch_size=1000000000000`` pass every range check, then
fail minutes later with a MemoryError (or a traceback from the allocator). This module
counts, from the config alone, what training must hold at once: the parameters with their
gradients and AdamW state (fp32), the activations one micro-batch keeps for its backward,
the carried memory of every stream (``train.context: carry``) and the token windows of one
optimizer step. Every term is an *under*-estimate - the vocabulary is unknown here and
counts as nothing, temporaries are left out, each kept tensor is counted once - so a
config it refuses cannot fit, and one it lets through may still not: it only stops the
absurd, before anything is created.
"""

from __future__ import annotations

import dataclasses

from fbtrain.config.curriculum import Curriculum
from fbtrain.config.kinds import model_kind
from fbtrain.config.limits import MACHINE, MemoryLimit, memory_limit, physical_memory
from fbtrain.config.schema import CurriculumStage, ModelConfig
from fbtrain.config.tree import Config
from fbtrain.messages import format_bytes

FLOAT32 = 4  # bytes
TOKEN_ID = 8  # int64, as the batches hold inputs and targets
# fp32 weights, their gradients and AdamW's two moment estimates (exp_avg, exp_avg_sq).
PARAMETER_COPIES = 4
# Python objects of one micro-batch (a tuple, two tensors, their storages): far more in
# truth; this only keeps grad_accum = 10^9 from looking free when batches are tiny.
MICRO_BATCH_OVERHEAD = 200  # bytes


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes of each part of a training step's memory (a lower bound on each)."""

    parameters: int  # weights, gradients and AdamW state
    activations: int  # kept by one micro-batch for its backward (the largest stage's)
    carried: int  # carried memory of every stream (train.context: carry)
    batches: int  # token windows (inputs and targets) of one optimizer step
    streams: int = 0  # carried streams (train.batch_size x train.grad_accum), 0: none
    micro_batches: int = 1  # per optimizer step (train.grad_accum)

    @property
    def total(self) -> int:
        """Bytes of every part together."""
        return self.parameters + self.activations + self.carried + self.batches

    def parts(self) -> list[tuple[str, int]]:
        """(what, bytes) of the parts, largest first."""
        micro = "micro-batch" if self.micro_batches == 1 else "micro-batches"
        named = [("weights, gradients and AdamW state", self.parameters),
                 ("activations of one micro-batch", self.activations),
                 ("carried memory of train.batch_size x train.grad_accum = "
                  f"{self.streams:,} streams", self.carried),
                 (f"token windows of one step's {self.micro_batches:,} {micro}", self.batches)]
        return sorted(named, key=lambda part: -part[1])


def parameter_count(model: ModelConfig) -> int:
    """Trainable parameters of the model, without the embedding and the output head (their
    size depends on the vocabulary, unknown before the data is read): the kind's own
    estimate (config/kinds.py)."""
    return model_kind(model.kind).parameters(model)


def estimate(cfg: Config) -> Estimate:
    """A lower bound on the memory training ``cfg`` needs at once, part by part."""
    model, train = cfg.model, cfg.train
    parameters = parameter_count(model) * FLOAT32 * PARAMETER_COPIES
    carry = train.context == "carry"
    # Activations may be bf16 under autocast, but not a kind whose step loop always runs
    # in fp32 (the feedback core: feedback.py turns autocast off around it).
    kind = model_kind(model.kind)
    act_bytes = FLOAT32 if kind.fp32_activations or cfg.run.precision == "fp32" else 2
    streams = train.batch_size * train.grad_accum
    window = model.memory_window
    activations = batches = 0
    start = 0
    curriculum = Curriculum(cfg)
    for stage in cfg.curriculum:
        if start >= train.max_steps:  # a stage training stops before
            break
        batch = train.batch_size if carry else curriculum.batch_size_at(start)
        seq_len = stage.seq_len
        # Carried memory fills up to the window as the steps go (never past what was seen).
        carried = min(window, seq_len * (train.max_steps - 1)) if carry else 0
        activations = max(activations,
                          kind.activations(model, batch, seq_len, carried) * act_bytes)
        # Every micro-batch of a step is drawn before the first forward (batches.py).
        batches = max(batches, train.grad_accum * (batch * seq_len * 2 * TOKEN_ID
                                                   + MICRO_BATCH_OVERHEAD))
        if stage.until_step is not None:
            start = stage.until_step
    carried_bytes = 0
    if carry:
        # Per stream: the window's keys and values (one set for feedback_kv, one per layer
        # otherwise) and what they were projected from (m_t, or every layer's input), plus
        # the stream's start offset (data/samplers.py SegmentReader).
        key_sets, sources = kind.key_value_sets(model), kind.carried_sources(model)
        kept = min(window, curriculum.max_seq_len * train.max_steps)
        carried_bytes = streams * (kept * model.d_model * (2 * key_sets + sources) * FLOAT32
                                   + TOKEN_ID)
    return Estimate(parameters, activations, carried_bytes, batches,
                    streams if carry else 0, train.grad_accum)


def available_memory() -> MemoryLimit | None:
    """What training may use here: the least of this machine's physical memory, the
    process's RLIMIT_AS and its cgroup's limit (:mod:`fbtrain.config.limits`)."""
    return memory_limit(physical_memory())


# (section, key) whose size the estimate grows with, blamed by name when it does not fit.
SIZE_KEYS = (("model", "d_model"), ("model", "n_heads"), ("model", "d_ff"),
             ("model", "n_layers"), ("model", "max_rel_pos"), ("model", "mem_len"),
             ("train", "batch_size"), ("train", "grad_accum"))
SHOWN_SHARE = 0.1  # parts of the total named in the message: those of at least this share


def memory_problem(cfg: Config, available: int | None = None) -> str | None:
    """Why training ``cfg`` cannot fit in the memory it may use (``available`` bytes of
    this machine, default :func:`available_memory`), naming the keys to make smaller; None
    when it may."""
    limit = MemoryLimit(available, MACHINE) if available is not None \
        else available_memory()
    if limit is None:
        return None
    need = estimate(cfg)
    if need.total <= limit.size:
        return None
    parts = "; ".join(f"{what}: {format_bytes(size)}" for what, size in need.parts()
                      if size >= SHOWN_SHARE * need.total)
    blamed = _blame(cfg, need.total)
    subject = ", ".join(blamed) if blamed else "this config"
    which = "them" if len(blamed) > 1 else "it"
    return (f"{subject}: training needs at least {format_bytes(need.total)} of memory "
            f"({parts}) but {limit.holder} {format_bytes(limit.size)}{limit.how}; make "
            f"{which} smaller")


def _blame(cfg: Config, total: int) -> list[str]:
    """``key = value`` of the sizes that make ``cfg`` too big, most to blame first: those
    whose default alone would at least halve the estimate, else every one above its
    default that adds to it."""
    defaults = Config()
    ratios: list[tuple[float, str]] = []
    for section, key in SIZE_KEYS:
        value = getattr(getattr(cfg, section), key)
        default = getattr(getattr(defaults, section), key)
        if value == default:
            continue
        smaller = dataclasses.replace(cfg, **{section: dataclasses.replace(
            getattr(cfg, section), **{key: default})})
        ratios.append((total / max(1, estimate(smaller).total), f"{section}.{key} = {value}"))
    if [s.seq_len for s in cfg.curriculum] != [s.seq_len for s in defaults.curriculum]:
        longest = max(range(len(cfg.curriculum)), key=lambda i: cfg.curriculum[i].seq_len)
        smaller = dataclasses.replace(cfg, curriculum=[
            CurriculumStage(s.seq_len, s.until_step) for s in defaults.curriculum])
        ratios.append((total / max(1, estimate(smaller).total),
                       f"curriculum[{longest}].seq_len = {cfg.curriculum[longest].seq_len}"))
    ratios.sort(key=lambda r: -r[0])
    strong = [name for ratio, name in ratios if ratio >= 2]
    return strong or [name for ratio, name in ratios if ratio > 1]
