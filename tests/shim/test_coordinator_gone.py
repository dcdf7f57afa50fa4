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
import signal
from pathlib import Path

from tests.shim import test_first_day as first_day
from tests.shim.agentgroup import Group
from tests.shim.test_first_day import cli, pids, states

scratch = first_day.scratch
plain = first_day.plain
group = first_day.group


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
