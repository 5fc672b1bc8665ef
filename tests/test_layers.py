"""The packages' layering (docs/design.md "Layers"): `runtime/` at the bottom, importing only
`plugins/`; `build_engines/`, `server/`, `calibration/` and `reference/` above it and never into
each other; `tools/` and `runtime/cli.py` above everything; and no import cycle between files.
Every import counts, the lazy ones inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "plugins",
    "runtime",
    "build_engines",
    "server",
    "calibration",
    "reference",
    "tools",
    "bench",
)
# what each package may import of the project besides itself
ALLOWED = {
    "plugins": set(),
    "runtime": {"plugins"},
    "build_engines": {"runtime", "plugins"},
    "server": {"runtime", "plugins"},
    "calibration": {"runtime", "plugins"},
    "reference": {"runtime", "plugins"},
    "tools": set(PACKAGES) - {"bench"},
    "bench": set(PACKAGES),  # the measurements; only runtime/cli.py (TOP) imports them
}
TOP = ("runtime/cli.py",)  # the command line dispatches to every layer


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules a file imports (a `from package import name` of a submodule counts)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = source_files()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    modules = source_files()
    problems = []
    for name, targets in edges.items():
        if str(modules[name].relative_to(ROOT)) in TOP:
            continue
        package = name.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != package and other not in ALLOWED[package]:
                problems.append(f"{name} imports {target}")
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_package_imports_only_downwards():
    assert layer_violations(graph()) == []


def test_no_import_cycle_between_files():
    assert cycles(graph()) == []


def test_the_checks_catch_what_they_forbid():
    edges = {"runtime.executor": {"build_engines.engines"}, "build_engines.engines": set()}
    assert layer_violations(edges) == ["runtime.executor imports build_engines.engines"]
    assert layer_violations({"server.app": {"reference.mso1"}, "reference.mso1": set()})
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
