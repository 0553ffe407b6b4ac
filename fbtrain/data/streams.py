"""What a split is: a :class:`Stream` of inputs and targets, cut from token ids.

Shapes: token ids are 1-D integer tensors (LongTensors, or uint8 for a large byte-level
corpus); a window drawn from a stream is a LongTensor (:func:`window`). Targets equal to
:data:`IGNORE_INDEX` are not scored (PyTorch's cross-entropy convention). The samplers
that draw training and evaluation windows are in :mod:`fbtrain.data.samplers`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fbtrain.config import MAX_VAL_FRACTION
from fbtrain.data.errors import DataError, TooShortToSplit

IGNORE_INDEX = -100  # a target position that no loss or metric counts (F.cross_entropy's default)


class Stream(NamedTuple):
    """A split as the model sees it: ``inputs`` and ``targets``, integer tensors ``[n]``.

    ``targets[i]`` is what the model must predict after reading ``inputs[: i + 1]``;
    :data:`IGNORE_INDEX` where nothing is scored. A text corpus predicts the next token
    (:func:`next_token_stream`); a labelled dataset scores only the positions it labels.
    Any integer dtype: a 100M-token corpus stays uint8 (inputs and targets two views of one
    buffer), labelled targets need a signed one; windows are drawn with :func:`window`,
    which makes them LongTensors.
    """

    inputs: torch.Tensor
    targets: torch.Tensor


def next_token_stream(ids: torch.Tensor) -> Stream:
    """Token ids ``[n]`` -> inputs ``ids[:-1]``, targets ``ids[1:]`` (``n - 1`` predictions):
    views of ``ids``, in its dtype, so nothing is copied."""
    return Stream(ids[:-1], ids[1:])


def as_stream(data: torch.Tensor | Stream) -> Stream:
    """A :class:`Stream` as it is; a 1-D tensor of ids as its next-token stream."""
    if isinstance(data, Stream):
        if not (isinstance(data.inputs, torch.Tensor) and data.inputs.dim() == 1
                and data.inputs.shape == data.targets.shape):
            raise TypeError("a Stream needs 1-D inputs and targets of the same length")
        if data.inputs.is_floating_point() or data.targets.is_floating_point():
            raise TypeError("a Stream holds integer token ids, not floats")
        return data
    _check_data(data)
    return next_token_stream(data)


def window(ids: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """``ids[index]`` as a new LongTensor (what embeddings and cross-entropy take), never a
    view of ``ids``: only the drawn windows of a compact (uint8) split are widened, and a
    caller may write into the result (e.g. :data:`IGNORE_INDEX`)."""
    return ids[index].to(torch.long, copy=True)


def split(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``int(n * (1 - val_fraction))`` ids for training, the rest for validation.

    Tiny Shakespeare (1,115,394 chars) with 0.1 gives 1,003,854 / 111,540. The tiny epsilon
    keeps float noise (e.g. 90 * (1 - 0.3) = 62.99999...) from losing a token; it never rounds up
    a genuine fraction, which is what the documented split relies on.
    """
    n_train = split_point(len(ids), val_fraction)
    train, val = ids[:n_train], ids[n_train:]
    check_split(len(train), len(val), val_fraction)
    return train, val


def check_split(n_train: int, n_val: int, val_fraction: float, unit: str = "tokens") -> None:
    """TooShortToSplit unless both splits hold at least 2 tokens (one prediction)."""
    if n_train < 2 or n_val < 2:
        raise TooShortToSplit(
            f"text too short to split: {n_train + n_val} {unit} with data.val_fraction = "
            f"{val_fraction} gives {n_train} train / {n_val} validation; each needs at least 2"
        )


def split_point(n: int, val_fraction: float) -> int:
    """How many of ``n`` tokens (or characters) :func:`split` keeps for training."""
    if not 0 < val_fraction <= MAX_VAL_FRACTION:  # also refuses NaN
        raise DataError(f"data.val_fraction = {val_fraction}: must be > 0 and <= "
                        f"{MAX_VAL_FRACTION}")
    return min(n, max(0, math.floor(n * (1 - val_fraction) + 1e-9)))


def _check_data(data: torch.Tensor) -> None:
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise TypeError("data must be a 1-D tensor of token ids")


def require_tokens(n: int, seq_len: int, what: str) -> None:
    """Raise DataError unless ``n`` tokens hold one window of ``seq_len`` inputs + target."""
    if n < seq_len + 1:
        raise DataError(
            f"{what} too short for seq_len {seq_len}: {n} tokens, need at least {seq_len + 1};"
            " use a shorter curriculum seq_len or a longer text"
        )
