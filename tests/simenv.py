"""Run child processes against the simulated CUDA driver (or the real one).

Other suites reuse this: ``sim_env()`` gives the environment for a child
process that loads ``build*/shim_c/sim/libcuda.so.1`` through the library
path, and ``Worker`` is a child Python process that executes snippets sent
to it and answers with JSON, so that one test can drive several processes
in lockstep (and pass file descriptors between them).

Driver selection: ``CUINTERPOSE_TEST_DRIVER`` = ``asan`` (default: the
ASan/UBSan build), ``release`` (the ``build/`` tree) or ``system`` (the
machine's own libcuda, for running the same tests on a real GPU).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Namespaces made here carry the test runner's pid, so that the accounting
# files the simulator leaves in /dev/shm are removed when the runner exits.
_RUN_PREFIX = f"t{os.getpid()}"
BUILD_DIRS = {"asan": REPO / "build-asan", "release": REPO / "build"}


def driver_kind() -> str:
    """Which driver the tests run against: asan, release or system."""
    kind = os.environ.get("CUINTERPOSE_TEST_DRIVER", "asan").strip().lower()
    if kind not in ("asan", "release", "system"):
        raise ValueError(f"CUINTERPOSE_TEST_DRIVER={kind!r}: want asan, release or system")
    return kind


def is_simulated() -> bool:
    return driver_kind() != "system"


def multicast_allowed() -> bool:
    """Multicast runs on the simulator; on real GPUs only when explicitly allowed
    (cuMulticastCreate can take a shared host's GPUs out of service)."""
    return is_simulated() or os.environ.get("CUINTERPOSE_ALLOW_MULTICAST", "") == "1"


def sim_dir(build: str = "asan") -> Path:
    """Directory holding the built simulated libcuda.so.1."""
    return BUILD_DIRS[build] / "shim_c" / "sim"


@functools.cache
def asan_runtime() -> str:
    """The compiler's libasan.so: Python itself is not instrumented, so the
    runtime must be loaded first for the ASan build of the driver."""
    out = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = Path(out)
    if not path.is_absolute() or not path.exists():
        raise FileNotFoundError(f"libasan.so not found (gcc said {out!r})")
    return str(path.resolve())


def sim_env(
    build: str | None = None,
    devices: int = 2,
    extra: Mapping[str, str] | None = None,
    namespace: str | None = None,
) -> dict[str, str]:
    """Environment for a child process that uses the simulated driver.

    ``build`` is ``asan`` or ``release`` (default: from CUINTERPOSE_TEST_DRIVER;
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
        if kind == "asan":
            preload = env.get("LD_PRELOAD", "")
            env["LD_PRELOAD"] = asan_runtime() + (" " + preload if preload else "")
            # Python leaks by design at exit and is not instrumented.
            env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:verify_asan_link_order=0"
            env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    if extra:
        env.update(extra)
    return env


@atexit.register
def _remove_namespaces() -> None:
    for path in Path("/dev/shm").glob(f"cuinterpose-sim-{os.getuid()}-{_RUN_PREFIX}-*"):
        path.unlink(missing_ok=True)


def run_python(
    code: str, env: Mapping[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run a Python program in a child process; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


# The child side of Worker: exec each snippet in one namespace; the snippet
# leaves its answer in `result`. `send_fd`/`recv_fd` use the socketpair.
_WORKER = r"""
import json, os, socket, sys, traceback
_sock = socket.socket(fileno=int(sys.argv[1]))
_out = os.fdopen(int(sys.argv[2]), "w")
from cuda.bindings import driver as cu
ns = {"cu": cu, "os": os, "sock": _sock}
def send_fd(fd):
    socket.send_fds(_sock, [b"x"], [fd])
def recv_fd():
    _, fds, _, _ = socket.recv_fds(_sock, 1, 1)
    return fds[0]
def check(r):
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(cu.cuGetErrorName(err)[1].decode())
    if isinstance(r, tuple):
        rest = r[1:]
        return rest[0] if len(rest) == 1 else rest
    return None
def err(r):
    e = r[0] if isinstance(r, tuple) else r
    return e.name if hasattr(e, "name") else str(e)
ns.update(send_fd=send_fd, recv_fd=recv_fd, check=check, err=err)
for line in sys.stdin:
    ns["result"] = None
    try:
        exec(json.loads(line), ns)
        reply = {"ok": True, "result": ns["result"]}
    except Exception as e:
        reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    _out.write(json.dumps(reply) + "\n")
    _out.flush()
"""


class WorkerError(RuntimeError):
    pass


class Worker:
    """A child Python process using cuda.bindings.driver, driven snippet by
    snippet: ``w("result = ...")`` runs the code there and returns
    ``result`` (JSON). FDs travel through the test process: inside a snippet
    ``send_fd(fd)`` / ``fd = recv_fd()``; here ``take_fd()`` / ``give_fd(fd)``.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self._sock, child = socket.socketpair()
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(child.fileno()), str(w)],
            env=dict(env),
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=[w, child.fileno()],
            cwd=REPO,
        )
        os.close(w)
        child.close()
        self._replies = os.fdopen(r, "r")
        self._done = False
        self._backlog = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, code: str) -> None:
        """Start a snippet without waiting for its answer (see ``reply``).
        An earlier snippet still unanswered is waited for first, so workers
        can start up concurrently and still run in order."""
        assert self.proc.stdin is not None
        while self._backlog:
            self.reply()
        self.proc.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
        self.proc.stdin.flush()
        self._backlog = 1

    def reply(self) -> Any:
        """The answer of the snippet started last."""
        self._backlog = 0
        line = self._replies.readline()
        if not line:
            self.proc.wait(timeout=10)
            stderr = self.proc.stderr.read() if self.proc.stderr else ""
            raise WorkerError(f"worker {self.pid} died (rc={self.proc.returncode}):\n{stderr}")
        msg = json.loads(line)
        if not msg["ok"]:
            raise WorkerError(msg["error"] + "\n" + msg.get("trace", ""))
        return msg["result"]

    def answered(self, timeout: float) -> bool:
        """Has the snippet started with ``send`` answered within ``timeout`` s?
        (Used to show that a call blocks.)"""
        ready, _, _ = select.select([self._replies], [], [], timeout)
        return bool(ready)

    def __call__(self, code: str) -> Any:
        self.send(code)
        return self.reply()

    def take_fd(self) -> int:
        """An FD the worker sent with ``send_fd``; the caller owns it."""
        _, fds, _, _ = socket.recv_fds(self._sock, 1, 1)
        return fds[0]

    def give_fd(self, fd: int) -> None:
        """Send an FD for the worker's ``recv_fd``."""
        socket.send_fds(self._sock, [b"x"], [fd])

    def close(self) -> None:
        """Stop the worker; a crash or a sanitizer report fails the test."""
        if self._done:
            return
        self._done = True
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        stderr = self.proc.stderr.read() if self.proc.stderr else ""
        self._replies.close()
        self._sock.close()
        if self.proc.returncode != 0 or "Sanitizer" in stderr:
            raise WorkerError(f"worker {self.pid} exited {self.proc.returncode}:\n{stderr}")

    def kill(self) -> None:
        """Stop the worker without judging how it ended."""
        if self._done:
            return
        self._done = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._replies.close()
        self._sock.close()
