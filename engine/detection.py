"""Detection: which processes have a shim, from their control sockets (specs/detection.md).

The sockets are the only evidence: ``/proc/*/environ`` is never read. What is at each
socket path is decided in one place, :func:`look` (and, where no socket is, whether the
process exists and runs), and said in one set of words, :meth:`Sighting.problem`:
the fail-closed truth table (:func:`detect`), the command line's prepare, restore and
status, and the stale sockets a restore must free (:func:`remove_stale_sockets`) all
take it from there.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import attrs

from . import discovery
from .client import HEAL_WAIT_S, Endpoint, endpoint_for
from .errors import AgentError
from .manifest import Process

Mode = Literal["cuinterpose", "native"]
Evidence = Literal["socket", "absent", "other"]
Life = Literal["running", "zombie", "gone"]


@attrs.frozen
class Where:
    """Where the shims' sockets are: a control directory, reached directly or through
    ``proc_root/<observed pid>/root`` (a coordinator outside the containers), and the
    one uid besides root and the coordinator's own trusted there (``--trust-uid``).

    A process's endpoint is made once per ``Where``: with a proc root, its control
    directory is resolved inside its root at the first request and every later one of
    the run goes through that resolution (engine/_rooted.py)."""

    control_dir: Path = attrs.field(converter=Path)
    proc_root: Path | None = None
    trust_uid: int | None = None
    check_peer: bool = True  # off only for a test's fakes (endpoint_for says why)
    _made: dict[Process, Endpoint] = attrs.field(factory=dict, eq=False, repr=False,
                                                 init=False)  # fmt: skip

    def endpoint(self, process: Process) -> Endpoint:
        made = self._made.get(process)
        if made is None:
            made = endpoint_for(
                process.observed_pid,
                process.namespace_pid,
                control_dir=self.control_dir,
                proc_root=self.proc_root,
                trust_uid=self.trust_uid,
                check_peer=self.check_peer,
            )
            self._made[process] = made
        return made


class Group(tuple[Process, ...]):
    """The processes of one verb, checked once, when it is made (none, or one twice, is
    refused): the steps below the verb take this value and do not check it again.

    A tuple, so that every step iterates, zips and counts it as it did the processes."""

    __slots__ = ()

    def __new__(cls, processes: Iterable[Process | tuple[int, int]]) -> Group:
        members = tuple(p if isinstance(p, Process) else Process(*p) for p in processes)
        if not members:
            raise ValueError("no processes given")
        if len(set(members)) < len(members):
            twice = next(p for p in members if members.count(p) > 1)
            raise ValueError(f"{twice.describe()} is given twice")
        return super().__new__(cls, members)


def group_of(processes: Sequence[Process | tuple[int, int]]) -> Group:
    """The processes a verb was given, as a :class:`Group` (refused as it says); a
    :class:`Group` is returned as it is."""
    return processes if isinstance(processes, Group) else Group(processes)


class DetectionRefused(AgentError):
    """The sockets contradict the group's request (or each other): nothing was done."""


@attrs.frozen
class Detection:
    """What the sockets say: ``cuinterpose`` (every process has a shim) or ``native``."""

    mode: Mode
    endpoints: tuple[Endpoint, ...]


def socket_evidence(endpoint: Endpoint) -> tuple[Evidence, str]:
    """What is at the endpoint's socket path, not followed (inside the process's root,
    with no symbolic link at any component, where it is reached through a proc root),
    and, for a path that is not a socket, what is there in words."""
    if endpoint.rooted is not None:
        problem = endpoint.rooted.resolve()
        if problem is not None:
            return ("absent", "") if endpoint.rooted.missing else ("other", problem)
    try:
        info = endpoint.entry()
    except FileNotFoundError:
        return "absent", ""
    except OSError as exc:
        return "other", f"something that cannot be looked at ({exc.strerror})"
    if stat.S_ISSOCK(info.st_mode):
        return "socket", ""
    return "other", discovery.kind_of(info.st_mode)


