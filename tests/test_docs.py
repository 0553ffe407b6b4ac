"""The docs stay true to the code: the key reference is generated and complete, every config
key a page names exists, every command a page quotes parses (its config file exists, its
keys and values load, its flags exist), and every link points at a file that is there."""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fbtrain.cli import app
from fbtrain.cli_errors import click  # click as typer ships it (vendored or not)
from fbtrain.config import SECTIONS, ConfigError, load_config
from fbtrain.config.reference import BEGIN, END, config_keys, markdown_table, render_page

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
EXPECTED_PAGES = {"configuration.md", "datasets.md", "carried-memory.md", "state-tracking.md",
                  "performance.md", "design.md", "troubleshooting.md", "results.md",
                  "commands.md"}


def all_keys() -> set[str]:
    """Every config key the code has, as ``section.key`` (and ``curriculum``)."""
    keys = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    return keys | {"curriculum"}


# ----------------------------------------------------------------------------- the pages


def test_the_docs_pages_exist():
    assert {p.name for p in DOCS.glob("*.md")} >= EXPECTED_PAGES


def test_configuration_page_is_the_generated_table():
    page = CONFIGURATION.read_text(encoding="utf-8")
    assert render_page(page) == page, (
        "docs/configuration.md is stale: run python -m fbtrain.config.reference")


def test_configuration_page_lists_every_key_and_only_real_keys():
    page = CONFIGURATION.read_text(encoding="utf-8")
    table = page.split(BEGIN, 1)[1].split(END, 1)[0]
    listed = re.findall(r"^\| `([a-z_.0-9]+)` \|", table, flags=re.M)
    assert len(listed) == len(set(listed)), "a key is listed twice"
    assert set(listed) == all_keys(), (
        f"missing: {sorted(all_keys() - set(listed))}; unknown: {sorted(set(listed) - all_keys())}")


def test_reference_escapes_what_markdown_would_eat():
    # "<out_dir>/<name>" unescaped is read as two HTML tags and shown as "/".
    assert "<out_dir>" not in markdown_table()
    assert "&lt;out_dir&gt;/&lt;name&gt;" in markdown_table()


def test_render_page_refuses_a_page_without_markers():
    with pytest.raises(ValueError, match="no .*BEGIN KEYS"):
        render_page("# no table here\n")


# ----------------------------------------------------------------------------- config keys


# `section.key` at the start of a code span, optionally followed by = or : and a value.
KEY_MENTION = re.compile(r"`(run|data|model|train|checkpoint|logging)\.([a-z_0-9]+)(?=[`=: ])")
FILE_SUFFIXES = {"py", "yaml", "jsonl", "json", "pt", "png", "md", "cpp", "txt", "safetensors"}


def test_every_config_key_the_docs_name_exists():
    known = all_keys()
    bad = []
    for page in PAGES:
        for m in KEY_MENTION.finditer(page.read_text(encoding="utf-8")):
            key = f"{m.group(1)}.{m.group(2)}"
            if m.group(2) not in FILE_SUFFIXES and key not in known:
                bad.append(f"{page.relative_to(ROOT)}: {key}")
    assert not bad, "unknown config keys named in the docs:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- commands


def code_lines(text: str) -> Iterator[tuple[str, str | None]]:
    """(command, next line) for each line of a fenced code block, continuations joined."""
    in_block, pending = False, ""
    lines = text.splitlines()
    for i, raw in enumerate(lines):
        if raw.lstrip().startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if not in_block:
            continue
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else None
        yield pending + line, nxt
        pending = ""


def inline_commands(text: str) -> Iterator[str]:
    """Inline code spans (outside fenced blocks) that are ``fbtrain ...`` commands."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())  # a span may wrap over two lines
        if span.startswith("fbtrain "):
            yield span


def split_command(command: str) -> list[str] | None:
    """The words of a shell command line, comment dropped; None if it is not fbtrain's."""
    command = command.removeprefix("$ ")
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]  # VAR=value prefixes (OMP_NUM_THREADS=1 fbtrain ...)
    if words[:1] == ["torchrun"]:
        words = words[words.index("-m") + 1:] if "-m" in words else []
        words = ["fbtrain", *words[1:]] if words[:1] == ["fbtrain"] else []
    if words[:3] == ["python", "-m", "fbtrain"]:
        words = ["fbtrain", *words[3:]]
    return words if words[:1] == ["fbtrain"] else None


