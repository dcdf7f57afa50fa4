"""What a step does: the wire exchange with every participant, or a local action.

A run's mutable facts live in one :class:`Run`; each step reads and
extends it. The wire exchange sends the step's op to every participant at once
and accepts nothing but an OK reply in the expected phase from the expected
participant. Local actions are looked up by the :class:`~cuinterpose.phases.Action`
their step declares.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs

from ..phases import PHASE_OP, Action, MachineSpec, ProgressKind, Step
from . import discovery, quiesce
from . import trace as tracing
from .client import (
    BadReply,
    Endpoint,
    ParticipantError,
    ParticipantGone,
    ParticipantHangup,
    ParticipantTimeout,
)
from .directory import promote_intent, read_intent, write_intent
from .errors import Problem, StepFailed
from .fsm import step_op, step_reply_phase
from .options import RETRY_PAUSE_S, Options
from .progress import NativeKept, OpEvent, Transfer
from .statefile import (
    READABLE_PROTOCOL_VERSIONS,
    STATE_FILE_NAME,
    CheckpointState,
    StateFileError,
    StateParticipant,
    read_state,
    utc_timestamp,
    write_state,
)
from .topology import Topology
from .wire import VERSION, HostCopy, Op, Phase, Reply, Request, Status, WireError

_log = logging.getLogger(__name__)


@attrs.frozen
class Bound:
    """A participant as its HANDSHAKE reply bound it: durable id, pid, phase."""

    endpoint: Endpoint
    participant: str
    pid: int
    phase: Phase
    message: str


@attrs.define
class Run:
    """What one run of one machine has learned so far. Private to that run."""

    spec: MachineSpec
    endpoints: tuple[Endpoint, ...]
    checkpoint_dir: Path
    options: Options
    bound: tuple[Bound, ...] = ()
    replies: tuple[Reply, ...] = ()
    topology: Topology | None = None  # the latest INSPECT's
    captured: Topology | None = None  # the state file's
    state_file: CheckpointState | None = None
    state_path: Path | None = None
    events: list[OpEvent] = attrs.Factory(list)
    # What the step in progress adds to its trace entry.
    trace_extra: dict[str, Any] = attrs.Factory(dict)
    # Participants whose process was gone at HANDSHAKE (machines that drop them).
    gone: tuple[Problem, ...] = ()
    # What a rollback could not bring back, as the shims named it (ROLLBACK_IMPORTS).
    lost: list[str] = attrs.Factory(list)
    intent_path: Path | None = None
    # The run's lease token, carried by every request: each shim serves one
    # coordinator at a time (specs/recovery.md). A rollback after a failure
    # is the same coordinator's and carries the same token.
    lease: bytes = attrs.Factory(lambda: os.urandom(16))
    # A restore onto other GPUs: the mapping LOAD_ALLOCATIONS carries (gpus.wire_text),
    # "" for the GPUs of the capture.
    gpu_map: str = ""

    def observed(self) -> dict[str, int]:
        """Each bound participant's observed pid, by participant id."""
        return {b.participant: b.endpoint.observed_pid for b in self.bound}


def check_endpoints(endpoints: Sequence[Endpoint]) -> None:
    """Refuse endpoints that cannot be a team: none, or one socket twice."""
    if not endpoints:
        raise ValueError("at least one participant process is needed")
    seen: dict[Path, Endpoint] = {}
    for endpoint in endpoints:
        if endpoint.path in seen:
            raise ValueError(
                f"{endpoint.describe()} and {seen[endpoint.path].describe()} "
                "are the same control socket"
            )
        seen[endpoint.path] = endpoint


def _error_kind(error: ParticipantError) -> str:
    if isinstance(error, ParticipantTimeout):
        return "timed out"
    if isinstance(error, ParticipantHangup):
        return "hung up"
    if isinstance(error, BadReply):
        return "bad reply"
    return "failed"


def reply_problem(
    op: Op, phase: Phase | None, endpoint: Endpoint, result: Reply | ParticipantError
) -> Problem | None:
    """What is wrong with one participant's answer to ``op``, or None when nothing is."""
    pid, ns = endpoint.observed_pid, endpoint.namespace_pid
    if isinstance(result, ParticipantError):
        return Problem(f"{_error_kind(result)}: {result.reason}", result.participant, pid,
                       namespace_pid=ns)  # fmt: skip
    if result.op is not op:  # the client checks this too; a transport stand-in may not
        return Problem(
            f"reply echoes {result.op.name}, expected {op.name}", result.participant, pid,
            namespace_pid=ns,
        )  # fmt: skip
    if result.status is not Status.OK:
        text = result.message or "no message"
        return Problem(
            f"{result.status.name} in phase {result.phase.name}: {text}",
            result.participant,
            pid,
            result.not_quiet,
            namespace_pid=ns,
        )
    if phase is not None and result.phase is not phase:
        return Problem(
            f"reported phase {result.phase.name} after {op.name}, expected {phase.name}",
            result.participant,
            pid,
            namespace_pid=ns,
        )
    return None


