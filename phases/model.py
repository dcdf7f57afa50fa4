"""The vocabulary the machines are declared in: guards, steps, machine specs.

Plain frozen data; the only behaviour is lookups and the consistency checks a
declaration must pass (a malformed machine is refused when it is declared, not
when the engine is half way through a checkpoint).

Ops and shim phases are named as the wire protocol names them (``Op`` and
``Phase`` member names in ``cuinterpose.engine.wire``): this package depends on
nothing, and the engine resolves the names when it builds a machine.
"""

from __future__ import annotations

import enum

import attrs

from .ops import OP, PHASE_OP

# Triggers the engine adds to every machine: a guard that fails before the
# first destructive op refuses; anything else that goes wrong fails.
REFUSE_TRIGGER = "REFUSE"
FAIL_TRIGGER = "FAIL"
REFUSED_STATE = "refused"
FAILED_STATE = "failed"


class ProgressKind(enum.Enum):
    """What progress a step reports when it completes."""

    NONE = "none"  # local bookkeeping (state file, final checks): no event of its own
    PHASE = "phase"  # elapsed time and participant count
    TRANSFER = "transfer"  # PHASE plus allocations, bytes and throughput


class Refusal(enum.Enum):
    """What a guard that fails before the first destructive op refuses on."""

    PARTICIPANTS = "participants"  # who answered, and in which phase
    TOPOLOGY = "topology"  # a validation predicate
    PREFLIGHT = "preflight"  # a record the shim could never restore
    CHECKPOINT_DIR = "checkpoint_dir"  # where the state file would go


class Action(enum.Enum):
    """The work of a local step: what the coordinator itself does, sending nothing."""

    WRITE_STATE = "write_state"
    READ_STATE = "read_state"
    READ_TOPOLOGY = "read_topology"  # the intent or state file, when the directory holds one
    NOTHING = "nothing"  # the step's guards are the whole step


@attrs.frozen
class Guard:
    """A named predicate the engine evaluates before a step's op is sent."""

    name: str
    description: str
    refusal: Refusal


@attrs.frozen
class Step:
    """One transition: the wire op it sends to every participant (or a local action)."""

    trigger: str
    source: str
    dest: str
    description: str
    op: str | None = None
    # For a wire op that leaves the phase as it is: the phase every reply must
    # report, or None when any will do (HANDSHAKE reports whatever phase the shim
    # is in). A phase op's reply phase is the one ``ops.PHASE_OPS`` declares.
    reply_phase: str | None = None
    guards: tuple[str, ...] = ()
    progress: ProgressKind = ProgressKind.PHASE
    action: Action | None = None  # a local step's work

    def __attrs_post_init__(self) -> None:
        # A wire step is named after its op; an op sent twice in one machine is
        # told apart by a qualifier (INSPECT, INSPECT_PREPARED).
        named = self.op is not None and (
            self.trigger == self.op or self.trigger.startswith(self.op + "_")
        )
        if self.op is not None and not named:
            raise ValueError(
                f"step {self.trigger}: a wire step's trigger must be its op's name, "
                "or that name and a qualifier"
            )
        if self.op is None and self.reply_phase is not None:
            raise ValueError(f"step {self.trigger}: a local step sends nothing to check")
        if (self.op is None) == (self.action is None):
            raise ValueError(f"step {self.trigger}: a step either sends an op or has an action")
        if self.op in PHASE_OP and self.reply_phase is not None:
            raise ValueError(f"step {self.trigger}: a phase op's reply phase is ops.PHASE_OPS'")
        if self.op is None and self.progress is not ProgressKind.NONE:
            raise ValueError(f"step {self.trigger}: a local step reports no phase progress")
        if self.op is not None and self.progress is ProgressKind.NONE:
            raise ValueError(f"step {self.trigger}: every wire op reports progress")
        if len(set(self.guards)) != len(self.guards):
            raise ValueError(f"step {self.trigger}: a guard is listed twice")

    @property
    def tears_down(self) -> bool:
        """Whether a run stopped after this step needs a rollback (the op table's
        ``tears_down``: QUIESCE's gate opens with the coordinator's lease)."""
        wire_op = OP.get(self.op) if self.op is not None else None
        return wire_op is not None and wire_op.tears_down

    @property
    def expected_phase(self) -> str | None:
        """The shim phase every reply must report, or None when any phase will do."""
        phase_op = PHASE_OP.get(self.op) if self.op is not None else None
        return phase_op.reaches if phase_op is not None else self.reply_phase


@attrs.frozen
class MachineSpec:
    """A linear machine: ``steps`` lead from ``initial`` to ``final`` one after another."""

    name: str
    title: str
    initial: str
    final: str
    guards: tuple[Guard, ...]
    steps: tuple[Step, ...]
    # Record the group durably (participants, topology) before the first
    # destructive op, so that any later invocation knows what was under way.
    writes_intent: bool = False
    # Go on without participants whose process is gone (socket missing or
    # refused at HANDSHAKE): a rollback brings the survivors back.
    drops_gone: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"machine {self.name} has no steps")
        state = self.initial
        for step in self.steps:
            if step.source != state:
                raise ValueError(
                    f"machine {self.name}: step {step.trigger} leaves {step.source}, "
                    f"but the previous step ends in {state}"
                )
            state = step.dest
        if state != self.final:
            raise ValueError(f"machine {self.name}: the steps end in {state}, not {self.final}")
        triggers = [s.trigger for s in self.steps]
        if len(set(triggers)) != len(triggers):
            raise ValueError(f"machine {self.name}: a trigger is used twice")
        if {REFUSE_TRIGGER, FAIL_TRIGGER} & set(triggers):
            raise ValueError(f"machine {self.name}: {REFUSE_TRIGGER}/{FAIL_TRIGGER} are reserved")
        states = self.states
        if len(set(states)) != len(states) or {REFUSED_STATE, FAILED_STATE} & set(states):
            raise ValueError(f"machine {self.name}: states repeat or use a reserved name")
        declared = {g.name for g in self.guards}
        used = {g for s in self.steps for g in s.guards}
        if used - declared:
            raise ValueError(f"machine {self.name}: undeclared guards {sorted(used - declared)}")
        if declared - used:
            raise ValueError(f"machine {self.name}: unused guards {sorted(declared - used)}")

    @property
    def states(self) -> tuple[str, ...]:
        """The states in the order the steps visit them, without the terminal failures."""
        return (self.initial, *(s.dest for s in self.steps))

    @property
    def all_states(self) -> tuple[str, ...]:
        return (*self.states, REFUSED_STATE, FAILED_STATE)

    @property
    def ops(self) -> tuple[str, ...]:
        """The wire ops in the order they are sent."""
        return tuple(s.op for s in self.steps if s.op is not None)

    def step(self, trigger: str) -> Step:
        for step in self.steps:
            if step.trigger == trigger:
                return step
        raise KeyError(f"machine {self.name} has no step {trigger!r}")

    def guard(self, name: str) -> Guard:
        for guard in self.guards:
            if guard.name == name:
                return guard
        raise KeyError(f"machine {self.name} has no guard {name!r}")

    def first_teardown(self) -> int | None:
        """Index of the first step after which a stopped run needs a rollback, or None."""
        for index, step in enumerate(self.steps):
            if step.tears_down:
                return index
        return None

    def is_refusal(self, trigger: str) -> bool:
        """Whether a guard failing on this step refuses (nothing torn down yet: a
        QUIESCED group reopens when the run's lease ends) or fails."""
        index = self.steps.index(self.step(trigger))
        first = self.first_teardown()
        return first is None or index <= first
