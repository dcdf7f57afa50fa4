"""The fake participant: a shim's phase table, validation and faults, over real sockets."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cuinterpose.engine import wire
from cuinterpose.engine.client import call
from cuinterpose.engine.wire import (
    HEADER_SIZE,
    RECORDS_MAX,
    Header,
    Op,
    Phase,
    Record,
    RecordFlag,
    RecordKind,
    Reply,
    Request,
    ResourceKind,
    Stats,
    Status,
    WireError,
    socket_name,
)
from cuinterpose.phases import OP
from cuinterpose.testing import (
    FakeParticipant,
    FakeParticipantError,
    Fault,
    allowed_phases,
    is_phase_op,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.waiting import wait_until

StartFake = Callable[..., FakeParticipant]

CAPTURE = [Op.QUIESCE, Op.PREPARE_MULTICAST, Op.SAVE_ALLOCATIONS, Op.PREPARE_UNICAST]
RESTORE = [
    Op.LOAD_ALLOCATIONS,
    Op.RESTORE_UNICAST,
    Op.RESTORE_MULTICAST_CREATORS,
    Op.RESTORE_MULTICAST_IMPORTERS,
    Op.RESTORE_MULTICAST_DEVICES,
    Op.RESTORE_MULTICAST_BINDINGS,
]
CAPTURED = (Record(kind=RecordKind.MAPPING, id=b"\x01" * 16, address=1 << 20, size=4096),)
RESTORED = (Record(kind=RecordKind.MAPPING, id=b"\x01" * 16, address=2 << 20, size=4096),)


def ask(fake: FakeParticipant, op: Op, *, participant: str | None = None) -> Reply:
    """``op`` as the coordinator sends it (HANDSHAKE names no participant)."""
    if op is Op.HANDSHAKE:
        return call(fake.endpoint, Request(op), timeout=2, expect_participant=None)
    who = fake.participant if participant is None else participant
    fd = os.open(os.devnull, os.O_RDONLY) if op in wire.FILE_OPS else None
    try:
        request = Request(op, participant=who, fds=() if fd is None else (fd,))
        return call(fake.endpoint, request, timeout=2, expect_participant=None)
    finally:
        if fd is not None:
            os.close(fd)


def exchange(path: Path, payload: bytes) -> bytes:
    """Send raw bytes and end the request there, then read until the fake closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect(str(path))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # a short payload is all there will be
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def refusal(raw: bytes) -> tuple[Header, str]:
    """A refusal's header and message: its op is echoed as sent, maybe not a valid Op."""
    header = Header.decode(raw[:HEADER_SIZE])
    assert len(raw) == HEADER_SIZE + header.message_length and header.count == 0
    return header, raw[HEADER_SIZE:].decode("utf-8")


# -- the phase table ------------------------------------------------------------------


def test_capture_then_restore_walks_the_phase_table(start_fake: StartFake) -> None:
    save, load = Stats(2, 8 << 20, 5_000, 3_000), Stats(2, 8 << 20, 7_000, 4_000)
    fake = start_fake(
        records=CAPTURED,
        restored_records=RESTORED,
        stats={Op.SAVE_ALLOCATIONS: save, Op.LOAD_ALLOCATIONS: load},
    )
    assert ask(fake, Op.INSPECT).records == CAPTURED
    expected = [
        Phase.QUIESCED,
        Phase.MULTICAST_DETACHED,
        Phase.ALLOCATIONS_SAVED,
        Phase.PREPARED,
        Phase.ALLOCATIONS_LOADED,
        Phase.UNICAST_RESTORED,
        Phase.MULTICAST_CREATED,
        Phase.MULTICAST_IMPORTED,
        Phase.MULTICAST_JOINED,
        Phase.ACTIVE,
    ]
    for op, phase in zip(CAPTURE + RESTORE, expected, strict=True):
        reply = ask(fake, op)
        assert (reply.op, reply.status, reply.phase) == (op, Status.OK, phase)
        assert fake.phase is phase
        assert reply.stats == {Op.SAVE_ALLOCATIONS: save, Op.LOAD_ALLOCATIONS: load}.get(
            op, Stats()
        )
    # After a restore INSPECT answers the restored topology.
    assert ask(fake, Op.INSPECT).records == RESTORED
    assert fake.received == [Op.INSPECT, *CAPTURE, *RESTORE, Op.INSPECT]


