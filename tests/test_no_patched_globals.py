"""No test assigns a `runtime` module global or a runtime class's attribute (issue 36): tests
configure the runtime through its public parameters, as measurement tooling must. An AST scan
of every tests/*.py, and the scan's own check on a snippet that breaks each rule."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RUNTIME = "runtime"
# calls whose first argument is the object (or dotted string) they change
PATCHING_METHODS = {"setattr", "delattr", "setitem", "delitem", "object"}
PATCHING_BUILTINS = {"setattr", "delattr"}
PATCHING_STRING_CALLS = {"setattr", "delattr", "patch"}


def is_runtime(module: str | None) -> bool:
    return module is not None and (module == RUNTIME or module.startswith(RUNTIME + "."))


def runtime_names(tree: ast.AST) -> set[str]:
    """Names the module binds, anywhere in it, to a runtime module or to something imported
    from one (a class, a function, a constant)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and is_runtime(node.module):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if is_runtime(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def root_name(node: ast.expr) -> str | None:
    """`a` of `a`, `a.b` or `a.b.c`; None for anything else."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def patched_call(call: ast.Call, names: set[str]) -> bool:
    """`x.setattr(target, ...)` (monkeypatch's and the like), `setattr(target, ...)`, or
    `patch("runtime....")`, where the target is a runtime name or a dotted runtime path."""
    if not call.args:
        return False
    called, target = called_name(call), call.args[0]
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        return called in PATCHING_STRING_CALLS and is_runtime(target.value.split(":")[0])
    method = isinstance(call.func, ast.Attribute) and called in PATCHING_METHODS
    builtin = isinstance(call.func, ast.Name) and called in PATCHING_BUILTINS
    return (method or builtin) and root_name(target) in names


def assigned_targets(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment, augmented or annotated assignment, or `del` writes to,
    tuples unpacked."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return []
    flat = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        else:
            flat.append(target)
    return flat


def violations(source: str, filename: str) -> list[str]:
    """`filename:line: code` for every runtime global or runtime attribute the source patches
    or assigns."""
    tree = ast.parse(source, filename)
    names = runtime_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and patched_call(node, names):
            found.append(node)
        for target in assigned_targets(node):
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                base = target.value if isinstance(target, ast.Subscript) else target
                if root_name(base) in names:
                    found.append(node)
    lines = sorted({(node.lineno, ast.unparse(node).splitlines()[0]) for node in found})
    return [f"{filename}:{line}: {code}" for line, code in lines]


def test_no_test_patches_a_runtime_global():
    found = []
    for path in sorted(TESTS.glob("*.py")):
        found += violations(path.read_text(encoding="utf-8"), f"tests/{path.name}")
    assert not found, "runtime globals patched (configure through parameters):\n" + "\n".join(found)


# a test module breaking every rule once, kept as text outside tests/*.py so that it is not code;
# its plain assignment of a runtime global is written with "·" for its dot, so that no scan of
# the repository's text reads the fixture itself as such an assignment
BREAKS_EVERY_RULE = (
    (TESTS / "fixtures" / "patches" / "breaks_every_rule.txt").read_text("utf-8").replace("·", ".")
)

KEEPS_EVERY_RULE = """
import torch
from runtime import images
from runtime.heads import DeviceMLPs

def test_y(monkeypatch, heads):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OMNIJEV_PLUGIN_LIBRARY", "runtime.x")
    monkeypatch.setattr(heads.device_mlps, "run", None)
    class Skewed(DeviceMLPs):
        pass
    Skewed.run = None
    heads.device_mlps = None
    got = images.decode_rgb(b"", "image/png", fast=False)
    command = ["python", "-m", "runtime.cli"]
"""


def test_the_scan_finds_each_kind_of_patch():
    source = textwrap.dedent(BREAKS_EVERY_RULE)
    found = violations(source, "snippet.py")
    body = source.splitlines()
    expected = [
        number
        for number, line in enumerate(body, 1)
        if line.startswith("    ") and not line.strip().startswith(("pass", "def "))
    ]
    assert [int(entry.split(":")[1]) for entry in found] == expected, found
    assert found[0] == "snippet.py:10: monkeypatch.setattr(strict_json, 'SCAN_CHUNK', 7)"


def test_the_scan_lets_other_patches_be():
    assert violations(textwrap.dedent(KEEPS_EVERY_RULE), "snippet.py") == []
