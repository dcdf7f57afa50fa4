"""The lockstep runner: runs a machine of :mod:`cuinterpose.phases` against real participants.

Each wire step sends its op to every participant at once (``call_all``) and
waits for every reply, a barrier, before the machine moves on. Anything other
than an OK reply in the expected phase from the expected participant stops the
machine (fail-stop: nothing is rolled back) and no later op is sent to anyone.
Guards run before the step they sit on; those before the first destructive op
refuse, later ones fail.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
from transitions import EventData, Machine

from . import trace as tracing
from .client import (
    BadReply,
    Endpoint,
    ParticipantError,
    ParticipantHangup,
    ParticipantTimeout,
    call_all,
)
from .errors import (
    CoordinatorError,
    ParticipantsRefused,
    PhaseFailed,
    PreflightRefused,
    Problem,
    Refused,
    TopologyRefused,
    VerificationFailed,
)
from .fsm import (
    CAPTURE,
    FAIL_TRIGGER,
    REFUSE_TRIGGER,
    RESTORE,
    MachineSpec,
    ProgressKind,
    Step,
    build_machine,
    step_op,
    step_reply_phase,
)
from .progress import DoneEvent, FailedEvent, PhaseEvent, ProgressCallback, Transfer
from .statefile import (
    CheckpointState,
    StateFileError,
    StateParticipant,
    read_state,
    utc_timestamp,
    write_state,
)
from .topology import Topology
from .validate import Violation, preflight, validate
from .wire import VERSION, Op, Phase, Reply, Request, Status

# The transport: ``client.call_all``'s signature, injectable for embedders' tests.
Transport = Callable[..., list[Reply | ParticipantError]]

DEFAULT_PHASE_TIMEOUT_S = 120.0

# Which refusal a guard raises; guards after the first destructive op fail instead.
_REFUSALS: Mapping[str, type[Refused]] = {
    "all_active": ParticipantsRefused,
    "participants_match_state": ParticipantsRefused,
    "all_prepared": ParticipantsRefused,
    "topology_valid": TopologyRefused,
    "preflight_clean": PreflightRefused,
}


@attrs.frozen
class Options:
    """How a run behaves; every field has a default an embedder can keep."""

    phase_timeout: float = DEFAULT_PHASE_TIMEOUT_S
    on_progress: ProgressCallback | None = None
    trace: tracing.TraceSink | None = None
    content_mode: Literal["host", "native"] = "host"
    transport: Transport = call_all
    clock: Callable[[], float] = time.monotonic

    def __attrs_post_init__(self) -> None:
        if not self.phase_timeout > 0:
            raise ValueError(f"phase_timeout must be positive, got {self.phase_timeout}")


@attrs.frozen
class Bound:
    """A participant as its HANDSHAKE reply bound it: durable id, pid, phase."""

    endpoint: Endpoint
    participant: str
    pid: int
    phase: Phase
    message: str


@attrs.frozen
class CaptureResult:
    state: CheckpointState
    state_path: Path
    phases: tuple[PhaseEvent, ...]
    elapsed_s: float


@attrs.frozen
class RestoreResult:
    state: CheckpointState
    topology: Topology
    phases: tuple[PhaseEvent, ...]
    elapsed_s: float


def capture(
    endpoints: Sequence[Endpoint], checkpoint_dir: Path, options: Options | None = None
) -> CaptureResult:
    """Run the capture machine; the state file is written into ``checkpoint_dir``.

    Raises a :class:`~.errors.Refused` subclass when a guard refuses (nothing was
    changed), :class:`~.errors.PhaseFailed` when anything else stops the machine,
    and ValueError for endpoints that cannot be a team (none, or one socket twice).
    """
    run = _Run(CAPTURE, endpoints, Path(checkpoint_dir), options or Options())
    run.execute()
    assert run.state_file is not None and run.state_path is not None
    return CaptureResult(run.state_file, run.state_path, tuple(run.events), run.elapsed())


def restore(
    endpoints: Sequence[Endpoint], checkpoint_dir: Path, options: Options | None = None
) -> RestoreResult:
    """Run the restore machine against the state file in ``checkpoint_dir``.

    Raises as :func:`capture` does; :class:`~.errors.VerificationFailed` when the
    rebuilt topology is invalid or differs from the captured one.
    """
    run = _Run(RESTORE, endpoints, Path(checkpoint_dir), options or Options())
    run.execute()
    assert run.state_file is not None and run.topology is not None
    return RestoreResult(run.state_file, run.topology, tuple(run.events), run.elapsed())


def run_machine(
    spec: MachineSpec,
    endpoints: Sequence[Endpoint],
    checkpoint_dir: Path,
    options: Options | None = None,
) -> CaptureResult | RestoreResult:
    """Run ``spec`` (CAPTURE or RESTORE) by name, as the CLI and trace replay do."""
    if spec is CAPTURE:
        return capture(endpoints, checkpoint_dir, options)
    if spec is RESTORE:
        return restore(endpoints, checkpoint_dir, options)
    raise ValueError(f"no driver for machine {spec.name}")


def inspect(
    endpoints: Sequence[Endpoint], *, timeout: float, transport: Transport = call_all
) -> tuple[tuple[Bound, ...], Topology]:
    """HANDSHAKE then INSPECT, outside any machine: changes nothing in the participants."""
    _check_endpoints(endpoints)
    bound = _bind(
        "inspect",
        endpoints,
        transport([(e, Request(Op.HANDSHAKE), None) for e in endpoints], timeout=timeout),
    )
    calls = [
        (b.endpoint, Request(Op.INSPECT, participant=b.participant), b.participant) for b in bound
    ]
    results = transport(calls, timeout=timeout)
    problems = [
        p
        for b, result in zip(bound, results, strict=True)
        if (p := _reply_problem(Op.INSPECT, Phase.ACTIVE, b.endpoint, result)) is not None
    ]
    if problems:
        raise PhaseFailed("inspect", Op.INSPECT.name, problems)
    replies = [r for r in results if isinstance(r, Reply)]
    return bound, Topology.from_inspect((r.participant, r.pid, r.records) for r in replies)


def _check_endpoints(endpoints: Sequence[Endpoint]) -> None:
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


def _reply_problem(
    op: Op, phase: Phase | None, endpoint: Endpoint, result: Reply | ParticipantError
) -> Problem | None:
    """What is wrong with one participant's answer to ``op``, or None when nothing is."""
    pid = endpoint.observed_pid
    if isinstance(result, ParticipantError):
        return Problem(f"{_error_kind(result)}: {result.reason}", result.participant, pid)
    if result.op is not op:  # the client checks this too; a transport stand-in may not
        return Problem(
            f"reply echoes {result.op.name}, expected {op.name}", result.participant, pid
        )
    if result.status is not Status.OK:
        text = result.message or "no message"
        return Problem(
            f"{result.status.name} in phase {result.phase.name}: {text}", result.participant, pid
        )
    if phase is not None and result.phase is not phase:
        return Problem(
            f"reported phase {result.phase.name} after {op.name}, expected {phase.name}",
            result.participant,
            pid,
        )
    return None


