"""The state file's fast paths, pinned to the plain code they stand in for.

Reading: a record that is exactly well formed is structured by a hand-written hook;
anything else goes to cattrs' generated hook. Checking: a record the codec encodes
skips the field-by-field range check. Either way the outcome (state, or the error
and its message) must be what the plain code gives; these tests run both.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import pytest
from cuinterpose.engine import statefile as st
from cuinterpose.engine.statefile import CheckpointState, StateFileError, decode_state, encode_state
from cuinterpose.engine.topology import ParticipantTopology, Topology
from cuinterpose.engine.wire import Access, BindingKind, Record, RecordFlag, RecordKind
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_
from topologies import records, state_of, team, topologies

WHEN = datetime(2026, 11, 29, 12, 30, 15, 250000, tzinfo=UTC)
PATH = Path("/checkpoint/cuinterpose.state")


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """The code as it was: cattrs' generated record hook, every record range-checked."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(st, "_fast_record_hook", lambda generated: generated)
        patch.setattr(st, "_encodes", lambda record: False)
        patch.setattr(st, "_converter", st.make_converter)  # not the one kept for reuse
        yield


def outcome(data: bytes) -> CheckpointState | str:
    try:
        return decode_state(data, PATH)
    except StateFileError as exc:
        return str(exc)


def both(data: bytes) -> CheckpointState | str:
    fast = outcome(data)
    with plain():
        assert outcome(data) == fast
    return fast


def document_of(topology: Topology) -> dict[str, Any]:
    state = state_of(topology, "host", now=WHEN)
    document: dict[str, Any] = json.loads(encode_state(state))
    return document


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies(max_participants=3, max_records=6))
def test_any_wire_topology_reads_back_alike(topology: Topology) -> None:
    state = state_of(topology, "host", now=WHEN)
    data = encode_state(state)
    with plain():
        assert encode_state(state) == data
    assert both(data) == state


# Values a corrupt or hand-edited file may hold where a record field belongs.
ODD_VALUES: list[object] = [
    None, True, False, 0, 1, -1, 1.5, 2**64, -(2**63) - 1, "1", "", "ab" * 16, "AB" * 16,
    "XY" * 16, "0" * 31, "GHOST", "MAPPING", "BIND_MEM", "NONE", [], {}, ["CREATOR"],
    ["CREATOR", "CREATOR"], ["SHINY"], ["CONTENT", "CREATOR"], [1], [None], [[]], [{}],
    [{"location_type": 1, "location_id": 0, "flags": 3}],
    [{"location_type": 1, "location_id": 0}],
    [{"location_type": 1, "location_id": 0, "flags": 3, "extra": 0}],
    [{"location_type": "1", "location_id": 0, "flags": 3}],
    [{"location_type": 1, "location_id": 0, "flags": 2**64}],
    ({"location_type": 1, "location_id": 0, "flags": 3},),
]  # fmt: skip
FIELDS = [f.name for f in attrs.fields(Record)] + ["fd", "Kind"]


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st_.integers(0, 40),
    st_.lists(
        st_.tuples(st_.sampled_from(FIELDS), st_.sampled_from([*ODD_VALUES, "<delete>"])),
        min_size=1,
        max_size=3,
    ),
)
def test_a_corrupt_record_is_refused_alike(which: int, edits: list[tuple[str, object]]) -> None:
    document = document_of(team(3, 2))
    every = [r for p in document["topology"]["participants"] for r in p["records"]]
    record = every[which % len(every)]
    for key, value in edits:
        if value == "<delete>":
            record.pop(key, None)
        else:
            record[key] = copy.deepcopy(value)
    both(json.dumps(document).encode())


@pytest.mark.slow
@pytest.mark.parametrize("key", FIELDS)
def test_every_odd_value_in_every_field_is_read_alike(key: str) -> None:
    document = document_of(team(2, 1))
    for value in [*ODD_VALUES, "<delete>"]:
        edited = copy.deepcopy(document)
        for record in (r for p in edited["topology"]["participants"] for r in p["records"]):
            if value == "<delete>":
                record.pop(key, None)
            else:
                record[key] = copy.deepcopy(value)
            break
        both(json.dumps(edited).encode())


@pytest.mark.parametrize("replacement", [[], {}, "records", 7, None, [[]], [7], ["x"]])
def test_a_record_that_is_not_an_object_is_refused_alike(replacement: object) -> None:
    document = document_of(team(2, 1))
    document["topology"]["participants"][0]["records"][0] = replacement
    both(json.dumps(document).encode())


def test_the_files_converter_is_made_once_and_is_nobody_elses() -> None:
    assert st._converter() is st._converter()
    assert st.make_converter() is not st._converter()


