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
import sys
from pathlib import Path

from cuinterpose.demo import coordinator_env
from cuinterpose.engine import wire

from tests import simenv
from tests.shim import shimenv
from tests.shim import test_first_day as first_day
from tests.shim import test_terminal as terminal
from tests.shim.agentgroup import Group, build_group
from tests.shim.test_first_day import BIN, cli, pids, states
from tests.simenv import Spawn
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


def test_a_coordinator_killed_mid_resume_leaves_resume_and_status_naming_recover(
    slow_group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    group = slow_group
    where = ["--checkpoint-dir", "ck", "--control-dir", str(control_dir)]
    run = cli(scratch, plain, "suspend", *where, *pids(group))
    assert run.returncode == 0, run.stderr
    argv = [str(BIN / "cuinterpose"), "resume", *where]
    phase = _killed_during(argv, scratch, plain, control_dir, group.creator.pid,
                           wire.Op.LOAD_ALLOCATIONS)  # fmt: skip
    assert phase is wire.Phase.ALLOCATIONS_LOADED
    run = cli(scratch, plain, "resume", *where)
    assert run.returncode == 1, run.stderr
    assert "stopped midway" in run.stderr and "nothing was changed" in run.stderr, run.stderr
    hint = _recover_line(run.stderr)
    run = cli(scratch, plain, "status", "--control-dir", str(control_dir), "--checkpoint-dir",
              "ck", "--json")  # fmt: skip
    assert json.loads(run.stdout)["next"] == hint, run.stdout + run.stderr
    run = cli(scratch, plain, "status", "--control-dir", str(control_dir))
    assert "a run stopped midway" in run.stderr, run.stderr
    assert "`cuinterpose recover --checkpoint-dir DIR --control-dir" in run.stderr, run.stderr
    run = cli(scratch, plain, shell=hint)
    assert run.returncode == 0, run.stderr
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    # The suspend is over: the directory takes the next one.
    assert json.loads((scratch / "ck" / "manifest.json").read_text())["resumed_at"]
    group.close()


def test_a_resume_on_other_gpus_without_a_map_is_refused_before_the_native_restore(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    """Suspended on this (simulated) node, resumed by a coordinator of another without
    --gpu-map: refused before any native step, naming the GPUs recorded and those here
    and the mapping that fits; that mapping, given, resumes the group."""
    where = ["--checkpoint-dir", "ck", "--control-dir", str(control_dir)]
    run = cli(scratch, plain, "suspend", *where, *pids(group))
    assert run.returncode == 0, run.stderr
    recorded = json.loads((scratch / "ck" / "manifest.json").read_text())
    uuids = {g["uuid"] for p in recorded["participants"] for g in p["gpus"]}
    beta = {**plain, "CUINTERPOSE_SIM_NODE": "beta"}
    run = cli(scratch, beta, "resume", *where)
    assert run.returncode == 1, run.stderr
    assert "resume refused (nothing was changed): the group was suspended on other GPUs" in (
        run.stderr
    ), run.stderr
    assert all(f"{u}" in run.stderr for u in uuids), run.stderr
    assert "here: GPU 0 GPU-" in run.stderr, run.stderr
    assert states(scratch, plain, control_dir, *group.pids) == {("CHECKPOINTED", "PREPARED")}
    fitting = re.search(r"--gpu-map (\S+)", run.stderr)
    assert fitting, run.stderr
    run = cli(scratch, beta, "resume", *where, "--gpu-map", fitting[1])
    assert run.returncode == 0, run.stderr
    assert group.mismatches() == []
    group.close()


def test_a_stray_handshake_cannot_fail_a_resume_after_its_native_restore(
    spawn: Spawn, control_dir: Path, sim_namespace: str, scratch: Path, plain: dict[str, str]
) -> None:
    """A process of a trusted uid sends one HANDSHAKE to a suspended group and lives on:
    its lease holds for SNAPSHOT_LEASE_HANDSHAKE_S (1 s here). The resume takes the lease
    before its native restore, waiting that out, so its restore is never refused after
    the native restore ran: exit 0, every byte back."""
    shim = shimenv.shim_env("release", control_dir=control_dir, namespace=sim_namespace)
    shim["SNAPSHOT_LEASE_HANDSHAKE_S"] = "1"
    group = build_group(spawn, shim, simenv.sim_env("release", namespace=sim_namespace))
    where = ["--checkpoint-dir", "ck", "--control-dir", str(control_dir)]
    run = cli(scratch, plain, "suspend", *where, *pids(group))
    assert run.returncode == 0, run.stderr
    path = shimenv.socket_path(control_dir, group.creator.pid)
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.shim.workers.lease_holder", str(path), os.urandom(16).hex()],
        env=coordinator_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=simenv.REPO,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline().strip() == "OK"  # it holds the creator's lease
        run = cli(scratch, plain, "resume", *where)
        assert run.returncode == 0, run.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


def test_a_relative_control_dir_is_recorded_absolute(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    """``suspend --control-dir ../../c`` records where the shims are as an absolute path:
    a resume typed in another directory finds them."""
    relative = os.path.relpath(control_dir, scratch)
    assert not os.path.isabs(relative)
    run = cli(scratch, plain, "suspend", "--checkpoint-dir", "ck", "--control-dir", relative,
              *pids(group))  # fmt: skip
    assert run.returncode == 0, run.stderr
    origin = json.loads((scratch / "ck" / "manifest.json").read_text())["origin"]
    assert origin["control_dir"] == str(control_dir), origin
    elsewhere = scratch / "elsewhere"
    elsewhere.mkdir()
    run = cli(elsewhere, plain, "resume", "--checkpoint-dir", str(scratch / "ck"))
    assert run.returncode == 0, run.stderr
    assert group.mismatches() == []
    group.close()


def test_a_suspend_cut_short_after_its_capture_is_brought_back_by_the_command_resume_names(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    """Where a suspend whose coordinator died after its capture leaves a group: the state
    file and no manifest, the shims PREPARED, one process natively LOCKED (its lock
    done, the other's not). resume refuses, naming recover; that recover unlocks it and
    restores the group."""
    where = ["--checkpoint-dir", "ck", "--control-dir", str(control_dir)]
    run = cli(scratch, plain, "prepare", *where, *pids(group))
    assert run.returncode == 0, run.stderr
    run = cli(scratch, plain, "native", "--action", "lock", "--control-dir", str(control_dir),
              "--pid", str(group.creator.pid))  # fmt: skip
    assert run.returncode == 0, run.stderr
    run = cli(scratch, plain, "resume", *where)
    assert run.returncode == 1, run.stderr
    assert "holds a capture and no manifest" in run.stderr, run.stderr
    hint = _recover_line(run.stderr)
    assert states(scratch, plain, control_dir, *group.pids) == {
        ("LOCKED", "PREPARED"), ("RUNNING", "PREPARED")}  # fmt: skip
    run = cli(scratch, plain, "status", "--control-dir", str(control_dir), "--checkpoint-dir",
              "ck", "--json")  # fmt: skip
    assert json.loads(run.stdout)["next"] == hint, run.stdout + run.stderr
    run = cli(scratch, plain, shell=hint)
    assert run.returncode == 0, run.stderr
    assert f"pid {group.creator.pid}: native unlock done" in run.stderr, run.stderr
    assert states(scratch, plain, control_dir, *group.pids) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()
