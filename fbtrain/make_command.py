"""The ``make`` command that started this process, for the lines that say what to run again
(the interrupt line's resume command, the offline hint of a failed download).

The Makefile's ``train`` and ``quick`` recipes name themselves in ``FBTRAIN_MAKE_TARGET``;
make passes the variables given on its command line (``DATA=input.txt``) to the recipe in
``MAKEFLAGS``, after `` -- ``, spaces escaped with a backslash and ``$`` doubled. Variables
the recipes read that came from the environment instead (``DATA=input.txt make quick``) are
in the environment as they are. Repeating them all is what makes the command run the same
thing again: without its ``DATA=`` a resume of ``make quick DATA=input.txt`` would download.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping

MAKE_TARGET_ENV = "FBTRAIN_MAKE_TARGET"
# The Makefile's variables that its train and quick recipes read (``DATA ?=``, ``CONFIG ?=``):
# set in the environment, make used them.
RECIPE_VARIABLES = ("DATA", "CONFIG")


def make_command(env: Mapping[str, str] | None = None, **replace: str) -> str | None:
    """``make quick DATA=input.txt``: the make target that runs this process and the
    variables it was given, each quoted for a shell; ``replace`` sets or replaces variables
    (``DATA="FILE"``). None when make did not start this process (``FBTRAIN_MAKE_TARGET``
    inherited by a process that make is not running, say)."""
    env = os.environ if env is None else env
    target = env.get(MAKE_TARGET_ENV, "").strip()
    if not target or not env.get("MAKELEVEL"):
        return None
    variables = dict(command_line_variables(env.get("MAKEFLAGS", "")))
    for name in RECIPE_VARIABLES:
        if env.get(name) and name not in variables:
            variables[name] = env[name]
    variables.update(replace)
    words = [f"{name}={shlex.quote(value)}" for name, value in variables.items()]
    return " ".join(["make", target, *words])


def command_line_variables(makeflags: str) -> list[tuple[str, str]]:
    """The ``(name, value)`` assignments make's command line gave, from ``MAKEFLAGS``
    (``"s -- CONFIG=a\\ b.yaml DATA=foo"``: ``[("CONFIG", "a b.yaml"), ("DATA", "foo")]``)."""
    _, sep, assigned = f" {makeflags}".partition(" -- ")
    if not sep:
        return []
    out = []
    for word in re.findall(r"(?:\\.|[^ ])+", assigned):
        word = re.sub(r"\\(.)", r"\1", word).replace("$$", "$")
        name, eq, value = word.partition("=")
        if eq and name:
            out.append((name.rstrip(":+?"), value))
    return out
