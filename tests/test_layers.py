"""fbtrain's modules import only downwards: no import cycle, no layer importing a higher one.

Read from the source with ``ast`` (nothing is imported), counting every import: at the top
of a module and inside functions alike, since a lazy import that closes a circle is still
a circle (the two that came back were of both sorts). docs/design.md states the order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fbtrain"

# The top-level modules and packages of fbtrain, lowest first: each may import its own
# layer and those before it, never one after it. A new module takes its place here.
LAYERS: list[set[str]] = [
    {"__init__", "errors", "io", "filelock", "messages", "progress", "rng", "rundir_names",
     "startup", "device", "distributed", "make_command"},
    {"config"},
    {"data"},
    {"models", "inference"},
    {"scoring"},
    {"checkpoint"},
    {"metrics"},
    {"evaluate", "sample", "sample_budget"},
    {"rundir"},
    {"train"},
    {"cli_errors", "cli_options", "cli", "__main__"},
]


def modules(package: Path) -> dict[str, Path]:
    """Every module under ``package`` by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: the fbtrain modules it imports}``, from every import statement in it.

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``.
    """
    found = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in found)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from .x import y
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in found:
                        targets.add(sub)
                    elif source in found:
                        targets.add(source)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def top(module: str) -> str:
    """``fbtrain.config.kinds`` -> ``config``; ``fbtrain`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a module in a higher layer than the importer's."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if layer_of(top(b)) > layer_of(top(a)))


def test_the_graph_sees_imports_inside_functions(tmp_path):
    """The reader itself: a lazy import, a relative one and ``from pkg import module``
    each make an edge, so a circle closed inside a function is found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from ..c import x\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules that import one another): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_every_top_level_module_has_a_layer():
    tops = {top(m) for m in modules(PACKAGE)}
    placed = set().union(*LAYERS)
    assert tops <= placed, f"give these a place in LAYERS: {sorted(tops - placed)}"
    assert sum(len(layer) for layer in LAYERS) == len(placed), "a name in two layers"


def test_no_layer_imports_a_higher_one():
    assert upward_imports(import_graph()) == []


@pytest.mark.parametrize("lower, higher", [("fbtrain.config.schema", "fbtrain.train.step"),
                                           ("fbtrain.models.layers", "fbtrain.scoring")])
def test_an_upward_import_is_reported(lower, higher):
    graph = {lower: {higher}, higher: set()}
    assert upward_imports(graph) == [f"{lower} -> {higher}"]


def test_the_kind_registry_reads_fields_the_model_config_has():
    """config/kinds.py sits below config/schema.py, reading a model config through its
    ModelShape protocol: every name that declares is one of ModelConfig's."""
    from fbtrain.config.kinds import ModelShape
    from fbtrain.config.schema import ModelConfig

    declared = set(ModelShape.__annotations__) | {
        name for name, value in vars(ModelShape).items() if isinstance(value, property)}
    config = ModelConfig()
    assert declared, "ModelShape declares nothing"
    assert all(hasattr(config, name) for name in declared), \
        sorted(n for n in declared if not hasattr(config, n))
