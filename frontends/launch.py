"""Start a program with the shim preloaded: ``cuinterpose launch [--driver sim|system] -- CMD``.

The environment: ``LD_PRELOAD`` gets the built ``libcuinterpose.so`` (after any
preload already there, so that a sanitizer runtime stays first); with the
simulated driver, its directory comes first on ``LD_LIBRARY_PATH``;
``SNAPSHOT_CONTROL_DIR`` names the control directory, created with mode 0700
when missing, and refused when the shim would not trust it. Nothing is compiled
here: the libraries are the installed package's, or a build tree's
(:mod:`cuinterpose.engine.artifacts`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from .engine import artifacts
from .engine.client import control_dir_length_problem, control_dir_problem

DRIVERS: Final = ("sim", "system")
DEFAULT_CONTROL_DIR: Final = Path("/snapshot-control")
CONTROL_DIR_ENV: Final = "SNAPSHOT_CONTROL_DIR"
# launch --keep-host-copy (shim_c/keep.c; specs/shim.md, "Kept host copy").
KEEP_HOST_COPY_ENV: Final = "SNAPSHOT_SHIM_KEEP_HOST_COPY"


class LaunchError(RuntimeError):
    """The command could not be started as asked (bad driver, control dir, command)."""


def _check_driver(driver: str) -> None:
    if driver not in DRIVERS:
        raise LaunchError(f"unknown driver {driver!r}: use one of {', '.join(DRIVERS)}")


def control_dir_for(control_dir: Path | None, base: Mapping[str, str]) -> Path:
    """The control directory: the one given, else ``$SNAPSHOT_CONTROL_DIR``, else the default."""
    if control_dir is not None:
        return Path(control_dir)
    value = base.get(CONTROL_DIR_ENV, "")
    return Path(value) if value else DEFAULT_CONTROL_DIR


def ensure_control_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700, ours) if it is missing; refuse one the shim would not trust.

    The last component is made with ``mkdir`` (which never follows a link there) and
    judged with ``lstat``: a symbolic link, a non-directory, a directory owned by
    another user than root or us, or one writable by group or others is refused
    with the reason, as the shim and the coordinator refuse it.
    """
    path = Path(path)
    if not path.is_absolute():
        raise LaunchError(f"control directory {path} must be an absolute path")
    too_long = control_dir_length_problem(path)
    if too_long is not None:
        raise LaunchError(too_long)
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise LaunchError(f"cannot create control directory {path}: {exc}") from exc
    if created:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # mkdir's mode is filtered by the umask
        finally:
            os.close(fd)
    problem = control_dir_problem(path)
    if problem is None and not path.is_dir():  # vanished between the two
        problem = f"control directory {path} does not exist"
    if problem is not None:
        raise LaunchError(problem)
    return path


def _prepend(value: str, existing: str) -> str:
    parts = [value, *(p for p in existing.split(":") if p and p != value)]
    return ":".join(parts)


def _append(value: str, existing: str) -> str:
    """``LD_PRELOAD`` takes colons or spaces; keep what is there first, ``value`` last."""
    parts = [p for p in existing.replace(" ", ":").split(":") if p and p != value]
    return ":".join([*parts, value])


def launch_env(
    *,
    driver: str,
    control_dir: Path | None,
    base: Mapping[str, str] | None = None,
    preload_shim: bool = True,
) -> dict[str, str]:
    """The environment a program needs to run under the shim.

    ``base`` defaults to this process's environment. ``preload_shim=False`` gives
    the same driver setup without the shim (for a native-checkpoint controller or
    a process that must stay outside the topology). The control directory is only
    named here, not created (see :func:`ensure_control_dir`).
    """
    _check_driver(driver)
    env = dict(os.environ if base is None else base)
    if preload_shim:
        env["LD_PRELOAD"] = _append(str(artifacts.shim_library()), env.get("LD_PRELOAD", ""))
    if driver == "sim":
        env["LD_LIBRARY_PATH"] = _prepend(
            str(artifacts.sim_library_dir()), env.get("LD_LIBRARY_PATH", "")
        )
    env[CONTROL_DIR_ENV] = str(control_dir_for(control_dir, env))
    return env


def _write_pidfile(path: Path, pid: int) -> None:
    try:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(f"{pid}\n")
        os.replace(tmp, path)  # a reader never sees a half-written pid
    except OSError as exc:
        raise LaunchError(f"cannot write the pid file {path}: {exc}") from exc


def _announce(stream: TextIO | None, pid: int, command: Sequence[str], verb: str) -> None:
    """The program's pid line, the one to name (``becomes``: this process, by exec)."""
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError):
        stream.write(
            f"cuinterpose launch: pid {pid} {verb} {shlex.join(command)} (name it: --pid {pid})\n"
        )
        stream.flush()  # before an exec, which drops what is buffered


def launch(
    command: Sequence[str],
    *,
    driver: str,
    control_dir: Path | None,
    pidfile: Path | None = None,
    exec_: bool = False,
    announce: TextIO | None = None,
    keep_host_copy: bool = False,
) -> int:
    """Run ``command`` under the shim and return its exit status.

    The program's pid (the one to name in ``suspend --pid``) goes to ``announce`` and
    to ``pidfile``. With ``exec_`` this process becomes the program, so its own pid
    is the program's, and is said before the exec (never returns unless the exec
    fails). A child killed by a signal gives 128 + the signal number, as a shell does.
    SIGINT and SIGTERM reaching this process are passed on to the child, and the
    child's own status is still what is returned. ``keep_host_copy`` sets
    SNAPSHOT_SHIM_KEEP_HOST_COPY=1 for it (the variable as the environment has it otherwise).
    """
    if not command:
        raise LaunchError("no command to launch")
    try:
        env = launch_env(driver=driver, control_dir=control_dir)
    except artifacts.ArtifactMissingError as exc:
        raise LaunchError(str(exc)) from exc
    ensure_control_dir(Path(env[CONTROL_DIR_ENV]))
    if keep_host_copy:
        env[KEEP_HOST_COPY_ENV] = "1"
    if exec_:
        if pidfile is not None:
            _write_pidfile(Path(pidfile), os.getpid())
        _announce(announce, os.getpid(), command, "becomes")
        try:
            os.execvpe(command[0], list(command), env)
        except OSError as exc:
            raise LaunchError(f"cannot start {command[0]!r}: {exc}") from exc
    try:
        child = subprocess.Popen(list(command), env=env)
    except OSError as exc:
        raise LaunchError(f"cannot start {command[0]!r}: {exc}") from exc
    if pidfile is not None:
        try:
            _write_pidfile(Path(pidfile), child.pid)
        except LaunchError:
            child.kill()
            child.wait()
            raise
    _announce(announce, child.pid, command, "runs")

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - status if status < 0 else status
