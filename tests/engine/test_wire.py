"""Codec properties: round-trips of records, replies and requests, and refusals."""

from __future__ import annotations

import struct

import attrs
import pytest
from cuinterpose.engine import client, wire
from cuinterpose.engine.wire import (
    HEADER_SIZE,
    MESSAGE_MAX,
    RECORD_SIZE,
    RECORDS_MAX,
    Access,
    BindingKind,
    Header,
    Op,
    Phase,
    Record,
    RecordFlag,
    RecordKind,
    Reply,
    ReplyFlag,
    Request,
    ResourceKind,
    Stats,
    Status,
    VersionMismatch,
    WireError,
    decode_request,
)
from hypothesis import given, settings
from hypothesis import strategies as st

U8 = st.integers(0, 2**8 - 1)
U16 = st.integers(0, 2**16 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
PARTICIPANTS = st.text("0123456789abcdef", min_size=32, max_size=32)
IDS = st.binary(min_size=16, max_size=16)

ACCESSES = st.builds(Access, location_type=I32, location_id=I32, flags=U64)
RECORDS = st.builds(
    Record,
    kind=st.sampled_from(RecordKind),
    flags=st.integers(0, 7).map(RecordFlag),
    id=IDS,
    member_id=IDS,
    creator=st.just("") | PARTICIPANTS,
    address=U64,
    size=U64,
    offset=U64,
    member_offset=U64,
    op_flags=U64,
    handle_types=U64,
    object_flags=U64,
    allocation_type=I32,
    location_type=I32,
    location_id=I32,
    device=I32,
    num_devices=U32,
    binding_kind=st.sampled_from(BindingKind),
    api_version=U8,
    handle_count=U32,
    access=st.lists(ACCESSES, max_size=wire.ACCESS_MAX).map(tuple),
)
STATS = st.builds(Stats, count=U64, bytes=U64, elapsed_ns=U64, copy_ns=U64)
MESSAGES = st.text(max_size=300).filter(lambda t: len(t.encode("utf-8")) <= MESSAGE_MAX)
REPLIES = st.builds(
    Reply,
    op=st.sampled_from(Op),
    status=st.sampled_from(Status),
    participant=PARTICIPANTS,
    pid=U32,
    phase=st.sampled_from(Phase),
    message=MESSAGES,
    stats=STATS,
    records=st.lists(RECORDS, max_size=4).map(tuple),
)
FILE_OPS = (Op.STORE_STAGED, Op.FETCH_STAGED)
PLAIN_REQUESTS = st.builds(
    Request,
    op=st.sampled_from(
        [op for op in Op if op not in (Op.HANDSHAKE, Op.EXPORT, Op.RELEASE, *FILE_OPS)]
    ),
    participant=PARTICIPANTS,
    authorization=IDS,
)
# The descriptor travels beside the bytes (SCM_RIGHTS): not encoded, not compared.
FILE_REQUESTS = st.builds(
    Request,
    op=st.sampled_from(FILE_OPS),
    participant=PARTICIPANTS,
    authorization=IDS,
    fds=st.lists(st.integers(0, 2**20), min_size=1, max_size=wire.STORED_MAX_PARTS).map(tuple),
)
LEASE_REQUESTS = st.builds(
    Request, op=st.sampled_from([Op.HANDSHAKE, Op.RELEASE]), authorization=IDS.filter(any)
)
EXPORT_REQUESTS = st.builds(
    Request,
    op=st.just(Op.EXPORT),
    participant=PARTICIPANTS,
    resource_id=IDS,
    authorization=IDS,
    resource_kind=st.sampled_from(ResourceKind),
    fetcher=PARTICIPANTS,
    export_size=st.integers(0, 2**64 - 1),
    withdraw=st.booleans(),
)
REQUESTS = (
    st.just(Request(Op.HANDSHAKE))
    | PLAIN_REQUESTS
    | LEASE_REQUESTS
    | EXPORT_REQUESTS
    | FILE_REQUESTS
)

OK_REPLY = Reply(
    op=Op.INSPECT,
    status=Status.OK,
    participant="ab" * 16,
    pid=7,
    phase=Phase.ACTIVE,
    message="hello",
    records=(Record(kind=RecordKind.MAPPING, id=b"\x01" * 16, size=4096),),
)


def patched(raw: bytes, fmt: str, offset: int, *values: int) -> bytes:
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


# -- round trips ------------------------------------------------------------------


def test_only_the_file_ops_carry_a_descriptor_and_always() -> None:
    with pytest.raises(WireError, match="STORE_STAGED request lacks the file descriptor"):
        nowhere = client.Endpoint(1, 1, "/nonexistent/cuinterpose-1.sock")
        client.call_all(
            [(nowhere, Request(Op.STORE_STAGED, participant="ab" * 16), None)], timeout=1
        )
    with pytest.raises(WireError, match="LOAD_ALLOCATIONS request carries a file descriptor"):
        Request(Op.LOAD_ALLOCATIONS, participant="ab" * 16, fds=(3,)).encode()
    with pytest.raises(WireError, match="carries 65 file descriptors, more than 64"):
        Request(Op.STORE_STAGED, participant="ab" * 16, fds=tuple(range(65))).encode()
    parts = Request(Op.FETCH_STAGED, participant="ab" * 16, fds=tuple(range(3, 3 + 64)))
    assert len(parts.encode()) == HEADER_SIZE


@given(RECORDS)
def test_record_round_trip(record: Record) -> None:
    raw = record.encode()
    assert len(raw) == RECORD_SIZE
    assert Record.decode(raw) == record


@settings(max_examples=50)
@given(REPLIES)
def test_reply_round_trip(reply: Reply) -> None:
    raw = reply.encode()
    assert len(raw) == HEADER_SIZE + len(reply.message.encode()) + RECORD_SIZE * len(reply.records)
    assert Reply.decode(raw) == reply


@given(REQUESTS)
def test_request_round_trip(request: Request) -> None:
    raw = request.encode()
    assert len(raw) == HEADER_SIZE + (wire.PARTICIPANT_LEN if request.op is Op.EXPORT else 0)
    decoded, header = decode_request(raw)
    assert decoded == request
    assert header.op == request.op and header.participant == request.participant


@given(RECORDS)
def test_unused_record_fields_encode_as_zero(record: Record) -> None:
    raw = record.encode()
    (reserved0,) = struct.unpack_from("<H", raw, 150)
    (reserved1,) = struct.unpack_from("<I", raw, 156)
    assert reserved0 == reserved1 == 0
    unused = raw[160 + 16 * len(record.access) :]
    assert unused == bytes(len(unused))


# -- refusals: header -----------------------------------------------------------------


@given(U32.filter(lambda m: m != wire.MAGIC))
def test_bad_magic_is_refused(magic: int) -> None:
    raw = patched(OK_REPLY.encode(), "<I", 0, magic)
    with pytest.raises(WireError, match="bad magic"):
        Reply.decode(raw)
    with pytest.raises(WireError, match="bad magic"):
        decode_request(patched(Request(Op.HANDSHAKE).encode(), "<I", 0, magic))


@given(U16.filter(lambda v: v != wire.VERSION))
def test_other_versions_are_refused(version: int) -> None:
    with pytest.raises(WireError, match=f"unsupported protocol version {version}"):
        Reply.decode(patched(OK_REPLY.encode(), "<H", 4, version))
    with pytest.raises(WireError, match="unsupported protocol version"):
        decode_request(patched(Request(Op.HANDSHAKE).encode(), "<H", 4, version))


@given(U16.filter(lambda v: v not in set(Op)))
def test_unknown_ops_are_refused(op: int) -> None:
    with pytest.raises(WireError, match=f"unknown op {op}"):
        Reply.decode(patched(OK_REPLY.encode(), "<H", 6, op))
    with pytest.raises(WireError, match=f"unknown op {op}"):
        decode_request(patched(Request(Op.HANDSHAKE).encode(), "<H", 6, op))


@given(I32.filter(lambda v: v not in set(Status)))
def test_unknown_statuses_are_refused(status: int) -> None:
    with pytest.raises(WireError, match=f"unknown status {status}"):
        Reply.decode(patched(OK_REPLY.encode(), "<i", 8, status))


@given(U16.filter(lambda v: v not in set(Phase)))
def test_unknown_phases_are_refused(phase: int) -> None:
    with pytest.raises(WireError, match=f"unknown phase {phase}"):
        Reply.decode(patched(OK_REPLY.encode(), "<H", 92, phase))


@given(st.integers(2, 2**16 - 1))
def test_unknown_reply_flags_are_refused(value: int) -> None:
    with pytest.raises(WireError, match="unknown flags"):
        Reply.decode(patched(OK_REPLY.encode(), "<H", 94, value))


@given(st.integers(1, 2**16 - 1))
def test_a_request_carries_no_flags(value: int) -> None:
    with pytest.raises(WireError, match=r"reply-only fields set|unknown flags"):
        decode_request(patched(Request(Op.HANDSHAKE).encode(), "<H", 94, value))


def test_the_not_quiet_flag_is_the_replys_typed_reason() -> None:
    # protocol.h CUIP_REPLY_NOT_QUIET, at offset 94; the message plays no part.
    refused = attrs.evolve(
        OK_REPLY, op=Op.QUIESCE, status=Status.REFUSED, message="", flags=ReplyFlag.NOT_QUIET
    )
    raw = refused.encode()
    assert struct.unpack_from("<H", raw, 94) == (1,)
    assert Reply.decode(raw).not_quiet and Reply.decode(raw) == refused
    assert not OK_REPLY.not_quiet and not Reply.decode(OK_REPLY.encode()).not_quiet


@given(U16.filter(lambda v: v != wire.VERSION))
def test_another_version_is_named_with_its_number(version: int) -> None:
    with pytest.raises(VersionMismatch) as caught:
        Reply.decode(patched(OK_REPLY.encode(), "<H", 4, version))
    assert caught.value.version == version


@given(st.integers(RECORDS_MAX + 1, 2**32 - 1))
def test_record_count_over_the_limit_is_refused(count: int) -> None:
    with pytest.raises(WireError, match=f"record count {count} exceeds {RECORDS_MAX}"):
        Reply.decode(patched(OK_REPLY.encode(), "<I", 12, count))


@given(st.integers(MESSAGE_MAX + 1, 2**32 - 1))
def test_message_length_over_the_limit_is_refused(length: int) -> None:
    with pytest.raises(WireError, match=f"message_length {length} exceeds {MESSAGE_MAX}"):
        Reply.decode(patched(OK_REPLY.encode(), "<I", 84, length))


@settings(max_examples=50)
@given(REPLIES, st.data())
def test_truncated_replies_are_refused(reply: Reply, data: st.DataObject) -> None:
    raw = reply.encode()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(WireError):
        Reply.decode(raw[:cut])


@settings(max_examples=50)
@given(REPLIES, st.binary(min_size=1, max_size=300))
def test_trailing_bytes_are_refused(reply: Reply, extra: bytes) -> None:
    with pytest.raises(WireError, match="records are"):
        Reply.decode(reply.encode() + extra)


@given(st.integers(0, HEADER_SIZE - 1))
def test_truncated_requests_are_refused(cut: int) -> None:
    with pytest.raises(WireError, match=f"header must be {HEADER_SIZE} bytes, got {cut}"):
        decode_request(Request(Op.HANDSHAKE).encode()[:cut])


@pytest.mark.parametrize(
    "participant", [b"AB" * 16, b"zz" * 16, b"ab" * 15 + b"\0\0", b"\xff" * 32, b" " * 32]
)
def test_participants_that_are_not_lowercase_hex_are_refused(participant: bytes) -> None:
    with pytest.raises(WireError, match="participant"):
        Reply.decode(patched(OK_REPLY.encode(), "<32s", 16, participant))


def test_reply_without_participant_is_refused() -> None:
    with pytest.raises(WireError, match="no participant"):
        Reply.decode(patched(OK_REPLY.encode(), "<32s", 16, bytes(32)))


def test_reply_message_that_is_not_utf8_is_refused() -> None:
    raw = OK_REPLY.encode()
    broken = raw[:HEADER_SIZE] + b"\xff\xfe\xfd\xfc\xfb" + raw[HEADER_SIZE + 5 :]
    with pytest.raises(WireError, match="not UTF-8"):
        Reply.decode(broken)


# -- refusals: requests -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "offset", "value", "what"),
    [
        ("<i", 8, 1, "reply-only"),  # status
        ("<I", 12, 1, "reply-only"),  # count
        ("<I", 84, 1, "reply-only"),  # message_length
        ("<I", 88, 1, "reply-only"),  # pid
        ("<H", 92, 1, "reply-only"),  # phase
        ("<Q", 96, 1, "stats"),
        ("<Q", 120, 1, "stats"),
        ("<I", 80, 3, "unknown resource_kind 3"),
        ("<I", 80, 1, "EXPORT-only"),
        ("<16s", 48, b"\x01" * 16, "EXPORT-only"),
    ],
)
def test_requests_with_fields_that_must_be_zero_are_refused(
    fmt: str, offset: int, value: int | bytes, what: str
) -> None:
    raw = Request(Op.INSPECT, participant="cd" * 16).encode()
    with pytest.raises(WireError, match=what):
        decode_request(patched(raw, fmt, offset, value))  # type: ignore[arg-type]


