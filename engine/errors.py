"""Why a capture or restore stopped: refused before anything changed, or failed.

Every error names the machine and the step it stopped at (the op, or the local step) and
carries one :class:`Problem` per participant that caused it, each with the
participant id, its pid and the reason. The first problem is the primary one
(``participant``, ``pid``, ``reason``); all of them reach stderr and the
``failed`` progress event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from ..phases import Refusal


@attrs.frozen
class Problem:
    """One thing wrong: with whom (when it is about one participant) and why."""

    reason: str
    participant: str | None = None
    pid: int | None = None
    # QUIESCE's typed "not quiet in time" (the reply's NOT_QUIET flag, or rounds
    # that ended with the participant still PENDING): what decides a restart.
    not_quiet: bool = False
    # The validation predicate that found it (specs/validation.md), for -v and JSON:
    # never part of the sentence a person reads.
    rule: str = ""
    # The process's pid in its own pid namespace, where it differs from ``pid``.
    namespace_pid: int | None = None

    def __str__(self) -> str:
        who = []
        if self.participant:
            who.append(f"participant {self.participant}")
        if self.pid is not None:
            ns = self.namespace_pid
            who.append(f"pid {self.pid}" if ns in (None, self.pid) else
                       f"pid {self.pid} (ns pid {ns})")  # fmt: skip
        return f"{', '.join(who)}: {self.reason}" if who else self.reason


class CoordinatorError(Exception):
    """A machine stopped. ``step`` is the step it stopped at: its op's name, or the local
    step's (``LOCK``, ``READ_STATE``, ``WRITE_STATE``, ...).

    The runner notes on the error whether a destructive op had been sent
    (``destroyed``) and, if so, how the rollback that followed ended:
    ``rolled_back`` when the group is running again as before, else
    ``rollback_error`` says why not (``cuinterpose recover`` must run).
    """

    kind = "failed"
    destroyed: bool = False
    rolled_back: bool = False
    rollback_error: CoordinatorError | None = None
    # Rolled back, but these could not come back (a creator died with the bytes).
    rollback_lost: tuple[str, ...] = ()

    def __init__(self, machine: str, step: str, problems: Sequence[Problem]) -> None:
        if not problems:
            raise ValueError("a coordinator error needs at least one problem")
        super().__init__(machine, step, tuple(problems))
        self.machine = machine
        self.step = step
        self.problems: tuple[Problem, ...] = tuple(problems)

    @property
    def participant(self) -> str | None:
        return self.problems[0].participant

    @property
    def pid(self) -> int | None:
        return self.problems[0].pid

    @property
    def reason(self) -> str:
        return self.problems[0].reason

    def lines(self) -> tuple[str, ...]:
        """One line per problem, each naming the machine, phase, participant, pid, reason."""
        return tuple(f"{self.machine} {self.kind} at {self.step}: {p}" for p in self.problems)

    def details(self) -> tuple[str, ...]:
        """What a person does not need to read, for ``-v``: the machine's own names of
        where it stopped and of the predicates that found each problem."""
        rules = sorted({p.rule for p in self.problems if p.rule})
        return (
            f"{self.machine} stopped at step {self.step}"
            + (f" (guard {self.guard})" if self.guard else "")
            + (f"; rules: {', '.join(rules)}" if rules else ""),
        )

    @property
    def guard(self) -> str:
        """The guard that refused or failed; empty for an op's own failure."""
        return ""

    def __str__(self) -> str:
        return "\n".join(self.lines())


# What each guard checks, in a person's words: a refusal names its check, never the
# step it sits on (a preflight refusal is not "at PREPARE_MULTICAST": that op was never
# sent). The guard's own name stays in details() and the JSON events.
CHECKS: Final[Mapping[str, str]] = {
    "all_active": "the check that every process runs normally (no capture under way)",
    "all_prepared": "the check that every process was captured (its shim PREPARED)",
    "topology_valid": "the consistency check of the shims' sharing records",
    "preflight_clean": "the check for memory and sharing that cannot be checkpointed",
    "checkpoint_dir_writable": "the checkpoint directory check",
    "checkpoint_dir_free": "the checkpoint directory lock (one run at a time)",
    "checkpoint_dir_trusted": "the checkpoint directory's trust check",
    "participants_match_state": "the check that the processes are the state file's",
    "records_match_state": "the check that the shims hold what the state file says",
    "topology_matches_capture": "the check that the restored sharing equals the captured",
    "topology_matches_before": "the check that the rolled-back sharing equals the recorded",
    "all_can_roll_back": "the check that every process is where a rollback can start",
}


