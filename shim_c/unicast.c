/*
 * Unicast tracking (the application's VMM calls) and the unicast phase work
 * (INSPECT records, PREPARE_UNICAST teardown, RESTORE_UNICAST re-import,
 * ROLLBACK_IMPORTS' drop and re-import), and the gate on the application's
 * calls that would take a kept reservation away while not ACTIVE.
 *
 * Reference model: while an object exists (the application holds a handle
 * or a mapping) the shim holds exactly one real driver reference to it.
 * Application handles are counted in obj->refs; a retain's extra real
 * reference is dropped at once (the driver may return the same value for a
 * create and a retain, so values are never counted). Teardown therefore
 * releases one reference after unmapping, and rebuild takes one back.
 */
#include "shim.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ helpers */
static int access_cmp(const void *a, const void *b)
{
    const struct cuip_access *x = a, *y = b;
    if (x->location_type != y->location_type)
        return x->location_type < y->location_type ? -1 : 1;
    if (x->location_id != y->location_id)
        return x->location_id < y->location_id ? -1 : 1;
    return 0;
}

/* Merge per location: a later call for the same location replaces its
 * flags, other locations keep theirs; PROT_NONE removes the location. */
static void access_merge(struct mapping *m, const CUmemAccessDesc *d, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        uint32_t k;
        for (k = 0; k < m->access_count; k++)
            if (m->access[k].location_type == (int32_t)d[i].location.type &&
                m->access[k].location_id == (int32_t)d[i].location.id)
                break;
        if (d[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE) {
            if (k < m->access_count) {
                m->access[k] = m->access[m->access_count - 1];
                memset(&m->access[m->access_count - 1], 0, sizeof m->access[0]);
                m->access_count--;
            }
            continue;
        }
        if (k == m->access_count) {
            if (m->access_count == CUIP_ACCESS_MAX) {
                shim_log(LOG_WARN, "more than %u access locations on one mapping; dropped",
                         CUIP_ACCESS_MAX);
                continue;
            }
            m->access_count++;
            m->access[k].location_type = (int32_t)d[i].location.type;
            m->access[k].location_id = (int32_t)d[i].location.id;
        }
        m->access[k].flags = (uint64_t)d[i].flags;
    }
    qsort(m->access, m->access_count, sizeof m->access[0], access_cmp);
}

/* Map `m` for `o` and re-apply its access: remapping does not restore it. */
static CUresult map_apply(struct obj *o, const struct mapping *m, char *msg, size_t n)
{
    CUresult r = real.cuMemMap(m->va, m->size, m->offset, o->real, m->flags);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemMap", r);
        return r;
    }
    return mapping_restore_access(m, msg, n);
}

/* Under g.lock: does [va, va + size) overlap a mapping the shim keeps? */
static bool overlaps_kept(CUdeviceptr va, size_t size)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        if (!o)
            continue;
        for (uint32_t k = 0; k < o->nmaps; k++) {
            const struct mapping *m = &o->maps[k];
            if (m->va < va + size && va < m->va + m->size)
                return true;
        }
    }
    return false;
}

/* Under g.lock: does [va, va + size) overlap memory the shim owns for the
 * application (owned.c)? The driver refuses VMM calls on cuMemAlloc memory,
 * and so does the shim on what stands for it. */
static bool overlaps_owned(CUdeviceptr va, size_t size)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        if (o && obj_owned(o) && o->own->base < va + size && va < o->own->base + o->own->reserved)
            return true;
    }
    return false;
}

/* Enter the shim for a call on [va, va + size) the shim does not track,
 * which must not touch a range the shim keeps while not ACTIVE (a torn-down
 * mapping's reservation is where the rebuild maps it again). Answers
 * CUDA_SUCCESS with `*locked` telling whether g.lock is held: in ACTIVE it is
 * held across the caller's driver call, so a phase op cannot start in the
 * middle; outside ACTIVE the tables do not change, and the call may block
 * (a native checkpoint lock) without stalling the control server. */
