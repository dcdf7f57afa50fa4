"""The GPU memory a suspend says it released (engine/released.py): the allocations each
process created, shared or private, counted once whichever way their bytes went."""

from __future__ import annotations

from cuinterpose.engine.progress import NativeKept, StagingSummary
from cuinterpose.engine.released import Released, released, size
from cuinterpose.engine.wire import RecordFlag
from topologies import (
    CREATOR_FLAGS,
    GRANULARITY,
    MiB,
    allocation,
    participant,
    resource,
    team,
    with_records,
)


def staging(staged: int, kept: int = 0) -> StagingSummary:
    return StagingSummary(1, staged, 0.1, 1.0, NativeKept(1 if kept else 0, kept))


def test_shared_allocations_and_multicast_members_count_as_shared() -> None:
    # Two 4 MiB allocations imported by the other process; a 2 MiB member each, bound.
    topology = team(participants=2, allocations=2, multicast=True)
    freed = released(topology, None, 2)
    assert freed == Released(2, 12 * MiB, 12 * MiB)
    assert freed.private_bytes == 0
    assert "12.0 MiB (all of it shared) in 2 processes" in freed.human()


def test_a_private_allocation_is_private_and_counted_once_with_its_staging() -> None:
    private = allocation(resource(0x77), participant(1), size=3 * GRANULARITY,
                         flags=CREATOR_FLAGS)  # fmt: skip
    topology = with_records(team(participants=2, allocations=1, multicast=False),
                            participant(1), private)  # fmt: skip
    # The shims staged both (SNAPSHOT_SHIM_STAGE_PRIVATE=1, the default).
    freed = released(topology, staging(10 * MiB), 2)
    assert (freed.tracked_bytes, freed.shared_bytes, freed.private_bytes) == (
        10 * MiB, 4 * MiB, 6 * MiB)  # fmt: skip
    assert "10.0 MiB (4.0 MiB shared, 6.0 MiB private) in 2 processes" in freed.human()
    assert freed.to_json() == {
        "processes": 2,
        "all_device_memory": True,
        "tracked_bytes": 10 * MiB,
        "shared_bytes": 4 * MiB,
        "private_bytes": 6 * MiB,
    }


def test_private_allocations_left_to_the_native_checkpoint_are_counted_from_the_stats() -> None:
    # SNAPSHOT_SHIM_STAGE_PRIVATE=0: the private ones are in no record, only in INSPECT's
    # stats (what the native checkpoint keeps); the shared 4 MiB were staged.
    topology = team(participants=2, allocations=1, multicast=False)
    freed = released(topology, staging(4 * MiB, kept=5 * MiB), 2)
    assert (freed.tracked_bytes, freed.shared_bytes, freed.private_bytes) == (
        9 * MiB, 4 * MiB, 5 * MiB)  # fmt: skip


def test_content_mode_native_counts_the_kept_allocations_once() -> None:
    # Every created allocation is in the records and in the stats; nothing staged.
    topology = team(participants=2, allocations=1, multicast=False)
    freed = released(topology, staging(0, kept=4 * MiB), 2)
    assert (freed.tracked_bytes, freed.shared_bytes) == (4 * MiB, 4 * MiB)


def test_an_importers_record_is_not_a_second_allocation() -> None:
    topology = team(participants=3, allocations=1, multicast=False)
    importer_records = [
        r for p in topology.participants[1:] for r in p.records if RecordFlag.CREATOR not in r.flags
    ]
    assert importer_records  # the allocation is recorded three times, created once
    assert released(topology, None, 3).tracked_bytes == 4 * MiB


def test_without_a_capture_there_is_no_figure_and_the_summary_says_why() -> None:
    native_only = released(None, None, 3)
    assert native_only.tracked_bytes is None
    assert native_only.human() == (
        "GPU memory released: all device memory of 3 processes (the native checkpoint; how "
        "much is not known: no shim tracked their allocations)"
    )
    assert native_only.to_json() == {
        "processes": 3,
        "all_device_memory": True,
        "unknown": "no shim tracked their allocations",
    }


def test_sizes_read_in_binary_units() -> None:
    assert [size(n) for n in (512, 3 << 10, 64 * MiB, 3 << 30)] == [
        "512 B", "3.0 KiB", "64.0 MiB", "3.0 GiB"]  # fmt: skip
