"""The topology predicates (specs/validation.md) as pure functions.

Each ``check_*`` takes a :class:`~.topology.Topology` and returns the violations it
finds (empty when the predicate holds); :func:`validate` and :func:`preflight` run
them all. Capture runs both before its first destructive op, restore runs
:func:`validate` on its final INSPECT. Every violation names the participant, the
record kind and the resource id, so an operator can find the offending process and
allocation. ``specs/validation.md`` says what each rule guards against.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Final

import attrs

from .topology import Topology, resource_hex
from .wire import (
    ACCESS_MAX,
    BindingKind,
    Record,
    RecordFlag,
    RecordKind,
    Unowned,
    is_participant_id,
)

# CUmemAllocationHandleType: the only handle type the shim can move between processes.
HANDLE_TYPE_POSIX_FD: Final = 0x1
# CUmemLocationType values cuMemSetAccess accepts for a descriptor: DEVICE, HOST,
# HOST_NUMA, HOST_NUMA_CURRENT (0 is INVALID/NONE, 5 and 6 never name an access target).
ACCESS_LOCATION_TYPES: Final = frozenset({1, 2, 3, 4})
LOCATION_TYPE_DEVICE: Final = 1
# CUmemAccess_flags that grant access: PROT_READ, PROT_READWRITE (PROT_NONE grants none).
ACCESS_FLAGS: Final = frozenset({0x1, 0x3})
# MC_BINDING api_version: 1 for cuMulticastBindMem/BindAddr, 2 for the _v2 binds.
BIND_API_VERSIONS: Final = frozenset({1, 2})

_MC_USERS: Final = (RecordKind.MC_DEVICE, RecordKind.MC_BINDING, RecordKind.MC_MAPPING)
_MAPPING_KINDS: Final = (RecordKind.MAPPING, RecordKind.MC_MAPPING)
_START_END: Final = operator.itemgetter(0, 1)
# Flag bits tested as int(flags) & bit: what ``FLAG in flags`` answers, without
# going through enum.Flag's Python-level operators for every record.
_CREATOR: Final = int(RecordFlag.CREATOR)
_HANDLE_LIVE: Final = int(RecordFlag.HANDLE_LIVE)
_CONTENT: Final = int(RecordFlag.CONTENT)
_ADDRESS_SPACE_END: Final = 1 << 64


@attrs.frozen
class Violation:
    """One predicate that does not hold, and where."""

    rule: str
    participant: str
    kind: RecordKind | None
    resource: str
    reason: str

    def __str__(self) -> str:
        where = f"participant {self.participant}" if self.participant else "the group"
        if self.kind is not None:
            where += f", {self.kind.name}"
        if self.resource:
            where += f" {self.resource}"
        return f"{where}: {self.reason} [{self.rule}]"


Check = Callable[[Topology], tuple[Violation, ...]]


def _violation(rule: str, participant: str, record: Record, reason: str) -> Violation:
    return Violation(rule, participant, record.kind, resource_hex(record.id), reason)


def _of_kind(topology: Topology, *kinds: RecordKind) -> Iterator[tuple[str, Record]]:
    return iter(topology.of_kind(*kinds))


def _by_resource(topology: Topology, kind: RecordKind) -> Mapping[bytes, list[tuple[str, Record]]]:
    """Resource id -> every (participant, record) of ``kind`` with that id, in order.

    Computed once per topology and kind, and shared by the predicates: read only."""

    def build(topology: Topology) -> Mapping[bytes, list[tuple[str, Record]]]:
        grouped: dict[bytes, list[tuple[str, Record]]] = {}
        for participant, record in topology.of_kind(kind):
            group = grouped.get(record.id)
            if group is None:
                grouped[record.id] = [(participant, record)]
            else:
                group.append((participant, record))
        return MappingProxyType(grouped)

    return topology.derived(("by_resource", kind), build)


def _own(topology: Topology, kind: RecordKind) -> Mapping[tuple[str, bytes], Record]:
    """(participant, resource id) -> that participant's record of ``kind`` (the first one).

    Computed once per topology and kind, and shared by the predicates: read only."""

    def build(topology: Topology) -> Mapping[tuple[str, bytes], Record]:
        own: dict[tuple[str, bytes], Record] = {}
        for participant, record in topology.of_kind(kind):
            own.setdefault((participant, record.id), record)
        return MappingProxyType(own)

    return topology.derived(("own", kind), build)


def _names(participants: Iterable[str]) -> str:
    return ", ".join(sorted(set(participants))) or "nobody"


# --- participants -----------------------------------------------------------------


def check_participant_ids(topology: Topology) -> tuple[Violation, ...]:
    """Participant ids are 32 lowercase hex digits and no two participants share one."""
    found: list[Violation] = []
    seen: dict[str, int] = defaultdict(int)
    for p in topology.participants:
        seen[p.participant] += 1
        if not is_participant_id(p.participant):
            found.append(
                Violation(
                    "participants.id_format",
                    p.participant,
                    None,
                    "",
                    f"participant id {p.participant!r} (pid {p.pid}) is not 32 lowercase"
                    " hex digits",
                )
            )
    for participant, count in seen.items():
        if count > 1:
            pids = ", ".join(
                str(p.pid) for p in topology.participants if p.participant == participant
            )
            found.append(
                Violation(
                    "participants.unique",
                    participant,
                    None,
                    "",
                    f"participant id is reported by {count} processes (pids {pids})",
                )
            )
    return tuple(found)


def check_resource_ids(topology: Topology) -> tuple[Violation, ...]:
    """Allocation and multicast records carry a resource id; the shim never uses all zero."""
    shared = (
        RecordKind.ALLOCATION,
        RecordKind.MAPPING,
        RecordKind.MC_OBJECT,
        *_MC_USERS,
    )
    return tuple(
        _violation("records.resource_id", p, r, "resource id is all zero")
        for p, r in _of_kind(topology, *shared)
        if not r.id.strip(b"\0")  # all zero (any(r.id) would walk it in Python)
    )


def check_duplicate_records(topology: Topology) -> tuple[Violation, ...]:
    """A participant reports each allocation and each multicast object once."""
    found: list[Violation] = []
    for kind in (RecordKind.ALLOCATION, RecordKind.MC_OBJECT):
        counts: dict[tuple[str, bytes], int] = {}
        for participant, record in _of_kind(topology, kind):
            key = (participant, record.id)
            count = counts[key] = counts.get(key, 0) + 1
            if count == 2:
                found.append(
                    _violation(
                        "records.duplicate",
                        participant,
                        record,
                        f"the participant reports this {kind.name} more than once",
                    )
                )
    return tuple(found)


# --- unicast ----------------------------------------------------------------------


def _absent_creator(topology: Topology, group: list[tuple[str, Record]]) -> str:
    """The creator every record of ``group`` names when no record is the creator's and
    that creator is no participant of the group (its process gone, or not named); ""
    otherwise."""
    if any(int(r.flags) & _CREATOR for _, r in group):
        return ""
    named = {r.creator for _, r in group}
    if len(named) != 1:
        return ""
    creator = named.pop()
    return creator if creator and creator not in topology.participant_ids else ""


def _single_creator(
    topology: Topology, kind: RecordKind, rule: str, noun: str
) -> tuple[Violation, ...]:
    found: list[Violation] = []
    for group in _by_resource(topology, kind).values():
        creators = [p for p, r in group if int(r.flags) & _CREATOR]
        if len(creators) == 1:
            continue
        if kind is RecordKind.ALLOCATION and _absent_creator(topology, group):
            continue  # check_creator_absent says it once per importer and creator
        if not creators:
            participant, record = group[0]
            reporters = _names(p for p, _ in group)
            named = _names(r.creator for _, r in group if r.creator)
            found.append(
                _violation(
                    rule,
                    participant,
                    record,
                    f"no participant reports creating this {noun} (reported by {reporters};"
                    f" records name creator {named})",
                )
            )
        elif len(creators) > 1:
            for participant, record in group:
                if RecordFlag.CREATOR in record.flags:
                    found.append(
                        _violation(
                            rule,
                            participant,
                            record,
                            f"{len(creators)} participants claim to have created this {noun}"
                            f" ({_names(creators)})",
                        )
                    )
    return tuple(found)


def check_single_creator(topology: Topology) -> tuple[Violation, ...]:
    """Every shared allocation has exactly one creator (CREATOR flag) in the team."""
    return _single_creator(topology, RecordKind.ALLOCATION, "unicast.single_creator", "allocation")


def check_creator_absent(topology: Topology) -> tuple[Violation, ...]:
    """Every allocation a participant imported was created by a participant of the group.

    An import whose creator is in no process of the group (its creator exited while the
    import stayed open, or was not named) has nobody to re-create its memory on restore:
    one violation per importer and absent creator, naming the allocations, instead of
    one per allocation and rule."""
    imports: dict[tuple[str, str], list[Record]] = {}
    for group in _by_resource(topology, RecordKind.ALLOCATION).values():
        creator = _absent_creator(topology, group)
        for participant, record in group if creator else ():
            imports.setdefault((participant, creator), []).append(record)
    found: list[Violation] = []
    for (participant, creator), records in imports.items():
        ids = ", ".join(resource_hex(r.id) for r in records)
        count = f"{len(records)} allocation{'s' if len(records) > 1 else ''}"
        found.append(
            Violation(
                "unicast.creator_absent",
                participant,
                RecordKind.ALLOCATION,
                ids,
                f"imports {count} whose creator, participant {creator}, is in no process"
                " of the group: its process is gone (or was not named), and nobody could"
                " re-create the memory on restore. Close the imports in this process"
                " (cuIpcCloseMemHandle of each opened pointer; a VMM import: cuMemUnmap and"
                " cuMemRelease), or name the creator's process too if it runs",
            )
        )
    return tuple(found)


def _creator_agreement(topology: Topology, kind: RecordKind, rule: str) -> tuple[Violation, ...]:
    found: list[Violation] = []
    for group in _by_resource(topology, kind).values():
        for participant, record in group:
            if int(record.flags) & _CREATOR and record.creator != participant:
                found.append(
                    _violation(
                        rule,
                        participant,
                        record,
                        f"record has the CREATOR flag but names creator {record.creator!r}",
                    )
                )
        creators = {r.creator for _, r in group}
        if len(creators) > 1:
            for participant, record in group:
                found.append(
                    _violation(
                        rule,
                        participant,
                        record,
                        f"names creator {record.creator!r}; the group's records name"
                        f" {_names(repr(c) for c in creators)}",
                    )
                )
    return tuple(found)


def check_allocation_creator(topology: Topology) -> tuple[Violation, ...]:
    """All ALLOCATION records of one id name the same creator, the one flagged CREATOR."""
    return _creator_agreement(topology, RecordKind.ALLOCATION, "unicast.creator_agreement")


def _field_agreement(
    topology: Topology, kind: RecordKind, field: str, rule: str
) -> tuple[Violation, ...]:
    found: list[Violation] = []
    for group in _by_resource(topology, kind).values():
        values = {getattr(r, field) for _, r in group}
        if len(values) > 1:
            listing = ", ".join(f"{p}: {getattr(r, field)}" for p, r in group)
            for participant, record in group:
                found.append(
                    _violation(
                        rule,
                        participant,
                        record,
                        f"{field} {getattr(record, field)} disagrees with the other"
                        f" processes' records ({listing})",
                    )
                )
    return tuple(found)


def check_allocation_size(topology: Topology) -> tuple[Violation, ...]:
    """An allocation is non-empty and every participant reports the same size for it."""
    empty = tuple(
        _violation("unicast.size", p, r, "allocation size is 0")
        for p, r in _of_kind(topology, RecordKind.ALLOCATION)
        if r.size == 0
    )
    return empty + _field_agreement(topology, RecordKind.ALLOCATION, "size", "unicast.size")


def _handle_type(
    topology: Topology, kind: RecordKind, rule: str, noun: str
) -> tuple[Violation, ...]:
    found: list[Violation] = []
    for group in _by_resource(topology, kind).values():
        shared = len({p for p, _ in group}) > 1
        for participant, record in group:
            if record.handle_types & ~HANDLE_TYPE_POSIX_FD:
                found.append(
                    _violation(
                        rule,
                        participant,
                        record,
                        f"handle_types {record.handle_types:#x}: only POSIX file descriptors"
                        f" ({HANDLE_TYPE_POSIX_FD:#x}) can be re-exported on restore",
                    )
                )
            elif shared and record.handle_types != HANDLE_TYPE_POSIX_FD:
                found.append(
                    _violation(
                        rule,
                        participant,
                        record,
                        f"{noun} is shared between participants but handle_types is"
                        f" {record.handle_types:#x}, not POSIX file descriptor"
                        f" ({HANDLE_TYPE_POSIX_FD:#x})",
                    )
                )
    return tuple(found)


def check_allocation_handle_type(topology: Topology) -> tuple[Violation, ...]:
    """Handle types agree and are POSIX FD (0 only for an allocation no one imported)."""
    return _field_agreement(
        topology, RecordKind.ALLOCATION, "handle_types", "unicast.handle_type"
    ) + _handle_type(topology, RecordKind.ALLOCATION, "unicast.handle_type", "allocation")


def check_creator_holds(topology: Topology) -> tuple[Violation, ...]:
    """The creator still holds a handle (HANDLE_LIVE) or a mapping of what it created:
    without either the driver may already have freed the memory."""
    # Only a creator without HANDLE_LIVE needs its mappings looked up.
    suspects = [
        (p, r)
        for p, r in _of_kind(topology, RecordKind.ALLOCATION)
        if int(r.flags) & (_CREATOR | _HANDLE_LIVE) == _CREATOR
    ]
    if not suspects:
        return ()
    mapped = {(p, r.id) for p, r in _of_kind(topology, RecordKind.MAPPING)}
    return tuple(
        _violation(
            "unicast.creator_holds",
            p,
            r,
            "the creator holds neither a live handle (HANDLE_LIVE) nor a mapping",
        )
        for p, r in suspects
        if (p, r.id) not in mapped
    )


def check_content(topology: Topology) -> tuple[Violation, ...]:
    """CONTENT (who saves and loads the bytes) is on the creator's record, exactly once."""
    found: list[Violation] = []
    for group in _by_resource(topology, RecordKind.ALLOCATION).values():
        holders = [(p, r) for p, r in group if int(r.flags) & _CONTENT]
        for participant, record in holders:
            if not int(record.flags) & _CREATOR:
                found.append(
                    _violation(
                        "unicast.content",
                        participant,
                        record,
                        "CONTENT is set on a participant that did not create the allocation",
                    )
                )
        if not holders and not _absent_creator(topology, group):
            creators = [(p, r) for p, r in group if int(r.flags) & _CREATOR]
            participant, record = creators[0] if creators else group[0]
            found.append(
                _violation(
                    "unicast.content",
                    participant,
                    record,
                    "no participant saves this allocation's bytes (no CONTENT flag)",
                )
            )
        elif len(holders) > 1:
            for participant, record in holders:
                found.append(
                    _violation(
                        "unicast.content",
                        participant,
                        record,
                        f"CONTENT is set by {len(holders)} participants"
                        f" ({_names(p for p, _ in holders)}); the bytes would be loaded twice",
                    )
                )
    return tuple(found)


