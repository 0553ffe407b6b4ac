"""How the command line reports what went wrong: the exit code of every failure, decided in
one function (:func:`exit_code_for`), and the line(s) it prints (:func:`report`).

Exit codes: 0 done, or stdout's reader left (``| head``: ends quietly); 1 training stopped
(:class:`~fbtrain.errors.TrainingError`: a non-finite loss or gradient norm); 2 bad input
(every :class:`~fbtrain.errors.UserError`: config, data, checkpoint, device or a command's
argument; an OSError the user caused, whose message names the file: a full disk, no
permission, a path they named that is not there (:func:`user_caused`); an allocation that
failed, anywhere
(``MemoryError``, the allocator's RuntimeError: more memory asked for than the process may
use); click's usage errors: an unknown flag, a value out of range, a missing option); 129 /
130 / 143 stopped by SIGHUP / SIGINT / SIGTERM. Anything else is a bug: it keeps its
traceback (exit 1, Python's).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

try:  # newer typer vendors click; older releases use the click package
    from typer import _click as click
except ImportError:  # pragma: no cover
    import click  # type: ignore[no-redef]

from fbtrain.config.limits import allocation_failed, is_allocation_failure
from fbtrain.errors import EXIT_USAGE, FbtrainError, TrainingError
from fbtrain.startup import Stopped, exit_code


def exit_code_for(error: BaseException) -> int | None:
    """The exit code the command line ends with for ``error``; None for a bug, which keeps
    its traceback. The one place exit codes are decided (see the module's docstring)."""
    if isinstance(error, BrokenPipeError):  # `fbtrain sample | head`: the reader has enough
        return 0
    if isinstance(error, FbtrainError):  # UserError 2, TrainingError 1 or 128 + signal
        return error.exit_code
    if isinstance(error, click.exceptions.ClickException):  # usage errors: click's own 2
        return error.exit_code
    if is_allocation_failure(error):  # anywhere: more memory asked for than the process has
        return EXIT_USAGE
    if isinstance(error, OSError) and user_caused(error):
        return EXIT_USAGE
    if isinstance(error, (KeyboardInterrupt, typer.Abort)):
        return exit_code(_interrupt(error))
    return None


# What a user's setting or disk causes and the user can fix: a full disk or quota, no
# permission, a read-only place, a name too long, a file where a folder must be (or the
# other way round). Any other OSError (a path fbtrain made wrong) is a bug.
_USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                          errno.EROFS, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR,
                          errno.ELOOP})


def user_caused(error: OSError) -> bool:
    """Whether ``error`` is bad input (exit 2, its line) rather than a bug (its traceback):
    one of the errnos above, or a missing file or folder the command's own arguments name
    (``fbtrain eval --data-path missing.txt``)."""
    if error.errno in _USER_ERRNOS:
        return True
    return error.errno == errno.ENOENT and error.filename is not None and \
        os.path.abspath(os.fsdecode(error.filename)) in _named_paths()


def _named_paths() -> set[str]:
    """Every value the running command was given, as an absolute path (``--set KEY=VALUE``:
    its value): the paths the user named. Empty outside a command."""
    ctx = click.globals.get_current_context(silent=True)
    values: list[Any] = []
    while ctx is not None:
        values += ctx.params.values()
        ctx = ctx.parent
    words = [str(w) for v in values for w in (v if isinstance(v, (list, tuple)) else [v])
             if isinstance(w, (str, os.PathLike))]
    return {os.path.abspath(w.split("=", 1)[-1]) for w in words if w}


def report(error: BaseException, argv: list[str] | None = None) -> None:
    """Print what the user sees for ``error`` (one of :func:`exit_code_for`'s, not a bug)
    on stderr: ``error:`` lines, training's own stop line, or 'interrupted'. ``argv``: the
    command line's words, which a usage error's suggestion may quote."""
    if isinstance(error, BrokenPipeError):
        from fbtrain.metrics.console import silence_stdout

        silence_stdout()
    elif isinstance(error, TrainingError):  # 'step 5: loss is nan; ...': a sentence of its own
        typer.echo(str(error), err=True)
    elif isinstance(error, click.exceptions.UsageError) and \
            not isinstance(error, click.exceptions.NoArgsIsHelpError):
        hint = _usage_hint(error, argv or [])
        # click's own suggestion ("Possible options: ...") gives way to a better one
        message = (error.message if hint else error.format_message()).rstrip(".")
        where = f"{error.ctx.command_path}: " if error.ctx is not None else ""
        error_line(f"{where}{message[:1].lower()}{message[1:]}{hint}")
    elif isinstance(error, click.exceptions.ClickException):  # `fbtrain` alone: the help
        error.show()
    elif isinstance(error, (KeyboardInterrupt, typer.Abort)):
        typer.echo(interrupted_line(_interrupt(error)), err=True)
    elif is_allocation_failure(error):  # one the command did not name itself
        error_line(allocation_failed(error, "", "give the process more memory, or ask for "
                                     "less"))
    else:
        error_line(str(error))  # a ConfigError: one line per problem


