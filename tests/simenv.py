"""Run child processes against the simulated CUDA driver (or the real one).

Other suites reuse this: ``sim_env()`` gives the environment for a child
process that loads ``build*/shim_c/sim/libcuda.so.1`` through the library
path. The child processes themselves are ``cuinterpose.demo.Worker``s, started
with the ``spawn`` fixture (tests/conftest.py); ``WorkerDefaults`` is how a
directory tells ``spawn`` what its workers are by default.

Driver selection: ``CUINTERPOSE_TEST_DRIVER`` = ``asan`` (default: the
ASan/UBSan build), ``tsan`` (the ThreadSanitizer build, ``make tsan``), ``release``
(the ``build/`` tree) or ``system`` (the machine's own libcuda, for running the same
tests on a real GPU).
"""

from __future__ import annotations

import atexit
import functools
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
from cuinterpose.demo import Worker

REPO = Path(__file__).resolve().parent.parent
# Namespaces made here carry the test runner's pid, so that the accounting
# files the simulator leaves in /dev/shm are removed when the runner exits.
_RUN_PREFIX = f"t{os.getpid()}"
BUILD_DIRS = {"asan": REPO / "build-asan", "tsan": REPO / "build-tsan", "release": REPO / "build"}
# What the sanitizer builds' runtimes are told. TSan: stop at the first report (the
# worker's exit status and stderr then fail the test), with the deliberate races of
# the simulated driver suppressed (the file says why, one by one).
TSAN_SUPPRESSIONS = REPO / "tests" / "tsan.supp"
SANITIZER_OPTIONS = {
    "asan": {
        # Python leaks by design at exit and is not instrumented.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:verify_asan_link_order=0",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    },
    "tsan": {
        "TSAN_OPTIONS": f"halt_on_error=1:exitcode=66:second_deadlock_stack=1"
        f":suppressions={TSAN_SUPPRESSIONS}",
    },
}


def driver_kind() -> str:
    """Which driver the tests run against: asan, release or system."""
    kind = os.environ.get("CUINTERPOSE_TEST_DRIVER", "asan").strip().lower()
    if kind not in ("asan", "tsan", "release", "system"):
        raise ValueError(f"CUINTERPOSE_TEST_DRIVER={kind!r}: want asan, tsan, release or system")
    return kind


def is_simulated() -> bool:
    return driver_kind() != "system"


def multicast_allowed() -> bool:
    """Multicast runs on the simulator; on real GPUs only when explicitly allowed
    (cuMulticastCreate can take a shared host's GPUs out of service)."""
    return is_simulated() or os.environ.get("CUINTERPOSE_ALLOW_MULTICAST", "") == "1"


def sim_dir(build: str | None = None) -> Path:
    """Directory holding the built simulated libcuda.so.1 (default: the build the tests
    run against; the ASan one when they run on the system's driver)."""
    kind = build or driver_kind()
    return BUILD_DIRS[kind if kind in BUILD_DIRS else "asan"] / "shim_c" / "sim"


@functools.cache
def sanitizer_runtime(kind: str = "asan") -> str:
    """The compiler's libasan.so or libtsan.so (``kind``): Python itself is not
    instrumented, so the runtime must be loaded first for a sanitizer build."""
    name = f"lib{kind}.so"
    out = subprocess.run(
        ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = Path(out)
    if not path.is_absolute() or not path.exists():
        raise FileNotFoundError(f"{name} not found (gcc said {out!r})")
    return str(path.resolve())


def asan_runtime() -> str:
    return sanitizer_runtime("asan")


def sim_env(
    build: str | None = None,
    devices: int = 2,
    extra: Mapping[str, str] | None = None,
    namespace: str | None = None,
) -> dict[str, str]:
    """Environment for a child process that uses the simulated driver.

    ``build`` is ``asan``, ``tsan`` or ``release`` (default: from CUINTERPOSE_TEST_DRIVER;
    ``system`` leaves the library path alone). ``namespace`` isolates the
    simulated devices' memory accounting (cuMemGetInfo) from other runs;
    processes that must see each other's memory use share one.
    """
    kind = build or driver_kind()
    env = dict(os.environ)
    if kind != "system":
        lib = sim_dir(kind)
        if not (lib / "libcuda.so.1").is_file():
            raise FileNotFoundError(f"{lib}/libcuda.so.1 missing: run `make build`")
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = str(lib) + (":" + old if old else "")
        env["CUINTERPOSE_SIM_DEVICES"] = str(devices)
        env["CUINTERPOSE_SIM_NAMESPACE"] = namespace or f"{_RUN_PREFIX}-{uuid.uuid4().hex[:12]}"
        if kind in SANITIZER_OPTIONS:
            preload = env.get("LD_PRELOAD", "")
            env["LD_PRELOAD"] = sanitizer_runtime(kind) + (" " + preload if preload else "")
            env.update(SANITIZER_OPTIONS[kind])
    if extra:
        env.update(extra)
    return env


@atexit.register
def _remove_namespaces() -> None:
    for path in Path("/dev/shm").glob(f"cuinterpose-sim-{os.getuid()}-{_RUN_PREFIX}-*"):
        path.unlink(missing_ok=True)


def run_python(
    script: Path, *args: str, env: Mapping[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run a Python program (a file of the suite's, with ``args``) in a child process;
    returns the completed process."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


# The ``spawn`` fixture's type: spawn(name="worker", env=None, *, extra, setup, device, wait).
Spawn = Callable[..., Worker]


@attrs.frozen
class WorkerDefaults:
    """What ``spawn()`` starts when given no environment: ``env(extra)`` is the
    environment, ``setup`` the snippet each such worker runs first (with ``DEV``, its
    device, defined), which sets CUDA up itself. A directory's conftest overrides the
    ``worker_defaults`` fixture with one of these."""

    env: Callable[[Mapping[str, str]], dict[str, str]] | None = None
    setup: str = ""