# --- mappings -----------------------------------------------------------------------


def check_mapping_allocation(topology: Topology) -> tuple[Violation, ...]:
    """Every MAPPING maps an allocation the same participant reported."""
    known = _own(topology, RecordKind.ALLOCATION)
    return tuple(
        _violation(
            "mapping.unknown_allocation",
            p,
            r,
            f"mapping at {r.address:#x} refers to an allocation the participant did not report",
        )
        for p, r in _of_kind(topology, RecordKind.MAPPING)
        if (p, r.id) not in known
    )


def check_mapping_empty(topology: Topology) -> tuple[Violation, ...]:
    """Mappings (unicast and multicast) have a non-zero size and address."""
    found: list[Violation] = []
    for p, r in _of_kind(topology, RecordKind.MAPPING, RecordKind.MC_MAPPING):
        if r.size == 0:
            found.append(_violation("mapping.empty", p, r, f"mapping at {r.address:#x} has size 0"))
        if r.address == 0:
            found.append(_violation("mapping.empty", p, r, "mapping has address 0"))
    return tuple(found)


def check_mapping_bounds(topology: Topology) -> tuple[Violation, ...]:
    """offset + size of a MAPPING lies inside the participant's allocation."""
    known = _own(topology, RecordKind.ALLOCATION)
    found: list[Violation] = []
    for p, r in _of_kind(topology, RecordKind.MAPPING):
        allocation = known.get((p, r.id))
        if allocation is not None and r.offset + r.size > allocation.size:
            found.append(
                _violation(
                    "mapping.bounds",
                    p,
                    r,
                    f"mapping at {r.address:#x} covers offset {r.offset:#x} + size {r.size:#x},"
                    f" beyond the allocation's size {allocation.size:#x}",
                )
            )
    return tuple(found)


