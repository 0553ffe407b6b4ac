"""Deterministic loss, bits per character and perplexity (used by ``train`` and ``eval``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fbtrain.config import INT64_MAX
from fbtrain.config.fields import int_bound
from fbtrain.config.limits import allocation_failed, is_allocation_failure
from fbtrain.config.schema import CONTEXTS, SPLITS
from fbtrain.data.characters import characters_covered
from fbtrain.data.streams import IGNORE_INDEX, Stream, as_stream, window
from fbtrain.errors import ArgumentError, OutOfMemory
from fbtrain.inference import inference, saved_precision
from fbtrain.progress import Progress
from fbtrain.scoring import Scores, window_scores

LN2 = math.log(2.0)


def loss_figures(loss: float, chars_per_token: float = 1.0) -> dict[str, float]:
    """Cross-entropy in nats per token -> loss, bits per character and perplexity (per
    token). ``chars_per_token``: characters the scored tokens cover, per token
    (:mod:`fbtrain.data.characters`; 1.0: a token is a character, and bpc is loss / ln 2).

    exp() overflows past ~709 nats; a diverged model's perplexity is reported as inf (and
    a NaN loss's as NaN, not as inf).
    """
    return {"loss": loss, "bpc": loss / LN2 / chars_per_token,
            "perplexity": math.inf if loss > 700 else math.exp(loss)}


def mean_loss(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> float:
    """Mean cross-entropy in nats over the scored targets of windows x, y: [N, T] (each
    window from empty memory; targets equal to IGNORE_INDEX are not scored), in the one
    inference context at fp32 on the model's device; the model's mode is put back."""
    device = next(model.parameters(), torch.empty(0)).device
    with inference(model, "fp32", device):
        return window_scores(model, x, y, batch_size).loss



def evaluate_split(
    model: nn.Module, ids: Tensor | Stream, seq_len: int, batch_size: int, *,
    context: str = "reset", history: int = 0, precision: str = "fp32",
    show_progress: bool = False
) -> dict[str, Any]:
    """Score every prediction of a split once: ``ids`` [n] (a text: n - 1 next-token
    predictions) or a :class:`~fbtrain.data.streams.Stream` (its scored targets only).

    The predictions are cut into consecutive windows of ``seq_len`` (the last one shorter).

    - ``context="reset"``: each window starts from empty memory ``history`` tokens before
      it (those are read, not scored; 0: as in training with reset context); windows with
      their whole history run ``batch_size`` side by side (tokens [B, history + seq_len]),
      the first ones and the short last one on their own. A labelled dataset whose
      predictions depend on at most ``history`` earlier tokens (the algorithmic programs:
      the longest program) is then scored exactly, in parallel.
    - ``context="carry"``: the split is one stream fed in ``seq_len`` chunks with the memory
      state carried across them (batch 1), so every prediction sees up to ``mem_len`` earlier
      characters. Exact, but sequential: for a feedback model this costs n model steps
      one after another whatever ``batch_size`` is.

    Deterministic: runs in the inference context (:func:`fbtrain.inference.inference`: eval
    mode, autocast at ``precision``, no autograd, frozen weights, the RNG untouched), as
    validation during training does; the model's mode is restored afterwards. Summed
    cross-entropy is accumulated in float64. Returns ``loss`` (mean nats per scored
    target), ``bpc`` (loss / ln 2), ``perplexity`` (exp(loss)), ``accuracy`` (arg-max
    right, over the scored targets), ``tokens`` (predictions run), ``scored`` (targets
    scored), ``seq_len`` (the window length used: the number of predictions when the split
    is shorter than ``seq_len``), ``context`` and ``precision``.

    ``show_progress``: a progress line of the windows scored on stderr when it is a
    terminal (a long evaluation takes minutes; nothing is printed elsewhere).
    """
    _check_split_args(ids, seq_len, batch_size, context, history)
    device = next(model.parameters()).device
    # prediction i reads inputs[..i], scores targets[i]; a compact (uint8) split stays
    # compact on the device, only the windows run are widened
    inputs, targets = (t.to(device, non_blocking=True) for t in as_stream(ids))
    n = len(targets)
    if n < 1:
        raise ArgumentError("need at least one prediction to score, got an empty split")
    seq_len = min(seq_len, n)  # a window past the split is the split: nothing sized by more
    scores = Scores()
    shown = Progress(-(-n // seq_len), desc=f"eval ({context})", unit="windows") \
        if show_progress else None

    def add(x: Tensor, y: Tensor, state: Any = None) -> Any:
        """Run tokens x [B, T] (on ``state``), add the scores against y [B, T]."""
        logits, new_state = model(x, state)
        scores.add(logits, y)
        if shown is not None:
            shown.update(x.shape[0])
        return new_state

    try:
        with inference(model, precision, device):
            if context == "reset":
                _score_reset_windows(add, inputs, targets, seq_len, batch_size, history)
            else:
                state = None
                for start in range(0, n, seq_len):
                    chunk = slice(start, start + seq_len)
                    state = add(window(inputs, chunk)[None], window(targets, chunk)[None], state)
    finally:
        if shown is not None:
            shown.close()
    return {
        **loss_figures(scores.loss),
        "accuracy": scores.accuracy,
        "tokens": n,
        "scored": scores.count,
        "seq_len": seq_len,  # what was used: a split shorter than one window is one
        "context": context,
        **({"history": history} if context == "reset" and history else {}),
        "precision": precision,
    }


def check_window_args(seq_len: int | None, batch_size: int, context: str) -> None:
    """ArgumentError (one line) for a window length, batch size or context that cannot work;
    ``seq_len`` None: the checkpoint's own (checked later)."""
    if context not in CONTEXTS:
        raise ArgumentError(f"context = {context!r}: must be one of {', '.join(CONTEXTS)}")
    if seq_len is not None:
        check_count("seq_len", seq_len)
    check_count("batch_size", batch_size)


