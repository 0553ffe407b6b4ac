"""Cached incremental generation: the prompt is read once, then one model call per character.

A feedback model has to consume text one token at a time anyway, and it carries everything it
knows about the past in its :class:`~fbtrain.models.MemoryState` (the newest ``mem_len``
memory keys/values). So sampling never re-runs the prefix: after one call over the prompt,
each new character is a single one-token call on the carried state. That makes a step cost
O(mem_len) instead of O(prefix length) and lets generation run past the trained length and
past ``max_rel_pos`` (the state keeps a sliding window of memory).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, TextIO

import torch
from torch import Tensor, nn

from fbtrain.config import INT64_MAX
from fbtrain.config.fields import int_bound
from fbtrain.data.errors import DataError
from fbtrain.data.tokenizers import Tokenizer
from fbtrain.errors import ArgumentError
from fbtrain.inference import inference, saved_precision
from fbtrain.io import writing
from fbtrain.progress import Progress, isatty, note
from fbtrain.rng import sample_generator
from fbtrain.sample_budget import check_memory, model_device


def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= INT64_MAX


# What each sampling argument must be: a test and its words. The CLI's flag callbacks check
# with the same rules (:func:`check_argument`), so each rule is written once.
SAMPLING_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "length": (_int_at_least(1), "an integer >= 1"),
    "temperature": (lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                    ">= 0 and finite (0 means greedy)"),
    "top_k": (lambda v: v is None or _int_at_least(1)(v), "an integer >= 1 (or unset)"),
    "top_p": (lambda v: v is None or (isinstance(v, (int, float)) and 0 < v <= 1),
              "in (0, 1] (or unset)"),
    "num_samples": (_int_at_least(1), "an integer >= 1"),
    "seed": (_int_at_least(0), "an integer >= 0"),
}


def check_argument(name: str, value: Any) -> None:
    """ArgumentError (one line) when ``value`` breaks :data:`SAMPLING_RULES`' rule for ``name``
    (integers also at most 2^63 - 1, what torch can index)."""
    ok, allowed = SAMPLING_RULES[name]
    if not ok(value):
        raise ArgumentError(f"{name} = {value!r}: must be {int_bound(value) or allowed}")


def check_sampling_args(
    length: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    num_samples: int = 1,
    prompt: str | None = None,
) -> None:
    """Raise ArgumentError (one line) for arguments :func:`generate` cannot honour (``prompt``
    None: not given; an empty one is refused)."""
    if prompt is not None and not prompt:
        raise ArgumentError("prompt is empty: give at least one character (e.g. a newline)")
    for name, value in (("length", length), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p), ("num_samples", num_samples)):
        check_argument(name, value)


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to -inf every logit outside the top ``top_k`` and outside the nucleus ``top_p``.

    logits: [N, V] (already divided by the temperature) -> [N, V]. The nucleus is the smallest
    set of most likely tokens whose probabilities sum to at least ``top_p``; the most likely
    token is always kept, so some token can always be drawn.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the more likely ones before it already reach top_p.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# The largest loss (nats) one token may cost: float32's largest number over 2^24, so a
# float32 sum of 2^24 such losses (eval sums a batch of windows so) stays finite. A uniform
# guess costs log(vocabulary) nats; a model this far past it has diverged.
MAX_TOKEN_LOSS = float(torch.finfo(torch.float32).max) / 2**24


class NonFiniteLogits(ValueError):
    """The model predicted NaN or inf (weights so large that the logits overflow)."""


def next_tokens(
    logits: Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick one token per row of logits [N, V] -> LongTensors [N]: on the logits' device
    (for the next step) and on the host (for the text), after one host sync.

    ``temperature == 0`` is greedy (argmax; top-k/top-p cannot change the argmax). Otherwise
    tokens are drawn with ``torch.multinomial`` from ``generator``, on the generator's device
    (so a CPU generator gives the same draws whether the model runs on CPU or CUDA). The
    one read carries the finiteness check with the probabilities a host generator draws
    from, or with the tokens drawn on the device.

    Raises :class:`NonFiniteLogits` when a logit is NaN or inf (no distribution to draw
    from; multinomial would fail with a traceback), or a token's log-probability is below
    ``-MAX_TOKEN_LOSS``: logits finite but so far apart that ``fbtrain eval``'s loss of
    such a model overflows, and eval refuses it (a diverged or damaged model either way).
    """
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    sane = (log_probs >= -MAX_TOKEN_LOSS).all()  # 0-dim; NaN compares False: refused too
    if temperature == 0:
        return _read_tokens(logits.argmax(dim=-1), sane)
    scaled = logits / temperature
    probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)
    # The tiny-temperature rule: softmax(logits / T) tends to a one-hot on the argmax as T
    # goes to 0, so a row whose scaled logits overflow float32 (its largest is +inf, or NaN
    # when T itself rounds to 0 in float32; e.g. T = 1e-45) is drawn greedily - the argmax
    # of its unscaled logits - instead of from a softmax of inf - inf = NaN. Rows that stay
    # finite are drawn as usual, and every row still takes its draw from the generator, so
    # the other rows' text does not depend on whether one row overflowed.
    greedy = ~torch.isfinite(scaled.amax(dim=-1))  # [N]; applied always: no host read
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1])
    probs = torch.where(greedy[:, None], one_hot.to(probs.dtype), probs)
    if generator is not None and generator.device != probs.device:
        # The probabilities and the check come to the host together, the one read.
        host = torch.cat([probs, sane.to(probs.dtype).expand(len(probs), 1)], dim=1).cpu()
        _check_finite(bool(host[0, -1]))
        picked = torch.multinomial(host[:, :-1], 1, generator=generator).squeeze(-1)
        return picked.to(logits.device, non_blocking=True), picked
    # A refused row must not reach the draw (NaN probabilities fail it): a uniform row
    # instead, and the check is raised after the read.
    probs = torch.where(sane, probs, torch.ones_like(probs))
    return _read_tokens(torch.multinomial(probs, 1, generator=generator).squeeze(-1), sane)


