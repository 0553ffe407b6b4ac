"""Reading a config: the YAML file (duplicate keys refused, aliases bounded, text fields
read as written), ``--set section.key=value`` overrides, then the validation report
(validate.py); and writing one back (:func:`save_config`).

Precedence: defaults < YAML file < ``--set``.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from fbtrain.config.errors import ConfigError, cut, show
from fbtrain.config.fields import allowed_types, yaml_copy
from fbtrain.config.tree import SECTIONS, Config, closest_keys
from fbtrain.config.validate import config_from_dict
from fbtrain.io import NotRegularFileError, atomic_write_text, open_regular
from fbtrain.messages import first_line, format_bytes

# A YAML document may stand for far more values than it holds: nine levels of nine aliases
# of nine strings are 400 bytes and 387 million strings. No config comes near this.
MAX_YAML_VALUES = 100_000
# The largest shipped config is under 3 KiB; 1 MiB is hundreds of configs' worth, and
# PyYAML (pure Python) is slow enough that a file much bigger would parse for minutes
# (docs/performance.md), so a bigger file is refused at once.
MAX_CONFIG_BYTES = 1 << 20


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file; unreadable files and syntax errors become a one-line ConfigError."""
    path = Path(path)
    loader = _UniqueKeyLoader(_config_text(path))
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or first_line(e)
        raise ConfigError([f"{path}:{line}: malformed YAML: {problem}"]) from None
    except _YAMLTooBig:
        raise ConfigError([f"{path}: {_YAMLTooBig.message('the YAML')}"]) from None
    except (ValueError, RecursionError) as e:
        raise ConfigError([f"{path}: {_yaml_failure(e)}"]) from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise ConfigError([f"{path}: {d}" for _, d in sorted(loader.duplicates)])
    return data


def _config_text(path: Path) -> str:
    """The text of config file ``path``, read only when it is a regular file of at most
    MAX_CONFIG_BYTES (``/dev/zero`` would fill the memory, ``/dev/urandom`` never ends, a
    FIFO would wait for a writer); a one-line ConfigError otherwise."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(MAX_CONFIG_BYTES + 1) if size <= MAX_CONFIG_BYTES else b""
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found{_close_file_hint(path)}"]) from None
    except NotRegularFileError as e:
        raise ConfigError([f"{path}: is {e.kind}, not a config file; --config takes a YAML "
                           "file"]) from None
    except OSError as e:
        raise ConfigError([f"{path}: cannot read config file: {e.strerror or e}"]) from None
    if max(size, len(raw)) > MAX_CONFIG_BYTES:  # len(raw): a file still growing as it is read
        raise ConfigError([f"{path}: {format_bytes(max(size, len(raw)))} is too big for a config "
                           f"file (at most {format_bytes(MAX_CONFIG_BYTES)}; a config is a few "
                           "KiB): is it the right file?"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: cannot read config file: not UTF-8 text (byte "
                           f"{e.start})"]) from None


def _close_file_hint(path: Path) -> str:
    """``; did you mean configs/tiny_shakespeare.yaml?`` for a name close to a file in
    ``path``'s folder (configs/tinyshakespeare.yaml), else ""."""
    try:
        names = [p.name for p in path.parent.iterdir() if p.is_file()]
    except OSError:  # the folder is missing or unreadable too
        return ""
    close = difflib.get_close_matches(path.name, names, n=1)
    return f"; did you mean {path.parent / close[0]}?" if close else ""


class _YAMLTooBig(Exception):
    """The document stands for more than MAX_YAML_VALUES values once aliases are expanded."""

    @staticmethod
    def message(what: str) -> str:
        """The problem, said of ``what`` (the YAML, the value)."""
        return (f"{what} expands to more than {MAX_YAML_VALUES:,} values through its aliases "
                "(each *name repeats everything &name anchors); a config holds a few dozen: "
                "write the values out instead")


