"""A run's training wall time across its segments (one segment per process that trained
it: a run stopped with Ctrl-C and resumed has two), for the closing line's totals.

A part of the checkpoint, as ``clock``: what it holds is the time up to that save, so a
run resumed from an older checkpoint (a rewind) counts from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fbtrain.checkpoint.state import expect_dict
from fbtrain.messages import is_int, is_number


@dataclass
class RunClock:
    """Seconds and segments before this one (restored from a checkpoint; 0 when fresh),
    and this segment's start (``time.perf_counter``; never saved)."""

    seconds: float = 0.0
    segments: int = 0
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Seconds of this segment so far."""
        return time.perf_counter() - self.started

    def total_seconds(self) -> float:
        """Seconds of every segment so far, this one included."""
        return self.seconds + self.elapsed()

    @property
    def resumed(self) -> bool:
        """Whether an earlier segment trained this run (as far as its checkpoint says)."""
        return self.segments > 0

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.total_seconds(), "segments": self.segments + 1}

    def state_problem(self, state: Any) -> str:
        if state is None:
            return ""  # saved before the clock was: this segment counts from zero
        problem = expect_dict(state)
        if problem:
            return problem
        if not (is_number(state.get("seconds")) and state["seconds"] >= 0):
            return f"seconds is {state.get('seconds')!r}, not a number >= 0"
        if not (is_int(state.get("segments")) and state["segments"] >= 1):
            return f"segments is {state.get('segments')!r}, not an integer >= 1"
        return ""

    def load_state_dict(self, state: Any) -> None:
        self.seconds, self.segments = float(state["seconds"]), int(state["segments"])
