"""Environment for child processes that run with the shim preloaded.

``shim_env()`` extends ``simenv.sim_env()`` (the simulated driver on the library
path, libasan first for the sanitizer build) with ``libcuinterpose.so`` in
``LD_PRELOAD`` and ``SNAPSHOT_CONTROL_DIR``. ``shim_library()`` and
``test_program()`` locate the built artifacts. Also a tiny control-protocol client
(``request``) for tests that talk to a shim directly.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.engine import wire

from tests import simenv, snippet
from tests.waiting import wait_until

REPO = simenv.REPO


def sim_namespace_for(control_dir: Path | str) -> str:
    """The simulated driver's namespace of the test whose control directory this is."""
    return f"shim-{Path(control_dir).name}"


def coordinator_cli_env(control_dir: Path | str) -> dict[str, str]:
    """The coordinator CLI's environment: no shim, and on the simulated driver its
    release build in the test's namespace, so that the native state checks run."""
    env = dict(os.environ)
    if simenv.is_simulated():
        env = simenv.sim_env("release", namespace=sim_namespace_for(control_dir))
        # The CLI loads the driver the shims report (--driver auto), here the ASan
        # build's simulated libcuda: its runtime comes along as a dependency, which ASan
        # accepts only with this (engine/native_checkpoint.py refuses it otherwise).
        env["ASAN_OPTIONS"] = "detect_leaks=0:verify_asan_link_order=0"
    env.pop("LD_PRELOAD", None)
    if simenv.driver_kind() == "tsan":
        # The TSan build's simulated libcuda needs its runtime loaded first, and its
        # static TLS cannot be had by a dlopen (the native checks load that driver).
        env["LD_PRELOAD"] = simenv.sanitizer_runtime("tsan")
        env.update(simenv.SANITIZER_OPTIONS["tsan"])
    return env


def build_kind(build: str | None = None) -> str:
    """``asan``, ``tsan`` or ``release``; ``system`` (the real driver) uses the release
    shim."""
    kind = build or simenv.driver_kind()
    return "release" if kind == "system" else kind


def shim_library(build: str | None = None) -> Path:
    path = simenv.BUILD_DIRS[build_kind(build)] / "shim_c" / "libcuinterpose.so"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `make build`")
    return path


def has_test_hooks(build: str | None = None) -> bool:
    """Whether the shim of ``build`` has the test hooks compiled in (CMake's
    CUINTERPOSE_TEST_HOOKS: the Makefile's build-asan/ and build-tsan/, never build/)."""
    cache = simenv.BUILD_DIRS[build_kind(build)] / "CMakeCache.txt"
    if not cache.is_file():
        raise FileNotFoundError(f"{cache} missing: run `make build`")
    return "CUINTERPOSE_TEST_HOOKS:BOOL=ON" in cache.read_text().splitlines()


def needs_test_hooks(hook: str) -> None:
    """Skip, naming ``hook`` and the build, when the shim the tests run has no hooks."""
    if not has_test_hooks():
        pytest.skip(
            f"{hook} is a test hook: the {build_kind()} shim has none (run the "
            "suite on build-asan/ or build-tsan/)"
        )


def test_program(name: str, build: str | None = None) -> Path:
    """A C test program built from tests/shim/c (e.g. ``shim_direct``)."""
    path = simenv.BUILD_DIRS[build_kind(build)] / "tests" / "shim" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `make build`")
    return path


def shim_env(
    build: str | None = None,
    control_dir: Path | str | None = None,
    driver: str | None = None,
    namespace: str | None = None,
    devices: int = 2,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment of an application process with the shim preloaded.

    ``build``: ``asan`` (default, from CUINTERPOSE_TEST_DRIVER), ``tsan`` or ``release``.
    ``driver``: ``sim`` (default unless CUINTERPOSE_TEST_DRIVER=system) or ``system``.
    ``control_dir`` becomes SNAPSHOT_CONTROL_DIR (the shim creates it if missing).
    """
    kind = build_kind(build)
    drv = driver or ("system" if simenv.driver_kind() == "system" else "sim")
    base = simenv.sim_env(
        build=kind if drv == "sim" else "system", devices=devices, namespace=namespace
    )
    if drv == "system" and kind == "asan":
        base["LD_PRELOAD"] = simenv.asan_runtime() + (
            " " + base["LD_PRELOAD"] if base.get("LD_PRELOAD") else ""
        )
        base["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:verify_asan_link_order=0"
    shim = str(shim_library(kind))
    preload = base.get("LD_PRELOAD", "")
    # After the sanitizer runtime (which must come first), before anything else.
    parts = preload.split()
    if parts and ("libasan" in parts[0] or "libtsan" in parts[0]):
        parts.insert(1, shim)
    else:
        parts.insert(0, shim)
    base["LD_PRELOAD"] = " ".join(parts)
    if control_dir is not None:
        base["SNAPSHOT_CONTROL_DIR"] = str(control_dir)
    if extra:
        base.update(extra)
    return base


# ---------------------------------------------------------------- a tiny client
def socket_path(control_dir: Path | str, pid: int) -> Path:
    return Path(control_dir) / wire.socket_name(pid)


def wait_socket(control_dir: Path | str, pid: int, timeout: float = 20.0) -> Path:
    path = socket_path(control_dir, pid)
    wait_until(path.exists, f"no control socket {path}", timeout)
    return path


def raw_exchange(path: Path | str, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the shim closes; returns what came back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        try:
            s.sendall(payload)
        except BrokenPipeError:
            return b""  # the shim closed before reading: it answered nothing
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            chunks.append(b)
    return b"".join(chunks)


def request(
    path: Path | str, req: wire.Request, timeout: float = 30.0
) -> tuple[wire.Reply, list[int]]:
    """One request; returns the decoded reply and any FDs it carried (caller closes)."""
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        if not req.fds:
            s.sendall(req.encode())
        else:  # STORE_STAGED / FETCH_STAGED: the files with the header
            socket.send_fds(s, [req.encode()], list(req.fds))
        data = b""
        while True:
            msg, got, _, _ = socket.recv_fds(s, 1 << 20, 4)
            fds.extend(got)
            if not msg:
                break
            data += msg
    return wire.Reply.decode(data), fds


def handshake(path: Path | str) -> wire.Reply:
    reply, fds = request(path, wire.Request(op=wire.Op.HANDSHAKE))
    for fd in fds:
        os.close(fd)
    return reply


# ---------------------------------------------------------------- worker snippets
# Run first in each default worker of tests/shim (``worker_defaults``; cuda.bindings in
# the child): a context, helpers to create, map, fill and digest allocations. Handles
# live in the worker's namespace.
WORKER_SETUP = snippet.load(__file__, "worker_setup")


def send_held(worker: Any, code: str) -> None:
    """Start ``code`` (an application call) in ``worker`` and check that it waits at the
    closed gate (specs/quiesce.md): no answer yet. ``worker.reply()`` gives its answer
    once the gate has opened."""
    worker.send(code)
    assert not worker.answered(0.3), f"{worker.name} answered while its gate is closed"