def bind(
    machine: str, endpoints: Sequence[Endpoint], results: Sequence[Reply | ParticipantError]
) -> tuple[Bound, ...]:
    """Bind every endpoint to the participant its HANDSHAKE reply names, or fail."""
    problems: list[Problem] = []
    bound: list[Bound] = []
    owners: dict[str, Endpoint] = {}
    for endpoint, result in zip(endpoints, results, strict=True):
        problem = reply_problem(Op.HANDSHAKE, None, endpoint, result)
        if problem is not None:
            if isinstance(result, ParticipantError):
                # No participant id to go by yet: the socket path says who it was.
                problem = attrs.evolve(problem, reason=f"{problem.reason} ({endpoint.path})")
            problems.append(problem)
            continue
        assert isinstance(result, Reply)
        if result.pid != endpoint.namespace_pid:
            # The socket is named after the shim's own getpid(): another pid
            # answering means a stale or foreign socket, not the process asked for.
            problems.append(
                Problem(
                    f"the control socket of namespace pid {endpoint.namespace_pid} "
                    f"is served by pid {result.pid}",
                    result.participant,
                    endpoint.observed_pid,
                )
            )
            continue
        if result.participant in owners:
            problems.append(
                Problem(
                    f"answers at {endpoint.describe()} and at "
                    f"{owners[result.participant].describe()}",
                    result.participant,
                    endpoint.observed_pid,
                )
            )
            continue
        owners[result.participant] = endpoint
        bound.append(Bound(endpoint, result.participant, result.pid, result.phase, result.message))
    if problems:
        raise StepFailed(machine, Op.HANDSHAKE.name, problems)
    return tuple(bound)


def perform(run: Run, step: Step) -> OpEvent | None:
    """Do ``step``'s work; a wire step returns its progress event."""
    op = step_op(step)
    if op is not None:
        if run.spec.writes_intent and run.intent_path is None and step.tears_down:
            write_intent_file(run)
        return exchange(run, step, op)
    assert step.action is not None  # a step without an op has an action (phases checks)
    ACTIONS[step.action](run)
    return None


def exchange(run: Run, step: Step, op: Op) -> OpEvent:
    """Send ``op`` to every participant at once and check every answer: a barrier."""
    options = run.options
    calls: list[tuple[Endpoint, Request, str | None]]
    lease = run.lease
    if op is Op.HANDSHAKE:
        calls = [(e, Request(op, authorization=lease), None) for e in run.endpoints]
    else:
        # QUIESCE's deadline and round flag are set per round (quiesce.converge).
        gpu_map = run.gpu_map if op is Op.LOAD_ALLOCATIONS else ""
        calls = [
            (
                b.endpoint,
                Request(op, participant=b.participant, authorization=lease, gpu_map=gpu_map),
                b.participant,
            )
            for b in run.bound
        ]
    began = options.clock()
    quieting = None
    if op is Op.QUIESCE:
        quieting = quiesce.converge(run.spec.name, calls, partial(_attempt, run), options)
        results = quieting.results
    else:
        results = _send(run, calls, options.timeout_for(_transfer_bytes(run, op)))
    elapsed = options.clock() - began
    if op is Op.HANDSHAKE:
        if run.spec.drops_gone:
            answered = _drop_gone(run, calls, results)
            calls = [c for c, r in zip(calls, answered, strict=True) if r is not None]
            results = [r for r in answered if r is not None]
        run.bound = bind(run.spec.name, [e for e, _, _ in calls], results)
    else:
        expected = step_reply_phase(step)
        problems = [
            p
            for (endpoint, _, _), result in zip(calls, results, strict=True)
            if (p := _problem(op, expected, endpoint, result, quieting)) is not None
        ]
        if problems:
            raise StepFailed(run.spec.name, op.name, problems)
    run.replies = tuple(r for r in results if isinstance(r, Reply))
    if op is Op.ROLLBACK_IMPORTS:
        run.lost += [
            f"participant {r.participant} (pid {r.pid}): {r.message}"
            for r in run.replies
            if r.message
        ]
    if op is Op.INSPECT:
        run.topology = Topology.from_inspect((r.participant, r.pid, r.records) for r in run.replies)
    transfer = kept = None
    if op is Op.INSPECT:
        kept = NativeKept(
            sum(r.stats.count for r in run.replies), sum(r.stats.bytes for r in run.replies)
        )
    if step.progress is ProgressKind.TRANSFER:
        by_id = {b.participant: b for b in run.bound}
        transfer = Transfer.from_stats(
            [(r.participant, by_id[r.participant].endpoint.observed_pid, r.stats)
             for r in run.replies],
            elapsed,
            _host_copies(run.replies),
        )  # fmt: skip
    return OpEvent(run.spec.name, op.name, elapsed, len(run.endpoints), transfer, kept)


