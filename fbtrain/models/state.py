"""The memory a model carries between calls (chunked evaluation, incremental sampling)."""

from __future__ import annotations

from dataclasses import dataclass

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
