"""QUIESCE and the gate (specs/quiesce.md) on the simulated driver, whose streams run
their work on worker threads (CUINTERPOSE_SIM_WORK_US: each piece takes that long), so
that work really is in flight when a capture starts.

- threads that keep launching and synchronizing in two processes sharing memory are
  suspended (capture, native checkpoint) and resumed: every write that returned success
  is there afterwards; the same capture without QUIESCE loses updates or faults;
- a process that never synchronizes is refused within the deadline, named with what its
  threads were held at, and runs on with its bytes;
- a coordinator killed while the group is QUIESCED: the gates reopen by themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose.demo import Worker, coordinator_env
from cuinterpose.engine import Options, StepFailed, agent, capture, endpoint_for, wire
from cuinterpose.engine.errors import not_quiet
from cuinterpose.engine.progress import FailedEvent, QuiesceRound
from cuinterpose.engine.serial import to_json

from tests import snippet
from tests.shim import shimenv
from tests.shim.agentgroup import WorkerBackend
from tests.simenv import Spawn
from tests.waiting import wait_until

KILLED_COORDINATOR = Path(__file__).parent / "workers" / "killed_coordinator.py"
WORK_US = "2000"  # each queued memset takes 2 ms: every thread has work in flight
THREADS = 3
REGION = 64 << 10  # bytes of X per thread

# Threads that write 1, 2, 3... to consecutive words of their region of X, one async
# memset each on their own stream, and count a write once its synchronize returned
# success. `sync=False` leaves the synchronize out (a process that never waits, launching
# 250 times a second: faster than the device runs them).
LOOPS = snippet.load(__file__, "loops")


# Two ranks looping "collective N (cuLaunchHostFunc of the simulator's
# cuinterposeSimCollective: the stream stays busy until both ranks launched N); write
# N + 1 to word N of the rank's region of X; synchronize". A rank told to pause stops
# between its launches and its synchronize, as a rank busy on the host would: its peer
# then launches N + 1 and waits for it, one collective ahead.
COLLECTIVE = snippet.load(__file__, "collective")


def _ranks(spawn: Spawn, shim_env: dict[str, str], arena: Path) -> tuple[Worker, Worker]:
    """The collective's two ranks (creator rank 0, importer rank 1), sharing X, each
    one collective ahead of the other at most, the importer paused before its
    synchronize and the creator waiting in the collective after it."""
    creator, importer = _group(spawn, shim_env, {})
    arena.write_bytes(bytes(4096))
    for rank, w in enumerate((creator, importer)):
        w(COLLECTIVE + f"join({str(arena)!r}, {rank})\ncoll_start(X)")
    ranks = (creator, importer)
    wait_until(lambda: all(w("result = RUN['done']") >= 3 for w in ranks), "both ranks ran")
    importer("RUN['pause'] = True")
    wait_until(lambda: importer("result = RUN['paused_at']") is not None, "the importer paused")
    paused_at = importer("result = RUN['paused_at']")
    # The creator's collective paused_at completed (both launched it); it launched the
    # next one, which waits for the importer.
    wait_until(
        lambda: creator("result = RUN['launched']") == paused_at + 2, "the creator ran ahead"
    )
    return creator, importer


def test_ranks_a_collective_apart_converge_by_advancing(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], tmp_path: Path
) -> None:
    """The deadlock of the H200 run, made certain: when the gates close, the creator
    waits in collective N + 1 and the importer, held before its synchronize of N, has
    not launched N + 1. No wait ends that; the rounds advance the quiet importer by one
    synchronization, it launches N + 1, and both are quiet."""
    creator, importer = _ranks(spawn, shim_env, tmp_path / "arena")
    observer = spawn("observer", plain_env)
    native, where = WorkerBackend(observer), agent.Where(Path(shim_env["SNAPSHOT_CONTROL_DIR"]))
    rounds: list[QuiesceRound] = []
    refusals: list[FailedEvent] = []

    def on_event(event: agent.AgentEvent) -> None:
        if isinstance(event, FailedEvent):
            refusals.append(event)  # an attempt that ran out of time: no convergence
        if isinstance(event, QuiesceRound):
            if not rounds:
                # Every gate is closed now: the importer's synchronize is held.
                importer("RUN['pause'] = False\nGO.set()")
            rounds.append(event)
            print("ROUND", to_json(event), flush=True)

    processes = [(w.pid, w.pid) for w in (creator, importer)]
    done = agent.suspend(processes, tmp_path / "ckpt", where=where, native=native,
                         on_event=on_event)  # fmt: skip
    assert done.manifest.prepared
    assert refusals == [], "the first capture attempt did not converge"
    assert rounds, "the team was quiet at once: the ranks were not a collective apart"
    assert [p.pid for p in rounds[0].pending] == [creator.pid]
    assert "device work still running" in rounds[0].pending[0].message
    at_suspend = [w("result = RUN['done']") for w in (creator, importer)]
    assert abs(at_suspend[0] - at_suspend[1]) <= 1
    agent.resume(tmp_path / "ckpt", where=where, native=native)
    wait_until(
        lambda: all(w("result = RUN['done']") > n + 3 for w, n in zip((creator, importer),
                                                                      at_suspend, strict=True)),
        "both ranks run collectives again",
    )  # fmt: skip
    for w in (creator, importer):
        w("coll_stop()")
        assert w("result = RUN['errors']") == [], w.name
        assert w("result = coll_missing(X)") == [], w.name


def test_a_coordinator_killed_between_rounds_leaves_the_gates_open(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    """Killed after round 1: the creator is PENDING (ACTIVE, gate closed), the importer
    QUIESCED. Each notices from a held thread that the lease holder is gone."""
    creator, importer = _ranks(spawn, shim_env, tmp_path / "arena")
    (tmp_path / "ckpt").mkdir()
    killed = subprocess.run(
        [sys.executable, str(KILLED_COORDINATOR), "capture", "QUIESCE_ROUND", "1",
         str(tmp_path / "ckpt"), str(control_dir), str(creator.pid), str(importer.pid)],
        env=coordinator_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    importer("RUN['pause'] = False\nGO.set()")  # its synchronize meets the closed gate
    ranks = (creator, importer)
    wait_until(
        lambda: {_phase(control_dir, w.pid) for w in ranks} == {wire.Phase.ACTIVE},
        "both shims ACTIVE",
    )
    after = [w("result = RUN['done']") for w in ranks]
    wait_until(
        lambda: all(w("result = RUN['done']") > n + 3 for w, n in zip(ranks, after, strict=True)),
        "both ranks run collectives again",
    )
    for w in ranks:
        w("coll_stop()")
        assert w("result = RUN['errors']") == [], w.name
        assert w("result = coll_missing(X)") == [], w.name


def _group(spawn: Spawn, shim_env: dict[str, str], extra: dict[str, str]) -> tuple[Worker, ...]:
    env = {**shim_env, "CUINTERPOSE_SIM_WORK_US": WORK_US, **extra}
    creator = spawn("creator", env, wait=False)
    importer = spawn("importer", env, wait=False)
    for w in (creator, importer):
        w.wait_ready()
        w(shimenv.WORKER_SETUP + f"THREADS = {THREADS}\nREGION = {REGION}\n" + LOOPS)
    size = 2 * THREADS * REGION
    creator(f"""
