/*
 * Legacy CUDA IPC (cuIpcGetMemHandle, cuIpcOpenMemHandle, cuIpcCloseMemHandle)
 * over tracked sharing. For memory the shim owns (owned.c), the 64-byte
 * handle is a struct cuip_ipc_handle naming the creator's allocation (one
 * allocation per cudaMalloc: owned.c), whose range starts at its start;
 * opening it in another shim fetches the allocation from the creator's
 * endpoint through the capability import (capability.c: cap_import and
 * cap_adopt_import, the same EXPORT, authorization, size and server checks,
 * the same FETCH record, withdrawn when the open fails afterwards), and maps
 * it at a new VA. Capture, restore and rollback then see an importer like any
 * other. The driver's own rules hold (specs/records/2026-12-01-h200-legacy-ipc.txt):
 * a handle of an interior pointer names the whole allocation, opening in the
 * creating process is CUDA_ERROR_INVALID_CONTEXT, a second open in one
 * process returns the same pointer and needs its own close, a close takes
 * the opened pointer only, an open is accessible from the allocation's device
 * and from the opener's only when it is that one or lazy peer access is asked
 * for (specs/records/2026-12-01-h200-fidelity.jsonl).
 *
 * Everything else (driver memory when ownership is off, a driver handle from
 * a process without the shim) goes to the driver and is recorded as
 * unowned sharing (unowned.c), which refuses the capture.
 */
#include "shim.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ handles */
static void to_hex(char out[CUIP_PARTICIPANT_LEN], const uint8_t *in)
{
    char buf[CUIP_PARTICIPANT_LEN + 1];
    shim_hex(buf, in, CUIP_PARTICIPANT_LEN / 2);
    memcpy(out, buf, CUIP_PARTICIPANT_LEN);
}

/* The full authorization: the handle's 12 bytes and 4 zeros. */
static void full_auth(uint8_t out[CUIP_AUTH_LEN], const struct cuip_ipc_handle *h)
{
    memset(out, 0, CUIP_AUTH_LEN);
    memcpy(out, h->authorization, CUIP_IPC_AUTH_LEN);
}

/* Every handle the shim hands out names a range at its allocation's start
 * (owned.c gives each cudaMalloc an allocation of its own). */
static bool handle_ok(const struct cuip_ipc_handle *h)
{
    return h->creator_pid > 0 && h->creator_pid <= 0x7fffffffu && h->size > 0 &&
           h->offset == 0 && !shim_is_zero(h->resource_id, CUIP_ID_LEN) &&
           !shim_is_zero(h->creator, sizeof h->creator);
}

static void handle_ref(const struct cuip_ipc_handle *h, struct cap_ref *ref)
{
    memset(ref, 0, sizeof *ref);
    ref->kind = CUIP_RESOURCE_UNICAST;
    to_hex(ref->creator, h->creator);
    memcpy(ref->id, h->resource_id, CUIP_ID_LEN);
    full_auth(ref->auth, h);
    snprintf(ref->endpoint, sizeof ref->endpoint, "%s%u%s", CUIP_SOCKET_PREFIX, h->creator_pid,
             CUIP_SOCKET_SUFFIX);
    ref->size = h->size;
}

/* Under g.lock: fill `h` for the creator's range `rg` of owned `o`. */
static CUresult make_handle(struct obj *o, struct owned_range *rg, struct cuip_ipc_handle *h)
{
    if (!o->has_auth) {
        if (shim_random(o->auth, CUIP_IPC_AUTH_LEN) != 0)
            return CUDA_ERROR_OPERATING_SYSTEM;
        memset(o->auth + CUIP_IPC_AUTH_LEN, 0, CUIP_AUTH_LEN - CUIP_IPC_AUTH_LEN);
        o->has_auth = true;
    }
    memset(h, 0, sizeof *h);
    h->magic = CUIP_IPC_MAGIC;
    h->creator_pid = (uint32_t)getpid();
    if (!shim_unhex(h->creator, g.participant, CUIP_PARTICIPANT_LEN))
        return CUDA_ERROR_NOT_INITIALIZED;
    memcpy(h->resource_id, o->id, CUIP_ID_LEN);
    memcpy(h->authorization, o->auth, CUIP_IPC_AUTH_LEN);
    if (rg->offset > UINT32_MAX)
        return CUDA_ERROR_INVALID_VALUE; /* the handle's offset is 32 bits */
    h->offset = (uint32_t)rg->offset;
    h->size = rg->size;
    o->exported = true; /* shared from now on: captured and rebuilt */
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    struct cuip_ipc_handle h;
    struct owned_range *rg;
    struct obj *o;
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = app_lock_for(real.cuIpcGetMemHandle);

    if (r != CUDA_SUCCESS)
        return r;
    o = owned_find(dptr, &rg);
    if (o) {
        /* An opened pointer is VMM memory to the driver too: not shareable. */
        r = !pHandle || !o->is_creator ? CUDA_ERROR_INVALID_VALUE : make_handle(o, rg, &h);
        if (r == CUDA_SUCCESS)
            memcpy(pHandle, &h, sizeof h);
        pthread_mutex_unlock(&g.lock);
        return r;
    }
    pthread_mutex_unlock(&g.lock);
    r = real.cuIpcGetMemHandle(pHandle, dptr);
    if (r == CUDA_SUCCESS &&
        real.cuMemGetAddressRange(&base, &size, dptr) == CUDA_SUCCESS)
        unowned_add(CUIP_UNOWNED_IPC_EXPORT, base, base, size);
    return r;
}

