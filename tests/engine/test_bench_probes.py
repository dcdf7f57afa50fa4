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
