"""Loss and accuracy over the scored targets: the one place that reads IGNORE_INDEX.

Training, validation and ``fbtrain eval`` all score through :func:`score_sums`, so a
dataset that labels only some positions (targets elsewhere :data:`IGNORE_INDEX`) gets the
same masked loss and accuracy everywhere, and a text corpus (every target scored) the
usual mean cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fbtrain.data.streams import IGNORE_INDEX


def score_sums(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Summed cross-entropy (nats), number of scored targets and number predicted right.

    logits ``[..., V]``, targets ``[...]`` (same leading shape; IGNORE_INDEX: not scored)
    -> three 0-dim tensors on the logits' device: the cross-entropy sum (float32, with
    gradients), the count and the correct count (int64). A prediction is right when the
    target is the arg-max of its logits.
    """
    flat = logits.float().reshape(-1, logits.shape[-1])  # [N, V]
    y = targets.reshape(-1)  # [N]
    ce = F.cross_entropy(flat, y, ignore_index=IGNORE_INDEX, reduction="sum")
    scored = y != IGNORE_INDEX
    correct = ((flat.detach().argmax(dim=-1) == y) & scored).sum()
    return ce, scored.sum(), correct


def count_scored(targets: Tensor) -> Tensor:
    """Scored targets in ``targets`` ``[...]``: a 0-dim int64 tensor on their device."""
    return (targets != IGNORE_INDEX).sum()


@dataclass
class Scores:
    """Running sums of :func:`score_sums` (float64 for the loss); ``loss`` and ``accuracy``
    are means over the scored targets (NaN when none was scored).

    Each batch's sums stay on the device until a figure is asked for: then they are read
    in one host sync, however many batches, and added up in the order they came."""

    _loss_sum: float = 0.0
    _count: int = 0
    _correct: int = 0
    _pending: list[Tensor] = field(default_factory=list)  # [3] float64 each, on the device

    def add(self, logits: Tensor, targets: Tensor) -> None:
        ce, count, correct = score_sums(logits, targets)
        self._pending.append(torch.stack([ce.detach().double(), count.double(),
                                          correct.double()]))

    def _settle(self) -> None:
        if not self._pending:
            return
        rows = torch.stack(self._pending).tolist()  # the one read
        self._pending.clear()
        for loss, count, correct in rows:
            self._loss_sum += loss
            self._count += int(count)
            self._correct += int(correct)

    @property
    def count(self) -> int:
        self._settle()
        return self._count

    @property
    def loss(self) -> float:
        self._settle()
        return self._loss_sum / self._count if self._count else float("nan")

    @property
    def accuracy(self) -> float:
        self._settle()
        return self._correct / self._count if self._count else float("nan")


def window_scores(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> Scores:
    """Loss and accuracy over the scored targets of windows x, y ``[N, T]``, each window from
    empty memory, ``batch_size`` windows per forward.

    Runs the model as it finds it: the caller holds :func:`fbtrain.inference.inference`
    (validation, ``fbtrain eval``, :func:`fbtrain.evaluate.mean_loss`), which owns eval
    mode, autograd and precision, so they are set in one place."""
    scores = Scores()
    for start in range(0, x.shape[0], batch_size):
        logits, _ = model(x[start:start + batch_size])
        scores.add(logits, y[start:start + batch_size])
    return scores
