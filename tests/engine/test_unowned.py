"""preflight.unowned_sharing: sharing the shim does not own refuses a capture, and the
refusal names the participant, the call that made the sharing and what to do instead."""

from __future__ import annotations

import pytest
from cuinterpose.engine.validate import preflight, validate
from cuinterpose.engine.wire import Record, RecordKind, Unowned
from topologies import participant, team, with_records

P1 = participant(1)

EXPECTED = {
    Unowned.IPC_EXPORT: ("cuIpcGetMemHandle", "SNAPSHOT_SHIM_OWN_ALLOCATIONS=1"),
    Unowned.IPC_OPEN: ("cuIpcOpenMemHandle", "start the exporter under the shim"),
    Unowned.POOL_EXPORT: ("cuMemPoolExportToShareableHandle", "destroy the pool"),
    Unowned.POOL_IMPORT: ("cuMemPoolImportFromShareableHandle", "destroy the pool"),
}


@pytest.mark.parametrize("kind", list(Unowned))
def test_each_kind_refuses_naming_its_call(kind: Unowned) -> None:
    record = Record(
        kind=RecordKind.UNOWNED_SHARING,
        op_flags=int(kind),
        address=0x7F00_0020_0000,
        size=3 << 20,
        handle_count=2,
    )
    topology = with_records(team(participants=2), P1, record)
    assert validate(topology) == ()  # not a broken topology: one that cannot be rebuilt
    (found,) = preflight(topology)
    call, advice = EXPECTED[kind]
    assert found.rule == "preflight.unowned_sharing"
    assert found.participant == P1 and found.kind is RecordKind.UNOWNED_SHARING
    text = str(found)
    assert text.startswith(f"participant {P1}, UNOWNED_SHARING")
    assert call in text and advice in text
    assert "at 0x7f0000200000, size 0x300000, 2 live" in text


def test_an_unknown_kind_still_refuses() -> None:
    record = Record(kind=RecordKind.UNOWNED_SHARING, op_flags=99)
    (found,) = preflight(with_records(team(participants=2), P1, record))
    assert "sharing of an unknown kind 99" in str(found) and "address unknown" in str(found)


def test_a_team_without_it_passes() -> None:
    assert preflight(team(participants=2)) == ()
