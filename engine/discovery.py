"""What the coordinator finds out about a group before it acts: which processes exist,
which have a shim, which driver their shims loaded, and every shim a control
directory holds.

The driver report is STATUS with ``ask_driver`` (protocol.h, ``CUIP_ASK_DRIVER``):
the path of the ``libcuda.so.1`` a shim's process runs on, which the native
checkpoint calls must load too (a simulated driver and a real one answer only for
the processes that loaded them). Nothing here changes or binds anything.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

# The wire and the client where a name is made or matched, or a shim is asked: looking
# at a process or at an empty control directory loads neither
# (tests/engine/test_import_cost.py).
if TYPE_CHECKING:
    from .client import Endpoint


@functools.cache
def _socket_name() -> re.Pattern[str]:
    from .wire import SOCKET_PREFIX, SOCKET_SUFFIX

    return re.compile(rf"{re.escape(SOCKET_PREFIX)}([1-9][0-9]*){re.escape(SOCKET_SUFFIX)}")


class DriverMismatch(RuntimeError):
    """The processes' shims loaded different drivers: one coordinator cannot reach all."""

    def __init__(self, drivers: dict[int, str]) -> None:
        super().__init__(drivers)
        self.drivers = drivers

    def __str__(self) -> str:
        named = ", ".join(f"pid {pid}: {path}" for pid, path in self.drivers.items())
        return f"the processes run on different CUDA drivers ({named})"


@attrs.frozen
class DriverReport:
    """Which driver each shim that answered loaded (pid as seen here -> path)."""

    drivers: dict[int, str]
    silent: tuple[int, ...] = ()  # shims that did not say (not answering, an older shim)

    def one(self) -> str | None:
        """The driver of the whole group; None when no shim named one."""
        paths = set(self.drivers.values())
        if len(paths) > 1:
            raise DriverMismatch(self.drivers)
        return next(iter(paths), None)


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


