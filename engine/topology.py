"""The team's sharing topology: what every participant reported in its INSPECT reply.

Instances are always normalized (the converters run on every construction, including
the state file's), so two topologies that describe the same sharing compare equal no
matter in which order the shims listed their records or the coordinator heard from
them. Restore relies on that: its final INSPECT must equal the captured topology.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final, TypeVar, cast

import attrs

from .wire import BindingKind, Record, RecordFlag, RecordKind

# The fields that tell two records of one kind and one resource apart, so that
# differences() pairs a captured record with its restored counterpart and reports
# the fields that changed instead of "one missing, one extra".
_IDENTITY_FIELDS: Final[Mapping[RecordKind, tuple[str, ...]]] = {
    RecordKind.ALLOCATION: (),
    RecordKind.MAPPING: ("address",),
    RecordKind.MC_OBJECT: (),
    RecordKind.MC_DEVICE: ("device",),
    RecordKind.MC_BINDING: ("device", "offset"),
    RecordKind.MC_MAPPING: ("address",),
    RecordKind.RAW_IMPORT: ("address", "size"),
    RecordKind.UNSUPPORTED_EXPORTABLE: ("size",),
    RecordKind.FETCH: (),
    RecordKind.UNOWNED_SHARING: ("op_flags", "address"),
    RecordKind.HOST_COPY: (),
}
_T = TypeVar("_T")
_HEX_FIELDS: Final = frozenset({"address", "offset", "member_offset", "op_flags", "object_flags"})


# _record_key's fields, in order; attrgetter builds the tuple in C. Enum and flag
# values compare as the integers they are, so the order is the integers' order.
_RECORD_KEY_FIELDS: Final = operator.attrgetter(
    "kind",
    "id",
    "address",
    "offset",
    "device",
    "member_id",
    "member_offset",
    "size",
    "flags",
    "creator",
    "op_flags",
    "handle_types",
    "object_flags",
    "allocation_type",
    "location_type",
    "location_id",
    "num_devices",
    "binding_kind",
    "api_version",
    "handle_count",
)
_ACCESS_KEY: Final = operator.attrgetter("location_type", "location_id", "flags")


def _record_key(record: Record) -> tuple[object, ...]:
    """A total order over records: kind, resource, then every other field, then access."""
    return (_RECORD_KEY_FIELDS(record), tuple(map(_ACCESS_KEY, record.access)))


def _normalize_record(record: Record) -> Record:
    # The shim merges access per location, so the order of descriptors carries no
    # meaning; sorting it keeps a re-applied (reordered) access list from reading
    # as a restore mismatch.
    if len(record.access) < 2:
        return record
    ordered = tuple(sorted(record.access, key=_ACCESS_KEY))
    if ordered == record.access:
        return record
    return attrs.evolve(record, access=ordered)


def normalize(records: Iterable[Record]) -> tuple[Record, ...]:
    """Records in canonical order (duplicates kept: validation reports them)."""
    return tuple(sorted(map(_normalize_record, records), key=_record_key))


def resource_hex(resource_id: bytes) -> str:
    """A resource id as messages and the state file show it ("" for the all-zero id)."""
    return resource_id.hex() if any(resource_id) else ""


def describe_record(record: Record) -> str:
    """Kind, resource id and the fields that identify the record among its siblings."""
    text = record.kind.name
    resource = resource_hex(record.id)
    if resource:
        text += f" {resource}"
    extras = _IDENTITY_FIELDS.get(record.kind, ())
    if extras:
        text += " (" + ", ".join(f"{name} {_format_field(record, name)}" for name in extras) + ")"
    return text


def _format_field(record: Record, name: str) -> str:
    value = getattr(record, name)
    if name in ("id", "member_id"):
        return resource_hex(value) or "0"
    if name == "flags":
        flags = RecordFlag(value)
        return "|".join(f.name or "" for f in RecordFlag if f in flags) or "none"
    if name == "binding_kind":
        return BindingKind(value).name
    if name == "creator":
        return value or '""'
    if name == "access":
        return (
            "["
            + ", ".join(
                f"(type {a.location_type}, id {a.location_id}, flags {a.flags:#x})" for a in value
            )
            + "]"
        )
    if name in _HEX_FIELDS:
        return f"{value:#x}"
    return str(value)


def _sorted_participants(
    participants: Iterable[ParticipantTopology],
) -> tuple[ParticipantTopology, ...]:
    return tuple(sorted(participants, key=lambda p: (p.participant, p.pid)))


@attrs.frozen
class ParticipantTopology:
    """One participant's INSPECT reply: its durable id, its pid, its records."""

    participant: str
    pid: int
    records: tuple[Record, ...] = attrs.field(converter=normalize)
    # FETCH records: who fetched this participant's allocations. Not part of the
    # shape (a restored team fetches again, from new pids) nor of the state file.
    fetches: tuple[Record, ...] = attrs.field(default=(), eq=False)


