"""The data layer's error and the helper that keeps its messages on one line.

Everything the user can get wrong in :mod:`fbtrain.data` (a file, a URL, a vocabulary, a
text too short) raises :class:`DataError` with a one-line message that says which file or
URL is at fault and what to do; the CLI turns it into exit code 2.
"""

from __future__ import annotations

from fbtrain.errors import UserError


class DataError(UserError):
    """A user-facing data problem; the message is one line naming the file/URL and the fix."""


class TooShortToSplit(DataError):
    """Too few tokens for a training and a validation split; the corpus loader names the
    file or dataset (the splitting code never sees it)."""


class VocabularyError(DataError):
    """The data does not fit a given vocabulary (tokens it lacks, or too many for byte ids),
    or the vocabulary given is none (entries its tokenizer cannot read): the one data problem
    that is about the checkpoint whose vocabulary it is."""


def one_line(text: str, limit: int = 200) -> str:
    """``text`` with its whitespace runs collapsed, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