size = max(gran, {size})
h = check(cu.cuMemCreate(size, prop(), 0))
X = map_rw(h, size)
check(cu.cuMemsetD8(X, 0, size))
fd = check(cu.cuMemExportToShareableHandle(h, POSIX, 0))
""")
    fd = creator.send_fd_to(importer, int(creator("result = int(fd)")), close=True)
    importer(f"""
size = max(gran, {size})
h = check(cu.cuMemImportFromShareableHandle({fd}, POSIX))
X = map_rw(h, size) + {THREADS * REGION}
""")
    return creator, importer


def _progress(worker: Worker) -> int:
    return int(worker("result = sum(RUN['done'])"))


def _phase(control_dir: Path, pid: int) -> wire.Phase:
    return shimenv.handshake(shimenv.socket_path(control_dir, pid)).phase


def _running(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], extra: dict[str, str]
) -> tuple[list[Worker], WorkerBackend, agent.Where]:
    """The group with every thread writing, calls in flight in each; a native backend
    run by a worker without the shim; where the sockets are."""
    creator, importer = _group(spawn, shim_env, extra)
    observer = spawn("observer", plain_env)
    group = [creator, importer]
    for w in group:
        w("start(X)")
    wait_until(lambda: all(min(w("result = RUN['done']")) >= 3 for w in group), "every thread ran")
    return group, WorkerBackend(observer), agent.Where(Path(shim_env["SNAPSHOT_CONTROL_DIR"]))


@pytest.mark.threads  # make tsan
def test_a_running_group_is_suspended_and_resumed_without_a_lost_update(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], tmp_path: Path
) -> None:
    group, native, where = _running(spawn, shim_env, plain_env, {})
    processes = [(w.pid, w.pid) for w in group]
    seen: list[agent.AgentEvent] = []
    done = agent.suspend(processes, tmp_path, where=where, native=native, on_event=seen.append)
    assert done.manifest.prepared
    quiesce = [e for e in seen if to_json(e).get("phase") == "QUIESCE"]
    assert quiesce, [to_json(e) for e in seen]
    at_suspend = [_progress(w) for w in group]
    agent.resume(tmp_path, where=where, native=native)
    # The held threads run on: every one of them writes again after the resume.
    wait_until(
        lambda: all(_progress(w) > n + THREADS for w, n in zip(group, at_suspend, strict=True)),
        "every thread wrote after the resume",
    )
    for w in group:
        w("stop()")
        assert w("result = RUN['errors']") == []
        assert w("result = missing(X)") == [], w.name


def test_without_the_gate_the_same_suspend_loses_updates_or_faults(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], tmp_path: Path
) -> None:
    """The control: SNAPSHOT_SHIM_GATE=0 (QUIESCE drains once, holds nothing). The
    threads' work lands on memory SAVE has already copied and PREPARE_UNICAST unmaps."""
    group, native, where = _running(spawn, shim_env, plain_env, {"SNAPSHOT_SHIM_GATE": "0"})
    failure: Exception | None = None
    # Without the gate nothing holds the threads, so QUIESCE's one drain can find work
    # still running and refuse before anything is torn down: that suspend ran no
    # control, and the group runs as before. Try again until one gets past QUIESCE.
    for attempt in range(8):
        failure = None
        directory = tmp_path / f"ckpt-{attempt}"
        directory.mkdir()
        try:
            agent.suspend([(w.pid, w.pid) for w in group], directory, where=where, native=native)
            agent.resume(directory, where=where, native=native)
        except Exception as exc:  # the resume's reload meets the failed context, for one
            failure = exc
        refused_at_quiesce = (
            isinstance(failure, StepFailed) and failure.step == "QUIESCE" and not failure.destroyed
        )
        if not refused_at_quiesce:
            break
    for w in group:
        w("stop()")
    errors = [e for w in group for e in w("result = RUN['errors']")]
    faulted = any("CUDA_ERROR_ILLEGAL_ADDRESS" in e for e in errors)
    lost = [] if faulted else [m for w in group for m in w("result = missing(X)")]
    assert faulted or lost, (errors, failure)