_KINDS: Final = (
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def kind_of(mode: int) -> str:
    """A file of ``mode``, in words: "a socket", "a directory", ..."""
    return next((word for test, word in _KINDS if test(mode)), f"a file of mode {mode:o}")


def nspids(pid: int, proc_root: Path | None = None) -> tuple[int, ...]:
    """The NSpid line of ``/proc/<pid>/status`` (under ``proc_root``): the process's pid
    in each pid namespace from that /proc's to its own; empty when there is no such
    process or the line cannot be read."""
    proc = Path(proc_root) if proc_root is not None else Path("/proc")
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            words = line.split()[1:]
            return tuple(int(w) for w in words) if all(w.isdigit() for w in words) else ()
    return ()


def shim_drivers(endpoints: Sequence[Endpoint], *, timeout: float = 5.0) -> DriverReport:
    """Ask every endpoint that has a socket which driver its shim loaded."""
    from .client import call_all
    from .stopped import stopped
    from .wire import Op, Reply, Request, Status

    # A stopped process's shim answers nothing until continued: not waited for.
    asked = [e for e in endpoints if _has_socket(e) and not stopped(e.observed_pid, e.proc_root())]
    replies = call_all([(e, Request(Op.STATUS, ask_driver=True), None) for e in asked],
                       timeout=timeout)  # fmt: skip
    drivers: dict[int, str] = {}
    silent: list[int] = []
    for endpoint, reply in zip(asked, replies, strict=True):
        if isinstance(reply, Reply) and reply.status is Status.OK and reply.message:
            drivers[endpoint.observed_pid] = reply.message
        else:  # not answering, or a shim older than the driver report
            silent.append(endpoint.observed_pid)
    return DriverReport(drivers, tuple(silent))


def _has_socket(endpoint: Endpoint) -> bool:
    try:
        return stat.S_ISSOCK(endpoint.entry().st_mode)
    except OSError:
        return False


def pid_exists(pid: int, proc_root: Path | None = None) -> bool:
    """Whether ``pid`` names a process (under ``proc_root`` when the coordinator sees the
    processes through another /proc; else in the coordinator's pid namespace, as the
    transport asks before it waits for a socket to heal)."""
    if proc_root is not None:
        return (Path(proc_root) / str(pid)).exists()
    from .client import pid_visible

    return pid_visible(pid)


def is_running(pid: int, proc_root: Path | None = None) -> bool:
    """Whether ``pid`` names a process that has not exited: one that exited and that its
    parent has not reaped yet (a zombie, state Z or X in ``/proc/<pid>/stat``) still has
    its pid, but takes part in nothing."""
    if not pid_exists(pid, proc_root):
        return False
    try:
        stat_line = (Path(proc_root or "/proc") / str(pid) / "stat").read_text()
    except OSError:
        return True  # exists (kill said so), its state unreadable: not known to be dead
    state = stat_line.rpartition(")")[2].split()[:1]
    return state not in (["Z"], ["X"])


def serves(path: Path) -> bool:
    """Whether anything listens on the Unix socket ``path`` (a stale one refuses)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def start_ticks(pid: int, proc_root: Path | None = None) -> int:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22); 0
    when it cannot be read (gone, or no /proc)."""
    proc = Path(proc_root) if proc_root is not None else Path("/proc")
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return 0
    fields = text.rpartition(")")[2].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def pid_namespace(pid: int, proc_root: Path | None = None) -> int:
    """The pid namespace of ``pid`` (the inode of ``/proc/PID/ns/pid``); 0 when it
    cannot be read."""
    proc = Path(proc_root) if proc_root is not None else Path("/proc")
    try:
        return os.stat(proc / str(pid) / "ns" / "pid").st_ino
    except OSError:
        return 0


def other_mounts(pid: int) -> bool:
    """Whether ``pid`` runs in another mount namespace than the coordinator (a pod's
    process, whose paths are not the coordinator's); False when it cannot be told."""
    try:
        theirs = os.stat(f"/proc/{pid}/ns/mnt").st_ino
        ours = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False
    return theirs != ours


def same_process(pid: int, started: int, proc_root: Path | None = None) -> bool:
    """Whether ``pid`` still names the process that had start time ``started`` (0: not
    recorded, then whether the pid names any process; a zombie is gone)."""
    if not is_running(pid, proc_root):
        return False
    if not started:
        return True
    now = start_ticks(pid, proc_root)
    return now in (0, started)  # unreadable (another user's): take it as the same


def unanswered(endpoints: Sequence[Endpoint], *, timeout: float = 5.0) -> dict[Endpoint, str]:
    """The endpoints whose shim does not answer STATUS (nothing is bound or changed), each
    with a line naming the process and where its socket was looked for."""
    from .client import ParticipantError, call_all
    from .wire import Op, Reply, Request

    replies = call_all([(e, Request(Op.STATUS), None) for e in endpoints], timeout=timeout)
    silent: dict[Endpoint, str] = {}
    for endpoint, reply in zip(endpoints, replies, strict=True):
        if isinstance(reply, Reply):
            continue
        why = reply.reason if isinstance(reply, ParticipantError) else str(reply)
        silent[endpoint] = (
            f"pid {endpoint.observed_pid} (ns pid {endpoint.namespace_pid}): no shim answers "
            f"at {endpoint.path} ({why}); looked in {endpoint.path.parent}"
        )
    return silent


def children(pid: int) -> tuple[int, ...]:
    """The pids of ``pid``'s children (empty when /proc does not say)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return ()
    for task in tasks:
        try:
            text = (task / "children").read_text()
        except OSError:
            continue
        found += [int(word) for word in text.split()]
    return tuple(sorted(set(found)))


def missing_shim_hint(pid: int, control_dir: Path) -> str:
    """What to do about a process without a control socket: name its child that has one
    (a launcher's), or start the program under the shim."""
    from .wire import socket_name

    with_shim = [c for c in children(pid) if is_socket(control_dir / socket_name(c))]
    if with_shim:
        named = " ".join(f"--pid {c}" for c in with_shim)
        return (
            f"its child pid {with_shim[0]} has one (the program a `cuinterpose launch` "
            f"started, whose pid it prints): name {named}"
        )
    return (
        "start the program with `cuinterpose launch -- COMMAND` (or LD_PRELOAD the shim); "
        "for the native checkpoint alone, of processes without a shim, give --not-requested"
    )


def shims_in(control_dir: Path) -> tuple[int, ...]:
    """The namespace pids of every control socket in ``control_dir``, in order."""
    try:
        names = os.listdir(control_dir)
    except OSError:
        return ()
    pids = []
    for name in names:  # the wire's names only for a directory that holds something
        match = _socket_name().fullmatch(name)
        if match and is_socket(Path(control_dir) / name):
            pids.append(int(match[1]))
    return tuple(sorted(pids))