def test_handshake_naming_a_participant_is_refused() -> None:
    raw = patched(Request(Op.HANDSHAKE).encode(), "<32s", 16, b"cd" * 16)
    with pytest.raises(WireError, match="HANDSHAKE request must not name a participant"):
        decode_request(raw)


def test_encoding_refuses_values_that_do_not_fit() -> None:
    with pytest.raises(WireError, match="EXPORT-only"):
        Request(Op.INSPECT, participant="cd" * 16, resource_kind=ResourceKind.UNICAST).encode()
    with pytest.raises(WireError, match="not 32 lowercase hex"):
        Request(Op.INSPECT, participant="CD" * 16).encode()
    with pytest.raises(WireError, match="out of range"):
        Record(kind=RecordKind.MAPPING, size=2**64).encode()
    with pytest.raises(WireError, match="at most 8"):
        Record(kind=RecordKind.MAPPING, access=(Access(1, 0, 3),) * 9).encode()
    with pytest.raises(WireError, match="exceeds 1024"):
        Reply(Op.HANDSHAKE, Status.OK, "ab" * 16, 1, Phase.ACTIVE, message="x" * 1025).encode()
    with pytest.raises(WireError, match="must be 16 bytes"):
        Record(kind=RecordKind.MAPPING, id=b"short").encode()


