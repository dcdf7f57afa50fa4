"""``cuinterpose check``: can a suspend work here? In the spirit of ``criu check``.

Each line is one finding: the CUDA driver (real or simulated, its version, where it
was loaded from), its native checkpoint API, cuda-bindings, the control directory's
trust, the shim's library, pidfd and ptrace. A FAIL is something a suspend needs; a
WARN is something only some groups need. Exit 0 when nothing FAILs. Nothing is
changed (the driver is loaded into this process only).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TextIO

import attrs

from . import drivers
from .engine import artifacts, discovery, driver_trust
from .engine.client import control_dir_problem, endpoint_for
from .engine.native_checkpoint import (
    CudaBackend,
    NativeError,
    NativeUnavailableError,
    loaded_driver,
)

Verdict = Literal["OK", "WARN", "FAIL"]
EXIT_OK = 0
EXIT_CANNOT = 1


@attrs.frozen
class Finding:
    name: str
    verdict: Verdict
    detail: str

    def line(self) -> str:
        return f"{self.verdict:<4} {self.name}: {self.detail}"


def _bindings() -> Finding:
    try:
        version = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        return Finding("cuda-bindings", "FAIL", "missing: pip install 'cuda-bindings>=13,<14'")
    return Finding("cuda-bindings", "OK", version)


def _library(control_dir: Path, driver: str) -> tuple[str | None, str]:
    """The driver to load and why that one."""
    if driver == "sim":
        return str(artifacts.sim_library_dir() / "libcuda.so.1"), "--driver sim"
    if driver == "auto":
        endpoints = [
            endpoint_for(p, p, control_dir=control_dir) for p in discovery.shims_in(control_dir)
        ]
        reported = driver_trust.trusted(discovery.shim_drivers(endpoints))
        if reported is not None:
            return reported, "the one the shims in the control directory report"
        # What `cuinterpose launch` would run a program on here (frontends/drivers.py).
        chosen = drivers.installed()
        if chosen.kind == "sim":
            return drivers.sim_library(), f"as launch: {chosen.line()}"
        return None, f"as launch: {chosen.line()}"
    return None, "the loader's search for libcuda.so.1"


def _driver(control_dir: Path, driver: str) -> list[Finding]:
    try:
        library, why = _library(control_dir, driver)
        backend = CudaBackend(library)
        version = backend.driver_version()
    except (NativeUnavailableError, NativeError, artifacts.ArtifactMissingError) as exc:
        return [
            Finding("driver", "FAIL", str(exc)),
            Finding("native checkpoint API", "FAIL", "no driver to ask"),
        ]
    path = loaded_driver() or library or "libcuda.so.1"
    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    simulated = hasattr(lib, "cuinterposeSimIsSimulated")
    kind = "simulated (shim_c/sim, no GPU)" if simulated else "NVIDIA"
    found = [
        Finding(
            "driver",
            "OK",
            f"{kind}, CUDA {version // 1000}.{version % 1000 // 10}, {path} ({why})",
        )
    ]
    calls = [
        "cuCheckpointProcessLock",
        "cuCheckpointProcessCheckpoint",
        "cuCheckpointProcessRestore",
        "cuCheckpointProcessUnlock",
        "cuCheckpointProcessGetState",
    ]
    missing = [c for c in calls if not hasattr(lib, c)]
    if missing:
        lacks = f"the driver lacks {', '.join(missing)} (it needs driver 550 or later)"
        found.append(Finding("native checkpoint API", "FAIL", lacks))
    else:
        found.append(Finding("native checkpoint API", "OK", "cuCheckpointProcess* present"))
    return found


def _control_dir(path: Path) -> Finding:
    if not path.exists():
        return Finding(
            "control directory",
            "WARN",
            f"{path} does not exist yet (`cuinterpose launch` creates it; "
            "without it, only --not-requested suspends work)",
        )
    problem = control_dir_problem(path)
    if problem is not None:
        return Finding("control directory", "FAIL", f"{problem}: the shims refuse it")
    shims = discovery.shims_in(path)
    return Finding("control directory", "OK", f"{path}, trusted, {len(shims)} shim(s) in it")


def _shim() -> Finding:
    try:
        return Finding("shim", "OK", str(artifacts.shim_library()))
    except artifacts.ArtifactMissingError as exc:
        return Finding("shim", "FAIL", str(exc))


def _pidfd() -> Finding:
    opener: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
    if opener is None:
        return Finding("pidfd", "WARN", "os.pidfd_open is missing (Linux 5.3+, Python 3.9+)")
    try:
        os.close(opener(os.getpid()))
    except OSError as exc:
        return Finding("pidfd", "WARN", f"pidfd_open failed: {exc.strerror}")
    return Finding("pidfd", "OK", "pidfd_open works (the shims' lease follows the coordinator)")


def _ptrace() -> Finding:
    path = Path("/proc/sys/kernel/yama/ptrace_scope")
    try:
        scope = int(path.read_text())
    except (OSError, ValueError):
        return Finding("ptrace", "OK", "no Yama restriction")
    if scope >= 3:
        return Finding("ptrace", "FAIL", f"{path} is {scope}: no process may act on another")
    if scope >= 1 and os.geteuid() != 0:
        return Finding(
            "ptrace",
            "WARN",
            f"{path} is {scope}: the native calls on another process may need root "
            "or CAP_SYS_PTRACE",
        )
    return Finding("ptrace", "OK", f"{path} is {scope}")


def findings(control_dir: Path, driver: str) -> list[Finding]:
    return [
        *_driver(control_dir, driver),
        _bindings(),
        _control_dir(control_dir),
        _shim(),
        _pidfd(),
        _ptrace(),
    ]


def text_lines(found: list[Finding], *, quiet: bool) -> list[str]:
    """The text report: every finding and the verdict; ``quiet`` (``-q``: nothing but
    the errors), the FAILs and the verdict only when there is one, else nothing."""
    failed = any(f.verdict == "FAIL" for f in found)
    shown = [f for f in found if f.verdict == "FAIL" or not quiet]
    verdict = "suspend cannot work here" if failed else "suspend can work here"
    return [f.line() for f in shown] + ([verdict] if failed or not quiet else [])


def run(*, control_dir: Path, driver: str, as_json: bool, out: TextIO, quiet: bool = False) -> int:
    """``quiet`` thins the text report only: the JSON document is what was asked for."""
    found = findings(control_dir, driver)
    code = EXIT_CANNOT if any(f.verdict == "FAIL" for f in found) else EXIT_OK
    if as_json:
        # One line ending the output as every verb's JSON does: a summary.
        outcome = "suspend can work here" if code == EXIT_OK else "suspend cannot work here"
        document = {"event": "summary", "command": "check",
                    "findings": [attrs.asdict(f) for f in found], "outcome": outcome,
                    "exit_code": code}  # fmt: skip
        out.write(json.dumps(document) + "\n")
    else:
        out.writelines(line + "\n" for line in text_lines(found, quiet=quiet))
    return code