def check_count(name: str, value: Any) -> None:
    """ArgumentError (one line) unless ``value`` is an integer in [1, 2^63 - 1]; the CLI's
    ``--seq-len`` and ``--batch-size`` are checked with it too."""
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT64_MAX):
        raise ArgumentError(f"{name} = {value!r}: must be {int_bound(value) or 'an integer >= 1'}")


def _check_split_args(ids: Tensor | Stream, seq_len: int, batch_size: int, context: str,
                      history: int) -> None:
    """ArgumentError naming the first argument of :func:`evaluate_split` that cannot work."""
    if seq_len is None:
        raise ArgumentError("seq_len = None: must be an integer >= 1")
    check_window_args(seq_len, batch_size, context)
    if not isinstance(history, int) or history < 0:
        raise ArgumentError(f"history = {history!r}: must be an integer >= 0")
    if not isinstance(ids, Stream) and (ids.dim() != 1 or len(ids) < 2):
        raise ArgumentError(f"need a 1-D tensor of at least 2 token ids, got shape "
                         f"{tuple(ids.shape)}")


def _score_reset_windows(add: Any, inputs: Tensor, targets: Tensor, seq_len: int,
                         batch_size: int, history: int) -> None:
    """``context="reset"``: windows of ``seq_len`` predictions [n], each after ``history``
    unscored tokens from empty memory; those with their full history and length run
    ``batch_size`` at a time ([B, history + seq_len]), the rest one by one."""
    n, device = len(targets), targets.device
    starts = list(range(0, n, seq_len))
    batched = [a for a in starts if a >= history and a + seq_len <= n]
    span = torch.arange(history + seq_len, device=device)
    # The batched starts step by seq_len, so a batch's index is made on the device from its
    # first start (a list copied from the host would be a blocking copy every batch).
    for i in range(0, len(batched), batch_size):
        starts_i = torch.arange(len(batched[i:i + batch_size]), device=device) * seq_len
        index = (starts_i + (batched[i] - history))[:, None] + span
        y = window(targets, index)
        y[:, :history] = IGNORE_INDEX
        add(window(inputs, index), y)
    for a in sorted(set(starts) - set(batched)):
        low, high = max(0, a - history), min(n, a + seq_len)
        y = window(targets, slice(low, high))
        y[: a - low] = IGNORE_INDEX
        add(window(inputs, slice(low, high))[None], y[None])


