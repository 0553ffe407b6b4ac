"""Tokenizers: text (or bytes) to token ids and back, and the vocabulary file.

One token per character (:class:`CharTokenizer`, the text corpora), per word
(:class:`WordTokenizer`, the algorithmic programs), per byte (:class:`ByteTokenizer`,
enwik8) or per piece of a learned byte-level BPE vocabulary (:class:`BpeTokenizer`). A
tokenizer saves itself as ``vocab.json`` and inside checkpoints (:func:`make_tokenizer`
rebuilds it); :meth:`Tokenizer.decoder` decodes ids that arrive
one at a time, as ``fbtrain sample`` prints them.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fbtrain.data import bpe
from fbtrain.data.errors import DataError, VocabularyError, one_line
from fbtrain.io import atomic_write_text
from fbtrain.rundir_names import VOCAB

VOCAB_FILE = VOCAB  # also an export folder's
_MAX_LISTED = 10  # unknown characters named in an error; more would not fit on one line


class Tokenizer:
    """Maps each token of a fixed vocabulary to its index in ``tokens``; subclasses say
    what a token is (:meth:`pieces`) and how decoded tokens are joined (``joiner``)."""

    kind = ""  # the name saved in checkpoints (``"char"`` or ``"word"``)
    key = "tokens"  # the list's key in vocab.json (``"chars"`` or ``"words"``)
    unit = "token"  # what error messages call one token
    joiner = ""  # between decoded tokens
    start = "\n"  # the default prompt of ``fbtrain sample``

    def __init__(self, tokens: Sequence[str]):
        tokens = list(tokens)
        bad = [t for t in tokens if not self._valid(t)]
        if bad:
            raise VocabularyError(f"vocabulary entries must be {self._what_valid}, got "
                                  f"{bad[:3]!r}")
        if len(set(tokens)) != len(tokens):
            raise VocabularyError(f"vocabulary has repeated {self.unit}s; it must list each "
                                  "one once")
        self.tokens: list[str] = tokens
        self._index = {t: i for i, t in enumerate(tokens)}

    _what_valid = "strings"

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str)

    def pieces(self, text: str) -> Sequence[str]:
        """``text`` cut into tokens (not yet checked against the vocabulary)."""
        raise NotImplementedError

    @staticmethod
    def _show(token: str) -> str:
        """A token as an error message names it."""
        return repr(token)

    def decoder(self) -> Decoder:
        """A decoder for ids that arrive one at a time (``fbtrain sample`` prints as it goes)."""
        return Decoder(self)

    def characters(self) -> torch.Tensor | None:
        """Characters each token covers, int64 ``[vocab_size]``, for bits per character;
        None where every token is one (characters; bytes, whose bits per character are
        bits per byte, as published; the programs' words, scored per token)."""
        return None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> LongTensor ``[tokens in text]``; unknown tokens raise VocabularyError."""
        pieces = self.pieces(text)
        try:
            ids = [self._index[c] for c in pieces]
        except KeyError:
            missing = sorted(set(pieces) - self._index.keys())
            raise not_in_vocabulary([self._show(c) for c in missing], self.unit) from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Ids (list or 1-D tensor) -> text (tokens joined by ``joiner``)."""
        return self.joiner.join(self.tokens[i] for i in self._checked(ids))

    def _checked(self, ids: torch.Tensor | Sequence[int]) -> list[int]:
        """Ids as a list; DataError for one outside the vocabulary."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        n = len(self.tokens)
        # Checked up front: a negative id would otherwise index from the end silently.
        bad = [i for i in values if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise DataError(f"token id {bad[0]!r} is outside the vocabulary (0..{n - 1})")
        return values

    def to_dict(self) -> dict[str, list[str]]:
        return {self.key: list(self.tokens)}

    @classmethod
    def from_dict(cls, d: Any) -> Tokenizer:
        """A vocabulary dict, ``{"chars": [...]}``, ``{"words": [...]}`` or
        ``{"bytes": [...]}``, as its tokenizer (the one it names when called on
        :class:`Tokenizer` itself)."""
        classes = [cls] if cls is not Tokenizer else list(TOKENIZERS.values())
        for klass in classes:
            if isinstance(d, dict) and isinstance(d.get(klass.key), list):
                return klass(d[klass.key])
        shapes = " or ".join(f'{{"{k.key}": [...]}}' for k in classes)
        raise DataError(f"a vocabulary must look like {shapes}")

    def save(self, path: str | Path) -> Path:
        """Write ``vocab.json`` atomically; ``path`` is the file or a folder to put it in."""
        path = Path(path)
        if path.is_dir():
            path = path / VOCAB_FILE
        atomic_write_text(path, self.to_json())
        return path

    def to_json(self) -> str:
        """What :meth:`save` writes to ``vocab.json``."""
        return json.dumps(self.to_dict(), ensure_ascii=False) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a vocabulary written by :meth:`save` (the file, or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / VOCAB_FILE
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(f"{path}: vocabulary file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: cannot read vocabulary ({one_line(str(e))})") from None
        try:
            return cls.from_dict(d)
        except DataError as e:
            raise DataError(f"{path}: {e}") from None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.tokens == other.tokens  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.kind, tuple(self.tokens)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def not_in_vocabulary(missing: Sequence[str], unit: str) -> VocabularyError:
    """"3 character(s) not in the vocabulary: 'X', 'Y', 'Z'; ...": ``missing`` as shown."""
    shown = ", ".join(missing[:_MAX_LISTED])
    more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
    return VocabularyError(f"{len(missing)} {unit}(s) not in the vocabulary: {shown}{more}; "
                           "the vocabulary comes from the training data")


def utf8(text: str) -> bytes:
    """``text`` in UTF-8; DataError for a lone surrogate, which UTF-8 cannot hold (a command
    line passes a byte that is not UTF-8 as one of U+DC80..U+DCFF: ``--prompt $'\\xff'``)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        shown = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise DataError(f"character {e.start} is {shown}, which is not UTF-8 text; give "
                        "UTF-8 text") from None


class CharTokenizer(Tokenizer):
    """One token per character (the text corpora)."""

    kind, key, unit, joiner, start = "char", "chars", "character", "", "\n"
    _what_valid = "single characters"

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str) and len(token) == 1

    @property
    def chars(self) -> list[str]:
        return self.tokens

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary of the sorted distinct characters of ``text`` (65 for Tiny Shakespeare)."""
        return cls(sorted(set(text)))

    def pieces(self, text: str) -> Sequence[str]:
        # The text itself, not list(text): a list would hold 8 bytes a character, and one
        # string object (about 80 bytes) for each character past U+00FF, while encode runs.
        return text


class WordTokenizer(Tokenizer):
    """One token per whitespace-separated word; decoding joins words with single spaces."""

    kind, key, unit, joiner = "word", "words", "word", " "
    _what_valid = "words without whitespace"

    def __init__(self, tokens: Sequence[str]):
        super().__init__(tokens)
        self.start = self.tokens[0] if self.tokens else ""  # e.g. END: a new program starts

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str) and bool(token) and token.split() == [token]

    def pieces(self, text: str) -> list[str]:
        return text.split()


class ByteTokenizer(Tokenizer):
    """One token per byte (enwik8: bits per character are bits per byte, as published).

    A token is the byte ``b`` as the one-character string ``chr(b)`` (its latin-1 reading),
    so vocab.json and checkpoints keep a list of strings like the other tokenizers. Bytes
    go in and come out unchanged, invalid UTF-8 included (:meth:`decode_bytes`); text
    (a prompt) is encoded as UTF-8, and :meth:`decode` reads the bytes as UTF-8 with
    U+FFFD for what is not.
    """

    kind, key, unit, joiner, start = "byte", "bytes", "byte", "", "\n"
    _what_valid = "single characters below U+0100 (one per byte value)"

    @staticmethod
    def _valid(token: object) -> bool:
        return isinstance(token, str) and len(token) == 1 and ord(token) < 256

    @staticmethod
    def _show(token: str) -> str:
        return f"0x{ord(token):02x}"

    @classmethod
    def from_bytes(cls, data: bytes) -> ByteTokenizer:
        """Vocabulary of the sorted distinct bytes of ``data``."""
        return cls([chr(b) for b in sorted(set(data))])

    def pieces(self, text: str | bytes) -> list[str]:  # type: ignore[override]
        raw = utf8(text) if isinstance(text, str) else bytes(text)
        return [chr(b) for b in raw]

    def decode_bytes(self, ids: torch.Tensor | Sequence[int]) -> bytes:
        """Ids -> the exact bytes they stand for."""
        return super().decode(ids).encode("latin-1")

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Ids -> text: the bytes read as UTF-8, U+FFFD where they are not valid UTF-8."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decoder(self) -> Decoder:
        return Utf8Decoder(self)

    def token_bytes(self, token_id: int) -> bytes:
        """The byte token ``token_id`` stands for."""
        return bytes([ord(self.tokens[token_id])])


class BpeTokenizer(Tokenizer):
    """A byte-level BPE vocabulary learned from the training split (:mod:`fbtrain.data.bpe`).

    ``tokens`` is the saved form, one entry per id: a byte's symbol, or ``"left right"``,
    the merge of two earlier pieces that made this one; the list alone is the tokenizer
    (its pieces, and its merges in the order they apply). Text is encoded as UTF-8 bytes;
    a byte outside the vocabulary (one the file did not hold) is refused, naming it.
    """

    kind, key, unit, joiner, start = "bpe", "pieces", "piece", "", "\n"
    _what_valid = "byte symbols or merges 'left right' of earlier pieces"

    def __init__(self, tokens: Sequence[str]):
        super().__init__(tokens)
        try:
            self.vocab_pieces, self.merges = bpe.pieces_of(self.tokens)
        except ValueError as e:
            raise VocabularyError(f"not a BPE vocabulary: {e}") from None
        self._bytes = [bpe.piece_bytes(p) for p in self.vocab_pieces]
        self._alphabet = frozenset(bpe.symbol_bytes()[p] for p in self.vocab_pieces if len(p) == 1)
        self._encoder: Any = None  # the library's tokenizer, made on first use

    @classmethod
    def learn(cls, text: str, vocab_size: int, alphabet: Sequence[int], *,
              show_progress: bool = False) -> BpeTokenizer:
        """Merges learned from ``text`` (the training split) up to ``vocab_size`` pieces,
        over the bytes ``alphabet`` (the whole file's)."""
        return cls(bpe.learn(bpe.chunks(text), vocab_size, alphabet,
                             show_progress=show_progress))

    def _check_bytes(self, text: str) -> None:
        missing = sorted(set(utf8(text)) - self._alphabet)
        if missing:
            raise not_in_vocabulary([f"0x{b:02x}" for b in missing], "byte value")

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> LongTensor ``[pieces]``; VocabularyError for bytes it lacks."""
        return self.encode_compact(text).long()

    def encode_compact(self, text: str, progress: Any = None) -> torch.Tensor:
        """``text`` -> ids ``[pieces]``, uint16 when the vocabulary fits (int32 else),
        in bounded memory (:func:`fbtrain.data.bpe.encode`)."""
        self._check_bytes(text)
        if self._encoder is None:
            self._encoder = bpe.encoder(self.vocab_pieces, self.merges)
        return bpe.encode(self._encoder, text, self.compact_dtype, progress=progress)

    @property
    def compact_dtype(self) -> torch.dtype:
        """The ids' dtype: uint16 when the vocabulary fits, int32 else."""
        return torch.uint16 if self.vocab_size <= 1 << 16 else torch.int32

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes piece ``token_id`` stands for."""
        return self._bytes[token_id]

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Ids -> text: the pieces' bytes read as UTF-8, U+FFFD where they are not."""
        return b"".join(self._bytes[i] for i in self._checked(ids)).decode("utf-8",
                                                                           errors="replace")

    def decoder(self) -> Decoder:
        return Utf8Decoder(self)

    def characters(self) -> torch.Tensor:
        # A piece covers the characters whose first byte it holds (every byte but a UTF-8
        # continuation byte 10xxxxxx starts one): summed over consecutive pieces, that is
        # exactly the characters of their text, however pieces cut a character.
        return torch.tensor([sum((b & 0xC0) != 0x80 for b in piece) for piece in self._bytes],
                            dtype=torch.long)


class Decoder:
    """Decodes ids one at a time into the text they continue (one per generated sample)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def feed(self, token_id: int) -> str:
        """The text token ``token_id`` adds (joined as :meth:`Tokenizer.decode` joins)."""
        return self.tokenizer.joiner + self.tokenizer.tokens[token_id]

    def end(self) -> str:
        """Text still held back when the ids stop (none here)."""
        return ""


class Utf8Decoder(Decoder):
    """Bytes to text as they arrive: a character split over several bytes is written once
    it is whole, so the decoded text equals :meth:`ByteTokenizer.decode` of all the ids."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))  # type: ignore[attr-defined]

    def end(self) -> str:
        return self._decoder.decode(b"", final=True)


TOKENIZERS: dict[str, type[Tokenizer]] = {"char": CharTokenizer, "word": WordTokenizer,
                                          "byte": ByteTokenizer, "bpe": BpeTokenizer}


def make_tokenizer(tokens: Sequence[str], kind: str | None = "char") -> Tokenizer:
    """The tokenizer a checkpoint saved: its ``vocab`` list and ``tokenizer`` kind (absent in
    checkpoints from before word vocabularies: ``char``)."""
    klass = TOKENIZERS.get(kind or "char")
    if klass is None:
        raise DataError(f"unknown tokenizer kind {kind!r}; known: {', '.join(TOKENIZERS)}")
    return klass(tokens)