def _yaml_failure(e: ValueError | RecursionError) -> str:
    """One line for what PyYAML raises outside its own errors: a value its constructors
    cannot build (a 5000-digit number, the date 2024-13-45) or nesting past the stack."""
    if isinstance(e, RecursionError):
        return ("malformed YAML: lists or mappings nested too deeply (thousands of levels); "
                "a config needs three at most")
    return f"malformed YAML: a value cannot be read: {cut(first_line(e))}"


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Values (nodes) the document ``root`` stands for with every alias expanded, counted
    up to just past ``limit``. An alias is the anchored node itself in the composed graph,
    so sizes are memoised per node: the count costs one visit per distinct node however
    often it is repeated. A node inside itself (``&a [*a]``) expands without end."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            return limit + 1
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        total = 1
        for child in children:
            total += size(child)
            if total > limit:
                break
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


class _BoundedLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses, before building anything, a document whose aliases
    expand past MAX_YAML_VALUES values (PyYAML would build it as shared references, but
    copying or printing it walks every one: minutes, then a MemoryError)."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            raise _YAMLTooBig()
        self.before_construct(node)
        return self.construct_document(node)

    def before_construct(self, node: yaml.Node) -> None:
        """A look at the composed document before it is built (nothing here)."""


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# YAML 1.1 (PyYAML) reads a leading 0 as octal (010 is 8) and colons as base 60 (1:30 is
# 90, 1:00:00 is 3600): silently, and never what a config meant. These resolvers read
# integers in decimal (or 0x hex, 0b binary: a prefix no one writes by accident) and floats
# without base 60; the rest is left text, which an int or float key then refuses, naming
# the key and the value (fields.decimal_hint says why).
_BoundedLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_BoundedLoader.add_implicit_resolver(
    _INT_TAG, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0x[0-9a-fA-F_]+|[-+]?(?:0|[1-9][0-9_]*))$"),
    list("-+0123456789"))