def pair_problem(process: Process, proc_root: Path | None) -> str | None:
    """Why ``process`` is not the pair it is named by: the pid namespace that
    ``/proc/<observed pid>/status`` (under ``proc_root``) says its last NSpid is, differs
    from the namespace pid given. None when it agrees, or when there is no such process
    (detection says that)."""
    chain = discovery.nspids(process.observed_pid, proc_root)
    if not chain or chain[-1] == process.namespace_pid:
        return None
    o, n, found = process.observed_pid, process.namespace_pid, chain[-1]
    proc = proc_root or Path("/proc")
    if o == n:
        return (
            f"pid {o} is ns pid {found} in its own pid namespace (NSpid {' '.join(map(str, chain))}"
            f" in {proc}/{o}/status), not pid {n}: name it --process {o} {found}"
            + (
                ""
                if proc_root is not None
                else " and reach its control directory with --proc-root /proc"
            )
        )
    return (
        f"pid {o} (ns pid {n}) is not that pair: process {o} is ns pid {found} in its pid "
        f"namespace (NSpid {' '.join(map(str, chain))} in {proc}/{o}/status); refused before "
        f"anything was sent: name it --process {o} {found}, or the process whose ns pid is {n}"
    )


@attrs.frozen
class Sighting:
    """What one process's control socket path holds, looked at once (``lstat``, never
    followed) and, where no socket is, whether the process runs: the one place that
    decides it. ``there`` words what sits at a path that is not a socket."""

    process: Process
    endpoint: Endpoint
    evidence: Evidence
    there: str = ""
    life: Life = "running"  # looked at only where no socket is
    mismatch: str | None = None  # the pair is not one process (pair_problem)

    def name(self) -> str:
        return self.endpoint.name()

    def problem(self, requested: bool, where: Where) -> str | None:
        """What is wrong with this process for a group that did (or did not) request
        cuinterpose, in words a person acts on; None when nothing is."""
        path = self.endpoint.path
        if self.mismatch is not None:
            return self.mismatch
        if (
            self.evidence == "other"
            and self.endpoint.rooted is not None
            and self.there.startswith("control directory")
        ):
            return f"{self.name()}: {self.there}; nothing was sent"
        if self.evidence == "other":
            return (
                f"{self.name()} has no control socket: at its path {path} there is "
                f"{self.there}, not a socket: no shim can serve there until it is removed "
                "(then a shim that served there before serves again within 100 ms; one "
                "that found it at its start has no control server until its program "
                "starts again)"
            )
        if self.evidence == "socket":
            if requested:
                return None  # a live shim, or a stale socket the capture's HANDSHAKE names
            return (
                f"{self.name()}: a control socket at {path}, yet the group did not request "
                "cuinterpose (a native checkpoint would fail on its sharing)"
            )
        if (gone := self.gone(where)) is not None:
            return gone
        if not requested:
            return None
        if where.proc_root is None and discovery.other_mounts(self.process.observed_pid):
            return (
                f"{self.name()}: its control socket {path} does not exist here, and it runs "
                "in another mount namespace (a container) whose control directory is its "
                "own: reach it inside its root with --proc-root /proc (and --process "
                "HOST_PID NS_PID)"
            )
        return (
            f"{self.name()} has no shim: its control socket {path} does not exist; "
            + discovery.missing_shim_hint(self.process.observed_pid, path.parent)
        )

    def gone(self, where: Where) -> str | None:
        """The line for a process without a socket that does not exist or has exited
        (whatever the group requested, it cannot take part); None otherwise."""
        if self.evidence != "absent" or self.life == "running":
            return None
        if self.life == "zombie":
            return f"{self.name()} exited (a zombie its parent has not reaped): it takes no part"
        under = f" under {where.proc_root}" if where.proc_root is not None else ""
        return f"{self.name()} does not exist (no such process{under})"


