"""Which CUDA driver a program runs on and the native checkpoint calls load (``--driver``).

``auto``: for the native calls, the ``libcuda.so.1`` the group's shims report (STATUS,
specs/protocol.md "Which driver"), else the one its manifest recorded at suspend, so
that the same commands work on the simulated driver and on a GPU with nothing set;
for ``launch``, and for the native calls when nothing reports one, :func:`installed`:
the system's driver where an NVIDIA driver is installed, else the simulated one.
``sim``: the simulated driver of this installation. ``system``: the loader's search.

A report (and the manifest's record of one) is the workload's word, and loading a
library runs its constructors in the coordinator (often root): only a driver the
coordinator finds by itself is loaded, the system's ``libcuda.so.1`` as the dynamic
linker finds it or one of this installation's simulated ones (``artifacts.sim_drivers``),
and only when the file the process reports is that file (``st_dev``/``st_ino``). The
path loaded is the coordinator's own, never the reported one. Through ``--proc-root`` a
reported path is the container's: the file is taken from the process's own mappings
(``<proc-root>/<pid>/maps``), not looked up in this mount namespace.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs

from . import artifacts
from .engine import discovery
from .engine.client import Endpoint
from .engine.gpus import Gpu
from .engine.native_checkpoint import CudaBackend, NativeUnavailableError, ProcessState

DRIVER_NAME: Final = "libcuda.so.1"
# The dynamic linker's own directories after LD_LIBRARY_PATH and its cache (ld.so(8)).
_DEFAULT_DIRS: Final = (
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
)
Identity = tuple[int, int]  # st_dev, st_ino


def _cached(name: str) -> list[str]:
    """The paths the linker's cache (``ldconfig -p``) has for ``name``, in its order."""
    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            listing = subprocess.run(
                [ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        return [
            line.rpartition("=>")[2].strip()
            for line in listing.splitlines()
            if line.strip().startswith(f"{name} ") and "=>" in line
        ]
    return []


def system_drivers() -> tuple[Path, ...]:
    """Every ``libcuda.so.1`` ``dlopen`` could find here, in its order: LD_LIBRARY_PATH,
    the linker's cache (each architecture's entry), its default directories."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    found = [
        *(os.path.join(d, DRIVER_NAME) for d in dirs),
        *_cached(DRIVER_NAME),
        *(os.path.join(d, DRIVER_NAME) for d in _DEFAULT_DIRS),
    ]
    return tuple(dict.fromkeys(Path(p) for p in found if os.path.isfile(p)))


def system_driver() -> Path | None:
    """The ``libcuda.so.1`` ``dlopen`` would find first here (None: there is none)."""
    return next(iter(system_drivers()), None)


def _identity(path: Path) -> Identity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _mapped(pid: int, path: str, proc_root: Path) -> Identity | str:
    """The file the process maps at ``path`` (its own namespace's), from its maps: the
    kernel's word, not a lookup of the path here; or why there is none."""
    maps = Path(proc_root) / str(pid) / "maps"
    try:
        text = maps.read_text(errors="replace")
    except OSError as exc:
        return f"its mappings ({maps}) cannot be read: {exc.strerror}"
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == path:
            major, _, minor = fields[3].partition(":")
            try:
                return os.makedev(int(major, 16), int(minor, 16)), int(fields[4])
            except ValueError:
                break
    return f"it maps no file {path} ({maps})"


def _candidates() -> list[tuple[str, Path]]:
    return [
        *(("this installation's simulated driver", path) for path in artifacts.sim_drivers()),
        *(("the system's driver", path) for path in system_drivers()),
    ]


def _match(reported: str, found: Identity | str, whose: str) -> Path:
    """The coordinator's own path of the trusted driver that ``found`` (the reported
    file's identity, or why it has none) is; else :class:`NativeUnavailableError`."""
    candidates = _candidates()
    known = {_identity(path): path for _, path in reversed(candidates)}
    path = known.get(found) if not isinstance(found, str) else None
    if path is None:
        why = found if isinstance(found, str) else "it is another file"
        offered = "; ".join(f"{name} {path}" for name, path in candidates)
        raise NativeUnavailableError(
            f"refused to load the CUDA driver {reported} that {whose} reports: {why}, "
            "not one this coordinator trusts, compared by file identity ("
            + (offered or "it finds no libcuda.so.1 of the system nor a simulated one")
            + "); name the driver instead: --driver system (the loader's search) or "
            "--driver sim"
        )
    return path


def _here(reported: str) -> Identity | str:
    if not os.path.isabs(reported):
        return f"{reported!r} is not an absolute path"
    return _identity(Path(reported)) or f"{reported} does not exist here"


def trusted(report: discovery.DriverReport, proc_root: Path | None = None) -> str | None:
    """The driver to load for ``report`` (None: no shim named one): the coordinator's own
    path of the trusted driver every reporting process runs on; else
    :class:`NativeUnavailableError` naming the path, the pid and what to do."""
    reported = report.one()
    if reported is None:
        return None
    chosen: Path | None = None
    for pid in report.drivers:
        found = _mapped(pid, reported, proc_root) if proc_root is not None else _here(reported)
        chosen = _match(reported, found, f"pid {pid}")
    return None if chosen is None else str(chosen)


def trusted_recorded(recorded: str, proc_root: Path | None = None) -> str:
    """The driver to load for the one a manifest recorded at suspend (the shims' word
    then, so checked as theirs is now); through ``proc_root`` it is a container's path,
    which no process is there to resolve: refused, naming ``--driver``."""
    if proc_root is not None and Path(proc_root).resolve() != Path("/proc").resolve():
        raise NativeUnavailableError(
            f"no shim answers to say which CUDA driver to load, and the manifest's "
            f"{recorded} is a path in the processes' mount namespace ({proc_root}): "
            "name the driver: --driver system or --driver sim"
        )
    return str(_match(recorded, _here(recorded), "the manifest"))


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
    try:
        said = report if report is not None else discovery.shim_drivers(endpoints())
        reported = trusted(said, proc_root)
    except discovery.DriverMismatch as exc:
        raise NativeUnavailableError(f"{exc}; run one command per driver") from exc
    if reported is not None:
        return reported
    if recorded is not None:
        return trusted_recorded(recorded, proc_root)
    return sim_library() if installed().kind == "sim" else None


class LateBackend:
    """A :class:`CudaBackend` whose driver is chosen at its first call: for processes
    that do not exist yet when the command starts (a CRIU restore recreates them, and
    their shims then say which driver they run on). ``report``: what the shims already
    said (a suspend's one STATUS round, :class:`~.engine.suspension.DriverChoice`), so
    that they are not asked again."""

    def __init__(
        self,
        choice: str,
        endpoints: Callable[[], Sequence[Endpoint]],
        recorded: Callable[[], str | None] = lambda: None,
        *,
        proc_root: Path | None = None,
        report: discovery.DriverReport | None = None,
    ) -> None:
        self.choice = choice
        self.endpoints = endpoints
        self.recorded = recorded
        self.proc_root = proc_root
        self.report = report
        self._backend: CudaBackend | None = None

    def _chosen(self) -> CudaBackend:
        if self._backend is None:
            chosen = library(
                self.choice, self.endpoints, self.recorded(), proc_root=self.proc_root,
                report=self.report)  # fmt: skip
            self._backend = CudaBackend(chosen)
        return self._backend

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._chosen().lock(pid, timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._chosen().checkpoint(pid)

    def restore(self, pid: int) -> None:
        self._chosen().restore(pid)

    def restore_onto(self, pid: int, gpu_pairs: Sequence[tuple[str, str]]) -> None:
        self._chosen().restore_onto(pid, gpu_pairs)

    def gpus(self) -> tuple[Gpu, ...]:
        return self._chosen().gpus()

    def unlock(self, pid: int) -> None:
        self._chosen().unlock(pid)

    def state(self, pid: int) -> ProcessState:
        return self._chosen().state(pid)