def test_the_phase_table_is_the_protocols() -> None:
    # The fake serves each op where the op table (phases/ops.py, pinned to
    # protocol.h) says, and moves its phase on exactly the phase ops.
    for op in Op:
        assert allowed_phases(op) == {Phase[name] for name in OP[op.name].served_in}, op
    assert [op for op in Op if is_phase_op(op)] == CAPTURE[1:] + RESTORE + [
        Op.ROLLBACK_ALLOCATIONS,
        Op.ROLLBACK_IMPORTS,
        Op.QUIESCE,
    ]


@pytest.mark.parametrize("stop_after", range(len(CAPTURE) + 1))
def test_rollback_returns_from_any_point_of_a_capture(
    start_fake: StartFake, stop_after: int
) -> None:
    fake = start_fake(records=CAPTURED)
    for op in CAPTURE[:stop_after]:
        assert ask(fake, op).status is Status.OK
    assert ask(fake, Op.ROLLBACK_IMPORTS).status is Status.WRONG_PHASE
    assert ask(fake, Op.ROLLBACK_ALLOCATIONS).phase is Phase.ROLLBACK_LOADED
    assert ask(fake, Op.ROLLBACK_ALLOCATIONS).phase is Phase.ROLLBACK_LOADED  # idempotent
    assert ask(fake, Op.ROLLBACK_IMPORTS).phase is Phase.ACTIVE
    assert ask(fake, Op.INSPECT).records == CAPTURED


@pytest.mark.parametrize("phase", list(Phase))
def test_every_op_outside_its_phase_is_wrong_phase_and_changes_nothing(
    start_fake: StartFake, phase: Phase
) -> None:
    fake = start_fake(phase=phase)
    for op in Op:
        if phase in allowed_phases(op):
            continue
        reply = ask(fake, op)
        assert (reply.status, reply.phase) == (Status.WRONG_PHASE, phase), op
        assert f"{op.name} is not allowed in phase {phase.name}" == reply.message
    assert fake.phase is phase


def test_export_finds_nothing_in_a_fake(start_fake: StartFake) -> None:
    fake = start_fake()
    request = Request(
        Op.EXPORT,
        participant=fake.participant,
        resource_id=b"\x07" * 16,
        authorization=b"\x08" * 16,
        resource_kind=ResourceKind.UNICAST,
    )
    reply = call(fake.endpoint, request, timeout=2, expect_participant=fake.participant)
    assert (reply.status, reply.phase) == (Status.NOT_FOUND, Phase.ACTIVE)


# -- failures and FAILED ----------------------------------------------------------------------


def test_a_failing_destructive_op_leaves_the_fake_failed(start_fake: StartFake) -> None:
    fault = Fault("fail", Status.CUDA_FAILED, "cuMemcpyDtoH: CUDA_ERROR_ILLEGAL_ADDRESS")
    fake = start_fake(script={Op.SAVE_ALLOCATIONS: fault})
    assert ask(fake, Op.QUIESCE).status is Status.OK
    assert ask(fake, Op.PREPARE_MULTICAST).status is Status.OK
    failed = ask(fake, Op.SAVE_ALLOCATIONS)
    assert (failed.status, failed.message, failed.phase) == (
        Status.CUDA_FAILED,
        fault.message,
        Phase.FAILED,
    )
    assert ask(fake, Op.PREPARE_UNICAST).status is Status.WRONG_PHASE
    assert ask(fake, Op.INSPECT).status is Status.WRONG_PHASE
    hello = ask(fake, Op.HANDSHAKE)
    assert (hello.status, hello.phase) == (Status.OK, Phase.FAILED)
    assert hello.message == f"SAVE_ALLOCATIONS failed: {fault.message}"


