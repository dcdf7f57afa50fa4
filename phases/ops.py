"""What each phase op does to a shim's phase: the one table of it.

The shim (``shim_c/protocol.h``, ``CUIP_PHASE_OPS``), the test double and the
machines all follow this table; a test pins the C table to it. Names are the
wire protocol's ``Op`` and ``Phase`` member names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs


@attrs.frozen
class PhaseOp:
    """A wire op that moves a shim from one phase to the next."""

    op: str
    needs: tuple[str, ...]  # the phases in which the shim serves the op
    reaches: str  # the phase every successful reply reports
    transfers: bool = False  # the reply carries byte and allocation statistics
    # Tears nothing down: a shim left in ``reaches`` goes back to ACTIVE by itself
    # when its coordinator's lease ends (RELEASE, or the holder's exit), so a run
    # that stops there needs no rollback.
    undone_by_release: bool = False


PHASE_OPS: Final[tuple[PhaseOp, ...]] = (
    # Served again in QUIESCED, where it is an advance: the process makes one more
    # synchronization and is quieted again (specs/quiesce.md; protocol.h
    # CUIP_QUIESCE_FROM). The wire table (CUIP_PHASE_OPS) names the first phase.
    PhaseOp("QUIESCE", ("ACTIVE", "QUIESCED"), "QUIESCED", undone_by_release=True),
    PhaseOp("PREPARE_MULTICAST", ("QUIESCED",), "MULTICAST_DETACHED"),
    PhaseOp("SAVE_ALLOCATIONS", ("MULTICAST_DETACHED",), "ALLOCATIONS_SAVED", transfers=True),
    PhaseOp("PREPARE_UNICAST", ("ALLOCATIONS_SAVED",), "PREPARED"),
    PhaseOp("LOAD_ALLOCATIONS", ("PREPARED",), "ALLOCATIONS_LOADED", transfers=True),
    PhaseOp("RESTORE_UNICAST", ("ALLOCATIONS_LOADED",), "UNICAST_RESTORED"),
    PhaseOp("RESTORE_MULTICAST_CREATORS", ("UNICAST_RESTORED",), "MULTICAST_CREATED"),
    PhaseOp("RESTORE_MULTICAST_IMPORTERS", ("MULTICAST_CREATED",), "MULTICAST_IMPORTED"),
    PhaseOp("RESTORE_MULTICAST_DEVICES", ("MULTICAST_IMPORTED",), "MULTICAST_JOINED"),
    PhaseOp("RESTORE_MULTICAST_BINDINGS", ("MULTICAST_JOINED",), "ACTIVE"),
)

# Where a rollback may start: every phase short of the native checkpoint, an
# interrupted rollback, and FAILED while the shim still holds the staged bytes.
ROLLBACK_FROM: Final[tuple[str, ...]] = (
    "ACTIVE",
    "MULTICAST_DETACHED",
    "ALLOCATIONS_SAVED",
    "PREPARED",
    "ALLOCATIONS_LOADED",
    "UNICAST_RESTORED",
    "MULTICAST_CREATED",
    "MULTICAST_IMPORTED",
    "MULTICAST_JOINED",
    "ROLLBACK_LOADED",
    "QUIESCED",
    "FAILED",
)

# Back to ACTIVE with the bytes at their addresses: creators re-create and refill
# from their staged copies, then importers import again from the creators.
ROLLBACK_OPS: Final[tuple[PhaseOp, ...]] = (
    PhaseOp("ROLLBACK_ALLOCATIONS", ROLLBACK_FROM, "ROLLBACK_LOADED", transfers=True),
    PhaseOp("ROLLBACK_IMPORTS", ("ROLLBACK_LOADED",), "ACTIVE"),
)

PHASE_OP: Final[Mapping[str, PhaseOp]] = {p.op: p for p in (*PHASE_OPS, *ROLLBACK_OPS)}
