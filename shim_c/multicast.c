/*
 * Multicast, for now: objects get logical handles and every call is passed
 * through (handles translated), but nothing is captured. A live multicast
 * object makes INSPECT report an UNSUPPORTED_EXPORTABLE record so that the
 * coordinator refuses the capture instead of being silently wrong, and
 * PREPARE_MULTICAST refuses too. The restore ops have nothing to do.
 *
 * Binds block in the driver until every device of the team was added, so
 * g.lock is never held across them.
 */
#include "shim.h"

#include <string.h>

/* Translate `h` (tagged or raw) under g.lock; false when tagged and dead. */
static bool translate(CUmemGenericAllocationHandle h, CUmemGenericAllocationHandle *out,
                      struct obj **o)
{
    *o = NULL;
    if (!SHIM_IS_TAGGED(h)) {
        *out = h;
        return true;
    }
    *o = obj_lookup(h, true);
    if (!*o || !(*o)->live)
        return false;
    *out = (*o)->real;
    return true;
}

CUresult CUDAAPI cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle,
                                   const CUmulticastObjectProp *prop)
{
    CUmemGenericAllocationHandle h;
    struct obj *o;
    CUresult r;

    if (!mcHandle || !prop) {
        r = shim_enter();
        return r != CUDA_SUCCESS ? r : real.cuMulticastCreate(mcHandle, prop);
    }
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    r = real.cuMulticastCreate(&h, prop);
    if (r != CUDA_SUCCESS)
        goto out;
    r = obj_adopt_created(OBJ_MC, h, &o);
    if (r != CUDA_SUCCESS)
        goto out;
    o->mcprop = *prop;
    o->size = prop->size;
    o->handle_types = prop->handleTypes;
    shim_log(LOG_INFO, "multicast object created: passed through, capture will refuse");
    *mcHandle = obj_handle(o);
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMulticastAddDevice(CUmemGenericAllocationHandle mcHandle, CUdevice dev)
{
    CUmemGenericAllocationHandle h;
    struct obj *o;
    CUresult r;

    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    if (!translate(mcHandle, &h, &o)) {
        pthread_mutex_unlock(&g.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g.lock);
    return real.cuMulticastAddDevice(h, dev);
}

/* Translate the object and the member under the lock, then bind without it. */
static CUresult bind_prepare(CUmemGenericAllocationHandle mc, CUmemGenericAllocationHandle mem,
                             CUmemGenericAllocationHandle *rmc, CUmemGenericAllocationHandle *rmem,
                             struct obj **member)
{
    struct obj *o;
    CUresult r = app_lock();
    if (r != CUDA_SUCCESS)
        return r;
    if (!translate(mc, rmc, &o) || (rmem && !translate(mem, rmem, member))) {
        pthread_mutex_unlock(&g.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g.lock);
    return CUDA_SUCCESS;
}

static void mark_member(struct obj *member, CUmemGenericAllocationHandle mem)
{
    pthread_mutex_lock(&g.lock);
    /* Still the same object (not released meanwhile)? */
    if (member && obj_lookup(mem, false) == member)
        member->mc_member = true;
    pthread_mutex_unlock(&g.lock);
}

CUresult CUDAAPI cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                    CUmemGenericAllocationHandle memHandle, size_t memOffset,
                                    size_t size, unsigned long long flags)
{
    CUmemGenericAllocationHandle rmc, rmem;
    struct obj *member = NULL;
    CUresult r = bind_prepare(mcHandle, memHandle, &rmc, &rmem, &member);
    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMulticastBindMem(rmc, mcOffset, rmem, memOffset, size, flags);
    if (r == CUDA_SUCCESS)
        mark_member(member, memHandle);
    return r;
}

CUresult CUDAAPI cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                       size_t mcOffset, CUmemGenericAllocationHandle memHandle,
                                       size_t memOffset, size_t size, unsigned long long flags)
{
    CUmemGenericAllocationHandle rmc, rmem;
    struct obj *member = NULL;
    CUresult r;

    if (!shim_resolve_real() || !real.cuMulticastBindMem_v2)
        return CUDA_ERROR_NOT_SUPPORTED;
    r = bind_prepare(mcHandle, memHandle, &rmc, &rmem, &member);
    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMulticastBindMem_v2(rmc, dev, mcOffset, rmem, memOffset, size, flags);
    if (r == CUDA_SUCCESS)
        mark_member(member, memHandle);
    return r;
}

CUresult CUDAAPI cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                     CUdeviceptr memptr, size_t size, unsigned long long flags)
{
    CUmemGenericAllocationHandle rmc;
    CUresult r = bind_prepare(mcHandle, 0, &rmc, NULL, NULL);
    if (r != CUDA_SUCCESS)
        return r;
    return real.cuMulticastBindAddr(rmc, mcOffset, memptr, size, flags);
}

CUresult CUDAAPI cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                        size_t mcOffset, CUdeviceptr memptr, size_t size,
                                        unsigned long long flags)
{
    CUmemGenericAllocationHandle rmc;
    CUresult r;

    if (!shim_resolve_real() || !real.cuMulticastBindAddr_v2)
        return CUDA_ERROR_NOT_SUPPORTED;
    r = bind_prepare(mcHandle, 0, &rmc, NULL, NULL);
    if (r != CUDA_SUCCESS)
        return r;
    return real.cuMulticastBindAddr_v2(rmc, dev, mcOffset, memptr, size, flags);
}

CUresult CUDAAPI cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                   size_t mcOffset, size_t size)
{
    CUmemGenericAllocationHandle rmc;
    CUresult r = bind_prepare(mcHandle, 0, &rmc, NULL, NULL);
    if (r != CUDA_SUCCESS)
        return r;
    return real.cuMulticastUnbind(rmc, dev, mcOffset, size);
}

/* ------------------------------------------------------------ phase ops */
/* Under g.lock. */
uint32_t multicast_live(void)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (o && o->kind == OBJ_MC && !obj_unused(o))
            n++;
    }
    return n;
}

/* Under g.lock: one UNSUPPORTED_EXPORTABLE record per live multicast object,
 * appended to r->records (room was reserved by the caller). */
void multicast_inspect(struct reply *r, uint32_t *n)
{
    *n = 0;
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        struct cuip_record *rec;
        if (!o || o->kind != OBJ_MC || obj_unused(o))
            continue;
        rec = &r->records[r->h.count++];
        memset(rec, 0, sizeof *rec);
        rec->kind = CUIP_RECORD_UNSUPPORTED_EXPORTABLE;
        rec->handle_types = o->handle_types;
        rec->size = o->size;
        (*n)++;
    }
}

/* Nothing to detach yet; a live multicast object refuses (phase unchanged). */
enum phase_result multicast_prepare(struct reply *r)
{
    uint32_t n;
    pthread_mutex_lock(&g.lock);
    n = multicast_live();
    pthread_mutex_unlock(&g.lock);
    if (n) {
        reply_msg(r, CUIP_STATUS_REFUSED,
                  "%u live multicast object(s): multicast capture is not supported yet", n);
        return PHASE_REFUSED;
    }
    return PHASE_DONE;
}
