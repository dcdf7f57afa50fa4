"""The one-pass record decoder (``decode_records``, behind ``Reply.from_parts``).

It unpacks a whole block with ``RECORD_STRUCT.iter_unpack`` and caches creator ids
and access descriptors per block. These tests pin it to a reference: the
record-by-record decoder it replaced, copied here verbatim in behaviour. Whatever
the bytes, both give equal records or refuse with the same message.
"""

from __future__ import annotations

import struct

import pytest
from cuinterpose.engine import wire
from cuinterpose.engine.wire import (
    ACCESS_MAX,
    HEADER_SIZE,
    RECORD_SIZE,
    RECORD_STRUCT,
    Access,
    BindingKind,
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
    decode_records,
    host_copy_request_stats,
)
from hypothesis import given, settings
from hypothesis import strategies as st

U8 = st.integers(0, 2**8 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
IDS = st.binary(min_size=16, max_size=16)
# Few distinct creators and descriptors, so that the per-block caches are hit.
CREATORS = st.sampled_from(["", "ab" * 16, "0123456789abcdef" * 2]) | st.text(
    "0123456789abcdef", min_size=32, max_size=32
)
ACCESSES = st.sampled_from([Access(1, 0, 3), Access(1, 1, 1)]) | st.builds(
    Access, location_type=I32, location_id=I32, flags=U64
)
RECORDS = st.builds(
    Record,
    kind=st.sampled_from(RecordKind),
    flags=st.integers(0, 7).map(RecordFlag),
    id=IDS,
    member_id=IDS,
    creator=CREATORS,
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
    access=st.lists(ACCESSES, max_size=ACCESS_MAX).map(tuple),
)

_KINDS = {int(k): k for k in RecordKind}
_BINDINGS = {int(k): k for k in BindingKind}


def reference_decode(raw: bytes) -> Record:
    """The decoder before the one-pass one: slice, unpack, check, construct by keyword."""
    if len(raw) != RECORD_SIZE:
        raise WireError(f"record must be {RECORD_SIZE} bytes, got {len(raw)}")
    (
        kind, flags, access_count, id_, member_id, creator, address, size, offset,
        member_offset, op_flags, handle_types, object_flags, allocation_type,
        location_type, location_id, device, num_devices, binding_kind, api_version,
        reserved0, handle_count, pid, *flat,
    ) = RECORD_STRUCT.unpack(raw)  # fmt: skip
    record_kind = _KINDS.get(kind)
    if record_kind is None:
        raise WireError(f"unknown record kind {kind}")
    if flags & ~7:
        raise WireError(f"{record_kind.name} record has unknown flags {flags:#x}")
    if access_count > ACCESS_MAX:
        raise WireError(f"{record_kind.name} record has access_count {access_count} > {ACCESS_MAX}")
    binding = _BINDINGS.get(binding_kind)
    if binding is None:
        raise WireError(f"{record_kind.name} record has unknown binding_kind {binding_kind}")
    if reserved0:
        raise WireError(f"{record_kind.name} record has non-zero reserved fields")
    if pid and record_kind is not RecordKind.FETCH:
        raise WireError(f"{record_kind.name} record has a pid (only FETCH records carry one)")
    used = 3 * access_count
    if any(flat[used:]):
        raise WireError(f"{record_kind.name} record has non-zero unused access slots")
    return Record(
        kind=record_kind,
        flags=RecordFlag(flags),
        id=id_,
        member_id=member_id,
        creator=wire._participant_text(creator, f"{record_kind.name} record creator"),
        address=address,
        size=size,
        offset=offset,
        member_offset=member_offset,
        op_flags=op_flags,
        handle_types=handle_types,
        object_flags=object_flags,
        allocation_type=allocation_type,
        location_type=location_type,
        location_id=location_id,
        device=device,
        num_devices=num_devices,
        binding_kind=binding,
        api_version=api_version,
        handle_count=handle_count,
        access=tuple(Access(*flat[i : i + 3]) for i in range(0, used, 3)),
        pid=pid,
    )


def reference_block(block: bytes) -> tuple[Record, ...] | str:
    """Every record in order, or the message of the first refusal."""
    try:
        return tuple(
            reference_decode(block[i : i + RECORD_SIZE]) for i in range(0, len(block), RECORD_SIZE)
        )
    except WireError as exc:
        return str(exc)


def one_pass(block: bytes) -> tuple[Record, ...] | str:
    try:
        return decode_records(block, len(block) // RECORD_SIZE)
    except WireError as exc:
        return str(exc)


def same_outcome(block: bytes) -> None:
    expected = reference_block(block)
    assert one_pass(block) == expected
    if isinstance(expected, tuple):
        # Field by field too: equal records could still differ in type (int vs enum).
        for got, want in zip(
            decode_records(block, len(block) // RECORD_SIZE), expected, strict=True
        ):
            assert type(got.kind) is type(want.kind) and type(got.flags) is type(want.flags)
            assert type(got.binding_kind) is type(want.binding_kind)
            assert got.access == want.access and all(type(a) is Access for a in got.access)


@given(st.lists(RECORDS, max_size=8))
def test_one_pass_decodes_what_the_reference_decodes(records: list[Record]) -> None:
    block = b"".join(r.encode() for r in records)
    same_outcome(block)
    assert decode_records(block, len(records)) == tuple(records)


@pytest.mark.slow
@settings(max_examples=300)
@given(
    st.lists(RECORDS, min_size=1, max_size=4),
    st.data(),
)
def test_one_pass_refuses_what_the_reference_refuses(
    records: list[Record], data: st.DataObject
) -> None:
    block = bytearray(b"".join(r.encode() for r in records))
    # Corrupt a few bytes anywhere: most land in plain integers (still decodable),
    # others in the kind, flags, access count, binding kind, reserved fields, unused
    # access slots or the creator id.
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(block) - 1))
        block[at] = data.draw(st.integers(0, 255))
    same_outcome(bytes(block))


# The fields the protocol checks, as (struct format, offset) inside one record.
_CHECKED = [
    ("<H", 0),  # kind
    ("<H", 2),  # flags
    ("<I", 4),  # access_count
    ("<B", 148),  # binding_kind
    ("<H", 150),  # reserved0
    ("<I", 156),  # pid (FETCH records only)
]


@pytest.mark.slow
@settings(max_examples=300)
@given(
    st.lists(RECORDS, min_size=1, max_size=4),
    st.sampled_from(_CHECKED),
    st.integers(0, 2**16 - 1),
    st.data(),
)
def test_checked_fields_are_refused_alike_in_any_record_of_a_block(
    records: list[Record], field: tuple[str, int], value: int, data: st.DataObject
) -> None:
    fmt, offset = field
    at = data.draw(st.integers(0, len(records) - 1))
    block = bytearray(b"".join(r.encode() for r in records))
    struct.pack_into(
        fmt, block, at * RECORD_SIZE + offset, value % (1 << (8 * struct.calcsize(fmt)))
    )
    same_outcome(bytes(block))


@given(st.binary(min_size=RECORD_SIZE, max_size=RECORD_SIZE))
def test_random_bytes_are_refused_alike(raw: bytes) -> None:
    same_outcome(raw)
    same_outcome(Record(kind=RecordKind.MAPPING).encode() + raw)


CREATOR = "ab" * 16
GOOD = Record(kind=RecordKind.ALLOCATION, id=b"\x01" * 16, creator=CREATOR)


def with_creator(record: Record, creator: bytes) -> bytes:
    return bytes(record.encode()[:40]) + creator + record.encode()[72:]


@pytest.mark.parametrize("bad", [b"AB" * 16, b"\xff" * 32, b"ab" * 15 + b"\0\0"])
def test_a_bad_creator_after_a_good_one_is_refused_naming_its_record(bad: bytes) -> None:
    mapping = Record(kind=RecordKind.MAPPING, id=b"\x01" * 16)
    block = GOOD.encode() + with_creator(mapping, bad)
    same_outcome(block)
    with pytest.raises(WireError, match="MAPPING record creator"):
        decode_records(block, 2)
    # The same bad creator twice: refused at the first, named by its kind.
    with pytest.raises(WireError, match="ALLOCATION record creator"):
        decode_records(with_creator(GOOD, bad) + with_creator(mapping, bad), 2)


def test_cached_creators_and_access_descriptors_decode_equal() -> None:
    rw = Access(1, 0, 3)
    records = [
        Record(kind=RecordKind.MAPPING, id=bytes([i]) * 16, creator=CREATOR, access=(rw,))
        for i in range(1, 5)
    ] + [Record(kind=RecordKind.MAPPING, id=b"\x09" * 16, access=(rw, Access(1, 1, 1)))]
    decoded = decode_records(b"".join(r.encode() for r in records), len(records))
    assert decoded == tuple(records)
    assert {r.creator for r in decoded[:4]} == {CREATOR} and decoded[4].creator == ""


@pytest.mark.parametrize(("size", "count"), [(10, 0), (RECORD_SIZE, 2), (RECORD_SIZE * 2 + 1, 2)])
def test_a_block_of_the_wrong_size_is_refused(size: int, count: int) -> None:
    with pytest.raises(
        WireError, match=f"records are {size} bytes, header says {count} x {RECORD_SIZE}"
    ):
        decode_records(bytes(size), count)


def test_a_reply_decodes_its_records_in_one_pass() -> None:
    records = tuple(
        Record(kind=RecordKind.MAPPING, id=bytes([i]) * 16, size=4096, access=(Access(1, 0, 3),))
        for i in range(1, 40)
    )
    reply = Reply(Op.INSPECT, Status.OK, CREATOR, 7, Phase.ACTIVE, "m", records=records)
    raw = reply.encode()
    assert Reply.decode(raw) == reply
    bad = bytearray(raw)
    struct.pack_into("<H", bad, HEADER_SIZE + 1 + 17 * RECORD_SIZE + 2, 8)
    with pytest.raises(WireError, match="MAPPING record has unknown flags 0x8"):
        Reply.decode(bytes(bad))


def test_the_flags_converter_is_record_flag() -> None:
    # Record's converter skips the enum call for a RecordFlag; anything else still
    # goes through RecordFlag, refusing what it refuses.
    assert Record(kind=RecordKind.MAPPING, flags=3).flags is RecordFlag(3)
    flag = RecordFlag.CREATOR | RecordFlag.CONTENT
    assert Record(kind=RecordKind.MAPPING, flags=flag).flags is flag
    assert type(Record(kind=RecordKind.MAPPING, flags=True).flags) is RecordFlag
    with pytest.raises(ValueError):
        Record(kind=RecordKind.MAPPING, flags="CREATOR")  # type: ignore[arg-type]


# -- requests: packed directly, as the Header they stand for would pack -------------

PARTICIPANT_TEXT = st.sampled_from(["", "ab" * 16, "AB" * 16, "ab" * 15, "zz" * 16]) | st.text(
    "0123456789abcdef", min_size=32, max_size=32
)


@given(
    st.sampled_from(Op),
    PARTICIPANT_TEXT,
    st.sampled_from([bytes(16), b"\x01" * 16, b"\x01" * 15]),
    st.sampled_from([bytes(16), b"\x02" * 16, b"\x02" * 17]),
    st.sampled_from(ResourceKind),
)
def test_a_request_encodes_as_its_header_does(
    op: Op, participant: str, resource_id: bytes, authorization: bytes, kind: ResourceKind
) -> None:
    request = Request(op, participant, resource_id, authorization, kind)

    def via_header() -> bytes | str:
        # Request.encode as it was: its own checks, then a Header.
        # Every other op carries its lease token in authorization; EXPORT's text
        # (the fetcher's id, all zero here) follows its header.
        exporting = op is Op.EXPORT
        # STORE_STAGED and FETCH_STAGED name the dump in resource_id.
        named = resource_id != bytes(16) and op not in (Op.STORE_STAGED, Op.FETCH_STAGED)
        if not exporting and (named or kind):
            return f"{op.name} request carries EXPORT-only fields"
        if op in (Op.HANDSHAKE, Op.RELEASE) and participant:
            return f"{op.name} request must not name a participant"
        if op is Op.RELEASE and authorization == bytes(16):
            return "RELEASE request carries no lease token"
        try:
            text = bytes(32) if exporting else b""
            return (
                Header(
                    op=int(op),
                    participant=participant,
                    resource_id=resource_id,
                    authorization=authorization,
                    resource_kind=int(kind),
                    message_length=len(text),
                    # HOST_COPY says what it asks: KEEP unless it gives back.
                    stats=host_copy_request_stats(True) if op is Op.HOST_COPY else Stats(),
                ).encode()
                + text
            )
        except WireError as exc:
            return str(exc)

    try:
        got: bytes | str = request.encode()
    except WireError as exc:
        got = str(exc)
    assert got == via_header()


@given(
    st.sampled_from(Op),
    st.sampled_from(Status),
    st.sampled_from(Phase),
    st.text(max_size=20),
    st.integers(0, 2**32 - 1),
)
def test_reply_enums_decode_to_the_members(
    op: Op, status: Status, phase: Phase, message: str, pid: int
) -> None:
    reply = Reply(op, status, CREATOR, pid, phase, message)
    decoded = Reply.decode(reply.encode())
    assert decoded == reply
    assert decoded.op is op and decoded.status is status and decoded.phase is phase