# -- refusals: records -------------------------------------------------------------------

RECORD = Record(kind=RecordKind.MAPPING, id=b"\x02" * 16, access=(Access(1, 0, 3),))


@given(U16.filter(lambda v: v not in set(RecordKind)))
def test_unknown_record_kinds_are_refused(kind: int) -> None:
    with pytest.raises(WireError, match=f"unknown record kind {kind}"):
        Record.decode(patched(RECORD.encode(), "<H", 0, kind))


@given(U16.filter(lambda v: v & ~7))
def test_unknown_record_flags_are_refused(flags: int) -> None:
    with pytest.raises(WireError, match="unknown flags"):
        Record.decode(patched(RECORD.encode(), "<H", 2, flags))


@given(st.integers(wire.ACCESS_MAX + 1, 2**32 - 1))
def test_access_count_over_the_limit_is_refused(count: int) -> None:
    with pytest.raises(WireError, match=f"access_count {count} > {wire.ACCESS_MAX}"):
        Record.decode(patched(RECORD.encode(), "<I", 4, count))


@given(U8.filter(lambda v: v not in set(BindingKind)))
def test_unknown_binding_kinds_are_refused(kind: int) -> None:
    with pytest.raises(WireError, match=f"unknown binding_kind {kind}"):
        Record.decode(patched(RECORD.encode(), "<B", 148, kind))