@attrs.frozen
class Topology:
    """The whole team's records, one entry per participant, sorted by participant id."""

    participants: tuple[ParticipantTopology, ...] = attrs.field(converter=_sorted_participants)

    @classmethod
    def from_inspect(cls, replies: Iterable[tuple[str, int, Sequence[Record]]]) -> Topology:
        """Build from (participant, pid, records), one triple per INSPECT reply."""
        return cls(
            tuple(
                ParticipantTopology(
                    participant,
                    pid,
                    tuple(r for r in records if r.kind is not RecordKind.FETCH),
                    tuple(r for r in records if r.kind is RecordKind.FETCH),
                )
                for participant, pid, records in replies
            )
        )

    @property
    def participant_ids(self) -> tuple[str, ...]:
        return tuple(p.participant for p in self.participants)

    def records_by_participant(self) -> Mapping[str, tuple[Record, ...]]:
        """Participant id -> its normalized records (read-only)."""
        return MappingProxyType({p.participant: p.records for p in self.participants})

    def records(self) -> Iterable[tuple[str, Record]]:
        """Every (participant id, record) pair in canonical order."""
        for p in self.participants:
            for record in p.records:
                yield p.participant, record

    def fetches(self) -> tuple[tuple[str, Record], ...]:
        """Every (creator's participant id, FETCH record): who fetched what."""
        return tuple((p.participant, r) for p in self.participants for r in p.fetches)

    def of_kind(self, *kinds: RecordKind) -> tuple[tuple[str, Record], ...]:
        """The (participant id, record) pairs of :meth:`records` whose kind is one of
        ``kinds``, in the same order; computed once per set of kinds, so that each
        predicate can ask without walking every record."""
        wanted = frozenset(kinds)
        return self.derived(("of_kind", wanted), lambda t: _of_kind(t, wanted))

    def derived(self, key: Hashable, build: Callable[[Topology], _T]) -> _T:
        """``build(self)``, computed once per ``key`` and kept: a topology is immutable, so
        whatever is derived from it stays true. Callers must not mutate what they get."""
        cache = self._derived
        if key in cache:
            return cast(_T, cache[key])
        value = cache[key] = build(self)
        return value

    @functools.cached_property
    def _derived(self) -> dict[Hashable, object]:
        return {}

    @property
    def record_count(self) -> int:
        return sum(len(p.records) for p in self.participants)

    @property
    def allocation_count(self) -> int:
        """Allocations whose bytes SAVE/LOAD_ALLOCATIONS move (CONTENT records)."""
        return sum(1 for _, r in self._content_records())

    @property
    def allocation_bytes(self) -> int:
        """Bytes SAVE/LOAD_ALLOCATIONS move: the sizes of the CONTENT records."""
        return sum(r.size for _, r in self._content_records())

    @property
    def multicast_object_count(self) -> int:
        return len({r.id for _, r in self.records() if r.kind is RecordKind.MC_OBJECT})

    def _content_records(self) -> Iterable[tuple[str, Record]]:
        return (
            (p, r)
            for p, r in self.records()
            if r.kind is RecordKind.ALLOCATION and RecordFlag.CONTENT in r.flags
        )

    def _shape(self) -> tuple[tuple[str, tuple[Record, ...]], ...]:
        return tuple((p.participant, p.records) for p in self.participants)

    def same_shape(self, other: Topology) -> bool:
        """Same participant ids and the same normalized records; pids may differ."""
        return self._shape() == other._shape()

    def differences(
        self, other: Topology, *, this_name: str = "captured", other_name: str = "restored"
    ) -> tuple[str, ...]:
        """What differs from ``other``, one line each, naming participant, kind, resource
        and field; empty exactly when :meth:`same_shape` holds. Pids are not compared."""
        mine = _group_by_participant(self)
        theirs = _group_by_participant(other)
        lines: list[str] = []
        for participant in sorted(mine.keys() | theirs.keys()):
            if participant not in theirs:
                lines.append(
                    f"participant {participant}: in {this_name}, missing from {other_name}"
                )
                continue
            if participant not in mine:
                lines.append(f"participant {participant}: in {other_name}, not in {this_name}")
                continue
            mine_entries, theirs_entries = mine[participant], theirs[participant]
            if mine_entries == theirs_entries:
                continue  # what the field-by-field comparison below would conclude
            if len(mine_entries) == len(theirs_entries) == 1:
                lines.extend(
                    _record_differences(
                        participant, mine_entries[0], theirs_entries[0], this_name, other_name
                    )
                )
            elif mine_entries != theirs_entries:
                # A participant id listed twice only arises in an invalid topology (the
                # validation names it); compare its entries as wholes.
                lines.append(
                    f"participant {participant}: listed {len(mine_entries)} times in"
                    f" {this_name}, {len(theirs_entries)} times in {other_name}, entries differ"
                )
        return tuple(lines)