def _read_tokens(picked: Tensor, sane: Tensor) -> tuple[Tensor, Tensor]:
    """``picked`` [N] and its host copy, read with the check ``sane`` (0-dim) in one sync."""
    host = torch.cat([picked, sane.long()[None]]).cpu()
    _check_finite(bool(host[-1]))
    return picked, host[:-1]


def _check_finite(sane: bool) -> None:
    if not sane:
        raise NonFiniteLogits("the model's predictions are NaN or inf (its weights are so "
                              "large that the logits overflow)")


def generate(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    length: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    on_text: Callable[[int, str], None] | None = None,
    precision: str = "fp32",
) -> list[str]:
    """Continue ``prompt`` by ``length`` characters, ``num_samples`` times (in one batch).

    The prompt (tokens [num_samples, len(prompt)]) goes through the model once; then each new
    character is one call with tokens [num_samples, 1] on the returned state - the prefix is
    never re-run. ``on_text(i, chunk)`` is called with each new character of sample ``i`` as
    it is drawn. Returns the continuations without the prompt (unlike fbtrain sample,
    which prints the prompt first), one string per sample: ``prompt + text`` is the whole.

    ``device`` is where the tokens go (default: where the model's parameters are). Same
    ``generator`` seed, same text. Runs in the inference context
    (:func:`fbtrain.inference.inference`: eval mode, autocast at ``precision``, no autograd,
    frozen weights, the global RNG untouched); the model's train/eval mode is restored.

    Raises ArgumentError for bad arguments, an empty prompt (the CLI's default prompt is a
    newline) or more samples than memory holds (:func:`check_memory`), DataError when the
    prompt holds characters outside the vocabulary and :class:`NonFiniteLogits` when the
    model predicts NaN or inf.
    """
    check_sampling_args(length, temperature, top_k, top_p, num_samples, prompt)
    ids = encode_prompt(tokenizer, prompt)  # [P]
    device = torch.device(device) if device is not None else model_device(model)
    check_memory(model, tokenizer, len(ids), num_samples, length, device)
    # Per sample: a byte vocabulary prints a multi-byte character once it is whole.
    decoders = [tokenizer.decoder() for _ in range(num_samples)]
    out = torch.empty(num_samples, length, dtype=torch.long)
    with inference(model, precision, device):
        tokens = ids.to(device, non_blocking=True).unsqueeze(0).expand(num_samples, -1)  # [N, P]
        logits, state = model(tokens)  # the prompt, once
        for i in range(length):
            # [N] on the device and on the host: one host sync a token
            token, token_cpu = next_tokens(logits[:, -1], temperature, top_k, top_p, generator)
            out[:, i] = token_cpu
            if on_text is not None:
                for s, t in enumerate(token_cpu.tolist()):
                    on_text(s, decoders[s].feed(t))  # continues the text
            if i + 1 < length:  # the last character needs no prediction after it
                logits, state = model(token.unsqueeze(1), state)  # [N, 1] on the state
    if on_text is not None:
        for s, decoder in enumerate(decoders):
            if tail := decoder.end():  # an unfinished character at the very end
                on_text(s, tail)
    return [tokenizer.decode(row) for row in out]


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> Tensor:
    """The prompt's ids ``[P]``, P >= 1; DataError for tokens outside the vocabulary,
    ArgumentError for a prompt without a token (e.g. only spaces for a word vocabulary)."""
    try:
        ids = tokenizer.encode(prompt)
    except DataError as e:
        raise DataError(f"prompt: {e}") from None
    if len(ids) == 0:
        raise ArgumentError(f"prompt {prompt!r} holds no {tokenizer.unit}; give at least one "
                         f"(e.g. {tokenizer.start!r})")
    return ids


