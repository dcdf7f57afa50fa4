"""A group's standing: every process's native state and its shim's phase (``status``),
and the refusal of a verb whose processes are not in the native state it needs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from .client import ParticipantError, call_all, pid_visible
from .detection import Sighting, Where, group_of, look
from .errors import AgentError
from .manifest import Process, resume_hint
from .native_checkpoint import NativeBackend, ProcessState, state_names
from .serial import shape
from .stopped import stopped
from .wire import HostCopy, InFlight, Op, Request

# What the driver's cuCheckpointProcessGetState answers for a pid with no CUDA state.
_NOT_CUDA = "unknown (CUDA_ERROR_NOT_INITIALIZED)"


class StateRefused(AgentError):
    """A process is not in the native state the command needs: nothing was done."""


def _in_flight(in_flight: InFlight | None) -> dict[str, Any] | None:
    if in_flight is None or in_flight.op is None:
        return None
    return {
        "op": in_flight.op.name,
        "bytes_done": in_flight.bytes_done,
        "bytes_total": in_flight.bytes_total,
        "elapsed_s": in_flight.elapsed_ns / 1e9,
    }


def _host_copy(host: HostCopy | None) -> dict[str, Any] | None:
    if host is None:
        return None
    return {"bytes": host.bytes, "copies": host.count, "hash_table_bytes": host.overhead}


@shape(
    flatten={"process": {"observed_pid": "observed_pid", "namespace_pid": "namespace_pid"}},
    omit=frozenset({"in_flight", "problem", "host_copy"}),
    convert={"in_flight": _in_flight, "host_copy": _host_copy},
)
@attrs.frozen
class ProcessStatus:
    """One process as :func:`status` found it."""

    process: Process
    native_state: str  # a ProcessState name, or "unknown (<why>)"
    shim_phase: str | None  # None: no control socket
    participant: str | None = None
    in_flight: InFlight | None = None
    problem: str = ""  # why the shim did not answer, or its stored failure reason
    # The host memory its kept host copies hold (SNAPSHOT_SHIM_KEEP_HOST_COPY); None when
    # the shim is not in that mode and holds none.
    host_copy: HostCopy | None = None

    def describe(self) -> str:
        shim = self.shim_phase or "no shim socket"
        text = f"{self.process.describe()}: native {self.native_state}, shim {shim}"
        return f"{text} ({self.problem})" if self.problem else text


def status(
    processes: Sequence[Process | tuple[int, int]],
    where: Where,
    native: NativeBackend,
    *,
    timeout: float = 5.0,
    seen: Sequence[Sighting] | None = None,
) -> tuple[ProcessStatus, ...]:
    """Every process's native state and its shim's phase and op in flight (STATUS, which
    changes and binds nothing and is served while a phase op runs). ``seen``: what the
    caller's :func:`~.detection.look` found at the group's sockets, not looked at again."""
    group = group_of(processes)
    states = state_names(native, [p.observed_pid for p in group])
    if seen is None:
        seen = look(group, where, heal=True)  # a removed socket its shim re-creates
    elif [s.process for s in seen] != list(group):
        raise ValueError("status: what was seen is not of these processes")
    # A stopped process answers nothing until continued: named, not waited for.
    held = {p: stopped(p.observed_pid, where.proc_root) for p in group}
    present = [s.evidence == "socket" for s in seen]
    asked = [s.endpoint for s in seen if s.evidence == "socket" and not held[s.process]]
    answers = iter(call_all([(e, Request(Op.STATUS), None) for e in asked], timeout=timeout))
    out: list[ProcessStatus] = []
    for process, here in zip(group, present, strict=True):
        native_state = states[process.observed_pid]
        if not here:
            out.append(ProcessStatus(process, native_state, None))
            continue
        if held[process]:
            out.append(ProcessStatus(process, native_state, "not answering", problem=held[process]))
            continue
        reply = next(answers)
        if isinstance(reply, ParticipantError):
            out.append(ProcessStatus(process, native_state, "not answering", problem=reply.reason))
            continue
        if reply.status != 0:
            problem = f"STATUS answered {reply.status.name}: {reply.message}"
            out.append(ProcessStatus(process, native_state, reply.phase.name, problem=problem))
            continue
        out.append(
            ProcessStatus(
                process,
                native_state,
                reply.phase.name,
                reply.participant,
                InFlight.from_stats(reply.stats),
                reply.message,
                HostCopy.in_reply(reply.records),
            )
        )
    return tuple(out)


def status_lines(group: Sequence[Process], where: Where, native: NativeBackend) -> list[str]:
    """One line per process, as a failure's report ends (``now ...``)."""
    return [s.describe() for s in status(group, where, native)]