def test_a_failing_inspect_changes_no_phase(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("fail", Status.INTERNAL, "table corrupt")})
    reply = ask(fake, Op.INSPECT)
    assert (reply.status, reply.message, reply.phase) == (
        Status.INTERNAL,
        "table corrupt",
        Phase.ACTIVE,
    )
    assert ask(fake, Op.HANDSHAKE).message == ""


def test_a_scripted_failure_still_respects_the_phase(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.LOAD_ALLOCATIONS: Fault("fail")})
    assert ask(fake, Op.LOAD_ALLOCATIONS).status is Status.WRONG_PHASE
    assert fake.phase is Phase.ACTIVE


@pytest.mark.parametrize("op", [op for op in Op if op not in (Op.HANDSHAKE, Op.RELEASE)])
def test_requests_for_another_participant_are_refused(start_fake: StartFake, op: Op) -> None:
    fake = start_fake()
    other = "0" * 31 + "1"
    if op is Op.EXPORT:
        request = Request(op, participant=other, resource_kind=ResourceKind.UNICAST)
        reply = call(fake.endpoint, request, timeout=2, expect_participant=None)
    else:
        reply = ask(fake, op, participant=other)
    assert (reply.status, reply.participant) == (Status.WRONG_PARTICIPANT, fake.participant)
    assert other in reply.message
    assert fake.phase is Phase.ACTIVE


def test_wrong_participant_wins_over_a_scripted_fault(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("hangup")})
    assert ask(fake, Op.INSPECT, participant="f" * 32).status is Status.WRONG_PARTICIPANT


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff" * HEADER_SIZE, "bad magic"),
        (Header(op=99).encode(), "unknown op 99"),
        (Header(op=int(Op.INSPECT), status=3).encode(), "reply-only"),
        (Header(op=int(Op.HANDSHAKE), participant="ab" * 16).encode(), "must not name"),
    ],
)
def test_malformed_requests_get_bad_request(
    start_fake: StartFake, payload: bytes, reason: str
) -> None:
    fake = start_fake()
    header, message = refusal(exchange(fake.socket_path, payload))
    assert header.status == Status.BAD_REQUEST
    assert reason in message
    assert (header.participant, header.pid, header.phase) == (fake.participant, fake.pid, 1)
    assert fake.received == []  # only well-formed requests count as received


def test_bad_request_echoes_an_unknown_op_as_sent(start_fake: StartFake) -> None:
    fake = start_fake()
    header, _ = refusal(exchange(fake.socket_path, Header(op=99).encode()))
    assert (header.op, header.status) == (99, Status.BAD_REQUEST)


def test_the_fake_survives_any_bytes(start_fake: StartFake) -> None:
    fake = start_fake()

    @settings(max_examples=60, deadline=None)
    @given(payload=st.binary(min_size=0, max_size=2 * HEADER_SIZE))
    def survives(payload: bytes) -> None:
        answer = exchange(fake.socket_path, payload)
        if len(payload) >= HEADER_SIZE:
            assert refusal(answer)[0].participant == fake.participant
        else:
            assert answer == b""  # a request cut short is dropped: nothing to answer
        assert ask(fake, Op.HANDSHAKE).status is Status.OK

    survives()


def test_clients_that_go_silent_or_vanish_do_not_stop_the_fake(start_fake: StartFake) -> None:
    fake = start_fake()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(fake.socket_path))
    silent.send(b"CUIP")  # and never the rest
    for _ in range(5):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.connect(str(fake.socket_path))
    assert ask(fake, Op.HANDSHAKE).status is Status.OK
    silent.close()


# -- faults --------------------------------------------------------------------------------


