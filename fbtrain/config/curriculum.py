"""The curriculum's arithmetic: which stage, sequence length and batch size each optimizer
step trains with, and the tokens over the whole run.

A pure function of the step index and the config (no hidden state), so a resumed run gets
exactly the curriculum of an uninterrupted one. It lives in config/ because the config plans
with it (the memory estimate, :mod:`fbtrain.config.budget`) and the trainer reads it; it
imports nothing but the config's own types, and no torch (``fbtrain --help`` loads the
config and must not wait for torch).
"""

from __future__ import annotations

from fbtrain.config.schema import CurriculumStage
from fbtrain.config.tree import Config


class Curriculum:
    """The curriculum's arithmetic: which stage, sequence length and batch size each
    optimizer step (0-based index) trains with, and the tokens over the whole run.

    A stage with ``until_step: 300`` holds the steps with index < 300; the last stage holds
    the rest. With ``train.constant_tokens`` a shorter stage gets a larger batch, so every
    step trains about as many tokens as one of the last stage.
    """

    def __init__(self, cfg: Config):
        self.stages = list(cfg.curriculum)
        self.train = cfg.train

    def stage_index_at(self, step: int) -> int:
        """Index of the curriculum stage that holds ``step`` (0-based)."""
        for i, stage in enumerate(self.stages):
            if stage.until_step is None or step < stage.until_step:
                return i
        return len(self.stages) - 1

    def stage_at(self, step: int) -> CurriculumStage:
        """The curriculum stage that holds ``step`` (0-based)."""
        return self.stages[self.stage_index_at(step)]

    def seq_len_at(self, step: int) -> int:
        """Sequence length of the curriculum stage that holds ``step`` (0-based)."""
        return self.stage_at(step).seq_len

    def batch_size_at(self, step: int) -> int:
        """Batch size at ``step``: scaled up for short stages when ``constant_tokens`` is on."""
        if not self.train.constant_tokens:
            return self.train.batch_size
        tokens = self.train.batch_size * self.stages[-1].seq_len
        return max(1, tokens // self.seq_len_at(step))

    @property
    def max_seq_len(self) -> int:
        """The longest sequence of any stage."""
        return max(s.seq_len for s in self.stages)

    def total_tokens(self) -> int:
        """Training tokens over all ``max_steps`` (one rank; micro-batches included)."""
        total, start = 0, 0
        for stage in self.stages:
            end = self.train.max_steps if stage.until_step is None else min(
                stage.until_step, self.train.max_steps)
            if end > start:
                total += (end - start) * self.batch_size_at(start) * stage.seq_len
            start = max(start, end)
        return total * self.train.grad_accum
