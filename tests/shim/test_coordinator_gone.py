"""When something is stuck, the command a person runs says what and how to go on
(issue 44 §1): a participant stopped (SIGSTOP) is named by ``status`` and ``suspend``
within their own deadlines; a coordinator killed (SIGKILL) mid-capture or mid-resume
leaves a group whose every verb names the one command that brings it back. On real
shims through the installed command; each case ends with the processes running and
their bytes checked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from cuinterpose.engine import wire

from tests.shim import shimenv
from tests.shim import test_first_day as first_day
from tests.shim import test_terminal as terminal
from tests.shim.agentgroup import Group
from tests.shim.test_first_day import BIN, cli, pids, states
from tests.waiting import wait_until

scratch = first_day.scratch
plain = first_day.plain
group = first_day.group
slow_group = terminal.slow_group


def test_a_stopped_participant_is_named_by_status_and_by_suspend(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    stopped = group.importer.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        run = cli(scratch, plain, "status", "--control-dir", str(control_dir), "--json")
        assert run.returncode == 0, run.stderr
        rows = {r["observed_pid"]: r for r in json.loads(run.stdout)["processes"]}
        assert rows[stopped]["native_state"] == "unknown (stopped: state T)", rows
        assert rows[stopped]["shim_phase"] == "not answering", rows
        assert (
            f"stopped (state T, by a signal (SIGSTOP, Ctrl-Z)): `kill -CONT {stopped}`"
            in (rows[stopped]["problem"])
        ), rows
        creator = rows[group.creator.pid]
        assert (creator["native_state"], creator["shim_phase"]) == ("RUNNING", "ACTIVE"), rows
        run = cli(scratch, plain, "status", "--control-dir", str(control_dir))  # the table
        assert run.returncode == 0 and "kill -CONT" in run.stdout, run.stdout + run.stderr
        run = cli(scratch, plain, "suspend", "--checkpoint-dir", "ck", "--control-dir",
                  str(control_dir), *pids(group), "--step-timeout", "5")  # fmt: skip
        assert run.returncode == 1, run.stderr
        assert "a process of the group is stopped" in run.stderr, run.stderr
        assert f"pid {stopped} (ns pid {stopped})" in run.stderr, run.stderr
        assert "the process is stopped (state T" in run.stderr, run.stderr
        assert not (scratch / "ck" / "manifest.json").exists()
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


# -- the coordinator killed (SIGKILL) mid-run ----------------------------------------------


def _phase(control_dir: Path, pid: int) -> tuple[wire.Phase, wire.Op | None]:
    """The shim's phase and the op in flight, from STATUS."""
    reply, _ = shimenv.request(shimenv.socket_path(control_dir, pid), wire.Request(wire.Op.STATUS))
    return reply.phase, wire.InFlight.from_stats(reply.stats).op


def _killed_during(
    argv: list[str], scratch: Path, env: dict[str, str], control_dir: Path, pid: int, op: wire.Op
) -> wire.Phase:
    """Run ``argv``, SIGKILL it while the shim of ``pid`` runs ``op``; the phase that op
    leaves the shim in, once it is done."""
    run = subprocess.Popen(argv, cwd=scratch, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
    wait_until(lambda: _phase(control_dir, pid)[1] is op, f"{op.name} is in flight")
    run.kill()
    run.wait()
    wait_until(lambda: _phase(control_dir, pid)[1] is None, f"{op.name} is done")
    return _phase(control_dir, pid)[0]


def _recover_line(text: str) -> str:
    """The one command a refusal names to bring the group back."""
    found = re.search(r"`(cuinterpose recover --checkpoint-dir [^`]*)`", text)
    assert found, text
    return found[1]


def test_a_coordinator_killed_mid_capture_leaves_every_verb_naming_recover(
    slow_group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    group = slow_group
    where = ["--checkpoint-dir", "ck", "--control-dir", str(control_dir)]
    argv = [str(BIN / "cuinterpose"), "suspend", *where, *pids(group)]
    phase = _killed_during(argv, scratch, plain, control_dir, group.creator.pid,
                           wire.Op.SAVE_ALLOCATIONS)  # fmt: skip
    assert phase is wire.Phase.ALLOCATIONS_SAVED
    said = []
    for verb in (["resume", *where], ["prepare", *where, *pids(group)], ["restore", *where]):
        run = cli(scratch, plain, *verb)
        assert run.returncode == 1, (verb, run.stderr)
        said.append(_recover_line(run.stderr))
    run = cli(scratch, plain, "status", "--control-dir", str(control_dir), "--checkpoint-dir", "ck")
    assert run.returncode == 0, run.stderr
    said.append(_recover_line(run.stdout + run.stderr))
    assert len(set(said)) == 1, said  # one command, whichever verb saw the group
    run = cli(scratch, plain, shell=said[0])
    assert run.returncode == 0, run.stderr
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()