def test_non_zero_record_reserved_is_refused() -> None:
    with pytest.raises(WireError, match="non-zero reserved"):
        Record.decode(patched(RECORD.encode(), "<H", 150, 1))


def test_a_pid_is_refused_outside_fetch_records() -> None:
    with pytest.raises(WireError, match="MAPPING record has a pid"):
        Record.decode(patched(RECORD.encode(), "<I", 156, 1))


def test_fetch_records_carry_the_fetcher_and_its_pid() -> None:
    fetcher = "0123456789abcdef" * 2
    fetch = Record(
        RecordKind.FETCH, id=b"\x05" * 16, member_id=bytes.fromhex(fetcher), creator="ab" * 16,
        pid=4242,
    )  # fmt: skip
    raw = fetch.encode()
    assert struct.unpack_from("<I", raw, 156) == (4242,)
    decoded = Record.decode(raw)
    assert decoded == fetch and decoded.fetcher == fetcher
    assert Record(RecordKind.ALLOCATION, member_id=bytes.fromhex(fetcher)).fetcher == ""


@given(st.integers(1, wire.ACCESS_MAX - 1), st.integers(0, 15))
def test_non_zero_unused_access_slots_are_refused(slot: int, byte: int) -> None:
    # RECORD uses one slot; any byte of any later slot must stay zero.
    raw = patched(RECORD.encode(), "<B", 160 + 16 * slot + byte, 1)
    with pytest.raises(WireError, match="unused access slots"):
        Record.decode(raw)


