/*
 * The way back to ACTIVE (CUIP_ROLLBACK_OPS in protocol.h, specs/protocol.md):
 * from any phase short of the native checkpoint, and from FAILED while the
 * staged bytes are all there, the application gets its bytes back at their
 * VAs and its sharing rebuilt, instead of a job stranded in a half-captured
 * state.
 *
 * Two ops, because importers can only import once every creator has its
 * allocations again: ROLLBACK_ALLOCATIONS (to all) re-creates and refills
 * each creator's torn-down allocations, keeping the staged bytes in case it
 * is interrupted and sent again; ROLLBACK_IMPORTS (to all, after every
 * ROLLBACK_ALLOCATIONS answered) imports every import again and only then
 * frees the staged bytes.
 *
 * Multicast teams are rebuilt after unicast, in the same two ops: in
 * ROLLBACK_ALLOCATIONS every process tears down whatever it still holds of
 * its teams and each creator creates its objects again (a creator's new
 * object means no importer may keep the old one); in ROLLBACK_IMPORTS,
 * once every creator has answered and every unicast import is back (the
 * bound members), importers import, every process adds its devices, binds
 * and maps. Binds wait in the driver for the whole team, which the
 * coordinator's sending ROLLBACK_IMPORTS to every participant at once
 * completes.
 */
#include "shim.h"

enum phase_result rollback_allocations(struct reply *r)
{
    enum phase_result rc = multicast_rollback_ready(r);

    if (rc == PHASE_DONE)
        rc = content_reload(r);
    return rc == PHASE_DONE ? multicast_rollback_create(r) : rc;
}

enum phase_result rollback_imports(struct reply *r)
{
    enum phase_result rc = unicast_reimport_all(r);
    if (rc == PHASE_DONE)
        rc = multicast_rollback_rebuild(r);
    /* Freed only once no import can need the creator to refill again. */
    if (rc == PHASE_DONE)
        content_free_staged();
    return rc;
}
