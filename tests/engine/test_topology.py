"""The topology model: normalization, comparison, differences, counts."""

from __future__ import annotations

import attrs
import pytest
from cuinterpose.engine.topology import ParticipantTopology, Topology, normalize
from cuinterpose.engine.wire import Access, RecordFlag, RecordKind
from hypothesis import given, settings
from hypothesis import strategies as st
from topologies import (
    CREATOR_FLAGS,
    GRANULARITY,
    MC_ID,
    allocation,
    allocation_id,
    inspect_replies,
    mapping,
    participant,
    records,
    replace_records,
    rw,
    team,
    topologies,
    va,
    with_participant,
    with_records,
    without_participant,
    without_records,
)

P0, P1, P2 = participant(0), participant(1), participant(2)
A0 = allocation_id(0)


@settings(max_examples=25, deadline=None)
@given(topology=topologies(max_records=6), data=st.data())
def test_shuffled_inspect_replies_give_an_equal_topology(
    topology: Topology, data: st.DataObject
) -> None:
    replies = [
        (who, pid, data.draw(st.permutations(list(recs)), label=f"records of {who}"))
        for who, pid, recs in inspect_replies(topology)
    ]
    shuffled = Topology.from_inspect(data.draw(st.permutations(replies), label="replies"))
    assert shuffled == topology
    assert shuffled.same_shape(topology)
    assert shuffled.differences(topology) == ()
    assert hash(shuffled) == hash(topology)


@settings(max_examples=40, deadline=None)
@given(recs=st.lists(records(), max_size=10), data=st.data())
def test_normalize_is_order_independent_and_idempotent(
    recs: list[object], data: st.DataObject
) -> None:
    once = normalize(recs)  # type: ignore[arg-type]
    assert normalize(once) == once
    assert normalize(data.draw(st.permutations(recs))) == once  # type: ignore[arg-type]
    # Nothing lost or altered: each record is kept (only its access list is ordered).
    assert sorted(map(repr, once)) == sorted(repr(normalize([r])[0]) for r in recs)  # type: ignore[list-item]
    assert len(once) == len(recs)  # duplicates are kept for validation to see


@settings(max_examples=30, deadline=None)
@given(a=topologies(max_participants=3, max_records=4), data=st.data())
def test_differences_are_empty_exactly_when_same_shape(a: Topology, data: st.DataObject) -> None:
    b = data.draw(
        st.one_of(
            st.just(Topology.from_inspect((p, pid + 1, r) for p, pid, r in inspect_replies(a))),
            topologies(max_participants=3, max_records=4),
        )
    )
    assert (a.differences(b) == ()) == a.same_shape(b)
    assert (b.differences(a) == ()) == a.same_shape(b)


def test_access_order_inside_a_record_does_not_matter() -> None:
    one = mapping(A0, va(0), access=(rw(1), rw(0), Access(2, 0, 1)))
    other = attrs.evolve(one, access=(Access(2, 0, 1), rw(0), rw(1)))
    assert normalize([one]) == normalize([other])
    assert normalize([one])[0].access == (rw(0), rw(1), Access(2, 0, 1))


def test_records_sort_by_kind_then_resource() -> None:
    topology = team(participants=2, allocations=2)
    kinds = [r.kind for r in topology.records_by_participant()[P0]]
    assert kinds == sorted(kinds)
    ids = [r.id for r in topology.records_by_participant()[P0] if r.kind is RecordKind.ALLOCATION]
    assert ids == sorted(ids)


def test_participants_are_sorted_by_id_whatever_the_reply_order() -> None:
    topology = Topology.from_inspect([(P2, 3, ()), (P0, 1, ()), (P1, 2, ())])
    assert topology.participant_ids == (P0, P1, P2)
    assert [p.pid for p in topology.participants] == [1, 2, 3]


def test_direct_construction_is_normalized_too() -> None:
    recs = team(participants=1).participants[0].records
    direct = Topology((ParticipantTopology(P0, 1, tuple(reversed(recs))),))
    assert direct.participants[0].records == recs


def test_records_by_participant_is_read_only() -> None:
    topology = team(participants=2)
    by_participant = topology.records_by_participant()
    assert set(by_participant) == {P0, P1}
    assert by_participant[P1] == topology.participants[1].records
    with pytest.raises(TypeError):
        by_participant[P0] = ()  # type: ignore[index]


