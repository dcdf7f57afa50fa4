"""The lockstep runner: runs a machine of :mod:`cuinterpose.phases` against real participants.

Each wire step sends its op to every participant at once and waits for every
reply, a barrier, before the machine moves on (:mod:`.steps`). Anything other
than an OK reply in the expected phase from the expected participant stops the
machine (fail-stop: no later op of that machine is sent to anyone). A machine
stopped after its first op that tears something down is then rolled back
(the ROLLBACK machine, unless ``Options.rollback_on_failure`` is off: then
``cuinterpose recover`` undoes it); one stopped before changed nothing to undo.
Guards (:mod:`.guards`) run before the step they sit on; those before the first
destructive op refuse, later ones fail. This module is the loop alone: it
moves the ``transitions`` machine, and traces and reports every transition.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from transitions import EventData, Machine

from ..phases import Step
from . import trace as tracing
from .client import Endpoint, call_all
from .directory import DirectoryBusy, DirectoryUntrusted, clear_intent, finish_restore, locked
from .errors import (
    REFUSALS,
    CheckpointDirRefused,
    CoordinatorError,
    Interrupted,
    Problem,
    Refused,
    StepFailed,
    VerificationFailed,
)
from .fsm import (
    CAPTURE,
    FAIL_TRIGGER,
    REFUSE_TRIGGER,
    RESTORE,
    ROLLBACK,
    MachineSpec,
    build_machine,
)
from .gpus import wire_text
from .guards import GUARDS
from .options import DEFAULT_PHASE_TIMEOUT_S, Options, Transport
from .progress import DoneEvent, FailedEvent, OpEvent
from .statefile import CheckpointState
from .steps import Bound, Run, bind, check_endpoints, perform, release, reply_problem
from .topology import Topology
from .wire import Op, Phase, Reply, Request

__all__ = [
    "DEFAULT_PHASE_TIMEOUT_S",
    "Bound",
    "CaptureResult",
    "Options",
    "RestoreResult",
    "RollbackResult",
    "Transport",
    "capture",
    "inspect",
    "restore",
    "rollback",
    "run_machine",
]


@attrs.frozen
class CaptureResult:
    state: CheckpointState
    state_path: Path
    phases: tuple[OpEvent, ...]
    elapsed_s: float


@attrs.frozen
class RestoreResult:
    state: CheckpointState
    topology: Topology
    phases: tuple[OpEvent, ...]
    elapsed_s: float
    # Late steps that did not go through after the group ran (the directory is usable).
    warnings: tuple[str, ...] = ()


@attrs.frozen
class RollbackResult:
    topology: Topology
    gone: tuple[Problem, ...]  # participants whose process was not there any more
    phases: tuple[OpEvent, ...]
    elapsed_s: float
    lost: tuple[str, ...] = ()  # shared ranges whose creator died with their bytes


def capture(
    endpoints: Sequence[Endpoint], checkpoint_dir: Path, options: Options | None = None
) -> CaptureResult:
    """Run the capture machine; the state file is written into ``checkpoint_dir``.

    Raises a :class:`~.errors.Refused` subclass when a guard refuses (nothing was
    changed), :class:`~.errors.StepFailed` when anything else stops the machine
    (after a destructive op, the group was rolled back first: see the error's
    ``rolled_back`` and ``rollback_error``), and ValueError for endpoints that
    cannot be a team (none, or one socket twice).
    """
    loop = _Loop(CAPTURE, endpoints, Path(checkpoint_dir), options or Options())
    _execute(loop)
    run = loop.run
    assert run.state_file is not None and run.state_path is not None
    return CaptureResult(run.state_file, run.state_path, tuple(run.events), loop.elapsed())


def restore(
    endpoints: Sequence[Endpoint],
    checkpoint_dir: Path,
    options: Options | None = None,
    *,
    gpu_pairs: Sequence[tuple[str, str]] = (),
    lease: bytes | None = None,
) -> RestoreResult:
    """Run the restore machine against the state file in ``checkpoint_dir``.

    ``gpu_pairs`` (old UUID, new UUID; :func:`.gpus.resolve`): the native restore put
    the processes onto those GPUs; every shim's LOAD_ALLOCATIONS checks it did.
    ``lease``: the token of a lease the caller took already (a resume takes it before
    its native restore): the run goes on under it, and releases it as it ends.
    Raises as :func:`capture` does; :class:`~.errors.VerificationFailed` when the
    rebuilt topology is invalid or differs from the captured one.
    """
    loop = _Loop(RESTORE, endpoints, Path(checkpoint_dir), options or Options())
    loop.run.gpu_map = wire_text(gpu_pairs)
    if lease is not None:
        loop.run.lease = lease
    _execute(loop)
    run = loop.run
    assert run.state_file is not None and run.topology is not None
    warnings = finish_restore(loop.run.checkpoint_dir, run.state_file)
    return RestoreResult(run.state_file, run.topology, tuple(run.events), loop.elapsed(), warnings)


def rollback(
    endpoints: Sequence[Endpoint],
    checkpoint_dir: Path,
    options: Options | None = None,
    *,
    captured: Topology | None = None,
) -> RollbackResult:
    """Bring every participant still there back to ACTIVE, bytes and sharing as before.

    ``captured`` is the topology before the capture when the caller has it; else the
    checkpoint directory's intent (or state file) provides it. Participants whose
    process is gone are left out and reported in ``gone``. The intent is removed
    once the group is back.
    """
    options = attrs.evolve(options or Options(), stop=None, rollback_on_failure=False, on_step=None)
    loop = _Loop(ROLLBACK, endpoints, Path(checkpoint_dir), options)
    loop.run.captured = captured
    _execute(loop)
    run = loop.run
    assert run.topology is not None
    clear_intent(run.checkpoint_dir)
    return RollbackResult(
        run.topology, run.gone, tuple(run.events), loop.elapsed(), tuple(run.lost)
    )


def _execute(loop: _Loop) -> None:
    """Run the loop with the directory locked; after a failure past the first
    destructive op, roll the group back (when the options say so) before raising."""
    directory = loop.run.checkpoint_dir
    try:
        with locked(directory):
            try:
                loop.execute()
            except CoordinatorError as error:
                error.destroyed = loop.destroyed
                if loop.destroyed and loop.options.rollback_on_failure:
                    _roll_back_after(loop, error)
                elif not loop.destroyed and loop.run.intent_path is not None:
                    # Stopped at QUIESCE: the lease's end below reopens every gate;
                    # nothing is left to recover.
                    clear_intent(directory)
                raise
            finally:
                # The lease lasts while the run is in flight: a restore after the
                # native checkpoint, or recover, is another coordinator's run.
                release(loop.run)
    except DirectoryBusy as busy:
        guard = "checkpoint_dir_trusted" if isinstance(busy, DirectoryUntrusted) else None
        raise CheckpointDirRefused(
            loop.spec.name, "LOCK", guard or "checkpoint_dir_free", [Problem(str(busy))]
        ) from None


def _roll_back_after(loop: _Loop, error: CoordinatorError) -> None:
    endpoints = [b.endpoint for b in loop.run.bound] or list(loop.run.endpoints)
    captured = loop.run.topology if loop.spec is CAPTURE else loop.run.captured
    try:
        # The lock is held already: the rollback is this coordinator's own.
        inner = _Loop(ROLLBACK, endpoints, loop.run.checkpoint_dir, loop.options_for_rollback())
        inner.run.lease = loop.run.lease  # the same coordinator: its lease goes on
        inner.run.captured = captured
        inner.execute()
        clear_intent(loop.run.checkpoint_dir)
        error.rolled_back = True
        error.rollback_lost = tuple(inner.run.lost)
    except CoordinatorError as failed:
        error.rollback_error = failed


def run_machine(
    spec: MachineSpec,
    endpoints: Sequence[Endpoint],
    checkpoint_dir: Path,
    options: Options | None = None,
) -> CaptureResult | RestoreResult | RollbackResult:
    """Run ``spec`` (CAPTURE, RESTORE or ROLLBACK) by name, as the CLI and trace replay do."""
    if spec is CAPTURE:
        return capture(endpoints, checkpoint_dir, options)
    if spec is RESTORE:
        return restore(endpoints, checkpoint_dir, options)
    if spec is ROLLBACK:
        return rollback(endpoints, checkpoint_dir, options)
    raise ValueError(f"no runner for machine {spec.name}")


def inspect(
    endpoints: Sequence[Endpoint], *, timeout: float, transport: Transport = call_all
) -> tuple[tuple[Bound, ...], Topology]:
    """HANDSHAKE then INSPECT, outside any machine: changes nothing in the participants."""
    check_endpoints(endpoints)
    bound = bind(
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
        if (p := reply_problem(Op.INSPECT, Phase.ACTIVE, b.endpoint, result)) is not None
    ]
    if problems:
        raise StepFailed("inspect", Op.INSPECT.name, problems)
    replies = [r for r in results if isinstance(r, Reply)]
    return bound, Topology.from_inspect((r.participant, r.pid, r.records) for r in replies)


class _Loop:
    """One run of one machine: the ``transitions`` model. Mutable, private, never shared.

    Its conditions are the spec's guards, one attribute each, all answered by
    :data:`.guards.GUARDS`; its ``perform`` is :func:`.steps.perform`.
    """

    def __init__(
        self,
        spec: MachineSpec,
        endpoints: Sequence[Endpoint],
        checkpoint_dir: Path,
        options: Options,
    ) -> None:
        check_endpoints(endpoints)
        self.spec = spec
        self.options = options
        self.run = Run(spec, tuple(endpoints), checkpoint_dir, options)
        self.problems: dict[str, list[Problem]] = {}  # the current step's guards'
        for guard in spec.guards:
            setattr(self, guard.name, functools.partial(self._check, guard.name))
        self.machine_state = spec.initial  # set by transitions from here on
        self.machine: Machine = build_machine(spec, self, model_attribute="machine_state")
        self.started = options.clock()
        self.destroyed = False  # an op that tears something down has been sent

    def options_for_rollback(self) -> Options:
        return attrs.evolve(self.options, stop=None, rollback_on_failure=False, on_step=None)

    def elapsed(self) -> float:
        return self.options.clock() - self.started

    def execute(self) -> None:
        self._trace(
            tracing.start_entry(
                self.spec.name,
                self.run.endpoints,
                phase_timeout=self.options.phase_timeout,
                content_mode=self.options.content_mode,
                checkpoint_dir=self.run.checkpoint_dir,
                rollback_on_failure=self.options.rollback_on_failure,
            )
        )
        for step in self.spec.steps:
            source = self.machine_state
            self.run.trace_extra = {}
            self.problems = {}
            began = self.options.clock()
            if self.options.stop is not None and self.options.stop.is_set():
                interrupted = Interrupted(
                    self.spec.name,
                    step.trigger,
                    [Problem(f"stopped on request before {step.trigger}")],
                )
                self._stop(FAIL_TRIGGER, interrupted)
                raise interrupted
            try:
                moved = bool(self.machine.events[step.trigger].trigger(self))
            except CoordinatorError as failure:
                self._trace_step(step, source, began, "failed", failure)
                self._stop(FAIL_TRIGGER, failure)
                raise
            except Exception as exc:
                # A bug or an unforeseen OS error: still fail-stop, with the trace
                # and the progress stream closed properly, and the cause chained.
                internal = StepFailed(
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
            DoneEvent(
                self.spec.name,
                self.elapsed(),
                len(self.run.endpoints),
                str(self.run.checkpoint_dir),
            )
        )

    # -- the model's callbacks ---------------------------------------------------

    def perform(self, event: EventData) -> None:
        step = self.spec.step(event.event.name)
        if self.options.on_step is not None:
            # Before ``destroyed``: a run the hook stops here has not sent this op.
            self.options.on_step(self.spec.name, step.trigger)
        self.destroyed = self.destroyed or step.tears_down
        phase_event = perform(self.run, step)
        if phase_event is not None:
            self.run.events.append(phase_event)
            self._emit(phase_event)

    def _check(self, name: str, event: EventData) -> bool:
        problems = GUARDS[name](self.run)
        self.problems[name] = problems
        return not problems

    # -- stopping ----------------------------------------------------------------

    def _guard_error(self, step: Step) -> CoordinatorError:
        # transitions stops at the first false condition: that guard is the one to name.
        failed = next(g for g in step.guards if self.problems.get(g))
        problems = self.problems[failed]
        if self.spec.is_refusal(step.trigger):
            refusal = REFUSALS[self.spec.guard(failed).refusal]
            return refusal(self.spec.name, step.trigger, failed, problems)
        return VerificationFailed(self.spec.name, step.trigger, failed, problems)

    def _stop(self, trigger: str, error: CoordinatorError) -> None:
        source = self.machine_state
        began = self.options.clock()
        self.machine.events[trigger].trigger(self)
        self._trace(
            tracing.transition_entry(
                self.spec.name, trigger, source, self.machine_state, "ok",
                began - self.started, self.options.clock() - began, {},
            )
        )  # fmt: skip
        self._trace(tracing.end_entry(self.spec.name, error.kind, error, self.elapsed()))
        first = error.problems[0]
        self._emit(
            FailedEvent(
                machine=self.spec.name,
                kind=error.kind,
                phase=error.step,
                participant=first.participant,
                pid=first.pid,
                reason=first.reason,
                elapsed_s=self.elapsed(),
                problems=tuple(str(p) for p in error.problems),
                check=error.guard,
                rules=tuple(sorted({p.rule for p in error.problems if p.rule})),
            )
        )

    # -- reporting ---------------------------------------------------------------

    def _emit(self, event: OpEvent | DoneEvent | FailedEvent) -> None:
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
        extra = dict(self.run.trace_extra)
        if self.problems:
            extra["guards"] = {
                name: [tracing.problem_entry(p) for p in problems]
                for name, problems in self.problems.items()
            }
        if error is not None:
            extra["problems"] = [tracing.problem_entry(p) for p in error.problems]
        self._trace(
            tracing.transition_entry(
                self.spec.name, step.trigger, source, self.machine_state, outcome,
                began - self.started, self.options.clock() - began, extra,
            )
        )  # fmt: skip
