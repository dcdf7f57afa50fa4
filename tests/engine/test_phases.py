"""The machines as declared in phases/: their order, their ops, their refusals."""

from __future__ import annotations

import attrs
import pytest
from cuinterpose.engine.wire import Op, Phase
from cuinterpose.phases import (
    CAPTURE,
    EVERY_PHASE,
    FAIL_TRIGGER,
    OPS,
    PHASE_OP,
    PHASE_OPS,
    RESTORE,
    ROLLBACK_OPS,
    TEARS_DOWN,
    Action,
    Guard,
    MachineSpec,
    ProgressKind,
    Refusal,
    Step,
    machine_spec,
)


def test_capture_sends_the_design_order() -> None:
    assert CAPTURE.ops == (
        "HANDSHAKE",
        "QUIESCE",
        "INSPECT",
        "PREPARE_MULTICAST",
        "SAVE_ALLOCATIONS",
        "PREPARE_UNICAST",
    )
    assert CAPTURE.steps[-1].trigger == "WRITE_STATE"


def test_restore_sends_the_design_order() -> None:
    assert RESTORE.steps[0].trigger == "READ_STATE"
    assert RESTORE.ops == (
        "HANDSHAKE",
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "RESTORE_MULTICAST_CREATORS",
        "RESTORE_MULTICAST_IMPORTERS",
        "RESTORE_MULTICAST_DEVICES",
        "RESTORE_MULTICAST_BINDINGS",
        "INSPECT",
    )
    assert RESTORE.steps[-1].trigger == "VERIFY"


def test_the_op_table_is_the_wire_enum() -> None:
    # Every op once, in number order, served in phases listed in enum order; and the
    # phase ops are all and only the ops with a phase to reach.
    assert [(o.name, o.number) for o in OPS] == [(op.name, int(op)) for op in Op]
    assert list(EVERY_PHASE) == [p.name for p in Phase]
    for entry in OPS:
        values = [Phase[name] for name in entry.served_in]
        assert values and values == sorted(set(values)), entry.name
    # Tearing down is a phase op's: the others change nothing of the application's.
    assert set(PHASE_OP) > TEARS_DOWN and set(PHASE_OP) - TEARS_DOWN == {"QUIESCE"}


def test_the_phase_table_names_wire_ops_and_phases() -> None:
    for entry in PHASE_OP.values():
        assert Op[entry.op] and Phase[entry.reaches]
        assert entry.needs and all(Phase[n] for n in entry.needs)
    # The capture/restore ops: one phase each, but QUIESCE, which advances a QUIESCED shim.
    assert all(len(p.needs) == 1 for p in PHASE_OPS if p.op != "QUIESCE")
    assert len(PHASE_OP) == len(PHASE_OPS) + len(ROLLBACK_OPS)
    transfers = [p.op for p in PHASE_OP.values() if p.transfers]
    assert transfers == ["SAVE_ALLOCATIONS", "LOAD_ALLOCATIONS", "ROLLBACK_ALLOCATIONS"]


@pytest.mark.parametrize(
    "spec,begins,ends",
    [(CAPTURE, "ACTIVE", "PREPARED"), (RESTORE, "PREPARED", "ACTIVE")],
    ids=["capture", "restore"],
)
def test_phase_ops_lead_the_shim_from_phase_to_phase(
    spec: MachineSpec, begins: str, ends: str
) -> None:
    """Each phase op starts where the previous one left the shim; the rest change nothing."""
    phase = begins
    for step in spec.steps:
        entry = PHASE_OP.get(step.op or "")
        if entry is None:
            assert not step.tears_down, step.trigger
            if step.op is None:
                assert step.action is not None and step.expected_phase is None
            elif step.op == "HANDSHAKE":
                assert step.expected_phase is None  # reports whatever phase the shim is in
            else:
                assert step.expected_phase == phase, step.trigger
            continue
        assert step.tears_down is (step.op != "QUIESCE") and phase in entry.needs, step.trigger
        phase = entry.reaches
        assert step.expected_phase == phase
    assert phase == ends


