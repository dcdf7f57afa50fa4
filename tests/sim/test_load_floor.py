"""bench/load_floor.py, LOAD's floor without the shim, on the simulated driver: every case
measured, its runs and its rates reported, the shape's bytes right, on the release build
and under ASan; a driver out of memory ends the probe naming the call and its result;
sizes that leave the probe nothing to do, or thread counts it cannot have, are refused,
saying which; so is a source it does not know."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.simenv import BUILD_DIRS, sim_dir, sim_env

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "bench" / "load_floor.py"
MIB = 1 << 20


def run(*args: str, build: str = "release", mem_mib: int = 0) -> subprocess.CompletedProcess[str]:
    lib = sim_dir(build) / "libcuda.so.1"
    env = sim_env(build, devices=1, extra={"CUINTERPOSE_BUILD_DIR": str(BUILD_DIRS[build])})
    if mem_mib:
        env["CUINTERPOSE_SIM_MEM_MIB"] = str(mem_mib)
    return subprocess.run(
        [sys.executable, str(PROBE), "--libcuda", str(lib), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("build", "source"),
    [("release", "pinned"), ("asan", "pinned"), ("asan", "staged"), ("asan", "piped")],
)
def test_every_case_is_measured_and_its_bytes_are_the_shapes(
    tmp_path: Path, build: str, source: str
) -> None:
    """Staged, the bytes go through each copy thread's two pieces (piped: one pipeline per
    thread across its units), and every MiB of every allocation is checked against its
    source after each run both at once."""
    out = tmp_path / "floor.json"
    done = run("--count", "24", "--mib", "6", "--threads", "3", "1", "--piece-mib", "4",
               "--repeat", "2", "--ceiling-mib", "16", "--out", str(out),
               *(["--source", source] if source != "pinned" else []), build=build)  # fmt: skip
    assert done.returncode == 0, done.stderr
    floor = json.loads(out.read_text())
    assert json.loads(done.stdout) == floor
    assert floor["source"] == source and "ERROR: AddressSanitizer" not in done.stderr
    # Staged, the work is cut as the shim's LOAD chunks (144 MiB over 3 threads x 4: 12,
    # at most an allocation: 6; 1 thread: 6), and the memcpy alone is measured.
    assert floor["unit"] == 6 * MIB
    assert ("memcpy_s" in floor) == (source != "pinned")
    assert (floor["count"], floor["bytes_each"], floor["bytes"]) == (24, 6 * MIB, 144 * MIB)
    assert set(floor["by_threads"]) == {"3", "1"} and floor["threads"] in (3, 1)
    # The floor is the fastest both at once, and its figures are that count's.
    fastest = min(floor["by_threads"].values(), key=lambda r: r["overlap_s"]["median"])
    assert {k: v for k, v in floor.items() if k != "by_threads"} == fastest
    assert (floor["piece"], floor["repeat"]) == (4 * MIB, 2)
    for case in ("recreate", "copy", "overlap", *(["memcpy"] if source != "pinned" else [])):
        runs = floor[f"{case}_s"]["runs"]
        assert len(runs) == 2 and all(r > 0 for r in runs), floor
        assert floor[f"{case}_gbps"] == pytest.approx(
            144 * MIB / floor[f"{case}_s"]["median"] / 1e9
        )
    assert floor["htod_ceiling_gbps"] > 0
    assert floor["overlap_of_htod"] == pytest.approx(
        floor["overlap_gbps"] / floor["htod_ceiling_gbps"]
    )


@pytest.mark.parametrize("name", ["count", "mib", "piece-mib", "repeat"])
def test_a_size_of_nothing_is_refused(name: str) -> None:
    done = run(f"--{name}", "0")
    assert done.returncode == 2 and f"--{name} must be at least 1" in done.stderr, done.stderr


def test_a_driver_out_of_memory_ends_it_naming_the_call() -> None:
    """64 MiB of device memory for 48 allocations of 2 MiB: the re-creation fails, the
    probe says where, undoes what it made (ASan finds nothing left) and fails."""
    done = run("--count", "48", "--mib", "2", "--threads", "2", "--ceiling-mib", "8",
               build="asan", mem_mib=64)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY" in done.stderr, done.stderr
    assert "ERROR: AddressSanitizer" not in done.stderr and "LeakSanitizer" not in done.stderr


@pytest.mark.parametrize("threads", ["0", "65"])
def test_a_thread_count_it_cannot_have_is_refused(threads: str) -> None:
    done = run("--threads", "4", threads)
    assert done.returncode == 2 and "--threads must be from 1 to 64" in done.stderr, done.stderr


def test_a_source_it_does_not_know_is_refused() -> None:
    probe = BUILD_DIRS["release"] / "bench" / "load_floor"
    lib = sim_dir("release") / "libcuda.so.1"
    done = subprocess.run([str(probe), str(lib), "4", "2", "1", "1", "1", "8", "mapped"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2 and "source 'mapped' is not pinned, staged or piped" in done.stderr


@pytest.mark.parametrize("source", ["staged", "piped"])
def test_a_large_allocation_staged_is_cut_over_every_thread(tmp_path: Path, source: str) -> None:
    """One allocation of 32 MiB from staged memory with 4 threads: units of the shim's
    LOAD chunk (32 MiB / 16: 2 MiB), so every thread copies, and every MiB arrives."""
    out = tmp_path / "floor.json"
    done = run("--count", "1", "--mib", "32", "--threads", "4", "--piece-mib", "1",
               "--repeat", "1", "--ceiling-mib", "8", "--source", source, "--out", str(out),
               build="asan")  # fmt: skip
    assert done.returncode == 0, done.stderr
    floor = json.loads(out.read_text())
    assert (floor["unit"], floor["piece"], floor["bytes"]) == (2 * MIB, MIB, 32 * MIB)