def documented_commands() -> list[tuple[str, list[str], bool]]:
    """(where, words, expected to fail) for every fbtrain command in the README and docs; a
    command followed by an ``error:`` line in its block is an example of a refusal."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        where = str(page.relative_to(ROOT))
        for line, nxt in code_lines(text):
            words = split_command(line)
            if words:
                found.append((where, words, bool(nxt and nxt.startswith("error:"))))
        for span in inline_commands(text):
            words = split_command(span)
            if words:
                found.append((where + " (inline)", words, False))
    return found


COMMANDS = documented_commands()
CLICK_APP = typer.main.get_command(app)


def test_the_docs_quote_commands():
    # The extraction works: the README's quickstart and the docs' rows are all seen.
    words = [" ".join(w) for _, w, _ in COMMANDS]
    assert any(w.startswith("fbtrain sample --checkpoint runs/tiny_shakespeare") for w in words)
    assert any("--set train.eval_every=500" in w for w in words)
    assert len(COMMANDS) > 40


def train_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """The --config file and the --set overrides (with --device as run.device) of train."""
    config, sets = None, []
    for i, word in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else ""
        if word == "--config":
            config = value
        elif word in ("--set", "-s"):
            sets.append(value)
        elif word == "--device":
            sets.append(f"run.device={value}")
    return config, sets


@pytest.mark.parametrize(("where", "words", "fails"), COMMANDS,
                         ids=[f"{w}: {' '.join(c)}"[:120] for w, c, _ in COMMANDS])
def test_documented_command_parses(where: str, words: list[str], fails: bool):
    command, args = words[1], words[2:]
    if command in ("--help", "--version") or command.isupper():  # COMMAND: a placeholder
        return
    assert command in CLICK_APP.commands, f"{where}: no such command: {command}"
    sub = CLICK_APP.commands[command]
    inline = where.endswith("(inline)")
    if inline:
        # Inline spans may leave out a required flag; every flag they name must exist.
        names = {opt for p in sub.params for opt in (*p.opts, *p.secondary_opts)}
        unknown = [w for w in args if w.startswith("-") and w.split("=")[0] not in names]
        assert not unknown, f"{where}: {command} has no {unknown}"
    else:
        try:
            sub.make_context(command, list(args))
        except click.exceptions.ClickException as e:
            pytest.fail(f"{where}: fbtrain {' '.join(args)}: {e.format_message()}")
    if command != "train":
        return
    config, sets = train_overrides(args)
    if inline and any(w.startswith(("$(", "<")) for w in args):
        return  # a placeholder, as in the make targets' table: `--config $(CONFIG)`
    if config is not None:
        assert (ROOT / config).is_file(), f"{where}: no config file {config}"
    if fails:
        with pytest.raises(ConfigError):
            load_config(ROOT / config if config else None, sets)
    else:
        load_config(ROOT / config if config else None, sets)


MAKE_LINE = re.compile(r"^(?:\$ )?make ([a-z][a-z-]*)")


def test_documented_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    quoted = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for line, _ in code_lines(text):
            if m := MAKE_LINE.match(line):
                quoted.add(m.group(1))
        quoted |= set(re.findall(r"`make ([a-z][a-z-]*)", text))
    assert {"train", "test"} <= quoted
    assert quoted <= targets, f"make targets quoted but not in the Makefile: {quoted - targets}"


def test_documented_scripts_exist():
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for script in re.findall(r"\bscripts/[a-z_]+\.py", text):
            if not (ROOT / script).is_file():
                missing.append(f"{page.name}: {script}")
        for module in re.findall(r"python -m (fbtrain(?:\.[a-z_]+)*)", text):
            if not (ROOT / (module.replace(".", "/") + ".py")).is_file() and \
                    not (ROOT / module.replace(".", "/") / "__main__.py").is_file():
                missing.append(f"{page.name}: python -m {module}")
    assert not missing, missing


def test_no_development_paths_in_user_facing_text():
    # ../shared/... exists only in this project's development set-up.
    bad = [p.name for p in PAGES if "../shared" in p.read_text(encoding="utf-8")]
    assert not bad


# ----------------------------------------------------------------------------- links


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target, anchor in LINK.findall(text):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                bad.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor[1:] not in anchors(path):
                bad.append(f"{page.name}: {target}{anchor}")
        for anchor in re.findall(r"\]\((#[^)\s]+)\)", text):
            if anchor[1:] not in anchors(page):
                bad.append(f"{page.name}: {anchor}")
    assert not bad, "broken links:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- --list-keys


def test_list_keys_prints_every_key_with_default_and_help():
    result = CliRunner().invoke(app, ["train", "--list-keys"])
    assert result.exit_code == 0, result.output
    for key in config_keys():
        assert f"{key.name} = {key.default}\n" in result.output
    assert "train.lr = 0.002\n    Peak learning rate (AdamW)." in result.output


# ----------------------------------------------------------------------------- headline figures


RESULTS = DOCS / "results.md"
FIGURE = re.compile(r"(?<![\d.])\d\.\d{4}(?![\d.])")  # a loss or bpc to four decimals
CPU_KIND = re.compile(r"AVX-?512|AVX2")


def section(text: str, heading: str) -> str:
    """The body under ``heading`` (any level) up to the next heading of that level or above."""
    m = re.search(rf"^(#+) {re.escape(heading)}\n", text, flags=re.M)
    assert m, f"no heading {heading!r}"
    level = len(m.group(1))
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def machines_table() -> tuple[list[str], list[list[str]]]:
    """results.md's "Across CPU kinds" table: its header cells and its rows' cells."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section(RESULTS.read_text(encoding="utf-8"), "Across CPU kinds")
            .splitlines() if line.startswith("|") and not line.startswith("|---")]
    return rows[0], rows[1:]


