"""The package imports only downward (``torchq/floors.py`` declares the floors): every import of
every module, lazy ones included, read from the source (AST)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from torchq.floors import ALLOWED_CIRCLES, ALLOWED_PRIVATE, ALLOWED_UPWARD, FLOORS, floor_of

ROOT = pathlib.Path(__file__).resolve().parents[1] / "torchq"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """``(imported torchq module, imported name or None, line)`` for every import in ``module``."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [(f"{target}.{a.name}", None) if f"{target}.{a.name}" in MODULES else (target, a.name) for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            name = node.args[0].value  # importlib.import_module("torchq.x") or (".x", __name__)
            if name.startswith("."):
                anchor = node.args[1] if len(node.args) > 1 else None
                if not (isinstance(anchor, ast.Name) and anchor.id == "__name__"):
                    continue
                dots = len(name) - len(name.lstrip("."))
                base = module.split(".")
                name = ".".join(base[: len(base) - (dots - 1)] + [name.lstrip(".")])
            if name not in MODULES:  # a compiled module (torchq._native) or another package's
                continue
            targets = [(name, None)]
        else:
            continue
        for name, attr in targets:
            while name and name not in MODULES:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name.startswith("torchq") and name != module:
                found.append((name, attr, node.lineno))
    return found


EDGES = {m: _imports(m) for m in MODULES}


def _outside_imports(module: str) -> list[str]:
    """Imports of the checkout's own folders that are not the package (they are not installed)."""
    tree = ast.parse(MODULES[module].read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level and n.module]
    return [f"{module} imports {n}" for n in names if n.split(".")[0] in ("examples", "tests", "benchmarks", "tutorials")]


def _circles() -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in {t for t, _, _ in EDGES[v]}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_floor():
    assert [m for m in MODULES if floor_of(m) is None] == []


def test_no_import_circles():
    assert [sorted(c) for c in _circles() if c not in ALLOWED_CIRCLES] == []


def test_imports_go_to_the_same_floor_or_below():
    upward = [f"{m} ({FLOORS[floor_of(m)][0]}) imports {t} ({FLOORS[floor_of(t)][0]}) at line {line}"
              for m, edges in EDGES.items() for t, _, line in edges
              if floor_of(t) > floor_of(m) and (m, t) not in ALLOWED_UPWARD]
    assert upward == []


def test_no_module_imports_another_modules_private_names():
    private = [f"{m} imports {t}.{name} (line {line})" for m, edges in EDGES.items() for t, name, line in edges
               if name and name.startswith("_") and not name.startswith("__") and (m, t, name) not in ALLOWED_PRIVATE]
    assert private == []


def test_the_exceptions_are_still_needed():
    """An exception nobody uses any more is removed from the list (the list stays the truth)."""
    edges = {(m, t) for m, es in EDGES.items() for t, _, _ in es}
    assert ALLOWED_UPWARD <= edges
    assert set(ALLOWED_CIRCLES) <= set(_circles())
    assert ALLOWED_PRIVATE <= {(m, t, name) for m, es in EDGES.items() for t, name, _ in es if name}


def test_the_package_holds_the_library_only():
    """Example models, multi-process helpers and benchmarks live outside ``torchq/`` (the checkout's
    ``examples/`` and ``benchmarks/``), and the library never imports them."""
    assert not (ROOT / "examples").exists()
    assert [line for m in MODULES for line in _outside_imports(m)] == []


@pytest.mark.parametrize("source,expect", [
    ("from . import dispatch\n", "torchq.dispatch"),
    ("from .checkpoint.codec import CheckpointError\n", "torchq.checkpoint.codec"),
    ("def f():\n    from .tensor import AQT\n", "torchq.tensor"),
    ("import importlib\nimportlib.import_module('torchq.dispatch')\n", "torchq.dispatch"),
])
def test_the_reader_sees_every_kind_of_import(tmp_path, monkeypatch, source, expect):
    """The analysis itself: relative, from-package and lazy (function-level) imports are found."""
    path = ROOT / "floors.py"
    monkeypatch.setitem(MODULES, "torchq.floors", tmp_path / "floors.py")
    (tmp_path / "floors.py").write_text(source)
    assert expect in {t for t, _, _ in _imports("torchq.floors")}
    assert path.exists()


def test_the_reader_resolves_import_module_relative_to_the_calling_module(tmp_path, monkeypatch):
    monkeypatch.setitem(MODULES, "torchq.hf", tmp_path / "__init__.py")
    (tmp_path / "__init__.py").write_text("import importlib\nimportlib.import_module('.registry', __name__)\n")
    assert {t for t, _, _ in _imports("torchq.hf")} == {"torchq.hf.registry"}
