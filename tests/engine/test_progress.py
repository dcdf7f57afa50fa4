"""Progress events: figures, JSON and human shapes, the callback printers."""

from __future__ import annotations

import io
import json

import pytest
from cuinterpose.engine.progress import (
    DoneEvent,
    FailedEvent,
    OpEvent,
    Transfer,
    human_line,
    json_line,
    json_printer,
)
from cuinterpose.engine.wire import Stats

A, B, C = "a" * 32, "b" * 32, "c" * 32
GIB = 1 << 30


def test_transfer_sums_participants_and_divides_by_summed_copy_time() -> None:
    transfer = Transfer.from_stats(
        [
            (A, 10, Stats(count=2, bytes=GIB, elapsed_ns=600_000_000, copy_ns=500_000_000)),
            (B, 11, Stats(count=1, bytes=GIB, elapsed_ns=300_000_000, copy_ns=250_000_000)),
            (C, 12, Stats()),  # an importer: nothing to move, no copy time
        ],
        elapsed_s=1.0,
    )
    assert transfer.allocation_count == 3
    assert transfer.allocation_bytes == 2 * GIB
    assert transfer.gb_per_s == pytest.approx(2 * GIB / 1e9)
    assert transfer.copy_gb_per_s == pytest.approx(2 * GIB / 0.75 / 1e9)
    per = {p.participant: p for p in transfer.per_participant}
    assert per[A].copy_gb_per_s == pytest.approx(GIB / 0.5 / 1e9)
    assert per[B].pid == 11 and per[B].shim_elapsed_s == pytest.approx(0.3)
    assert per[C].copy_gb_per_s == 0.0


def test_nothing_moved_reports_zero_not_a_division_by_zero() -> None:
    transfer = Transfer.from_stats([(A, 1, Stats())], elapsed_s=0.0)
    assert (transfer.gb_per_s, transfer.copy_gb_per_s) == (0.0, 0.0)
    # Bytes without measurable copy time (a shim reporting zero) stay finite too.
    odd = Transfer.from_stats([(A, 1, Stats(count=1, bytes=5))], elapsed_s=0.0)
    assert (odd.gb_per_s, odd.copy_gb_per_s) == (0.0, 0.0)
    assert json.loads(json_line(OpEvent("capture", "SAVE_ALLOCATIONS", 0.0, 1, odd)))


def test_phase_event_json_shape() -> None:
    plain = json.loads(json_line(OpEvent("capture", "INSPECT", 0.25, 3)))
    assert plain == {
        "event": "phase",
        "machine": "capture",
        "phase": "INSPECT",
        "elapsed_s": 0.25,
        "participants": 3,
    }
    transfer = Transfer.from_stats([(A, 1, Stats(1, GIB, 10**9, 10**9))], elapsed_s=2.0)
    moved = json.loads(json_line(OpEvent("restore", "LOAD_ALLOCATIONS", 2.0, 1, transfer)))
    assert moved["allocation_count"] == 1 and moved["allocation_bytes"] == GIB
    assert moved["gb_per_s"] == pytest.approx(GIB / 2e9)
    assert moved["copy_gb_per_s"] == pytest.approx(GIB / 1e9)
    assert moved["per_participant"][0]["participant"] == A


def test_done_and_failed_json_shapes() -> None:
    done = json.loads(json_line(DoneEvent("restore", 1.5, 2, "/ckpt")))
    assert done == {
        "event": "done",
        "machine": "restore",
        "elapsed_s": 1.5,
        "participants": 2,
        "checkpoint_dir": "/ckpt",
    }
    failed = json.loads(
        json_line(FailedEvent("capture", "failed", "SAVE_ALLOCATIONS", A, 42, "boom", 0.5, ("x",)))
    )
    assert failed["event"] == "failed"
    assert (failed["phase"], failed["participant"], failed["pid"], failed["reason"]) == (
        "SAVE_ALLOCATIONS",
        A,
        42,
        "boom",
    )
    assert failed["kind"] == "failed" and failed["problems"] == ["x"]