def check_mapping_overlap(topology: Topology) -> tuple[Violation, ...]:
    """A participant's mappings (MAPPING and MC_MAPPING) do not overlap in address space."""
    found: list[Violation] = []
    for participant in topology.participants:
        ranges = sorted(
            (
                (r.address, r.address + r.size, r)
                for r in participant.records
                if r.kind in _MAPPING_KINDS and r.size
            ),
            key=_START_END,
        )
        reach_end, reach = 0, None
        for start, end, record in ranges:
            if reach is not None and start < reach_end:
                found.append(
                    _violation(
                        "mapping.overlap",
                        participant.participant,
                        record,
                        f"mapping [{start:#x}, {end:#x}) overlaps {reach.kind.name}"
                        f" {resource_hex(reach.id)} at [{reach.address:#x},"
                        f" {reach.address + reach.size:#x})",
                    )
                )
            if end > reach_end:
                reach_end, reach = end, record
        for start, end, record in ranges:
            if end > _ADDRESS_SPACE_END:
                found.append(
                    _violation(
                        "mapping.overlap",
                        participant.participant,
                        record,
                        f"mapping at {start:#x} of size {record.size:#x} wraps the address space",
                    )
                )
    return tuple(found)


def check_mapping_access(topology: Topology) -> tuple[Violation, ...]:
    """At most 8 access descriptors per mapping, each a known location type and a granting
    flag, no location listed twice (the shim merges per location)."""
    found: list[Violation] = []
    for p, r in _of_kind(topology, RecordKind.MAPPING, RecordKind.MC_MAPPING):
        if len(r.access) > ACCESS_MAX:
            found.append(
                _violation(
                    "mapping.access",
                    p,
                    r,
                    f"{len(r.access)} access descriptors, at most {ACCESS_MAX}",
                )
            )
        seen: set[tuple[int, int]] = set()
        for n, a in enumerate(r.access):
            problem = ""
            if a.location_type not in ACCESS_LOCATION_TYPES:
                problem = f"unknown location type {a.location_type}"
            elif a.location_type == LOCATION_TYPE_DEVICE and a.location_id < 0:
                problem = f"device location id {a.location_id} is negative"
            elif a.flags not in ACCESS_FLAGS:
                problem = f"flags {a.flags:#x} are neither READ (0x1) nor READWRITE (0x3)"
            elif (a.location_type, a.location_id) in seen:
                problem = f"location (type {a.location_type}, id {a.location_id}) listed twice"
            seen.add((a.location_type, a.location_id))
            if problem:
                found.append(
                    _violation(
                        "mapping.access",
                        p,
                        r,
                        f"access descriptor {n} of mapping at {r.address:#x}: {problem}",
                    )
                )
    return tuple(found)