static CUresult range_enter(const char *call, CUdeviceptr va, size_t size, bool *locked)
{
    CUresult r = shim_enter();

    *locked = false;
    if (r != CUDA_SUCCESS)
        return r;
    app_gate_lock(call);
    if (g.phase == CUIP_PHASE_ACTIVE) {
        if (overlaps_owned(va, size)) {
            pthread_mutex_unlock(&g.lock);
            return CUDA_ERROR_INVALID_VALUE;
        }
        *locked = true;
        return CUDA_SUCCESS;
    }
    r = overlaps_kept(va, size) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
    pthread_mutex_unlock(&g.lock);
    return r;
}

static void range_leave(bool locked)
{
    if (locked)
        pthread_mutex_unlock(&g.lock);
}

/* cuMemMap of a handle the shim does not track (a raw one of the driver's). */
static CUresult map_untracked(CUdeviceptr ptr, size_t size, size_t offset,
                              CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    bool locked;
    CUresult r = range_enter("cuMemMap", ptr, size, &locked);

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemMap(ptr, size, offset, handle, flags);
    range_leave(locked);
    return r;
}

/* ------------------------------------------------------------ application calls */
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUmemGenericAllocationHandle h;
    struct obj *o;
    CUresult r;

    if (!handle || !prop) {
        r = shim_enter();
        return r != CUDA_SUCCESS ? r : real.cuMemCreate(handle, size, prop, flags);
    }
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    r = real.cuMemCreate(&h, size, prop, flags);
    if (r != CUDA_SUCCESS)
        goto out;
    r = obj_adopt_created(OBJ_ALLOC, h, &o);
    if (r != CUDA_SUCCESS)
        goto out;
    o->size = size;
    o->prop = *prop;
    o->prop.win32HandleMetaData = NULL; /* a pointer into the caller: never kept */
    o->handle_types = (uint64_t)prop->requestedHandleTypes;
    o->unsupported =
        (prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
    *handle = obj_handle(o);
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle)
{
    struct obj *o;
    CUresult r;

    if (!SHIM_IS_TAGGED(handle)) {
        r = shim_enter();
        return r != CUDA_SUCCESS ? r : real.cuMemRelease(handle);
    }
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    o = obj_lookup(handle, true);
    if (!o) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    o->refs--;
    obj_release_if_unused(o);
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    struct mapping m;
    struct obj *o;
    CUresult r;

    if (!SHIM_IS_TAGGED(handle))
        return map_untracked(ptr, size, offset, handle, flags);
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    o = obj_lookup(handle, true);
    if (!o) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if (o->kind == OBJ_MC) {
        /* Waits for the whole team: mapped without g.lock. */
        r = multicast_map(o, ptr, size, offset, flags);
        goto out;
    }
    r = real.cuMemMap(ptr, size, offset, o->real, flags);
    if (r != CUDA_SUCCESS)
        goto out;
    memset(&m, 0, sizeof m);
    m.va = ptr;
    m.size = size;
    m.offset = offset;
    m.flags = flags;
    if (obj_add_mapping(o, &m) != 0) {
        real.cuMemUnmap(ptr, size);
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult r;

    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    if (overlaps_owned(ptr, size)) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    r = real.cuMemUnmap(ptr, size);
    if (r != CUDA_SUCCESS)
        goto out;
    /* The driver refuses a partial unmap, so whole mappings inside the range
     * are what went away. */
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!o)
            continue;
        for (uint32_t k = 0; k < o->nmaps;) {
            const struct mapping *m = &o->maps[k];
            if (m->va >= ptr && m->va - ptr < size && m->size <= size - (m->va - ptr))
                obj_del_mapping(o, k);
            else
                k++;
        }
        obj_release_if_unused(o);
    }
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