RANGE = re.compile(r"(?<![\d.])(\d\.\d{3,4})-(\d\.\d{3,4})(?![\d.])")


def table_ranges() -> dict[str, tuple[float, float]]:
    """The machines table's range column, by row (those that state one)."""
    header, rows = machines_table()
    return {row[0]: tuple(float(x) for x in m.groups())
            for row in rows if (m := RANGE.fullmatch(row[-1]))}


def test_the_machines_table_names_each_machine_and_the_range():
    """Both CPU kinds at least, each column with its CPU and commit (or that the report
    gave none), and a range column that is the lowest and highest figure of its row."""
    header, rows = machines_table()
    machines = [h for h in header[1:] if CPU_KIND.search(h)]
    assert len(machines) >= 2 and {CPU_KIND.search(m).group() for m in machines} >= {
        "AVX-512", "AVX2"}, header
    assert all(re.search(r"commit (?:[0-9a-f]{7}|not given)", m) for m in machines), header
    assert header[-1] == "range" and rows
    ranges = table_ranges()
    assert len(ranges) >= 2, rows
    for row in rows:
        if row[0] in ranges:
            losses = [float(FIGURE.findall(cell)[0]) for cell in row[1:-1]
                      if FIGURE.findall(cell)]
            assert ranges[row[0]] == (min(losses), max(losses)), row


