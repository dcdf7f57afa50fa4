"""QUIESCE in rounds: how a team converges to a quiet point (specs/quiesce.md).

Every shim closes its gate at a slightly different moment. Two ranks can then be a
collective apart: one launched collective N and waits for it, its peer is held at
the synchronization before launching N. Waiting does not end that; letting the idle
peer make exactly one more synchronization does. So QUIESCE is sent in rounds:

- round 1 closes every gate and waits up to the round's length;
- while any participant is still busy (PENDING: its gate stays closed, launches
  flow), the next round goes to every participant: a busy one keeps waiting, a
  quiet one (QUIESCED) advances: each of its threads held at a synchronizing call
  makes that call, runs on to its next one, and is held again;
- the team is quiet when every participant answers QUIESCED in the same round (a
  QUIESCED process holds every launch, so it stays quiet).

A round stays :data:`FIRST_ROUND_S` long while some quiet participant has threads
held at its gate: an advance can move the team, and the busy one need not wait long
for it (on two H200s an NCCL rank took up to seven advances). Rounds in which
nobody can advance grow, up to :data:`LONGEST_ROUND_S`: then only waiting helps. They end with
the team quiet, with a refusal (a shim's own deadline, counted from its first
round, ran out: its gate is open again), or when ``Options.quiesce_deadline`` is
spent: the pending shims are then reported as not quiet, and the run's RELEASE
opens their gates.

A capture still refused as not quiet (an application that did not synchronize for
a shim's whole deadline; ranks whose synchronizations interleave so that every
advance overtakes the other) changed nothing, and its gates open as the run ends:
:func:`until_quiet` starts it over, up to :data:`CAPTURE_ATTEMPTS` in all, closing
the gates at another moment. Every verb that captures (``suspend``, ``prepare``)
runs its capture through it; the machine itself (:func:`~.runner.capture`, trace
replay) runs once.

This module is the whole QUIESCE policy: the steps send what it says and report
what it finds (:func:`problem`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final, TypeGuard, TypeVar

import attrs

from . import errors
from .client import Endpoint, ParticipantError
from .errors import NOT_QUIET, CoordinatorError, Problem, StepFailed
from .options import Options
from .progress import PendingParticipant, QuiesceRound
from .wire import Phase, Reply, Request, Status

FIRST_ROUND_S: Final = 0.02
LONGEST_ROUND_S: Final = 0.5
# A capture refused as not quiet starts over once (see above).
CAPTURE_ATTEMPTS: Final = 2

Call = tuple[Endpoint, Request, str | None]
Send = Callable[[Sequence[Call], float], list[Reply | ParticipantError]]
T = TypeVar("T")


def round_length(index: int) -> float:
    """The time round ``index`` (0 first) gives each shim before it answers PENDING."""
    return min(FIRST_ROUND_S * 2.0**index, LONGEST_ROUND_S)


def pending(result: Reply | ParticipantError) -> TypeGuard[Reply]:
    """Whether ``result`` is a shim still getting quiet, its gate closed."""
    return (
        isinstance(result, Reply)
        and result.status is Status.PENDING
        and result.phase is Phase.ACTIVE
    )


def quiet(result: Reply | ParticipantError) -> TypeGuard[Reply]:
    return (
        isinstance(result, Reply) and result.status is Status.OK and result.phase is Phase.QUIESCED
    )


@attrs.frozen
class Outcome:
    """The last round's answers, and how the rounds went."""

    results: list[Reply | ParticipantError]
    rounds: int
    elapsed_s: float


