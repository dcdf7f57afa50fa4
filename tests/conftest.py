"""Fixtures every suite shares: a control directory and the worker processes.

``spawn`` starts ``cuinterpose.demo.Worker`` processes (the demo's worker application,
driven by command or by Python snippet); at teardown every worker still running is
closed, and one that crashed or reported a sanitizer error fails the test.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from cuinterpose.demo import Worker, WorkerError

from tests.simenv import Spawn, WorkerDefaults

# A real GPU's checkpoints move gigabytes: the suite's default per-test timeout
# (pyproject.toml) is sized for the simulator.
GPU_TIMEOUT_S = 1800


# Set on a test that pytest-timeout stopped: its workers are killed at teardown
# instead of being given their 30 s to quit (a hung one would take all of them).
TIMED_OUT = pytest.StashKey[bool]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(GPU_TIMEOUT_S))


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.excinfo is not None and "from pytest-timeout" in str(call.excinfo.value):
        item.stash[TIMED_OUT] = True


@pytest.fixture
def control_dir() -> Iterator[Path]:
    """A fresh private control directory (mode 0700), removed afterwards. Short: AF_UNIX
    socket paths in it are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cip-"))
    path.chmod(0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def worker_defaults() -> WorkerDefaults:
    """What ``spawn()`` starts when given no environment (tests/sim and tests/shim say)."""
    return WorkerDefaults()


@pytest.fixture
def worker_timeout_s() -> float:
    """How long a worker may take to answer one command."""
    return 120.0


@pytest.fixture
def spawn(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    worker_defaults: WorkerDefaults,
    worker_timeout_s: float,
) -> Iterator[Spawn]:
    """``spawn(name="worker", env=None, *, extra=None, setup=None, device=0, wait=True)``
    starts a worker (its stderr in ``tmp_path/<name>.stderr``).

    - ``env`` given: a worker on that environment (plus ``extra``) with CUDA initialized
      on ``device``, for commands (``check("create", ...)``); ``wait=False`` returns before
      it is ready (call ``wait_ready``), so that several start in parallel.
    - ``env`` omitted: the directory's default worker (``worker_defaults``): its
      environment with ``extra``, running its setup snippet first.
    - ``setup`` given: CUDA is left to the snippets; ``setup`` runs first (with ``DEV`` =
      ``device``), unless empty. A setup snippet is answered before the worker's first use,
      so that workers start up concurrently.
    """
    started: list[Worker] = []
    names: set[str] = set()

    def start(
        name: str = "worker",
        env: Mapping[str, str] | None = None,
        *,
        extra: Mapping[str, str] | None = None,
        setup: str | None = None,
        device: int = 0,
        wait: bool = True,
    ) -> Worker:
        if env is None:
            if worker_defaults.env is None:
                raise TypeError("spawn(): this directory has no default worker; pass env")
            environment = worker_defaults.env(dict(extra or {}))
            setup = worker_defaults.setup if setup is None else setup
        else:
            environment = {**env, **(extra or {})}
        unique, n = name, 1
        while unique in names:
            n += 1
            unique = f"{name}-{n}"
        names.add(unique)
        worker = Worker(
            unique,
            environment,
            device=device,
            log_dir=tmp_path,
            timeout_s=worker_timeout_s,
            # A setup snippet goes out at once; its answer says the worker is ready.
            wait=wait and setup is None,
            init_cuda=setup is None,
        )
        started.append(worker)
        if setup:
            worker.send(f"DEV = {device}\n{setup}")
        return worker

    yield start
    errors = []
    timed_out = request.node.stash.get(TIMED_OUT, False)
    for worker in started:
        if worker.closed:
            continue
        if timed_out:
            worker.kill()
            errors.append(f"{worker.name}: killed after the test's timeout; stderr tail:\n"
                          f"{worker.stderr_tail(1500)}")  # fmt: skip
            continue
        try:
            worker.close_clean()
        except WorkerError as exc:  # report every worker, not only the first
            errors.append(str(exc))
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