def _host_copies(replies: Sequence[Reply]) -> dict[str, tuple[HostCopy, str]]:
    """Each reply's HOST_COPY record (the kept host copy's figures) with its message; a
    reply whose records hold more than one is left out, and logged: the figures are the
    summary's, the op succeeded."""
    found: dict[str, tuple[HostCopy, str]] = {}
    for r in replies:
        try:
            host = HostCopy.in_reply(r.records)
        except WireError as exc:
            _log.warning("participant %s (pid %d): %s", r.participant, r.pid, exc)
            continue
        if host is not None:
            found[r.participant] = (host, r.message)
    return found


def _problem(
    op: Op,
    expected: Phase | None,
    endpoint: Endpoint,
    result: Reply | ParticipantError,
    quieting: quiesce.Outcome | None,
) -> Problem | None:
    """``reply_problem``, after what QUIESCE's rounds say of the answer (quiesce.problem)."""
    if quieting is not None and (found := quiesce.problem(endpoint, result, quieting)):
        return found
    return reply_problem(op, expected, endpoint, result)


def _transfer_bytes(run: Run, op: Op) -> int:
    """The bytes ``op`` moves, as far as the run knows them (0 for a phase that moves none)."""
    phase_op = PHASE_OP.get(op.name)
    if phase_op is None or not phase_op.transfers:
        return 0
    topology = run.topology or run.captured
    return topology.allocation_bytes if topology is not None else 0


def _send(
    run: Run, calls: Sequence[tuple[Endpoint, Request, str | None]], timeout: float
) -> list[Reply | ParticipantError]:
    """Send ``calls``; send again to every participant that answered RETRY, while
    attempts and the phase's time last. Every attempt goes into the trace in order."""
    options = run.options
    deadline = options.clock() + timeout
    results = _attempt(run, calls, timeout)
    pause = RETRY_PAUSE_S
    for _ in range(options.retry_attempts - 1):
        again = [i for i, r in enumerate(results) if _retryable(r)]
        if not again or options.clock() + pause >= deadline or _stopped(options, pause):
            break
        answers = _attempt(run, [calls[i] for i in again], deadline - options.clock())
        for i, answer in zip(again, answers, strict=True):
            results[i] = answer
        pause *= 2
    return results


def _attempt(
    run: Run, calls: Sequence[tuple[Endpoint, Request, str | None]], timeout: float
) -> list[Reply | ParticipantError]:
    options = run.options
    results = list(options.transport(calls, timeout=timeout))
    if options.trace is not None:  # hex-encoding every record is not free
        run.trace_extra.setdefault("exchanges", []).extend(
            tracing.exchange_entry(endpoint, request, result)
            for (endpoint, request, _), result in zip(calls, results, strict=True)
        )
    return results


def _retryable(result: Reply | ParticipantError) -> bool:
    return isinstance(result, Reply) and result.status is Status.RETRY


def _stopped(options: Options, pause: float) -> bool:
    """Wait ``pause`` before a resend; True when the run was told to stop meanwhile."""
    if options.stop is None:
        time.sleep(pause)
        return False
    return options.stop.wait(pause)


def _drop_gone(
    run: Run,
    calls: Sequence[tuple[Endpoint, Request, str | None]],
    results: Sequence[Reply | ParticipantError],
) -> list[Reply | ParticipantError | None]:
    """None for every participant whose process is gone (its socket missing or refused)."""
    kept: list[Reply | ParticipantError | None] = []
    gone: list[Problem] = []
    for (endpoint, _, _), result in zip(calls, results, strict=True):
        if isinstance(result, ParticipantGone):
            gone.append(Problem(f"gone: {result.reason}", None, endpoint.observed_pid))
            kept.append(None)
        else:
            kept.append(result)
    if gone and len(gone) == len(calls):
        raise StepFailed(run.spec.name, Op.HANDSHAKE.name, gone)
    run.gone = tuple(gone)
    if gone:
        run.trace_extra["gone"] = [str(p) for p in gone]
    return kept


