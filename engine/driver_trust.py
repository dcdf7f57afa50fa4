"""Which ``libcuda.so.1`` the coordinator may load for the native checkpoint calls.

A shim's report of the driver it runs on (STATUS ``ask_driver``, specs/protocol.md
"Which driver"), and a manifest's record of one, is the workload's word, and loading a
library runs its constructors in the coordinator (often root): only a driver the
coordinator finds by itself is loaded, the system's ``libcuda.so.1`` as the dynamic
linker finds it or one of this installation's simulated ones
(:func:`.artifacts.sim_drivers`), and only when the file the process reports is that
file (``st_dev``/``st_ino``). The path loaded is the coordinator's own, never the
reported one. Through a proc root a reported path is the container's: the file is taken
from the process's own mappings (``<proc-root>/<pid>/maps``), not looked up here.

The agent's verbs apply this rule when they choose the native calls themselves
(``native`` left to its default); an agent that passes its own backend chose its driver.
Which mount namespace the files are looked up in is :class:`.native_checkpoint.CudaBackend`'s
check (specs/detection.md "Driver trust").
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from . import artifacts
from .client import Endpoint
from .discovery import DriverMismatch, DriverReport, shim_drivers
from .gpus import Gpu
from .native_checkpoint import CudaBackend, NativeUnavailableError, ProcessState

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
            "--driver sim (an embedding agent: pass CudaBackend(library=PATH) as native)"
        )
    return path


def _here(reported: str) -> Identity | str:
    if not os.path.isabs(reported):
        return f"{reported!r} is not an absolute path"
    return _identity(Path(reported)) or f"{reported} does not exist here"


def trusted(report: DriverReport, proc_root: Path | None = None) -> str | None:
    """The driver to load for ``report`` (None: no shim named one): the coordinator's own
    path of the trusted driver every reporting process runs on; else
    :class:`NativeUnavailableError` naming the path, the pid and what to do."""
    try:
        reported = report.one()
    except DriverMismatch as exc:
        raise NativeUnavailableError(f"{exc}; run one command per driver") from exc
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


def reported_or_recorded(
    endpoints: Sequence[Endpoint], recorded: str | None, proc_root: Path | None = None
) -> str | None:
    """The trusted driver the shims at ``endpoints`` say they run on; none saying, the
    one ``recorded`` (a manifest's), checked the same way; None: neither names one (the
    loader's search)."""
    said = trusted(shim_drivers(endpoints), proc_root)
    if said is not None:
        return said
    return None if recorded is None else trusted_recorded(recorded, proc_root)


class LateBackend:
    """A :class:`CudaBackend` whose driver is chosen at its first call (``choose``: the
    path to load, None for the loader's search; it raises :class:`NativeUnavailableError`
    to refuse): for processes that do not exist yet when the run starts (a CRIU restore
    recreates them, and their shims then say which driver they run on), and so that a
    run that makes no native call asks nothing."""

    def __init__(self, choose: Callable[[], str | None]) -> None:
        self.choose = choose
        self._backend: CudaBackend | None = None

    def _chosen(self) -> CudaBackend:
        if self._backend is None:
            self._backend = CudaBackend(self.choose())
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
