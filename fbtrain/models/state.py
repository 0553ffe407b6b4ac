"""The memory a model carries between calls (chunked evaluation, incremental sampling,
training on carried streams)."""

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

    ``sources``: what those keys and values were projected from - the memory vectors
    (feedback kinds, [1, batch, slots, D]) or each layer's inputs (transformer,
    [n_layers, batch, slots, D]). Differentiable calls keep them, and a call that gets them
    re-projects the carried keys and values with the current weights, as Transformer-XL and
    the paper's code do when training on carried memory: keys made by last step's weights
    would not fit this step's queries, and the weights would get no gradient from the
    carried slots. Decoding and evaluation (no gradients, fixed weights) keep none and use
    the keys and values as they are, at no extra cost per token.
    """

    keys: Tensor
    values: Tensor
    steps: int
    sources: Tensor | None = None

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def detached(self) -> MemoryState:
        """The same memory cut from the graph: what a later segment may read but not
        back-propagate into (truncated back-propagation through time)."""
        sources = None if self.sources is None else self.sources.detach()
        return MemoryState(self.keys.detach(), self.values.detach(), self.steps, sources)

    def to_dict(self) -> dict[str, Any]:
        """Plain tensors and ints, safe for ``torch.load(weights_only=True)``."""
        return {"keys": self.keys, "values": self.values, "steps": self.steps,
                "sources": self.sources}

    @staticmethod
    def state_problem(state: Any, batch: int) -> str:
        """What keeps a :meth:`to_dict` of ``batch`` rows from being loaded ('' when
        nothing does): its layout, not its values."""
        if not isinstance(state, dict):
            return "not a dict of keys, values, steps and sources"
        keys, values, sources = state.get("keys"), state.get("values"), state.get("sources")
        if not (torch.is_tensor(keys) and torch.is_tensor(values) and keys.dim() == 4
                and values.shape == keys.shape):
            return "keys and values are not two tensors [n_sets, batch * heads, slots, d_k]"
        if keys.shape[1] % batch:
            return f"keys of {keys.shape[1]} rows x heads do not fit {batch} rows"
        steps = state.get("steps")
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
            return f"steps is {steps!r}, not an integer >= 0"
        if sources is not None and not (torch.is_tensor(sources) and sources.dim() == 4
                                        and sources.shape[1] == batch):
            return f"sources are not a tensor [n, {batch}, slots, d_model]"
        return ""

    @classmethod
    def from_dict(cls, state: dict[str, Any], device: torch.device | str) -> MemoryState:
        sources = state.get("sources")
        return cls(state["keys"].to(device), state["values"].to(device), int(state["steps"]),
                   None if sources is None else sources.to(device))


def kept_sources(state: MemoryState, new: Tensor, window: int) -> Tensor | None:
    """The sources of the state after a call that added ``new`` [n, batch, T, D]: the newest
    ``window`` slots, or None when the call is not differentiable or the carried slots
    came without sources (they could not be re-projected)."""
    if not torch.is_grad_enabled() or (state.sources is None and state.slots):
        return None
    old = state.sources if state.sources is not None else new[:, :, :0]
    return torch.cat([old.to(new.dtype), new], 2)[:, :, -window:]
