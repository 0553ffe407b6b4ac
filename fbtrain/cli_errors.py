"""How the command line reports what went wrong: one ``error:`` line, a known exit code.

Exit codes: 0 done; 1 training failed (e.g. a non-finite loss); 2 bad input (config, data,
checkpoint, device or flag); 129 / 130 / 143 stopped by SIGHUP / SIGINT / SIGTERM; a closed
stdout (``| head``) ends quietly with 0.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperGroup

try:  # newer typer vendors click; older releases use the click package
    from typer import _click as click
except ImportError:  # pragma: no cover
    import click  # type: ignore[no-redef]

from fbtrain.config import ConfigError

EXIT_USAGE = 2  # bad input, as click's own usage errors
EXIT_INTERRUPTED = 130  # 128 + SIGINT


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
            error_line(f"{where}{message[:1].lower()}{message[1:]}")
            sys.exit(EXIT_USAGE)
        except click.exceptions.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:  # Ctrl-C while click itself was running
            typer.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
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


def error_line(message: str) -> None:
    for line in str(message).splitlines() or [""]:
        typer.echo(f"error: {line}", err=True)


@contextlib.contextmanager
def user_errors(*, value_errors: bool = False) -> Iterator[None]:
    """Turn the errors a user can cause into ``error: ...`` lines and exit code 2.

    ``value_errors``: also treat ValueError as bad input (sample/eval check their arguments
    with it); train leaves it alone, so a bug there keeps its traceback.
    """
    from fbtrain.checkpoint import CheckpointError
    from fbtrain.data.errors import DataError
    from fbtrain.device import DeviceError

    # OSError: a folder that cannot be created, a full disk; its message names the file.
    bad_input: tuple[type[Exception], ...] = (DataError, CheckpointError, DeviceError, OSError)
    if value_errors:
        bad_input += (ValueError,)
    try:
        yield
    except BrokenPipeError:  # `fbtrain sample | head`: the reader has all it wanted
        quit_on_closed_stdout()
    except ConfigError as e:
        for problem in e.problems:
            error_line(problem)
        raise typer.Exit(EXIT_USAGE) from None
    except bad_input as e:
        error_line(str(e))
        raise typer.Exit(EXIT_USAGE) from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def quit_on_closed_stdout() -> None:
    """Exit quietly (code 0) when stdout's reader has gone, as `head` does to a pipe."""
    from fbtrain.metrics.console import silence_stdout

    silence_stdout()
    raise typer.Exit(0)
