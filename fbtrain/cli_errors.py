"""How the command line reports what went wrong: one ``error:`` line, a known exit code.

Exit codes: 0 done; 1 training failed (e.g. a non-finite loss); 2 bad input (config, data,
checkpoint, device or flag); 129 / 130 / 143 stopped by SIGHUP / SIGINT / SIGTERM; a closed
stdout (``| head``) ends quietly with 0.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

try:  # newer typer vendors click; older releases use the click package
    from typer import _click as click
except ImportError:  # pragma: no cover
    import click  # type: ignore[no-redef]

from fbtrain.errors import EXIT_USAGE, UserError
from fbtrain.startup import Stopped, exit_code


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
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except click.exceptions.UsageError as e:
            message = e.format_message().rstrip(".")
            where = f"{e.ctx.command_path}: " if e.ctx is not None else ""
            error_line(f"{where}{message[:1].lower()}{message[1:]}{_config_hint(e)}")
            sys.exit(EXIT_USAGE)
        except click.exceptions.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort as e:  # Ctrl-C (or SIGTERM, SIGHUP) while click itself was running
            interrupt = e.__cause__ if isinstance(e.__cause__, KeyboardInterrupt) else None
            typer.echo(interrupted_line(interrupt), err=True)
            sys.exit(exit_code(interrupt))
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


def _config_hint(error: click.exceptions.UsageError) -> str:
    """``; did you mean --config FILE?`` for ``fbtrain train FILE`` (a config given as an
    argument: train takes none), else ""."""
    extra = re.match(r"Got unexpected extra arguments?(?:\(s\))? \((.+)\)$", error.message)
    if extra is None or error.ctx is None or error.ctx.command.name != "train":
        return ""
    return f"; did you mean --config {extra.group(1).split()[0]}?"


def error_line(message: str) -> None:
    for line in str(message).splitlines() or [""]:
        typer.echo(f"error: {line}", err=True)


@contextlib.contextmanager
def user_errors(*, value_errors: bool = False) -> Iterator[None]:
    """Turn the errors a user can cause into ``error: ...`` lines and an exit code: every
    :class:`~fbtrain.errors.UserError` (config, data, checkpoint, RNG state, device, core)
    with its own code, the one place they are mapped.

    OSError (a folder that cannot be created, a full disk; its message names the file) is
    bad input too, exit 2. ``value_errors``: also treat ValueError as bad input (sample/eval
    check their arguments with it); train leaves it alone, so a bug there keeps its
    traceback.
    """
    bad_input: tuple[type[Exception], ...] = (OSError, ValueError) if value_errors else (OSError,)
    try:
        yield
    except BrokenPipeError:  # `fbtrain sample | head`: the reader has all it wanted
        quit_on_closed_stdout()
    except UserError as e:
        error_line(str(e))  # a ConfigError: one line per problem
        raise typer.Exit(e.exit_code) from None
    except bad_input as e:
        error_line(str(e))
        raise typer.Exit(EXIT_USAGE) from None
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (fbtrain.startup)
        typer.echo(interrupted_line(e), err=True)
        raise typer.Exit(exit_code(e)) from None


def interrupted_line(interrupt: KeyboardInterrupt | None) -> str:
    """'interrupted', naming the signal when it was not Ctrl-C: 'interrupted (SIGTERM)'."""
    return f"interrupted ({interrupt})" if isinstance(interrupt, Stopped) else "interrupted"


def quit_on_closed_stdout() -> None:
    """Exit quietly (code 0) when stdout's reader has gone, as `head` does to a pipe."""
    from fbtrain.metrics.console import silence_stdout

    silence_stdout()
    raise typer.Exit(0)