def check_title(guard: str) -> str:
    return CHECKS.get(guard, f"the check {guard}")


class Refused(CoordinatorError):
    """A guard failed before the first destructive op: nothing was changed.

    ``guard`` names the predicate that refused (as declared in ``phases``); ``phase``
    the step it guards, whose op was not sent.
    """

    kind = "refused"

    def __init__(self, machine: str, phase: str, guard: str, problems: Sequence[Problem]) -> None:
        super().__init__(machine, phase, problems)
        self._guard = guard

    @property
    def guard(self) -> str:
        return self._guard

    def lines(self) -> tuple[str, ...]:
        return tuple(
            f"{self.machine} refused by {check_title(self.guard)}, nothing changed: {p}"
            for p in self.problems
        )


class TopologyRefused(Refused):
    """The inspected topology violates a validation predicate."""


class PreflightRefused(Refused):
    """A participant holds something that cannot be checkpointed (raw import, foreign export)."""


class ParticipantsRefused(Refused):
    """The participants are not the expected ones, or not in the expected phase."""


class CheckpointDirRefused(Refused):
    """The state file could not be written where the capture would put it."""


# The error a guard's declared refusal raises (phases declare the refusal, not the class).
REFUSALS: Final[Mapping[Refusal, type[Refused]]] = {
    Refusal.PARTICIPANTS: ParticipantsRefused,
    Refusal.TOPOLOGY: TopologyRefused,
    Refusal.PREFLIGHT: PreflightRefused,
    Refusal.CHECKPOINT_DIR: CheckpointDirRefused,
}


class StepFailed(CoordinatorError):
    """A participant failed, timed out, hung up or answered wrongly; or a local step failed.

    Fail-stop: no later op of the machine was sent to anyone. When it stopped after
    an op that tears something down, the runner rolled the group back before raising
    (unless ``Options.rollback_on_failure`` is off): ``destroyed``, ``rolled_back``
    and ``rollback_error`` say how that went.
    """


# The words a "not quiet" refusal uses, for humans (shim_c/quiesce.c, and the
# coordinator's own for rounds that ended PENDING); code decides on Problem.not_quiet.
NOT_QUIET: Final = "did not reach a quiet point"


def not_quiet(error: CoordinatorError) -> bool:
    """Whether ``error`` stopped a capture at QUIESCE because participants did not get
    quiet in time, and for no other reason: nothing was changed, every gate opens again
    with the run's lease, and the capture may start over (specs/quiesce.md)."""
    return (
        type(error) is StepFailed
        and error.step == "QUIESCE"
        and not error.destroyed
        and all(p.not_quiet for p in error.problems)
    )


class Interrupted(StepFailed):
    """The run was asked to stop (a signal, or the embedder's stop event): it stopped at a
    phase boundary. Said as "stopped", never as a failure: nothing went wrong."""

    kind = "stopped"


class VerificationFailed(StepFailed):
    """After the destructive ops, a guard failed (restored topology invalid or not equal)."""

    def __init__(self, machine: str, phase: str, guard: str, problems: Sequence[Problem]) -> None:
        super().__init__(machine, phase, problems)
        self._guard = guard

    @property
    def guard(self) -> str:
        return self._guard

    def lines(self) -> tuple[str, ...]:
        return tuple(
            f"{self.machine} failed at {self.step}, {check_title(self.guard)}: {p}"
            for p in self.problems
        )


class AgentError(Exception):
    """Why a suspend, resume or detection did not go through (engine/agent.py): one line
    per fact. ``changed`` says whether the group was left other than as it was found."""

    def __init__(self, what: str, lines: Sequence[str], *, changed: bool = False) -> None:
        super().__init__(what, tuple(lines), changed)
        self.what = what
        self.detail: tuple[str, ...] = tuple(lines)
        self.changed = changed

    def lines(self) -> tuple[str, ...]:
        return (self.what, *self.detail)

    def __str__(self) -> str:
        return "\n".join(self.lines())