def release(run: Run) -> tuple[Problem, ...]:
    """End the run's lease in every process it was sent to, whatever the outcome.

    Not a step (the machines and their traces do not change): a shim where the
    lease is held by another token, or was never taken, changes nothing. What
    did not answer keeps the lease until its holder (this process) is gone.
    """
    options = run.options
    calls = [(e, Request(Op.RELEASE, authorization=run.lease), None) for e in run.endpoints]
    results = options.transport(calls, timeout=options.phase_timeout)
    return tuple(
        p
        for (endpoint, _, _), result in zip(calls, results, strict=True)
        if (p := reply_problem(Op.RELEASE, None, endpoint, result)) is not None
    )


def _local_failure(run: Run, step: str, reason: str) -> StepFailed:
    return StepFailed(run.spec.name, step, [Problem(reason)])


def write_state_file(run: Run) -> None:
    try:
        if run.intent_path is not None and run.state_file is not None:
            run.state_path = promote_intent(run.checkpoint_dir)  # it says all the state says
        else:
            run.state_file = _state_of(run)
            run.state_path = write_state(run.checkpoint_dir, run.state_file)
    except (OSError, StateFileError) as exc:
        raise _local_failure(run, "WRITE_STATE", f"writing the state file failed: {exc}") from exc
    run.intent_path = None
    run.trace_extra["state_path"] = str(run.state_path)


def write_intent_file(run: Run) -> None:
    """Record the group durably before its first destructive op (see :mod:`.directory`)."""
    step = run.spec.steps[run.spec.first_teardown() or 0].trigger
    state = _state_of(run)
    try:
        run.intent_path = write_intent(run.checkpoint_dir, state)
    except (OSError, StateFileError) as exc:
        raise _local_failure(run, step, f"recording the intent failed: {exc}") from exc
    run.state_file = state
    run.trace_extra["intent_path"] = str(run.intent_path)


def _state_participant(bound: Bound) -> StateParticipant:
    """What the intent and the state file record of a bound participant: its pid as its
    shim says it, and the coordinator's pair, start time and pid namespace of it, by
    which a recover or restore addresses it (specs/state-file.md)."""
    endpoint = bound.endpoint
    proc_root = endpoint.rooted.proc_root if endpoint.rooted is not None else None
    observed = endpoint.observed_pid
    return StateParticipant(
        bound.participant,
        bound.pid,
        observed,
        discovery.start_ticks(observed, proc_root),
        discovery.pid_namespace(observed, proc_root),
    )


def _state_of(run: Run) -> CheckpointState:
    assert run.topology is not None
    return CheckpointState(
        protocol_version=VERSION,
        content_mode=run.options.content_mode,
        created_at=utc_timestamp(),
        participants=tuple(
            sorted(
                (_state_participant(b) for b in run.bound),
                key=lambda p: p.participant,
            )
        ),
        topology=run.topology,
    )


def read_topology_before(run: Run) -> None:
    """The topology before the capture, as the checkpoint directory keeps it: the
    intent's, else the state file's (the rollback's READ_TOPOLOGY step)."""
    if run.captured is not None:  # handed over by the run that failed
        return
    try:
        kept = read_intent(run.checkpoint_dir)
        if kept is None and (run.checkpoint_dir / STATE_FILE_NAME).is_file():
            kept = read_state(run.checkpoint_dir)
    except (OSError, StateFileError) as exc:
        # Every shim holds its own staged bytes: the file only lets VERIFY compare.
        # A corrupt or swapped one must not strand the group PREPARED.
        run.trace_extra["record_unreadable"] = str(exc)  # the trace's key, kept
        return
    if kept is not None:
        run.captured = kept.topology
        run.state_file = kept


def read_state_file(run: Run) -> None:
    if run.options.trace is not None:
        run.trace_extra["state_file"] = tracing.read_state_text(run.checkpoint_dir)
    try:
        state = read_state(run.checkpoint_dir)
    except StateFileError as exc:
        raise _local_failure(run, "READ_STATE", str(exc)) from exc
    except OSError as exc:
        raise _local_failure(run, "READ_STATE", f"state file unreadable: {exc}") from exc
    if state.protocol_version not in READABLE_PROTOCOL_VERSIONS:
        raise _local_failure(
            run,
            "READ_STATE",
            f"state file speaks protocol version {state.protocol_version}, "
            f"this coordinator {VERSION}",
        )
    run.state_file = state
    run.captured = state.topology


def _nothing(run: Run) -> None:
    """The step's guards are the whole step."""


ACTIONS: Final[Mapping[Action, Callable[[Run], None]]] = {
    Action.WRITE_STATE: write_state_file,
    Action.READ_STATE: read_state_file,
    Action.READ_TOPOLOGY: read_topology_before,
    Action.NOTHING: _nothing,
}
