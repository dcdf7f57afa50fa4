"""Detection: which processes have a shim, from their control sockets (specs/detection.md).

The sockets are the only evidence: ``/proc/*/environ`` is never read. Besides the
fail-closed truth table (:func:`detect`), the stale sockets a restore must free
(:func:`remove_stale_sockets`) are found here the same way.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs

from . import discovery
from .client import Endpoint, endpoint_for, pid_visible
from .errors import AgentError
from .manifest import Process

Mode = Literal["cuinterpose", "native"]
Evidence = Literal["socket", "absent", "other"]

# A live shim re-creates a removed socket within its heal period (specs/protocol.md).
_HEAL_WAIT_S: Final = 1.0


@attrs.frozen
class Where:
    """Where the shims' sockets are: a control directory, reached directly or through
    ``proc_root/<observed pid>/root`` (a coordinator outside the containers)."""

    control_dir: Path = attrs.field(converter=Path)
    proc_root: Path | None = None

    def endpoint(self, process: Process) -> Endpoint:
        return endpoint_for(
            process.observed_pid,
            process.namespace_pid,
            control_dir=self.control_dir,
            proc_root=self.proc_root,
        )


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


def socket_evidence(path: Path) -> Evidence:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError:
        return "other"
    return "socket" if stat.S_ISSOCK(info.st_mode) else "other"


def _healed_evidence(endpoint: Endpoint) -> Evidence:
    """An absent socket of a live process, looked at again while its shim may heal it."""
    if not pid_visible(endpoint.observed_pid):
        return "absent"
    deadline = time.monotonic() + _HEAL_WAIT_S
    evidence = socket_evidence(endpoint.path)
    while evidence == "absent" and time.monotonic() < deadline:
        time.sleep(0.01)
        evidence = socket_evidence(endpoint.path)
    return evidence


def detect(
    requested: bool, processes: Sequence[Process | tuple[int, int]], where: Where
) -> Detection:
    """The truth table of specs/detection.md, fail-closed.

    Requested and every process shows a control socket: ``cuinterpose``. Not requested
    and none does: ``native``. Anything else raises :class:`DetectionRefused` naming
    every process that broke the rule and how. Never reads ``/proc/*/environ``.
    """
    group = group_of(processes)
    endpoints = tuple(where.endpoint(p) for p in group)
    problems: list[str] = []
    for process, endpoint in zip(group, endpoints, strict=True):
        evidence = socket_evidence(endpoint.path)
        if requested and evidence == "absent":
            evidence = _healed_evidence(endpoint)
        if evidence == "other":
            problems.append(
                f"{process.describe()}: {endpoint.path} is {discovery.what_is_at(endpoint.path)},"
                " not a socket: no shim can serve there until it is removed"
            )
        elif requested and evidence == "absent":
            problems.append(
                f"{process.describe()}: no control socket at {endpoint.path}, yet the group "
                f"requested cuinterpose: {_no_shim_hint(process, endpoint, where)}"
            )
        elif not requested and evidence == "socket":
            problems.append(
                f"{process.describe()}: a control socket at {endpoint.path}, yet the group "
                "did not request cuinterpose (a native checkpoint would fail on its sharing)"
            )
    if problems:
        wanted = "requested" if requested else "not requested"
        raise DetectionRefused(f"detection refused (cuinterpose {wanted}):", problems)
    return Detection("cuinterpose" if requested else "native", endpoints)


def _no_shim_hint(process: Process, endpoint: Endpoint, where: Where) -> str:
    if not discovery.pid_exists(process.observed_pid, where.proc_root):
        return f"pid {process.observed_pid} does not exist"
    if not discovery.is_running(process.observed_pid, where.proc_root):
        return f"pid {process.observed_pid} exited (a zombie its parent has not reaped)"
    return discovery.missing_shim_hint(process.observed_pid, endpoint.path.parent)


def remove_stale_sockets(
    processes: Sequence[Process | tuple[int, int]], where: Where
) -> tuple[Path, ...]:
    """Remove the control sockets of ``processes`` that nobody listens on any more, so
    that processes recreated by a restore (CRIU) can bind them. A socket a live shim
    still serves, or a path that is not a socket, is refused by name, nothing removed."""
    group = group_of(processes)
    stale: list[Path] = []
    problems: list[str] = []
    for process in group:
        path = where.endpoint(process).path
        evidence = socket_evidence(path)
        if evidence == "absent":
            continue
        if evidence == "other":
            problems.append(
                f"{process.describe()}: {path} is {discovery.what_is_at(path)}, not a socket;"
                " not removed"
            )
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                stale.append(path)
                continue
            except OSError as exc:
                problems.append(f"{process.describe()}: {path}: {exc.strerror}; not removed")
                continue
        problems.append(f"{process.describe()}: {path} is served by a live shim; not removed")
    if problems:
        raise AgentError("stale socket removal refused:", problems)
    for path in stale:
        path.unlink(missing_ok=True)
    return tuple(stale)