# --- multicast ----------------------------------------------------------------------

_MC_PROPERTIES: Final = ("size", "handle_types", "num_devices", "object_flags")


def check_multicast_properties(topology: Topology) -> tuple[Violation, ...]:
    """MC_OBJECT size, handle types, device count and flags agree across the team, the
    size and device count are non-zero, and every record names the same creator."""
    found: list[Violation] = []
    for field in _MC_PROPERTIES:
        found.extend(
            _field_agreement(topology, RecordKind.MC_OBJECT, field, "multicast.properties")
        )
    for p, r in _of_kind(topology, RecordKind.MC_OBJECT):
        if r.size == 0 or r.num_devices == 0:
            found.append(
                _violation(
                    "multicast.properties",
                    p,
                    r,
                    f"size {r.size} and num_devices {r.num_devices} must both be non-zero",
                )
            )
    found.extend(_creator_agreement(topology, RecordKind.MC_OBJECT, "multicast.properties"))
    found.extend(
        _handle_type(topology, RecordKind.MC_OBJECT, "multicast.properties", "multicast object")
    )
    return tuple(found)


def check_multicast_single_creator(topology: Topology) -> tuple[Violation, ...]:
    """Every multicast object has exactly one creator (CREATOR flag) in the team."""
    return _single_creator(
        topology, RecordKind.MC_OBJECT, "multicast.single_creator", "multicast object"
    )