/* Freeing a reservation that holds a torn-down mapping would leave the
 * rebuild nowhere to map it: NOT_READY until the shim is ACTIVE again. */
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    bool locked;
    CUresult r = range_enter(__func__, ptr, size, &locked);

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemAddressFree(ptr, size);
    range_leave(locked);
    return r;
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                size_t count)
{
    CUresult r;

    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    if (overlaps_owned(ptr, size)) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    r = real.cuMemSetAccess(ptr, size, desc, count);
    if (r != CUDA_SUCCESS || !desc)
        goto out;
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!o)
            continue;
        for (uint32_t k = 0; k < o->nmaps; k++) {
            struct mapping *m = &o->maps[k];
            if (m->va < ptr + size && ptr < m->va + m->size)
                access_merge(m, desc, count);
        }
    }
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    CUmemGenericAllocationHandle h;
    struct obj *o;
    CUresult r;

    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    if (!handle) {
        r = real.cuMemRetainAllocationHandle(handle, addr);
        goto out;
    }
    r = real.cuMemRetainAllocationHandle(&h, addr);
    if (r != CUDA_SUCCESS)
        goto out;
    o = obj_by_address((CUdeviceptr)(uintptr_t)addr, NULL);
    if (o && obj_owned(o)) {
        /* cuMemAlloc memory has no allocation handle. */
        real.cuMemRelease(h);
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if (!o) {
        /* Not a mapping the shim made: hand the driver's answer back. */
        *handle = h;
        goto out;
    }
    /* The shim already holds its one reference: drop the driver's extra. */
    real.cuMemRelease(h);
    o->refs++;
    *handle = obj_handle(o);
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                        CUmemGenericAllocationHandle handle)
{
    struct obj *o;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    if (!SHIM_IS_TAGGED(handle))
        return real.cuMemGetAllocationPropertiesFromHandle(prop, handle);
    pthread_mutex_lock(&g.lock);
    o = obj_lookup(handle, true);
    if (!o)
        r = CUDA_ERROR_INVALID_VALUE;
    else if (!o->live)
        r = CUDA_ERROR_NOT_READY;
    else
        r = real.cuMemGetAllocationPropertiesFromHandle(prop, o->real);
    pthread_mutex_unlock(&g.lock);
    return r;
}

/* ------------------------------------------------------------ INSPECT */
static void rec_allocation(struct cuip_record *rec, const struct obj *o)
{
    memset(rec, 0, sizeof *rec);
    rec->kind = CUIP_RECORD_ALLOCATION;
    rec->flags = (uint16_t)((o->is_creator ? CUIP_FLAG_CREATOR | CUIP_FLAG_CONTENT : 0) |
                            (o->refs > 0 ? CUIP_FLAG_HANDLE_LIVE : 0));
    memcpy(rec->id, o->id, CUIP_ID_LEN);
    memcpy(rec->creator, o->creator, CUIP_PARTICIPANT_LEN);
    rec->size = o->size;
    rec->handle_types = o->handle_types;
    rec->allocation_type = (int32_t)o->prop.type;
    rec->location_type = (int32_t)o->prop.location.type;
    rec->location_id = o->prop.location.id;
    rec->handle_count = o->refs;
}

static void rec_mapping(struct cuip_record *rec, const struct obj *o, const struct mapping *m)
{
    memset(rec, 0, sizeof *rec);
    rec->kind = CUIP_RECORD_MAPPING;
    memcpy(rec->id, o->id, CUIP_ID_LEN);
    rec->address = m->va;
    rec->size = m->size;
    rec->offset = m->offset;
    rec->op_flags = m->flags;
    rec->access_count = m->access_count;
    memcpy(rec->access, m->access, m->access_count * sizeof m->access[0]);
}

static uint64_t known_size(const struct obj *o)
{
    uint64_t s = o->size;
    for (uint32_t k = 0; k < o->nmaps; k++)
        if (o->maps[k].offset + o->maps[k].size > s)
            s = o->maps[k].offset + o->maps[k].size;
    return s;
}

static void rec_refusal(struct cuip_record *rec, const struct obj *o, uint16_t kind)
{
    memset(rec, 0, sizeof *rec);
    rec->kind = kind;
    rec->handle_types = o->handle_types;
    rec->size = known_size(o);
    if (kind == CUIP_RECORD_UNSUPPORTED_EXPORTABLE) {
        rec->location_type = (int32_t)o->prop.location.type;
        rec->location_id = o->prop.location.id;
    }
}

/* What INSPECT reports as topology: every shared allocation (creator or
 * importer) and every allocation SAVE moves (the private ones this process
 * created, unless SNAPSHOT_SHIM_STAGE_PRIVATE=0). */
static bool reported(const struct obj *o)
{
    return obj_shared(o) || obj_staged(o);
}

/* Whether the native checkpoint keeps `o`'s bytes: an allocation this
 * process created that the shim leaves in place (a private one with
 * SNAPSHOT_SHIM_STAGE_PRIVATE=0, every one in content mode native). */
static bool left_to_native(const struct obj *o)
{
    if (o->kind != OBJ_ALLOC || !o->is_creator || o->raw_import || o->unsupported)
        return false;
    return shim_settings()->native_content || !obj_staged(o);
}

