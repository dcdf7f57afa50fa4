"""transitions machines built from phases/: triggers, conditions, terminal states."""

from __future__ import annotations

import attrs
import pytest
from cuinterpose.engine.fsm import (
    CAPTURE,
    RESTORE,
    build_machine,
    step_op,
    step_reply_phase,
    transition_table,
)
from cuinterpose.engine.wire import Op, Phase
from cuinterpose.phases import MachineSpec
from transitions import EventData


class Model:
    """Records what the machine calls; guards answer from ``verdicts``."""

    state: str

    def __init__(self, spec: MachineSpec, verdicts: dict[str, bool] | None = None) -> None:
        self.calls: list[str] = []
        self.verdicts = verdicts or {}
        self.explode: str | None = None
        for guard in spec.guards:
            setattr(self, guard.name, self._guard(guard.name))

    def _guard(self, name: str):  # type: ignore[no-untyped-def]
        def check(event: EventData) -> bool:
            self.calls.append(f"guard {name}")
            return self.verdicts.get(name, True)

        return check

    def perform(self, event: EventData) -> None:
        self.calls.append(f"perform {event.event.name}")
        if event.event.name == self.explode:
            raise RuntimeError("boom")


def fire(machine: object, model: Model, trigger: str) -> bool:
    return bool(machine.events[trigger].trigger(model))  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", [CAPTURE, RESTORE], ids=lambda s: s.name)
def test_every_step_runs_guards_then_performs(spec: MachineSpec) -> None:
    model = Model(spec)
    machine = build_machine(spec, model)
    assert model.state == spec.initial
    for step in spec.steps:
        model.calls.clear()
        assert fire(machine, model, step.trigger)
        assert model.calls == [f"guard {g}" for g in step.guards] + [f"perform {step.trigger}"]
        assert model.state == step.dest
    assert model.state == spec.final


def test_a_false_guard_stops_before_perform_and_leaves_the_state() -> None:
    model = Model(CAPTURE, {"preflight_clean": False})
    machine = build_machine(CAPTURE, model)
    for trigger in ("HANDSHAKE", "QUIESCE", "INSPECT"):
        fire(machine, model, trigger)
    model.calls.clear()
    assert not fire(machine, model, "PREPARE_MULTICAST")
    assert model.calls == ["guard topology_valid", "guard preflight_clean"]
    assert model.state == "inspected"
    assert fire(machine, model, "REFUSE") and model.state == "refused"


def test_an_exception_in_perform_propagates_and_fail_ends_the_machine() -> None:
    model = Model(RESTORE)
    model.explode = "LOAD_ALLOCATIONS"
    machine = build_machine(RESTORE, model)
    fire(machine, model, "READ_STATE")
    fire(machine, model, "HANDSHAKE")
    fire(machine, model, "INSPECT_PREPARED")
    with pytest.raises(RuntimeError, match="boom"):
        fire(machine, model, "LOAD_ALLOCATIONS")
    assert model.state == "prepared_inspected"
    assert fire(machine, model, "FAIL") and model.state == "failed"


def test_out_of_order_triggers_are_errors() -> None:
    from transitions import MachineError

    model = Model(CAPTURE)
    machine = build_machine(CAPTURE, model)
    with pytest.raises(MachineError):
        fire(machine, model, "SAVE_ALLOCATIONS")
    # A refusal is impossible once a tearing-down op has been sent.
    for trigger in ("HANDSHAKE", "QUIESCE", "INSPECT", "PREPARE_MULTICAST"):
        fire(machine, model, trigger)
    with pytest.raises(MachineError):
        fire(machine, model, "REFUSE")


def test_terminal_transitions() -> None:
    table = transition_table(CAPTURE)
    refuse = next(t for t in table if t["trigger"] == "REFUSE")
    fail = next(t for t in table if t["trigger"] == "FAIL")
    assert refuse["source"] == ["handshaken", "inspected"]  # before QUIESCE; before teardown
    assert fail["source"] == list(CAPTURE.states[:-1])
    restore_refuse = next(t for t in transition_table(RESTORE) if t["trigger"] == "REFUSE")
    assert restore_refuse["source"] == ["handshaken", "prepared_inspected"]


def test_a_model_missing_a_guard_is_refused() -> None:
    class Partial:
        def perform(self, event: EventData) -> None:
            pass

        def all_active(self, event: EventData) -> bool:
            return True

    with pytest.raises(TypeError, match="lacks topology_valid, preflight_clean"):
        build_machine(CAPTURE, Partial())


def test_op_and_phase_names_resolve() -> None:
    assert step_op(CAPTURE.step("INSPECT")) is Op.INSPECT
    assert step_op(CAPTURE.step("WRITE_STATE")) is None
    assert step_reply_phase(CAPTURE.step("PREPARE_UNICAST")) is Phase.PREPARED
    bad = attrs.evolve(CAPTURE.step("INSPECT"), reply_phase="SLEEPING")
    with pytest.raises(ValueError, match="unknown phase 'SLEEPING'"):
        step_reply_phase(bad)
    hello = attrs.evolve(CAPTURE.steps[0], trigger="HELLO", op="HELLO")
    spec = attrs.evolve(CAPTURE, steps=(hello, *CAPTURE.steps[1:]))
    with pytest.raises(ValueError, match="unknown op 'HELLO'"):
        transition_table(spec)