def check_multicast_object_known(topology: Topology) -> tuple[Violation, ...]:
    """MC_DEVICE, MC_BINDING and MC_MAPPING refer to an MC_OBJECT the same participant
    reported: restore needs that participant's handle to the object to replay them."""
    known = _own(topology, RecordKind.MC_OBJECT)
    return tuple(
        _violation(
            "multicast.unknown_object",
            p,
            r,
            "refers to a multicast object the participant did not report",
        )
        for p, r in _of_kind(topology, *_MC_USERS)
        if (p, r.id) not in known
    )


def check_multicast_devices(topology: Topology) -> tuple[Violation, ...]:
    """The devices added to an object across the team are unique and exactly num_devices.

    Device ordinals are compared across processes, so this assumes every participant
    sees the same device numbering (no per-process CUDA_VISIBLE_DEVICES reordering)."""
    found: list[Violation] = []
    objects = _by_resource(topology, RecordKind.MC_OBJECT)
    devices = _by_resource(topology, RecordKind.MC_DEVICE)
    for resource, added in devices.items():
        owners: dict[int, list[str]] = defaultdict(list)
        for participant, record in added:
            owners[record.device].append(participant)
        for participant, record in added:
            if len(owners[record.device]) > 1:
                found.append(
                    _violation(
                        "multicast.devices",
                        participant,
                        record,
                        f"device {record.device} is added {len(owners[record.device])} times"
                        f" (by {', '.join(sorted(owners[record.device]))})",
                    )
                )
        expected = {r.num_devices for _, r in objects.get(resource, [])}
        # Disagreeing or missing objects are reported by their own predicates.
        if len(expected) == 1:
            (num_devices,) = expected
            if len(owners) != num_devices:
                participant, record = objects[resource][0]
                found.append(
                    _violation(
                        "multicast.devices",
                        participant,
                        record,
                        f"{len(owners)} distinct devices added ({sorted(owners)}),"
                        f" the object was created for {num_devices}",
                    )
                )
    for resource, group in objects.items():
        if resource not in devices:
            participant, record = group[0]
            found.append(
                _violation(
                    "multicast.devices",
                    participant,
                    record,
                    f"no participant added a device; the object was created for"
                    f" {record.num_devices}",
                )
            )
    return tuple(found)


