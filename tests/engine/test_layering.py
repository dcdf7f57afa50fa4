"""The package's rooms depend on each other one way: no import circles, no upward imports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("py_imports", ROOT / "tools" / "py_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


py_imports = _tool()


def test_the_package_has_no_import_cycle() -> None:
    assert py_imports.cycles(py_imports.graph()) == []


def test_the_checker_sees_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert py_imports.cycles(edges) == [["a", "b", "c"]]


def test_the_library_never_imports_its_front_ends() -> None:
    edges = py_imports.graph()
    for module, targets in edges.items():
        if module.startswith("cuinterpose.phases"):
            assert all(t.startswith("cuinterpose.phases") for t in targets), module
        elif module.startswith("cuinterpose.engine"):
            assert all(
                t.startswith(("cuinterpose.engine", "cuinterpose.phases")) for t in targets
            ), module


def test_every_module_is_seen() -> None:
    names = set(py_imports.modules())
    assert {"cuinterpose.cli", "cuinterpose.engine.runner", "cuinterpose.phases.ops"} <= names
    assert "cuinterpose.engine.guards" in py_imports.graph()["cuinterpose.engine.runner"]
