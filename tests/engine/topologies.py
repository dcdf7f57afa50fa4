"""Example topologies for the engine's tests (and for embedders' tests).

Record builders (``allocation``, ``mapping``, ``mc_object``, ...) fill in the fields a
shim would report for one kind with sensible defaults; ``team`` builds a whole valid
team (unicast allocations shared by everyone, plus an optional multicast object with
one device and one member binding per participant) from a few knobs; ``with_records``,
``without_records`` and ``replace_records`` derive broken variants for the predicates'
tests.

    topo = team(participants=3, allocations=2, multicast=True)
    pid_of(topo, participant(0))
    broken = replace_records(topo, participant(1), kind=RecordKind.MAPPING, size=0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import attrs
from cuinterpose.engine import wire
from cuinterpose.engine.statefile import (
    CheckpointState,
    ContentMode,
    StateParticipant,
    utc_timestamp,
)
from cuinterpose.engine.topology import ParticipantTopology, Topology
from cuinterpose.engine.wire import Access, BindingKind, Record, RecordFlag, RecordKind
from hypothesis import strategies as st

MiB = 1 << 20
GRANULARITY = 2 * MiB
POSIX_FD = 0x1
LOCATION_DEVICE = 1
ACCESS_READ = 0x1
ACCESS_READWRITE = 0x3
ALLOCATION_PINNED = 1
CREATOR_FLAGS = RecordFlag.CREATOR | RecordFlag.HANDLE_LIVE | RecordFlag.CONTENT
IMPORTER_FLAGS = RecordFlag.HANDLE_LIVE
VA_BASE = 0x7F00_0000_0000
VA_STRIDE = 0x1_0000_0000  # each participant's mappings live in their own 4 GiB window
MC_WINDOW = 0x8000_0000  # multicast mappings start here within a participant's window
MEMBER_WINDOW = 0xC000_0000  # BIND_ADDR members are mapped here


def participant(n: int) -> str:
    """A readable participant id: participant(1) == "a1a1...a1" (32 hex digits)."""
    return f"{0xA0 + n:02x}" * 16


def resource(n: int) -> bytes:
    """A readable resource id: resource(10).hex() == "0a0a...0a"."""
    return bytes([n]) * 16


def allocation_id(n: int) -> bytes:
    """Shared unicast allocations: 0x10, 0x11, ..."""
    return resource(0x10 + n)


def member_id(n: int) -> bytes:
    """Each participant's multicast member allocation: 0x40, 0x41, ..."""
    return resource(0x40 + n)


MC_ID = resource(0xC0)


def rw(device: int) -> Access:
    """Read-write access for one device."""
    return Access(LOCATION_DEVICE, device, ACCESS_READWRITE)


def allocation(
    id: bytes,
    creator: str,
    *,
    size: int = GRANULARITY,
    flags: RecordFlag = IMPORTER_FLAGS,
    handle_types: int = POSIX_FD,
    device: int = 0,
    handle_count: int = 1,
) -> Record:
    return Record(
        kind=RecordKind.ALLOCATION,
        flags=flags,
        id=id,
        creator=creator,
        size=size,
        handle_types=handle_types,
        allocation_type=ALLOCATION_PINNED,
        location_type=LOCATION_DEVICE,
        location_id=device,
        handle_count=handle_count,
    )


def mapping(
    id: bytes,
    address: int,
    *,
    size: int = GRANULARITY,
    offset: int = 0,
    access: Iterable[Access] = (rw(0),),
) -> Record:
    return Record(
        kind=RecordKind.MAPPING,
        id=id,
        address=address,
        size=size,
        offset=offset,
        access=tuple(access),
    )


def mc_object(
    id: bytes,
    creator: str,
    *,
    size: int = GRANULARITY,
    num_devices: int = 2,
    flags: RecordFlag = IMPORTER_FLAGS,
    handle_types: int = POSIX_FD,
    object_flags: int = 0,
    handle_count: int = 1,
) -> Record:
    return Record(
        kind=RecordKind.MC_OBJECT,
        flags=flags,
        id=id,
        creator=creator,
        size=size,
        handle_types=handle_types,
        object_flags=object_flags,
        num_devices=num_devices,
        handle_count=handle_count,
    )


def mc_device(id: bytes, device: int) -> Record:
    return Record(kind=RecordKind.MC_DEVICE, id=id, device=device)


def mc_bind_mem(
    id: bytes,
    device: int,
    member: bytes,
    *,
    size: int = GRANULARITY,
    offset: int = 0,
    member_offset: int = 0,
    api_version: int = 1,
) -> Record:
    return Record(
        kind=RecordKind.MC_BINDING,
        id=id,
        device=device,
        offset=offset,
        size=size,
        binding_kind=BindingKind.BIND_MEM,
        api_version=api_version,
        member_id=member,
        member_offset=member_offset,
    )