_BoundedLoader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
                           |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                           |[-+]?\.(?:inf|Inf|INF)
                           |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _load_yaml_value(text: str) -> Any:
    """yaml.safe_load of one --set value, under the same bound as a file."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


_STR_TAG, _NULL_TAG = "tag:yaml.org,2002:str", "tag:yaml.org,2002:null"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(_BoundedLoader):
    """The config file's loader: notes every key given twice in one mapping (YAML keeps the
    last silently, so a second ``lr:`` further down would quietly win over the first), and
    reads each text field's plain scalar as the text written (see :meth:`before_construct`)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.duplicates: list[tuple[int, str]] = []  # (line, message)
        self._checked: set[int] = set()  # ids of the mappings checked for duplicates

    def before_construct(self, node: yaml.Node) -> None:
        """Text fields (run.name, data.path, ...) keep the text written: YAML 1.1 would read
        ``name: 007`` as 7, ``yes`` as True and ``2024-06-01`` as a date. Only plain
        (unquoted) scalars that would not be null change; as --set does (apply_overrides)."""
        if not isinstance(node, yaml.MappingNode):
            return
        self.flatten_mapping(node)  # merged-in sections and keys are looked at too
        for section_node, body in node.value:
            if not (isinstance(section_node, yaml.ScalarNode)
                    and isinstance(body, yaml.MappingNode)):
                continue
            self.flatten_mapping(body)
            for i, (key_node, value_node) in enumerate(body.value):
                if (isinstance(key_node, yaml.ScalarNode)
                        and isinstance(value_node, yaml.ScalarNode)
                        and value_node.style is None
                        and value_node.tag not in (_STR_TAG, _NULL_TAG)
                        and _is_text_field(section_node.value, key_node.value)):
                    # A new node, not a retagged one: an alias elsewhere keeps its type.
                    text = yaml.ScalarNode(_STR_TAG, value_node.value, value_node.start_mark,
                                           value_node.end_mark, style=None)
                    body.value[i] = (key_node, text)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Merge keys (``<<: *defaults``) spliced in, as PyYAML does, after noting the keys
        this mapping itself gives twice: a key a merge brings in and the mapping then sets
        is an override, as YAML means it, not a duplicate. Called again on a mapping
        already spliced (by before_construct, then by its construction): checked once."""
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._note_duplicates(node)
        super().flatten_mapping(node)

    def _note_duplicates(self, node: yaml.MappingNode) -> None:
        first_given: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_given:
                    self.duplicates.append((line, f"duplicate key {show(key)} at line {line} "
                                            f"(first given at line {first_given[key]}); "
                                            "give each key once"))
                else:
                    first_given[key] = line
            except TypeError:  # an unhashable key: construct_mapping reports it
                pass


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings (values parsed as YAML scalars) to a nested dict."""
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"--set {show(item)}: must look like section.key=value")
            continue
        try:
            value = _load_yaml_value(text) if text.strip() else None
        except _YAMLTooBig:
            problems.append(f"--set {show(item)}: {_YAMLTooBig.message('the value')}")
            continue
        except (ValueError, RecursionError) as e:
            problems.append(f"--set {show(item)}: {_yaml_failure(e)}")
            continue
        except yaml.YAMLError:
            problems.append(f"--set {show(item)}: value {show(text)} is not valid YAML")
            continue
        parts = key.split(".")
        if parts == ["curriculum"]:
            raw["curriculum"] = value
            continue
        named = [part for part in parts if part.strip()]  # ".max_steps": no section named
        if len(parts) != 2 or len(named) != 2:
            meant = closest_keys(named[-1]) if len(named) == 1 else []
            hint = f"; did you mean {' or '.join(f'{k}={text}' for k in meant)}?" if meant else ""
            problems.append(f"--set {show(item)}: key must be section.key (or curriculum)"
                            f"{hint}")
            continue
        section = raw.setdefault(parts[0], {})
        if not isinstance(section, dict):
            problems.append(f"--set {show(item)}: {parts[0]} is not a section")
            continue
        if _is_text_field(parts[0], parts[1]) and (
                isinstance(value, (int, float, datetime.date)) or _cut_at_a_hash(text)):
            # run.name=007 stays "007" (not the integer 7), 2024-06-01 too (not a date);
            # data.path='#1 notes.txt' too (YAML: a comment, so null: the download).
            value = text.strip()
        section[parts[1]] = value
    if problems:
        raise ConfigError(problems)
    return raw


def _cut_at_a_hash(text: str) -> bool:
    """Whether YAML reads part of the unquoted ``text`` as a comment (a ``#`` at its start
    or after a space), which the value written did not mean."""
    plain = text.strip()
    return not plain.startswith(("'", '"')) and (plain.startswith("#") or " #" in plain
                                                  or "\t#" in plain)


def _is_text_field(section: str, key: str) -> bool:
    """``section.key`` is a text field (str, maybe null): its value is the text written."""
    cls = SECTIONS.get(section)
    if cls is None or key not in {f.name for f in dataclasses.fields(cls)}:
        return False
    allowed = allowed_types(typing.get_type_hints(cls)[key])
    return str in allowed and not {int, float, bool} & set(allowed)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file at ``path`` (optional) < ``overrides``; raises ConfigError."""
    raw = read_yaml(path) if path is not None else {}
    if raw is None:
        raw = {}
    where = str(path) if path is not None else "<defaults>"
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: the top level must be a mapping of sections"])
    raw = yaml_copy(raw)
    # A section the file gets wrong is the file's problem, whatever --set adds to it.
    file_problems = []
    for name in SECTIONS:
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            file_problems.append(f"{where}: {name} = {show(raw[name])}: must be a mapping of "
                                 "keys to values")
            raw[name] = {}
    try:
        raw = apply_overrides(raw, list(overrides))
        cfg = config_from_dict(raw, where + (" (with --set)" if overrides else ""))
    except ConfigError as e:
        raise ConfigError(file_problems + e.problems) from None
    if file_problems:
        raise ConfigError(file_problems)
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    """Write ``cfg`` to ``path`` as YAML (atomically: a reader sees the old file or the new)."""
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
