"""Fixtures of the pod tests: real pods (tests/pods/podenv.py), the shim's environment
inside them and the coordinator's command line on the host.

Every test here is skipped, with the reason, where pods cannot be made (not root, no
``unshare``) or the simulated driver is not the one tested.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import simenv
from tests.pods import podenv
from tests.shim import shimenv

MakePod = Callable[..., podenv.Pod]


@pytest.fixture(scope="session")
def pods_possible() -> None:
    reason = podenv.unavailable()
    if reason is not None:
        pytest.skip(reason)
    if not simenv.is_simulated():
        pytest.skip("the pod tests run on the simulated driver (tests/gpu: the real one)")


@pytest.fixture
def pod_control_dir(pods_possible: None) -> Iterator[Path]:
    """The control directory's path in every pod of the test (each pod mounts its own
    tmpfs there; on the host it stays an empty 0700 directory). Short: socket paths."""
    path = Path(tempfile.mkdtemp(prefix="cip-pod-"))
    path.chmod(0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sim_namespace(pod_control_dir: Path) -> Iterator[str]:
    name = shimenv.sim_namespace_for(pod_control_dir)
    yield name
    Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{name}").unlink(missing_ok=True)


@pytest.fixture
def make_pod(pod_control_dir: Path, tmp_path: Path) -> Iterator[MakePod]:
    """``make_pod(user=False, own_root=False, net=False, run_as=None)``: a pod, closed at
    teardown."""
    made: list[podenv.Pod] = []

    def make(**kwargs: Any) -> podenv.Pod:
        pod = podenv.Pod(pod_control_dir, tmp_path, **kwargs)
        made.append(pod)
        return pod

    yield make
    for pod in made:
        pod.close()


@pytest.fixture
def pod_env(pod_control_dir: Path, sim_namespace: str) -> dict[str, str]:
    """A shimmed worker's environment (release build: a coordinator resuming from a
    clean shell loads the driver its shims report, which must not need a sanitizer's
    runtime preloaded)."""
    return shimenv.shim_env("release", control_dir=pod_control_dir, namespace=sim_namespace)


def cli_env(pod_control_dir: Path) -> dict[str, str]:
    env = shimenv.coordinator_cli_env(pod_control_dir)
    env.pop("SNAPSHOT_CONTROL_DIR", None)  # the command line says where
    return env


def run_cli(
    args: list[str], env: dict[str, str], *, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