# The shim's own deadline (counted from the first round: the shim refuses and opens its
# gate), or a shorter one the embedder gives the rounds (the coordinator stops asking;
# the shim's last answer was PENDING, and the run's RELEASE opens its gate).
@pytest.mark.threads  # make tsan
@pytest.mark.parametrize(("setting_s", "sent_s"), [("1.5", None), ("30", 0.3)], ids=["own", "sent"])
def test_a_process_that_never_synchronizes_is_refused_and_runs_on(
    spawn: Spawn,
    shim_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    setting_s: str,
    sent_s: float | None,
) -> None:
    slow = {"CUINTERPOSE_SIM_WORK_US": "10000", "SNAPSHOT_SHIM_QUIESCE_TIMEOUT_S": setting_s}
    creator, importer = _group(spawn, shim_env, slow)
    importer("start(X)")  # synchronizes
    creator("start(X, sync=False)")  # launches faster than the device runs them
    wait_until(lambda: sum(creator("result = RUN['launched']")) >= 30, "the queue grew")
    endpoints = [endpoint_for(w.pid, w.pid, control_dir=control_dir) for w in (creator, importer)]
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(StepFailed) as caught:
        capture(endpoints, tmp_path / "ckpt", Options(60.0, quiesce_deadline=sent_s))
    error = caught.value
    text = str(error)
    assert error.step == "QUIESCE" and not error.destroyed, text
    # The creator first; the importer, quiet in every round, was advanced each time the
    # creator was not and may have been caught busy by the last one: it says so.
    assert error.problems[0].pid == creator.pid, text
    assert all("(advanced" in p.reason for p in error.problems[1:]), text
    if sent_s is None:
        assert f"QUIESCE: pid {creator.pid} did not reach a quiet point within 1500 ms" in text
        assert "the gate is open again and the process runs on" in text
    else:
        assert "QUIESCE: did not reach a quiet point within" in text
        assert f"pid {creator.pid}" in text
        assert "its last answer: QUIESCE: not quiet yet after" in text
    assert "device work still running" in text
    # The shim's refusal carries the typed reason (the NOT_QUIET flag), which is what
    # lets a capture start over; so does a participant the rounds left PENDING.
    assert error.problems[0].not_quiet and not_quiet(error), text
    # Both back in ACTIVE, gates open: the importer's threads synchronize again and the
    # creator keeps launching.
    assert {_phase(control_dir, w.pid) for w in (creator, importer)} == {wire.Phase.ACTIVE}
    launched = sum(creator("result = RUN['launched']"))
    done = _progress(importer)
    wait_until(lambda: sum(creator("result = RUN['launched']")) > launched, "creator launches")
    wait_until(lambda: _progress(importer) > done + THREADS, "importer synchronizes")
    for w in (creator, importer):
        w("stop()")
        assert w("result = RUN['errors']") == []
        assert w("result = missing(X)") == [], w.name


