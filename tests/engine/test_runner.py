"""The lockstep driver through real sockets and fake participants."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
from cuinterpose.engine import runner, wire
from cuinterpose.engine.client import Endpoint, ParticipantError, call_all
from cuinterpose.engine.errors import (
    Interrupted,
    ParticipantsRefused,
    PreflightRefused,
    Problem,
    Refused,
    StepFailed,
    TopologyRefused,
    VerificationFailed,
    not_quiet,
)
from cuinterpose.engine.progress import DoneEvent, Event, FailedEvent, OpEvent
from cuinterpose.engine.statefile import STATE_FILE_NAME, read_state
from cuinterpose.engine.wire import Op, Phase, RecordKind, Reply, Request, Status
from cuinterpose.testing import Fault
from engine_harness import TEARS_DOWN_OPS, Team, short_dir, team_of
from topologies import (
    allocation_id,
    participant,
    raw_import,
    replace_records,
    team,
    with_records,
)

CAPTURE_OPS = [
    Op.HANDSHAKE,
    Op.QUIESCE,
    Op.INSPECT,
    Op.PREPARE_MULTICAST,
    Op.SAVE_ALLOCATIONS,
    Op.PREPARE_UNICAST,
]
RESTORE_OPS = [
    Op.HANDSHAKE,
    Op.INSPECT,
    Op.LOAD_ALLOCATIONS,
    Op.RESTORE_UNICAST,
    Op.RESTORE_MULTICAST_CREATORS,
    Op.RESTORE_MULTICAST_IMPORTERS,
    Op.RESTORE_MULTICAST_DEVICES,
    Op.RESTORE_MULTICAST_BINDINGS,
    Op.INSPECT,
]
TOPOLOGY = team(participants=3, allocations=2, multicast=True)


@pytest.fixture
def work() -> Path:  # type: ignore[misc]
    with short_dir() as path:
        (path / "ckpt").mkdir()
        yield path


def options(
    events: list[Event] | None = None,
    *,
    phase_timeout: float = 5.0,
    transport: runner.Transport = call_all,
) -> runner.Options:
    sink = events.append if events is not None else None
    # The machine alone, fail-stop: the rollback after a failure is tested on its own.
    return runner.Options(
        phase_timeout=phase_timeout,
        on_progress=sink,
        transport=transport,
        rollback_on_failure=False,
    )


def assert_nothing_destroyed(team_: Team) -> None:
    """Nothing torn down, and every gate open again: the group runs as before."""
    for received in team_.received():
        assert not TEARS_DOWN_OPS & set(received), received
    assert Phase.QUIESCED not in {f.phase for f in team_.fakes}


def capture(
    team_: Team, ckpt: Path, *, phase_timeout: float = 5.0, transport: runner.Transport = call_all
) -> runner.CaptureResult:
    return runner.capture(
        team_.endpoints, ckpt, options(phase_timeout=phase_timeout, transport=transport)
    )


# -- happy paths -----------------------------------------------------------------------


def test_capture_then_restore_unicast_and_multicast(work: Path) -> None:
    events: list[Event] = []
    with team_of(TOPOLOGY, work / "control") as t:
        result = runner.capture(t.endpoints, work / "ckpt", options(events))
        assert t.received() == [CAPTURE_OPS] * 3
        assert all(f.phase is Phase.PREPARED for f in t.fakes)
        state = read_state(work / "ckpt")
        assert state == result.state
        assert state.topology == TOPOLOGY
        assert {p.participant for p in state.participants} == set(TOPOLOGY.participant_ids)
        assert state.content_mode == "host"

        restored = runner.restore(t.endpoints, work / "ckpt", options(events))
        assert t.received() == [CAPTURE_OPS + RESTORE_OPS] * 3
        assert all(f.phase is Phase.ACTIVE for f in t.fakes)
        assert restored.topology.same_shape(TOPOLOGY)
    phases = [(e.machine, e.phase) for e in events if isinstance(e, OpEvent)]
    assert phases == [("capture", op.name) for op in CAPTURE_OPS] + [
        ("restore", op.name) for op in RESTORE_OPS
    ]
    assert [type(e) for e in events if not isinstance(e, OpEvent)] == [DoneEvent, DoneEvent]


def test_each_phase_is_dispatched_to_all_participants_at_once(work: Path) -> None:
    # The fakes answer an op only once every one of them has received it: a
    # coordinator that awaited one reply before sending the next request would hang.
    with team_of(TOPOLOGY, work / "control", barrier=True, barrier_timeout=3.0) as t:
        runner.capture(t.endpoints, work / "ckpt", options())
        runner.restore(t.endpoints, work / "ckpt", options())
        assert all(f.phase is Phase.ACTIVE for f in t.fakes)


def test_transfer_figures_on_save_and_load(work: Path) -> None:
    events: list[Event] = []
    with team_of(TOPOLOGY, work / "control") as t:
        runner.capture(t.endpoints, work / "ckpt", options(events))
    save = next(e for e in events if isinstance(e, OpEvent) and e.phase == "SAVE_ALLOCATIONS")
    assert save.transfer is not None
    assert save.transfer.allocation_count == 3  # one per fake (SAVE_STATS)
    assert save.transfer.allocation_bytes == 3 * (4 << 20)
    # bytes over summed copy time: 12 MiB over 3 ms
    assert save.transfer.copy_gb_per_s == pytest.approx(3 * (4 << 20) / 3e-3 / 1e9)
    assert save.transfer.gb_per_s == pytest.approx(3 * (4 << 20) / save.elapsed_s / 1e9)
    others = [e for e in events if isinstance(e, OpEvent) and e.phase != "SAVE_ALLOCATIONS"]
    assert all(e.transfer is None and e.participants == 3 for e in others)


# -- refusals: nothing destructive is sent -----------------------------------------------


def test_invalid_topology_is_refused_before_any_destructive_op(work: Path) -> None:
    broken = replace_records(TOPOLOGY, participant(1), kind=RecordKind.MAPPING, size=0)
    with team_of(broken, work / "control") as t:
        with pytest.raises(TopologyRefused) as caught:
            capture(t, work / "ckpt")
        assert_nothing_destroyed(t)
        assert all(f.phase is Phase.ACTIVE for f in t.fakes)  # QUIESCED, then released
    assert caught.value.step == "PREPARE_MULTICAST"
    assert caught.value.guard == "topology_valid"
    assert any(p.participant == participant(1) for p in caught.value.problems)
    assert not (work / "ckpt" / STATE_FILE_NAME).exists()


def test_preflight_refusal_names_participant_and_sends_nothing_destructive(work: Path) -> None:
    tainted = with_records(TOPOLOGY, participant(2), raw_import())
    with team_of(tainted, work / "control") as t:
        with pytest.raises(PreflightRefused) as caught:
            capture(t, work / "ckpt")
        assert_nothing_destroyed(t)
        pid = t.fakes[2].pid
    error = caught.value
    assert (error.participant, error.pid) == (participant(2), pid)
    assert "RAW_IMPORT" in error.reason


def test_missing_checkpoint_dir_is_refused_before_any_destructive_op(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        with pytest.raises(Refused) as caught:
            capture(t, work / "missing")
        assert_nothing_destroyed(t)
    assert caught.value.guard == "checkpoint_dir_writable"
    assert "does not exist" in caught.value.reason


def test_capture_refuses_a_participant_not_active(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        # A first capture leaves everyone PREPARED: a second must refuse.
        capture(t, work / "ckpt")
        with pytest.raises(ParticipantsRefused) as caught:
            capture(t, work / "ckpt")
        assert [ops[len(CAPTURE_OPS) :] for ops in t.received()] == [[Op.HANDSHAKE]] * 3
    assert caught.value.step == "QUIESCE"
    assert "phase PREPARED, expected ACTIVE" in caught.value.reason
    assert len(caught.value.problems) == 3


def test_a_failed_participant_is_refused_with_its_stored_reason(work: Path) -> None:
    script = {1: {Op.SAVE_ALLOCATIONS: Fault("fail", message="cuMemcpyDtoH: CUDA_ERROR_X")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        with pytest.raises(StepFailed):
            capture(t, work / "ckpt")
        with pytest.raises(ParticipantsRefused) as caught:
            capture(t, work / "ckpt")
        pid = t.fakes[1].pid
    failed = next(p for p in caught.value.problems if p.participant == participant(1))
    assert failed.pid == pid
    assert "phase FAILED" in failed.reason and "CUDA_ERROR_X" in failed.reason


# -- failures: fail-stop, nothing later is sent ---------------------------------------------


def test_participant_failing_mid_phase_stops_everyone(work: Path) -> None:
    events: list[Event] = []
    script = {1: {Op.SAVE_ALLOCATIONS: Fault("fail", message="cuMemcpyDtoH: CUDA_ERROR_X")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        with pytest.raises(StepFailed) as caught:
            runner.capture(t.endpoints, work / "ckpt", options(events))
        assert t.received() == [CAPTURE_OPS[:5]] * 3
        pid = t.fakes[1].pid
    error = caught.value
    assert (error.step, error.participant, error.pid) == ("SAVE_ALLOCATIONS", participant(1), pid)
    assert "CUDA_FAILED" in error.reason and "CUDA_ERROR_X" in error.reason
    assert not (work / "ckpt" / STATE_FILE_NAME).exists()
    failed = events[-1]
    assert isinstance(failed, FailedEvent)
    assert (failed.kind, failed.phase, failed.participant) == (
        "failed",
        "SAVE_ALLOCATIONS",
        participant(1),
    )


def test_a_hanging_participant_is_bounded_by_the_timeout(work: Path) -> None:
    script = {0: {Op.PREPARE_MULTICAST: Fault("hang")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        with pytest.raises(StepFailed) as caught:
            capture(t, work / "ckpt", phase_timeout=0.3)
        # The hang ends only by the client's timeout: the reason says it was 0.3 s.
        assert "0.3" in caught.value.reason
        assert t.received() == [CAPTURE_OPS[:4]] * 3
    assert caught.value.step == "PREPARE_MULTICAST"
    assert caught.value.participant == participant(0)
    assert caught.value.reason.startswith("timed out")


def test_a_participant_hanging_up_mid_restore_stops_everyone(work: Path) -> None:
    script = {2: {Op.RESTORE_MULTICAST_CREATORS: Fault("hangup")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        capture(t, work / "ckpt")
        with pytest.raises(StepFailed) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        assert t.received() == [CAPTURE_OPS + RESTORE_OPS[:5]] * 3
    assert (caught.value.step, caught.value.participant) == (
        "RESTORE_MULTICAST_CREATORS",
        participant(2),
    )
    assert caught.value.reason.startswith("hung up")


@pytest.mark.parametrize("kind", ["wrong_participant", "wrong_op", "garbage"])
def test_a_mismatched_reply_fails_the_phase(work: Path, kind: str) -> None:
    script = {1: {Op.INSPECT: Fault(kind)}}  # type: ignore[arg-type]
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        with pytest.raises(StepFailed) as caught:
            capture(t, work / "ckpt")
        assert t.received() == [CAPTURE_OPS[:3]] * 3
    assert caught.value.step == "INSPECT"
    assert caught.value.participant == participant(1)
    assert caught.value.reason.startswith("bad reply")
    if kind == "wrong_participant":
        assert f"expected {participant(1)}" in caught.value.reason


def test_a_missing_socket_fails_the_handshake(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        ghost = Endpoint(4242, 4242, work / "control" / "cuinterpose-4242.sock")
        with pytest.raises(StepFailed) as caught:
            runner.capture([*t.endpoints, ghost], work / "ckpt", options())
        assert t.received() == [[Op.HANDSHAKE]] * 3
    assert (caught.value.step, caught.value.pid) == ("HANDSHAKE", 4242)
    assert "does not exist" in caught.value.reason


def test_a_socket_served_by_another_pid_fails_the_handshake(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        fake = t.fakes[0]
        impostor = Endpoint(777, 777, fake.socket_path)
        with pytest.raises(StepFailed) as caught:
            runner.capture([impostor, *t.endpoints[1:]], work / "ckpt", options())
    assert caught.value.pid == 777
    assert f"served by pid {fake.pid}" in caught.value.reason


def test_same_socket_twice_is_a_caller_error(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t, pytest.raises(ValueError, match="same control"):
        runner.capture([t.endpoints[0], t.endpoints[0]], work / "ckpt", options())


def test_a_reply_in_an_unexpected_phase_fails(work: Path) -> None:
    def lying(
        calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float
    ) -> list[Reply | ParticipantError]:
        results = call_all(calls, timeout=timeout)
        if calls[0][1].op is Op.SAVE_ALLOCATIONS:
            reply = results[0]
            assert isinstance(reply, Reply)
            results[0] = attrs.evolve(reply, phase=Phase.MULTICAST_DETACHED)
        return results

    with team_of(TOPOLOGY, work / "control") as t:
        with pytest.raises(StepFailed) as caught:
            capture(t, work / "ckpt", transport=lying)
        assert t.received() == [CAPTURE_OPS[:5]] * 3
    assert "reported phase MULTICAST_DETACHED after SAVE_ALLOCATIONS" in caught.value.reason


# -- restore's own checks ---------------------------------------------------------------


def test_restore_refuses_a_participant_set_other_than_the_state_files(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        capture(t, work / "ckpt")
        with pytest.raises(ParticipantsRefused) as caught:
            runner.restore(t.endpoints[:2], work / "ckpt", options())
        assert_nothing_destroyed_since_capture(t)
    assert caught.value.guard == "participants_match_state"
    assert caught.value.participant == participant(2)
    assert "no given process answers as it" in caught.value.reason


def test_restore_refuses_an_unknown_participant(work: Path) -> None:
    others = team(participants=4, allocations=2, multicast=True, pid_base=3000)
    with team_of(TOPOLOGY, work / "control") as t:
        capture(t, work / "ckpt")
    with team_of(others, work / "control4", phase=Phase.PREPARED) as t:
        with pytest.raises(ParticipantsRefused) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        assert_nothing_destroyed(t)
    assert caught.value.participant == participant(3)
    assert "not in the state file" in caught.value.reason


def test_restore_refuses_participants_not_prepared(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        capture(t, work / "ckpt")
    with team_of(TOPOLOGY, work / "control2") as t:  # ACTIVE: never prepared
        with pytest.raises(ParticipantsRefused) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        assert_nothing_destroyed(t)
    assert caught.value.guard == "all_prepared"
    assert "phase ACTIVE, expected PREPARED" in caught.value.reason


def test_restore_without_a_state_file_fails_before_sending_anything(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control", phase=Phase.PREPARED) as t:
        with pytest.raises(StepFailed) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        assert t.received() == [[]] * 3
    assert caught.value.step == "READ_STATE"
    assert "missing" in caught.value.reason


@pytest.mark.parametrize(
    "content", [b"", b"{not json", b'{"format": "cuinterpose.state", "version": 99}']
)
def test_restore_with_a_corrupt_state_file_fails_before_sending_anything(
    work: Path, content: bytes
) -> None:
    (work / "ckpt" / STATE_FILE_NAME).write_bytes(content)
    with team_of(TOPOLOGY, work / "control", phase=Phase.PREPARED) as t:
        with pytest.raises(StepFailed) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        assert t.received() == [[]] * 3
    assert caught.value.step == "READ_STATE"
    assert STATE_FILE_NAME in caught.value.reason


def test_restore_fails_when_the_restored_topology_differs(work: Path) -> None:
    moved = replace_records(
        TOPOLOGY, participant(1), kind=RecordKind.ALLOCATION, id=allocation_id(0), handle_count=5
    )
    restored = {1: moved.records_by_participant()[participant(1)]}
    with team_of(TOPOLOGY, work / "control", restored=restored) as t:
        capture(t, work / "ckpt")
        with pytest.raises(VerificationFailed) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        assert t.received() == [CAPTURE_OPS + RESTORE_OPS] * 3
    assert (caught.value.step, caught.value.guard) == ("VERIFY", "topology_matches_capture")
    assert participant(1) in caught.value.reason and "handle_count" in caught.value.reason


def test_restore_fails_when_a_participant_reports_failure(work: Path) -> None:
    script = {0: {Op.LOAD_ALLOCATIONS: Fault("fail", Status.CUDA_FAILED, "cuMemCreate: OOM")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        capture(t, work / "ckpt")
        with pytest.raises(StepFailed) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        assert t.received() == [CAPTURE_OPS + RESTORE_OPS[:3]] * 3
        assert t.fakes[0].phase is Phase.FAILED
    assert (caught.value.step, caught.value.participant) == ("LOAD_ALLOCATIONS", participant(0))


def assert_nothing_destroyed_since_capture(team_: Team) -> None:
    for received in team_.received():
        assert not TEARS_DOWN_OPS & set(received[len(CAPTURE_OPS) :]), received


def test_inspect_changes_nothing(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        bound, topology = runner.inspect(t.endpoints, timeout=5.0)
        assert t.received() == [[Op.HANDSHAKE, Op.INSPECT]] * 3
    assert topology == TOPOLOGY
    assert [b.participant for b in bound] == [f.participant for f in t.fakes]


def test_an_unexpected_exception_still_fails_stop_and_closes_the_trace(work: Path) -> None:
    from cuinterpose.engine.trace import TraceRecorder

    def broken(
        calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float
    ) -> list[Reply | ParticipantError]:
        if calls[0][1].op is Op.SAVE_ALLOCATIONS:
            raise RuntimeError("transport bug")
        return call_all(calls, timeout=timeout)

    recorder = TraceRecorder()
    events: list[Event] = []
    with team_of(TOPOLOGY, work / "control") as t:
        opts = runner.Options(phase_timeout=5.0, on_progress=events.append, transport=broken,
                              trace=recorder, rollback_on_failure=False)  # fmt: skip
        with pytest.raises(StepFailed) as caught:
            runner.capture(t.endpoints, work / "ckpt", opts)
        assert t.received() == [CAPTURE_OPS[:4]] * 3
    assert caught.value.step == "SAVE_ALLOCATIONS"
    assert "internal error: RuntimeError('transport bug')" in caught.value.reason
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert recorder.entries[-1]["outcome"] == "failed"
    assert recorder.entries[-2]["trigger"] == "FAIL"
    assert isinstance(events[-1], FailedEvent)


def test_a_stop_request_ends_the_run_at_the_next_boundary_and_rolls_back(work: Path) -> None:
    stop = threading.Event()

    def on_progress(event: object) -> None:
        if isinstance(event, OpEvent) and event.phase == "SAVE_ALLOCATIONS":
            stop.set()

    with team_of(TOPOLOGY, work / "control") as t:
        opts = runner.Options(phase_timeout=5.0, on_progress=on_progress, stop=stop)
        with pytest.raises(Interrupted) as caught:
            runner.capture(t.endpoints, work / "ckpt", opts)
        sent = [f.received for f in t.fakes]
        phases = [f.phase for f in t.fakes]
    error = caught.value
    assert error.step == "PREPARE_UNICAST" and error.destroyed and error.rolled_back
    assert all(Op.PREPARE_UNICAST not in r and r[-1] is Op.INSPECT for r in sent)
    assert phases == [Phase.ACTIVE] * len(phases)
    assert not (work / "ckpt" / "cuinterpose.intent").exists()


def test_the_intent_is_on_disk_before_the_first_destructive_op(work: Path) -> None:
    seen: list[bool] = []

    def on_progress(event: object) -> None:
        if isinstance(event, OpEvent) and event.phase == "PREPARE_MULTICAST":
            seen.append((work / "ckpt" / "cuinterpose.intent").is_file())

    with team_of(TOPOLOGY, work / "control") as t:
        runner.capture(t.endpoints, work / "ckpt", runner.Options(5.0, on_progress=on_progress))
    assert seen == [True]
    assert not (work / "ckpt" / "cuinterpose.intent").exists()  # the state file replaced it
    assert (work / "ckpt" / "cuinterpose.state").is_file()


def test_rollback_leaves_out_a_process_that_is_gone(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        opts = runner.Options(5.0, rollback_on_failure=False)
        runner.capture(t.endpoints, work / "ckpt", opts)
        t.fakes[-1].stop()
        result = runner.rollback(t.endpoints, work / "ckpt")
        phases = [f.phase for f in t.fakes[:-1]]
    assert phases == [Phase.ACTIVE] * len(phases)
    assert len(result.gone) == 1 and "control socket does not exist" in result.gone[0].reason


# -- transient failures, byte-scaled timeouts, edited state files -------------------------


def test_a_participant_answering_retry_is_sent_the_op_again(work: Path) -> None:
    events: list[Event] = []
    script = {0: {Op.LOAD_ALLOCATIONS: Fault("retry", times=2)}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        capture(t, work / "ckpt")
        runner.restore(t.endpoints, work / "ckpt", options(events))
        loads = [r.count(Op.LOAD_ALLOCATIONS) for r in t.received()]
        assert all(f.phase is Phase.ACTIVE for f in t.fakes)
    # Only the participant that answered RETRY hears LOAD again: the others moved on.
    assert loads == [3, 1, 1]
    assert [type(e) for e in events][-1] is DoneEvent


def test_retry_that_never_clears_fails_the_phase_naming_the_participant(work: Path) -> None:
    script = {1: {Op.LOAD_ALLOCATIONS: Fault("retry")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        capture(t, work / "ckpt")
        opts = attrs.evolve(options(), retry_attempts=3)
        with pytest.raises(StepFailed) as caught:
            runner.restore(t.endpoints, work / "ckpt", opts)
        loads = [r.count(Op.LOAD_ALLOCATIONS) for r in t.received()]
        # RETRY kept the shim's phase: still PREPARED, nothing lost, retryable later.
        assert t.fakes[1].phase is Phase.PREPARED
    assert loads == [1, 3, 1]
    assert (caught.value.step, caught.value.participant) == ("LOAD_ALLOCATIONS", participant(1))
    assert "RETRY in phase PREPARED" in caught.value.reason


def test_byte_phases_get_time_for_their_bytes(work: Path) -> None:
    timeouts: dict[Op, float] = {}

    def recording(calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float):  # type: ignore[no-untyped-def]
        timeouts[calls[0][1].op] = timeout
        return call_all(calls, timeout=timeout)

    rate = 2**20  # one MiB a second: the topology's bytes then count in seconds
    with team_of(TOPOLOGY, work / "control") as t:
        opts = attrs.evolve(options(transport=recording), slowest_transfer_rate=rate)
        runner.capture(t.endpoints, work / "ckpt", opts)
        runner.restore(t.endpoints, work / "ckpt", opts)
    seconds = TOPOLOGY.allocation_bytes / rate
    assert seconds > 1
    for op in (Op.SAVE_ALLOCATIONS, Op.LOAD_ALLOCATIONS):
        assert timeouts[op] == pytest.approx(5.0 + seconds)
    for op in (Op.HANDSHAKE, Op.INSPECT, Op.PREPARE_UNICAST, Op.RESTORE_UNICAST):
        assert timeouts[op] == 5.0


def test_an_edited_state_file_is_refused_before_anything_changes(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        capture(t, work / "ckpt")
        path = work / "ckpt" / STATE_FILE_NAME
        document = json.loads(path.read_text())
        records = document["topology"]["participants"][1]["records"]
        mapping = next(r for r in records if r["kind"] == "MAPPING")
        mapping["address"] += 0x200000  # well-formed, but not what the shim holds
        path.write_text(json.dumps(document))
        with pytest.raises(TopologyRefused) as caught:
            runner.restore(t.endpoints, work / "ckpt", options())
        sent = t.received()
        assert all(f.phase is Phase.PREPARED for f in t.fakes)
    assert sent == [[*CAPTURE_OPS, Op.HANDSHAKE, Op.INSPECT]] * 3
    assert caught.value.guard == "records_match_state"
    assert "the state file does not match the shims" in str(caught.value)
    assert participant(1) in str(caught.value)


def test_a_capture_makes_its_intent_the_state_file(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        result = capture(t, work / "ckpt")
    # Only the state file: the lock file goes with the run that created it.
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == [STATE_FILE_NAME]
    assert read_state(work / "ckpt") == result.state


def test_a_directory_under_the_state_file_name_is_refused_before_teardown(work: Path) -> None:
    (work / "ckpt" / STATE_FILE_NAME).mkdir()
    with team_of(TOPOLOGY, work / "control") as t:
        opts = attrs.evolve(options(), replace=True)
        with pytest.raises(Refused) as caught:
            runner.capture(t.endpoints, work / "ckpt", opts)
        assert_nothing_destroyed(t)
    assert "is not a regular file" in str(caught.value)


@pytest.mark.parametrize(
    ("version", "upgrade"),
    [
        (1, "upgrade the shim preloaded in the workload (or use a cuinterpose matching it)"),
        (3, "upgrade cuinterpose, the coordinator's package on this node"),
    ],
)
def test_a_shim_of_another_protocol_version_is_refused_at_handshake(
    work: Path, version: int, upgrade: str
) -> None:
    # A shim of another version refuses every request of this one (as version 1's
    # does: "bad magic or version", in its own version): the coordinator names both
    # versions and the side to upgrade, and sends nothing past HANDSHAKE.
    with team_of(TOPOLOGY, work / "control", versions={1: version}) as t:
        rolling_back = attrs.evolve(options(), rollback_on_failure=True)
        with pytest.raises(StepFailed) as caught:
            runner.capture(t.endpoints, work / "ckpt", rolling_back)
        assert t.received() == [[Op.HANDSHAKE], [], [Op.HANDSHAKE]]
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}
    error = caught.value
    assert (error.step, error.pid, error.destroyed) == ("HANDSHAKE", 1001, False)
    assert error.reason.startswith(
        f"bad reply: its shim speaks protocol version {version}, "
        f"this coordinator speaks {wire.VERSION}: {upgrade}"
    )
    assert not (work / "ckpt" / "cuinterpose.intent").exists()


def test_a_refused_quiesce_is_left_to_the_lease_not_rolled_back(work: Path) -> None:
    # QUIESCE tears nothing down: the participants that reached QUIESCED go back to
    # ACTIVE when the run's lease ends (RELEASE), so no rollback op is sent.
    events: list[Event] = []
    why = "QUIESCE: pid 1001 did not reach a quiet point within 10000 ms"
    script = {1: {Op.QUIESCE: Fault("fail", Status.REFUSED, why)}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        rolling_back = attrs.evolve(options(events), rollback_on_failure=True)
        with pytest.raises(StepFailed) as caught:
            runner.capture(t.endpoints, work / "ckpt", rolling_back)
        assert t.received() == [CAPTURE_OPS[:2]] * 3
        assert [t.fakes[i].phase for i in (0, 2)] == [Phase.ACTIVE, Phase.ACTIVE]
        assert all(f.releases == 1 for f in t.fakes)
    error = caught.value
    assert (error.step, error.participant, error.destroyed) == ("QUIESCE", participant(1), False)
    assert why in error.reason
    assert not (work / "ckpt" / "cuinterpose.intent").exists()
    assert not (work / "ckpt" / STATE_FILE_NAME).exists()


def test_only_a_quiesce_nobody_got_quiet_for_may_start_over() -> None:
    # The typed reason decides, never the words: the same words without it are
    # another refusal, and the reason with other words is still not quiet.
    quiet = "QUIESCE: pid 7 did not reach a quiet point within 10000 ms"
    words = StepFailed("capture", "QUIESCE", [Problem(f"REFUSED in phase ACTIVE: {quiet}")])
    assert not not_quiet(words)
    refused = StepFailed("capture", "QUIESCE", [Problem("REFUSED: busy", not_quiet=True)])
    assert not_quiet(refused)
    # Anything else is reported at once: another reason, another phase, a change made.
    hangup = Problem("hung up: connection reset", "a" * 32, 8)
    assert not not_quiet(StepFailed("capture", "QUIESCE", [refused.problems[0], hangup]))
    assert not not_quiet(StepFailed("capture", "PREPARE_MULTICAST", refused.problems))
    assert not not_quiet(Interrupted("capture", "QUIESCE", refused.problems))
    refused.destroyed = True
    assert not not_quiet(refused)


def test_an_error_names_the_step_it_stopped_at() -> None:
    # A phase is the shim's (specs/architecture.md): the error names the machine's step,
    # an op or a local step; ``phase`` stays as the former name, for embedders.
    failed = StepFailed("capture", "WRITE_STATE", [Problem("disk full")])
    refused = TopologyRefused("capture", "PREPARE_MULTICAST", "topology_valid", [Problem("no")])
    assert failed.step == "WRITE_STATE"
    assert str(failed) == "capture failed at WRITE_STATE: disk full"
    # A refusal names its check, not the step whose op was never sent.
    assert str(refused) == (
        "capture refused by the consistency check of the shims' sharing records, "
        "nothing changed: no"
    )
    assert refused.step == "PREPARE_MULTICAST"
