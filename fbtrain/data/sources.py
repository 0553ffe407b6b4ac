"""The built-in downloadable corpora: where each comes from and how it is split.

Plain data, no torch: the data modules fetch from it (the config knows only the names,
and a test keeps the two in step). ``data.url: null`` means a dataset's ``url`` here and
``data.sha256: auto`` its pinned ``sha256``.
"""

from __future__ import annotations

from dataclasses import dataclass

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

TEXT8_ALPHABET = b"abcdefghijklmnopqrstuvwxyz "  # text8's 27 symbols



@dataclass(frozen=True)
class Source:
    """One downloadable corpus.

    ``member``: the file inside the zip archive at ``url`` (None: the download is the
    text itself). Archived corpora are the Hutter-prize style benchmarks: a fixed size,
    split by position into train / val / test, tokenized per ``unit``. ``alphabet``: the
    only bytes the file may hold (None: any), ``allowed`` the same in words, for messages.
    """

    url: str
    sha256: str | None  # of the download; None: none pinned (nothing to compare with yet)
    tokenization: str  # "char" (UTF-8 text, one token per character) or "byte"
    member: str | None = None
    alphabet: bytes | None = None
    allowed: str = "any byte"

    @property
    def archived(self) -> bool:
        return self.member is not None


SOURCES: dict[str, Source] = {
    "tinyshakespeare": Source(TINY_SHAKESPEARE_URL, TINY_SHAKESPEARE_SHA256, "char"),
    # The paper's benchmark (Fan et al. report 0.984 valid / 0.962 test bits per byte).
    # Bytes, as published: bits per character are bits per byte. No checksum is pinned:
    # the files could not be fetched where this was written; the size check stands in.
    "enwik8": Source("http://mattmahoney.net/dc/enwik8.zip", None, "byte", member="enwik8"),
    # Lowercase letters and spaces (27 symbols): per character and per byte coincide.
    "text8": Source("http://mattmahoney.net/dc/text8.zip", None, "char", member="text8",
                    alphabet=TEXT8_ALPHABET, allowed="lowercase letters a-z and spaces"),
}

ARCHIVED = tuple(name for name, source in SOURCES.items() if source.archived)
