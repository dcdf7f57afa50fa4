"""The kept host copy's chunk hash (shim_c/keephash.h): one definition, three readings.

The known-answer vectors (tests/keephash/vectors.json) are what the Python reading
(tests/keephash/reference.py) computes; the simulated driver's C twin, run by launching the
PTX the shim carries as the shim launches it (tests/keephash/run.py), gives the same, and so
must the GPU (tests/gpu/test_keep_hash.py). The PTX is the current nvcc output of
shim_c/kernels/keep_hash.cu (where that nvcc is here) and assembles for sm_75 and sm_90
(where ptxas is). A change of any one word changes both halves of its chunk's hash.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.keephash import reference
from tests.simenv import sim_env

REPO = Path(__file__).resolve().parents[2]
CUDA_BIN = Path("/usr/local/cuda/bin")


def tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidate = CUDA_BIN / name
    return str(candidate) if candidate.is_file() else None


def expected() -> list[list[list[str]]]:
    return [v["hashes"] for v in reference.vectors()]  # type: ignore[misc]


def test_the_reference_gives_the_vectors() -> None:
    for v in reference.vectors():
        got = reference.hashes(reference.vector_data(v))
        assert [[f"{a:016x}", f"{b:016x}"] for a, b in got] == v["hashes"], v["words"]


def test_the_simulated_twin_gives_the_vectors() -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "keephash" / "run.py")],
        env=sim_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == expected()


def test_one_changed_word_changes_both_halves() -> None:
    """Each lane's steps are bijections: one word changed changes its lane's two states,
    and so both 64-bit halves of the chunk's hash, whatever the word and its place."""
    rng = random.Random(11)
    raw = bytearray(reference.data(3, 3000))
    base = reference.hashes(bytes(raw))[0]
    for _ in range(40):
        at = rng.randrange(len(raw))
        changed = bytearray(raw)
        changed[at] ^= rng.randrange(1, 256)
        a, b = reference.hashes(bytes(changed))[0]
        assert a != base[0] and b != base[1], at


def test_the_committed_ptx_is_current(tmp_path: Path) -> None:
    nvcc = tool("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the committed PTX cannot be regenerated here")
    release = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
    header = reference.PTX_HEADER.read_text()
    made_by = header.split('#define KEEP_HASH_NVCC "', 1)[1].split('"', 1)[0]
    if f"release {made_by}," not in release.stdout:
        pytest.skip(f"nvcc here is not the release {made_by} that generated the PTX")
    regenerated = subprocess.run(
        [str(REPO / "tools" / "gen_keep_hash_ptx.sh"), nvcc],
        capture_output=True,
        text=True,
        check=True,
    )
    assert regenerated.stdout == header, (
        "shim_c/keep_hash_ptx.h is stale: run tools/gen_keep_hash_ptx.sh > shim_c/keep_hash_ptx.h"
    )


@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_the_ptx_assembles(tmp_path: Path, arch: str) -> None:
    ptxas = tool("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not found: the PTX cannot be assembled here")
    source = tmp_path / "keep_hash.ptx"
    source.write_text(reference.ptx())
    run = subprocess.run(
        [ptxas, f"-arch={arch}", str(source), "-o", str(tmp_path / "k.cubin")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