def require_states(
    native: NativeBackend,
    processes: Sequence[Process | tuple[int, int]],
    wanted: ProcessState,
    command: str,
    hint: str,
) -> None:
    """Refuse (:class:`StateRefused`, nothing changed) unless every process is ``wanted``;
    the message names each other one and says what to run."""
    group = group_of(processes)
    states = state_names(native, [p.observed_pid for p in group])
    odd = [p for p in group if states[p.observed_pid] != wanted.name]
    # The driver could not say (a state it names is a live process's), and no process
    # has the pid: it is gone, which the driver's error does not say.
    gone = [
        p
        for p in odd
        if states[p.observed_pid] not in ProcessState.__members__
        and not pid_visible(p.observed_pid)
    ]
    # The driver has no CUDA state for a live process: it is none of its processes.
    foreign = [p for p in odd if p not in gone and states[p.observed_pid] == _NOT_CUDA]
    wrong = [
        f"{p.describe()} is gone (no process has pid {p.observed_pid})"
        if p in gone
        else f"{p.describe()} is not a CUDA process of this driver "
        "(cuCheckpointProcessGetState answered CUDA_ERROR_NOT_INITIALIZED: it never "
        "initialized CUDA, or runs on another driver)"
        if p in foreign
        else f"{p.describe()} is {states[p.observed_pid]}, not {wanted.name}"
        for p in odd
    ]
    if gone:
        wrong.append(
            "a process that is gone cannot take part: `cuinterpose recover` brings the "
            "survivors back (specs/recovery.md)"
        )
    if foreign:
        wrong.append("name only the processes that use the GPU through this driver")
    if wrong:
        # The caller's hint is about native states; a group whose only trouble is
        # processes that are not CUDA ones (or gone) is told only that.
        about_states = len(odd) > len(gone) + len(foreign)
        raise StateRefused(f"{command} refused: {hint}" if about_states else
                           f"{command} refused:", wrong)  # fmt: skip


def require_natively_running(
    machine: str,
    native: NativeBackend,
    processes: Sequence[Process | tuple[int, int]],
    checkpoint_dir: Path,
    *,
    resume: str | None = None,
) -> None:
    """The capture and restore machines (``prepare``, ``restore``) run on processes
    natively RUNNING: one natively locked or checkpointed is refused
    (:class:`StateRefused`, nothing changed) with what brings it back first; ``resume``
    is that command as the caller prints it (default: :func:`~.manifest.resume_hint`).
    Raises NativeUnavailableError when no driver can say (the caller decides whether
    to go on unchecked)."""
    back = resume if resume is not None else resume_hint(checkpoint_dir)
    if machine == "capture":
        hint = (
            "a process is natively locked or checkpointed; bring it back first "
            f"({resume_hint(checkpoint_dir)}, or the native restore and unlock), then prepare"
        )
    else:
        hint = (
            "restore runs after the native restore and unlock of every process; run them "
            f"first (`cuinterpose native --action restore` and `--action unlock`, or {back})"
        )
    require_states(native, processes, ProcessState.RUNNING, machine, hint)