/* ------------------------------------------------------------ open */
/* Under g.lock: one more open of a known import of the same allocation (the
 * same range: an import holds the one it was handed); false when this
 * process has none. */
static bool reopen_known(const struct cuip_ipc_handle *h, CUdeviceptr *out, CUresult *r)
{
    uint8_t auth[CUIP_AUTH_LEN];
    struct owned_range *rg;
    struct obj *o = obj_by_id(h->resource_id);

    if (!o || !o->own || o->is_creator)
        return false;
    full_auth(auth, h);
    rg = o->own->nranges ? &o->own->ranges[0] : NULL;
    if (!o->live || !rg || !shim_ct_equal(o->auth, auth, CUIP_AUTH_LEN) ||
        rg->offset != h->offset || rg->size != h->size) {
        *r = CUDA_ERROR_INVALID_VALUE;
        return true;
    }
    rg->opens++;
    *out = o->own->base + h->offset;
    *r = CUDA_SUCCESS;
    return true;
}

/* Who may access an open, as the driver grants it: the allocation's device
 * always, the opening context's device when it is that one or the open asks
 * for peer access (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS). */
static CUresult open_devices(CUdevice owner, unsigned int flags, uint64_t *devices)
{
    CUdevice dev;
    CUresult r = real.cuCtxGetDevice(&dev);

    if (r != CUDA_SUCCESS)
        return r;
    if (owner < 0 || owner >= MAX_DEVICES || dev < 0 || dev >= MAX_DEVICES)
        return CUDA_ERROR_INVALID_DEVICE;
    *devices = 1ull << owner;
    if (dev == owner || (flags & CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        *devices |= 1ull << dev;
    return CUDA_SUCCESS;
}

/* The creator's allocation, imported and mapped here (no lock held: the
 * creator may be asking us for an export at the same time), with the access
 * the open's `flags` give. `fetched`: the creator recorded the fetch (a
 * failure then withdraws it). */
static CUresult fetch_and_map(const struct cap_ref *ref, unsigned int flags,
                              CUmemGenericAllocationHandle *out, size_t *size, CUdeviceptr *va,
                              struct mapping *m, bool *fetched)
{
    uint64_t devices = 0;
    CUmemAllocationProp prop;
    CUmemGenericAllocationHandle mh;
    char msg[512];
    size_t gran;
    CUresult r = CUDA_SUCCESS;
    int got = cap_import(ref, &mh, &r, msg, sizeof msg);

    *fetched = got == 0 || got == CAP_IMPORT_FAILED || got == CAP_FETCH_LOST;
    if (got != 0) {
        /* As the driver answers a handle whose memory is gone. */
        shim_log(LOG_WARN, "cuIpcOpenMemHandle: %s", msg);
        return got == CAP_IMPORT_FAILED ? r : CUDA_ERROR_INVALID_VALUE;
    }
    /* The allocation is the range rounded up to the granularity (owned.c). */
    r = real.cuMemGetAllocationPropertiesFromHandle(&prop, mh);
    if (r == CUDA_SUCCESS)
        r = owned_granularity(prop.location.id, &gran);
    if (r == CUDA_SUCCESS)
        r = open_devices(prop.location.id, flags, &devices);
    if (r == CUDA_SUCCESS && ref->size > SIZE_MAX - gran)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        *size = (size_t)((ref->size + gran - 1) / gran * gran);
        r = owned_map_for(mh, *size, devices, va, m);
    }
    if (r != CUDA_SUCCESS) {
        real.cuMemRelease(mh);
        return r;
    }
    *out = mh;
    return CUDA_SUCCESS;
}

/* Under g.lock: the importer's object for what fetch_and_map mapped. */
static CUresult adopt_import(const struct cap_ref *ref, CUmemGenericAllocationHandle mh,
                             size_t size, const struct mapping *m)
{
    struct owned_range *rg;
    struct obj *o = cap_adopt_import(mh, ref, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);

    if (!o)
        return CUDA_ERROR_OUT_OF_MEMORY;
    o->refs = 0; /* the application holds the pointer, not a handle */
    o->size = size;
    if (owned_new(o, m->va, size) != 0 || obj_add_mapping(o, m) != 0 ||
        !(rg = owned_add_range(o->own, 0, ref->size))) {
        /* Released here; the caller unmaps the VA it mapped. */
        o->nmaps = 0;
        real.cuMemRelease(mh);
        obj_free(o);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    rg->opens = 1;
    return CUDA_SUCCESS;
}

static CUresult open_owned(CUdeviceptr *pdptr, const struct cuip_ipc_handle *h,
                           unsigned int flags)
{
    char creator[CUIP_PARTICIPANT_LEN];
    CUmemGenericAllocationHandle mh = 0;
    struct cap_ref ref;
    struct mapping m;
    CUdeviceptr va = 0;
    CUcontext ctx;
    bool fetched, held = false;
    size_t size = 0;
    CUresult r;

    if (!handle_ok(h) || (flags & ~(unsigned int)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = real.cuCtxGetCurrent(&ctx)) != CUDA_SUCCESS)
        return r;
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    if (reopen_known(h, pdptr, &r)) {
        pthread_mutex_unlock(&g.lock);
        return r;
    }
    to_hex(creator, h->creator);
    if (!g.participant[0])
        r = CUDA_ERROR_NOT_INITIALIZED; /* no control server: nobody to fetch for */
    else if (!memcmp(creator, g.participant, CUIP_PARTICIPANT_LEN))
        r = CUDA_ERROR_INVALID_CONTEXT; /* the driver's answer in the creating process */
    pthread_mutex_unlock(&g.lock);
    if (r != CUDA_SUCCESS)
        return r;

    handle_ref(h, &ref);
    r = fetch_and_map(&ref, flags, &mh, &size, &va, &m, &fetched);
    if (r != CUDA_SUCCESS) {
        if (fetched)
            cap_withdraw(&ref);
        return r;
    }
    pthread_mutex_lock(&g.lock);
    if (g.phase != CUIP_PHASE_ACTIVE) {
        r = CUDA_ERROR_NOT_READY;
    } else if (reopen_known(h, pdptr, &r)) { /* another thread opened it meanwhile */
        held = r == CUDA_SUCCESS;
    } else {
        r = adopt_import(&ref, mh, size, &m); /* owns mh from here, even on failure */
        mh = 0;
        held = r == CUDA_SUCCESS;
        if (held)
            *pdptr = va;
    }
    pthread_mutex_unlock(&g.lock);
    if (!held || mh) {
        owned_unmap_range(va, size);
        if (mh)
            real.cuMemRelease(mh);
    }
    if (!held)
        cap_withdraw(&ref);
    return r;
}

static CUresult open_handle(CUresult (*driver)(CUdeviceptr *, CUipcMemHandle, unsigned int),
                            CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    struct cuip_ipc_handle h;
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    if (!driver)
        return CUDA_ERROR_NOT_SUPPORTED;
    memcpy(&h, &handle, sizeof h);
    if (h.magic == CUIP_IPC_MAGIC && pdptr)
        return open_owned(pdptr, &h, flags);
    r = driver(pdptr, handle, flags);
    if (r == CUDA_SUCCESS && pdptr) {
        if (real.cuMemGetAddressRange(&base, &size, *pdptr) != CUDA_SUCCESS)
            size = 0;
        unowned_add(CUIP_UNOWNED_IPC_OPEN, *pdptr, *pdptr, size);
    }
    return r;
}

_Static_assert(sizeof(CUipcMemHandle) == sizeof(struct cuip_ipc_handle),
               "the shim's handle fills CUipcMemHandle");

/* The fetch passes the gate for its whole length, as a capability import
 * does: QUIESCE waits for it. */
static CUresult open_gated(CUresult (*driver)(CUdeviceptr *, CUipcMemHandle, unsigned int),
                           CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    CUresult r;

    gate_enter(GATE_LAUNCH, "cuIpcOpenMemHandle");
    r = open_handle(driver, pdptr, handle, flags);
    gate_leave(GATE_LAUNCH);
    return r;
}

CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                    unsigned int Flags)
{
    return open_gated(real.cuIpcOpenMemHandle, pdptr, handle, Flags);
}

/* CUDA 4.1's name for the same ABI (cuda.h maps the name to _v2). */
#undef cuIpcOpenMemHandle
SHIM_EXPORT CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                                unsigned int Flags);
CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                    unsigned int Flags)
{
    return open_gated(real.cuIpcOpenMemHandle_v1, pdptr, handle, Flags);
}

/* ------------------------------------------------------------ close */
CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    struct owned_range *rg;
    struct obj *o;
    CUresult r = app_lock_for(real.cuIpcCloseMemHandle);

    if (r != CUDA_SUCCESS)
        return r;
    o = owned_find(dptr, &rg);
    if (!o) {
        pthread_mutex_unlock(&g.lock);
        r = real.cuIpcCloseMemHandle(dptr);
        if (r == CUDA_SUCCESS)
            unowned_drop(CUIP_UNOWNED_IPC_OPEN, dptr);
        return r;
    }
    if (o->is_creator || o->own->base + rg->offset != dptr) {
        pthread_mutex_unlock(&g.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (--rg->opens == 0)
        owned_release(o); /* the last open: the import goes */
    pthread_mutex_unlock(&g.lock);
    return CUDA_SUCCESS;
}
