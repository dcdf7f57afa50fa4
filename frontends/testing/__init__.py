"""Test doubles for embedders: a fake participant that speaks the wire protocol like a shim.

An agent's own tests can run :func:`cuinterpose.engine.capture` and
:func:`~cuinterpose.engine.restore` against :class:`FakeParticipant` servers
without a GPU, a shim or the simulated driver.
"""

from .fake import (
    FAULT_KINDS,
    FakeParticipant,
    FakeParticipantError,
    Fault,
    FaultKind,
    allowed_phases,
    is_phase_op,
)

__all__ = [
    "FAULT_KINDS",
    "FakeParticipant",
    "FakeParticipantError",
    "Fault",
    "FaultKind",
    "allowed_phases",
    "is_phase_op",
]
