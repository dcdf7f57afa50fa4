"""How much GPU memory a suspend released, from what the shims track.

The native checkpoint releases all device memory of each process it checkpoints:
the allocations the shims track, and what they do not (contexts, modules, pools,
allocations made before the shim was loaded). Only the first is known, and only
through a capture: the allocations each process created, from INSPECT's records
(shared with another process of the group, or private) and its stats (the created
allocations the shims left to the native checkpoint, reported in no record). A
suspend of processes without a shim (the native checkpoint alone) knows no figure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import attrs

from .progress import StagingSummary
from .serial import shape
from .topology import Topology
from .wire import RecordFlag, RecordKind

_GIB: Final = 1 << 30


@attrs.frozen
class Released:
    """The GPU memory a suspend released: ``tracked_bytes`` of allocations the group's
    processes created (``shared_bytes`` of them shared with another process of the
    group), None when nothing was tracked (no capture), in ``processes`` processes."""

    processes: int
    tracked_bytes: int | None
    shared_bytes: int = 0
    # Why there is no figure (tracked_bytes None).
    unknown: str = "no shim tracked their allocations"

    @property
    def private_bytes(self) -> int:
        return (self.tracked_bytes or 0) - self.shared_bytes

    # Hand-written: an either/or document (the reason there is no figure, or the three
    # figures), which no field-by-field shape says as plainly.
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"processes": self.processes, "all_device_memory": True}
        if self.tracked_bytes is None:
            out["unknown"] = self.unknown
        else:
            out.update(
                tracked_bytes=self.tracked_bytes,
                shared_bytes=self.shared_bytes,
                private_bytes=self.private_bytes,
            )
        return out

    def human(self) -> str:
        who = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        if self.tracked_bytes is None:
            return (
                f"GPU memory released: all device memory of {who} (the native checkpoint; "
                f"how much is not known: {self.unknown})"
            )
        split = (
            f" ({size(self.shared_bytes)} shared, {size(self.private_bytes)} private)"
            if self.shared_bytes and self.private_bytes
            else (" (all of it shared)" if self.shared_bytes else "")
        )
        return (
            f"GPU memory released: {size(self.tracked_bytes)}{split} in {who} (the allocations "
            "the shims tracked; the native checkpoint released all device memory of each)"
        )


shape(via=Released.to_json)(Released)


def size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it reaches, one decimal."""
    for unit, scale in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _created(topology: Topology) -> Iterable[tuple[str, bytes, int]]:
    """(creator's participant id, allocation id, size) of every allocation a
    participant reports creating."""
    for participant, record in topology.of_kind(RecordKind.ALLOCATION):
        if RecordFlag.CREATOR in record.flags:
            yield participant, record.id, record.size


def _shared_ids(topology: Topology) -> frozenset[bytes]:
    """Allocations another participant holds (an import) or that are bound into a
    multicast object (its member)."""
    holders: dict[bytes, set[str]] = {}
    for participant, record in topology.of_kind(RecordKind.ALLOCATION):
        holders.setdefault(record.id, set()).add(participant)
    shared = {i for i, who in holders.items() if len(who) > 1}
    shared |= {r.member_id for _, r in topology.of_kind(RecordKind.MC_BINDING) if r.member_id}
    return frozenset(shared)


def released(topology: Topology | None, staging: StagingSummary | None, processes: int) -> Released:
    """What a suspend of ``processes`` released: with the capture's ``topology``, the
    created allocations' bytes (the shims staged them, or the native checkpoint kept
    them: ``staging``'s two figures together count each once, in every content mode);
    without (no capture), no figure."""
    if topology is None:
        return Released(processes, None)
    created = list(_created(topology))
    shared_ids = _shared_ids(topology)
    shared = sum(nbytes for _, i, nbytes in created if i in shared_ids)
    in_records = sum(nbytes for _, _, nbytes in created)
    if staging is None:
        return Released(processes, in_records, shared)
    tracked = staging.allocation_bytes + staging.native_kept.allocation_bytes
    # Every created allocation is staged or kept; a record that is neither (a shim of
    # another build) still counts, never less than the records say.
    return Released(processes, max(tracked, in_records), shared)
