"""A run finishes or rolls back whatever happens to its terminal or its output
(issue 44 §1, issue 49 "Interrupting"): a closed pipe on stdout, a hung-up terminal
(SIGHUP), a second Ctrl-C; on real shims through the installed command, each case
ending with the processes running and their bytes checked.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import subprocess
import termios
from collections.abc import Callable
from pathlib import Path

import pytest
from cuinterpose.engine import wire

from tests import simenv
from tests.shim import shimenv
from tests.shim import test_first_day as first_day
from tests.shim.agentgroup import Group, build_group
from tests.shim.test_first_day import BIN, cli, pids, states
from tests.simenv import Spawn
from tests.waiting import wait_until

# A user's scratch directory, plain environment and group, as on the first day.
scratch = first_day.scratch
plain = first_day.plain
group = first_day.group


def _piped(
    scratch: Path, env: dict[str, str], command: str, *, both: bool = False
) -> tuple[int, str]:
    """``command | head -1`` (``both``: ``command 2>&1 | head -1``) as a person types it:
    the coordinator's exit status (from PIPESTATUS) and its stderr (none with ``both``)."""
    (scratch / "err").write_text("")
    into = "2>&1" if both else "2>err"
    shell = f"{command} {into} | head -1 >/dev/null; echo ${{PIPESTATUS[0]}} >rc"
    run = cli(scratch, env, shell=shell)
    assert run.returncode == 0, run.stderr
    return int((scratch / "rc").read_text()), (scratch / "err").read_text()