/* Called with g.lock held; no driver calls. The reply's stat_count and
 * stat_bytes say how many allocations (and bytes) this process created that
 * the native checkpoint keeps: the shim's part of "what is left to it". */
int unicast_inspect(struct reply *r)
{
    uint32_t n = obj_count(), nobj = 0, nrec = 0, nraw = 0, nuns = 0, mc = 0;
    struct obj **list = NULL;
    struct cuip_record *recs = NULL;

    list = calloc(n ? n : 1, sizeof *list);
    if (!list)
        goto nomem;
    for (uint32_t i = 0; i < n; i++) {
        struct obj *o = obj_at(i);
        if (!o || o->kind != OBJ_ALLOC || obj_unused(o))
            continue;
        if (left_to_native(o)) {
            r->h.stat_count++;
            r->h.stat_bytes += o->size;
        }
        if (reported(o)) {
            list[nobj++] = o;
            nrec += 1 + o->nmaps;
        } else if (o->raw_import) {
            nrec++;
            nraw++;
        } else if (o->unsupported) {
            nrec++;
            nuns++;
        }
    }
    mc = multicast_unsupported();
    nrec += multicast_record_count();
    if (nrec > CUIP_RECORDS_MAX) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "%u records exceed the limit of %u", nrec,
                  CUIP_RECORDS_MAX);
        free(list);
        return -1;
    }
    recs = calloc(nrec ? nrec : 1, sizeof *recs);
    if (!recs)
        goto nomem;
    qsort(list, nobj, sizeof *list, obj_ptr_id_cmp);
    nrec = 0;
    for (uint32_t i = 0; i < nobj; i++) {
        struct obj *o = list[i];
        rec_allocation(&recs[nrec++], o);
        if (o->nmaps > 1)
            qsort(o->maps, o->nmaps, sizeof *o->maps, mapping_va_cmp);
        for (uint32_t k = 0; k < o->nmaps; k++)
            rec_mapping(&recs[nrec++], o, &o->maps[k]);
    }
    /* Refusal records after the topology, in slot order. */
    for (uint32_t i = 0; i < n; i++) {
        struct obj *o = obj_at(i);
        if (!o || o->kind != OBJ_ALLOC || obj_unused(o) || reported(o))
            continue;
        if (o->raw_import)
            rec_refusal(&recs[nrec++], o, CUIP_RECORD_RAW_IMPORT);
        else if (o->unsupported)
            rec_refusal(&recs[nrec++], o, CUIP_RECORD_UNSUPPORTED_EXPORTABLE);
    }
    r->records = recs;
    r->h.count = nrec;
    multicast_inspect(r);
    if (nraw || nuns || mc)
        reply_msg(r, CUIP_STATUS_OK,
                  "not capturable: %u raw import(s) (an FD that is not a cuinterpose "
                  "capability), %u allocation(s) exportable through a handle type other than "
                  "POSIX FD, %u multicast object(s) exportable through a handle type other than "
                  "POSIX FD",
                  nraw, nuns, mc);
    free(list);
    return 0;
nomem:
    free(list);
    reply_msg(r, CUIP_STATUS_INTERNAL, "out of memory building INSPECT records");
    return -1;
}

/* ------------------------------------------------------------ PREPARE_UNICAST */
static void set_live(struct obj *o, bool live, CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&g.lock);
    o->live = live;
    o->real = h;
    pthread_mutex_unlock(&g.lock);
}

/* Unmap every mapping of `o`, or none: when one unmap fails, the ones done
 * are mapped again (with their access), so that `o` stays whole and live and
 * a rollback finds it as the application left it instead of half torn down.
 * An undo that fails too is added to `msg`. */
static int unmap_all_or_none(struct obj *o, CUmemGenericAllocationHandle h, char *msg, size_t n)
{
    uint32_t k;

    for (k = 0; k < o->nmaps; k++) {
        CUresult cr = real.cuMemUnmap(o->maps[k].va, o->maps[k].size);
        if (cr != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuMemUnmap", cr);
            break;
        }
    }
    if (k == o->nmaps)
        return 0;
    set_live(o, true, h); /* live again, and the handle to map with */
    while (k-- > 0) {
        char undo[128];
        if (map_apply(o, &o->maps[k], undo, sizeof undo) != CUDA_SUCCESS) {
            size_t used = strnlen(msg, n);
            snprintf(msg + used, n - used, "; mapping it again failed: %s", undo);
        }
    }
    return -1;
}