def converge(
    machine: str,
    calls: Sequence[Call],
    send: Send,
    options: Options,
) -> Outcome:
    """Send QUIESCE rounds to ``calls`` until the team is quiet or cannot be.

    Returns the last round's answers: all QUIESCED, or some PENDING (the overall
    deadline was spent, or the run was told to stop), or some other answer the
    caller reports as it reports any failed op.
    """
    clock = options.clock
    began = clock()
    budget = options.quiesce_deadline
    index = rounds = 0
    while True:
        length = round_length(index)
        if budget is not None:
            length = max(min(length, budget - (clock() - began)), 0.001)
        asked = [
            (endpoint, attrs.evolve(request, deadline_ns=round(length * 1e9), round=True), who)
            for endpoint, request, who in calls
        ]
        results = send(asked, options.phase_timeout + length)
        rounds += 1
        if not any(quiet(r) and r.stats.count for r in results):
            index += 1  # nobody to advance: wait longer
        elapsed = clock() - began
        _report(machine, rounds, length, elapsed, calls, results, options)
        busy = [r for r in results if pending(r)]
        if not busy or not all(quiet(r) or pending(r) for r in results):
            return Outcome(results, rounds, elapsed)
        if budget is not None and elapsed >= budget:
            return Outcome(results, rounds, elapsed)
        if options.stop is not None and options.stop.is_set():
            return Outcome(results, rounds, elapsed)


def problem(
    endpoint: Endpoint, result: Reply | ParticipantError, outcome: Outcome
) -> Problem | None:
    """What the rounds say of one participant's last answer beyond the ordinary reply
    check: a shim still PENDING when they ended is not quiet (None: check it as any
    other reply)."""
    return not_quiet_problem(endpoint, result, outcome) if pending(result) else None


def not_quiet_problem(endpoint: Endpoint, reply: Reply, outcome: Outcome) -> Problem:
    """A participant still PENDING when the rounds ended, worded as a refusal."""
    return Problem(
        f"QUIESCE: {NOT_QUIET} within {outcome.elapsed_s * 1e3:.0f} ms "
        f"({outcome.rounds} round{'s' if outcome.rounds != 1 else ''}); "
        f"its last answer: {reply.message}",
        reply.participant,
        endpoint.observed_pid,
        not_quiet=True,
    )


def _report(
    machine: str,
    index: int,
    length: float,
    elapsed: float,
    calls: Sequence[Call],
    results: Sequence[Reply | ParticipantError],
    options: Options,
) -> None:
    # A round everyone answered quiet is the QUIESCE phase event itself.
    if options.on_progress is None or not any(pending(r) for r in results):
        return
    quiet_ones: list[str] = []
    busy: list[PendingParticipant] = []
    for (endpoint, _, _), result in zip(calls, results, strict=True):
        if quiet(result):
            quiet_ones.append(result.participant)
        elif pending(result):
            busy.append(PendingParticipant(result.participant, endpoint.observed_pid,
                                           result.stats.count, result.message))  # fmt: skip
    options.on_progress(
        QuiesceRound(machine, index, length, elapsed, tuple(quiet_ones), tuple(busy))
    )


def restartable(error: CoordinatorError, options: Options) -> bool:
    """Whether a capture stopped by ``error`` may start over: it stopped at QUIESCE only
    because participants did not get quiet (nothing changed, every gate reopens as the
    run's lease ends), the run was not told to stop, and it is not traced (a trace is
    one run, replayed as recorded)."""
    stopped = options.stop is not None and options.stop.is_set()
    return not stopped and options.trace is None and errors.not_quiet(error)


def until_quiet(capture: Callable[[], T], options: Options, log: logging.Logger | None = None) -> T:
    """Run ``capture`` (a whole capture machine under ``options``) and start it over
    while :func:`restartable` says so, up to :data:`CAPTURE_ATTEMPTS` runs in all; each
    restart is a warning on ``log`` (this module's logger by default)."""
    log = log or logging.getLogger(__name__)
    for attempt in range(1, CAPTURE_ATTEMPTS + 1):
        try:
            return capture()
        except StepFailed as error:
            if attempt == CAPTURE_ATTEMPTS or not restartable(error, options):
                raise
            log.warning("capture attempt %d of %d not quiet: %s", attempt, CAPTURE_ATTEMPTS,
                        error.reason)  # fmt: skip
    raise AssertionError("unreachable: the last attempt returns or raises")
