"""fbtrain's exception hierarchy: every failure it reports as a message, not a traceback.

- :class:`FbtrainError`: the base; ``str()`` is the message and ``exit_code`` what the
  command exits with.
- :class:`UserError` (exit 2): something the user can fix. A bad config key, a missing
  file, a damaged checkpoint, a device that is not there, a core that cannot be built: each
  raises a subclass whose message is one line (or, for a config, one line per problem)
  naming what is wrong and what is allowed. :class:`ArgumentError` is the one for a value
  given to a command (a flag, a split, a prompt); :class:`OutOfMemory` the one for an
  allocation that failed (what was asked is more than this process may use).
- :class:`TrainingError` (exit 1, or 128 + the signal): training stopped, on a non-finite
  loss or gradient norm, or on a signal after saving.

The CLI maps these and everything else (a closed pipe, an OSError, Ctrl-C, click's usage
errors) in one function, :func:`fbtrain.cli_errors.exit_code_for`. Anything else that
escapes is a bug and keeps its traceback: a ``ValueError`` from fbtrain's own checks is an
:class:`ArgumentError` raised where the check is, never a plain one caught wholesale.
The exit codes' values are defined here and nowhere else. Imports only the standard
library, so every layer can raise one.
"""

from __future__ import annotations

EXIT_FAILED = 1  # training stopped (a non-finite loss or gradient norm), or a peer rank died
EXIT_USAGE = 2  # bad input, as click's own usage errors


def signal_exit_code(signum: int) -> int:
    """128 + the signal's number, as shells report a process a signal ended: 130 for
    SIGINT (Ctrl-C), 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + int(signum)



class FbtrainError(Exception):
    """A failure fbtrain reports as its message (one line per problem) and ``exit_code``.
    ``skip_teardown``: once reported, the process ends at once (``os._exit``), without
    Python's teardown, for a failure that leaves objects whose destruction can hang."""

    exit_code: int = EXIT_FAILED
    skip_teardown: bool = False


class UserError(FbtrainError):
    """Something the user can fix; ``str()`` is the user-facing message (one line per
    problem), shown after ``error:``."""

    exit_code: int = EXIT_USAGE


class ArgumentError(UserError, ValueError):
    """A value given to a command that cannot work (``length = 0``, a split the data does
    not have, an empty prompt). A ValueError too, so a library caller that catches those
    still does."""


class OutOfMemory(UserError):
    """An allocation failed: the memory the work asked for (a batch, a window, a text) is
    more than this process may use. The message names what was being done and the limit."""


class TrainingError(FbtrainError):
    """Training stopped; the message says why and which checkpoint holds the last good
    state. ``exit_code``: 1 (non-finite) or 129 / 130 / 143 (SIGHUP / SIGINT / SIGTERM)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code
