"""Declarative capture and restore machines: states, ops, guards.

The engine builds its ``transitions`` machines from these declarations alone;
the diagrams in ``specs/`` are generated from them too.
"""

from .machines import CAPTURE, MACHINES, RESTORE, machine_spec
from .model import (
    FAIL_TRIGGER,
    FAILED_STATE,
    REFUSE_TRIGGER,
    REFUSED_STATE,
    Guard,
    MachineSpec,
    ProgressKind,
    Step,
)

__all__ = [
    "CAPTURE",
    "FAILED_STATE",
    "FAIL_TRIGGER",
    "MACHINES",
    "REFUSED_STATE",
    "REFUSE_TRIGGER",
    "RESTORE",
    "Guard",
    "MachineSpec",
    "ProgressKind",
    "Step",
    "machine_spec",
]
