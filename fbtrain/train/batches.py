"""Where each training step's micro-batches come from, and the memory carried between steps.

Two sources behind one interface, so the training loop never asks which context it runs:

- :class:`RandomWindows` (``train.context: reset``): independent random windows, each
  from empty memory.
- :class:`CarriedStreams` (``train.context: carry``): the next segment of every stream of a
  :class:`~fbtrain.data.samplers.SegmentReader`, run on the memory the previous segment left,
  detached (truncated back-propagation through time: memory flows forward across the
  segment boundary, gradients stop there).

The loop calls ``micro_batches`` once per step and ``keep`` with each micro-batch's new
memory; x, y are ``[batch, T]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fbtrain.data.errors import DataError
from fbtrain.data.samplers import BatchSampler, SegmentReader
from fbtrain.messages import a_type
from fbtrain.models import MemoryState

MicroBatch = tuple[Tensor, Tensor, MemoryState | None]  # inputs, targets, memory to start on


class RandomWindows:
    """Random windows from a :class:`~fbtrain.data.samplers.BatchSampler`; no memory is carried."""

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
    and its own carried memory.

    A part of the checkpoint (:mod:`fbtrain.checkpoint.state`): the cursor and the memory.
    Only rank 0's memory is saved, so ``restores_memory=False`` (the other ranks) loads the
    cursor and goes on from empty memory; memory that does not fit is refused, never
    dropped.
    """

    def __init__(self, layout: SegmentReader, grad_accum: int,
                 device: torch.device | str = "cpu", *, restores_memory: bool = True):
        self.layout = layout
        self.grad_accum = grad_accum
        self.device = device
        self.restores_memory = restores_memory
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

    def state_problem(self, state: Any) -> str:
        """What keeps a saved :meth:`state_dict` from continuing these streams ('' when
        nothing does)."""
        if state is None:
            return ("missing: the checkpoint was trained with train.context reset, which "
                    "carries no streams; resume with train.context = reset")
        if not isinstance(state, dict):
            return f"is {a_type(state)}, not a dict of layout and memory"
        problem = self.layout.state_problem(state.get("layout"))
        if problem or not self.restores_memory:
            return problem
        saved = state.get("memory")
        if not isinstance(saved, list) or len(saved) != self.grad_accum:
            count = len(saved) if isinstance(saved, list) else a_type(saved)
            return (f"the carried memory of {count} micro-batches does not fit "
                    f"train.grad_accum = {self.grad_accum}; resume with the grad_accum (and "
                    "batch_size) it was trained with")
        rows = len(self.layout.starts) // self.grad_accum
        for m, s in enumerate(saved):
            problem = "" if s is None else MemoryState.state_problem(s, rows)
            if problem:
                return f"the carried memory of micro-batch {m}: {problem}"
        return ""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor and (``restores_memory``) the carried memory."""
        problem = self.state_problem(state)
        if problem:
            raise DataError(problem)
        self.layout.load_state_dict(state["layout"])
        saved = state["memory"] if self.restores_memory else [None] * self.grad_accum
        self.states = [None if s is None else MemoryState.from_dict(s, self.device)
                       for s in saved]
