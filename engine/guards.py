"""The guards a machine declares, by name: each a function of the run's state to its problems.

A guard passes when it returns no problem. Which error a failing guard raises
is declared with the guard in :mod:`cuinterpose.phases` (its refusal), and
whether it refuses or fails depends on where its step sits in the machine;
neither is decided here. A new guard is a declaration in ``phases`` and one
function in :data:`GUARDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from ..phases import ROLLBACK_FROM
from .directory import capture_problem
from .errors import Problem
from .steps import Run
from .validate import Violation, preflight, validate
from .wire import Phase

GuardCheck = Callable[[Run], list[Problem]]


def violation_problems(
    violations: Sequence[Violation], observed: Mapping[str, int]
) -> list[Problem]:
    return [
        Problem(_violation_text(v), v.participant or None, observed.get(v.participant), rule=v.rule)
        for v in violations
    ]


def _violation_text(violation: Violation) -> str:
    # The problem names the participant already (a group-wide violation: nobody), and
    # carries the rule apart (-v, JSON): the sentence is what was found and what to do.
    kind = violation.kind.name if violation.kind is not None else ""
    where = " ".join(part for part in (kind, violation.resource) if part)
    return f"{where}: {violation.reason}" if where else violation.reason


def _phase_problems(run: Run, expected: Phase) -> list[Problem]:
    problems = []
    for b in run.bound:
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


def all_active(run: Run) -> list[Problem]:
    return _phase_problems(run, Phase.ACTIVE)


def all_prepared(run: Run) -> list[Problem]:
    return _phase_problems(run, Phase.PREPARED)


def topology_valid(run: Run) -> list[Problem]:
    assert run.topology is not None
    if run.gone:
        return []  # survivors of a rollback only: a team missing members cannot be whole
    return violation_problems(validate(run.topology), run.observed())


def preflight_clean(run: Run) -> list[Problem]:
    assert run.topology is not None
    return violation_problems(preflight(run.topology), run.observed())


def checkpoint_dir_writable(run: Run) -> list[Problem]:
    reason = capture_problem(run.checkpoint_dir, replace=run.options.replace)
    return [Problem(reason)] if reason else []


def all_can_roll_back(run: Run) -> list[Problem]:
    return [
        Problem(
            f"is in phase {b.phase.name}, from which no rollback starts",
            b.participant,
            b.endpoint.observed_pid,
        )
        for b in run.bound
        if b.phase.name not in ROLLBACK_FROM
    ]


def topology_matches_before(run: Run) -> list[Problem]:
    if run.captured is None or run.gone:
        return []  # nothing recorded, or survivors only: nothing whole to compare with
    if not set(run.captured.participant_ids) <= {b.participant for b in run.bound}:
        return []  # a recorded participant not given (it died): survivors only
    return topology_matches_capture(run)


def participants_match_state(run: Run) -> list[Problem]:
    assert run.state_file is not None
    recorded = {p.participant: p.pid for p in run.state_file.participants}
    answering = {b.participant for b in run.bound}
    problems = [
        Problem(
            f"is in the state file but no given process answers as it (pid {pid} at capture); "
            "if it is gone, `cuinterpose recover` brings the survivors back",
            participant,
        )
        for participant, pid in sorted(recorded.items())
        if participant not in answering
    ]
    problems += [
        Problem("answers but is not in the state file", b.participant, b.endpoint.observed_pid)
        for b in run.bound
        if b.participant not in recorded
    ]
    return problems


def records_match_state(run: Run) -> list[Problem]:
    """Before anything changes: the shims hold what the state file says they hold.

    A state file edited (or swapped for another group's) after the capture is
    refused here, not found out by the final VERIFY after every destructive step.
    """
    assert run.captured is not None and run.topology is not None
    if run.captured.same_shape(run.topology):  # the common case, and the cheap test
        return []
    differences = run.captured.differences(run.topology, other_name="inspected") or (
        "the records differ from the state file's",
    )
    return [Problem(f"the state file does not match the shims: {d}") for d in differences]


def topology_matches_capture(run: Run) -> list[Problem]:
    assert run.captured is not None and run.topology is not None
    if run.captured.same_shape(run.topology):  # the common case, and the cheap test
        return []
    differences = run.captured.differences(run.topology) or (
        "restored topology differs from the captured one",
    )
    return [Problem(f"restored topology differs: {d}") for d in differences]


GUARDS: Final[Mapping[str, GuardCheck]] = {
    check.__name__: check
    for check in (
        all_active,
        all_prepared,
        topology_valid,
        preflight_clean,
        checkpoint_dir_writable,
        participants_match_state,
        records_match_state,
        topology_matches_capture,
        all_can_roll_back,
        topology_matches_before,
    )
}
