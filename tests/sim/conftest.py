"""Fixtures for the simulated-driver suite: ``spawn()`` starts a worker that uses
cuda.bindings.driver against the driver chosen by CUINTERPOSE_TEST_DRIVER (default: the
ASan build of the simulator), with a context on device ``device`` and the helpers of
``simtest.PRELUDE``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests import simenv
from tests.sim.simtest import PRELUDE


@pytest.fixture
def namespace() -> Iterator[str]:
    """One simulated node per test: its processes share cuMemGetInfo."""
    name = uuid.uuid4().hex[:12]
    yield name
    Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{name}").unlink(missing_ok=True)


@pytest.fixture
def worker_defaults(namespace: str) -> simenv.WorkerDefaults:
    def env(extra: Mapping[str, str]) -> dict[str, str]:
        return simenv.sim_env(namespace=namespace, extra=extra)

    return simenv.WorkerDefaults(env, f"SIM = {simenv.is_simulated()}\n{PRELUDE}")