def fail(error: BaseException, argv: list[str] | None = None) -> NoReturn:
    """End the command as :func:`exit_code_for` says, after :func:`report`; a bug is
    raised again as it was (its traceback kept)."""
    code = exit_code_for(error)
    if code is None:
        raise error
    # stderr itself may not take it (2>/dev/full): the exit code still says it
    with contextlib.suppress(OSError):
        report(error, argv)
    if isinstance(error, FbtrainError) and error.skip_teardown:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _interrupt(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt behind ``error`` (itself, or the cause of click's Abort)."""
    if isinstance(error, KeyboardInterrupt):
        return error
    return error.__cause__ if isinstance(error.__cause__, KeyboardInterrupt) else None


class OneLineErrors(TyperGroup):
    """Click's own usage errors (a flag value out of range, an unknown choice, a missing
    option) as one ``error:`` line and exit code 2, like every other bad input, instead of
    click's usage block. ``fbtrain`` alone still prints the help."""

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        # Abort: Ctrl-C (or SIGTERM, SIGHUP) while click itself was running
        except (click.exceptions.ClickException, typer.Abort) as e:
            fail(e, list(args) if args is not None else sys.argv[1:])
        # Without standalone mode click returns a command's result, or the code it exited
        # with; fbtrain's commands return None.
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: Any) -> Any:
        """Run the command; a result printed after stdout's reader left (``eval --json |
        true``) ends quietly with 0. Caught here, inside click, whose own main turns a
        broken pipe into exit code 1."""
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            quit_on_closed_stdout()


def _usage_hint(error: click.exceptions.UsageError, argv: list[str]) -> str:
    """What ``fbtrain train`` was most likely meant to be, as ``; did you mean ...?``, or "":

    - ``--set train.max_steps 100`` (a space for the ``=``): ``--set train.max_steps=100``;
    - ``train configs/tiny.yaml`` (a config as an argument: train takes none): ``--config``;
    - ``--steps 100`` (a config key as a flag; click has no one flag to suggest):
      ``--set train.max_steps=100``.
    """
    ctx = error.ctx
    if ctx is None or ctx.command.name != "train":
        return ""
    extra = re.match(r"Got unexpected extra arguments?(?:\(s\))? \((.+)\)$", error.message)
    if extra is not None:
        value = extra.group(1).split()[0]
        at = argv.index(value) if value in argv else -1
        if at >= 2 and argv[at - 2] in ("--set", "-s") and "=" not in argv[at - 1]:
            return f"; did you mean --set {argv[at - 1]}={value}?"
        return f"; did you mean --config {value}?"
    if isinstance(error, click.exceptions.NoSuchOption):
        from fbtrain.config.tree import closest_keys

        flag = error.option_name
        keys = closest_keys(flag.lstrip("-"))
        exact = any(key.endswith("." + flag.lstrip("-").replace("-", "_")) for key in keys)
        # A flag click can name (--devic: --device) is the better guess, unless the word
        # is a key's very name (--seed: run.seed, though click would say --set).
        if keys and (exact or len(error.possibilities or ()) != 1):
            sets = [f"--set {key}={_flag_value(flag, argv) or 'VALUE'}" for key in keys]
            return f"; did you mean {' or '.join(sets)}?"
    return ""


def _flag_value(flag: str, argv: list[str]) -> str:
    """The value given to ``flag`` on the command line (``--steps 100``, ``--steps=100``),
    or "" when none is there."""
    for i, word in enumerate(argv):
        if word.startswith(flag + "="):
            return word[len(flag) + 1:]
        if word == flag and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return ""


def error_line(message: str) -> None:
    for line in str(message).splitlines() or [""]:
        typer.echo(f"error: {line}", err=True)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Run a command's work, ending every failure :func:`exit_code_for` knows with its line
    and code (:func:`fail`); a bug passes through with its traceback."""
    try:
        yield
    except (Exception, KeyboardInterrupt) as e:
        if exit_code_for(e) is None:
            raise  # a bug: its traceback, as it was
        fail(e)


def interrupted_line(interrupt: KeyboardInterrupt | None) -> str:
    """'interrupted', naming the signal when it was not Ctrl-C: 'interrupted (SIGTERM)'."""
    return f"interrupted ({interrupt})" if isinstance(interrupt, Stopped) else "interrupted"


def quit_on_closed_stdout() -> NoReturn:
    """Exit quietly (code 0) when stdout's reader has gone, as `head` does to a pipe."""
    fail(BrokenPipeError())