def check_multicast_device_bindings(topology: Topology) -> tuple[Violation, ...]:
    """Every added device has a binding, and every binding is on an added device (the
    driver's bind waits until the team is complete, so either gap hangs restore)."""
    added = {(r.id, r.device) for _, r in _of_kind(topology, RecordKind.MC_DEVICE)}
    bound = {(r.id, r.device) for _, r in _of_kind(topology, RecordKind.MC_BINDING)}
    found = [
        _violation("multicast.device_binding", p, r, f"device {r.device} has no binding")
        for p, r in _of_kind(topology, RecordKind.MC_DEVICE)
        if (r.id, r.device) not in bound
    ]
    found.extend(
        _violation(
            "multicast.device_binding",
            p,
            r,
            f"binding on device {r.device}, which no participant added to the object",
        )
        for p, r in _of_kind(topology, RecordKind.MC_BINDING)
        if (r.id, r.device) not in added
    )
    return tuple(found)


def _inside_object(
    topology: Topology, kind: RecordKind, rule: str, noun: str, *, check_empty: bool
) -> tuple[Violation, ...]:
    objects = _own(topology, RecordKind.MC_OBJECT)
    found: list[Violation] = []
    for p, r in _of_kind(topology, kind):
        if check_empty and r.size == 0:
            found.append(_violation(rule, p, r, f"{noun} has size 0"))
        mc = objects.get((p, r.id))
        if mc is not None and r.offset + r.size > mc.size:
            found.append(
                _violation(
                    rule,
                    p,
                    r,
                    f"{noun} covers offset {r.offset:#x} + size {r.size:#x}, beyond the"
                    f" multicast object's size {mc.size:#x}",
                )
            )
    return tuple(found)


def check_multicast_binding_bounds(topology: Topology) -> tuple[Violation, ...]:
    """Bindings are non-empty and lie inside the multicast object."""
    return _inside_object(
        topology, RecordKind.MC_BINDING, "multicast.binding_bounds", "binding", check_empty=True
    )


def check_multicast_mapping_bounds(topology: Topology) -> tuple[Violation, ...]:
    """MC_MAPPINGs lie inside the multicast object (mapping.empty covers their size)."""
    return _inside_object(
        topology, RecordKind.MC_MAPPING, "multicast.mapping_bounds", "mapping", check_empty=False
    )


