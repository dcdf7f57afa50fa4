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


# The agent's verbs, each in its room (engine/agent.py is their public face).
AGENT_ROOMS = frozenset(
    f"cuinterpose.engine.{name}"
    for name in (
        "agent", "detection", "events", "group_status", "resumption", "suspension", "watch",
    )
)  # fmt: skip
# What runs one machine: it knows nothing of the verbs built on it.
MACHINE_ROOMS = frozenset(
    f"cuinterpose.engine.{name}"
    for name in (
        "client", "directory", "errors", "fsm", "guards", "options", "progress", "quiesce",
        "replay", "runner", "statefile", "steps", "topology", "trace", "validate", "wire",
    )
)  # fmt: skip


def test_the_agent_rooms_exist() -> None:
    assert set(py_imports.graph()) >= AGENT_ROOMS | MACHINE_ROOMS


def test_the_machines_never_import_the_agent_verbs() -> None:
    edges = py_imports.graph()
    for module in MACHINE_ROOMS:
        assert not edges[module] & AGENT_ROOMS, (module, edges[module] & AGENT_ROOMS)


def test_only_the_face_and_its_users_import_the_agent() -> None:
    # The rooms are below their face: a room importing engine.agent would be a circle
    # waiting to happen, and the face re-exports, it decides nothing.
    edges = py_imports.graph()
    importers = {m for m, targets in edges.items() if "cuinterpose.engine.agent" in targets}
    assert not importers & AGENT_ROOMS
    assert "cuinterpose.engine.agent" in edges["cuinterpose.engine"]


def test_suspend_and_resume_are_apart() -> None:
    edges = py_imports.graph()
    assert "cuinterpose.engine.suspension" not in edges["cuinterpose.engine.resumption"]
    assert "cuinterpose.engine.resumption" not in edges["cuinterpose.engine.suspension"]