/* Unmap every mapping of `o` (all mapped) and release the shim's reference;
 * the VA reservations stay (graphs and kernels hold those pointers). On
 * failure `o` is left live and mapped, as it was. */
int unicast_drop(struct obj *o, char *msg, size_t n)
{
    bool pushed;
    CUmemGenericAllocationHandle h = o->real;
    CUresult cr = shim_ctx_enter(o->ctx, &pushed);

    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", cr);
        return -1;
    }
    set_live(o, false, 0); /* EXPORT stops serving it before it goes away */
    if (unmap_all_or_none(o, h, msg, n) != 0)
        goto fail;
    cr = real.cuMemRelease(h);
    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemRelease", cr);
        /* Unmapped but still held: map it back rather than strand the handle. */
        set_live(o, true, h);
        if (unicast_load_mappings(o, msg + strnlen(msg, n), n - strnlen(msg, n)) !=
            CUDA_SUCCESS)
            set_live(o, false, 0);
        goto fail;
    }
    shim_ctx_leave(pushed);
    return 0;
fail:
    shim_ctx_leave(pushed);
    return -1;
}

static int teardown(struct obj *o, struct reply *r)
{
    char msg[256];
    if (unicast_drop(o, msg, sizeof msg) != 0) {
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "PREPARE_UNICAST: %s", msg);
        return -1;
    }
    return 0;
}

enum phase_result unicast_prepare(struct reply *r)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!o || !reported(o) || !o->live)
            continue;
        if (o->is_creator && shim_settings()->native_content)
            continue; /* kept: the native checkpoint saves it */
        if (o->is_creator && !o->host) {
            reply_msg(r, CUIP_STATUS_INTERNAL,
                      "PREPARE_UNICAST: allocation content was not saved");
            return PHASE_FAILED;
        }
        if (teardown(o, r) != 0)
            return PHASE_FAILED;
    }
    return PHASE_DONE;
}

/* ------------------------------------------------------------ rebuild */
/* Map every recorded mapping of `o` again (creator after LOAD, importer
 * after RESTORE). Offsets, sizes and flags are the application's own. On
 * failure what was mapped is unmapped again and the failing call's result
 * returned (an undo that fails is named in `msg` and its result returned). */
CUresult unicast_load_mappings(struct obj *o, char *msg, size_t n)
{
    uint32_t k;
    CUresult r = CUDA_SUCCESS;

    for (k = 0; k < o->nmaps; k++) {
        r = map_apply(o, &o->maps[k], msg, n);
        if (r != CUDA_SUCCESS)
            break;
    }
    if (r == CUDA_SUCCESS)
        return r;
    while (k-- > 0) {
        CUresult u = real.cuMemUnmap(o->maps[k].va, o->maps[k].size);
        if (u != CUDA_SUCCESS) {
            size_t used = strnlen(msg, n);
            snprintf(msg + used, n - used, "; undoing it, cuMemUnmap failed: %s (%d)",
                     shim_cu_name(u), (int)u);
            r = u;
        }
    }
    return r;
}

/* Unmap every recorded mapping of `o`; all are tried, the first error is
 * reported. */
int unicast_unload_mappings(struct obj *o, char *msg, size_t n)
{
    int rc = 0;
    for (uint32_t k = 0; k < o->nmaps; k++) {
        CUresult cr = real.cuMemUnmap(o->maps[k].va, o->maps[k].size);
        if (cr != CUDA_SUCCESS && rc == 0) {
            shim_fail(msg, n, "cuMemUnmap", cr);
            rc = -1;
        }
    }
    return rc;
}

/* `h` (a fresh import of o's creator's allocation) mapped at o's VAs. */
static int load_import(struct obj *o, CUmemGenericAllocationHandle h, const char *op,
                       struct reply *r)
{
    char msg[512];
    bool pushed = false;
    CUresult cr;

