"""The capture and restore machines, declared as data (specs/capture.md, specs/restore.md).

Why this order: multicast sits on top of unicast members, so it is torn down
first on capture and rebuilt last on restore. LOAD_ALLOCATIONS is the creator
barrier (every creator's allocation and export endpoint is ready before any
importer asks for it). All devices join a multicast team before any binding,
because the driver's bind spins until the team is complete.
"""

from __future__ import annotations

from .model import Action, Guard, MachineSpec, ProgressKind, Refusal, Step

_TOPOLOGY_VALID = Guard(
    "topology_valid",
    "the inspected topology satisfies every validation predicate",
    Refusal.TOPOLOGY,
)

CAPTURE = MachineSpec(
    name="capture",
    title="cuinterpose capture",
    initial="start",
    final="captured",
    writes_intent=True,
    guards=(
        Guard(
            "all_active",
            "every participant reported phase ACTIVE at HANDSHAKE",
            Refusal.PARTICIPANTS,
        ),
        _TOPOLOGY_VALID,
        Guard(
            "preflight_clean",
            "no RAW_IMPORT, UNSUPPORTED_EXPORTABLE or UNOWNED_SHARING record",
            Refusal.PREFLIGHT,
        ),
        Guard(
            "checkpoint_dir_writable",
            "the state file can be written (a file is created there) and would overwrite "
            "neither an interrupted capture nor one never restored",
            Refusal.CHECKPOINT_DIR,
        ),
    ),
    steps=(
        Step(
            "HANDSHAKE",
            "start",
            "handshaken",
            "bind every endpoint to its participant id and pid",
            op="HANDSHAKE",
        ),
        Step(
            "QUIESCE",
            "handshaken",
            "quiesced",
            "close every gate: threads held at their next synchronizing call, then at "
            "every launch, until no device work is left (specs/quiesce.md)",
            op="QUIESCE",
            guards=("all_active",),
        ),
        Step(
            "INSPECT",
            "quiesced",
            "inspected",
            "collect every participant's topology records, which the gate now keeps from changing",
            op="INSPECT",
            reply_phase="QUIESCED",
        ),
        Step(
            "PREPARE_MULTICAST",
            "inspected",
            "multicast_detached",
            "unbind, unmap and release every multicast object",
            op="PREPARE_MULTICAST",
            guards=("topology_valid", "preflight_clean", "checkpoint_dir_writable"),
        ),
        Step(
            "SAVE_ALLOCATIONS",
            "multicast_detached",
            "allocations_saved",
            "creators copy every shared allocation into host storage",
            op="SAVE_ALLOCATIONS",
            progress=ProgressKind.TRANSFER,
        ),
        Step(
            "PREPARE_UNICAST",
            "allocations_saved",
            "prepared",
            "importers release imports, creators release allocations; VA kept",
            op="PREPARE_UNICAST",
        ),
        Step(
            "WRITE_STATE",
            "prepared",
            "captured",
            "write the state file into the checkpoint directory",
            progress=ProgressKind.NONE,
            action=Action.WRITE_STATE,
        ),
    ),
)

