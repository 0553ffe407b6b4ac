"""Every seed and random state of a run, in one place: seed, preserve (and, in the
checkpoint, capture and restore).

A run's numbers depend on three streams: Python's ``random``, torch's global generator
(initialisation, dropout) on the CPU and each CUDA device, and the batch sampler's own
generator (``data``). Seeding them in a fixed order and saving all of them is what makes a
resumed run bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch


def seed_everything(seed: int) -> None:
    """Python and torch (CPU and every CUDA device) from ``seed``; nothing in fbtrain draws
    from numpy."""
    random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def preserve_rng(device: torch.device) -> Iterator[None]:
    """Run a block (evaluation, sampling) without moving Python's, torch's or CUDA's RNG."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(state)
