"""The fast paths of normalization and validation, pinned to the plain versions they replace.

``normalize`` sorts with a key built by ``operator.attrgetter``; the predicates walk
per-kind indexes a topology computes once (``Topology.of_kind``) and share the
resource groupings built from them. Each test compares with the straightforward
implementation, copied here: same order, same violations, in the same order.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator

import attrs
import pytest
from cuinterpose.engine import validate as checks
from cuinterpose.engine.topology import Topology, normalize
from cuinterpose.engine.wire import Access, BindingKind, Record, RecordFlag, RecordKind
from hypothesis import given, settings
from hypothesis import strategies as st
from topologies import participant, records, team, topologies


def reference_access_key(access: Access) -> tuple[int, int, int]:
    return (access.location_type, access.location_id, access.flags)


def reference_record_key(record: Record) -> tuple[object, ...]:
    return (
        int(record.kind),
        record.id,
        record.address,
        record.offset,
        record.device,
        record.member_id,
        record.member_offset,
        record.size,
        int(record.flags),
        record.creator,
        record.op_flags,
        record.handle_types,
        record.object_flags,
        record.allocation_type,
        record.location_type,
        record.location_id,
        record.num_devices,
        int(record.binding_kind),
        record.api_version,
        record.handle_count,
        tuple(reference_access_key(a) for a in record.access),
    )


def reference_normalize(recs: list[Record]) -> tuple[Record, ...]:
    ordered = [
        attrs.evolve(r, access=tuple(sorted(r.access, key=reference_access_key))) for r in recs
    ]
    return tuple(sorted(ordered, key=reference_record_key))


_ACCESS = [Access(1, 0, 3), Access(1, 1, 1), Access(2, 0, 3), Access(1, 0, 1)]
# Small pools per field, so that records tie on every field but a few, in any position.
_POOLS: dict[str, list[object]] = {
    name: [0, 1]
    for name in (
        "address", "offset", "device", "member_offset", "size", "op_flags", "handle_types",
        "object_flags", "allocation_type", "location_type", "location_id", "num_devices",
        "api_version", "handle_count",
    )
} | {
    "kind": [RecordKind.ALLOCATION, RecordKind.MAPPING],
    "id": [b"\x01" * 16, b"\x02" * 16],
    "member_id": [bytes(16), b"\x01" * 16],
    "flags": [RecordFlag(0), RecordFlag(5)],
    "creator": ["", participant(1)],
    "binding_kind": [BindingKind.NONE, BindingKind.BIND_MEM],
}  # fmt: skip


def near_duplicates() -> st.SearchStrategy[list[Record]]:
    """Records that tie on most fields, differing in a few (the access list included)."""
    base = Record(kind=RecordKind.MAPPING, id=b"\x01" * 16)
    edits = st.dictionaries(
        st.sampled_from(sorted(_POOLS)), st.sampled_from([0, 1]), max_size=3
    ).map(lambda chosen: {name: _POOLS[name][i] for name, i in chosen.items()})
    one = st.tuples(edits, st.lists(st.sampled_from(_ACCESS), max_size=3)).map(
        lambda pair: attrs.evolve(base, access=tuple(pair[1]), **pair[0])  # type: ignore[arg-type]
    )
    return st.lists(one, max_size=16)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(records(ids=2), max_size=12) | near_duplicates())
def test_normalize_orders_as_the_reference_key_does(recs: list[Record]) -> None:
    got = normalize(recs)
    assert got == reference_normalize(recs)
    # Identity too where nothing changed: a record already in order is kept as is.
    for record in got:
        assert record in recs or len(record.access) > 1


@pytest.mark.parametrize(
    ("first", "second"), list(itertools.combinations([*sorted(_POOLS), "access"], 2))
)
def test_every_pair_of_fields_sorts_as_the_reference_key_does(first: str, second: str) -> None:
    # Two records differing in two fields, in opposite directions: whichever field
    # the key looks at first decides, so any reordering of the key shows here.
    def value(name: str, i: int) -> object:
        return ((), (Access(1, 0, 3),))[i] if name == "access" else _POOLS[name][i]

    base = Record(kind=RecordKind.MAPPING, id=b"\x01" * 16)
    one = attrs.evolve(base, **{first: value(first, 0), second: value(second, 1)})  # type: ignore[arg-type]
    other = attrs.evolve(base, **{first: value(first, 1), second: value(second, 0)})  # type: ignore[arg-type]
    assert normalize([one, other]) == normalize([other, one]) == reference_normalize([one, other])


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(topologies(max_participants=4, max_records=10), st.data())
def test_of_kind_is_records_filtered(topology: Topology, data: st.DataObject) -> None:
    kinds = data.draw(st.sets(st.sampled_from(RecordKind), max_size=4))
    expected = tuple((p, r) for p, r in topology.records() if r.kind in kinds)
    assert topology.of_kind(*kinds) == expected
    assert topology.of_kind(*sorted(kinds, reverse=True)) == expected
    assert topology.of_kind(*kinds) is topology.of_kind(*kinds)  # computed once


def test_derived_values_are_per_topology() -> None:
    calls: list[Topology] = []

    def build(t: Topology) -> int:
        calls.append(t)
        return len(calls)

    one = team(2)
    other = attrs.evolve(one)
    assert one.derived("n", build) == one.derived("n", build) == 1
    assert other.derived("n", build) == 2
    assert calls == [one, other]
    # Not a field: equality, hashing and the state file's view are unchanged.
    assert one == other and hash(one) == hash(other)
    assert [f.name for f in attrs.fields(Topology)] == ["participants"]


# The helpers as they were: a walk over every record per call, nothing shared.


def reference_of_kind(topology: Topology, *kinds: RecordKind) -> Iterator[tuple[str, Record]]:
    return ((p, r) for p, r in topology.records() if r.kind in kinds)


def reference_by_resource(
    topology: Topology, kind: RecordKind
) -> dict[bytes, list[tuple[str, Record]]]:
    grouped: dict[bytes, list[tuple[str, Record]]] = defaultdict(list)
    for participant_id, record in reference_of_kind(topology, kind):
        grouped[record.id].append((participant_id, record))
    return grouped


def reference_own(topology: Topology, kind: RecordKind) -> dict[tuple[str, bytes], Record]:
    own: dict[tuple[str, bytes], Record] = {}
    for participant_id, record in reference_of_kind(topology, kind):
        own.setdefault((participant_id, record.id), record)
    return own


def reference_violations(topology: Topology) -> tuple[tuple[str, object], ...]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checks, "_of_kind", reference_of_kind)
        patch.setattr(checks, "_by_resource", reference_by_resource)
        patch.setattr(checks, "_own", reference_own)
        return tuple(("validate", v) for v in checks.validate(topology)) + tuple(
            ("preflight", v) for v in checks.preflight(topology)
        )


def violations(topology: Topology) -> tuple[tuple[str, object], ...]:
    return tuple(("validate", v) for v in checks.validate(topology)) + tuple(
        ("preflight", v) for v in checks.preflight(topology)
    )


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(topologies(max_participants=4, max_records=10))
def test_predicates_find_what_the_reference_finds_in_order(topology: Topology) -> None:
    expected = reference_violations(topology)
    assert violations(topology) == expected
    assert violations(topology) == expected  # again, from the kept indexes


@pytest.mark.parametrize(
    ("participants", "allocations", "multicast", "binding"),
    [
        (1, 1, False, BindingKind.BIND_MEM),
        (3, 4, False, BindingKind.BIND_MEM),
        (4, 2, True, BindingKind.BIND_MEM),
        (3, 3, True, BindingKind.BIND_ADDR),
    ],
)
def test_valid_teams_agree_with_the_reference(
    participants: int, allocations: int, multicast: bool, binding: BindingKind
) -> None:
    topology = team(participants, allocations, multicast=multicast, binding=binding)
    assert violations(topology) == reference_violations(topology) == ()


def test_shared_groupings_are_read_only() -> None:
    topology = team(3)
    grouped = checks._by_resource(topology, RecordKind.ALLOCATION)
    with pytest.raises(TypeError):
        grouped[b"x"] = []  # type: ignore[index]
    own = checks._own(topology, RecordKind.ALLOCATION)
    with pytest.raises(TypeError):
        own[(participant(0), b"x")] = next(iter(own.values()))  # type: ignore[index]
    assert list(itertools.chain.from_iterable(grouped.values())) == sorted(
        reference_of_kind(topology, RecordKind.ALLOCATION),
        key=lambda pr: list(grouped).index(pr[1].id),
    )
