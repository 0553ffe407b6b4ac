"""A dataset as the trainer and ``fbtrain eval`` see it: a tokenizer and named splits.

Each split is a :class:`~fbtrain.data.streams.Stream` of inputs and per-token targets, so the
code that trains and scores never asks what the data is:

- a text corpus (``data.dataset`` tinyshakespeare, a local ``data.path`` or a name with a
  ``data.url``): characters (or, by ``data.tokenizer``, bytes or the pieces of a BPE
  vocabulary learned from the training part), next-token targets, split into ``train``
  and ``val`` by ``data.val_fraction``;
- ``data.dataset: enwik8`` or ``text8`` (:mod:`fbtrain.data.archives`): bytes (enwik8) or
  characters (text8), next-token targets, the standard ``train`` / ``val`` / ``test``
  split; the splits are uint8 views of one buffer, not copies;
- ``data.dataset: algorithmic``: the programs of :mod:`fbtrain.data.algorithmic` as words,
  ``train`` / ``val`` / ``test`` program sets concatenated into one stream each; only a
  ``print``'s ``;`` has a target (the printed value), every other target is
  :data:`~fbtrain.data.streams.IGNORE_INDEX`. ``labelled`` is then true: loss and accuracy count
  labelled positions only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fbtrain.config import DataConfig
from fbtrain.config.limits import allocation_failed, is_allocation_failure
from fbtrain.data import algorithmic, archives
from fbtrain.data.bpe import chunks
from fbtrain.data.errors import DataError, TooShortToSplit, VocabularyError
from fbtrain.data.fetch import cache_dir
from fbtrain.data.id_cache import cached_ids, ids_key
from fbtrain.data.sources import SOURCES
from fbtrain.data.streams import (
    IGNORE_INDEX,
    Stream,
    check_split,
    next_token_stream,
    split,
    split_point,
)
from fbtrain.data.text import load_text, read_local
from fbtrain.data.tokenizers import (
    BpeTokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    WordTokenizer,
)
from fbtrain.errors import ArgumentError
from fbtrain.progress import Progress, isatty, note

ALGORITHMIC = "algorithmic"


@dataclass
class Corpus:
    """A tokenizer and its splits (``train``, ``val`` and maybe ``test``)."""

    tokenizer: Tokenizer
    splits: dict[str, Stream]
    labelled: bool  # True: only some targets are scored, and accuracy is reported
    # Earlier tokens a prediction can depend on at most (0: unbounded, as in a text). The
    # programs are independent, so for them it is the longest program's length: a window
    # that reads that many tokens first scores as well as the whole stream would.
    history: int = 0

    def stream(self, name: str) -> Stream:
        """The split ``name``; an ArgumentError naming the splits there are otherwise."""
        if name not in self.splits:
            raise ArgumentError(f"split = {name!r}: this data has the splits "
                             f"{', '.join(self.splits)}")
        return self.splits[name]


def load_corpus(data_cfg: DataConfig, vocab: Sequence[str] | None = None, *,
                any_text: bool = False) -> Corpus:
    """The dataset ``data_cfg`` names; ``vocab`` (a checkpoint's) fixes the token ids.

    ``any_text``: ``data.path`` is any text to score (``fbtrain eval --data-path``), not the
    benchmark's own file: read with the dataset's tokenization (bytes for enwik8) and split
    by ``data.val_fraction``, without the standard size check and split.

    Downloads into the cache when needed (under DDP the trainer lets rank 0 call this
    first). Raises DataError when the data does not fit ``vocab``, or this process's
    memory (an allocation that failed while reading or tokenizing it).
    """
    where = (f"data.path {Path(data_cfg.path).expanduser()}" if data_cfg.path
             else f"dataset {data_cfg.dataset}")
    try:
        return _read_corpus(data_cfg, vocab, any_text)
    except TooShortToSplit as e:
        raise DataError(f"{where}: {e}") from None
    except (MemoryError, RuntimeError, SystemError) as e:
        if not is_allocation_failure(e):
            raise
        fix = "use a smaller file" if data_cfg.path else "give the process more memory"
        raise DataError(f"{where}: {allocation_failed(e, 'reading and tokenizing it', fix)}"
                        ) from None


def _read_corpus(data_cfg: DataConfig, vocab: Sequence[str] | None, any_text: bool
                 ) -> Corpus:
    if data_cfg.dataset == ALGORITHMIC:
        return algorithmic_corpus(data_cfg, vocab)
    source = SOURCES.get(data_cfg.dataset)
    if source is not None and source.archived:
        if not (any_text and data_cfg.path):
            return benchmark_corpus(data_cfg, vocab)
        if source.tokenization == "byte":
            return byte_text_corpus(data_cfg, vocab)
    if data_cfg.tokenizer == "byte" and data_cfg.path:
        return byte_text_corpus(data_cfg, vocab)
    text = load_text(data_cfg)
    if data_cfg.tokenizer == "bpe":
        return bpe_corpus(data_cfg, text, vocab)
    if data_cfg.tokenizer == "byte":  # a download, read as its UTF-8 bytes
        return byte_text_corpus(data_cfg, vocab, bytearray(text.encode("utf-8")))
    tokenizer = CharTokenizer(vocab) if vocab else CharTokenizer.from_text(text)
    ids = tokenizer.encode(text)
    train, val = split(ids, data_cfg.val_fraction)
    return Corpus(tokenizer, {"train": next_token_stream(train), "val": next_token_stream(val)},
                  labelled=False)


def tokenizer_kind(data_cfg: DataConfig) -> str:
    """The tokenizer ``data_cfg`` trains with: data.tokenizer, else the dataset's own."""
    if data_cfg.dataset == ALGORITHMIC:
        return "word"
    source = SOURCES.get(data_cfg.dataset)
    if data_cfg.tokenizer is None and source is not None and source.archived:
        return source.tokenization
    return data_cfg.tokenizer or "char"


def check_tokenizer(data_cfg: DataConfig, saved: object, source: object) -> None:
    """DataError when checkpoint ``source`` (its ``tokenizer`` entry: ``saved``; absent in
    the oldest: char) was trained with another tokenizer than ``data_cfg`` asks for: its
    vocabulary, and so its embedding rows, mean other tokens."""
    saved_kind = saved if isinstance(saved, str) else "char"
    wanted = tokenizer_kind(data_cfg)
    if saved_kind != wanted:
        raise DataError(f"checkpoint {source} was trained with data.tokenizer {saved_kind}, "
                        f"but the config asks for {wanted}: its embedding rows are other "
                        f"tokens; use --set data.tokenizer={saved_kind} with it")


def benchmark_corpus(data_cfg: DataConfig, vocab: Sequence[str] | None = None) -> Corpus:
    """enwik8 (one token per byte) or text8 (per character: its alphabet, checked by
    :func:`fbtrain.data.archives.load_bytes`, is ASCII, so a character is a byte), split the
    standard way; ids are uint8 ``[SIZE]``, each split a view of them."""
    name = data_cfg.dataset
    where = f"data.path {data_cfg.path}" if data_cfg.path else f"data.dataset {name}"
    # uint8 [SIZE], memory-mapped, and its byte values (one pass over the 100 MB, used for
    # the alphabet check, the vocabulary and encode_bytes' missing-byte check).
    raw, present = archives.load_bytes(data_cfg)
    if vocab is None:
        vocab = [chr(b) for b in present]
    tokenizer: Tokenizer
    if SOURCES[name].tokenization == "byte":
        tokenizer = ByteTokenizer(vocab)
    else:
        tokenizer = CharTokenizer(vocab)
    ids = archives.encode_bytes(raw, tokenizer.tokens, present, where)  # uint8 [SIZE]
    del raw  # the mapped file is no longer needed: only the ids stay in memory
    splits = {split_name: next_token_stream(ids[start:end])
              for split_name, (start, end) in archives.split_bounds().items()}
    return Corpus(tokenizer, splits, labelled=False)


# Reading a text as bytes takes its bytes and their uint8 ids: 2 bytes a byte.
BYTE_TEXT_MEMORY_PER_BYTE = 2


def byte_text_corpus(data_cfg: DataConfig, vocab: Sequence[str] | None = None,
                     data: bytearray | None = None) -> Corpus:
    """The file ``data.path`` (or the bytes ``data``), any size, one token per byte (as
    enwik8 is read), split into ``train`` and ``val`` by ``data.val_fraction``; ids are
    uint8 ``[n]``."""
    where = (f"data.path {Path(data_cfg.path).expanduser()}" if data_cfg.path
             else f"data.dataset {data_cfg.dataset}")
    if data is None:
        assert data_cfg.path is not None
        data = read_local(data_cfg.path, BYTE_TEXT_MEMORY_PER_BYTE)
    if not data:
        raise DataError(f"{where} is empty; point it at a text file with content")
    raw = torch.frombuffer(data, dtype=torch.uint8)  # the bytes read, not a copy
    present = archives.present_bytes(raw)
    tokenizer = ByteTokenizer(vocab if vocab else [chr(b) for b in present])
    ids = archives.encode_bytes(raw, tokenizer.tokens, present, where)  # uint8 [n]
    train, val = split(ids, data_cfg.val_fraction)
    return Corpus(tokenizer, {"train": next_token_stream(train), "val": next_token_stream(val)},
                  labelled=False)


def bpe_corpus(data_cfg: DataConfig, text: str, vocab: Sequence[str] | None = None
               ) -> Corpus:
    """``text`` split by characters as a character corpus is (so the validation text is the
    same), a byte-level BPE vocabulary learned from the training part alone (``vocab``: a
    checkpoint's, used as it is), both parts encoded, or mapped from the download cache where
    an earlier start encoded them (:mod:`fbtrain.data.id_cache`); ids are uint16 ``[n]``."""
    n_train = split_point(len(text), data_cfg.val_fraction)
    if vocab:
        tokenizer = BpeTokenizer(vocab)
    else:
        alphabet = text_bytes(text)
        if data_cfg.vocab_size < len(alphabet):
            raise DataError(f"data.vocab_size = {data_cfg.vocab_size}: below the "
                            f"{len(alphabet)} distinct bytes of the text, which the "
                            f"vocabulary starts from; use at least {len(alphabet)}")
        note(f"data: learning a BPE vocabulary of {data_cfg.vocab_size:,} pieces from "
             f"{n_train:,} training characters")
        tokenizer = BpeTokenizer.learn(text[:n_train], data_cfg.vocab_size, alphabet,
                                       show_progress=isatty(sys.stderr))

    def encode() -> tuple[torch.Tensor, torch.Tensor]:
        with Progress(len(text), desc="encoding the text", unit="chars", plain=True) as shown:
            return (tokenizer.encode_compact(text[:n_train], shown),
                    tokenizer.encode_compact(text[n_train:], shown))

    # Encoded once: later starts on the same text and vocabulary map the ids (id_cache.py).
    dtype = tokenizer.compact_dtype
    train, val = cached_ids(cache_dir(data_cfg), ids_key(text, tokenizer.tokens, n_train, dtype),
                            dtype, encode)
    check_split(len(train), len(val), data_cfg.val_fraction, "pieces")
    return Corpus(tokenizer, {"train": next_token_stream(train), "val": next_token_stream(val)},
                  labelled=False)


def text_bytes(text: str) -> list[int]:
    """The byte values of ``text`` in UTF-8, ascending (encoded a part at a time)."""
    seen: set[int] = set()
    for part in chunks(text):
        seen.update(part.encode("utf-8"))
    return sorted(seen)


def algorithmic_corpus(data_cfg: DataConfig, vocab: Sequence[str] | None = None) -> Corpus:
    """Generate the program sets (train / val / test) and label them."""
    tokenizer = WordTokenizer(vocab if vocab else algorithmic.VOCABULARY)
    counts = {"train": data_cfg.train_programs, "val": data_cfg.valid_programs,
              "test": data_cfg.test_programs}
    splits, history = {}, 0
    for name, count in counts.items():
        # Only training programs may mix lengths; val and test are the task as stated.
        shortest = data_cfg.train_min_program_len if name == "train" else None
        programs = algorithmic.generate_split(data_cfg.seed, name, count, data_cfg.variables,
                                              data_cfg.program_len, shortest)
        splits[name] = labelled_stream(*algorithmic.program_words(programs), tokenizer)
        history = max(history, *(algorithmic.program_size(p) for p in programs))
    return Corpus(tokenizer, splits, labelled=True, history=history)


def labelled_stream(words: list[str], labels: list[str | None], tokenizer: Tokenizer
                    ) -> Stream:
    """Words and one label per word (None: not scored) -> a :class:`Stream` ``[n]``."""
    index = {token: i for i, token in enumerate(tokenizer.tokens)}
    try:
        inputs = tokenizer.encode(" ".join(words))
        targets = torch.tensor([IGNORE_INDEX if label is None else index[label]
                                for label in labels], dtype=torch.long)
    except KeyError as e:
        raise VocabularyError(f"data.dataset {ALGORITHMIC}: label {e.args[0]!r} is not in the "
                              "vocabulary") from None
    except VocabularyError as e:
        raise VocabularyError(f"data.dataset {ALGORITHMIC}: {e}") from None
    return Stream(inputs, targets)
