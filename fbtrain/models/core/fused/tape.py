""":class:`FusedTape`: what the fused core's forward keeps for its backward.

Its own module so that the sweeps' host side (core.py) and the gradients after the sweep
(grads.py) both read it from below, neither importing the other's.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class FusedTape(NamedTuple):
    """What the forward keeps for the backward, all full-call buffers (a list of tensors, so
    graphs.py can capture a call). [L, T, B, ...] per layer and step unless said; the masks
    are empty without dropout. ``score`` holds step t's attention scores at their position
    rows (window slot j at row P - ell + j), and ``lse`` their log-sum-exp per head, so
    the probabilities are exp(score - lse). Attention records of steps that do not attend
    are not written (the backward never reads them); ``y`` there is x."""

    a: Tensor  # [L, T, B, D] LN1(x)
    mu1: Tensor  # [L, T, B]
    rs1: Tensor  # [L, T, B]
    qu: Tensor  # [L, T, B, D]
    score: Tensor  # [L, T, B, H, P]
    lse: Tensor  # [L, T, B, H]
    o: Tensor  # [L, T, B, D] the attention's output (after dropout on its probabilities)
    y: Tensor  # [L, T, B, D] x + attention: the feed-forward's input
    mu2: Tensor  # [L, T, B]
    rs2: Tensor  # [L, T, B]
    c: Tensor  # [L, T, B, D] LN2(y)
    h: Tensor  # [L, T, B, F] relu output, after dropout
    m_hat: Tensor  # [T, B, D] norm(m_t) (memory norm only)
    mu_m: Tensor  # [T, B]
    rs_m: Tensor  # [T, B]
    mask_att: Tensor  # as masks.Masks
    mask_prob: Tensor
    mask_h: Tensor
    mask_ff: Tensor
