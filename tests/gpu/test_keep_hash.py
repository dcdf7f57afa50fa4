"""The kept host copy's hash kernel on a real GPU: the PTX the shim carries
(shim_c/keep_hash_ptx.h), JIT-compiled by the driver and launched as the shim launches it,
gives the known-answer vectors (tests/keephash/vectors.json: random data, zeros, a float
ramp, one to three chunks), which the Python reading and the simulated driver's C twin
give too (tests/shim/test_keep_hash.py). Skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose.demo import coordinator_env

from tests.keephash import reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu")]

REPO = Path(__file__).resolve().parents[2]


def test_the_kernel_gives_the_vectors() -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "keephash" / "run.py")],
        env=coordinator_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [v["hashes"] for v in reference.vectors()]
