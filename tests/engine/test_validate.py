"""Every validation predicate: the valid teams pass, each broken variant names its rule,
participant, record kind and resource."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from cuinterpose.engine import validate as v
from cuinterpose.engine.topology import ParticipantTopology, Topology
from cuinterpose.engine.wire import Access, BindingKind, Record, RecordFlag, RecordKind
from topologies import (
    CREATOR_FLAGS,
    GRANULARITY,
    IMPORTER_FLAGS,
    MC_ID,
    allocation,
    allocation_id,
    mapping,
    member_id,
    participant,
    raw_import,
    replace_records,
    resource,
    rw,
    team,
    unsupported_exportable,
    va,
    with_participant,
    with_records,
    without_participant,
    without_records,
)

P0, P1, P2 = participant(0), participant(1), participant(2)
A0 = allocation_id(0)
A1 = allocation_id(1)
ALLOC, MAP = RecordKind.ALLOCATION, RecordKind.MAPPING
MC_OBJ, MC_DEV = RecordKind.MC_OBJECT, RecordKind.MC_DEVICE
MC_BIND, MC_MAP = RecordKind.MC_BINDING, RecordKind.MC_MAPPING


def base() -> Topology:
    """Three participants, two shared allocations (created by P0 and P1), multicast."""
    return team(participants=3, allocations=2)


def everywhere(topology: Topology, *, kind: RecordKind, id: bytes, **changes: object) -> Topology:
    for who in topology.participant_ids:
        topology = replace_records(topology, who, kind=kind, id=id, **changes)
    return topology


@attrs.frozen
class Case:
    build: Callable[[], Topology]
    check: Callable[[Topology], tuple[v.Violation, ...]]
    rule: str
    participant: str
    kind: RecordKind | None
    resource: bytes | None
    says: str  # a fragment of the reason


def case(name: str, *args: object) -> object:
    return pytest.param(Case(*args), id=name)  # type: ignore[arg-type]


CASES = [
    # participants
    case(
        "participant-id-uppercase",
        lambda: with_participant(base(), ParticipantTopology("AB" * 16, 77, ())),
        v.check_participant_ids, "participants.id_format", "AB" * 16, None, None,
        "not 32 lowercase hex",
    ),
    case(
        "participant-id-short",
        lambda: with_participant(base(), ParticipantTopology("abc", 77, ())),
        v.check_participant_ids, "participants.id_format", "abc", None, None, "pid 77",
    ),
    case(
        "participant-id-twice",
        lambda: with_participant(base(), ParticipantTopology(P1, 4242, ())),
        v.check_participant_ids, "participants.unique", P1, None, None, "4242",
    ),
    # records
    case(
        "resource-id-zero",
        lambda: with_records(base(), P1, allocation(bytes(16), P1, flags=CREATOR_FLAGS)),
        v.check_resource_ids, "records.resource_id", P1, ALLOC, None, "all zero",
    ),
    case(
        "allocation-reported-twice",
        lambda: with_records(base(), P1, allocation(A0, P0, size=2 * GRANULARITY)),
        v.check_duplicate_records, "records.duplicate", P1, ALLOC, A0, "more than once",
    ),
    case(
        "mc-object-reported-twice",
        lambda: with_records(
            base(), P2, next(r for r in base().records_by_participant()[P2] if r.kind is MC_OBJ)
        ),
        v.check_duplicate_records, "records.duplicate", P2, MC_OBJ, MC_ID, "more than once",
    ),
    # unicast
    case(
        "no-creator",
        lambda: replace_records(base(), P0, kind=ALLOC, id=A0, flags=IMPORTER_FLAGS),
        v.check_single_creator, "unicast.single_creator", P0, ALLOC, A0,
        "no participant reports creating",
    ),
    case(
        "creator-gone",
        lambda: without_participant(team(participants=3, multicast=False), P0),
        v.check_creator_absent, "unicast.creator_absent", P1, ALLOC, A0,
        f"whose creator, participant {P0}, is in no process of the group",
    ),
    case(
        "two-creators",
        lambda: replace_records(base(), P1, kind=ALLOC, id=A0, flags=CREATOR_FLAGS),
        v.check_single_creator, "unicast.single_creator", P1, ALLOC, A0,
        "2 participants claim",
    ),
    case(
        "creator-field-disagrees",
        lambda: replace_records(base(), P2, kind=ALLOC, id=A0, creator=P1),
        v.check_allocation_creator, "unicast.creator_agreement", P2, ALLOC, A0,
        f"names creator '{P1}'",
    ),
    case(
        "creator-flag-names-other",
        lambda: everywhere(base(), kind=ALLOC, id=A0, creator=P2),
        v.check_allocation_creator, "unicast.creator_agreement", P0, ALLOC, A0,
        "has the CREATOR flag but names",
    ),
    case(
        "size-disagrees",
        lambda: replace_records(base(), P1, kind=ALLOC, id=A0, size=8 * GRANULARITY),
        v.check_allocation_size, "unicast.size", P1, ALLOC, A0, "disagrees with the other",
    ),
    case(
        "size-zero",
        lambda: everywhere(base(), kind=ALLOC, id=A1, size=0),
        v.check_allocation_size, "unicast.size", P2, ALLOC, A1, "size is 0",
    ),
    case(
        "handle-type-fabric",
        lambda: everywhere(base(), kind=ALLOC, id=A0, handle_types=0x9),
        v.check_allocation_handle_type, "unicast.handle_type", P1, ALLOC, A0,
        "only POSIX file descriptors",
    ),
    case(
        "handle-type-none-but-shared",
        lambda: everywhere(base(), kind=ALLOC, id=A0, handle_types=0),
        v.check_allocation_handle_type, "unicast.handle_type", P2, ALLOC, A0,
        "shared between participants",
    ),
    case(
        "handle-type-disagrees",
        lambda: replace_records(base(), P1, kind=ALLOC, id=A0, handle_types=0),
        v.check_allocation_handle_type, "unicast.handle_type", P1, ALLOC, A0, "disagrees",
    ),
    case(
        "creator-holds-nothing",
        lambda: without_records(
            replace_records(
                base(), P0, kind=ALLOC, id=A0, flags=RecordFlag.CREATOR | RecordFlag.CONTENT
            ),
            P0, kind=MAP, id=A0,
        ),
        v.check_creator_holds, "unicast.creator_holds", P0, ALLOC, A0, "neither a live handle",
    ),
    case(
        "content-on-importer",
        lambda: replace_records(
            base(), P2, kind=ALLOC, id=A0, flags=RecordFlag.HANDLE_LIVE | RecordFlag.CONTENT
        ),
        v.check_content, "unicast.content", P2, ALLOC, A0, "did not create",
    ),
    case(
        "content-missing",
        lambda: replace_records(
            base(), P1, kind=ALLOC, id=A1, flags=RecordFlag.CREATOR | RecordFlag.HANDLE_LIVE
        ),
        v.check_content, "unicast.content", P1, ALLOC, A1, "no CONTENT flag",
    ),
    # mappings
    case(
        "mapping-of-unreported-allocation",
        lambda: without_records(base(), P2, kind=ALLOC, id=A1),
        v.check_mapping_allocation, "mapping.unknown_allocation", P2, MAP, A1,
        "did not report",
    ),
    case(
        "mapping-empty",
        lambda: replace_records(base(), P1, kind=MAP, id=A0, size=0),
        v.check_mapping_empty, "mapping.empty", P1, MAP, A0, "size 0",
    ),
    case(
        "mapping-address-zero",
        lambda: replace_records(base(), P1, kind=MAP, id=A0, address=0),
        v.check_mapping_empty, "mapping.empty", P1, MAP, A0, "address 0",
    ),
    case(
        "mc-mapping-empty",
        lambda: replace_records(base(), P2, kind=MC_MAP, size=0),
        v.check_mapping_empty, "mapping.empty", P2, MC_MAP, MC_ID, "size 0",
    ),
    case(
        "mapping-beyond-allocation",
        lambda: replace_records(base(), P1, kind=MAP, id=A0, offset=GRANULARITY),
        v.check_mapping_bounds, "mapping.bounds", P1, MAP, A0, "beyond the allocation",
    ),
    case(
        "mappings-overlap",
        lambda: replace_records(base(), P2, kind=MAP, id=A1, address=va(2, GRANULARITY)),
        v.check_mapping_overlap, "mapping.overlap", P2, MAP, A1, "overlaps MAPPING",
    ),
    case(
        "mapping-overlaps-mc-mapping",
        lambda: replace_records(base(), P0, kind=MC_MAP, address=va(0, 3 * GRANULARITY)),
        v.check_mapping_overlap, "mapping.overlap", P0, MC_MAP, MC_ID, "overlaps MAPPING",
    ),
    case(
        "mapping-wraps",
        lambda: replace_records(base(), P0, kind=MAP, id=A0, address=(1 << 64) - GRANULARITY),
        v.check_mapping_overlap, "mapping.overlap", P0, MAP, A0, "wraps",
    ),
    case(
        "nine-access-descriptors",
        lambda: replace_records(
            base(), P1, kind=MAP, id=A0, access=tuple(rw(d) for d in range(9))
        ),
        v.check_mapping_access, "mapping.access", P1, MAP, A0, "9 access descriptors",
    ),
    case(
        "access-location-type-invalid",
        lambda: replace_records(base(), P1, kind=MAP, id=A0, access=(Access(0, 1, 3),)),
        v.check_mapping_access, "mapping.access", P1, MAP, A0, "unknown location type 0",
    ),
    case(
        "access-location-type-unknown",
        lambda: replace_records(base(), P1, kind=MC_MAP, access=(Access(9, 1, 3),)),
        v.check_mapping_access, "mapping.access", P1, MC_MAP, MC_ID, "unknown location type 9",
    ),
    case(
        "access-device-negative",
        lambda: replace_records(base(), P1, kind=MAP, id=A0, access=(Access(1, -1, 3),)),
        v.check_mapping_access, "mapping.access", P1, MAP, A0, "negative",
    ),
    case(
        "access-flags-none",
        lambda: replace_records(base(), P1, kind=MAP, id=A0, access=(Access(1, 1, 0),)),
        v.check_mapping_access, "mapping.access", P1, MAP, A0, "flags 0x0",
    ),
    case(
        "access-flags-unknown",
        lambda: replace_records(base(), P1, kind=MAP, id=A0, access=(Access(1, 1, 2),)),
        v.check_mapping_access, "mapping.access", P1, MAP, A0, "flags 0x2",
    ),
    case(
        "access-location-twice",
        lambda: replace_records(
            base(), P1, kind=MAP, id=A0, access=(Access(1, 1, 1), Access(1, 1, 3))
        ),
        v.check_mapping_access, "mapping.access", P1, MAP, A0, "listed twice",
    ),
    # multicast
    case(
        "mc-size-disagrees",
        lambda: replace_records(base(), P1, kind=MC_OBJ, size=4 * GRANULARITY),
        v.check_multicast_properties, "multicast.properties", P1, MC_OBJ, MC_ID, "size",
    ),
    case(
        "mc-num-devices-disagrees",
        lambda: replace_records(base(), P2, kind=MC_OBJ, num_devices=4),
        v.check_multicast_properties, "multicast.properties", P2, MC_OBJ, MC_ID,
        "num_devices 4 disagrees",
    ),
    case(
        "mc-object-flags-disagree",
        lambda: replace_records(base(), P2, kind=MC_OBJ, object_flags=1),
        v.check_multicast_properties, "multicast.properties", P2, MC_OBJ, MC_ID,
        "object_flags 1 disagrees",
    ),
    case(
        "mc-handle-types-disagree",
        lambda: replace_records(base(), P1, kind=MC_OBJ, handle_types=0x8),
        v.check_multicast_properties, "multicast.properties", P1, MC_OBJ, MC_ID,
        "only POSIX file descriptors",
    ),
    case(
        "mc-zero-devices",
        lambda: everywhere(base(), kind=MC_OBJ, id=MC_ID, num_devices=0),
        v.check_multicast_properties, "multicast.properties", P0, MC_OBJ, MC_ID,
        "must both be non-zero",
    ),
    case(
        "mc-creator-disagrees",
        lambda: replace_records(base(), P2, kind=MC_OBJ, creator=P2),
        v.check_multicast_properties, "multicast.properties", P2, MC_OBJ, MC_ID,
        f"names creator '{P2}'",
    ),
    case(
        "mc-no-creator",
        lambda: replace_records(base(), P0, kind=MC_OBJ, flags=IMPORTER_FLAGS),
        v.check_multicast_single_creator, "multicast.single_creator", P0, MC_OBJ, MC_ID,
        "no participant reports creating this multicast object",
    ),
    case(
        "mc-two-creators",
        lambda: replace_records(
            base(), P2, kind=MC_OBJ, flags=RecordFlag.CREATOR | RecordFlag.HANDLE_LIVE
        ),
        v.check_multicast_single_creator, "multicast.single_creator", P2, MC_OBJ, MC_ID,
        "2 participants claim",
    ),
    case(
        "mc-records-without-object",
        lambda: without_records(base(), P1, kind=MC_OBJ),
        v.check_multicast_object_known, "multicast.unknown_object", P1, MC_DEV, MC_ID,
        "did not report",
    ),
    case(
        "mc-device-added-twice",
        lambda: replace_records(base(), P2, kind=MC_DEV, device=1),
        v.check_multicast_devices, "multicast.devices", P2, MC_DEV, MC_ID,
        "device 1 is added 2 times",
    ),
    case(
        "mc-device-missing",
        lambda: without_records(base(), P2, kind=MC_DEV),
        v.check_multicast_devices, "multicast.devices", P0, MC_OBJ, MC_ID,
        "2 distinct devices added ([0, 1]), the object was created for 3",
    ),
    case(
        "mc-no-device-at-all",
        lambda: without_records(
            without_records(without_records(base(), P0, kind=MC_DEV), P1, kind=MC_DEV),
            P2, kind=MC_DEV,
        ),
        v.check_multicast_devices, "multicast.devices", P0, MC_OBJ, MC_ID,
        "no participant added a device",
    ),
    case(
        "mc-device-unbound",
        lambda: without_records(base(), P1, kind=MC_BIND),
        v.check_multicast_device_bindings, "multicast.device_binding", P1, MC_DEV, MC_ID,
        "device 1 has no binding",
    ),
    case(
        "mc-binding-on-foreign-device",
        lambda: with_records(
            base(),
            P1,
            attrs.evolve(
                next(r for r in base().records_by_participant()[P1] if r.kind is MC_BIND),
                device=7,
            ),
        ),
        v.check_multicast_device_bindings, "multicast.device_binding", P1, MC_BIND, MC_ID,
        "device 7, which no participant added",
    ),
    case(
        "mc-binding-beyond-object",
        lambda: replace_records(base(), P1, kind=MC_BIND, offset=GRANULARITY),
        v.check_multicast_binding_bounds, "multicast.binding_bounds", P1, MC_BIND, MC_ID,
        "beyond the multicast object's size",
    ),
    case(
        "mc-binding-empty",
        lambda: replace_records(base(), P1, kind=MC_BIND, size=0),
        v.check_multicast_binding_bounds, "multicast.binding_bounds", P1, MC_BIND, MC_ID,
        "binding has size 0",
    ),
    case(
        "mc-mapping-beyond-object",
        lambda: replace_records(base(), P2, kind=MC_MAP, offset=GRANULARITY),
        v.check_multicast_mapping_bounds, "multicast.mapping_bounds", P2, MC_MAP, MC_ID,
        "beyond the multicast object's size",
    ),
    case(
        "mc-binding-kind-none",
        lambda: replace_records(base(), P0, kind=MC_BIND, binding_kind=BindingKind.NONE),
        v.check_binding_kind, "multicast.binding_kind", P0, MC_BIND, MC_ID,
        "neither BIND_MEM nor BIND_ADDR",
    ),
    case(
        "mc-binding-api-version",
        lambda: replace_records(base(), P0, kind=MC_BIND, api_version=3),
        v.check_binding_kind, "multicast.binding_kind", P0, MC_BIND, MC_ID, "api_version 3",
    ),
    case(
        "mc-bind-mem-unknown-member",
        lambda: replace_records(base(), P1, kind=MC_BIND, member_id=resource(0x99)),
        v.check_bind_mem_members, "multicast.bind_mem_member", P1, MC_BIND, MC_ID,
        f"member allocation {resource(0x99).hex()} on device 1",
    ),
    case(
        "mc-bind-mem-other-participants-member",
        lambda: replace_records(base(), P1, kind=MC_BIND, member_id=member_id(2)),
        v.check_bind_mem_members, "multicast.bind_mem_member", P1, MC_BIND, MC_ID,
        "is not an allocation the participant reported",
    ),
    case(
        "mc-bind-mem-beyond-member",
        lambda: replace_records(base(), P2, kind=MC_BIND, member_offset=GRANULARITY // 2),
        v.check_bind_mem_members, "multicast.bind_mem_member", P2, MC_BIND, MC_ID,
        f"beyond member allocation {member_id(2).hex()}",
    ),
    case(
        "mc-bind-addr-null",
        lambda: replace_records(
            team(participants=3, allocations=2, binding=BindingKind.BIND_ADDR),
            P1, kind=MC_BIND, address=0,
        ),
        v.check_bind_addr, "multicast.bind_addr", P1, MC_BIND, MC_ID, "address 0",
    ),
]  # fmt: skip


@pytest.mark.parametrize("c", CASES)
def test_each_violation_is_named(c: Case) -> None:
    topology = c.build()
    resource_hex = c.resource.hex() if c.resource is not None else ""
    expected = [
        found
        for found in c.check(topology)
        if (found.participant, found.kind, found.resource) == (c.participant, c.kind, resource_hex)
    ]
    assert expected, f"{c.check.__name__} found {[str(x) for x in c.check(topology)]}"
    assert {found.rule for found in c.check(topology)} == {c.rule}
    assert any(c.says in found.reason for found in expected), [str(x) for x in expected]
    for found in expected:
        text = str(found)
        assert c.rule in text
        assert (c.participant or "the group") in text
        assert c.kind is None or c.kind.name in text
        assert resource_hex in text
    # validate() runs the predicate; the unbroken team does not trip it.
    assert set(expected) <= set(v.validate(topology))
    assert c.check(base()) == ()


def test_every_predicate_has_a_case() -> None:
    covered = {p.values[0].check for p in CASES}  # type: ignore[attr-defined]
    assert set(v.TOPOLOGY_CHECKS) <= covered


@pytest.mark.parametrize(
    "shape",
    [
        {"participants": 1, "allocations": 0},
        {"participants": 1, "allocations": 1},
        {"participants": 2, "allocations": 1},
        {"participants": 3, "allocations": 2},
        {"participants": 8, "allocations": 5},
        {"participants": 4, "allocations": 2, "multicast": False},
        {"participants": 4, "allocations": 2, "binding": BindingKind.BIND_ADDR},
        {"participants": 2, "allocations": 3, "allocation_size": GRANULARITY},
    ],
    ids=repr,
)
def test_valid_teams_have_no_violations(shape: dict[str, object]) -> None:
    topology = team(**shape)  # type: ignore[arg-type]
    assert v.validate(topology) == ()
    assert v.preflight(topology) == ()


def test_empty_topology_is_valid() -> None:
    assert v.validate(Topology(())) == ()


def test_private_allocation_may_be_unexportable() -> None:
    # A multicast member nobody imports need not be exportable: only a shared one must.
    topology = replace_records(base(), P1, kind=ALLOC, id=member_id(1), handle_types=0)
    assert v.validate(topology) == ()


def test_partial_mapping_and_read_access_are_valid() -> None:
    topology = with_records(
        team(participants=2, allocations=1, multicast=False),
        P1,
        mapping(A0, va(1, 8 * GRANULARITY), size=GRANULARITY, offset=GRANULARITY,
                access=(Access(1, 1, 1), Access(2, 0, 3))),
    )  # fmt: skip
    assert v.validate(topology) == ()


def test_creator_with_only_a_mapping_holds_it() -> None:
    topology = replace_records(
        base(), P0, kind=ALLOC, id=A0, flags=RecordFlag.CREATOR | RecordFlag.CONTENT
    )
    assert v.check_creator_holds(topology) == ()


def test_preflight_refuses_raw_import() -> None:
    topology = with_records(base(), P1, raw_import(size=3 * GRANULARITY, handle_types=0x1))
    (found,) = v.preflight(topology)
    assert (found.rule, found.participant, found.kind, found.resource) == (
        "preflight.raw_import",
        P1,
        RecordKind.RAW_IMPORT,
        "",
    )
    assert "size 0x600000" in found.reason and "handle_types 0x1" in found.reason
    assert str(found).startswith(f"participant {P1}, RAW_IMPORT: ")
    assert v.validate(topology) == ()  # a refusal, not a topology violation


def test_preflight_refuses_unsupported_exportable() -> None:
    topology = with_records(base(), P2, unsupported_exportable(resource(0xEE), handle_types=0x9))
    (found,) = v.preflight(topology)
    assert (found.rule, found.participant, found.kind, found.resource) == (
        "preflight.unsupported_exportable",
        P2,
        RecordKind.UNSUPPORTED_EXPORTABLE,
        resource(0xEE).hex(),
    )
    assert "handle_types 0x9" in found.reason and "size 0x200000" in found.reason
    assert resource(0xEE).hex() in str(found)


def _fetched_by(topology: Topology, creator: str, fetcher: str, pid: int) -> Topology:
    """``topology`` with ``creator`` reporting that ``fetcher`` (process ``pid``) fetched A0."""
    fetch = Record(
        RecordKind.FETCH, id=A0, member_id=bytes.fromhex(fetcher), creator=creator, pid=pid
    )
    return Topology(
        tuple(
            attrs.evolve(p, fetches=(*p.fetches, fetch)) if p.participant == creator else p
            for p in topology.participants
        )
    )


def test_preflight_refuses_a_team_that_leaves_out_a_fetcher() -> None:
    outsider = participant(9)
    topology = _fetched_by(base(), P0, outsider, 4711)
    (found,) = v.preflight(topology)
    assert (found.rule, found.participant, found.kind, found.resource) == (
        "preflight.whole_team",
        P0,
        RecordKind.ALLOCATION,
        A0.hex(),
    )
    assert found.reason == (
        f"the process with pid 4711 (as this process sees it; participant {outsider}) imported"
        " this allocation and is not among the processes named: name it too, or stop it first"
    )
    assert str(found).startswith(f"participant {P0}, ALLOCATION {A0.hex()}: ")
    assert v.validate(topology) == ()  # a refusal, not a topology violation
    # A fetcher in the team is fine; one the creator cannot see is named without a pid.
    assert v.preflight(_fetched_by(base(), P0, P1, 4712)) == ()
    (unseen,) = v.preflight(_fetched_by(base(), P0, outsider, 0))
    assert f"a process this one cannot see (participant {outsider}) imported" in unseen.reason


def test_fetch_records_are_kept_apart_from_the_topology() -> None:
    records = base().records_by_participant()[P0]
    fetch = Record(RecordKind.FETCH, id=A0, member_id=bytes.fromhex(P1), creator=P0, pid=5)
    inspected = Topology.from_inspect([(P0, 1, (*records, fetch))])
    (member,) = inspected.participants
    assert member.records == Topology.from_inspect([(P0, 1, records)]).participants[0].records
    assert member.fetches == (fetch,) and inspected.fetches() == ((P0, fetch),)
    # Not part of the shape: a restored team fetches again, from new pids.
    assert inspected == Topology.from_inspect([(P0, 1, records)])


def test_preflight_names_every_refusal() -> None:
    topology = with_records(
        with_records(base(), P0, raw_import(size=0)), P2, unsupported_exportable()
    )
    found = v.preflight(topology)
    assert [(f.participant, f.kind) for f in found] == [
        (P0, RecordKind.RAW_IMPORT),
        (P2, RecordKind.UNSUPPORTED_EXPORTABLE),
    ]
    assert "size unknown" in found[0].reason


def test_imports_of_a_gone_creator_are_refused_once_per_importer() -> None:
    # P0 created A0 and A3 (of four allocations), then exited; P1 and P2 still hold them.
    gone = without_participant(team(participants=3, allocations=4, multicast=False), P0)
    found = v.validate(gone)
    assert {f.rule for f in found} == {"unicast.creator_absent"}, [str(f) for f in found]
    assert sorted(f.participant for f in found) == [P1, P2]
    for f in found:
        assert f.resource == f"{A0.hex()}, {allocation_id(3).hex()}"
        assert "imports 2 allocations" in f.reason and f"participant {P0}" in f.reason
        assert "Close the imports in this process (cuIpcCloseMemHandle" in f.reason
    # Another participant's allocation without a creator is still said as before.
    broken = replace_records(team(participants=2), P0, kind=ALLOC, id=A0, flags=IMPORTER_FLAGS)
    assert "unicast.creator_absent" not in {f.rule for f in v.validate(broken)}


def test_violation_text_for_a_team_wide_violation() -> None:
    violation = v.Violation("some.rule", "", None, "", "something is off")
    assert str(violation) == "the group: something is off [some.rule]"


def test_violation_text_names_everything() -> None:
    violation = v.Violation("unicast.size", P1, RecordKind.ALLOCATION, A0.hex(), "too big")
    assert str(violation) == f"participant {P1}, ALLOCATION {A0.hex()}: too big [unicast.size]"


def test_validate_is_deterministic_and_collects_all() -> None:
    topology = replace_records(
        replace_records(base(), P1, kind=MAP, id=A0, size=0), P2, kind=MC_DEV, device=1
    )
    first = v.validate(topology)
    assert first == v.validate(topology)
    assert {"mapping.empty", "multicast.devices"} <= {f.rule for f in first}


def test_every_rule_is_documented() -> None:
    spec = (Path(__file__).resolve().parents[2] / "specs" / "validation.md").read_text()
    rules = {p.values[0].rule for p in CASES}  # type: ignore[attr-defined]
    rules |= {"preflight.raw_import", "preflight.unsupported_exportable", "preflight.whole_team"}
    assert {rule for rule in rules if f"`{rule}`" not in spec} == set()


def test_a_process_s_private_allocations_are_a_valid_topology(tmp_path: Path) -> None:
    """What a shim reports for private allocations it stages (issue 19): one participant
    alone, CREATOR and CONTENT; one kept by its handle, one not exportable, one held by
    its mapping only (the application released its handle), one mapped twice. Valid,
    nothing to refuse, and the state file keeps them as they are."""
    from cuinterpose.engine import statefile

    owned = RecordFlag.CREATOR | RecordFlag.CONTENT
    ids = [allocation_id(10 + k) for k in range(4)]
    records = (
        allocation(ids[0], P0, flags=CREATOR_FLAGS, size=3 * GRANULARITY),
        mapping(ids[0], va(0), size=3 * GRANULARITY),
        allocation(ids[1], P0, flags=CREATOR_FLAGS, handle_types=0),
        mapping(ids[1], va(4)),
        allocation(ids[2], P0, flags=owned, handle_count=0),
        mapping(ids[2], va(6)),
        allocation(ids[3], P0, flags=CREATOR_FLAGS, device=1),
        mapping(ids[3], va(8), access=(rw(0), rw(1))),
        mapping(ids[3], va(10), access=(Access(1, 0, 1),)),
    )
    topology = Topology((ParticipantTopology(P0, 1000, records),))
    assert v.validate(topology) == ()
    assert v.preflight(topology) == ()
    assert topology.allocation_count == 4
    assert topology.allocation_bytes == 6 * GRANULARITY
    state = statefile.CheckpointState(
        protocol_version=1,
        content_mode="host",
        created_at=statefile.utc_timestamp(),
        participants=(statefile.StateParticipant(P0, 1000),),
        topology=topology,
    )
    statefile.write_state(tmp_path, state)
    assert statefile.read_state(tmp_path) == state