def test_a_hanging_op_does_not_block_other_connections(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("hang")})
    hanging = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hanging.connect(str(fake.socket_path))
    hanging.sendall(Request(Op.INSPECT, participant=fake.participant).encode())
    wait_until(lambda: fake.received == [Op.INSPECT], "the fake received the hanging INSPECT")
    # Answered (within ask's own timeout) while the INSPECT hangs.
    assert ask(fake, Op.HANDSHAKE).status is Status.OK
    assert fake.received == [Op.INSPECT, Op.HANDSHAKE]
    hanging.settimeout(0.1)
    with pytest.raises(TimeoutError):
        hanging.recv(1)
    hanging.close()


def test_a_delay_delays(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("delay", seconds=0.2)})
    started = time.monotonic()
    assert ask(fake, Op.INSPECT).status is Status.OK
    assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize(
    ("fault", "check"),
    [
        (Fault("hangup"), lambda raw, fake: raw == b""),
        (Fault("garbage"), lambda raw, fake: len(raw) >= HEADER_SIZE and raw[:4] != b"CUIP"),
        (
            Fault("wrong_participant"),
            lambda raw, fake: Reply.decode(raw).participant != fake.participant,
        ),
        (Fault("wrong_op"), lambda raw, fake: Reply.decode(raw).op is Op.PREPARE_MULTICAST),
    ],
)
def test_reply_faults_as_seen_on_the_wire(
    start_fake: StartFake, fault: Fault, check: Callable[[bytes, FakeParticipant], bool]
) -> None:
    fake = start_fake(script={Op.INSPECT: fault})
    raw = exchange(fake.socket_path, Request(Op.INSPECT, participant=fake.participant).encode())
    assert check(raw, fake)
    assert fake.received == [Op.INSPECT]


def test_wrong_op_and_participant_faults_still_do_the_work(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.PREPARE_MULTICAST: Fault("wrong_op")})
    assert ask(fake, Op.QUIESCE).status is Status.OK
    raw = exchange(
        fake.socket_path, Request(Op.PREPARE_MULTICAST, participant=fake.participant).encode()
    )
    assert Reply.decode(raw).op is Op.SAVE_ALLOCATIONS
    assert fake.phase is Phase.MULTICAST_DETACHED


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "explode"}, "not one of"),
        ({"kind": "fail", "status": Status.OK}, "non-OK status"),
        ({"kind": "delay", "seconds": -1.0}, ">= 0"),
    ],
)
def test_faults_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fault(**kwargs)  # type: ignore[arg-type]


# -- identity and lifecycle ------------------------------------------------------------------


def test_identity_defaults(control_dir: Path) -> None:
    fake = FakeParticipant(control_dir / socket_name(4242))
    assert fake.pid == 4242  # from the socket name, so endpoint and fake agree
    assert len(fake.participant) == 32 and set(fake.participant) <= set("0123456789abcdef")
    other = FakeParticipant(control_dir / "elsewhere.sock")
    assert other.pid > 0 and other.participant != fake.participant
    assert fake.endpoint.path == fake.socket_path


def test_a_bad_participant_id_is_refused_up_front(control_dir: Path) -> None:
    with pytest.raises(WireError, match="32 lowercase hex"):
        FakeParticipant(control_dir / "x.sock", participant="NOT-HEX")


def test_socket_is_private_and_removed_on_stop(control_dir: Path) -> None:
    threads = threading.active_count()
    path = control_dir / socket_name(8)
    with FakeParticipant(path) as fake:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert ask(fake, Op.HANDSHAKE).status is Status.OK
    assert not path.exists()
    assert threading.active_count() == threads
    fake.stop()  # idempotent


def test_an_existing_file_is_not_replaced(control_dir: Path) -> None:
    path = control_dir / socket_name(8)
    path.write_text("not a socket")
    with pytest.raises(FileExistsError):
        FakeParticipant(path).start()
    assert path.read_text() == "not a socket"


