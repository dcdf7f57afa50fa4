"""The agent API against fake participants and an in-memory native driver.

Every row of the detection truth table (specs/detection.md), the manifest rules, stale
socket removal, the native group steps and their undo, and suspend/resume with a
failure at each step; the CLI verbs' exit statuses and messages.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import topologies
from cuinterpose import cli
from cuinterpose.engine import Options, StepFailed, agent, native_checkpoint, quiesce, runner
from cuinterpose.engine.client import Endpoint
from cuinterpose.engine.detection import group_of
from cuinterpose.engine.native_checkpoint import NativeError, NativeGroupError, ProcessState
from cuinterpose.engine.progress import QuiesceRound
from cuinterpose.engine.statefile import STATE_FILE_NAME
from cuinterpose.engine.wire import Op, Phase, Status, socket_name
from cuinterpose.testing import Fault
from engine_harness import Team, short_dir, team_of

TOPOLOGY = topologies.team(2, 2, multicast=False)
PIDS = [m.pid for m in TOPOLOGY.participants]

# CUprocessState transitions the driver allows: (step, from) -> to.
_MOVES = {
    ("lock", ProcessState.RUNNING): ProcessState.LOCKED,
    ("checkpoint", ProcessState.LOCKED): ProcessState.CHECKPOINTED,
    ("restore", ProcessState.CHECKPOINTED): ProcessState.LOCKED,
    ("unlock", ProcessState.LOCKED): ProcessState.RUNNING,
}


@attrs.define
class FakeNative:
    """The native checkpoint of processes that exist only here; ``fail`` = (step, pid)."""

    states: dict[int, ProcessState]
    fail: tuple[str, int] | None = None
    calls: list[tuple[str, int]] = attrs.field(factory=list)

    def _move(self, step: str, pid: int) -> None:
        self.calls.append((step, pid))
        if pid not in self.states:
            raise NativeError(pid, f"cuCheckpointProcess{step.title()}", "CUDA_ERROR_NOT_FOUND")
        if self.fail == (step, pid):
            raise NativeError(pid, f"cuCheckpointProcess{step.title()}", "CUDA_ERROR_INJECTED")
        to = _MOVES.get((step, self.states[pid]))
        if to is None:
            raise NativeError(pid, f"cuCheckpointProcess{step.title()}", "CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = to

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._move("lock", pid)

    def checkpoint(self, pid: int) -> None:
        self._move("checkpoint", pid)

    def restore(self, pid: int) -> None:
        self._move("restore", pid)

    def unlock(self, pid: int) -> None:
        self._move("unlock", pid)

    def state(self, pid: int) -> ProcessState:
        if pid not in self.states:
            raise NativeError(pid, "cuCheckpointProcessGetState", "CUDA_ERROR_NOT_FOUND")
        return self.states[pid]


def running(pids: list[int] = PIDS) -> FakeNative:
    return FakeNative({p: ProcessState.RUNNING for p in pids})


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.fixture
def live() -> Iterator[list[int]]:
    """The pids of two processes that run and have no shim (a native-only group's)."""
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        yield [c.pid for c in children]
    finally:
        for child in children:
            child.kill()
            child.wait()


def bind_socket(path: Path, *, listening: bool) -> socket.socket | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    if listening:
        s.listen()
        return s
    s.close()  # the file stays: a stale socket
    return None


# ------------------------------------------------------------------ detection
@pytest.mark.parametrize(
    "requested, present, mode, named",
    [
        (True, [True, True], "cuinterpose", []),
        (True, [True, False], None, [2]),
        (True, [False, False], None, [1, 2]),
        (False, [False, False], "native", []),
        (False, [True, False], None, [1]),
        (False, [True, True], None, [1, 2]),
    ],
)
def test_detection_truth_table(
    work: Path,
    live: list[int],
    requested: bool,
    present: list[bool],
    mode: str | None,
    named: list[int],
) -> None:
    control = work / "control"
    control.mkdir()
    pids = tuple(live)  # processes that run: a missing socket is no shim
    for pid, here in zip(pids, present, strict=True):
        if here:
            bind_socket(control / socket_name(pid), listening=False)
    where = agent.Where(control)
    if mode is not None:
        found = agent.detect(requested, [(p, p) for p in pids], where)
        assert found.mode == mode
        assert [e.path for e in found.endpoints] == [control / socket_name(p) for p in pids]
        return
    with pytest.raises(agent.DetectionRefused) as info:
        agent.detect(requested, [(p, p) for p in pids], where)
    text = str(info.value)
    for i, pid in enumerate(pids, 1):
        assert bool(re.search(rf"\bpid {pid}\b", text)) == (i in named), text
    assert ("has no shim" in text) == requested
    assert ("did not request" in text) == (not requested)


@pytest.mark.parametrize("requested", [True, False])
@pytest.mark.parametrize("there", ["a regular file", "a directory"])
def test_detection_refuses_a_path_that_is_not_a_socket(
    work: Path, requested: bool, there: str
) -> None:
    control = work / "control"
    control.mkdir()
    if there == "a directory":
        (control / socket_name(1)).mkdir()
    else:
        (control / socket_name(1)).write_text("not a socket")
    with pytest.raises(agent.DetectionRefused) as info:
        agent.detect(requested, [(1, 1)], agent.Where(control))
    path = control / socket_name(1)
    assert f"pid 1 has no control socket: at its path {path} there is {there}, not a socket" in str(
        info.value
    )
    assert "until it is removed" in str(info.value)
    assert "does not exist" not in str(info.value) and "has no shim" not in str(info.value)


def test_detection_says_a_zombie_exited(work: Path) -> None:
    control = work / "control"
    control.mkdir()
    child = subprocess.Popen(["sleep", "60"])
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        with pytest.raises(agent.DetectionRefused) as info:
            agent.detect(True, [(child.pid, child.pid)], agent.Where(control))
    finally:
        child.wait()
    assert f"pid {child.pid} exited (a zombie its parent has not reaped)" in str(info.value)


def test_detection_through_proc_root_uses_the_namespace_pid(work: Path) -> None:
    # A process seen here as 4242 is pid 7 in its namespace; its root holds the socket.
    bind_socket(work / "4242" / "root" / "ctl" / socket_name(7), listening=False)
    found = agent.detect(True, [(4242, 7)], agent.Where(Path("/ctl"), work))
    assert found.endpoints[0].path == work / "4242" / "root" / "ctl" / socket_name(7)
    with pytest.raises(agent.DetectionRefused, match=r"pid 4243 \(ns pid 7\)"):
        agent.detect(True, [(4243, 7)], agent.Where(Path("/ctl"), work))


def test_detection_needs_processes_each_once(work: Path) -> None:
    with pytest.raises(ValueError, match="no processes"):
        agent.detect(True, [], agent.Where(work))
    with pytest.raises(ValueError, match="given twice"):
        agent.detect(True, [(1, 1), (1, 1)], agent.Where(work))
    with pytest.raises(ValueError, match=r"pid 2 \(ns pid 2\) is given twice"):
        agent.Group([(1, 1), (2, 2), (2, 2)])


def test_a_group_is_checked_once_and_passed_down_as_it_is(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """suspend makes the group's one value; detect and require_states take it as it is."""
    group = agent.Group([(1, 1), (2, 2)])
    assert group_of(group) is group and list(group) == [agent.Process(1, 1), agent.Process(2, 2)]
    checked: list[object] = []
    made = agent.Group.__new__

    def counted(cls: type[agent.Group], processes: Any) -> agent.Group:
        checked.append(processes)
        return made(cls, processes)

    monkeypatch.setattr(agent.Group, "__new__", counted)
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        suspend(team, work / "ckpt", fake)
    assert len(checked) == 1, checked


# ------------------------------------------------------------------ stale sockets
def test_stale_sockets_are_removed_and_live_ones_refused(work: Path) -> None:
    control = work / "control"
    bind_socket(control / socket_name(1), listening=False)
    where = agent.Where(control)
    assert agent.remove_stale_sockets([(1, 1), (2, 2)], where) == (control / socket_name(1),)
    assert not (control / socket_name(1)).exists()
    assert agent.remove_stale_sockets([(1, 1)], where) == ()

    live = bind_socket(control / socket_name(3), listening=True)
    bind_socket(control / socket_name(4), listening=False)
    (control / socket_name(5)).write_text("x")
    try:
        with pytest.raises(agent.AgentError) as info:
            agent.remove_stale_sockets([(3, 3), (4, 4), (5, 5)], where)
        text = str(info.value)
        assert "pid 3 (ns pid 3)" in text and "live shim" in text
        assert "pid 5 (ns pid 5)" in text and "not a socket" in text
        # Refused as a whole: the stale one of the same call stays too.
        assert (control / socket_name(4)).exists() and (control / socket_name(3)).exists()
    finally:
        assert live is not None
        live.close()


# ------------------------------------------------------------------ the manifest
def test_manifest_round_trips_and_drives_the_restore(work: Path) -> None:
    manifest = agent.Manifest(
        True,
        True,
        (agent.Participant(10, 1, "a" * 32), agent.Participant(11, 2, "b" * 32)),
        (agent.Timing("capture", 0.5, 1 << 20),),
        "2026-11-30T00:00:00.000Z",
    )
    agent.write_manifest(work, manifest)
    assert agent.read_manifest(work) == manifest
    data = json.loads((work / agent.MANIFEST_FILE_NAME).read_text())
    assert data["cuinterpose"] == {"requested": True, "prepared": True}
    # Version 1 names a timed step "phase": the file keeps it, manifests already written
    # stay readable.
    assert data["timings"] == [{"phase": "capture", "seconds": 0.5, "bytes": 1 << 20}]
    assert agent.read_manifest(work).timings[0].step == "capture"
    # Prepared without a state file: an error, never a native-only restore.
    with pytest.raises(agent.ManifestError, match=r"no cuinterpose\.state"):
        agent.restore_plan(manifest, work)
    (work / STATE_FILE_NAME).write_text("{}")
    assert agent.restore_plan(manifest, work) is True
    native_only = attrs.evolve(manifest, requested=False, prepared=False)
    assert agent.restore_plan(native_only, work) is False


@pytest.mark.parametrize(
    "document, why",
    [
        ("[]", "not a version 1 manifest"),
        ('{"version": 2}', "not a version 1 manifest"),
        (
            '{"version": 1, "cuinterpose": {"requested": true}, "participants": []}',
            r"required field missing @ \$\.cuinterpose\.prepared",
        ),
        (
            '{"version": 1, "cuinterpose": {"requested": "yes", "prepared": false}, '
            '"participants": []}',
            r"expected bool @ \$\.cuinterpose\.requested",
        ),
        (
            '{"version": 1, "cuinterpose": {"requested": false, "prepared": true}, '
            '"participants": []}',
            "prepared, yet cuinterpose was not requested",
        ),
        (
            '{"version": 1, "cuinterpose": {"requested": true, "prepared": true}, '
            '"participants": []}',
            "no participants",
        ),
        (
            '{"version": 1, "cuinterpose": {"requested": true, "prepared": true}, '
            '"participants": [{"observed_pid": 1, "namespace_pid": "2", "participant": null}]}',
            r"expected int @ \$\.participants\[0\]\.namespace_pid",
        ),
        (
            '{"version": 1, "cuinterpose": {"requested": true, "prepared": true}, '
            '"participants": [{"observed_pid": 1, "namespace_pid": 2, "participant": null}], '
            '"timings": [{"step": "capture", "seconds": 1.0}]}',
            r"required field missing @ \$\.timings\[0\]\.phase",
        ),
        ("{not json", "not JSON"),
    ],
)
def test_a_bad_manifest_is_refused_by_name(work: Path, document: str, why: str) -> None:
    (work / agent.MANIFEST_FILE_NAME).write_text(document)
    with pytest.raises(agent.ManifestError, match=why) as info:
        agent.read_manifest(work)
    assert str(work / agent.MANIFEST_FILE_NAME) in str(info.value)


def test_a_missing_manifest_says_nothing_was_suspended(work: Path) -> None:
    with pytest.raises(agent.ManifestError, match="nothing was suspended"):
        agent.read_manifest(work)


# ------------------------------------------------------------------ native group steps
def test_native_steps_check_every_state_and_name_every_process() -> None:
    fake = running([1, 2, 3])
    timing = native_checkpoint.run_step(fake, "lock", [1, 2, 3])
    assert [pid for pid, _ in timing.calls] == [1, 2, 3]
    fake.fail = ("checkpoint", 2)
    with pytest.raises(NativeGroupError) as info:
        native_checkpoint.run_step(fake, "checkpoint", [1, 2, 3])
    err = info.value
    assert (err.step, err.pid, err.done) == ("checkpoint", 2, (1,))
    assert err.states == {1: "CHECKPOINTED", 2: "LOCKED", 3: "LOCKED"}
    assert "CUDA_ERROR_INJECTED" in str(err) and "pid 3 LOCKED" in str(err)
    lines = native_checkpoint.undo_suspend(fake, [1, 2, 3])
    assert lines == (
        "pid 1: native restore done",
        "pid 1: native unlock done",
        "pid 2: native unlock done",
        "pid 3: native unlock done",
    )
    assert set(fake.states.values()) == {ProcessState.RUNNING}


def test_a_step_that_leaves_a_process_in_another_state_fails() -> None:
    class Lying(FakeNative):
        def lock(self, pid: int, timeout_ms: int) -> None:
            self.calls.append(("lock", pid))  # claims success, locks nothing

    with pytest.raises(NativeGroupError, match="pid 1: is RUNNING after the lock, expected LOCKED"):
        native_checkpoint.run_step(Lying({1: ProcessState.RUNNING}), "lock", [1])
    with pytest.raises(ValueError, match="unknown native step"):
        native_checkpoint.run_step(running(), "freeze", PIDS)


# ------------------------------------------------------------------ suspend and resume
def suspend(team: Team, directory: Path, fake: FakeNative, **kwargs: Any) -> agent.SuspendResult:
    return agent.suspend(
        [(p, p) for p in PIDS],
        directory,
        where=agent.Where(team.control_dir),
        native=fake,
        **kwargs,
    )


def test_suspend_then_resume_with_fakes(work: Path) -> None:
    fake = running()
    events: list[agent.AgentEvent] = []
    with team_of(TOPOLOGY, work / "control") as team:
        done = suspend(team, work / "ckpt", fake, on_event=events.append)
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}
        assert set(fake.states.values()) == {ProcessState.CHECKPOINTED}
        assert fake.calls == [
            ("lock", 1000),
            ("lock", 1001),
            ("checkpoint", 1000),
            ("checkpoint", 1001),
        ]
        assert [p.participant for p in done.manifest.participants] == [
            m.participant for m in TOPOLOGY.participants
        ]
        rows = agent.status([(p, p) for p in PIDS], agent.Where(team.control_dir), fake)
        assert {(r.native_state, r.shim_phase) for r in rows} == {("CHECKPOINTED", "PREPARED")}
        back = agent.resume(work / "ckpt", where=agent.Where(team.control_dir), native=fake)
        assert back.coordinator_restored
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        assert set(fake.states.values()) == {ProcessState.RUNNING}
    started = [e.step for e in events if isinstance(e, agent.StepEvent) and e.status == "started"]
    assert started == ["detect", "capture", "native_lock", "native_checkpoint"]


def test_a_suspend_asks_its_shims_one_status_before_handshake(work: Path) -> None:
    """The driver and the ids in one STATUS (CUIP_ASK_DRIVER): the origin records the
    driver the shims reported, and nothing else is asked before the capture binds; the
    GPUs are asked after it, before the native lock."""
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        for f in team.fakes:
            f.driver = "/opt/cuda/libcuda.so.1"
        done = suspend(team, work / "ckpt", fake)
        for f in team.fakes:
            ops = f.received
            assert ops[: ops.index(Op.HANDSHAKE)] == [Op.STATUS], ops
    assert done.manifest.origin is not None
    assert done.manifest.origin.driver == "/opt/cuda/libcuda.so.1"
    assert [p.participant for p in done.manifest.participants] == [
        m.participant for m in TOPOLOGY.participants
    ]


def test_a_suspend_of_shims_on_two_drivers_is_refused_before_anything(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        for i, f in enumerate(team.fakes):
            f.driver = f"/opt/cuda-{i}/libcuda.so.1"
        with pytest.raises(agent.DetectionRefused, match="suspend refused") as refused:
            suspend(team, work / "ckpt", fake)
        assert "one suspend per driver" in "\n".join(refused.value.lines())
        assert all(Op.HANDSHAKE not in f.received for f in team.fakes)
    assert fake.calls == [] and set(fake.states.values()) == {ProcessState.RUNNING}


def test_a_shim_that_cannot_say_its_gpus_after_the_capture_is_undone(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPUs are asked once the capture is done (their report makes driver calls a
    process not RUNNING would hold): a report refused there (a hostile one may say
    anything) names the process, and the capture is undone before any native step."""
    from cuinterpose.engine import suspension

    asked = suspension.call_all

    def garbled(calls: Any, **kwargs: Any) -> Any:
        replies = list(asked(calls, **kwargs))
        if calls[0][1].ask_devices:
            replies[1] = attrs.evolve(replies[1], message="0\tnot a uuid\t1\tGPU\n")
        return replies

    monkeypatch.setattr(suspension, "call_all", garbled)
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.SuspendFailed) as failed:
            suspend(team, work / "ckpt", fake)
        assert failed.value.restored
        text = "\n".join(failed.value.lines())
        assert "pid 1001" in text and "devices report refused" in text, text
        assert "the group runs as before the suspend" in text
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    assert [c for c in fake.calls if c[0] != "state"] == []


@pytest.mark.parametrize("step, pid", [("lock", 1001), ("checkpoint", 1001), ("lock", 1000)])
def test_a_failed_native_step_is_undone_and_the_shims_restored(
    work: Path, step: str, pid: int
) -> None:
    fake = running()
    fake.fail = (step, pid)
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.SuspendFailed) as info:
            suspend(team, work / "ckpt", fake)
        assert info.value.restored
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        assert set(fake.states.values()) == {ProcessState.RUNNING}
    text = str(info.value)
    assert f"native {step} failed: pid {pid}" in text
    for p in PIDS:
        assert f"now pid {p} (ns pid {p}): native RUNNING, shim ACTIVE" in text
    assert not (work / "ckpt" / agent.MANIFEST_FILE_NAME).exists()


def test_an_undo_that_cannot_restore_says_the_group_is_not_back(work: Path) -> None:
    class Stuck(FakeNative):
        def restore(self, pid: int) -> None:
            self.calls.append(("restore", pid))
            raise NativeError(pid, "cuCheckpointProcessRestore", "CUDA_ERROR_NOT_SUPPORTED")

    fake = Stuck({p: ProcessState.RUNNING for p in PIDS}, fail=("checkpoint", 1001))
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.SuspendFailed) as info:
            suspend(team, work / "ckpt", fake)
        assert not info.value.restored
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}  # left for recover
    text = str(info.value)
    assert "pid 1000: native restore failed" in text and "CUDA_ERROR_NOT_SUPPORTED" in text
    assert "the coordinator restore was not run" in text
    assert "now pid 1000 (ns pid 1000): native CHECKPOINTED, shim PREPARED" in text


def test_suspend_refuses_before_anything_when_a_process_is_not_running(work: Path) -> None:
    fake = running()
    fake.states[1001] = ProcessState.LOCKED
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.StateRefused, match=r"pid 1001 \(ns pid 1001\) is LOCKED"):
            suspend(team, work / "ckpt", fake)
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        # The driver question alone (it makes no driver call in the shim), nothing after.
        assert all(f.received == [Op.STATUS] for f in team.fakes)
    assert [c for c in fake.calls if c[0] != "state"] == []


def test_suspend_refuses_a_requested_group_with_a_process_missing_its_socket(work: Path) -> None:
    fake = running([*PIDS, 1002])
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.DetectionRefused, match=r"pid 1002 does not exist"):
            agent.suspend(
                [(p, p) for p in [*PIDS, 1002]],
                work / "ckpt",
                where=agent.Where(team.control_dir),
                native=fake,
            )
        assert all(f.received == [] for f in team.fakes)
    assert fake.calls == []


def test_suspend_refuses_a_group_that_did_not_request_but_has_sockets(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.DetectionRefused, match="did not request"):
            suspend(team, work / "ckpt", fake, requested=False)
        assert all(f.received == [] for f in team.fakes)
    assert fake.calls == []


def test_a_group_that_did_not_request_is_checkpointed_natively_only(
    work: Path, live: list[int]
) -> None:
    fake = running(live)
    where = agent.Where(work / "control")
    done = agent.suspend(
        [(p, p) for p in live], work / "ckpt", where=where, native=fake, requested=False
    )
    assert (done.manifest.requested, done.manifest.prepared) == (False, False)
    assert [t.step for t in done.timings] == ["detect", "native_lock", "native_checkpoint"]
    assert not (work / "ckpt" / STATE_FILE_NAME).exists()
    back = agent.resume(work / "ckpt", where=where, native=fake)
    assert not back.coordinator_restored
    assert set(fake.states.values()) == {ProcessState.RUNNING}
    # Resumed: a second resume is refused, a new suspend may reuse the directory.
    assert agent.read_manifest(work / "ckpt").resumed_at
    with pytest.raises(agent.ManifestError, match="was resumed at"):
        agent.resume(work / "ckpt", where=where, native=fake)
    agent.suspend([(p, p) for p in live], work / "ckpt", where=where, native=fake, requested=False)
    # Suspended and never resumed: the manifest is not overwritten by another suspend.
    fake.states = {p: ProcessState.RUNNING for p in live}
    with pytest.raises(agent.ManifestError, match="never resumed") as info:
        agent.suspend([(p, p) for p in live], work / "ckpt", where=where, native=fake)
    first = f"pid {live[0]} (ns pid {live[0]})"
    assert first in str(info.value) and "resume it first" in str(info.value)


def test_a_native_only_group_with_a_process_gone_is_refused_by_detection(work: Path) -> None:
    """A pid that names no process is said so whatever the group requested, before any
    native call (a driver would only say it cannot find it)."""
    fake = running()
    with pytest.raises(agent.DetectionRefused, match="pid 1000 does not exist") as info:
        agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=agent.Where(work / "c"),
                      native=fake, requested=False)  # fmt: skip
    assert "pid 1001 does not exist" in str(info.value)
    assert fake.calls == []


def test_resume_refuses_other_processes_and_unsuspended_ones(work: Path, live: list[int]) -> None:
    fake = running(live)
    where = agent.Where(work / "control")
    agent.suspend([(p, p) for p in live], work / "ckpt", where=where, native=fake, requested=False)
    with pytest.raises(agent.ManifestError, match="not the manifest's"):
        agent.resume(work / "ckpt", where=where, native=fake, processes=[(live[0], live[0])])
    # One brought back natively behind the tool's back (or by a resume stopped midway):
    # refused, naming what takes such a mix back: the group was checkpointed natively
    # only (no shims for recover), so the native steps on the one still checkpointed.
    fake.states[live[0]] = ProcessState.RUNNING
    with pytest.raises(agent.StateRefused) as refused:
        agent.resume(work / "ckpt", where=where, native=fake)
    said = str(refused.value)
    assert f"pid {live[0]} (ns pid {live[0]}) is natively RUNNING" in said, said
    assert "no shims for `cuinterpose recover`" in said, said
    assert f"`cuinterpose native --action restore --pid {live[1]}`" in said, said
    assert f"`cuinterpose native --action unlock --pid {live[1]}`" in said, said
    assert f"--pid {live[0]}`" not in said, said
    assert fake.states[live[1]] is ProcessState.CHECKPOINTED  # nothing was changed
    fake.states[live[0]] = ProcessState.FAILED  # not a state recover takes back
    with pytest.raises(agent.StateRefused, match=rf"pid {live[0]} \(ns pid {live[0]}\) is FAILED"):
        agent.resume(work / "ckpt", where=where, native=fake)


# ------------------------------------------------------------------ the CLI verbs
def run_cli(argv: list[str], fake: FakeNative) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(argv, stdout=out, stderr=err, native=fake)
    return code, out.getvalue(), err.getvalue()


def test_cli_suspend_resume_and_status(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(team.control_dir)]
        code, out, err = run_cli(["suspend", *common, *team.processes], fake)
        assert code == 0, err
        events = [json.loads(line) for line in out.splitlines()]  # not a terminal: JSON
        assert events[-1]["event"] == "summary"
        code, out, err = run_cli(
            ["status", "--control-dir", str(team.control_dir), *team.processes, "--json"],
            fake,
        )
        assert code == 0, err
        rows = json.loads(out)["processes"]
        assert {(r["native_state"], r["shim_phase"]) for r in rows} == {
            ("CHECKPOINTED", "PREPARED")
        }
        code, out, err = run_cli(
            ["status", "--control-dir", str(team.control_dir), *team.processes], fake
        )
        assert code == 0 and "CHECKPOINTED" in out and "PREPARED" in out
        code, out, err = run_cli(
            ["resume", *common, *team.processes, "--progress", "human", "--per-participant"],
            fake,
        )
        assert code == 0, err
        assert "coordinator_restore" in out and "LOAD_ALLOCATIONS per participant" in out, out
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}


def test_cli_suspend_failures_exit_1_with_every_step(work: Path) -> None:
    fake = running()
    fake.fail = ("checkpoint", 1001)
    with team_of(TOPOLOGY, work / "control") as team:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(team.control_dir)]
        argv = ["suspend", *common, *team.processes, "--progress", "none"]
        code, _, err = run_cli(argv, fake)
        assert code == cli.EXIT_FAILED, err
        assert "native checkpoint failed: pid 1001" in err
        assert "the group runs as before the suspend" in err
        code, _, err = run_cli([*argv, "--not-requested"], running())
        assert code == cli.EXIT_FAILED
        assert "did not request cuinterpose" in err and "pid 1000" in err and "pid 1001" in err


def test_the_human_view_shows_copy_progress_steps_and_the_summary() -> None:
    from cuinterpose import render
    from cuinterpose.engine.progress import OpEvent, ParticipantTransfer, Transfer

    out = io.StringIO()
    view = render.HumanView(out, per_participant=True)
    transfer = Transfer(
        1, 4 << 20, 2.0, 4.0, (ParticipantTransfer("a" * 32, 7, 1, 4 << 20, 0.002, 0.001),)
    )
    with view.live():
        view(agent.StepEvent("capture", "started"))
        view(agent.CopyProgress("SAVE_ALLOCATIONS", 1 << 20, 4 << 20, 0.5))
        view(OpEvent("capture", "SAVE_ALLOCATIONS", 0.002, 1, transfer))
        view(agent.StepEvent("capture", "done", 0.25, 4 << 20))
    view.summary([agent.Timing("capture", 0.25, 4 << 20), agent.Timing("native_lock", 0.01)])
    text = out.getvalue()
    assert "SAVE_ALLOCATIONS" in text and "capture: done in 0.250 s" in text
    assert "0.02" in text  # 4 MiB in 0.25 s, in GB/s
    assert "native_lock" in text and "per participant" in text and "a" * 32 in text


def test_cli_suspend_refused_by_capture_touches_no_native_state(work: Path) -> None:
    fake = running()
    refused = topologies.with_records(TOPOLOGY, topologies.participant(1), topologies.raw_import())
    with team_of(refused, work / "control") as team:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(team.control_dir)]
        code, _, err = run_cli(["suspend", *common, *team.processes], fake)
        assert code == cli.EXIT_FAILED, err
        assert "capture refused" in err and "RAW_IMPORT" in err and "pid 1001" in err
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    assert [c for c in fake.calls if c[0] != "state"] == []
    assert not (work / "ckpt" / agent.MANIFEST_FILE_NAME).exists()


def _capture_until_quiet(
    endpoints: list[Endpoint], directory: Path, options: Options, log: logging.Logger
) -> runner.CaptureResult:
    """A capture as suspend runs it (engine/suspension.py)."""
    return quiesce.until_quiet(partial(runner.capture, endpoints, directory, options), options, log)


def test_a_suspend_refused_as_not_quiet_starts_over_once(tmp_path: Path) -> None:
    """A shim that ran out of its own deadline refuses (its gate opened): the capture
    starts over, and the second attempt's rounds find the team quiet."""
    not_quiet = "QUIESCE: pid 1001 did not reach a quiet point within 10000 ms"
    script = {1: {Op.QUIESCE: Fault("not_quiet", Status.REFUSED, not_quiet, times=1)}}
    with short_dir() as work, team_of(TOPOLOGY, work / "control", scripts=script) as t:
        log = logging.getLogger("test")
        captured = _capture_until_quiet(t.endpoints, tmp_path, Options(5.0), log)
        received = [f.received.count(Op.QUIESCE) for f in t.fakes]
    assert captured.state.topology == TOPOLOGY
    assert received == [quiesce.CAPTURE_ATTEMPTS] * len(received)


def test_a_suspend_refused_as_not_quiet_twice_is_refused(tmp_path: Path) -> None:
    not_quiet = "QUIESCE: pid 1001 did not reach a quiet point within 10000 ms"
    script = {1: {Op.QUIESCE: Fault("not_quiet", Status.REFUSED, not_quiet)}}
    with short_dir() as work, team_of(TOPOLOGY, work / "control", scripts=script) as t:
        log = logging.getLogger("test")
        with pytest.raises(StepFailed, match="did not reach a quiet point") as caught:
            _capture_until_quiet(t.endpoints, tmp_path, Options(5.0), log)
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}
    assert caught.value.step == "QUIESCE" and not caught.value.destroyed


def test_a_suspend_told_to_stop_during_quiesce_rounds_does_not_start_over(tmp_path: Path) -> None:
    """The stop event ends the rounds (the pending participant is reported not quiet),
    and the capture is not tried again."""
    stop = threading.Event()
    busy = "QUIESCE: pid 1002 not quiet yet after 20 ms: device work still running"
    script = {1: {Op.QUIESCE: Fault("pending", message=busy)}}

    def on_progress(event: object) -> None:
        if isinstance(event, QuiesceRound):
            stop.set()

    with short_dir() as work, team_of(TOPOLOGY, work / "control", scripts=script) as t:
        log = logging.getLogger("test")
        options = Options(5.0, stop=stop, on_progress=on_progress)
        with pytest.raises(StepFailed, match="did not reach a quiet point"):
            _capture_until_quiet(t.endpoints, tmp_path, options, log)
        received = [f.received.count(Op.QUIESCE) for f in t.fakes]
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}
    assert received == [1] * len(received)
