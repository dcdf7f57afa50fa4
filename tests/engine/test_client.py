"""The participant client, through real Unix sockets: fakes and hand-written servers."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cuinterpose.engine import client, wire
from cuinterpose.engine.client import (
    BadReply,
    Endpoint,
    ParticipantError,
    ParticipantGone,
    ParticipantHangup,
    ParticipantTimeout,
    ProtocolMismatch,
    call,
    call_all,
    endpoint_for,
)
from cuinterpose.engine.wire import (
    HEADER_SIZE,
    RECORDS_MAX,
    Access,
    Header,
    Op,
    Phase,
    Record,
    RecordFlag,
    RecordKind,
    Reply,
    Request,
    Status,
    socket_name,
)
from cuinterpose.testing import FakeParticipant, Fault

StartFake = Callable[..., FakeParticipant]

RECORDS = tuple(
    Record(
        kind=RecordKind.ALLOCATION,
        flags=RecordFlag.CREATOR | RecordFlag.HANDLE_LIVE,
        id=i.to_bytes(16, "little"),
        creator="ab" * 16,
        size=2 << 20,
        handle_count=1,
        access=(Access(1, 0, 3),),
    )
    for i in range(1, 1001)
)


def handshake(fake: FakeParticipant, timeout: float = 2.0) -> Reply:
    return call(fake.endpoint, Request(Op.HANDSHAKE), timeout=timeout, expect_participant=None)


def bound(fake: FakeParticipant, op: Op) -> tuple[Endpoint, Request, str]:
    return fake.endpoint, Request(op, participant=fake.participant), fake.participant


def ask(fake: FakeParticipant, op: Op, timeout: float = 2.0) -> Reply:
    """``op`` to ``fake``, bound to its participant id as the driver binds it."""
    request = Request(op, participant=fake.participant)
    return call(fake.endpoint, request, timeout=timeout, expect_participant=fake.participant)


# -- endpoints ----------------------------------------------------------------------


def test_endpoint_in_the_control_dir() -> None:
    endpoint = endpoint_for(1234, 7, control_dir=Path("/snapshot-control"))
    assert endpoint == Endpoint(1234, 7, Path("/snapshot-control/cuinterpose-7.sock"))
    assert endpoint.describe() == "pid 1234 (ns pid 7) at /snapshot-control/cuinterpose-7.sock"


def test_endpoint_through_the_proc_root() -> None:
    endpoint = endpoint_for(
        1234, 7, control_dir=Path("/snapshot-control"), proc_root=Path("/host/proc")
    )
    assert endpoint.path == Path("/host/proc/1234/root/snapshot-control/cuinterpose-7.sock")
    assert (endpoint.observed_pid, endpoint.namespace_pid) == (1234, 7)


@pytest.mark.parametrize(("observed", "namespace"), [(0, 7), (7, 0), (-1, 7), (7, -3), (True, 7)])
def test_endpoint_refuses_pids_that_are_not_positive(observed: int, namespace: int) -> None:
    with pytest.raises(ValueError, match="pid must be a positive integer"):
        endpoint_for(observed, namespace, control_dir=Path("/snapshot-control"))


def test_endpoint_refuses_a_relative_control_dir_under_a_proc_root() -> None:
    with pytest.raises(ValueError, match="must be absolute"):
        endpoint_for(1, 1, control_dir=Path("relative"), proc_root=Path("/proc"))


def test_a_proc_root_endpoint_reaches_the_shim(tmp_path: Path) -> None:
    # The layout a coordinator outside the container sees: /proc/<pid>/root/<control-dir>.
    inside = tmp_path / "proc" / "4321" / "root" / "snapshot-control"
    inside.mkdir(parents=True)
    with FakeParticipant(inside / socket_name(9), pid=9) as fake:
        endpoint = endpoint_for(
            4321, 9, control_dir=Path("/snapshot-control"), proc_root=tmp_path / "proc",
            check_peer=False,  # the fake is served by this test's process
        )  # fmt: skip
        reply = call(endpoint, Request(Op.HANDSHAKE), timeout=2, expect_participant=None)
    assert (reply.participant, reply.pid) == (fake.participant, 9)


def test_a_socket_path_longer_than_sun_path_still_works(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / socket_name(5)
    assert len(str(path)) > 108
    with FakeParticipant(path) as fake:
        assert handshake(fake).participant == fake.participant


# -- call: happy paths ------------------------------------------------------------------


def test_handshake_binds_the_participant(start_fake: StartFake) -> None:
    fake = start_fake(pid=77)
    reply = handshake(fake)
    assert reply == Reply(Op.HANDSHAKE, Status.OK, fake.participant, 77, Phase.ACTIVE)


def test_inspect_returns_every_record(start_fake: StartFake) -> None:
    fake = start_fake(records=RECORDS)
    reply = ask(fake, Op.INSPECT, timeout=5)
    assert reply.status is Status.OK
    assert reply.records == RECORDS


def test_a_non_ok_status_is_returned_not_raised(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.QUIESCE: Fault("fail", Status.REFUSED, "no way")})
    wrong_phase = ask(fake, Op.LOAD_ALLOCATIONS, timeout=2)
    assert (wrong_phase.status, wrong_phase.phase) == (Status.WRONG_PHASE, Phase.ACTIVE)
    failed = ask(fake, Op.QUIESCE, timeout=2)
    # A refusal leaves the shim's phase as it was, as a shim's does.
    assert (failed.status, failed.message, failed.phase) == (
        Status.REFUSED,
        "no way",
        Phase.ACTIVE,
    )


def test_a_delay_within_the_timeout_is_waited_for(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.HANDSHAKE: Fault("delay", seconds=0.15)})
    started = time.monotonic()
    assert handshake(fake, timeout=2).status is Status.OK
    assert time.monotonic() - started >= 0.15


# -- call: failures ------------------------------------------------------------------------


def test_a_hanging_participant_times_out_promptly(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("hang")})
    started = time.monotonic()
    with pytest.raises(ParticipantTimeout) as caught:
        ask(fake, Op.INSPECT, timeout=0.2)
    # It waited out its timeout, and gave up on its own: the fake never answers.
    assert time.monotonic() - started >= 0.2
    assert fake.received == [Op.INSPECT]
    error = caught.value
    assert (error.endpoint, error.op, error.participant) == (
        fake.endpoint,
        Op.INSPECT,
        fake.participant,
    )
    assert str(error) == (
        f"participant {fake.participant}, {fake.endpoint.describe()}: "
        "INSPECT: no reply within 0.2 s"
    )


def test_a_delay_beyond_the_timeout_times_out(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.HANDSHAKE: Fault("delay", seconds=5)})
    with pytest.raises(ParticipantTimeout, match=re.escape("HANDSHAKE: no reply within 0.1 s")):
        handshake(fake, timeout=0.1)


def test_a_hangup_is_reported(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("hangup")})
    with pytest.raises(
        ParticipantHangup, match=r"INSPECT: closed the connection after 0 of"
    ) as caught:
        ask(fake, Op.INSPECT, timeout=2)
    # A process that answered and then hung up is there: only a missing socket is gone.
    assert not isinstance(caught.value, ParticipantGone)


def test_a_reply_from_another_participant_is_refused(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("wrong_participant")})
    with pytest.raises(BadReply, match=f"expected {fake.participant}") as caught:
        ask(fake, Op.INSPECT, timeout=2)
    assert caught.value.participant == fake.participant
    assert "reply comes from participant" in caught.value.reason


def test_a_shim_of_another_version_is_a_typed_error_naming_both(start_fake: StartFake) -> None:
    older = start_fake(version=wire.VERSION - 1)
    with pytest.raises(ProtocolMismatch) as caught:
        handshake(older)
    error = caught.value
    assert isinstance(error, BadReply) and error.version == wire.VERSION - 1
    assert error.reason == (
        f"its shim speaks protocol version {wire.VERSION - 1}, this coordinator speaks "
        f"{wire.VERSION}: upgrade the shim preloaded in the workload "
        "(or use a cuinterpose matching it)"
    )
    # It crosses processes whole (the agent's workers pickle errors).
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.version, again.reason) == (
        ProtocolMismatch,
        error.version,
        error.reason,
    )
    # The fake of another version received nothing it would act on.
    assert older.received == [] and older.phase is Phase.ACTIVE


def test_handshake_accepts_any_participant(start_fake: StartFake) -> None:
    # HANDSHAKE establishes the binding: there is nothing to compare yet.
    fake = start_fake(script={Op.HANDSHAKE: Fault("wrong_participant")})
    reply = handshake(fake)
    assert reply.participant != fake.participant


def test_a_reply_for_another_op_is_refused(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.INSPECT: Fault("wrong_op")})
    with pytest.raises(BadReply, match="reply echoes op PREPARE_MULTICAST, expected INSPECT"):
        ask(fake, Op.INSPECT, timeout=2)


def test_garbage_is_refused(start_fake: StartFake) -> None:
    fake = start_fake(script={Op.HANDSHAKE: Fault("garbage")})
    with pytest.raises(BadReply, match="malformed reply: bad magic"):
        handshake(fake)


def test_a_missing_socket_is_a_participant_gone(control_dir: Path) -> None:
    endpoint = endpoint_for(3, 3, control_dir=control_dir)
    with pytest.raises(ParticipantGone, match="control socket does not exist") as caught:
        call(endpoint, Request(Op.HANDSHAKE), timeout=1, expect_participant=None)
    assert caught.value.participant is None
    assert endpoint.describe() in str(caught.value)


def test_a_missing_socket_of_a_live_process_is_retried_for_a_bounded_time(
    control_dir: Path,
) -> None:
    # Our own pid: a live process whose shim would re-create its socket (it has none).
    endpoint = endpoint_for(os.getpid(), os.getpid(), control_dir=control_dir)
    started = time.monotonic()
    with pytest.raises(ParticipantGone, match=r"does not exist \(retried for 1\.\d s\)"):
        call(endpoint, Request(Op.HANDSHAKE), timeout=10, expect_participant=None)
    assert time.monotonic() - started < 5


def test_a_socket_that_comes_back_within_the_window_is_reached(
    start_fake: StartFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = start_fake()
    away = fake.socket_path.with_name("away")
    fake.socket_path.rename(away)  # removed, as a cleanup script would

    def heal(pid: int) -> bool:  # asked once, at the first failed connect: the shim heals
        away.rename(fake.socket_path)
        return True

    monkeypatch.setattr(client, "pid_visible", heal)
    assert handshake(fake).status == Status.OK


def test_a_socket_nobody_listens_on_is_a_participant_gone(control_dir: Path) -> None:
    endpoint = endpoint_for(3, 3, control_dir=control_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(endpoint.path))  # bound, never listening: a dead shim's file
        with pytest.raises(ParticipantGone, match="connection refused"):
            call(endpoint, Request(Op.HANDSHAKE), timeout=1, expect_participant=None)


def test_errors_pickle_with_their_fields(start_fake: StartFake) -> None:
    error = ParticipantTimeout(start_fake().endpoint, Op.INSPECT, "no reply", "ab" * 16)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ParticipantTimeout
    assert (copy.endpoint, copy.op, copy.reason, copy.participant) == (
        error.endpoint,
        error.op,
        error.reason,
        error.participant,
    )


def test_a_negative_timeout_is_refused(start_fake: StartFake) -> None:
    with pytest.raises(ValueError, match="timeout"):
        handshake(start_fake(), timeout=-1)


# -- hand-written servers for what a fake never does ----------------------------------------


@contextlib.contextmanager
def one_shot_server(
    path: Path, answer: bytes, *, then: str = "close", backlog: int = 8
) -> Iterator[threading.Event]:
    """Accept one connection, read the request, send ``answer``, then close or stall."""
    release = threading.Event()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(backlog)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(HEADER_SIZE)
            conn.sendall(answer)
            if then == "stall":
                release.wait(5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield release
    finally:
        release.set()
        thread.join(5)
        listener.close()


def reply_bytes(op: Op = Op.INSPECT, records: int = 2) -> bytes:
    return Reply(
        op, Status.OK, "cd" * 16, 5, Phase.ACTIVE, message="hi", records=RECORDS[:records]
    ).encode()


@pytest.mark.parametrize("cut", [10, HEADER_SIZE, HEADER_SIZE + 2 + 300])
def test_a_reply_cut_short_is_a_hangup(control_dir: Path, cut: int) -> None:
    endpoint = endpoint_for(5, 5, control_dir=control_dir)
    raw = reply_bytes()
    with (
        one_shot_server(endpoint.path, raw[:cut]),
        pytest.raises(ParticipantHangup, match=f"after {cut} of") as caught,
    ):
        call(endpoint, Request(Op.INSPECT, participant="cd" * 16), timeout=2,
                 expect_participant="cd" * 16)  # fmt: skip
    if cut >= HEADER_SIZE:
        assert f"after {cut} of {len(raw)} reply bytes" in caught.value.reason


def test_a_stalled_partial_reply_times_out(control_dir: Path) -> None:
    endpoint = endpoint_for(5, 5, control_dir=control_dir)
    raw = reply_bytes()
    with one_shot_server(endpoint.path, raw[:200], then="stall"):
        started = time.monotonic()
        with pytest.raises(
            ParticipantTimeout,
            match=re.escape(f"incomplete reply within 0.2 s (200 of {len(raw)} bytes)"),
        ):
            call(endpoint, Request(Op.INSPECT, participant="cd" * 16), timeout=0.2,
                 expect_participant=None)  # fmt: skip
        assert time.monotonic() - started >= 0.2


def test_counts_over_the_limits_are_refused_before_reading_on(control_dir: Path) -> None:
    endpoint = endpoint_for(5, 5, control_dir=control_dir)
    header = Header(op=int(Op.INSPECT), participant="cd" * 16, phase=1).encode()
    over = bytearray(header)
    over[12:16] = (RECORDS_MAX + 1).to_bytes(4, "little")
    with (
        one_shot_server(endpoint.path, bytes(over), then="stall"),
        pytest.raises(BadReply, match=f"record count {RECORDS_MAX + 1} exceeds"),
    ):
        call(endpoint, Request(Op.INSPECT, participant="cd" * 16), timeout=2,
                 expect_participant=None)  # fmt: skip


def test_a_malformed_record_is_a_bad_reply(control_dir: Path) -> None:
    endpoint = endpoint_for(5, 5, control_dir=control_dir)
    raw = bytearray(reply_bytes(records=1))
    raw[HEADER_SIZE + 2 : HEADER_SIZE + 4] = (99).to_bytes(2, "little")  # record kind
    with (
        one_shot_server(endpoint.path, bytes(raw)),
        pytest.raises(BadReply, match="unknown record kind 99"),
    ):
        call(endpoint, Request(Op.INSPECT, participant="cd" * 16), timeout=2,
                 expect_participant="cd" * 16)  # fmt: skip


def fill_backlog(path: Path) -> list[socket.socket]:
    """Queue connections on a listener that never accepts until the kernel says EAGAIN."""
    fillers: list[socket.socket] = []
    while len(fillers) < 16:
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.setblocking(False)
        if filler.connect_ex(str(path)) != 0:
            filler.close()
            return fillers
        fillers.append(filler)
    raise AssertionError("the listen backlog never filled up")


def test_a_full_listen_backlog_times_out_connecting(control_dir: Path) -> None:
    endpoint = endpoint_for(5, 5, control_dir=control_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(endpoint.path))
        listener.listen(0)
        fillers = fill_backlog(endpoint.path)
        try:
            with pytest.raises(
                ParticipantTimeout, match=re.escape("could not connect within 0.1 s")
            ):
                call(endpoint, Request(Op.HANDSHAKE), timeout=0.1, expect_participant=None)
        finally:
            for filler in fillers:
                filler.close()


def test_a_full_listen_backlog_is_retried_until_accepted(
    control_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = endpoint_for(5, 5, control_dir=control_dir)
    answer = reply_bytes(Op.HANDSHAKE, records=0)
    # The server starts accepting once the client has met EAGAIN and planned a retry.
    met_eagain = threading.Event()
    start = client._Exchange.start

    def observed_start(exchange: client._Exchange, poller: client._Poller) -> None:
        start(exchange, poller)
        if exchange.retry_at is not None:
            met_eagain.set()

    monkeypatch.setattr(client._Exchange, "start", observed_start)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(endpoint.path))
        listener.listen(0)
        fillers = fill_backlog(endpoint.path)

        def serve_late() -> None:
            met_eagain.wait(30)  # (a client that never meets it fails below)
            listener.settimeout(2)
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(0.05)
                    try:
                        if len(conn.recv(HEADER_SIZE)) == HEADER_SIZE:
                            conn.sendall(answer)
                            return
                    except TimeoutError:
                        continue  # a filler: it never sends

        server = threading.Thread(target=serve_late, daemon=True)
        server.start()
        try:
            reply = call(endpoint, Request(Op.HANDSHAKE), timeout=2, expect_participant=None)
        finally:
            server.join(3)
            for filler in fillers:
                filler.close()
    assert met_eagain.is_set()
    assert reply.status is Status.OK


# -- call_all -----------------------------------------------------------------------------


def test_call_all_dispatches_concurrently(start_fake: StartFake) -> None:
    # Every fake answers only once all eight have received the op: a client
    # that awaited one reply before sending the next request would time out.
    arrival = threading.Barrier(8, timeout=5)
    fakes = [start_fake(arrival=arrival) for _ in range(8)]
    for op in (Op.HANDSHAKE, Op.INSPECT, Op.QUIESCE, Op.PREPARE_MULTICAST):
        calls = [
            (f.endpoint, Request(op), None) if op is Op.HANDSHAKE else bound(f, op) for f in fakes
        ]
        results = call_all(calls, timeout=3)
        assert all(isinstance(r, Reply) and r.status is Status.OK for r in results), results
        assert [r.participant for r in results if isinstance(r, Reply)] == [
            f.participant for f in fakes
        ]
    assert all(f.phase is Phase.MULTICAST_DETACHED for f in fakes)


def test_the_arrival_barrier_defeats_a_sequential_client(start_fake: StartFake) -> None:
    # The counterpart of the test above: one call at a time cannot pass.
    arrival = threading.Barrier(2)
    first, _ = start_fake(arrival=arrival), start_fake(arrival=arrival)
    with pytest.raises(ParticipantTimeout):
        handshake(first, timeout=0.2)


def test_call_all_collects_every_outcome_in_order(start_fake: StartFake, control_dir: Path) -> None:
    ok = start_fake(records=RECORDS[:3])
    hang = start_fake(script={Op.INSPECT: Fault("hang")})
    hangup = start_fake(script={Op.INSPECT: Fault("hangup")})
    garbage = start_fake(script={Op.INSPECT: Fault("garbage")})
    failing = start_fake(script={Op.INSPECT: Fault("fail", Status.INTERNAL, "boom")})
    stranger = start_fake(script={Op.INSPECT: Fault("wrong_participant")})
    missing = endpoint_for(999, 999, control_dir=control_dir)
    calls = [bound(f, Op.INSPECT) for f in (ok, hang, hangup, garbage, failing, stranger)]
    calls.append((missing, Request(Op.INSPECT, participant="ef" * 16), "ef" * 16))
    calls.append(bound(ok, Op.INSPECT))

    results = call_all(calls, timeout=0.3)

    kinds = [type(r) for r in results]
    assert kinds == [
        Reply,
        ParticipantTimeout,
        ParticipantHangup,
        BadReply,
        Reply,
        BadReply,
        ParticipantGone,
        Reply,
    ]
    first, failed, last = results[0], results[4], results[7]
    assert isinstance(first, Reply) and first.records == RECORDS[:3]
    assert isinstance(failed, Reply) and (failed.status, failed.message) == (
        Status.INTERNAL,
        "boom",
    )
    assert last == first
    errors = [r for r in results if isinstance(r, ParticipantError)]
    assert [e.endpoint for e in errors] == [hang.endpoint, hangup.endpoint, garbage.endpoint,
                                           stranger.endpoint, missing]  # fmt: skip


def test_call_all_shares_one_deadline(control_dir: Path) -> None:
    # Participants that read the request and never answer. With one deadline every
    # request is in flight before the first is given up on; one timeout after another
    # would give each up before sending the next.
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def serve(listener: socket.socket, k: int) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(HEADER_SIZE)
            with lock:
                events.append(("received", k))
            while conn.recv(4096):  # until the client hangs up
                pass
            with lock:
                events.append(("dropped", k))

    calls = []
    with contextlib.ExitStack() as stack:
        servers = []
        for k in range(4):
            endpoint = endpoint_for(20 + k, 20 + k, control_dir=control_dir)
            listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            listener.bind(str(endpoint.path))
            listener.listen(1)
            listener.settimeout(30)  # (a client that never connects fails below)
            servers.append(threading.Thread(target=serve, args=(listener, k), daemon=True))
            calls.append((endpoint, Request(Op.INSPECT, participant="cd" * 16), "cd" * 16))
        for server in servers:
            server.start()
        results = call_all(calls, timeout=0.2)
        for server in servers:
            server.join(30)
    assert all(isinstance(r, ParticipantTimeout) for r in results), results
    assert sorted(events[:4]) == [("received", k) for k in range(4)], events
    assert sorted(events[4:]) == [("dropped", k) for k in range(4)], events


def test_call_all_of_nothing(start_fake: StartFake) -> None:
    assert call_all([], timeout=1) == []


def test_call_all_leaves_no_descriptor_open(start_fake: StartFake, control_dir: Path) -> None:
    fakes = [start_fake(records=RECORDS[:10]) for _ in range(4)]
    garbage = start_fake(script={Op.INSPECT: Fault("garbage")})
    calls = [bound(f, Op.INSPECT) for f in [*fakes, garbage]]
    calls.append((endpoint_for(998, 998, control_dir=control_dir), Request(Op.HANDSHAKE), None))
    before = open_descriptors()  # the fakes hold theirs from start() on
    for _ in range(5):
        call_all(calls, timeout=0.5)
    # The fakes live in this process and close their side a moment after
    # replying: wait for that, but a leak would never settle.
    deadline = time.monotonic() + 2
    while open_descriptors() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert open_descriptors() == before


def open_descriptors() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))
