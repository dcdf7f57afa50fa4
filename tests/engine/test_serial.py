"""The documents' converter (engine/serial.py): each declared shape as written, and a
class declared after the converter was built still written by its shape."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
from cuinterpose import summaries
from cuinterpose.engine import criu, job, manifest, progress, serial
from cuinterpose.engine.events import CopyProgress, StepEvent
from cuinterpose.engine.released import Released


def test_an_event_is_written_with_its_tag_renames_and_flattened_parts() -> None:
    one = progress.ParticipantTransfer("p1", 7, 1, 4096, 0.5, 0.25)
    event = progress.OpEvent(
        "capture", "SAVE_ALLOCATIONS", 1.0, 1,
        progress.Transfer(1, 4096, 2.0, 3.0, (one,)), progress.NativeKept(2, 8192),
    )  # fmt: skip
    assert serial.to_json(event) == {
        "event": "phase", "machine": "capture", "phase": "SAVE_ALLOCATIONS",
        "elapsed_s": 1.0, "participants": 1,
        "allocation_count": 1, "allocation_bytes": 4096, "gb_per_s": 2.0, "copy_gb_per_s": 3.0,
        "per_participant": [{
            "participant": "p1", "pid": 7, "allocation_count": 1, "allocation_bytes": 4096,
            "shim_elapsed_s": 0.5, "copy_s": 0.25, "copy_gb_per_s": 4096 / 0.25 / 1e9,
            "kept": False, "bytes_copied": 0, "bytes_unchanged": 0, "note": "",
        }],
        "bytes_copied": 0, "bytes_unchanged": 0, "notes": [],
        "native_kept_allocations": 2, "native_kept_bytes": 8192,
    }  # fmt: skip
    assert serial.to_json(CopyProgress("SAVE_ALLOCATIONS", 1, 2, 0.5))["phase"] == (
        "SAVE_ALLOCATIONS"
    )
    assert "detail" not in serial.to_json(StepEvent("capture", "started"))
    assert serial.to_json(criu.ImageSize(3, 2, 1)) == {
        "total_bytes": 3, "pages_bytes": 2, "files": 1,
    }  # fmt: skip


def test_a_refusal_names_its_check_only_when_it_has_one() -> None:
    plain = progress.FailedEvent("capture", "failed", "INSPECT", None, None, "gone", 0.5)
    assert list(serial.to_json(plain)) == [
        "event", "machine", "kind", "phase", "participant", "pid", "reason", "elapsed_s",
        "problems",
    ]  # fmt: skip
    refused = attrs.evolve(plain, kind="refused", check="participants_known", rules=("r",))
    written = serial.to_json(refused)
    assert list(written)[-3:] == ["check", "check_title", "rules"]
    assert written["check_title"] == refused.check_title


def test_a_job_outcome_keeps_its_key_order_and_rounds_its_barriers() -> None:
    outcome = job.NodeOutcome("n0", "suspend", 0, ("ok",), "run-1", "", (("armed", 0.1234567),))
    written = serial.to_json(outcome)
    assert list(written) == [
        "node", "verb", "code", "outcome", "run", "decision", "lines", "barriers",
    ]  # fmt: skip
    assert written["barriers"] == [{"barrier": "armed", "seconds": 0.123457}]


def test_a_summary_nests_the_released_memory_and_the_manifest_reads_back(tmp_path: Path) -> None:
    timing = manifest.Timing("capture", 1.5, 10)
    summary = summaries.Summary(
        "suspend", "suspended", 1.5, 10, 2, (timing,), "next", tmp_path, None, Released(2, None)
    )
    written = serial.to_json(summary)
    assert written["timings"] == [{"phase": "capture", "seconds": 1.5, "bytes": 10}]
    assert written["gpu_memory_released"] == Released(2, None).to_json()
    assert written["bytes_in"] == "host memory of each process"
    assert "staging" not in written
    assert "gpu_memory_released" not in serial.to_json(attrs.evolve(summary, released=None))
    group = (manifest.Participant(5, 1, "p"),)
    document = manifest.Manifest(True, True, group, (timing,), "then")
    back = json.loads(json.dumps(serial.to_json(document)))
    assert set(back) == {"version", "cuinterpose", "participants", "timings", "created_at"}
    assert manifest.Manifest.from_json(back, tmp_path) == document


def test_a_class_declared_after_the_converter_was_built_is_written_by_its_shape() -> None:
    serial.to_json(progress.DoneEvent("capture", 0.1, 1, "/c"))  # the converter is built

    @serial.shape(tag={"event": "late"}, rename={"a": "b"}, omit=frozenset({"c"}))
    @attrs.frozen
    class Late:
        a: int
        c: tuple[int, ...] = ()

    assert serial.to_json(Late(1)) == {"event": "late", "b": 1}
    assert serial.to_json(Late(1, (2, 3))) == {"event": "late", "b": 1, "c": [2, 3]}


def test_an_embedder_writes_what_it_is_handed_through_the_engine() -> None:
    from cuinterpose import engine

    assert "to_json" in engine.AGENT_API and engine.to_json is serial.to_json
    assert engine.to_json(engine.Timing("detect", 0.25)) == {
        "phase": "detect", "seconds": 0.25, "bytes": 0,
    }  # fmt: skip