def test_refusals_come_before_the_first_destructive_op() -> None:
    # The gate closes first, so INSPECT reads a topology nothing can change; the
    # checks come before the first op that tears something down.
    assert CAPTURE.step("QUIESCE").guards == ("all_active",)
    assert CAPTURE.step("PREPARE_MULTICAST").guards == (
        "topology_valid",
        "preflight_clean",
        "checkpoint_dir_writable",
    )
    assert CAPTURE.is_refusal("QUIESCE") and CAPTURE.is_refusal("PREPARE_MULTICAST")
    assert not CAPTURE.is_refusal("SAVE_ALLOCATIONS")
    # QUIESCE changes the participants' phase, yet a run stopped there needs no rollback.
    assert "QUIESCE" in PHASE_OP and not CAPTURE.step("QUIESCE").tears_down
    assert CAPTURE.step("PREPARE_MULTICAST").tears_down
    assert RESTORE.step("INSPECT_PREPARED").guards == ("participants_match_state", "all_prepared")
    # The shims' records are compared with the state file before anything changes.
    assert RESTORE.step("LOAD_ALLOCATIONS").guards == ("records_match_state",)
    assert RESTORE.is_refusal("LOAD_ALLOCATIONS")
    # VERIFY's guards come after destruction: they fail rather than refuse.
    assert RESTORE.step("VERIFY").guards == ("topology_valid", "topology_matches_capture")
    assert not RESTORE.is_refusal("VERIFY")


def test_transfer_progress_only_where_bytes_move() -> None:
    steps = [*CAPTURE.steps, *RESTORE.steps]
    transfers = [s.trigger for s in steps if s.progress is ProgressKind.TRANSFER]
    assert transfers == ["SAVE_ALLOCATIONS", "LOAD_ALLOCATIONS"]


def test_lookups() -> None:
    assert machine_spec("capture") is CAPTURE and machine_spec("restore") is RESTORE
    assert CAPTURE.guard("all_active").name == "all_active"
    assert CAPTURE.first_teardown() == 3  # PREPARE_MULTICAST
    assert CAPTURE.states[0] == "start" and CAPTURE.states[-1] == "captured"
    assert CAPTURE.all_states[-2:] == ("refused", "failed")
    with pytest.raises(KeyError, match="no machine 'teardown'"):
        machine_spec("teardown")
    with pytest.raises(KeyError, match="no step 'EXPORT'"):
        CAPTURE.step("EXPORT")
    with pytest.raises(KeyError, match="no guard"):
        CAPTURE.guard("nope")


def _spec(*steps: Step, guards: tuple[Guard, ...] = (), final: str = "b") -> MachineSpec:
    return MachineSpec("m", "m", "a", final, guards, steps)


def test_malformed_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="trigger must be its op's name"):
        Step("X", "a", "b", "", op="INSPECT")
    with pytest.raises(ValueError, match="local step sends nothing"):
        Step("X", "a", "b", "", reply_phase="ACTIVE", progress=ProgressKind.NONE)
    with pytest.raises(ValueError, match="either sends an op or has an action"):
        Step("X", "a", "b", "", progress=ProgressKind.NONE)
    with pytest.raises(ValueError, match="either sends an op or has an action"):
        Step("INSPECT", "a", "b", "", op="INSPECT", action=Action.NOTHING)
    with pytest.raises(ValueError, match="local step reports no phase progress"):
        Step("X", "a", "b", "", action=Action.NOTHING)
    with pytest.raises(ValueError, match=r"reply phase is ops\.PHASE_OPS"):
        Step("LOAD_ALLOCATIONS", "a", "b", "", op="LOAD_ALLOCATIONS", reply_phase="ACTIVE")
    with pytest.raises(ValueError, match="every wire op reports progress"):
        Step("INSPECT", "a", "b", "", op="INSPECT", progress=ProgressKind.NONE)
    with pytest.raises(ValueError, match="guard is listed twice"):
        Step("INSPECT", "a", "b", "", op="INSPECT", guards=("g", "g"))


def test_malformed_machines_are_refused() -> None:
    inspect = Step("INSPECT", "a", "b", "", op="INSPECT")
    with pytest.raises(ValueError, match="no steps"):
        _spec()
    with pytest.raises(ValueError, match="previous step ends in b"):
        _spec(inspect, attrs.evolve(inspect, trigger="HANDSHAKE", op="HANDSHAKE", source="x"))
    with pytest.raises(ValueError, match="end in b, not z"):
        _spec(inspect, final="z")
    with pytest.raises(ValueError, match="trigger is used twice"):
        _spec(inspect, attrs.evolve(inspect, source="b", dest="c"), final="c")
    with pytest.raises(ValueError, match="reserved"):
        _spec(
            attrs.evolve(
                inspect,
                trigger=FAIL_TRIGGER,
                op=None,
                progress=ProgressKind.NONE,
                action=Action.NOTHING,
            )
        )
    with pytest.raises(ValueError, match="reserved name"):
        _spec(attrs.evolve(inspect, dest="failed"), final="failed")
    with pytest.raises(ValueError, match="undeclared guards"):
        _spec(attrs.evolve(inspect, guards=("g",)))
    with pytest.raises(ValueError, match="unused guards"):
        _spec(inspect, guards=(Guard("g", "", Refusal.TOPOLOGY),))


def test_specs_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        CAPTURE.steps[0].op = "EXPORT"  # type: ignore[misc]
