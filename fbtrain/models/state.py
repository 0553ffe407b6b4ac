"""The memory a model carries between calls (chunked evaluation, incremental sampling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class MemoryState:
    """Keys and values of the newest memory slots, at most ``mem_len`` of them.

    keys, values: [n_sets, batch * heads, slots, d_k]. A feedback_kv model keeps one set
    (shared by all layers: one key/value pair per past step); feedback and transformer keep
    one per layer. ``steps`` counts every token consumed so far.
    """

    keys: Tensor
    values: Tensor
    steps: int

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def detached(self) -> MemoryState:
        """The same memory cut from the graph: what a later segment may read but not
        back-propagate into (truncated back-propagation through time)."""
        return MemoryState(self.keys.detach(), self.values.detach(), self.steps)

    def to_dict(self) -> dict[str, Any]:
        """Plain tensors and ints, safe for ``torch.load(weights_only=True)``."""
        return {"keys": self.keys, "values": self.values, "steps": self.steps}

    @classmethod
    def from_dict(cls, state: dict[str, Any], device: torch.device | str) -> MemoryState:
        return cls(state["keys"].to(device), state["values"].to(device), int(state["steps"]))
