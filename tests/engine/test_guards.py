"""Every declaration in phases/ has exactly one implementation in the engine."""

from __future__ import annotations

from cuinterpose.engine.errors import REFUSALS, Refused
from cuinterpose.engine.guards import GUARDS
from cuinterpose.engine.steps import ACTIONS
from cuinterpose.phases import MACHINES, Action, Refusal


def test_every_declared_guard_has_a_check_and_every_check_is_declared() -> None:
    declared = {g.name for spec in MACHINES.values() for g in spec.guards}
    assert declared == set(GUARDS)


def test_every_refusal_raises_its_own_refused_error() -> None:
    assert set(REFUSALS) == set(Refusal)
    assert all(issubclass(error, Refused) for error in REFUSALS.values())
    assert len(set(REFUSALS.values())) == len(REFUSALS)


def test_every_local_action_has_a_function() -> None:
    assert set(ACTIONS) == set(Action)
    used = {s.action for spec in MACHINES.values() for s in spec.steps if s.action is not None}
    assert used <= set(ACTIONS)
