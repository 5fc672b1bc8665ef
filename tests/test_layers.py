"""The packages' layering (docs/design.md "Layers"): `runtime/` at the bottom, importing only
`plugins/`; `build_engines/`, `server/`, `calibration/` and `reference/` above it and never into
each other; `tools/` and `runtime/cli.py` above everything; inside `runtime/`, its own order of
layers (`RUNTIME_LAYERS`, docs/design.md "Inside runtime/"); and no import cycle between files.
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
# runtime/'s modules from the bottom up: a module imports only from its own layer or below
RUNTIME_LAYERS = (
    ("shared names and settings", ("runtime", "runtime.constants", "runtime.config",
                                   "runtime.errors", "runtime.types", "runtime.lru",
                                   "runtime.pools")),
    ("formats", ("runtime.export_format", "runtime.manifest")),
    ("request input", ("runtime.strict_json", "runtime.images", "runtime.panels",
                       "runtime.contract", "runtime.tokenizer", "runtime.processing",
                       "runtime.warm_up", "runtime.explain", "runtime.video",
                       "runtime.video_tracks", "runtime.video_prepare")),
    ("model", ("runtime.model",)),
    ("passes", ("runtime.passes", "runtime.packing", "runtime.batch")),
    ("backends", ("runtime.backends",)),
    ("heads and finishing", ("runtime.heads", "runtime.finish")),
    ("execution stages", ("runtime.run_passes", "runtime.image_prefix", "runtime.readouts",
                          "runtime.flight")),
    ("executor", ("runtime.executor",)),
    ("command line", ("runtime.cli",)),
)  # fmt: skip


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


def runtime_layer(name: str) -> int:
    """The index in RUNTIME_LAYERS of a runtime module (a package's modules are its layer's)."""
    best, rank = "", -1
    for index, (_, members) in enumerate(RUNTIME_LAYERS):
        for member in members:
            inside = name == member or name.startswith(member + ".")
            if inside and len(member) > len(best):
                best, rank = member, index
    if rank < 0:
        raise AssertionError(f"{name} is in no layer of RUNTIME_LAYERS")
    return rank


def runtime_violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports inside runtime/ from a higher layer than the importer's."""
    problems = []
    for name, targets in sorted(edges.items()):
        if name.split(".")[0] != "runtime":
            continue
        for target in sorted(targets):
            if target.split(".")[0] == "runtime" and runtime_layer(target) > runtime_layer(name):
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


def test_runtime_imports_only_its_own_layer_or_below():
    assert runtime_violations(graph()) == []


def test_no_import_cycle_between_files():
    assert cycles(graph()) == []


def test_the_checks_catch_what_they_forbid():
    edges = {"runtime.executor": {"build_engines.engines"}, "build_engines.engines": set()}
    assert layer_violations(edges) == ["runtime.executor imports build_engines.engines"]
    assert layer_violations({"server.app": {"reference.mso1"}, "reference.mso1": set()})
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    upward = {"runtime.export_format": {"runtime.heads"}, "runtime.heads": {"runtime.types"}}
    assert runtime_violations(upward) == ["runtime.export_format imports runtime.heads"]
    assert runtime_violations({"runtime.backends.compiled": {"runtime.executor"}})
    assert not runtime_violations({"runtime.backends.compiled": {"runtime.model.layers"}})


def test_every_runtime_module_has_a_layer():
    for name in source_files():
        if name.split(".")[0] == "runtime":
            runtime_layer(name)
