"""Where each training step's micro-batches come from, and the memory carried between steps.

Two sources behind one interface, so the training loop never asks which context it runs:

- :class:`RandomWindows` (``train.context: reset``): independent random windows, each
  from empty memory.
- :class:`CarriedStreams` (``train.context: carry``): the next segment of every stream of a
  :class:`~fbtrain.data.StreamLayout`, run on the memory the previous segment left,
  detached (truncated back-propagation through time: memory flows forward across the
  segment boundary, gradients stop there).

The loop calls ``micro_batches`` once per step and ``keep`` with each micro-batch's new
memory; x, y are ``[batch, T]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fbtrain.data import BatchSampler, StreamLayout
from fbtrain.models import MemoryState

MicroBatch = tuple[Tensor, Tensor, MemoryState | None]  # inputs, targets, memory to start on


class RandomWindows:
    """Random windows from a :class:`~fbtrain.data.BatchSampler`; no memory is carried."""

    def __init__(self, sampler: BatchSampler, grad_accum: int):
        self.sampler = sampler
        self.grad_accum = grad_accum

    def micro_batches(self, seq_len: int, batch: int, device: torch.device) -> list[MicroBatch]:
        return [(*self.sampler.sample(batch, seq_len, device), None)
                for _ in range(self.grad_accum)]

    def keep(self, micro: int, state: MemoryState) -> None:
        """Nothing to keep: the next step starts from empty memory."""


class CarriedStreams:
    """``batch * grad_accum`` streams; micro-batch m owns rows ``[m * batch, (m+1) * batch)``
    and its own carried memory."""

    def __init__(self, layout: StreamLayout, grad_accum: int):
        self.layout = layout
        self.grad_accum = grad_accum
        self.states: list[MemoryState | None] = [None] * grad_accum

    def micro_batches(self, seq_len: int, batch: int, device: torch.device) -> list[MicroBatch]:
        """The next segment of every stream (``batch`` is fixed by the layout); at the start
        of the streams, after a wrap, the memory is empty again."""
        x, y, fresh = self.layout.segment(seq_len, device)
        if fresh:
            self.states = [None] * self.grad_accum
        rows = x.shape[0] // self.grad_accum
        return [(x[m * rows:(m + 1) * rows], y[m * rows:(m + 1) * rows], self.states[m])
                for m in range(self.grad_accum)]

    def keep(self, micro: int, state: MemoryState) -> None:
        self.states[micro] = state.detached()

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the carried memory: a resumed run continues bitwise."""
        return {"layout": self.layout.state_dict(),
                "memory": [None if s is None else s.to_dict() for s in self.states]}

    def load_state_dict(self, state: dict[str, Any], device: torch.device, *,
                        memory: bool = True) -> None:
        """Restore the cursor and (``memory``) the carried memory; without it, or when the
        saved memory does not fit, the streams go on from empty memory."""
        self.layout.load_state_dict(state["layout"])
        saved = state.get("memory") or []
        if memory and len(saved) == self.grad_accum:
            self.states = [None if s is None else MemoryState.from_dict(s, device) for s in saved]
        else:
            self.states = [None] * self.grad_accum