@given(st.integers(0, RECORD_SIZE * 2).filter(lambda n: n != RECORD_SIZE))
def test_records_of_the_wrong_size_are_refused(size: int) -> None:
    with pytest.raises(WireError, match=f"record must be {RECORD_SIZE} bytes, got {size}"):
        Record.decode(bytes(size))


def test_refusals_inside_a_reply_name_the_record() -> None:
    raw = OK_REPLY.encode()
    bad = patched(raw, "<H", HEADER_SIZE + len(OK_REPLY.message) + 150, 9)
    with pytest.raises(WireError, match="MAPPING record has non-zero reserved"):
        Reply.decode(bad)


def test_header_decode_rejects_wrong_length() -> None:
    with pytest.raises(WireError, match="header must be 128 bytes, got 129"):
        Header.decode(bytes(129))


def test_quiesce_carries_its_deadline_and_only_it_does() -> None:
    request = Request(Op.QUIESCE, participant="ab" * 16, deadline_ns=500_000_000)
    raw = request.encode()
    assert Header.decode(raw[:HEADER_SIZE]).stats.elapsed_ns == 500_000_000
    assert decode_request(raw)[0] == request
    with pytest.raises(WireError, match="INSPECT request carries a deadline"):
        Request(Op.INSPECT, participant="ab" * 16, deadline_ns=1).encode()
    # A deadline in another op's request is refused as a shim refuses it.
    smuggled = bytearray(Request(Op.INSPECT, participant="ab" * 16).encode())
    smuggled[HEADER_SIZE - 16 : HEADER_SIZE - 8] = (7).to_bytes(8, "little")
    with pytest.raises(WireError, match="INSPECT request has stats set"):
        decode_request(bytes(smuggled))


def test_status_asks_for_the_driver_in_stat_count() -> None:
    """protocol.h: a STATUS request's stat_count CUIP_ASK_DRIVER asks for the shim's
    libcuda path; no other op carries it, and no other value is accepted."""
    raw = Request(Op.STATUS, ask_driver=True).encode()
    assert struct.unpack_from("<Q", raw, 96)[0] == wire.ASK_DRIVER == 1
    decoded, _ = decode_request(raw)
    assert decoded.ask_driver and decoded.op is Op.STATUS
    assert not decode_request(Request(Op.STATUS).encode())[0].ask_driver
    with pytest.raises(WireError, match="STATUS only"):
        Request(Op.HANDSHAKE, ask_driver=True).encode()
    with pytest.raises(WireError, match="stats"):
        decode_request(patched(raw, "<Q", 96, 4))


