"""Cached incremental generation: the prompt is read once, then one model call per character.

A feedback model has to consume text one token at a time anyway, and it carries everything it
knows about the past in its :class:`~fbtrain.models.MemoryState` (the newest ``mem_len``
memory keys/values). So sampling never re-runs the prefix: after one call over the prompt,
each new character is a single one-token call on the carried state. That makes a step cost
O(mem_len) instead of O(prefix length) and lets generation run past the trained length and
past ``max_rel_pos`` (the state keeps a sliding window of memory).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TextIO

import torch
from torch import Tensor, nn

from fbtrain.data.errors import DataError
from fbtrain.data.tokenizers import Tokenizer


def check_sampling_args(
    length: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    num_samples: int = 1,
) -> None:
    """Raise ValueError (one line) for arguments :func:`generate` cannot honour."""
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length = {length!r}: must be an integer >= 1")
    if not temperature >= 0:  # also catches NaN
        raise ValueError(f"temperature = {temperature!r}: must be >= 0 (0 means greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k = {top_k!r}: must be an integer >= 1 (or unset)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p!r}: must be in (0, 1] (or unset)")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples = {num_samples!r}: must be an integer >= 1")


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


def next_tokens(
    logits: Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token per row of logits [N, V] -> LongTensor [N] (on the logits' device).

    ``temperature == 0`` is greedy (argmax; top-k/top-p cannot change the argmax). Otherwise
    tokens are drawn with ``torch.multinomial`` from ``generator``, on the generator's device
    (so a CPU generator gives the same draws whether the model runs on CPU or CUDA).
    """
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    picked = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return picked.to(logits.device)


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


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
) -> list[str]:
    """Continue ``prompt`` by ``length`` characters, ``num_samples`` times (in one batch).

    The prompt (tokens [num_samples, len(prompt)]) goes through the model once; then each new
    character is one call with tokens [num_samples, 1] on the returned state - the prefix is
    never re-run. ``on_text(i, chunk)`` is called with each new character of sample ``i`` as
    it is drawn. Returns the continuations (without the prompt), one string per sample.

    ``device`` is where the tokens go (default: where the model's parameters are). Same
    ``generator`` seed, same text. Runs without autograd and in eval mode (no dropout); the
    model's previous train/eval mode is restored afterwards.

    Raises ValueError for bad arguments or an empty prompt (the CLI's default prompt is a
    newline) and DataError when the prompt holds characters outside the vocabulary.
    """
    check_sampling_args(length, temperature, top_k, top_p, num_samples)
    if not prompt:
        raise ValueError("prompt is empty: give at least one character (e.g. a newline)")
    ids = encode_prompt(tokenizer, prompt)  # [P]
    device = torch.device(device) if device is not None else _model_device(model)
    # Per sample: a byte vocabulary prints a multi-byte character once it is whole.
    decoders = [tokenizer.decoder() for _ in range(num_samples)]
    out = torch.empty(num_samples, length, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        # Weights are fixed while decoding: let a feedback model fold its tables only once.
        frozen = getattr(model, "frozen_weights", contextlib.nullcontext)
        with torch.inference_mode(), frozen():
            tokens = ids.to(device).unsqueeze(0).expand(num_samples, -1)  # [N, P]
            logits, state = model(tokens)  # the prompt, once
            for i in range(length):
                token = next_tokens(logits[:, -1], temperature, top_k, top_p, generator)  # [N]
                token_cpu = token.cpu()
                out[:, i] = token_cpu
                if on_text is not None:
                    for s, t in enumerate(token_cpu.tolist()):
                        on_text(s, decoders[s].feed(t))  # continues the text
                if i + 1 < length:  # the last character needs no prediction after it
                    logits, state = model(token.unsqueeze(1), state)  # [N, 1] on the state
    finally:
        model.train(was_training)
    if on_text is not None:
        for s, decoder in enumerate(decoders):
            if tail := decoder.end():  # an unfinished character at the very end
                on_text(s, tail)
    return [tokenizer.decode(row) for row in out]


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> Tensor:
    """The prompt's ids ``[P]``, P >= 1; DataError for tokens outside the vocabulary,
    ValueError for a prompt without a token (e.g. only spaces for a word vocabulary)."""
    try:
        ids = tokenizer.encode(prompt)
    except DataError as e:
        raise DataError(f"prompt: {e}") from None
    if len(ids) == 0:
        raise ValueError(f"prompt {prompt!r} holds no {tokenizer.unit}; give at least one "
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
) -> list[str]:
    """``fbtrain sample``: load a checkpoint (``best.pt`` of a run dir first) and write text.

    With one sample, the prompt and then each character as it is drawn go to ``stream``
    (flushed). With several, each sample is written after generation under a header line
    ``--- sample i ---`` (1-based). ``prompt`` None: the tokenizer's start text (a newline
    for characters; ``END`` for the algorithmic programs' words). ``stream`` defaults to
    ``sys.stdout`` as it is at call time (so test runners that swap it see the text).
    Returns the continuations.
    Raises ValueError, DataError, CheckpointError or DeviceError with one line (the CLI turns
    them into exit code 2).
    """
    from fbtrain.checkpoint import load_model
    from fbtrain.device import resolve_device

    check_sampling_args(length, temperature, top_k, top_p, num_samples)
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed = {seed!r}: must be an integer >= 0")
    if prompt is not None and not prompt:
        raise ValueError("prompt is empty: give at least one character (e.g. a newline)")
    out = stream if stream is not None else sys.stdout
    target = resolve_device(device)
    model, tokenizer, _ = load_model(checkpoint, target, prefer="best")
    if prompt is None:
        prompt = tokenizer.start
    # A CPU generator: the same seed gives the same text on CPU and GPU (up to float noise).
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # Check the prompt before printing anything, so an error is the only output.
    encode_prompt(tokenizer, prompt)

    on_text = None
    if num_samples == 1:
        out.write(prompt)
        out.flush()

        def on_text(_: int, chunk: str) -> None:
            out.write(chunk)
            out.flush()  # a terminal shows each character as it comes

    texts = generate(model, tokenizer, prompt, length, temperature=temperature, top_k=top_k,
                     top_p=top_p, num_samples=num_samples, generator=generator, device=target,
                     on_text=on_text)
    if num_samples == 1:
        out.write("\n")
    else:
        for i, text in enumerate(texts, 1):
            out.write(f"--- sample {i} ---\n{prompt}{tokenizer.joiner}{text}\n")
    out.flush()
    return texts
