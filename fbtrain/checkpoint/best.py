"""``best.pt`` kept true to the best validation loss the run recorded.

``best.pt`` is written when an evaluation beats the best so far, right after ``last.pt``
(:meth:`~fbtrain.checkpoint.files.CheckpointManager.save`). When that copy fails (a disk
that fills) the run stops, but the best loss is already recorded in ``last.pt``'s
progress: resumed as it was, the run would report that loss as its best while ``best.pt``
kept an older step for good, and ``fbtrain sample`` used it. So a resume compares the two
(:func:`heal_best`) and puts back, as ``best.pt``, the checkpoint that scored the recorded
best (``last.pt`` or a numbered one), or says that none was kept.
"""

from __future__ import annotations

from pathlib import Path

from fbtrain.checkpoint.files import CheckpointManager, atomic_copy, peek_checkpoint
from fbtrain.checkpoint.state import upgrade
from fbtrain.rundir_names import BEST


def scored_best(path: Path) -> tuple[int, float] | None:
    """``(step, validation loss)`` of the checkpoint ``path`` when it was saved right after
    an evaluation of its own step that was the best so far (as best.pt is); None when it
    was not, or cannot be read."""
    payload = peek_checkpoint(path) if path.is_file() else None
    progress = upgrade(payload).get("progress") if payload is not None else None
    if not isinstance(progress, dict):
        return None
    step, loss = progress.get("step"), progress.get("val_loss")
    if not isinstance(step, int) or not isinstance(loss, float):
        return None
    if progress.get("val_step", step) != step or progress.get("best_val_loss") != loss:
        return None
    return step, loss


def heal_best(manager: CheckpointManager, best_loss: float | None) -> str | None:
    """Make ``best.pt`` the checkpoint that scored ``best_loss`` (the best validation loss
    the resumed checkpoint recorded) when it is not: the newest of ``last.pt`` and the
    numbered checkpoints that did is copied over it. Returns the line saying what was done,
    or that the checkpoint was not kept; None when ``best.pt`` is right or no best was
    recorded. Call on rank 0 with the run directory's lock held."""
    if best_loss is None or not manager.entries():  # a folder emptied (moved) by hand
        return None
    held = scored_best(manager.best_path)
    if held is not None and held[1] == best_loss:
        return None
    held_text = (f"step {held[0]} (val loss {held[1]:.4f})" if held is not None else None)
    missing = not manager.best_path.exists()
    recorded = f"the best validation loss the run recorded ({best_loss:.4f})"
    for path in (manager.last_path, *reversed(manager.numbered())):
        scored = scored_best(path)
        if scored is not None and scored[1] == best_loss:
            atomic_copy(path, manager.best_path)
            was = (f"held {held_text}" if held_text else "was missing" if missing
                   else "was not saved after a best evaluation")
            return (f"{BEST} {was}: it is now a copy of {path.name} (step {scored[0]}), which "
                    f"scored {recorded}")
    now = (f"holds {held_text}" if held_text else "is missing" if missing
           else "is not saved after a best evaluation")
    return (f"{BEST} {now}, not the checkpoint of {recorded}, which was not kept (a save that "
            f"failed); the next evaluation that beats it replaces {BEST}")
