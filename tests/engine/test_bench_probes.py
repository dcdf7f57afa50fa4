"""The machine probes beside the benchmarks (no GPU): bench/storage_rate.py, the storage's
parallel write and read rate a store is compared with, and bench/host_touch.py, a first
touch of fresh memory and page cache against the same touch again, and bench/floor.py's
choice of the floor. Each writes its figures as JSON; the first two refuse sizes that
leave a thread nothing to do, saying so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_storage_rate_writes_reads_and_writes_from_a_large_source(tmp_path: Path) -> None:
    out = tmp_path / "rate.json"
    done = run("storage_rate.py", "--dir", str(tmp_path), "--gib", "0.0625", "--threads", "2",
               "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rate = json.loads(out.read_text())
    assert rate["bytes"] == 64 << 20 and rate["threads"] == 2
    for key in ("write_gbps", "read_gbps", "write_whole_gbps"):
        assert rate[key] > 0, rate
    assert "write from a source as large" in done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["rate.json"]  # its files are gone


def test_the_host_touch_reports_every_round(tmp_path: Path) -> None:
    out = tmp_path / "touch.json"
    done = run("host_touch.py", "--gib", "0.0625", "--file-gib", "0.03125", "--threads", "2",
               "--rounds", "2", "--dir", str(tmp_path), "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    touch = json.loads(out.read_text())
    assert len(touch["touch_gbps"]) == len(touch["write_gbps"]) == 2
    assert all(r > 0 for r in touch["touch_gbps"] + touch["write_gbps"]), touch
    assert "by round" in done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["touch.json"]


@pytest.mark.parametrize(
    ("script", "args", "words"),
    [
        ("storage_rate.py", ["--threads", "0"], "--threads must be at least 1"),
        ("storage_rate.py", ["--gib", "0.001"], "give each thread 8 MiB"),
        ("host_touch.py", ["--rounds", "0"], "--threads and --rounds must be at least 1"),
        ("host_touch.py", ["--file-gib", "0"], "--file-gib 0 gives a thread less than 8 MiB"),
    ],
)
def test_sizes_that_leave_a_thread_nothing_are_refused(
    script: str, args: list[str], words: str
) -> None:
    done = run(script, *args)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_the_floor_never_takes_the_resident_copy_for_it(tmp_path: Path) -> None:
    """bench/floor.py, one run without a GPU: the copy between resident mappings is
    measured beside the floor, but neither the best floor nor the bounce path's
    (``best_memcpy``, the fastest memcpy into fresh memory) may be it: it provides no
    page, and is usually the fastest copy of all."""
    out = tmp_path / "floor.json"
    done = run("floor.py", "--gib", "0.0625", "--threads", "1", "2", "--no-gpu",
               "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    floor = json.loads(out.read_text())
    assert floor["memcpy_resident_2"] > 0, floor
    fresh = [v for k, v in floor.items() if k.startswith("memcpy_thp_")]
    assert floor["best_memcpy"] == max(fresh), floor
    assert floor["best"]["case"] != "memcpy_resident_2", floor


def test_the_sleep_wake_report_reads_what_the_run_writes() -> None:
    """bench/sleep_wake.py (GPU only) reports from its JSON: a result of its shape gives
    every line, the ratios against the native checkpoint and the ceilings."""
    sys.path.insert(0, str(BENCH))
    try:
        import sleep_wake  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(BENCH))
    gib = 1 << 30

    def cyc(sus: float, res: float) -> dict[str, object]:
        return {"suspend": {"seconds": sus}, "resume": {"seconds": res},
                "check": {"ok": True}}  # fmt: skip

    def op(name: str, elapsed: float, copied: int) -> dict[str, object]:
        return {"op": name, "elapsed_s": elapsed, "bytes": 4 * gib, "bytes_copied": copied,
                "hash_s": 0.01}  # fmt: skip

    r, c = 1, 2
    saves = [op("SAVE_ALLOCATIONS", 0.1, 4 * gib)] + [
        op("SAVE_ALLOCATIONS", 0.02, 0) for _ in range(2 * r)
    ] + [op("SAVE_ALLOCATIONS", 0.05, gib) for _ in range(c + r)]  # fmt: skip
    loads = [op("LOAD_ALLOCATIONS", 0.09, 4 * gib) for _ in range(1 + 2 * r + c + r)]
    result = {
        "device": "NVIDIA H200",
        "args": {"repeat": r, "cycles": c, "rewrite_gib": 1.0},
        "ceiling": {"bytes": gib, "dtoh_gbps": {"median": 50.0, "min": 49.0, "max": 51.0},
                    "htod_gbps": {"median": 50.0, "min": 49.0, "max": 51.0}},
        "native": {"job": {"tensor_bytes": 4 * gib}, "cycles": [cyc(4.0, 2.0)]},
        "off": {"command": [cyc(1.0, 0.5)], "library": [cyc(0.5, 0.3)],
                "save": saves[:1], "load": loads[:1]},
        "on": {"pinned_after_s": 3.0, "first": [cyc(0.5, 0.3)],
               "unchanged_command": [cyc(0.4, 0.3)], "unchanged_library": [cyc(0.05, 0.1)],
               "rewritten_library": [cyc(0.08, 0.1)] * c, "rewritten_command": [cyc(0.4, 0.3)],
               "save": saves, "load": loads},
        "vllm": {"cycles": [{"sleep": {"seconds": 0.5}, "wake": {"seconds": 0.25}}]},
        "gen": {"cycles": [cyc(0.1, 0.1)] * 3, "save": saves[:3], "load": loads[:3]},
    }  # fmt: skip
    lines: list[str] = []
    sleep_wake.report(result, lines.append)
    text = "\n".join(lines)
    assert "ceilings (pinned, 1 GiB): DtoH 50.0 [49.0, 51.0] GB/s" in text, text
    assert "1 GiB rewritten" not in text and "1.0 GiB rewritten, library (2 cycles" in text
    assert "suspend 0.080 [0.080, 0.080] s (50.0x the native)" in text, text
    assert "unchanged SAVE: 0.0200 [0.0200, 0.0200] s, held/op 214.7" in text, text
    assert "rewritten SAVE: 0.0500" in text and "copied 1.00 GiB" in text
    assert "vLLM's sleep by hand: sleep 0.500 [0.500, 0.500] s (8.0x the native" in text
    assert "generation and parameters right every time: True" in text