def mc_bind_addr(
    id: bytes,
    device: int,
    address: int,
    *,
    size: int = GRANULARITY,
    offset: int = 0,
    member: bytes | None = None,
    member_offset: int = 0,
    api_version: int = 1,
) -> Record:
    return Record(
        kind=RecordKind.MC_BINDING,
        id=id,
        device=device,
        offset=offset,
        size=size,
        binding_kind=BindingKind.BIND_ADDR,
        api_version=api_version,
        address=address,
        member_id=member if member is not None else bytes(16),
        member_offset=member_offset if member is not None else 0,
    )


def mc_mapping(
    id: bytes,
    address: int,
    *,
    size: int = GRANULARITY,
    offset: int = 0,
    access: Iterable[Access] = (rw(0),),
) -> Record:
    return Record(
        kind=RecordKind.MC_MAPPING,
        id=id,
        address=address,
        size=size,
        offset=offset,
        access=tuple(access),
    )


def raw_import(*, size: int = GRANULARITY, handle_types: int = POSIX_FD) -> Record:
    return Record(kind=RecordKind.RAW_IMPORT, size=size, handle_types=handle_types)


def unsupported_exportable(
    id: bytes = resource(0xEE), *, size: int = GRANULARITY, handle_types: int = 0x8
) -> Record:
    return Record(
        kind=RecordKind.UNSUPPORTED_EXPORTABLE,
        id=id,
        size=size,
        handle_types=handle_types,
        location_type=LOCATION_DEVICE,
    )


def va(n: int, offset: int = 0) -> int:
    """An address in participant n's window."""
    return VA_BASE + n * VA_STRIDE + offset


def team(
    participants: int = 2,
    allocations: int = 1,
    *,
    multicast: bool = True,
    binding: BindingKind = BindingKind.BIND_MEM,
    allocation_size: int = 2 * GRANULARITY,
    mc_size: int = GRANULARITY,
    pid_base: int = 1000,
) -> Topology:
    """A valid team of ``participants`` processes.

    Unicast: allocation j (``allocation_id(j)``) is created by participant
    ``j % participants`` (CREATOR|HANDLE_LIVE|CONTENT) and imported (HANDLE_LIVE) by
    all others; everyone maps it whole in their own window, read-write for their device.
    Multicast (optional): participant 0 creates ``MC_ID`` for all participants; each
    participant i adds device i, creates member allocation ``member_id(i)`` and binds it
    whole (BIND_MEM, or BIND_ADDR through a mapping of the member), and maps the object.
    """
    if participants < 1:
        raise ValueError("a team has at least one participant")
    members: list[ParticipantTopology] = []
    for i in range(participants):
        me = participant(i)
        records: list[Record] = []
        for j in range(allocations):
            creator = participant(j % participants)
            records.append(
                allocation(
                    allocation_id(j),
                    creator,
                    size=allocation_size,
                    flags=CREATOR_FLAGS if creator == me else IMPORTER_FLAGS,
                )
            )
            records.append(
                mapping(
                    allocation_id(j),
                    va(i, j * allocation_size),
                    size=allocation_size,
                    access=(rw(i),),
                )
            )
        if multicast:
            records.extend(_multicast_member(i, participants, binding, mc_size))
        members.append(ParticipantTopology(me, pid_base + i, tuple(records)))
    return Topology(tuple(members))


def _multicast_member(
    i: int, participants: int, binding: BindingKind, mc_size: int
) -> list[Record]:
    me = participant(i)
    records = [
        mc_object(
            MC_ID,
            participant(0),
            size=mc_size,
            num_devices=participants,
            flags=(RecordFlag.CREATOR | RecordFlag.HANDLE_LIVE) if i == 0 else IMPORTER_FLAGS,
        ),
        mc_device(MC_ID, i),
        allocation(member_id(i), me, size=mc_size, flags=CREATOR_FLAGS, device=i),
        mc_mapping(MC_ID, va(i, MC_WINDOW), size=mc_size, access=(rw(i),)),
    ]
    if binding is BindingKind.BIND_ADDR:
        address = va(i, MEMBER_WINDOW)
        records.append(mapping(member_id(i), address, size=mc_size, access=(rw(i),)))
        records.append(mc_bind_addr(MC_ID, i, address, size=mc_size, member=member_id(i)))
    else:
        records.append(mc_bind_mem(MC_ID, i, member_id(i), size=mc_size))
    return records


# --- deriving variants ------------------------------------------------------------


def _matches(record: Record, kind: RecordKind | None, id: bytes | None) -> bool:
    return (kind is None or record.kind is kind) and (id is None or record.id == id)