def test_the_fast_hook_gives_what_cattrs_gives() -> None:
    fast = st.make_converter()
    with plain():
        slow = st.make_converter()
    for record in [
        Record(kind=RecordKind.MAPPING),
        Record(
            kind=RecordKind.ALLOCATION,
            flags=RecordFlag.CREATOR | RecordFlag.CONTENT,
            id=b"\x01" * 16,
            member_id=b"\x02" * 16,
            creator="ab" * 16,
            size=2 << 20,
            handle_types=1,
            location_type=1,
            location_id=-3,
            access=(Access(1, 0, 3), Access(2, 1, 1)),
        ),
    ]:
        raw = fast.unstructure(record)
        assert fast.structure(raw, Record) == slow.structure(raw, Record) == record
        # The same types, not just equal values (an int where an enum belongs would pass ==).
        got = fast.structure(raw, Record)
        assert type(got.kind) is RecordKind and type(got.flags) is RecordFlag
        assert all(type(a) is Access for a in got.access)


# --- state_problems: records the codec encodes skip the range check -------------------

WIDE = st_.integers(-(2**65), 2**65) | st_.sampled_from(
    [0, -1, 255, 256, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32 - 1, 2**32, 2**64 - 1, 2**64]
)


def wide_records() -> st_.SearchStrategy[Record]:
    """Records whose integers may not fit their wire widths (as code could build them)."""
    ints = {name: WIDE for name in st._RECORD_WIDTHS}
    accesses = st_.builds(Access, WIDE, WIDE, WIDE)
    return st_.builds(
        lambda base, fields, access: attrs.evolve(base, access=tuple(access), **fields),
        records(),
        st_.fixed_dictionaries({}, optional=ints),
        st_.lists(accesses, max_size=9),
    )


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st_.lists(wide_records(), min_size=1, max_size=4))
def test_state_problems_are_what_the_full_check_finds(recs: list[Record]) -> None:
    topology = Topology((ParticipantTopology("ab" * 16, 7, tuple(recs)),))
    state = state_of(topology, "host", now=WHEN)
    fast = st.state_problems(state)
    with plain():
        assert st.state_problems(state) == fast


@pytest.mark.parametrize("name", sorted(st._RECORD_WIDTHS))
def test_each_wire_width_is_the_codecs(name: str) -> None:
    # The fast path's premise: the codec refuses exactly the values _RECORD_WIDTHS does.
    _, low, high = st._RECORD_WIDTHS[name]
    for value, fits in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
        record = Record(kind=RecordKind.MAPPING, **{name: value})  # type: ignore[arg-type]
        assert st._encodes(record) is fits
        assert (st._out_of_range(record) == []) is fits
    for access_name, (_, low, high) in st._ACCESS_WIDTHS.items():
        for value, fits in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
            fields = {"location_type": 1, "location_id": 0, "flags": 3, access_name: value}
            record = Record(kind=RecordKind.MAPPING, access=(Access(**fields),))
            assert st._encodes(record) is fits
            assert (st._out_of_range(record) == []) is fits


# --- writing: names from tables --------------------------------------------------------


@pytest.mark.parametrize("value", range(8))
def test_flag_names_come_from_the_table_as_from_the_enum(value: int) -> None:
    flags = RecordFlag(value)
    expected = [f.name for f in RecordFlag if f in flags and f.name]
    first, second = st._unstructure_flags(flags), st._unstructure_flags(flags)
    assert first == second == expected
    assert first is not second  # a fresh list each time: nobody shares a mutable one


def test_enum_names_come_from_the_table_as_from_the_enum() -> None:
    for member in [*RecordKind, *BindingKind]:
        assert st._enum_name(member) == member.name
    # Equal values of two enums (ALLOCATION == BIND_MEM == 1) keep their own names.
    assert st._enum_name(RecordKind.ALLOCATION) == "ALLOCATION"
    assert st._enum_name(BindingKind.BIND_MEM) == "BIND_MEM"


# -- the nesting check ---------------------------------------------------------------------


def _depth(node: object) -> int:
    """The plain definition the level-by-level check stands in for (recursive)."""
    if isinstance(node, dict):
        return 1 + max(map(_depth, node.values()), default=0)
    if isinstance(node, list):
        return 1 + max(map(_depth, node), default=0)
    return 0


_json = st_.recursive(
    st_.none() | st_.booleans() | st_.integers() | st_.text(max_size=3),
    lambda inner: (
        st_.lists(inner, max_size=4) | st_.dictionaries(st_.text(max_size=2), inner, max_size=4)
    ),
    max_leaves=40,
)


@given(_json, st_.integers(min_value=0, max_value=8))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_the_nesting_check_agrees_with_the_plain_depth(document: object, limit: int) -> None:
    assert st._nested_deeper(document, limit) == (_depth(document) > limit)


@pytest.mark.parametrize("limit", [1, 2, st.MAX_STATE_NESTING])
def test_the_nesting_check_at_its_limit(limit: int) -> None:
    # Lists and objects mixed, the deepest branch beside shallow ones and scalars.
    deep: object = 7
    for level in range(limit):
        deep = [1, {"x": deep}] if level % 2 else {"a": "s", "b": [deep]}
    inside = _depth(deep)
    assert not st._nested_deeper(deep, inside) and st._nested_deeper(deep, inside - 1)
    assert not st._nested_deeper(3, 0) and st._nested_deeper([], 0)