def test_same_shape_ignores_pids_but_equality_does_not() -> None:
    topology = team(participants=2)
    restarted = team(participants=2, pid_base=5000)
    assert topology.same_shape(restarted)
    assert topology != restarted
    assert topology.differences(restarted) == ()


def test_same_shape_sees_a_changed_record() -> None:
    topology = team(participants=2)
    assert not topology.same_shape(
        replace_records(topology, P1, kind=RecordKind.MC_DEVICE, device=5)
    )


def test_counts() -> None:
    topology = team(participants=3, allocations=2, allocation_size=4 * GRANULARITY)
    # Two shared allocations plus one multicast member per participant carry CONTENT.
    assert topology.allocation_count == 2 + 3
    assert topology.allocation_bytes == 2 * 4 * GRANULARITY + 3 * GRANULARITY
    assert topology.multicast_object_count == 1
    assert topology.record_count == sum(len(p.records) for p in topology.participants)
    assert Topology(()).allocation_count == 0


def test_difference_in_a_field_names_participant_kind_resource_and_field() -> None:
    captured = team(participants=2)
    restored = replace_records(captured, P1, kind=RecordKind.MAPPING, id=A0, size=GRANULARITY)
    assert captured.differences(restored) == (
        f"participant {P1}: MAPPING {A0.hex()} (address {va(1):#x}): size 4194304 in captured,"
        " 2097152 in restored",
    )


def test_difference_in_flags_and_access_reads_well() -> None:
    captured = team(participants=2, multicast=False)
    restored = replace_records(
        captured, P0, kind=RecordKind.ALLOCATION, id=A0, flags=RecordFlag.CREATOR
    )
    restored = replace_records(restored, P1, kind=RecordKind.MAPPING, access=(Access(1, 1, 1),))
    assert captured.differences(restored) == (
        f"participant {P0}: ALLOCATION {A0.hex()}: flags CREATOR|HANDLE_LIVE|CONTENT in"
        " captured, CREATOR in restored",
        f"participant {P1}: MAPPING {A0.hex()} (address {va(1):#x}): access"
        " [(type 1, id 1, flags 0x3)] in captured, [(type 1, id 1, flags 0x1)] in restored",
    )


def test_missing_and_extra_records_are_named() -> None:
    captured = team(participants=2)
    restored = without_records(captured, P1, kind=RecordKind.MC_BINDING)
    restored = with_records(restored, P0, mapping(A0, va(0, 64 * GRANULARITY)))
    assert captured.differences(restored) == (
        f"participant {P0}: MAPPING {A0.hex()} (address {va(0, 64 * GRANULARITY):#x}):"
        " in restored, not in captured",
        f"participant {P1}: MC_BINDING {MC_ID.hex()} (device 1, offset 0x0): in captured,"
        " missing from restored",
    )


def test_missing_and_extra_participants_are_named() -> None:
    captured = team(participants=2)
    restored = with_participant(without_participant(captured, P1), ParticipantTopology(P2, 9, ()))
    assert captured.differences(restored, this_name="expected", other_name="found") == (
        f"participant {P1}: in expected, missing from found",
        f"participant {P2}: in found, not in expected",
    )


def test_a_moved_mapping_reads_as_one_gone_and_one_new() -> None:
    captured = team(participants=1, multicast=False)
    restored = replace_records(captured, P0, kind=RecordKind.MAPPING, address=va(0, GRANULARITY))
    lines = captured.differences(restored)
    assert len(lines) == 2
    assert "missing from restored" in lines[0] and "not in captured" in lines[1]


def test_a_participant_listed_twice_is_compared_as_a_whole() -> None:
    captured = team(participants=1)
    doubled = with_participant(captured, ParticipantTopology(P0, 7, ()))
    (line,) = captured.differences(doubled)
    assert (
        line == f"participant {P0}: listed 1 times in captured, 2 times in restored, entries differ"
    )
    assert doubled.differences(doubled) == ()


def test_duplicate_records_are_kept_and_compared() -> None:
    one = allocation(A0, P0, flags=CREATOR_FLAGS)
    captured = Topology.from_inspect([(P0, 1, [one])])
    restored = Topology.from_inspect([(P0, 1, [one, one])])
    assert captured.differences(restored) == (
        f"participant {P0}: ALLOCATION {A0.hex()}: in restored, not in captured",
    )