def test_human_lines() -> None:
    assert human_line(OpEvent("capture", "HANDSHAKE", 0.0123, 1)) == (
        "capture HANDSHAKE: 12.3 ms, 1 participant"
    )
    transfer = Transfer.from_stats([(A, 1, Stats(2, 3 * GIB, 10**9, 10**9))], elapsed_s=1.0)
    line = human_line(OpEvent("capture", "SAVE_ALLOCATIONS", 1.0, 2, transfer))
    assert line == (
        "capture SAVE_ALLOCATIONS: 1000.0 ms, 2 participants, 2 allocations (3.00 GiB), "
        "3.22 GB/s end to end, 3.22 GB/s copying"
    )
    assert human_line(DoneEvent("capture", 1.25, 2, "/c")).startswith("capture done in 1.250 s")
    failed = FailedEvent("restore", "refused", "LOAD_ALLOCATIONS", B, 7, "not prepared", 0.1)
    assert human_line(failed) == (
        f"restore refused at LOAD_ALLOCATIONS: participant {B} (pid 7) not prepared"
    )


def test_the_json_printer_writes_one_line_per_event() -> None:
    events = [OpEvent("capture", "HANDSHAKE", 0.001, 2), DoneEvent("capture", 0.1, 2, "/c")]
    out = io.StringIO()
    emit = json_printer(out)
    for event in events:
        emit(event)
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == [
        "phase",
        "done",
    ]


def test_kept_host_copies_count_what_was_copied_and_what_was_not() -> None:
    """A participant whose reply carries a HOST_COPY record (SNAPSHOT_SHIM_KEEP_HOST_COPY)
    copied what the record says; one without copied all its bytes; a SAVE whose hash could
    not run says why, naming the process. The summary says both, JSON and human."""
    from cuinterpose.engine.progress import NativeKept, StagingSummary
    from cuinterpose.engine.wire import HashState, HostCopy

    kept = HostCopy(2 * GIB, 2, 4096, GIB // 4, GIB + 3 * GIB // 4, HashState.COMPARED)
    blind = HostCopy(GIB, 1, 2048, GIB, 0, HashState.UNAVAILABLE)
    why = "SAVE_ALLOCATIONS copied every byte of the kept host copies: cuLaunchKernel failed"
    transfer = Transfer.from_stats(
        [(A, 10, Stats(2, 2 * GIB, 1, 1)), (B, 11, Stats(1, GIB, 1, 1)),
         (C, 12, Stats(1, GIB, 1, 1))],
        elapsed_s=1.0,
        kept={A: (kept, ""), B: (blind, why)},
    )  # fmt: skip
    assert (transfer.bytes_copied, transfer.bytes_unchanged) == (GIB // 4 + 2 * GIB, 7 * GIB // 4)
    assert transfer.notes == (f"pid 11: {why}",)
    moved = json.loads(json_line(OpEvent("capture", "SAVE_ALLOCATIONS", 1.0, 3, transfer)))
    assert (moved["bytes_copied"], moved["bytes_unchanged"]) == (9 * GIB // 4, 7 * GIB // 4)
    summary = StagingSummary.from_phases(
        [OpEvent("capture", "SAVE_ALLOCATIONS", 1.0, 3, transfer), OpEvent("capture", "X", 0, 3)]
    )
    assert summary is not None and summary.native_kept == NativeKept(0, 0)
    assert (summary.bytes_copied, summary.bytes_unchanged, summary.kept) == (
        9 * GIB // 4, 7 * GIB // 4, True
    )  # fmt: skip
    text = summary.human()
    assert "kept host copies: 2.25 GiB copied, 1.75 GiB unchanged" in text, text
    assert f"copied everything, pid 11: {why}" in text
    # Without kept copies: every byte copied, nothing said of them.
    plain = Transfer.from_stats([(A, 1, Stats(1, GIB, 1, 1))], elapsed_s=1.0)
    assert (plain.bytes_copied, plain.bytes_unchanged, plain.notes) == (GIB, 0, ())
    alone = StagingSummary.from_phases([OpEvent("capture", "SAVE_ALLOCATIONS", 1.0, 1, plain)])
    assert alone is not None and "kept host copies" not in alone.human()