@pytest.mark.threads  # make tsan
def test_a_coordinator_killed_while_quiesced_leaves_the_gates_open(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    creator, importer = _group(spawn, shim_env, {})
    group = [creator, importer]
    for w in group:
        w("start(X)")
    wait_until(lambda: all(min(w("result = RUN['done']")) >= 3 for w in group), "every thread ran")
    (tmp_path / "ckpt").mkdir()
    killed = subprocess.run(
        [sys.executable, str(KILLED_COORDINATOR), "capture", "QUIESCE", "1",
         str(tmp_path / "ckpt"), str(control_dir), *(str(w.pid) for w in group)],
        env=coordinator_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    # Held threads notice that the lease holder is gone: ACTIVE, and they run on.
    wait_until(
        lambda: {_phase(control_dir, w.pid) for w in group} == {wire.Phase.ACTIVE},
        "both shims back in ACTIVE",
    )
    after = [_progress(w) for w in group]
    wait_until(
        lambda: all(_progress(w) > n + THREADS for w, n in zip(group, after, strict=True)),
        "every thread writes again",
    )
    for w in group:
        w("stop()")
        assert w("result = RUN['errors']") == []
        assert w("result = missing(X)") == [], w.name


def test_a_pending_gate_that_no_round_follows_opens_at_the_shims_own_deadline(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path
) -> None:
    """A coordinator that lives on but sends no further round (hung, or stopped
    between rounds without RELEASE) must not keep the application held: once the
    shim's own deadline from its first round has passed, a held thread opens the gate."""
    slow = {"CUINTERPOSE_SIM_WORK_US": "200000", "SNAPSHOT_SHIM_QUIESCE_TIMEOUT_S": "1"}
    creator, _ = _group(spawn, shim_env, slow)
    creator("start(X)")
    wait_until(lambda: min(creator("result = RUN['done']")) >= 1, "every thread ran")
    path = shimenv.socket_path(control_dir, creator.pid)
    lease = os.urandom(16)
    bound, _ = shimenv.request(path, wire.Request(wire.Op.HANDSHAKE, authorization=lease))
    asked = wire.Request(wire.Op.QUIESCE, participant=bound.participant, authorization=lease,
                         deadline_ns=20_000_000, round=True)  # fmt: skip
    reply, _ = shimenv.request(path, asked)
    assert (reply.status, reply.phase) == (wire.Status.PENDING, wire.Phase.ACTIVE), reply
    assert "the gate stays closed until the next round" in reply.message
    # This process holds the lease and lives: only the deadline can open the gate. Until
    # then each thread finishes at most the synchronize it was in.
    held = _progress(creator)
    wait_until(lambda: _progress(creator) > held + THREADS, "the threads run on")
    assert _phase(control_dir, creator.pid) is wire.Phase.ACTIVE
    released, _ = shimenv.request(path, wire.Request(wire.Op.RELEASE, authorization=lease))
    assert released.status is wire.Status.OK
    creator("stop()")
    assert creator("result = RUN['errors']") == []
    assert creator("result = missing(X)") == []