def test_a_fake_starts_once(control_dir: Path) -> None:
    fake = FakeParticipant(control_dir / socket_name(8)).start()
    try:
        with pytest.raises(FakeParticipantError, match="only once"):
            fake.start()
    finally:
        fake.stop()
    with pytest.raises(FakeParticipantError, match="only once"):
        fake.start()


def test_stop_ends_hanging_and_waiting_requests_promptly(control_dir: Path) -> None:
    threads = threading.active_count()
    arrival = threading.Barrier(2)  # no timeout: only stop() can end the wait
    waiting = FakeParticipant(control_dir / socket_name(1), arrival=arrival).start()
    hanging = FakeParticipant(control_dir / socket_name(2), script={Op.INSPECT: Fault("hang")})
    hanging.start()
    clients = []
    for fake, request in [
        (waiting, Request(Op.HANDSHAKE)),
        (hanging, Request(Op.INSPECT, participant=hanging.participant)),
    ]:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(fake.socket_path))
        client.sendall(request.encode())
        clients.append(client)
    wait_until(lambda: waiting.received and hanging.received, "both fakes received")
    # Neither request would ever end by itself: stop() returning at all ends both.
    waiting.stop()
    hanging.stop()
    assert threading.active_count() == threads
    for client in clients:
        client.settimeout(1)
        assert client.recv(1) == b""  # closed without an answer
        client.close()


def test_received_is_a_snapshot(start_fake: StartFake) -> None:
    fake = start_fake()
    snapshot = fake.received
    ask(fake, Op.HANDSHAKE)
    assert snapshot == [] and fake.received == [Op.HANDSHAKE]


def test_many_fakes_with_many_records_answer_quickly(
    start_fake: StartFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = tuple(
        Record(
            kind=RecordKind.ALLOCATION,
            flags=RecordFlag.CREATOR,
            id=i.to_bytes(16, "big"),
            creator="ab" * 16,
            size=1 << 21,
        )
        for i in range(1, 1001)
    )
    fakes = [start_fake(records=records) for _ in range(8)]
    # The fake answers from bytes encoded once, at construction: it never encodes a
    # record again per request (seconds, not milliseconds, for 8000 records).
    encoded: list[Record] = []
    encode = Record.encode

    def counting(record: Record) -> bytes:
        encoded.append(record)
        return encode(record)

    monkeypatch.setattr(Record, "encode", counting)
    for fake in fakes:
        assert ask(fake, Op.INSPECT).records == records
    assert encoded == []


def test_restored_records_default_to_the_captured_ones(start_fake: StartFake) -> None:
    fake = start_fake(phase=Phase.MULTICAST_JOINED, records=CAPTURED)
    assert ask(fake, Op.RESTORE_MULTICAST_BINDINGS).phase is Phase.ACTIVE
    assert ask(fake, Op.INSPECT).records == CAPTURED


def test_more_records_than_the_protocol_allows_are_refused(control_dir: Path) -> None:
    with pytest.raises(ValueError, match=f"{RECORDS_MAX + 1} records exceed"):
        FakeParticipant(control_dir / "x.sock", records=CAPTURED * (RECORDS_MAX + 1))
    with pytest.raises(ValueError, match="restored_records exceed"):
        FakeParticipant(control_dir / "x.sock", restored_records=CAPTURED * (RECORDS_MAX + 1))


def test_a_bug_in_the_fake_costs_one_connection_and_fails_stop(
    control_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeParticipant(control_dir / socket_name(3)).start()

    def broken(request: Request, fault: Fault | None) -> bytes:
        raise RuntimeError("bug in the fake")

    monkeypatch.setattr(fake, "_answer", broken)
    raw = exchange(fake.socket_path, Request(Op.HANDSHAKE).encode())
    assert raw == b""  # that connection is dropped, the fake keeps serving
    monkeypatch.undo()
    assert ask(fake, Op.HANDSHAKE).status is Status.OK
    with pytest.raises(FakeParticipantError, match="bug in the fake"):
        fake.stop()
