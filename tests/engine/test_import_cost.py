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
from collections.abc import Callable
from pathlib import Path

import pytest
from cuinterpose.testing import FakeParticipant

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


def engine_modules(modules: set[str]) -> set[str]:
    return {m.removeprefix("cuinterpose.engine.") for m in modules
            if m.startswith("cuinterpose.engine.")}  # fmt: skip


def test_the_cli_module_loads_no_verb() -> None:
    modules = loaded("import cuinterpose.cli")
    assert offending(modules, HEAVY) == []
    assert offending(modules, VERB_ROOMS) == []
    # Of the engine, only what finds a process (the wire and the client come with a name
    # made or a shim asked).
    assert engine_modules(modules) == {"discovery"}


def test_the_engine_package_loads_its_names_on_first_use() -> None:
    modules = loaded("import cuinterpose.engine")
    assert sorted(m for m in modules if m.startswith("cuinterpose.engine.")) == []
    after = loaded("import cuinterpose.engine as e; e.Topology")
    assert "cuinterpose.engine.topology" in after
    assert offending(after, ("cuinterpose.engine.agent", "cattrs", "transitions")) == []


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"]])
def test_status_of_an_empty_control_directory_loads_only_its_listing(
    tmp_path: Path, argv: list[str]
) -> None:
    """An empty control directory: its listing and the line that says so, nothing that
    names or asks a shim (the wire, the client), reads a manifest or detects."""
    control = tmp_path / "control"
    control.mkdir(mode=0o700)
    code = (
        "import io, cuinterpose.cli as c\n"
        "out = io.StringIO()\n"
        f"assert c.main({argv!r}, stdout=out) == 0, out.getvalue()\n"
        "assert 'no shim in' in out.getvalue() or '\"processes\": []' in out.getvalue()"
    )
    modules = loaded(code, {"SNAPSHOT_CONTROL_DIR": str(control)})
    assert engine_modules(modules) == {"discovery"}
    assert offending(modules, HEAVY) == []
    assert "cuinterpose.phases" not in modules


def test_help_without_a_verb_loads_no_verb_options() -> None:
    code = (
        "import contextlib, io, cuinterpose.cli as c\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert c.main(['--help'], stdout=io.StringIO()) == 0\n"
    )
    modules = loaded(code)
    assert engine_modules(modules) == {"discovery"}
    assert offending(modules, HEAVY) == []


def _free_pid() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text())
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_a_suspend_refused_before_its_group_is_asked_loads_no_driver(
    tmp_path: Path, control_dir: Path
) -> None:
    """A pid that names no process: refused by the suspend's one look at the sockets
    (the engine's detection), before the native calls (cuda.bindings, ctypes, cuInit)
    and any machine."""
    code = (
        "import io, cuinterpose.cli as c\n"
        "err = io.StringIO()\n"
        f"argv = ['suspend', '--checkpoint-dir', {str(tmp_path / 'ck')!r}, '--pid', "
        f"'{_free_pid()}', '--progress', 'json']\n"
        "assert c.main(argv, stdout=io.StringIO(), stderr=err) == 1, err.getvalue()\n"
        "assert 'does not exist' in err.getvalue(), err.getvalue()"
    )
    modules = loaded(code, {"SNAPSHOT_CONTROL_DIR": str(control_dir)})
    assert offending(modules, ("rich", "transitions", "cuda", "ctypes")) == []
    assert engine_modules(modules) & {"runner", "fsm", "agent", "resumption"} == set()


# A native checkpoint of the process itself (it has no shim), with a fake driver.
_NATIVE_ALONE = """
import io, os, sys
import cuinterpose.cli as c
from cuinterpose.engine.native_checkpoint import ProcessState

class Native:
    def __init__(self):
        self.now = ProcessState.RUNNING
    def state(self, pid):
        return self.now
    def lock(self, pid, timeout_ms):
        self.now = ProcessState.LOCKED
    def checkpoint(self, pid):
        self.now = ProcessState.CHECKPOINTED
    def restore(self, pid):
        self.now = ProcessState.LOCKED
    def unlock(self, pid):
        self.now = ProcessState.RUNNING

out, err = io.StringIO(), io.StringIO()
argv = ["suspend", "--checkpoint-dir", sys.argv[1], "--pid", str(os.getpid()),
        "--not-requested", "--progress", "json"]
native = Native()
assert c.main(argv, stdout=out, stderr=err, native=native) == 0, err.getvalue()
assert '"outcome": "suspended"' in out.getvalue(), out.getvalue()
argv = ["resume", "--checkpoint-dir", sys.argv[1], "--progress", "json"]
assert c.main(argv, stdout=out, stderr=err, native=native) == 0, err.getvalue()
assert '"outcome": "resumed"' in out.getvalue(), out.getvalue()
"""


def test_a_native_checkpoint_alone_runs_no_machine(tmp_path: Path, control_dir: Path) -> None:
    """``suspend --not-requested`` (the native checkpoint alone), then its ``resume``: the
    manifest is written and read (cattrs), but no machine is run, so neither the runner
    nor transitions load; the native calls are the caller's, so neither ctypes nor
    cuda.bindings either."""
    script = tmp_path / "native_alone.py"
    script.write_text(_NATIVE_ALONE)
    code = f"import sys; sys.argv = ['x', {str(tmp_path / 'ck')!r}]\n"
    code += f"exec(open({str(script)!r}).read())"
    modules = loaded(code, {"SNAPSHOT_CONTROL_DIR": str(control_dir)})
    assert {"cuinterpose.engine.suspension", "cuinterpose.engine.resumption"} <= modules
    assert offending(modules, ("rich", "transitions", "cuda", "ctypes")) == []
    assert engine_modules(modules) & {"runner", "fsm", "recovery"} == set()


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


def test_status_of_a_shim_to_a_pipe_loads_no_rich_and_no_machine(
    control_dir: Path, start_fake: Callable[..., FakeParticipant]
) -> None:
    """A person's table to a pipe is plain text (rich only at a terminal); a status runs
    no machine (the agent's face, the runner and transitions stay unloaded)."""
    start_fake(pid=os.getpid())  # a live pid: its socket is not stale
    code = (
        "import io, cuinterpose.cli as c\n"
        "from cuinterpose.engine.native_checkpoint import ProcessState\n"
        "class Native:\n"
        "    def state(self, pid):\n"
        "        return ProcessState.RUNNING\n"
        "out, err = io.StringIO(), io.StringIO()\n"
        "assert c.main(['status'], stdout=out, stderr=err, native=Native()) == 0, err.getvalue()\n"
        "lines = out.getvalue().splitlines()\n"
        "assert lines[0] == 'cuinterpose status', lines\n"
        "assert lines[1].split() == ['pid', 'ns', 'pid', 'native', 'state', 'shim', 'phase',\n"
        "                            'participant', 'in', 'flight', 'kept', 'host',\n"
        "                            'copy'], lines\n"
        f"row = ['{os.getpid()}', '{os.getpid()}', 'RUNNING', 'ACTIVE']\n"
        "assert lines[2].split()[:4] == row, lines"
    )
    modules = loaded(code, {"SNAPSHOT_CONTROL_DIR": str(control_dir)})
    assert "cuinterpose.engine.group_status" in modules
    assert offending(modules, HEAVY) == []
    assert engine_modules(modules) & {"agent", "runner", "suspension", "resumption"} == set()
