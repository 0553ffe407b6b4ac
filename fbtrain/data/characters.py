"""How many characters the scored targets of a split cover: the denominator of bits per
character, so that runs with different tokenizers compare on one scale.

Bits per character = nats summed over the scored tokens / the characters they cover / ln 2.
A tokenizer whose tokens are one character each (characters, bytes, the programs' words)
reports no per-token counts (:meth:`~fbtrain.data.tokenizers.Tokenizer.characters`): its
bits per character are the loss / ln 2, computed as before, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from fbtrain.data.streams import IGNORE_INDEX

_CHUNK = 1 << 22  # targets counted at a time (a 100M-token split is never widened whole)


def characters_covered(tokenizer: Any, targets: torch.Tensor) -> tuple[int, int] | None:
    """``(characters, scored)``: the characters covered by the scored targets ``[...]``
    (any integer dtype, any device; IGNORE_INDEX: not scored) and how many were scored;
    None when every token is one character."""
    per_token = tokenizer.characters()
    if per_token is None:
        return None
    counts = torch.zeros(len(per_token), dtype=torch.long)
    flat = targets.reshape(-1)
    for start in range(0, len(flat), _CHUNK):
        chunk = flat[start:start + _CHUNK].to("cpu", torch.long)
        counts += torch.bincount(chunk[chunk != IGNORE_INDEX], minlength=len(per_token))
    return int((counts * per_token).sum()), int(counts.sum())


def chars_per_token(tokenizer: Any, targets: torch.Tensor) -> float:
    """Characters per scored target ``[...]`` (1.0 when every token is one character)."""
    covered = characters_covered(tokenizer, targets)
    if covered is None or not all(covered):
        return 1.0
    chars, scored = covered
    return chars / scored