def test_a_closed_pipe_stops_neither_suspend_nor_resume(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    where = f"--checkpoint-dir ck --control-dir {control_dir}"
    named = " ".join(pids(group))
    code, err = _piped(scratch, plain, f"cuinterpose suspend {where} {named} --progress human")
    assert code == 0, err
    assert states(scratch, plain, control_dir, *group.pids) == {("CHECKPOINTED", "PREPARED")}
    assert json.loads((scratch / "ck" / "manifest.json").read_text())["participants"]
    code, err = _piped(scratch, plain, f"cuinterpose resume {where} -v --progress human", both=True)
    assert code == 0, err
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


# -- a terminal that goes away, or a person who presses Ctrl-C twice --------------------------


@pytest.fixture
def slow_group(spawn: Spawn, control_dir: Path, sim_namespace: str, plain: dict[str, str]) -> Group:
    """The pair, each copy chunk a piece of stream work of 0.15 s on the simulated driver:
    a SAVE of the group's 8 MiB in 1 MiB chunks on one copy thread takes seconds."""
    if not (simenv.BUILD_DIRS["release"] / "shim_c" / "libcuinterpose.so").is_file():
        pytest.skip("build/ has no shim: run `make build`")
    shim = shimenv.shim_env("release", control_dir=control_dir, namespace=sim_namespace)
    shim.update(CUINTERPOSE_SIM_WORK_US="150000", SNAPSHOT_SHIM_COPY_CHUNK_MIB="1",
                SNAPSHOT_SHIM_COPY_THREADS="1")  # fmt: skip
    observer = simenv.sim_env("release", namespace=sim_namespace)
    return build_group(spawn, shim, observer)


def _saving(control_dir: Path, pid: int) -> bool:
    """Whether the shim's STATUS names SAVE_ALLOCATIONS in flight."""
    reply, _ = shimenv.request(shimenv.socket_path(control_dir, pid), wire.Request(wire.Op.STATUS))
    return wire.InFlight.from_stats(reply.stats).op is wire.Op.SAVE_ALLOCATIONS


class Terminal:
    """A command on a terminal of its own (a pty it has as its controlling terminal, as a
    login shell's foreground job has): what it wrote, Ctrl-C typed, the terminal closed."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        master, slave = os.openpty()

        def controlling() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=slave, stdout=slave,
                                     stderr=slave, preexec_fn=controlling)  # fmt: skip
        os.close(slave)
        self.master: int | None = master
        self.text = ""

    def read(self) -> bool:
        """Take what the command wrote so far; False once the terminal is closed."""
        assert self.master is not None
        while select.select([self.master], [], [], 0.01)[0]:
            try:
                got = os.read(self.master, 65536)
            except OSError:  # EIO: the command's side is closed
                return False
            if not got:
                return False
            self.text += got.decode(errors="replace")
        return True

    def until(self, ready: Callable[[], object], what: str) -> None:
        wait_until(lambda: (self.read() or True) and ready(), what)

    def type(self, data: bytes) -> None:
        assert self.master is not None
        os.write(self.master, data)

    def hang_up(self) -> None:
        """Close the terminal, as a closed window or a dropped SSH session does."""
        assert self.master is not None
        os.close(self.master)
        self.master = None

    def end(self) -> int:
        if self.master is not None:
            while self.read() and self.proc.poll() is None:
                pass
            self.read()
            os.close(self.master)
            self.master = None
        return self.proc.wait(timeout=120)


def _suspend_on_a_terminal(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> Terminal:
    argv = [str(BIN / "cuinterpose"), "suspend", "--checkpoint-dir", "ck", "--control-dir",
            str(control_dir), *pids(group)]  # fmt: skip
    return Terminal(argv, scratch, plain)


def test_a_closed_terminal_stops_a_suspend_and_undoes_it(
    slow_group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    """SIGHUP (the terminal closed) mid-SAVE: handled as SIGTERM, the capture stops at
    the next phase boundary and rolls back; exit 1, the group runs with its bytes."""
    group = slow_group
    term = _suspend_on_a_terminal(group, control_dir, scratch, plain)
    term.until(lambda: _saving(control_dir, group.creator.pid), "the SAVE is in flight")
    term.hang_up()
    assert term.end() == 1  # stopped and undone: the group runs as before
    assert not (scratch / "ck" / "manifest.json").exists()
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


def test_ctrl_c_twice_says_what_it_waits_for_and_never_leaves_the_group_half_done(
    slow_group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    group = slow_group
    term = _suspend_on_a_terminal(group, control_dir, scratch, plain)
    term.until(lambda: _saving(control_dir, group.creator.pid), "the SAVE is in flight")
    term.type(b"\x03")  # Ctrl-C, as typed: the terminal sends SIGINT
    first = re.compile(
        r"cuinterpose: stopping: waiting for SAVE_ALLOCATIONS[^\n]* to end; "
        r"then what was changed is undone, and the group runs as before"
    )
    term.until(lambda: first.search(term.text), "the first Ctrl-C is acknowledged")
    assert _saving(control_dir, group.creator.pid)  # said at once: the SAVE still runs
    term.type(b"\x03")
    again = re.compile(r"cuinterpose: still (stopping|undoing): waiting for [^\n]* to end; then "
                       r"[^\n]*A run never leaves the group half done")  # fmt: skip
    term.until(lambda: again.search(term.text), "the second Ctrl-C is acknowledged")
    assert term.end() == 1, term.text
    assert "capture: stopped on request before PREPARE_UNICAST" in term.text, term.text
    assert "FAILED" not in term.text, term.text
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


def _loading(control_dir: Path, pid: int) -> bool:
    reply, _ = shimenv.request(shimenv.socket_path(control_dir, pid), wire.Request(wire.Op.STATUS))
    return wire.InFlight.from_stats(reply.stats).op is wire.Op.LOAD_ALLOCATIONS


def test_ctrl_c_during_a_resumes_load_brings_the_group_back_running(
    slow_group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    """Once the native restore ran, a resume cannot go back to checkpointed: stopped
    during its LOAD, it rolls back to the bytes of the suspend; exit 3, reported as
    stopped, the group running."""
    group = slow_group
    where = ["--checkpoint-dir", "ck", "--control-dir", str(control_dir)]
    run = cli(scratch, plain, "suspend", *where, *pids(group))
    assert run.returncode == 0, run.stderr
    term = Terminal([str(BIN / "cuinterpose"), "resume", *where], scratch, plain)
    term.until(lambda: _loading(control_dir, group.creator.pid), "the LOAD is in flight")
    term.type(b"\x03")
    said = re.compile(r"cuinterpose: stopping: waiting for LOAD_ALLOCATIONS[^\n]* to end; then "
                      r"before its native restore nothing is changed; after it the group is "
                      r"brought back running")  # fmt: skip
    term.until(lambda: said.search(term.text), "the Ctrl-C is acknowledged")
    assert term.end() == 3, term.text
    assert "restore: stopped on request before" in term.text, term.text
    assert "cuinterpose: resume stopped on request:" in term.text, term.text
    assert "FAILED" not in term.text, term.text
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()
