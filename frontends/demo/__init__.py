"""``cuinterpose demo`` and the scripted worker application it runs.

:class:`Worker` drives one worker process (``worker.py`` beside this file,
``cuda.bindings.driver`` only) over a socket pair; :class:`Scenario` is the
three-process group the demo, the end-to-end tests, the GPU tests and
``bench/checkpoint.py`` share.
"""

from .scenario import (
    WORKER_SCRIPT,
    CliRun,
    DemoError,
    Region,
    Scenario,
    Worker,
    WorkerError,
    coordinator_env,
    pattern,
    pattern_digest,
    run_cli,
    run_demo,
)

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