@pytest.mark.parametrize(("page", "heading"), [
    (ROOT / "README.md", "Quickstart"),
    (ROOT / "README.md", "Results at a glance"),
    (RESULTS, "Tiny Shakespeare"),
], ids=["README-quickstart", "README-results", "results-tiny-shakespeare"])
def test_a_headline_figure_is_stated_with_its_machine_and_the_range(page: Path, heading: str):
    """Training is deterministic per machine, not across machines: every four-decimal
    figure of a headline section is in results.md's machines table (the machine it came
    from), and the section states what to expect elsewhere as a range that covers what
    every machine measured (the table's ``fbtrain eval`` range)."""
    body = section(page.read_text(encoding="utf-8"), heading)
    if page == RESULTS:  # its own machines table is part of the section; the rest is not
        body = body.split("### Across CPU kinds", 1)[0]
        body = body.split("### Earlier measurements", 1)[0]
    figures = set(FIGURE.findall(body))
    assert figures, f"{page.name} {heading}: no figures (update this test's sections)"
    in_table = {f for row in machines_table()[1] for f in FIGURE.findall(" ".join(row))}
    assert figures <= in_table, (
        f"{page.name} {heading}: figures without a machine in results.md's 'Across CPU kinds' "
        f"table: {sorted(figures - in_table)}")
    stated = [(float(lo), float(hi)) for lo, hi in RANGE.findall(body)]
    evaluated = next(r for name, r in table_ranges().items() if "fbtrain eval" in name)
    assert any(lo <= evaluated[0] and evaluated[1] <= hi for lo, hi in stated), (
        f"{page.name} {heading}: no range covering the measured {evaluated}: {stated}")


def test_the_readme_expects_ranges_that_cover_every_machine():
    """The quickstart's expectation, logged and from ``eval``, covers every machine's figure
    in results.md (a new machine outside it makes this fail until the README says so)."""
    quickstart = section((ROOT / "README.md").read_text(encoding="utf-8"), "Quickstart")
    m = re.search(r"expect \*\*(\d\.\d{3})-(\d\.\d{3})\*\*\s+logged\s+at\s+step\s+1500\s+and\s+"
                  r"\*\*(\d\.\d{3})-(\d\.\d{3})\*\*\s+from\s+`eval`", quickstart)
    assert m, "the README states no ranges to expect"
    logged, evaluated = (float(m[1]), float(m[2])), (float(m[3]), float(m[4]))
    ranges = table_ranges()
    for name, (lo, hi) in ranges.items():
        want = evaluated if "fbtrain eval" in name else logged
        assert want[0] <= lo and hi <= want[1], (name, (lo, hi), want)


# ----------------------------------------------------------------------------- figures


# A measurement in words: milliseconds, "3-5x faster", "took 112 s", "0.3 s for", "20% of a
# step", a rate, "measured ... 42". An example inside ``...`` (a status line's format) is
# not one.
MEASURED = re.compile(
    r"\b\d[\d.,]*\s?(?:ms|us|µs)\b|\b\d[\d.]*(?:-\d[\d.]*)?x (?:faster|slower)\b|\btook \d|"
    r"\b\d[\d.]*\s?s (?:for|a step|per)\b|\b\d[\d.]*%\s+of (?:a|the) step\b|"
    r"\b\d[\d,.]*\s?(?:tokens|tok|bytes|characters)/s\b|\bmeasured\b[^.\n]{0,40}\d", re.I)


def comments_and_docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every comment and docstring of a Python file."""
    import ast
    import io
    import tokenize

    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def test_code_carries_no_measured_figures():
    """A figure goes stale in a comment: it belongs in docs/ with its command
    (docs/performance.md, "Figures the code rests on"); the code says what and why."""
    found = [f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}"
             for path in sorted((ROOT / "fbtrain").rglob("*.py"))
             for line, text in comments_and_docstrings(path)
             for match in MEASURED.finditer(re.sub(r"``.*?``", "", text, flags=re.S))]
    assert not found, found


def test_the_figure_check_sees_comments_and_docstrings(tmp_path: Path):
    sample = tmp_path / "m.py"
    sample.write_text('"""Fast: 3-5x faster than the loop."""\nX = 1  # 1346 vs 481 ms a step\n'
                      'def f():\n    """``12,345 tok/s`` is an example."""\n')
    hits = [m.group(0) for _, text in comments_and_docstrings(sample)
            for m in MEASURED.finditer(re.sub(r"``.*?``", "", text, flags=re.S))]
    assert sorted(hits) == ["3-5x faster", "481 ms"]


def test_the_pytorch_core_notice_quotes_the_documented_figure():
    from fbtrain.models.core.select import PYTHON_CORE_SLOWDOWN

    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert f"about {PYTHON_CORE_SLOWDOWN} slower" in " ".join(page.split())
