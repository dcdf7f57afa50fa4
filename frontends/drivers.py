"""Which CUDA driver a program runs on and the native checkpoint calls load (``--driver``).

``auto``: for the native calls, the ``libcuda.so.1`` the group's shims report (STATUS,
specs/protocol.md "Which driver"), else the one its manifest recorded at suspend, so
that the same commands work on the simulated driver and on a GPU with nothing set;
for ``launch``, and for the native calls when nothing reports one, :func:`installed`:
the system's driver where an NVIDIA driver is installed, else the simulated one.
``sim``: the simulated driver of this installation. ``system``: the loader's search.
"""

from __future__ import annotations

import ctypes.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs

from . import artifacts
from .engine import discovery
from .engine.client import Endpoint
from .engine.native import CudaBackend, NativeUnavailableError, ProcessState

NVIDIA_PROC: Final = Path("/proc/driver/nvidia/version")
NVIDIA_DEVICE: Final = Path("/dev/nvidiactl")
# Where a driver's libcuda.so.1 is when the loader's cache does not list it (a container
# whose toolkit mounted it without running ldconfig).
_DRIVER_DIRS: Final = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/local/nvidia/lib64",
)


@attrs.frozen
class Installed:
    """The driver ``--driver auto`` runs a program on, and why (said on launch's first line)."""

    kind: Literal["sim", "system"]
    why: str

    def line(self) -> str:
        name = "the simulated driver" if self.kind == "sim" else "the system's driver"
        return f"on {name}: {self.why}"


def installed(proc: Path = NVIDIA_PROC, device: Path = NVIDIA_DEVICE) -> Installed:
    """The system's driver where an NVIDIA driver is installed (its kernel module answers
    in /proc, or its control device is there as a container is given it, and the loader
    knows a ``libcuda.so.1``), else the simulated one. Nothing is loaded: the coordinator
    may still load another driver afterwards."""
    try:
        version = proc.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        if not device.exists():
            return Installed("sim", f"no NVIDIA driver here (no {proc}, no {device})")
        version = f"{device}"
    if ctypes.util.find_library("cuda") is None and not any(
        (Path(d) / "libcuda.so.1").exists() for d in _DRIVER_DIRS
    ):
        return Installed(
            "sim", f"the NVIDIA kernel driver is loaded ({version}), but the loader finds no "
            f"libcuda.so.1 (ldconfig -p, {', '.join(_DRIVER_DIRS)})")  # fmt: skip
    return Installed("system", f"NVIDIA driver installed ({version})")


def sim_library() -> str:
    try:
        return str(artifacts.sim_library_dir() / "libcuda.so.1")
    except artifacts.ArtifactMissingError as exc:
        raise NativeUnavailableError(str(exc)) from exc


def library(
    choice: str, endpoints: Callable[[], Sequence[Endpoint]], recorded: str | None = None
) -> str | None:
    """The path to load (None: the loader's search); ``endpoints`` are asked (``auto``
    only) for the shims to ask which driver they run on; none saying, ``recorded`` (the
    manifest's), else :func:`installed`'s choice."""
    if choice == "sim":
        return sim_library()
    if choice == "system":
        return None
    try:
        reported = discovery.shim_drivers(endpoints()).one()
    except discovery.DriverMismatch as exc:
        raise NativeUnavailableError(f"{exc}; run one command per driver") from exc
    if reported is not None:
        return reported
    if recorded is not None:
        return recorded
    return sim_library() if installed().kind == "sim" else None


class LateBackend:
    """A :class:`CudaBackend` whose driver is chosen at its first call: for processes
    that do not exist yet when the command starts (a CRIU restore recreates them, and
    their shims then say which driver they run on)."""

    def __init__(
        self,
        choice: str,
        endpoints: Callable[[], Sequence[Endpoint]],
        recorded: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.choice = choice
        self.endpoints = endpoints
        self.recorded = recorded
        self._backend: CudaBackend | None = None

    def _chosen(self) -> CudaBackend:
        if self._backend is None:
            self._backend = CudaBackend(library(self.choice, self.endpoints, self.recorded()))
        return self._backend

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._chosen().lock(pid, timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._chosen().checkpoint(pid)

    def restore(self, pid: int) -> None:
        self._chosen().restore(pid)

    def unlock(self, pid: int) -> None:
        self._chosen().unlock(pid)

    def state(self, pid: int) -> ProcessState:
        return self._chosen().state(pid)
