"""A command loads only what its verb needs (issue 30: a command costs nothing of its own).

Each check runs a fresh interpreter and asserts by module name, never by time: the
interpreter's own start is what a verb that needs little should cost, and rich (the
person's output), cattrs (the state file and the manifest), transitions (the machines
as ``transitions`` objects) and the verbs' engine rooms are each loaded by the verbs
that use them, inside their functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# What no command pays for before it knows its verb.
HEAVY = ("rich", "cattrs", "transitions", "cuda", "ctypes")
# The engine's rooms of a suspend, a resume, a machine run and a replay (engine.native_checkpoint
# is not among them: its lock timeout is the parser's default; ctypes and the driver it
# loads only at the first native call).
VERB_ROOMS = tuple(
    f"cuinterpose.engine.{room}"
    for room in (
        "agent", "suspension", "resumption", "group_status", "recovery", "runner", "steps",
        "guards", "quiesce", "fsm", "replay", "statefile", "topology", "directory", "events",
        "watch", "released", "criu",
    )
)  # fmt: skip


def loaded(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter holds after ``code`` (which must not print)."""
    script = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def offending(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m in names or m.startswith(tuple(f"{n}." for n in names)))


def test_the_cli_module_loads_no_verb() -> None:
    modules = loaded("import cuinterpose.cli")
    assert offending(modules, HEAVY) == []
    assert offending(modules, VERB_ROOMS) == []


def test_the_engine_package_loads_its_names_on_first_use() -> None:
    modules = loaded("import cuinterpose.engine")
    assert sorted(m for m in modules if m.startswith("cuinterpose.engine.")) == []
    after = loaded("import cuinterpose.engine as e; e.Topology")
    assert "cuinterpose.engine.topology" in after
    assert offending(after, ("cuinterpose.engine.agent", "cattrs", "transitions")) == []


def test_status_without_shims_loads_only_detection(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir(mode=0o700)
    code = (
        "import io, cuinterpose.cli as c\n"
        "out = io.StringIO()\n"
        "assert c.main(['status'], stdout=out) == 0, out.getvalue()\n"
        "assert out.getvalue().startswith('no shim in'), out.getvalue()"
    )
    modules = loaded(code, {"SNAPSHOT_CONTROL_DIR": str(control)})
    assert "cuinterpose.engine.detection" in modules
    assert offending(modules, HEAVY) == []
    assert offending(modules, VERB_ROOMS) == []


@pytest.mark.parametrize("verb", ["suspend", "resume", "status", "prepare", "criu", "launch"])
def test_help_of_a_verb_loads_no_verb_room(verb: str) -> None:
    code = (
        "import contextlib, io, cuinterpose.cli as c\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert c.main([{verb!r}, '--help'], stdout=io.StringIO()) == 0\n"
    )
    modules = loaded(code)
    assert offending(modules, ("rich", "cattrs", "transitions")) == []
    assert offending(modules, VERB_ROOMS) == []