def _edit(
    topology: Topology, who: str, edit: Callable[[tuple[Record, ...]], Iterable[Record]]
) -> Topology:
    if who not in topology.participant_ids:
        raise KeyError(f"no participant {who} in the topology")
    return Topology(
        tuple(
            attrs.evolve(p, records=tuple(edit(p.records))) if p.participant == who else p
            for p in topology.participants
        )
    )


def with_records(topology: Topology, who: str, *records: Record) -> Topology:
    """``topology`` with ``records`` added to participant ``who``."""
    return _edit(topology, who, lambda rs: (*rs, *records))


def without_records(
    topology: Topology, who: str, *, kind: RecordKind | None = None, id: bytes | None = None
) -> Topology:
    """``topology`` without ``who``'s records of ``kind`` and/or ``id``."""
    return _edit(topology, who, lambda rs: (r for r in rs if not _matches(r, kind, id)))


def replace_records(
    topology: Topology,
    who: str,
    *,
    kind: RecordKind | None = None,
    id: bytes | None = None,
    **changes: Any,
) -> Topology:
    """``topology`` with ``changes`` applied to ``who``'s records of ``kind`` and/or ``id``;
    raises if nothing matched (so a test cannot silently mutate nothing)."""
    hits = [r for r in topology.records_by_participant()[who] if _matches(r, kind, id)]
    if not hits:
        raise LookupError(f"participant {who} has no record of kind {kind} id {id!r}")
    return _edit(
        topology,
        who,
        lambda rs: (attrs.evolve(r, **changes) if _matches(r, kind, id) else r for r in rs),
    )


def with_participant(topology: Topology, member: ParticipantTopology) -> Topology:
    return Topology((*topology.participants, member))


def without_participant(topology: Topology, who: str) -> Topology:
    return Topology(tuple(p for p in topology.participants if p.participant != who))


def pid_of(topology: Topology, who: str) -> int:
    return next(p.pid for p in topology.participants if p.participant == who)


def inspect_replies(topology: Topology) -> list[tuple[str, int, tuple[Record, ...]]]:
    """The (participant, pid, records) triples Topology.from_inspect takes, for fakes."""
    return [(p.participant, p.pid, p.records) for p in topology.participants]


# --- hypothesis strategies ------------------------------------------------------------

_U64 = st.integers(0, (1 << 64) - 1)
_U32 = st.integers(0, (1 << 32) - 1)
_I32 = st.integers(-(1 << 31), (1 << 31) - 1)


def accesses() -> st.SearchStrategy[Access]:
    return st.builds(Access, _I32, _I32, _U64)


def records(ids: int = 3) -> st.SearchStrategy[Record]:
    """Any record the wire can carry; ids drawn from a few values so they collide."""
    resource_ids = st.sampled_from([resource(n) for n in range(1, ids + 1)])
    return st.builds(
        Record,
        kind=st.sampled_from(RecordKind),
        flags=st.integers(0, 7).map(RecordFlag),
        id=resource_ids,
        member_id=st.one_of(st.just(bytes(16)), resource_ids),
        creator=st.sampled_from(["", participant(0), participant(1)]),
        address=_U64,
        size=_U64,
        offset=_U64,
        member_offset=_U64,
        op_flags=_U64,
        handle_types=_U64,
        object_flags=_U64,
        allocation_type=_I32,
        location_type=_I32,
        location_id=_I32,
        device=_I32,
        num_devices=_U32,
        binding_kind=st.sampled_from(BindingKind),
        api_version=st.integers(0, 255),
        handle_count=_U32,
        access=st.lists(accesses(), max_size=8).map(tuple),
    )


def topologies(max_participants: int = 4, max_records: int = 8) -> st.SearchStrategy[Topology]:
    """Arbitrary (mostly invalid) topologies with distinct, well-formed participant ids."""
    member = st.tuples(
        st.integers(0, 0x5F),
        st.integers(1, (1 << 32) - 1),
        st.lists(records(), max_size=max_records),
    )
    return st.lists(member, max_size=max_participants, unique_by=lambda m: m[0]).map(
        lambda ms: Topology.from_inspect((participant(n), pid, rs) for n, pid, rs in ms)
    )


def state_of(
    topology: Topology,
    content_mode: ContentMode,
    *,
    protocol_version: int = wire.VERSION,
    now: datetime | None = None,
) -> CheckpointState:
    """The state of a capture of ``topology``: participants taken from it, time now."""
    return CheckpointState(
        protocol_version=protocol_version,
        content_mode=content_mode,
        created_at=utc_timestamp(now),
        participants=tuple(StateParticipant(p.participant, p.pid) for p in topology.participants),
        topology=topology,
    )