def test_status_asks_for_the_devices_in_stat_count() -> None:
    """protocol.h: CUIP_ASK_DEVICES (2) asks which GPUs the process uses, never outside
    STATUS; with the driver, the bits together (CUIP_ASK_ALL, 3)."""
    raw = Request(Op.STATUS, ask_devices=True).encode()
    assert struct.unpack_from("<Q", raw, 96)[0] == wire.ASK_DEVICES == 2
    decoded, _ = decode_request(raw)
    assert decoded.ask_devices and not decoded.ask_driver
    with pytest.raises(WireError, match="STATUS only"):
        Request(Op.INSPECT, ask_devices=True).encode()
    both = Request(Op.STATUS, ask_devices=True, ask_driver=True)
    assert struct.unpack_from("<Q", both.encode(), 96)[0] == wire.ASK_ALL == 3
    assert decode_request(both.encode())[0] == both


GPU_MAP = "GPU-00000000-0000-0000-0000-000000000000=GPU-11111111-1111-1111-1111-111111111111"


def test_load_allocations_carries_the_gpu_mapping_as_its_text() -> None:
    """protocol.h: LOAD_ALLOCATIONS alone may carry text, the GPU mapping, at most
    MESSAGE_MAX bytes; decoded back the same."""
    raw = Request(Op.LOAD_ALLOCATIONS, gpu_map=GPU_MAP).encode()
    assert struct.unpack_from("<I", raw, 84)[0] == len(GPU_MAP)
    assert raw[wire.HEADER_SIZE:] == GPU_MAP.encode()
    assert decode_request(raw)[0].gpu_map == GPU_MAP
    assert decode_request(Request(Op.LOAD_ALLOCATIONS).encode())[0].gpu_map == ""
    with pytest.raises(WireError, match="LOAD_ALLOCATIONS only"):
        Request(Op.RESTORE_UNICAST, gpu_map=GPU_MAP).encode()
    with pytest.raises(WireError, match="ASCII bytes"):
        Request(Op.LOAD_ALLOCATIONS, gpu_map="x" * (wire.MESSAGE_MAX + 1)).encode()


def test_a_host_copy_record_is_checked_before_use() -> None:
    """HOST_COPY figures come from a shim: one record a reply at most, a known hash
    state, and only a HOST_COPY record read as one."""
    from cuinterpose.engine.wire import HashState, HostCopy, Record

    good = HostCopy(1 << 20, 1, 16, 0, 1 << 20, HashState.COMPARED)
    assert HostCopy.in_reply((good.record(),)) == good
    assert HostCopy.in_reply(()) is None
    with pytest.raises(WireError, match="carries 2 HOST_COPY records"):
        HostCopy.in_reply((good.record(), good.record()))
    with pytest.raises(WireError, match="unknown hash state 9"):
        HostCopy.of(Record(kind=RecordKind.HOST_COPY, op_flags=9))
    with pytest.raises(WireError, match="MAPPING record is no HOST_COPY record"):
        HostCopy.of(Record(kind=RecordKind.MAPPING))


def test_a_host_copy_request_says_keep_or_give_back_and_nothing_else() -> None:
    from cuinterpose.engine.wire import HOST_COPY_GIVE_BACK, HOST_COPY_KEEP, Header, Stats

    for give_back in (False, True):
        request = Request(Op.HOST_COPY, participant="ab" * 16, give_back=give_back)
        assert decode_request(request.encode())[0] == request
        want = HOST_COPY_GIVE_BACK if give_back else HOST_COPY_KEEP
        assert Header.decode(request.encode()).stats == Stats(count=want)
    for asked in (0, 3):
        raw = Header(op=int(Op.HOST_COPY), participant="ab" * 16, stats=Stats(count=asked))
        with pytest.raises(WireError, match="HOST_COPY request has stats set"):
            decode_request(raw.encode())