def check_binding_kind(topology: Topology) -> tuple[Violation, ...]:
    """Each binding says how to replay it: BIND_MEM or BIND_ADDR, API version 1 or 2."""
    found: list[Violation] = []
    for p, r in _of_kind(topology, RecordKind.MC_BINDING):
        if r.binding_kind is BindingKind.NONE:
            found.append(
                _violation(
                    "multicast.binding_kind", p, r, "binding_kind is neither BIND_MEM nor BIND_ADDR"
                )
            )
        if r.api_version not in BIND_API_VERSIONS:
            found.append(
                _violation(
                    "multicast.binding_kind",
                    p,
                    r,
                    f"api_version {r.api_version} is neither 1 nor 2",
                )
            )
    return tuple(found)


def check_bind_mem_members(topology: Topology) -> tuple[Violation, ...]:
    """A BIND_MEM member is an allocation the binding participant reported, and
    member_offset + size fits inside it."""
    known = _own(topology, RecordKind.ALLOCATION)
    found: list[Violation] = []
    for p, r in _of_kind(topology, RecordKind.MC_BINDING):
        if r.binding_kind is not BindingKind.BIND_MEM:
            continue
        member = known.get((p, r.member_id))
        if member is None:
            found.append(
                _violation(
                    "multicast.bind_mem_member",
                    p,
                    r,
                    f"member allocation {resource_hex(r.member_id) or '0'} on device {r.device}"
                    " is not an allocation the participant reported",
                )
            )
        elif r.member_offset + r.size > member.size:
            found.append(
                _violation(
                    "multicast.bind_mem_member",
                    p,
                    r,
                    f"member_offset {r.member_offset:#x} + size {r.size:#x} is beyond member"
                    f" allocation {resource_hex(r.member_id)} of size {member.size:#x}",
                )
            )
    return tuple(found)


def check_bind_addr(topology: Topology) -> tuple[Violation, ...]:
    """A BIND_ADDR binding has the (non-zero) address it binds."""
    return tuple(
        _violation(
            "multicast.bind_addr", p, r, f"BIND_ADDR binding on device {r.device} has address 0"
        )
        for p, r in _of_kind(topology, RecordKind.MC_BINDING)
        if r.binding_kind is BindingKind.BIND_ADDR and r.address == 0
    )


# --- preflight ----------------------------------------------------------------------


def _size_text(record: Record) -> str:
    return f"size {record.size:#x}" if record.size else "size unknown"


def check_raw_imports(topology: Topology) -> tuple[Violation, ...]:
    """A live import the shim could not resolve (the application imported a raw FD): its
    creator is unknown, so it can be neither torn down nor rebuilt."""
    return tuple(
        _violation(
            "preflight.raw_import",
            p,
            r,
            f"imports memory through a file descriptor the shim did not hand out"
            f" ({_size_text(r)}, handle_types {r.handle_types:#x}), so whose memory it is"
            f" and how to rebuild it are unknown: run the exporting process under the shim"
            f" too (cuinterpose launch) and import the descriptor it exported",
        )
        for p, r in _of_kind(topology, RecordKind.RAW_IMPORT)
    )


def check_unsupported_exportables(topology: Topology) -> tuple[Violation, ...]:
    """A live allocation or multicast object exportable through a handle type other than
    POSIX FD: it may be shared in ways the shim cannot see or restore."""
    return tuple(
        _violation(
            "preflight.unsupported_exportable",
            p,
            r,
            f"holds memory exportable as handle_types {r.handle_types:#x}, not POSIX file"
            f" descriptors only ({_size_text(r)}, location type {r.location_type}"
            f" id {r.location_id}): it may be shared in ways the shim cannot see or rebuild;"
            f" create it exportable as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only",
        )
        for p, r in _of_kind(topology, RecordKind.UNSUPPORTED_EXPORTABLE)
    )