def _bind(
    machine: str, endpoints: Sequence[Endpoint], results: Sequence[Reply | ParticipantError]
) -> tuple[Bound, ...]:
    """Bind every endpoint to the participant its HANDSHAKE reply names, or fail."""
    problems: list[Problem] = []
    bound: list[Bound] = []
    owners: dict[str, Endpoint] = {}
    for endpoint, result in zip(endpoints, results, strict=True):
        problem = _reply_problem(Op.HANDSHAKE, None, endpoint, result)
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
        raise PhaseFailed(machine, Op.HANDSHAKE.name, problems)
    return tuple(bound)


def _violation_problems(
    violations: Sequence[Violation], observed: Mapping[str, int]
) -> list[Problem]:
    return [
        Problem(_violation_text(v), v.participant or None, observed.get(v.participant))
        for v in violations
    ]


def _violation_text(violation: Violation) -> str:
    # The problem names the participant already; a team-wide violation keeps its own text.
    if not violation.participant:
        return str(violation)
    kind = violation.kind.name if violation.kind is not None else ""
    where = " ".join(part for part in (kind, violation.resource) if part)
    text = f"{violation.reason} [{violation.rule}]"
    return f"{where}: {text}" if where else text


class _Run:
    """One run of one machine: the ``transitions`` model. Mutable, private, never shared."""

    state: str  # set by transitions

    def __init__(
        self,
        spec: MachineSpec,
        endpoints: Sequence[Endpoint],
        checkpoint_dir: Path,
        options: Options,
    ) -> None:
        _check_endpoints(endpoints)
        self.spec = spec
        self.endpoints = tuple(endpoints)
        self.checkpoint_dir = checkpoint_dir
        self.options = options
        self.machine: Machine = build_machine(spec, self)
        self.bound: tuple[Bound, ...] = ()
        self.replies: tuple[Reply, ...] = ()
        self.topology: Topology | None = None
        self.captured: Topology | None = None
        self.state_file: CheckpointState | None = None
        self.state_path: Path | None = None
        self.events: list[PhaseEvent] = []
        self.guard_problems: dict[str, list[Problem]] = {}
        self.started = options.clock()
        self.step_record: dict[str, Any] = {}

    # -- the loop ---------------------------------------------------------------

    def elapsed(self) -> float:
        return self.options.clock() - self.started

    def execute(self) -> None:
        self._trace(
            tracing.start_entry(
                self.spec.name,
                self.endpoints,
                phase_timeout=self.options.phase_timeout,
                content_mode=self.options.content_mode,
                checkpoint_dir=self.checkpoint_dir,
            )
        )
        for step in self.spec.steps:
            source = self.state
            self.step_record = {}
            self.guard_problems = {}
            began = self.options.clock()
            try:
                moved = bool(self.machine.events[step.trigger].trigger(self))
            except CoordinatorError as failure:
                self._trace_step(step, source, began, "failed", failure)
                self._stop(FAIL_TRIGGER, failure)
                raise
            except Exception as exc:
                # A bug or an unforeseen OS error: still fail-stop, with the trace
                # and the progress stream closed properly, and the cause chained.
                internal = PhaseFailed(
                    self.spec.name, step.trigger, [Problem(f"internal error: {exc!r}")]
                )
                self._trace_step(step, source, began, "failed", internal)
                self._stop(FAIL_TRIGGER, internal)
                raise internal from exc
            if moved:
                self._trace_step(step, source, began, "ok", None)
                continue
            refusal = self._guard_error(step)
            self._trace_step(step, source, began, refusal.kind, refusal)
            self._stop(REFUSE_TRIGGER if isinstance(refusal, Refused) else FAIL_TRIGGER, refusal)
            raise refusal
        self._trace(tracing.end_entry(self.spec.name, "done", None, self.elapsed()))
        self._emit(
            DoneEvent(self.spec.name, self.elapsed(), len(self.endpoints), str(self.checkpoint_dir))
        )

    def _guard_error(self, step: Step) -> CoordinatorError:
        # transitions stops at the first false condition: that guard is the one to name.
        failed = next(g for g in step.guards if self.guard_problems.get(g))
        problems = self.guard_problems[failed]
        if self.spec.is_refusal(step.trigger):
            return _REFUSALS.get(failed, Refused)(self.spec.name, step.trigger, failed, problems)
        return VerificationFailed(self.spec.name, step.trigger, failed, problems)

    def _stop(self, trigger: str, error: CoordinatorError) -> None:
        source = self.state
        began = self.options.clock()
        self.machine.events[trigger].trigger(self)
        self._trace(
            tracing.transition_entry(
                self.spec.name, trigger, source, self.state, "ok",
                began - self.started, self.options.clock() - began, {},
            )
        )  # fmt: skip
        self._trace(tracing.end_entry(self.spec.name, error.kind, error, self.elapsed()))
        first = error.problems[0]
        self._emit(
            FailedEvent(
                machine=self.spec.name,
                kind=error.kind,
                phase=error.phase,
                participant=first.participant,
                pid=first.pid,
                reason=first.reason,
                elapsed_s=self.elapsed(),
                problems=tuple(str(p) for p in error.problems),
            )
        )

    def _emit(self, event: PhaseEvent | DoneEvent | FailedEvent) -> None:
        if self.options.on_progress is not None:
            self.options.on_progress(event)

    def _trace(self, entry: dict[str, Any]) -> None:
        if self.options.trace is not None:
            self.options.trace.write(entry)

    def _trace_step(
        self, step: Step, source: str, began: float, outcome: str, error: CoordinatorError | None
    ) -> None:
        if self.options.trace is None:
            return
        extra = dict(self.step_record)
        if self.guard_problems:
            extra["guards"] = {
                name: [tracing.problem_entry(p) for p in problems]
                for name, problems in self.guard_problems.items()
            }
        if error is not None:
            extra["problems"] = [tracing.problem_entry(p) for p in error.problems]
        self._trace(
            tracing.transition_entry(
                self.spec.name, step.trigger, source, self.state, outcome,
                began - self.started, self.options.clock() - began, extra,
            )
        )  # fmt: skip

    # -- performing steps (the ``before`` callback) -----------------------------

    def perform(self, event: EventData) -> None:
        step = self.spec.step(event.event.name)
        op = step_op(step)
        if op is not None:
            self._exchange(step, op)
        elif step.trigger == "WRITE_STATE":
            self._write_state()
        elif step.trigger == "READ_STATE":
            self._read_state()
        elif step.trigger == "VERIFY":
            pass  # the guards are the whole step
        else:
            raise AssertionError(f"no local action for step {step.trigger}")

    def _observed(self) -> dict[str, int]:
        return {b.participant: b.endpoint.observed_pid for b in self.bound}

    def _exchange(self, step: Step, op: Op) -> None:
        calls: list[tuple[Endpoint, Request, str | None]]
        if op is Op.HANDSHAKE:
            calls = [(e, Request(op), None) for e in self.endpoints]
        else:
            calls = [
                (b.endpoint, Request(op, participant=b.participant), b.participant)
                for b in self.bound
            ]
        began = self.options.clock()
        results = self.options.transport(calls, timeout=self.options.phase_timeout)
        elapsed = self.options.clock() - began
        if self.options.trace is not None:  # hex-encoding every record is not free
            self.step_record["exchanges"] = [
                tracing.exchange_entry(endpoint, request, result)
                for (endpoint, request, _), result in zip(calls, results, strict=True)
            ]
        if op is Op.HANDSHAKE:
            self.bound = _bind(self.spec.name, self.endpoints, results)
            self.replies = tuple(r for r in results if isinstance(r, Reply))
        else:
            problems = [
                p
                for (endpoint, _, _), result in zip(calls, results, strict=True)
                if (p := _reply_problem(op, step_reply_phase(step), endpoint, result)) is not None
            ]
            if problems:
                raise PhaseFailed(self.spec.name, op.name, problems)
            self.replies = tuple(r for r in results if isinstance(r, Reply))
        if op is Op.INSPECT:
            self.topology = Topology.from_inspect(
                (r.participant, r.pid, r.records) for r in self.replies
            )
        transfer = None
        if step.progress is ProgressKind.TRANSFER:
            transfer = Transfer.from_stats(
                [(r.participant, b.endpoint.observed_pid, r.stats) for r, b in self._paired()],
                elapsed,
            )
        event = PhaseEvent(self.spec.name, op.name, elapsed, len(self.endpoints), transfer)
        self.events.append(event)
        self._emit(event)

    def _paired(self) -> list[tuple[Reply, Bound]]:
        by_id = {b.participant: b for b in self.bound}
        return [(r, by_id[r.participant]) for r in self.replies]

    def _local_failure(self, step: str, reason: str) -> PhaseFailed:
        return PhaseFailed(self.spec.name, step, [Problem(reason)])

    def _write_state(self) -> None:
        assert self.topology is not None
        state = CheckpointState(
            protocol_version=VERSION,
            content_mode=self.options.content_mode,
            created_at=utc_timestamp(),
            participants=tuple(
                sorted(
                    (StateParticipant(b.participant, b.pid) for b in self.bound),
                    key=lambda p: p.participant,
                )
            ),
            topology=self.topology,
        )
        try:
            self.state_path = write_state(self.checkpoint_dir, state)
        except (OSError, StateFileError) as exc:
            raise self._local_failure(
                "WRITE_STATE", f"writing the state file failed: {exc}"
            ) from exc
        self.state_file = state
        self.step_record["state_path"] = str(self.state_path)

    def _read_state(self) -> None:
        if self.options.trace is not None:
            self.step_record["state_file"] = tracing.read_state_text(self.checkpoint_dir)
        try:
            state = read_state(self.checkpoint_dir)
        except StateFileError as exc:
            raise self._local_failure("READ_STATE", str(exc)) from exc
        except OSError as exc:
            raise self._local_failure("READ_STATE", f"state file unreadable: {exc}") from exc
        if state.protocol_version != VERSION:
            raise self._local_failure(
                "READ_STATE",
                f"state file speaks protocol version {state.protocol_version}, "
                f"this coordinator {VERSION}",
            )
        self.state_file = state
        self.captured = state.topology

    # -- guards (conditions, by the names declared in phases) -------------------

    def _guard(self, name: str, problems: list[Problem]) -> bool:
        self.guard_problems[name] = problems
        return not problems

    def all_active(self, event: EventData) -> bool:
        return self._guard("all_active", self._phase_problems(Phase.ACTIVE))

    def all_prepared(self, event: EventData) -> bool:
        return self._guard("all_prepared", self._phase_problems(Phase.PREPARED))

    def _phase_problems(self, expected: Phase) -> list[Problem]:
        problems = []
        for b in self.bound:
            if b.phase is expected:
                continue
            # A FAILED shim's HANDSHAKE message is the reason it failed: pass it on.
            detail = f": {b.message}" if b.phase is Phase.FAILED and b.message else ""
            problems.append(
                Problem(
                    f"is in phase {b.phase.name}{detail}, expected {expected.name}",
                    b.participant,
                    b.endpoint.observed_pid,
                )
            )
        return problems

    def topology_valid(self, event: EventData) -> bool:
        assert self.topology is not None
        return self._guard(
            "topology_valid", _violation_problems(validate(self.topology), self._observed())
        )

    def preflight_clean(self, event: EventData) -> bool:
        assert self.topology is not None
        return self._guard(
            "preflight_clean", _violation_problems(preflight(self.topology), self._observed())
        )

    def checkpoint_dir_writable(self, event: EventData) -> bool:
        reason = checkpoint_dir_ready(self.checkpoint_dir)
        return self._guard("checkpoint_dir_writable", [Problem(reason)] if reason else [])

    def participants_match_state(self, event: EventData) -> bool:
        assert self.state_file is not None
        recorded = {p.participant: p.pid for p in self.state_file.participants}
        answering = {b.participant for b in self.bound}
        problems = [
            Problem(
                f"is in the state file but no given process answers as it (pid {pid} at capture)",
                participant,
            )
            for participant, pid in sorted(recorded.items())
            if participant not in answering
        ]
        problems += [
            Problem("answers but is not in the state file", b.participant, b.endpoint.observed_pid)
            for b in self.bound
            if b.participant not in recorded
        ]
        return self._guard("participants_match_state", problems)

    def topology_matches_capture(self, event: EventData) -> bool:
        assert self.captured is not None and self.topology is not None
        differences = self.captured.differences(self.topology)
        if not differences and not self.captured.same_shape(self.topology):
            differences = ("restored topology differs from the captured one",)
        return self._guard(
            "topology_matches_capture",
            [Problem(f"restored topology differs: {d}") for d in differences],
        )


def checkpoint_dir_ready(path: Path) -> str | None:
    """Why the state file could not be written into ``path``, or None when it can."""
    if not path.is_dir():
        return f"checkpoint directory {path} does not exist"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"checkpoint directory {path} is not writable"
    return None