def _kind_groups(topology: Topology) -> tuple[tuple[str, dict[RecordKind, list[Record]]], ...]:
    groups = []
    for p in topology.participants:
        by_kind: dict[RecordKind, list[Record]] = {}
        for record in p.records:
            by_kind.setdefault(record.kind, []).append(record)
        groups.append((p.participant, by_kind))
    return tuple(groups)


def _of_kind(topology: Topology, kinds: frozenset[RecordKind]) -> tuple[tuple[str, Record], ...]:
    # Records are sorted by kind first: within one participant the records of each
    # kind are contiguous and come in ascending kind order, so walking each
    # participant's groups in kind order gives exactly records() filtered.
    ordered = sorted(kinds)
    return tuple(
        (participant, record)
        for participant, by_kind in topology.derived("kind_groups", _kind_groups)
        for kind in ordered
        for record in by_kind.get(kind, ())
    )


def _group_by_participant(topology: Topology) -> dict[str, list[tuple[Record, ...]]]:
    grouped: dict[str, list[tuple[Record, ...]]] = defaultdict(list)
    for p in topology.participants:
        grouped[p.participant].append(p.records)
    return grouped


_Identity = tuple[int, bytes, tuple[int, ...]]


def _identity(record: Record) -> _Identity:
    extras = tuple(int(getattr(record, name)) for name in _IDENTITY_FIELDS.get(record.kind, ()))
    return (int(record.kind), record.id, extras)


_COMPARED_FIELDS: Final = tuple(
    f.name for f in attrs.fields(Record) if f.name not in ("kind", "id")
)


def _record_differences(
    participant: str,
    mine: tuple[Record, ...],
    theirs: tuple[Record, ...],
    this_name: str,
    other_name: str,
) -> list[str]:
    mine_by_id: dict[_Identity, list[Record]] = defaultdict(list)
    theirs_by_id: dict[_Identity, list[Record]] = defaultdict(list)
    for r in mine:
        mine_by_id[_identity(r)].append(r)
    for r in theirs:
        theirs_by_id[_identity(r)].append(r)
    lines: list[str] = []
    prefix = f"participant {participant}:"
    for key in sorted(mine_by_id.keys() | theirs_by_id.keys()):
        left, right = mine_by_id.get(key, []), theirs_by_id.get(key, [])
        for a, b in zip(left, right, strict=False):
            for name in _COMPARED_FIELDS:
                if getattr(a, name) != getattr(b, name):
                    lines.append(
                        f"{prefix} {describe_record(a)}: {name} {_format_field(a, name)}"
                        f" in {this_name}, {_format_field(b, name)} in {other_name}"
                    )
        for a in left[len(right) :]:
            lines.append(
                f"{prefix} {describe_record(a)}: in {this_name}, missing from {other_name}"
            )
        for b in right[len(left) :]:
            lines.append(f"{prefix} {describe_record(b)}: in {other_name}, not in {this_name}")
    return lines