_OWN_IT: Final = (
    "run it under the shim with cudaMalloc memory owned (SNAPSHOT_SHIM_OWN_ALLOCATIONS=1, the"
    " default, owns requests of at least 2 MiB; SNAPSHOT_SHIM_OWN_SMALL=1 owns smaller ones"
    " too, at 2 MiB of device memory each), or share VMM memory instead (PyTorch:"
    " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
)
_UNOWNED_TEXT: Final[Mapping[int, str]] = {
    Unowned.IPC_EXPORT: (
        "cuIpcGetMemHandle of memory the driver allocated, not the shim: such a handle no"
        " longer opens once the process went through the native checkpoint; " + _OWN_IT
    ),
    Unowned.IPC_OPEN: (
        "cuIpcOpenMemHandle of a handle the shim did not hand out (its exporter runs without"
        " the shim, or without owned memory): the native restore of this process fails; start"
        " the exporter under the shim too (cuinterpose launch), with cudaMalloc memory owned"
    ),
    Unowned.POOL_EXPORT: (
        "a stream-ordered memory pool shared by cuMemPoolExportToShareableHandle or"
        " cuMemPoolExportPointer: the shim does not own pool memory and cannot rebuild the"
        " sharing; share memory from cudaMalloc or cuMemCreate instead, or destroy the pool"
    ),
    Unowned.POOL_IMPORT: (
        "a stream-ordered memory pool imported by cuMemPoolImportFromShareableHandle or"
        " cuMemPoolImportPointer: the shim does not own pool memory and cannot rebuild the"
        " sharing; share memory from cudaMalloc or cuMemCreate instead, or destroy the pool"
    ),
}


def _unowned_where(record: Record) -> str:
    where = f"at {record.address:#x}" if record.address else "address unknown"
    if record.size:
        where += f", size {record.size:#x}"
    return f"{where}, {record.handle_count} live"


def check_unowned_sharing(topology: Topology) -> tuple[Violation, ...]:
    """Sharing the shim does not own (legacy IPC of driver memory, pools shared between
    processes): neither the shim nor the native checkpoint can rebuild it."""
    return tuple(
        _violation(
            "preflight.unowned_sharing",
            p,
            r,
            f"{_UNOWNED_TEXT.get(r.op_flags, f'sharing of an unknown kind {r.op_flags}')}"
            f" ({_unowned_where(r)})",
        )
        for p, r in _of_kind(topology, RecordKind.UNOWNED_SHARING)
    )


def _left_out(record: Record) -> str:
    who = (
        f"the process with pid {record.pid} (as this process sees it; participant {record.fetcher})"
        if record.pid
        else f"a process this one cannot see (participant {record.fetcher})"
    )
    return (
        f"{who} imported this allocation and is not among the processes named: name it"
        " too, or stop it first"
    )


def check_whole_team(topology: Topology) -> tuple[Violation, ...]:
    """A participant that fetched a creator's allocation (the creator's FETCH record, for
    a process still alive) is in the team: left out, it would keep mapping memory that
    the capture tears down and the restore replaces, or lose it under its feet."""
    members = frozenset(topology.participant_ids)
    return tuple(
        Violation(
            "preflight.whole_team", p, RecordKind.ALLOCATION, resource_hex(r.id), _left_out(r)
        )
        for p, r in topology.fetches()
        if r.fetcher not in members
    )


TOPOLOGY_CHECKS: Final[tuple[Check, ...]] = (
    check_participant_ids,
    check_resource_ids,
    check_duplicate_records,
    check_single_creator,
    check_creator_absent,
    check_allocation_creator,
    check_allocation_size,
    check_allocation_handle_type,
    check_creator_holds,
    check_content,
    check_mapping_allocation,
    check_mapping_empty,
    check_mapping_bounds,
    check_mapping_overlap,
    check_mapping_access,
    check_multicast_properties,
    check_multicast_single_creator,
    check_multicast_object_known,
    check_multicast_devices,
    check_multicast_device_bindings,
    check_multicast_binding_bounds,
    check_multicast_mapping_bounds,
    check_binding_kind,
    check_bind_mem_members,
    check_bind_addr,
)
PREFLIGHT_CHECKS: Final[tuple[Check, ...]] = (
    check_raw_imports,
    check_unsupported_exportables,
    check_unowned_sharing,
    check_whole_team,
)


def _run(checks: Iterable[Check], topology: Topology) -> tuple[Violation, ...]:
    return tuple(v for check in checks for v in check(topology))


def validate(topology: Topology) -> tuple[Violation, ...]:
    """Every topology predicate (participants, unicast, mappings, multicast)."""
    return _run(TOPOLOGY_CHECKS, topology)


def preflight(topology: Topology) -> tuple[Violation, ...]:
    """What refuses a capture outright: RAW_IMPORT, UNSUPPORTED_EXPORTABLE and UNOWNED_SHARING
    records, and a live participant that fetched a team member's allocation but is not in
    the team."""
    return _run(PREFLIGHT_CHECKS, topology)
