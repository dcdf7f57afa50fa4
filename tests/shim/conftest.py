"""Fixtures for the shim's tests: workers on the simulated driver, with and without the
shim, and the coordinator's CLI.

``spawn()`` (no environment) starts a worker with the shim preloaded on the test's
control directory, set up with ``shimenv.WORKER_SETUP``. The end-to-end tests'
``shim_env`` and ``plain_env`` are skipped, with the reason, while a piece is missing
(the built shim or simulated driver, the CLI's prepare/restore) or when the driver is
the real one (tests/gpu runs that scenario there).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import coordinator_env

from tests import simenv
from tests.shim import shimenv


def _missing_stack() -> str | None:
    if not simenv.is_simulated():
        return "CUINTERPOSE_TEST_DRIVER=system: tests/gpu runs this scenario on the real GPU"
    cli = subprocess.run(
        [sys.executable, "-m", "cuinterpose", "prepare", "--help"],
        env=coordinator_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if cli.returncode != 0:
        return f"`cuinterpose prepare` is not available yet: {(cli.stderr or cli.stdout)[-300:]}"
    return None


@pytest.fixture(scope="session")
def stack() -> None:
    reason = _missing_stack()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def sim_namespace(control_dir: Path) -> Iterator[str]:
    """One simulated-driver namespace per test (device-wide memory accounting), shared by
    the shim processes and the plain ones, and removed afterwards."""
    name = shimenv.sim_namespace_for(control_dir)
    yield name
    Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{name}").unlink(missing_ok=True)


@pytest.fixture
def worker_defaults(control_dir: Path, sim_namespace: str) -> simenv.WorkerDefaults:
    def env(extra: Mapping[str, str]) -> dict[str, str]:
        return shimenv.shim_env(control_dir=control_dir, namespace=sim_namespace, extra=extra)

    return simenv.WorkerDefaults(env, shimenv.WORKER_SETUP)


def _env(factory: Callable[..., Any], control_dir: Path, namespace: str) -> dict[str, str]:
    params = inspect.signature(factory).parameters
    kwargs: dict[str, Any] = {}
    if "namespace" in params:
        kwargs["namespace"] = namespace
    if "control_dir" in params:
        kwargs["control_dir"] = control_dir
    try:
        env = dict(factory(**kwargs))
    except FileNotFoundError as exc:  # a build missing: say so instead of erroring
        pytest.skip(f"{factory.__module__}.{factory.__name__}: {exc}")
    env["SNAPSHOT_CONTROL_DIR"] = str(control_dir)
    env["CUINTERPOSE_SIM_NAMESPACE"] = namespace
    return env


@pytest.fixture
def shim_env(stack: None, control_dir: Path, sim_namespace: str) -> dict[str, str]:
    """Environment of an application process: shim preloaded on the simulated driver."""
    return _env(shimenv.shim_env, control_dir, sim_namespace)


@pytest.fixture
def plain_env(stack: None, control_dir: Path, sim_namespace: str) -> dict[str, str]:
    """The simulated driver without the shim: native-checkpoint controller, raw exporter."""
    return _env(simenv.sim_env, control_dir, sim_namespace)