    cr = shim_ctx_enter(o->ctx, &pushed);
    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, sizeof msg, "cuCtxPushCurrent", cr);
        real.cuMemRelease(h);
        goto fail;
    }
    pthread_mutex_lock(&g.lock);
    o->real = h;
    pthread_mutex_unlock(&g.lock);
    if (unicast_load_mappings(o, msg, sizeof msg) != CUDA_SUCCESS) {
        cr = real.cuMemRelease(h);
        if (cr != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuMemRelease of a failed import failed: %s", shim_cu_name(cr));
        set_live(o, false, 0);
        goto fail;
    }
    shim_ctx_leave(pushed);
    set_live(o, true, h);
    return 0;
fail:
    shim_ctx_leave(pushed);
    reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s: %s", op, msg);
    return -1;
}

static int reimport(struct obj *o, const char *op, struct reply *r)
{
    CUmemGenericAllocationHandle h;
    char msg[512];

    if (cap_import_again(o, &h, msg, sizeof msg) != 0) {
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s: %s", op, msg);
        return -1;
    }
    return load_import(o, h, op, r);
}

static bool is_import(const struct obj *o)
{
    return o && obj_shared(o) && !o->is_creator;
}

enum phase_result unicast_restore(struct reply *r)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!is_import(o) || o->live)
            continue;
        if (reimport(o, "RESTORE_UNICAST", r) != 0)
            return PHASE_FAILED;
    }
    return PHASE_DONE;
}

/* A torn-down import whose creator is gone: its bytes went with the creator,
 * and nothing can map them again. It is forgotten (its logical handle dead,
 * its VAs unmapped), so that the process runs on with its own memory; `lost`
 * names it for the reply. */
static void forget_lost_import(struct obj *o, char *lost, size_t n)
{
    size_t len = strlen(lost);
    char id[2 * CUIP_ID_LEN + 1];

    shim_hex(id, o->id, CUIP_ID_LEN);
    id[2 * CUIP_ID_LEN] = 0;
    snprintf(lost + len, n - len, "%sallocation %s of creator %.*s (%llu bytes, mapped at "
             "0x%llx%s)", len ? "; " : "", id, CUIP_PARTICIPANT_LEN, o->creator,
             (unsigned long long)o->size, o->nmaps ? (unsigned long long)o->maps[0].va : 0ull,
             o->nmaps > 1 ? " and more" : "");
    shim_log(LOG_ERROR, "ROLLBACK_IMPORTS: the creator of allocation %s is gone with its "
             "bytes; this import is dropped and its VAs stay unmapped", id);
    pthread_mutex_lock(&g.lock);
    obj_free(o);
    pthread_mutex_unlock(&g.lock);
}

/* Every import again: a live one may map memory that its creator has since
 * replaced (re-created from its staged bytes), so it is dropped, but only once
 * a fresh export is in hand. A live import whose creator is gone is kept: a
 * dead creator replaced nothing, and the import is the last reference to the
 * bytes. A torn-down one whose creator is gone is lost, and named in the
 * reply (OK): the process comes back with everything else. */
enum phase_result unicast_reimport_all(struct reply *r)
{
    char msg[512];
    char lost[CUIP_MESSAGE_MAX - 64] = "";

    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!is_import(o))
            continue;
        CUmemGenericAllocationHandle h;
        int got = cap_import_again(o, &h, msg, sizeof msg);
        if (got == CAP_CREATOR_GONE && o->live) {
            shim_log(LOG_WARN, "ROLLBACK_IMPORTS: creator %.*s is gone (%s); the import "
                     "that still maps its memory is kept", CUIP_PARTICIPANT_LEN, o->creator,
                     msg);
            continue;
        }
        if (got == CAP_CREATOR_GONE) {
            forget_lost_import(o, lost, sizeof lost);
            continue;
        }
        if (got != 0) {
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "ROLLBACK_IMPORTS: %s", msg);
            return PHASE_FAILED;
        }
        if (o->live && unicast_drop(o, msg, sizeof msg) != 0) {
            real.cuMemRelease(h);
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "ROLLBACK_IMPORTS: %s", msg);
            return PHASE_FAILED;
        }
        if (load_import(o, h, "ROLLBACK_IMPORTS", r) != 0)
            return PHASE_FAILED;
    }
    if (lost[0])
        reply_msg(r, CUIP_STATUS_OK, "lost (creator gone): %s", lost);
    return PHASE_DONE;
}
