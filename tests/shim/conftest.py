"""Fixtures for the end-to-end tests: worker processes on the simulated driver, with and
without the shim, a short control directory, and the coordinator's CLI.

Everything is skipped, with the reason, while a piece is missing (the built shim or
simulated driver, ``shimenv``/``simenv``, the CLI's prepare/restore).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from cuinterpose.demo import coordinator_env  # noqa: E402
from workers.cycle import Spawn, spawner  # noqa: E402


def _missing_stack() -> str | None:
    try:
        import simenv
    except ImportError as exc:
        return f"tests/simenv.py is not there yet ({exc})"
    if not simenv.is_simulated():
        return "CUINTERPOSE_TEST_DRIVER=system: tests/gpu runs this scenario on the real GPU"
    try:
        import shimenv  # noqa: F401
    except ImportError as exc:
        return f"tests/shim/shimenv.py is not there yet ({exc})"
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
def cdir() -> Iterator[Path]:
    """A short private control directory (the direct tests, no CLI needed)."""
    import shimenv

    with shimenv.control_dir() as path:
        yield path


@pytest.fixture
def control_dir(stack: None) -> Iterator[Path]:
    import shimenv

    with shimenv.control_dir() as path:
        yield path


@pytest.fixture
def sim_namespace(control_dir: Path) -> Iterator[str]:
    """One simulated-driver namespace per test (device-wide memory accounting), shared by
    the shim processes and the plain ones, and removed afterwards."""
    name = f"e2e-{control_dir.name}"
    yield name
    Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{name}").unlink(missing_ok=True)


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
def shim_env(control_dir: Path, sim_namespace: str) -> dict[str, str]:
    """Environment of an application process: shim preloaded on the simulated driver."""
    import shimenv

    return _env(shimenv.shim_env, control_dir, sim_namespace)


@pytest.fixture
def plain_env(control_dir: Path, sim_namespace: str) -> dict[str, str]:
    """The simulated driver without the shim: native-checkpoint controller, raw exporter."""
    import simenv

    return _env(simenv.sim_env, control_dir, sim_namespace)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start named workers; any still running at teardown are killed."""
    with spawner(tmp_path, timeout_s=60.0) as start:
        yield start
