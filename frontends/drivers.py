"""Which CUDA driver a program runs on and the native checkpoint calls load (``--driver``).

``auto``: for the native calls, the ``libcuda.so.1`` the group's shims report (STATUS,
specs/protocol.md "Which driver"), else the one its manifest recorded at suspend, so
that the same commands work on the simulated driver and on a GPU with nothing set;
for ``launch``, and for the native calls when nothing reports one, :func:`installed`:
the system's driver where an NVIDIA driver is installed, else the simulated one.
``sim``: the simulated driver of this installation. ``system``: the loader's search.

A report (and the manifest's record of one) is the workload's word: it is held to the
engine's trust rule (:mod:`.engine.driver_trust`, the same one the library's verbs apply
by default), and only the coordinator's own path of a trusted driver is loaded.
"""

from __future__ import annotations

import ctypes.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs

from .engine import artifacts, discovery, driver_trust
from .engine.client import Endpoint
from .engine.driver_trust import DRIVER_NAME, trusted, trusted_recorded
from .engine.native_checkpoint import NativeUnavailableError

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
        return str(artifacts.sim_library_dir() / DRIVER_NAME)
    except artifacts.ArtifactMissingError as exc:
        raise NativeUnavailableError(str(exc)) from exc


def library(
    choice: str,
    endpoints: Callable[[], Sequence[Endpoint]],
    recorded: str | None = None,
    *,
    proc_root: Path | None = None,
    report: discovery.DriverReport | None = None,
) -> str | None:
    """The path to load (None: the loader's search); ``endpoints`` are asked (``auto``
    only) for the shims to ask which driver they run on (``proc_root``: their pids are
    seen through it), unless ``report`` already says (a suspend's own STATUS round);
    none saying, ``recorded`` (the manifest's), else :func:`installed`'s choice."""
    if choice == "sim":
        return sim_library()
    if choice == "system":
        return None
    said = report if report is not None else discovery.shim_drivers(endpoints())
    reported = trusted(said, proc_root)  # one driver per command, trusted, else refused
    if reported is not None:
        return reported
    if recorded is not None:
        return trusted_recorded(recorded, proc_root)
    return sim_library() if installed().kind == "sim" else None


class LateBackend(driver_trust.LateBackend):
    """The native calls on the driver ``--driver`` names (:func:`library`), chosen at the
    first call: for processes that do not exist yet when the command starts (a CRIU
    restore recreates them, and their shims then say which driver they run on).
    ``report``: what the shims already said (a suspend's one STATUS round,
    :class:`~.engine.suspension.DriverChoice`), so that they are not asked again."""

    def __init__(
        self,
        choice: str,
        endpoints: Callable[[], Sequence[Endpoint]],
        recorded: Callable[[], str | None] = lambda: None,
        *,
        proc_root: Path | None = None,
        report: discovery.DriverReport | None = None,
    ) -> None:
        super().__init__(
            lambda: library(choice, endpoints, recorded(), proc_root=proc_root, report=report)
        )
        self.choice = choice
