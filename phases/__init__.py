"""Declarative capture and restore machines: states, ops, guards, and the shim's phase table.

The engine builds its ``transitions`` machines from these declarations alone;
the diagrams in ``specs/`` are generated from them too.
"""

from .machines import CAPTURE, MACHINES, RESTORE, ROLLBACK, machine_spec
from .model import (
    FAIL_TRIGGER,
    FAILED_STATE,
    REFUSE_TRIGGER,
    REFUSED_STATE,
    Action,
    Guard,
    MachineSpec,
    ProgressKind,
    Refusal,
    Step,
)
from .ops import (
    EVERY_PHASE,
    OP,
    OPS,
    PHASE_OP,
    PHASE_OPS,
    ROLLBACK_FROM,
    ROLLBACK_OPS,
    TEARS_DOWN,
    PhaseOp,
    WireOp,
)

__all__ = [
    "CAPTURE",
    "EVERY_PHASE",
    "FAILED_STATE",
    "FAIL_TRIGGER",
    "MACHINES",
    "OP",
    "OPS",
    "PHASE_OP",
    "PHASE_OPS",
    "REFUSED_STATE",
    "REFUSE_TRIGGER",
    "RESTORE",
    "ROLLBACK",
    "ROLLBACK_FROM",
    "ROLLBACK_OPS",
    "TEARS_DOWN",
    "Action",
    "Guard",
    "MachineSpec",
    "PhaseOp",
    "ProgressKind",
    "Refusal",
    "Step",
    "WireOp",
    "machine_spec",
]