def run(
    checkpoint: str,
    *,
    split: str = "val",
    seq_len: int | None = None,
    batch_size: int = 64,
    data_path: str | None = None,
    context: str = "reset",
    device: str = "auto",
    precision: str | None = None,
) -> dict[str, Any]:
    """``fbtrain eval``: loss / bpc / perplexity of a checkpoint on one split (train, val,
    or test where the data has one: enwik8, text8, the algorithmic programs), plus accuracy
    for a labelled dataset.

    The data is what the checkpoint's training config names (``config["data"]``: its local
    path or the cached download, or the generated programs), or the text ``data_path``; it
    is encoded with the checkpoint's vocabulary and split as in training. ``seq_len``
    defaults to the last curriculum stage's. ``precision`` (``auto``, ``fp32``, ``bf16``,
    ``fp16``) defaults to the run's own ``run.precision``, the one its validation line was
    scored at, so the same windows give that line's loss. Returns :func:`evaluate_split`'s dict plus
    ``split``, ``checkpoint`` (the file used) and ``step``. Raises ArgumentError, DataError,
    CheckpointError or DeviceError with one line (the CLI turns them into exit code 2).
    """
    from fbtrain.checkpoint import CheckpointError, load_model
    from fbtrain.checkpoint.contents import resolve_model
    from fbtrain.config import DataConfig
    from fbtrain.data.corpus import load_corpus
    from fbtrain.data.errors import DataError, VocabularyError
    from fbtrain.device import resolve_device

    if split not in SPLITS:
        raise ArgumentError(f"split = {split!r}: must be {', '.join(SPLITS[:-1])} or {SPLITS[-1]}")
    check_window_args(seq_len, batch_size, context)
    target = resolve_device(device)
    file = resolve_model(checkpoint, prefer="best")  # a run, a checkpoint or an export
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
        if not str(data_path).strip():  # data.path '' would mean the dataset's download
            raise ArgumentError(f"--data-path {str(data_path)!r}: empty; give a text file, or "
                                "leave the flag out to score the run's own data")
        if data_cfg.dataset == "algorithmic":  # its programs are generated, never read
            raise ArgumentError(f"--data-path {data_path}: {file} was trained on generated "
                             "programs (data.dataset: algorithmic), which are not read from "
                             "a file; leave --data-path out")
        data_cfg.path = str(data_path)
    if seq_len is None:
        seq_len = _last_seq_len(cfg.get("curriculum"))
        if seq_len is None:
            raise CheckpointError(f"{file}: holds no curriculum to take seq_len from; "
                                  "pass seq_len")

    where = f"data.path {data_cfg.path}" if data_cfg.path else f"dataset {data_cfg.dataset}"
    if data_path is not None:  # name what the user typed, not the config key behind it
        where = f"--data-path {data_path}"
    try:
        corpus = load_corpus(data_cfg, tokenizer.tokens, any_text=data_path is not None)
    except VocabularyError as e:
        # Only a vocabulary mismatch is about the checkpoint; a file that is missing, empty
        # or unreadable is reported as it is.
        raise DataError(f"{where} does not fit the vocabulary of checkpoint {file}: {e}") from None
    except DataError as e:
        if data_path is None:
            raise
        raise DataError(str(e).replace(f"data.path {data_cfg.path}", where)) from None
    try:
        stream = corpus.stream(split)
    except ArgumentError as e:
        raise ArgumentError(f"{e} ({where})") from None
    if data_path is None:
        _check_trained_split(file, payload.get("data"), split, stream, where)
    if precision is None:
        precision = saved_precision(payload)
    try:
        result = evaluate_split(model, stream, seq_len, batch_size, context=context,
                                history=corpus.history, precision=precision,
                                show_progress=True)
    except (MemoryError, RuntimeError) as e:
        if not is_allocation_failure(e):
            raise
        length = min(seq_len, len(stream.targets))
        windows = f", {batch_size:,} at a time" if context == "reset" else ", memory carried"
        raise OutOfMemory(allocation_failed(
            e, f"scoring windows of {length:,} tokens{windows}",
            "lower --seq-len" + (" or --batch-size" if context == "reset" else ""))) from None
    if result["scored"] == 0:
        raise DataError(f"split {split} of {where} holds no labelled target: nothing to score")
    if not math.isfinite(result["loss"]):  # no figure to report; sample refuses it too
        raise CheckpointError(f"{file}: cannot score it: the loss is {result['loss']}, as the "
                              "model's predictions are NaN or inf (its weights are so large "
                              "that the logits overflow)")
    if not corpus.labelled:  # every target is scored: accuracy is not this data's figure
        result.pop("accuracy")
        result.pop("scored")
    covered = characters_covered(tokenizer, stream.targets)  # every target was scored once
    if covered is not None and all(covered):
        chars, scored = covered
        result.update(loss_figures(result["loss"], chars / scored), characters=chars)
    return {**result, "split": split, "checkpoint": str(file), "step": payload.get("step")}


def _check_trained_split(file: Any, identity: Any, split: str, stream: Stream,
                         where: str) -> None:
    """DataError when the split read now is not the one checkpoint ``file`` recorded (its
    ``data`` entry holds the sha256 of the train and val splits it trained on): a relative
    data.path read from another folder, or a file edited since, would be scored as the
    run's own split. A checkpoint without the digest (format v1, an export) is not checked."""
    from fbtrain.data.errors import DataError
    from fbtrain.data.identity import split_sha256

    digests = identity.get("sha256") if isinstance(identity, dict) else None
    if not isinstance(digests, dict) or split not in digests:
        return
    if digests[split] != split_sha256(stream):
        raise DataError(f"{where} holds other text than checkpoint {file} was trained on "
                        f"(the sha256 of its {split} split differs: a relative path read "
                        "from another folder, or a file changed since); to score this text "
                        "anyway, pass it as --data-path")


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
        ("history", result.get("history")),
        ("precision", result.get("precision")),
        ("tokens", f"{result['tokens']:,}"),
        ("characters", f"{result['characters']:,}" if "characters" in result else None),
        ("scored", f"{result['scored']:,}" if "scored" in result else None),
        ("accuracy", f"{100 * result['accuracy']:.2f}%" if "accuracy" in result else None),
        ("loss", f"{result['loss']:.4f} nats/{_loss_unit(result)}"),
        ("bpc", f"{result['bpc']:.4f}"),
        ("perplexity", f"{result['perplexity']:.3f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows if value is not None)


def _loss_unit(result: dict[str, Any]) -> str:
    """What eval's loss is per: a scored target, a token (of a vocabulary whose tokens
    cover several characters) or a character."""
    return "target" if "scored" in result else "token" if "characters" in result else "char"
