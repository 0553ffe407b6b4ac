"""The one base class for errors a user can cause, and the exit code each ends with.

A bad config key, a missing file, a damaged checkpoint, a device that is not there, a
core that cannot be built: each raises a subclass of :class:`UserError` whose message is
one line (or, for a config, one line per problem) naming what is wrong and what is
allowed. The CLI maps them all in one place (:func:`fbtrain.cli_errors.user_errors`): the
message as ``error:`` lines, then ``exit_code``. Anything else that escapes is a bug and
keeps its traceback. Imports nothing, so every layer can raise one.
"""

from __future__ import annotations

EXIT_USAGE = 2  # bad input, as click's own usage errors


class UserError(Exception):
    """Something the user can fix; ``str()`` is the user-facing message (one line per
    problem) and ``exit_code`` what the CLI exits with."""

    exit_code: int = EXIT_USAGE
