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
 * frees the staged bytes. Multicast has no rollback work: capture refuses
 * a process holding a multicast object, so nothing multicast is torn down.
 */
#include "shim.h"

enum phase_result rollback_allocations(struct reply *r)
{
    return content_reload(r);
}

enum phase_result rollback_imports(struct reply *r)
{
    enum phase_result rc = unicast_reimport_all(r);
    /* Freed only once no import can need the creator to refill again. */
    if (rc == PHASE_DONE)
        content_free_staged();
    return rc;
}
