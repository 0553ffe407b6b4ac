"""The dataset as training uses it (:class:`TrainData`): the corpus's training stream, the
fixed validation windows every evaluation scores, and what a step's bits per character
divide by; loaded by :func:`load_data` (the default :class:`~fbtrain.train.setup.Seams`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fbtrain.config import Config
from fbtrain.config.curriculum import Curriculum
from fbtrain.data.characters import chars_per_token
from fbtrain.data.corpus import Corpus, load_corpus
from fbtrain.data.errors import DataError, VocabularyError
from fbtrain.data.identity import DataIdentity
from fbtrain.data.samplers import fixed_windows
from fbtrain.data.streams import IGNORE_INDEX, require_tokens
from fbtrain.distributed import DistContext


@dataclass(frozen=True)
class TrainData:
    """The dataset as training uses it: the tokenizer, the training stream and the fixed
    validation windows ``val_x``, ``val_y`` ``[windows, length]`` (on the device)."""

    tokenizer: Any  # CharTokenizer, ByteTokenizer or WordTokenizer
    labelled: bool  # targets only where labelled (an ignore marker elsewhere)
    train_ids: Any  # the training split's stream (inputs, targets)
    val_x: Tensor
    val_y: Tensor
    n_tokens: tuple[int, int]  # tokens (characters, bytes or words) in the train and val splits
    identity: DataIdentity  # what the splits are (a resume on other data is refused)
    # Characters per scored token of the training split and of the validation windows
    # (bits per character; 1.0 where a token is a character: data/characters.py).
    chars_per_token: tuple[float, float] = (1.0, 1.0)
    # Characters each token id covers, int64 [vocab] on the device, for each step's bits
    # per character; None where every token is one character.
    token_chars: Tensor | None = None


def load_data(cfg: Config, ctx: DistContext, vocab: list[str] | None,
              vocab_source: Path | None) -> TrainData:
    """The dataset's train/val streams (``corpus.py``) and the fixed validation windows.

    The vocabulary comes from the checkpoint being resumed or warm-started from (its
    embedding rows are indexed by it), else from the data.
    """
    try:
        corpus = _main_rank_first(cfg, ctx, lambda: load_corpus(cfg.data, vocab))
    except VocabularyError as e:  # about the checkpoint; other data problems are the data's
        raise DataError(f"vocabulary of checkpoint {vocab_source}: {e}") from None
    train_ids, val_ids = corpus.splits["train"], corpus.splits["val"]
    # Checked now, before anything is written (the sampler would only at step 1).
    max_seq_len = Curriculum(cfg).max_seq_len
    require_tokens(len(train_ids.inputs) + 1, max_seq_len, "training text")
    carry = cfg.train.context == "carry"
    # Computed once: every evaluation scores the same windows, so curves are comparable.
    # With carried memory each scored window runs on a full memory window of context.
    # A labelled dataset may need more context to be scored exactly (corpus.history).
    context = max(cfg.model.memory_window, corpus.history) if carry else 0
    # Carried segments are often short (16 tokens): windows of one segment would score
    # a few hundred tokens, too few to compare runs or pick best.pt by, so each window
    # scores at least a memory window's worth.
    scored = max_seq_len
    if carry:
        scored = max(scored, cfg.model.memory_window)
    _check_validation_length(cfg, len(val_ids.inputs), scored, context)
    val_x, val_y = fixed_windows(val_ids, scored, cfg.train.eval_windows, context=context)
    if corpus.labelled and not bool((val_y != IGNORE_INDEX).any()):
        # Validation would be NaN at every evaluation and best.pt never written.
        raise DataError(f"the {len(val_x)} validation windows ({val_x.shape[1]} tokens each) "
                        "hold no labelled target (a print's ;), so validation has nothing to "
                        "score; use a longer curriculum seq_len, more train.eval_windows, or "
                        "more data.valid_programs or a longer data.program_len")
    return TrainData(tokenizer=corpus.tokenizer, labelled=corpus.labelled, train_ids=train_ids,
                     val_x=val_x.to(ctx.device), val_y=val_y.to(ctx.device),
                     n_tokens=(len(train_ids.inputs), len(val_ids.inputs)),
                     identity=DataIdentity(cfg.data, corpus.splits),
                     chars_per_token=(chars_per_token(corpus.tokenizer, train_ids.targets),
                                      chars_per_token(corpus.tokenizer, val_y)),
                     token_chars=_on(corpus.tokenizer.characters(), ctx.device))


def _on(tensor: Tensor | None, device: torch.device) -> Tensor | None:
    return None if tensor is None else tensor.to(device)


def _check_validation_length(cfg: Config, predictions: int, scored: int, context: int
                             ) -> None:
    """DataError when the validation split (``predictions`` [n]) cannot hold one window of
    ``context`` unscored + ``scored`` scored tokens, naming the keys those lengths come from
    (a carried memory's length is model.mem_len or max_rel_pos, not a curriculum seq_len)."""
    span = context + scored
    if predictions >= span:
        return
    model = cfg.model
    window = (f"model.mem_len = {model.mem_len}" if model.mem_len is not None
              else f"model.max_rel_pos = {model.max_rel_pos}, as model.mem_len is null")
    longest = max(stage.seq_len for stage in cfg.curriculum)
    reads = [f"{scored} scored (" + ("the longest curriculum seq_len" if scored == longest
                                     else "with train.context carry, a memory window") + ")"]
    if context:
        source = ("the memory window" if context == model.memory_window
                  else "the longest program, from data.program_len")
        reads.insert(0, f"{context} of carried context ({source})")
    uses_window = context == model.memory_window or scored != longest
    fixes = (["a smaller model.mem_len"] if uses_window else []) + (
        ["a shorter curriculum seq_len"] if scored == longest else [])
    fixes += (["more data.valid_programs"] if cfg.data.dataset == "algorithmic"
              else ["a larger data.val_fraction", "a longer text"])
    raise DataError(f"validation text too short: {predictions + 1} tokens, but each validation "
                    f"window reads {' and '.join(reads)} tokens, so it needs at least "
                    f"{span + 1}{f' (the memory window is {window})' if uses_window else ''}; use "
                    f"{', '.join(fixes[:-1])} or {fixes[-1]}")


def _main_rank_first(cfg: Config, ctx: DistContext, load: Callable[[], Corpus]) -> Corpus:
    # Under DDP rank 0 fills the download cache first, so ranks don't all download
    # (or unzip: the other ranks then read the prepared enwik8/text8 from the cache).
    downloads = cfg.data.path is None and ctx.enabled
    if downloads and not ctx.is_main:
        ctx.barrier()
    corpus = load()
    if downloads and ctx.is_main:
        ctx.barrier()
    return corpus
