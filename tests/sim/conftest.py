"""Fixtures for the simulated-driver suite: worker processes that use
cuda.bindings.driver against the driver chosen by CUINTERPOSE_TEST_DRIVER
(default: the ASan build of the simulator)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import simenv
from simenv import Worker
from simtest import PRELUDE


@pytest.fixture
def namespace() -> Iterator[str]:
    """One simulated node per test: its processes share cuMemGetInfo."""
    name = uuid.uuid4().hex[:12]
    yield name
    Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{name}").unlink(missing_ok=True)


@pytest.fixture
def spawn(namespace: str) -> Iterator[Callable[..., Worker]]:
    """spawn(dev=0, extra=None) starts a worker with a context on `dev`."""
    workers: list[Worker] = []

    def make(dev: int = 0, extra: dict[str, str] | None = None) -> Worker:
        env = simenv.sim_env(namespace=namespace, extra=extra)
        w = Worker(env)
        workers.append(w)
        w.send(
            f"DEV = {dev}\nSIM = {simenv.is_simulated()}\n" + PRELUDE
        )  # answered before its first use
        return w

    yield make
    errors = []
    for w in workers:
        try:
            w.close()
        except Exception as e:  # report every worker, not only the first
            errors.append(str(e))
    if errors:
        pytest.fail("\n".join(errors))
