"""Byte-level BPE (``data.tokenizer: bpe``): learning merges from a text, and encoding with
them, through Hugging Face's ``tokenizers`` library.

``tokenizers`` is imported only inside the functions that learn or encode, never when
fbtrain is imported: character and byte runs, sampling from them, and the GPU check need
none of it (a machine without it trains them all).

A piece is a byte string. As in GPT-2's byte-level BPE, each byte is written as one
printable character (:func:`byte_symbols`: the byte itself where it is printable, else a
character from U+0100 on; never a space), so a vocabulary is a list of strings and a merge
of two pieces can be written ``"left right"``: that is how
:class:`~fbtrain.data.tokenizers.BpeTokenizer` saves one (:func:`pieces_of`).

Deterministic: the same text and vocabulary size give the same merges (the library breaks
ties between equally frequent pairs by the pair itself, not by thread timing; a test learns
with one thread and with several). A long text is cut only where the pre-tokenizer splits
anyway (:func:`chunks`), so cutting it changes no token. A word longer than
:data:`MAX_WORD_BYTES` is cut every that many bytes.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Any

import torch

from fbtrain.data.errors import DataError

# The longest word (a run of letters, of digits, of punctuation or of whitespace, as the
# pre-tokenizer splits a text) learned and encoded whole; a longer one is cut every this
# many bytes. The library learns merges in time quadratic in a word's length, so one long
# run (a file's NUL padding, blank lines, a long number) would all but stop learning. A
# text of words has none this long, so its pieces are the same either way.
MAX_WORD_BYTES = 256
# How a text becomes ids besides its vocabulary: part of the name of every cached encoding
# (id_cache.py), so that a change to these rules encodes a text anew instead of mapping ids
# the rules would no longer give.
ENCODING = f"byte-level GPT-2 words, cut every {MAX_WORD_BYTES} bytes"
CHUNK_CHARS = 1 << 20  # characters of text per piece handed to the library (memory bound)
_BATCH = 8  # chunks encoded per call (the library spreads a batch over its threads)


@lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """The character that stands for each byte value 0..255 (GPT-2's table: printable
    latin-1 bytes as themselves, the others shifted to U+0100 and beyond)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = {}, 0
    for b in range(256):
        if b in kept:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return tuple(symbols[b] for b in range(256))


@lru_cache(maxsize=1)
def symbol_bytes() -> dict[str, int]:
    """:func:`byte_symbols` inverted: symbol -> byte value."""
    return {s: b for b, s in enumerate(byte_symbols())}


