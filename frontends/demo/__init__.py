"""``cuinterpose demo`` and the scripted worker application it runs.

:class:`Worker` (``worker_client``) drives one worker process (``worker.py`` beside this
file, ``cuda.bindings.driver`` only) over a socket pair, by command or by Python
snippet; :class:`Scenario` is the three-process group the demo, the end-to-end tests,
the GPU tests and ``bench/checkpoint.py`` share. The test suite starts all its worker
processes through :class:`Worker`.
"""

from .scenario import (
    CliRun,
    Region,
    Scenario,
    coordinator_env,
    pattern,
    pattern_digest,
    run_cli,
    run_demo,
)
from .worker_client import WORKER_SCRIPT, DemoError, Worker, WorkerError

__all__ = [
    "WORKER_SCRIPT",
    "CliRun",
    "DemoError",
    "Region",
    "Scenario",
    "Worker",
    "WorkerError",
    "coordinator_env",
    "pattern",
    "pattern_digest",
    "run_cli",
    "run_demo",
]