def run(
    checkpoint: str,
    *,
    prompt: str | None = None,
    length: int = 500,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    num_samples: int = 1,
    seed: int = 1337,
    device: str = "auto",
    stream: TextIO | None = None,
    precision: str | None = None,
) -> list[str]:
    """``fbtrain sample``: load a model (a run dir's ``best.pt`` first, a checkpoint file, or
    a folder from ``fbtrain export``) and write text.

    With one sample, the prompt and then each character as it is drawn go to ``stream``
    (flushed). With several, each sample is written after generation under a header line
    ``--- sample i ---`` (1-based). ``prompt`` None: the tokenizer's start text (a newline
    for characters; ``END`` for the algorithmic programs' words). ``stream`` defaults to
    ``sys.stdout`` as it is at call time (so test runners that swap it see the text).
    ``precision``: the autocast to sample at (``auto``, ``fp32``, ``bf16``, ``fp16``); None:
    the run's own ``run.precision``, as its training validated and sampled at.
    Returns the continuations.
    Raises ArgumentError (bad arguments; more samples than memory holds), DataError,
    CheckpointError (also for a model whose predictions overflow to NaN/inf) or DeviceError
    with one line (the CLI turns them into exit code 2).
    """
    from fbtrain.checkpoint import CheckpointError, load_model
    from fbtrain.checkpoint.contents import resolve_model
    from fbtrain.device import resolve_device

    check_sampling_args(length, temperature, top_k, top_p, num_samples, prompt)
    check_argument("seed", seed)
    out = stream if stream is not None else sys.stdout
    target = resolve_device(device)
    file = resolve_model(checkpoint, prefer="best")  # a run, a checkpoint or an export
    model, tokenizer, payload = load_model(file, target)
    if precision is None:
        precision = saved_precision(payload)
    if prompt is None:
        prompt = tokenizer.start
    generator = sample_generator(seed)  # a CPU generator: the same text on CPU and GPU
    # Check the prompt and the memory before printing anything, so an error is the only
    # output.
    check_memory(model, tokenizer, len(encode_prompt(tokenizer, prompt)), num_samples, length,
                 target)

    # Which model speaks, on stderr (stdout is the text alone), as eval's table says.
    note(f"sampling from {file} (step {payload.get('step')})")
    streamed = num_samples == 1
    # A progress line (stderr, a terminal only) unless the text itself streams onto one.
    shown = Progress(length, desc="sampling", unit=f"{tokenizer.unit}s") \
        if not (streamed and isatty(out)) else None

    name = "stdout" if out is sys.stdout else getattr(out, "name", "the output")

    def emit(text: str) -> None:
        """``text`` written and flushed (a terminal shows each character as it comes); a
        full disk behind it (> /dev/full) is one line naming stdout."""
        with writing(name):
            out.write(text)
            out.flush()

    def on_text(sample: int, chunk: str) -> None:
        if streamed:
            emit(chunk)
        if shown is not None and sample == 0 and shown.n < length:  # a call a token
            shown.update(1)

    if streamed:
        emit(prompt)
    try:
        texts = generate(model, tokenizer, prompt, length, temperature=temperature,
                         top_k=top_k, top_p=top_p, num_samples=num_samples,
                         generator=generator, device=target, on_text=on_text,
                         precision=precision)
    except NonFiniteLogits as e:
        if num_samples == 1:
            emit("\n")  # end the streamed text, so the error starts on its own line
        raise CheckpointError(f"{file}: cannot sample from it: {e}") from None
    finally:
        if shown is not None:
            shown.close()
    if num_samples == 1:
        emit("\n")
    else:
        emit("".join(f"--- sample {i} ---\n{prompt}{tokenizer.joiner}{text}\n"
                     for i, text in enumerate(texts, 1)))
    return texts