def pieces_of(entries: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """A saved vocabulary (``entries``: one byte symbol, or ``"left right"``, a merge of two
    earlier pieces) -> its pieces in id order and its merges in the order they apply.
    ValueError naming the first entry that is neither, or that repeats a piece."""
    known = symbol_bytes()
    pieces: list[str] = []
    merges: list[tuple[str, str]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        parts = entry.split(" ")
        if len(parts) == 1 and len(entry) == 1 and entry in known:
            piece = entry
        elif len(parts) == 2 and parts[0] in seen and parts[1] in seen:
            piece = parts[0] + parts[1]
            merges.append((parts[0], parts[1]))
        else:
            raise ValueError(f"entry {i} ({entry!r}) is neither a byte's symbol nor a merge "
                             "'left right' of two earlier pieces")
        if piece in seen:
            raise ValueError(f"entry {i} ({entry!r}) repeats the piece {piece!r}")
        seen.add(piece)
        pieces.append(piece)
    return pieces, merges


def piece_bytes(piece: str) -> bytes:
    """The bytes a piece (a string of byte symbols) stands for."""
    table = symbol_bytes()
    return bytes(table[c] for c in piece)


def chunks(text: str, size: int | None = None) -> Iterator[str]:
    """``text`` in consecutive parts of about ``size`` characters, each cut just before a
    space, tab, CR or newline that ends a run of whitespace (a character that is no
    whitespace follows): the pre-tokenizer's expression splits there in any case (that
    character starts a word of its own, or one with the word after it, and the whitespace
    before it is a word of its own), so the parts give the tokens of the whole. Any line
    break or space between words will do, so a text with CRLF line ends, or none, is cut
    too; a text without such whitespace is one part. ``size``: :data:`CHUNK_CHARS` when
    None."""
    size = size or CHUNK_CHARS
    start, n = 0, len(text)
    while n - start > size:
        cut = _CUT.search(text, start + size)
        if cut is None:
            break
        yield text[start:cut.start()]
        start = cut.start()
    if start < n:
        yield text[start:]


# Where chunks cuts: before one of these, which the pre-tokenizer reads as whitespace (the
# set is kept to these four: Python's \s also holds U+001C-U+001F, which the library reads
# as punctuation), followed by what both read as no whitespace.
_CUT = re.compile(r"[\t\n\r ](?=\S)")


def _library() -> Any:
    """The ``tokenizers`` module; a one-line DataError where it cannot be imported (it is a
    dependency, but only a BPE run needs it, so a machine without it trains the rest)."""
    try:
        import tokenizers
    except ImportError as e:
        raise DataError(f"data.tokenizer = bpe needs Hugging Face's tokenizers library, "
                        f"which cannot be imported ({e}); install it: "
                        f"pip install '{_requirement()}'") from None
    return tokenizers


def _requirement() -> str:
    """fbtrain's own requirement on ``tokenizers`` (the versions it supports)."""
    try:
        requires = importlib.metadata.requires("fbtrain") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    return next((r for r in requires if r.startswith("tokenizers")), "tokenizers")


def _pre_tokenizer() -> Any:
    """GPT-2's byte-level split into words, then each word cut every :data:`MAX_WORD_BYTES`
    bytes."""
    library = _library()
    return library.pre_tokenizers.Sequence([
        library.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        library.pre_tokenizers.Split(library.Regex(f".{{1,{MAX_WORD_BYTES}}}"),
                                     behavior="isolated")])


def learn(parts: Iterable[str], vocab_size: int, alphabet: Sequence[int], *,
          show_progress: bool = False) -> list[str]:
    """Learn merges from ``parts`` (the training text, :func:`chunks` of it) until the
    vocabulary holds ``vocab_size`` pieces (fewer when the text runs out of pairs), starting
    from the bytes ``alphabet`` (byte values, so that text outside the training split but
    in the same file still encodes). Returns the saved form: the byte symbols in byte
    order, then one ``"left right"`` per merge that made a new piece."""
    library = _library()
    symbols = byte_symbols()
    tokenizer = library.Tokenizer(library.models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer()
    trainer = library.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0,
                                          show_progress=show_progress, special_tokens=[],
                                          initial_alphabet=[symbols[b] for b in alphabet])
    tokenizer.train_from_iterator(parts, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    entries = [symbols[b] for b in sorted(alphabet)]
    seen = set(entries)
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        if left + right not in seen:  # a pair that makes a piece again adds no entry
            seen.add(left + right)
            entries.append(f"{left} {right}")
    return entries


def encoder(pieces: Sequence[str], merges: Sequence[tuple[str, str]]) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes with exactly these pieces and merges."""
    library = _library()
    model = library.models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=list(merges))
    tokenizer = library.Tokenizer(model)
    tokenizer.pre_tokenizer = _pre_tokenizer()
    return tokenizer


def encode(tokenizer: Any, text: str, dtype: torch.dtype, *, progress: Any = None
           ) -> torch.Tensor:
    """``text`` -> ids ``[n]`` of ``dtype``, encoded :data:`_BATCH` chunks at a time into
    one buffer of a token per byte at most (so memory stays bounded: the library's
    per-token records exist for one batch only). ``progress``: told the characters done."""
    out = torch.empty(_utf8_length(text), dtype=dtype)
    n = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal n
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
            ids = encoding.ids
            out[n:n + len(ids)] = torch.tensor(ids, dtype=torch.int32).to(dtype)
            n += len(ids)
        if progress is not None:
            progress.update(sum(len(part) for part in batch))
        batch.clear()

    for part in chunks(text):
        batch.append(part)
        if len(batch) == _BATCH:
            flush()
    if batch:
        flush()
    return out[:n].clone()  # the ids alone: a piece covers several bytes


def _utf8_length(text: str) -> int:
    """Bytes of ``text`` in UTF-8, counted a chunk at a time (no whole copy)."""
    return sum(len(text[i:i + CHUNK_CHARS].encode("utf-8"))
               for i in range(0, len(text), CHUNK_CHARS))
