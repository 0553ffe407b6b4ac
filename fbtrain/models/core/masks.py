"""The dropout masks of one core call, drawn before the sweep in one fixed order from the
global generator, as the C++ core draws them: so from one seed both cores (C++ and PyTorch)
drop the same units, and a core's result does not depend on how it splits the batch.
Masks are bool (a quarter of float masks' memory: gigabytes at a GPU's batch sizes), scaled
by :attr:`Masks.scale` where they are applied.

Shapes as in ``spec.py``: B batch, T steps, D width, H heads, F feed-forward width, L layers,
n0 carried slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fbtrain.models.core.spec import CoreSpec


@dataclass
class Masks:
    """Inverted-dropout masks (bool: kept or dropped), drawn in one go as the C++ core
    draws them; a kept unit is scaled by ``scale`` (1/(1-p) in the activations' dtype).

    att [L, n_att, B, D]; prob [L, sum_t B*H*ell_t] (step t's [B, H, ell_t] block starts at
    ``prob_offset[t]``); h [L, T, B, F]; ff [L, T, B, D].
    """

    att: Tensor
    prob: Tensor
    h: Tensor
    ff: Tensor
    prob_offset: list[int]
    scale: float

    def drop(self, x: Tensor, mask: Tensor) -> Tensor:
        """``x`` after dropout with ``mask``, as a new tensor: bitwise ``x * m`` for the
        float mask m (0 or 1/(1-p)) that ``bernoulli_(1-p).div_(1-p)`` would make."""
        return (x * mask).mul_(self.scale)

    def drop_(self, x: Tensor, mask: Tensor) -> Tensor:
        """:meth:`drop`, in place."""
        return x.mul_(mask).mul_(self.scale)

    def prob_of(self, layer: int, t: int, B: int, H: int, ell: int) -> Tensor:
        """Layer ``layer``'s mask on step t's attention probabilities: [B, H, ell]."""
        start = self.prob_offset[t]
        return self.prob[layer, start:start + B * H * ell].view(B, H, ell)


def window_of(slot: int, window: int) -> tuple[int, int]:
    """First slot and length of the memory window seen by the step that creates ``slot``."""
    lo = max(0, slot - window)
    return lo, slot - lo


def prob_offsets(spec: CoreSpec, n0: int, T: int, B: int) -> list[int]:
    """Where step t's [B, H, ell_t] block starts in a layer's probability mask
    (:attr:`Masks.prob`), for t = 0 .. T: the last entry is the mask's length."""
    offsets = [0]
    for t in range(T):
        offsets.append(offsets[-1] + B * spec.n_heads * window_of(n0 + t, spec.window)[1])
    return offsets


def draw_masks(spec: CoreSpec, like: Tensor, n0: int, F: int) -> Masks | None:
    """The dropout masks of one call (None without dropout), in the C++ core's order."""
    if not spec.dropout:
        return None
    B, T, D = like.shape
    L, p = spec.n_layers, spec.dropout
    n_att = max(0, T - (0 if n0 > 0 else 1))
    offsets = prob_offsets(spec, n0, T, B)
    size = offsets.pop()

    def mask(*shape: int) -> Tensor:  # bernoulli_ draws one value an element, any dtype
        return like.new_empty(shape, dtype=torch.bool).bernoulli_(1.0 - p)

    # 1/(1-p) divided in the activations' dtype, on the host (no device sync), as
    # bernoulli_(1-p).div_(1-p) computes a float mask's kept value.
    scale = torch.ones((), dtype=like.dtype).div_(1.0 - p).item()
    att, prob = mask(L, n_att, B, D), mask(L, size)
    return Masks(att, prob, mask(L, T, B, F), mask(L, T, B, D), offsets, scale)
