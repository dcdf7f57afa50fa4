"""Every wire op, once: its number, the shim phases it is served in, whether it tears
something down; and what each phase op does to a shim's phase.

The shim (``shim_c/protocol.h``: ``CUIP_OPS``, ``CUIP_PHASE_OPS``,
``CUIP_ROLLBACK_OPS``), the test double and the machines all follow these tables;
a test pins the C tables to them. Names are the wire protocol's ``Op`` and
``Phase`` member names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

# Every shim phase, in enum order.
EVERY_PHASE: Final[tuple[str, ...]] = (
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


@attrs.frozen
class WireOp:
    """One op of the protocol, as ``CUIP_OPS`` declares it."""

    name: str
    number: int
    served_in: tuple[str, ...]  # the phases the shim serves it in, in enum order
    # A run that stops after it needs a rollback: it took something of the
    # application's apart. QUIESCE does not: it only holds the application at the
    # gate, which the coordinator's lease's end (RELEASE, or the holder's exit)
    # opens again.
    tears_down: bool = False


def _served(*phases: str) -> tuple[str, ...]:
    return tuple(p for p in EVERY_PHASE if p in phases)


OPS: Final[tuple[WireOp, ...]] = (
    WireOp("HANDSHAKE", 1, EVERY_PHASE),
    # QUIESCED for a capture (the gate keeps the records still), PREPARED for a
    # restore's comparison with its state file.
    WireOp("INSPECT", 2, _served("ACTIVE", "PREPARED", "QUIESCED")),
    WireOp("PREPARE_MULTICAST", 3, ("QUIESCED",), tears_down=True),
    WireOp("SAVE_ALLOCATIONS", 4, ("MULTICAST_DETACHED",), tears_down=True),
    WireOp("PREPARE_UNICAST", 5, ("ALLOCATIONS_SAVED",), tears_down=True),
    WireOp("LOAD_ALLOCATIONS", 6, ("PREPARED",), tears_down=True),
    WireOp("RESTORE_UNICAST", 7, ("ALLOCATIONS_LOADED",), tears_down=True),
    WireOp("RESTORE_MULTICAST_CREATORS", 8, ("UNICAST_RESTORED",), tears_down=True),
    WireOp("RESTORE_MULTICAST_IMPORTERS", 9, ("MULTICAST_CREATED",), tears_down=True),
    WireOp("RESTORE_MULTICAST_DEVICES", 10, ("MULTICAST_IMPORTED",), tears_down=True),
    WireOp("RESTORE_MULTICAST_BINDINGS", 11, ("MULTICAST_JOINED",), tears_down=True),
    # Wherever a creator's allocations are live for its importers: a peer's import
    # may still be in flight in QUIESCED; in ROLLBACK_LOADED importers import again.
    WireOp(
        "EXPORT",
        12,
        _served(
            "ACTIVE",
            "QUIESCED",
            "ALLOCATIONS_LOADED",
            "UNICAST_RESTORED",
            "MULTICAST_CREATED",
            "MULTICAST_IMPORTED",
            "MULTICAST_JOINED",
            "ROLLBACK_LOADED",
        ),
    ),
    # Any phase: FAILED while the shim still holds the staged bytes, again in
    # ROLLBACK_LOADED after an interrupted rollback.
    WireOp("ROLLBACK_ALLOCATIONS", 13, EVERY_PHASE, tears_down=True),
    WireOp("ROLLBACK_IMPORTS", 14, ("ROLLBACK_LOADED",), tears_down=True),
    WireOp("RELEASE", 15, EVERY_PHASE),  # ends the coordinator's lease
    WireOp("STATUS", 16, EVERY_PHASE),  # read-only, served while a phase op runs
    # In QUIESCED an advance: the process makes one more synchronization and is
    # quieted again (specs/quiesce.md).
    WireOp("QUIESCE", 17, _served("ACTIVE", "QUIESCED")),
    # With a file descriptor: the staged copies to and from a file beside the CRIU
    # images (specs/criu.md); the phase stays PREPARED.
    WireOp("STORE_STAGED", 18, ("PREPARED",)),
    WireOp("FETCH_STAGED", 19, ("PREPARED",)),
    # The kept host copy on or given back in a running process (specs/shim.md).
    WireOp("HOST_COPY", 20, ("ACTIVE",)),
)

OP: Final[Mapping[str, WireOp]] = {o.name: o for o in OPS}


@attrs.frozen
class PhaseOp:
    """A wire op that moves a shim from one phase to the next."""

    op: str
    reaches: str  # the phase every successful reply reports
    transfers: bool = False  # the reply carries byte and allocation statistics

    @property
    def needs(self) -> tuple[str, ...]:
        """The phases in which the shim serves the op (the op table's)."""
        return OP[self.op].served_in


PHASE_OPS: Final[tuple[PhaseOp, ...]] = (
    PhaseOp("QUIESCE", "QUIESCED"),
    PhaseOp("PREPARE_MULTICAST", "MULTICAST_DETACHED"),
    PhaseOp("SAVE_ALLOCATIONS", "ALLOCATIONS_SAVED", transfers=True),
    PhaseOp("PREPARE_UNICAST", "PREPARED"),
    PhaseOp("LOAD_ALLOCATIONS", "ALLOCATIONS_LOADED", transfers=True),
    PhaseOp("RESTORE_UNICAST", "UNICAST_RESTORED"),
    PhaseOp("RESTORE_MULTICAST_CREATORS", "MULTICAST_CREATED"),
    PhaseOp("RESTORE_MULTICAST_IMPORTERS", "MULTICAST_IMPORTED"),
    PhaseOp("RESTORE_MULTICAST_DEVICES", "MULTICAST_JOINED"),
    PhaseOp("RESTORE_MULTICAST_BINDINGS", "ACTIVE"),
)

# Back to ACTIVE with the bytes at their addresses: creators re-create and refill
# from their staged copies, then importers import again from the creators.
ROLLBACK_OPS: Final[tuple[PhaseOp, ...]] = (
    PhaseOp("ROLLBACK_ALLOCATIONS", "ROLLBACK_LOADED", transfers=True),
    PhaseOp("ROLLBACK_IMPORTS", "ACTIVE"),
)

# Where a rollback may start: every phase short of the native checkpoint, an
# interrupted rollback, and FAILED while the shim still holds the staged bytes.
ROLLBACK_FROM: Final[tuple[str, ...]] = OP["ROLLBACK_ALLOCATIONS"].served_in

PHASE_OP: Final[Mapping[str, PhaseOp]] = {p.op: p for p in (*PHASE_OPS, *ROLLBACK_OPS)}

# The ops after which a stopped run needs a rollback.
TEARS_DOWN: Final[frozenset[str]] = frozenset(o.name for o in OPS if o.tears_down)
