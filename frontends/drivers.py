"""Which CUDA driver the command line's native checkpoint calls load (``--driver``).

``auto``: the ``libcuda.so.1`` the group's shims report (STATUS, specs/protocol.md
"Which driver"), so that the same commands work on the simulated driver and on a
GPU with nothing set; none reporting: the loader's own search. ``sim``: the
simulated driver of this installation. ``system``: the loader's search.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import artifacts
from .engine import discovery

if TYPE_CHECKING:
    from .engine.client import Endpoint
    from .engine.native import CudaBackend, ProcessState


def library(choice: str, endpoints: Callable[[], Sequence[Endpoint]]) -> str | None:
    """The path to load (None: the loader's search); ``endpoints`` are asked (``auto``
    only) for the shims to ask which driver they run on."""
    from .engine.native import NativeUnavailableError

    if choice == "sim":
        try:
            return str(artifacts.sim_library_dir() / "libcuda.so.1")
        except artifacts.ArtifactMissingError as exc:
            raise NativeUnavailableError(str(exc)) from exc
    if choice == "system":
        return None
    try:
        return discovery.shim_drivers(endpoints()).one()
    except discovery.DriverMismatch as exc:
        raise NativeUnavailableError(f"{exc}; run one command per driver") from exc


class LateBackend:
    """A :class:`CudaBackend` whose driver is chosen at its first call: for processes
    that do not exist yet when the command starts (a CRIU restore recreates them, and
    their shims then say which driver they run on)."""

    def __init__(self, choice: str, endpoints: Callable[[], Sequence[Endpoint]]) -> None:
        self.choice = choice
        self.endpoints = endpoints
        self._backend: CudaBackend | None = None

    def _chosen(self) -> CudaBackend:
        if self._backend is None:
            from .engine.native import CudaBackend

            self._backend = CudaBackend(library(self.choice, self.endpoints))
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