RESTORE = MachineSpec(
    name="restore",
    title="cuinterpose restore",
    initial="start",
    final="restored",
    guards=(
        Guard(
            "participants_match_state",
            "the participant ids from HANDSHAKE equal the state file's exactly",
            Refusal.PARTICIPANTS,
        ),
        Guard(
            "all_prepared",
            "every participant reported phase PREPARED at HANDSHAKE",
            Refusal.PARTICIPANTS,
        ),
        Guard(
            "records_match_state",
            "every participant's records, inspected while PREPARED, equal the state file's",
            Refusal.TOPOLOGY,
        ),
        _TOPOLOGY_VALID,
        Guard(
            "topology_matches_capture",
            "the restored topology equals the captured normalized topology",
            Refusal.TOPOLOGY,
        ),
    ),
    steps=(
        Step(
            "READ_STATE",
            "start",
            "state_read",
            "read and check the state file in the checkpoint directory",
            progress=ProgressKind.NONE,
            action=Action.READ_STATE,
        ),
        Step(
            "HANDSHAKE",
            "state_read",
            "handshaken",
            "bind every endpoint to its participant id and pid",
            op="HANDSHAKE",
        ),
        Step(
            "INSPECT_PREPARED",
            "handshaken",
            "prepared_inspected",
            "collect every participant's records, to compare with the state file",
            op="INSPECT",
            reply_phase="PREPARED",
            guards=("participants_match_state", "all_prepared"),
        ),
        Step(
            "LOAD_ALLOCATIONS",
            "prepared_inspected",
            "allocations_loaded",
            "creators re-create, map and refill every shared allocation",
            op="LOAD_ALLOCATIONS",
            guards=("records_match_state",),
            progress=ProgressKind.TRANSFER,
        ),
        Step(
            "RESTORE_UNICAST",
            "allocations_loaded",
            "unicast_restored",
            "importers re-import at their original addresses",
            op="RESTORE_UNICAST",
        ),
        Step(
            "RESTORE_MULTICAST_CREATORS",
            "unicast_restored",
            "multicast_created",
            "creators re-create every multicast object",
            op="RESTORE_MULTICAST_CREATORS",
        ),
        Step(
            "RESTORE_MULTICAST_IMPORTERS",
            "multicast_created",
            "multicast_imported",
            "importers import every multicast object",
            op="RESTORE_MULTICAST_IMPORTERS",
        ),
        Step(
            "RESTORE_MULTICAST_DEVICES",
            "multicast_imported",
            "multicast_joined",
            "every participant adds its devices to each team",
            op="RESTORE_MULTICAST_DEVICES",
        ),
        Step(
            "RESTORE_MULTICAST_BINDINGS",
            "multicast_joined",
            "multicast_bound",
            "bind members and addresses, map and re-apply access",
            op="RESTORE_MULTICAST_BINDINGS",
        ),
        Step(
            "INSPECT",
            "multicast_bound",
            "inspected",
            "collect the restored topology",
            op="INSPECT",
            reply_phase="ACTIVE",
        ),
        Step(
            "VERIFY",
            "inspected",
            "restored",
            "validate the restored topology and compare it with the captured one",
            guards=("topology_valid", "topology_matches_capture"),
            progress=ProgressKind.NONE,
            action=Action.NOTHING,
        ),
    ),
)

# Back to ACTIVE from wherever a capture or restore stopped short of the native
# checkpoint: creators re-create their allocations and refill them from the
# bytes they staged, then importers import again, then the group is checked
# against the topology recorded before the capture.
ROLLBACK = MachineSpec(
    name="rollback",
    title="cuinterpose rollback",
    initial="start",
    final="rolled_back",
    drops_gone=True,
    guards=(
        Guard(
            "all_can_roll_back",
            "every participant is in a phase a rollback starts from",
            Refusal.PARTICIPANTS,
        ),
        _TOPOLOGY_VALID,
        Guard(
            "topology_matches_before",
            "the topology equals the one recorded before the capture, where one is recorded "
            "and every recorded participant answered",
            Refusal.TOPOLOGY,
        ),
    ),
    steps=(
        Step(
            "READ_TOPOLOGY",
            "start",
            "topology_read",
            "read the intent or the state file, where the checkpoint directory holds one",
            progress=ProgressKind.NONE,
            action=Action.READ_TOPOLOGY,
        ),
        Step(
            "HANDSHAKE",
            "topology_read",
            "handshaken",
            "bind every endpoint still served to its participant id and pid",
            op="HANDSHAKE",
        ),
        Step(
            "ROLLBACK_ALLOCATIONS",
            "handshaken",
            "allocations_back",
            "creators re-create, map and refill every allocation they tore down",
            op="ROLLBACK_ALLOCATIONS",
            guards=("all_can_roll_back",),
            progress=ProgressKind.TRANSFER,
        ),
        Step(
            "ROLLBACK_IMPORTS",
            "allocations_back",
            "imports_back",
            "importers import every shared allocation again; staged bytes are freed",
            op="ROLLBACK_IMPORTS",
        ),
        Step(
            "INSPECT",
            "imports_back",
            "inspected",
            "collect the topology the group is back in",
            op="INSPECT",
            reply_phase="ACTIVE",
        ),
        Step(
            "VERIFY",
            "inspected",
            "rolled_back",
            "validate the topology and compare it with the recorded one",
            guards=("topology_valid", "topology_matches_before"),
            progress=ProgressKind.NONE,
            action=Action.NOTHING,
        ),
    ),
)

MACHINES: dict[str, MachineSpec] = {m.name: m for m in (CAPTURE, RESTORE, ROLLBACK)}


def machine_spec(name: str) -> MachineSpec:
    try:
        return MACHINES[name]
    except KeyError:
        raise KeyError(f"no machine {name!r}; known: {', '.join(sorted(MACHINES))}") from None
