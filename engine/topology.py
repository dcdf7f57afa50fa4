"""The team's sharing topology: what every participant reported in its INSPECT reply.

Instances are always normalized (the converters run on every construction, including
the state file's), so two topologies that describe the same sharing compare equal no
matter in which order the shims listed their records or the coordinator heard from
them. Restore relies on that: its final INSPECT must equal the captured topology.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

import attrs

from .wire import Access, BindingKind, Record, RecordFlag, RecordKind

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
}
_HEX_FIELDS: Final = frozenset({"address", "offset", "member_offset", "op_flags", "object_flags"})


def _access_key(access: Access) -> tuple[int, int, int]:
    return (access.location_type, access.location_id, access.flags)


def _record_key(record: Record) -> tuple[object, ...]:
    """A total order over records: kind, resource, then every other field."""
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
        tuple(_access_key(a) for a in record.access),
    )


def _normalize_record(record: Record) -> Record:
    # The shim merges access per location, so the order of descriptors carries no
    # meaning; sorting it keeps a re-applied (reordered) access list from reading
    # as a restore mismatch.
    ordered = tuple(sorted(record.access, key=_access_key))
    if ordered == record.access:
        return record
    return attrs.evolve(record, access=ordered)


def normalize(records: Iterable[Record]) -> tuple[Record, ...]:
    """Records in canonical order (duplicates kept: validation reports them)."""
    return tuple(sorted((_normalize_record(r) for r in records), key=_record_key))


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


@attrs.frozen
class Topology:
    """The whole team's records, one entry per participant, sorted by participant id."""

    participants: tuple[ParticipantTopology, ...] = attrs.field(converter=_sorted_participants)

    @classmethod
    def from_inspect(cls, replies: Iterable[tuple[str, int, Sequence[Record]]]) -> Topology:
        """Build from (participant, pid, records), one triple per INSPECT reply."""
        return cls(
            tuple(
                ParticipantTopology(participant, pid, tuple(records))
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