def _life(process: Process, where: Where) -> Life:
    if not discovery.pid_exists(process.observed_pid, where.proc_root):
        return "gone"
    if not discovery.is_running(process.observed_pid, where.proc_root):
        return "zombie"
    return "running"


def _sight(process: Process, endpoint: Endpoint, where: Where) -> Sighting:
    evidence, there = socket_evidence(endpoint)
    life = _life(process, where) if evidence == "absent" else "running"
    return Sighting(process, endpoint, evidence, there, life,
                    pair_problem(process, where.proc_root))  # fmt: skip


def _healing(s: Sighting) -> bool:
    return s.evidence == "absent" and s.life == "running" and s.mismatch is None


def look(group: Group, where: Where, *, heal: bool) -> tuple[Sighting, ...]:
    """What is at each process's socket path (every verb's one look: :func:`detect`,
    the command line's prepare, restore and status). ``heal``: a socket missing while
    its process runs is looked at again for up to 1 s, as its shim may be re-creating
    a removed one (specs/protocol.md); all such waits run together."""
    seen = [_sight(p, where.endpoint(p), where) for p in group]
    deadline = time.monotonic() + HEAL_WAIT_S
    while heal and any(map(_healing, seen)) and time.monotonic() < deadline:
        time.sleep(0.01)
        seen = [_sight(s.process, s.endpoint, where) if _healing(s) else s for s in seen]
    return tuple(seen)


def problems(seen: Sequence[Sighting], requested: bool, where: Where) -> list[str]:
    """A line for each process that breaks the rule (:meth:`Sighting.problem`)."""
    return [line for s in seen if (line := s.problem(requested, where)) is not None]


def detect(
    requested: bool, processes: Sequence[Process | tuple[int, int]], where: Where
) -> Detection:
    """The truth table of specs/detection.md, fail-closed.

    Requested and every process shows a control socket: ``cuinterpose``. Not requested
    and none does: ``native``. Anything else, and a process that does not exist or has
    exited, raises :class:`DetectionRefused` naming every process that broke the rule
    and how. Never reads ``/proc/*/environ``.
    """
    seen = look(group_of(processes), where, heal=requested)
    wrong = problems(seen, requested, where)
    if wrong:
        wanted = "requested" if requested else "not requested"
        raise DetectionRefused(f"detection refused (cuinterpose {wanted}):", wrong)
    return Detection("cuinterpose" if requested else "native", tuple(s.endpoint for s in seen))


def remove_stale_sockets(
    processes: Sequence[Process | tuple[int, int]], where: Where
) -> tuple[Path, ...]:
    """Remove the control sockets of ``processes`` that nobody listens on any more, so
    that processes recreated by a restore (CRIU) can bind them. A socket a live shim
    still serves, or a path that is not a socket, is refused by name, nothing removed."""
    stale: list[Endpoint] = []
    problems: list[str] = []
    for seen in look(group_of(processes), where, heal=False):
        process, path = seen.process, seen.endpoint.path
        if seen.evidence == "absent":
            continue
        if seen.evidence == "other":
            problems.append(f"{process.describe()}: {path} is {seen.there}, not a socket; "
                            "not removed")  # fmt: skip
            continue
        endpoint = seen.endpoint
        address = (endpoint.rooted.address(path.name) if endpoint.rooted is not None
                   else str(path))  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(address)
            except (ConnectionRefusedError, FileNotFoundError):
                stale.append(endpoint)
                continue
            except OSError as exc:
                problems.append(f"{process.describe()}: {path}: {exc.strerror}; not removed")
                continue
        problems.append(f"{process.describe()}: {path} is served by a live shim; not removed")
    if problems:
        raise AgentError("stale socket removal refused:", problems)
    for endpoint in stale:  # inside a process's root: through its one resolution
        with contextlib.suppress(FileNotFoundError):
            if endpoint.rooted is not None:
                os.unlink(endpoint.path.name, dir_fd=endpoint.rooted.fd())
            else:
                endpoint.path.unlink()
    return tuple(e.path for e in stale)
