"""Deterministic loss, bits per character and perplexity (used by ``train`` and ``eval``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fbtrain.data import IGNORE_INDEX

LN2 = math.log(2.0)


def loss_figures(loss: float) -> dict[str, float]:
    """Cross-entropy in nats -> loss, bits per character and perplexity.

    exp() overflows past ~709 nats; a diverged model's perplexity is reported as inf.
    """
    return {"loss": loss, "bpc": loss / LN2,
            "perplexity": math.exp(loss) if loss < 700 else math.inf}


@torch.no_grad()
def mean_loss(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> float:
    """Mean cross-entropy in nats over the scored targets of windows x, y: [N, T] (each
    window from empty memory; targets equal to IGNORE_INDEX are not scored). Runs in eval
    mode and restores the model's mode afterwards."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, x.shape[0], batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            logits, _ = model(xb)
            total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                     yb.reshape(-1), reduction="sum").item()
            count += int((yb != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    return total / count


CONTEXTS = ("reset", "carry")


@torch.no_grad()
def evaluate_split(
    model: nn.Module, ids: Tensor, seq_len: int, batch_size: int, *, context: str = "reset"
) -> dict[str, Any]:
    """Score every character of ``ids`` [n] but the first: n - 1 predictions, each once.

    The predictions are cut into consecutive windows of ``seq_len`` (the last one shorter).

    - ``context="reset"``: each window starts from empty memory, as in training; full windows
      run ``batch_size`` side by side (tokens [B, seq_len]), the short last one on its own.
    - ``context="carry"``: the split is one stream fed in ``seq_len`` chunks with the memory
      state carried across them (batch 1), so every prediction sees up to ``mem_len`` earlier
      characters. Exact, but sequential: for a feedback model this costs n model steps
      one after another whatever ``batch_size`` is.

    Deterministic (eval mode, no sampling); the model's mode is restored afterwards. Summed
    cross-entropy is accumulated in float64. Returns ``loss`` (mean nats per character),
    ``bpc`` (loss / ln 2), ``perplexity`` (exp(loss)), ``tokens`` (n - 1), ``seq_len`` and
    ``context``.
    """
    if context not in CONTEXTS:
        raise ValueError(f"context = {context!r}: must be one of {', '.join(CONTEXTS)}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len = {seq_len!r}: must be an integer >= 1")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an integer >= 1")
    if ids.dim() != 1 or len(ids) < 2:
        raise ValueError(f"need a 1-D tensor of at least 2 token ids, got shape "
                         f"{tuple(ids.shape)}")
    device = next(model.parameters()).device
    ids = ids.long().to(device)
    inputs, targets = ids[:-1], ids[1:]  # prediction i reads inputs[..i], scores targets[i]
    n = len(targets)
    total = torch.zeros((), dtype=torch.float64, device=device)

    def add(x: Tensor, y: Tensor, state: Any = None) -> Any:
        """Run tokens x [B, T] (on ``state``), add the summed CE against y [B, T]."""
        nonlocal total
        logits, new_state = model(x, state)
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                 reduction="sum").double()
        return new_state

    was_training = model.training
    model.eval()
    try:
        if context == "reset":
            full = n // seq_len
            x_full = inputs[: full * seq_len].view(full, seq_len)
            y_full = targets[: full * seq_len].view(full, seq_len)
            for start in range(0, full, batch_size):
                add(x_full[start:start + batch_size], y_full[start:start + batch_size])
            if n % seq_len:
                add(inputs[full * seq_len:][None], targets[full * seq_len:][None])
        else:
            state = None
            for start in range(0, n, seq_len):
                chunk = slice(start, start + seq_len)
                state = add(inputs[chunk][None], targets[chunk][None], state)
    finally:
        model.train(was_training)
    return {
        **loss_figures(total.item() / n),
        "tokens": n,
        "seq_len": seq_len,
        "context": context,
    }


def run(
    checkpoint: str,
    *,
    split: str = "val",
    seq_len: int | None = None,
    batch_size: int = 64,
    data_path: str | None = None,
    context: str = "reset",
    device: str = "auto",
) -> dict[str, Any]:
    """``fbtrain eval``: loss / bpc / perplexity of a checkpoint on the train or val split.

    The text is ``data_path`` when given, else what the checkpoint's training config names
    (``config["data"]``: its local path or the cached download); it is encoded with the
    checkpoint's vocabulary and split with the checkpoint's ``val_fraction``. ``seq_len``
    defaults to the last curriculum stage's. Returns :func:`evaluate_split`'s dict plus
    ``split``, ``checkpoint`` (the file used) and ``step``. Raises ValueError, DataError,
    CheckpointError or DeviceError with one line (the CLI turns them into exit code 2).
    """
    from fbtrain.checkpoint import CheckpointError, load_model, resolve_checkpoint
    from fbtrain.config import DataConfig
    from fbtrain.data import DataError, load_text
    from fbtrain.data import split as split_ids
    from fbtrain.device import resolve_device

    if split not in ("train", "val"):
        raise ValueError(f"split = {split!r}: must be train or val")
    if context not in CONTEXTS:
        raise ValueError(f"context = {context!r}: must be one of {', '.join(CONTEXTS)}")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"seq_len = {seq_len!r}: must be an integer >= 1")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an integer >= 1")
    target = resolve_device(device)
    file = resolve_checkpoint(checkpoint, prefer="best")
    model, tokenizer, payload = load_model(file, target)
    cfg = payload.get("config")
    if not isinstance(cfg, dict):
        cfg = {}
    raw_data = cfg.get("data")
    if not isinstance(raw_data, dict):
        if data_path is None:
            raise CheckpointError(f"{file}: holds no data config; pass the text with a data path")
        raw_data = {}
    try:
        data_cfg = DataConfig(**raw_data)
    except TypeError as e:
        raise CheckpointError(f"{file}: bad data config: {e}") from None
    if data_path is not None:
        data_cfg.path = str(data_path)
    if seq_len is None:
        seq_len = _last_seq_len(cfg.get("curriculum"))
        if seq_len is None:
            raise CheckpointError(f"{file}: holds no curriculum to take seq_len from; "
                                  "pass seq_len")

    text = load_text(data_cfg)
    where = f"data.path {data_cfg.path}" if data_cfg.path else f"dataset {data_cfg.dataset}"
    try:
        ids = tokenizer.encode(text)
    except DataError as e:
        raise DataError(f"{where} does not fit the vocabulary of checkpoint {file}: {e}") from None
    train_ids, val_ids = split_ids(ids, data_cfg.val_fraction)
    result = evaluate_split(model, train_ids if split == "train" else val_ids, seq_len,
                            batch_size, context=context)
    return {**result, "split": split, "checkpoint": str(file), "step": payload.get("step")}


def _last_seq_len(curriculum: Any) -> int | None:
    if isinstance(curriculum, list) and curriculum and isinstance(curriculum[-1], dict):
        value = curriculum[-1].get("seq_len")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def format_result(result: dict[str, Any]) -> str:
    """The human-readable form of :func:`run`'s dict: one ``name  value`` line per figure."""
    rows = [
        ("checkpoint", result.get("checkpoint")),
        ("step", result.get("step")),
        ("split", result.get("split")),
        ("context", result.get("context")),
        ("seq_len", result.get("seq_len")),
        ("tokens", f"{result['tokens']:,}"),
        ("loss", f"{result['loss']:.4f} nats/char"),
        ("bpc", f"{result['bpc']:.4f}"),
        ("perplexity", f"{result['perplexity']:.3f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows if value is not None)
