/*
 * Owned memory: the application's cuMemAlloc (cudaMalloc) memory, backed by
 * VMM allocations the shim creates (POSIX-FD exportable, mapped at a
 * reservation of the shim's, read-write for the allocating device and its
 * enabled peers), so that the shim can share it (ipc.c), tear it down and
 * build it again like any tracked allocation. The application never sees a
 * handle: it holds pointers, and every call that takes one answers as the
 * driver does for cuMemAlloc memory (specs/shim.md, "Owned memory"; the
 * driver's answers are in specs/records/2026-12-01-h200-legacy-ipc.txt).
 *
 * Only what loses nothing to the granularity (2 MiB on the H200) is owned:
 * a request of at least one granularity gets a VMM allocation of its own,
 * its size rounded up to the granularity. A smaller request is the driver's
 * (it packs small cuMemAllocs into 2 MiB pages and keeps an importer inside
 * the range it was handed); legacy IPC of it is unowned sharing, refused at
 * capture (unowned.c). VMM maps whole granules, so packing small requests
 * into one allocation would hand an importer its neighbours' bytes: with
 * SNAPSHOT_SHIM_OWN_SMALL=1 a small request gets a granularity of its own
 * instead, at 2 MiB each (specs/shim.md, "Owned memory").
 *
 * Every function here runs with g.lock held across short driver calls, as
 * the other tracked calls do.
 */
#include "shim.h"

#include <stdlib.h>
#include <string.h>

#define PITCH_ALIGN 512u
/* CU_DEVICE_ATTRIBUTE_MAX_PITCH of the H200: a wider row is the driver's to
 * refuse (CUDA_ERROR_INVALID_VALUE), not owned memory's to fail. */
#define PITCH_MAX ((size_t)INT32_MAX)

/* Under g.lock: which devices may access memory owned on a device (bit a of
 * peers[d]: device a enabled peer access to device d). */
static uint64_t peers[MAX_DEVICES];

/* ------------------------------------------------------------ bookkeeping */
static void owned_destroy(struct owned *w)
{
    free(w->ranges);
    free(w);
}

int owned_new(struct obj *o, CUdeviceptr base, size_t reserved)
{
    struct owned *w = calloc(1, sizeof *w);
    if (!w)
        return -1;
    w->base = base;
    w->reserved = reserved;
    o->own = w;
    o->free_own = owned_destroy; /* obj_free frees it through this */
    return 0;
}

struct owned_range *owned_add_range(struct owned *w, uint64_t offset, uint64_t size)
{
    struct owned_range *r;

    if (w->nranges == w->capranges) {
        uint32_t cap = w->capranges ? 2 * w->capranges : 4;
        struct owned_range *n = realloc(w->ranges, cap * sizeof *n);
        if (!n)
            return NULL;
        w->ranges = n;
        w->capranges = cap;
    }
    r = &w->ranges[w->nranges++];
    memset(r, 0, sizeof *r);
    r->offset = offset;
    r->size = size;
    return r;
}

void owned_drop_range(struct owned *w, struct owned_range *range)
{
    *range = w->ranges[--w->nranges];
}

static bool range_holds(const struct owned_range *r, uint64_t off)
{
    /* A zero-size range never holds anything; cuMemAlloc refuses size 0. */
    return off >= r->offset && off - r->offset < r->size;
}

struct obj *owned_find(CUdeviceptr p, struct owned_range **range)
{
    struct obj *o = obj_by_address(p, NULL);
    uint64_t off;

    if (!o || !o->own || p < o->own->base)
        return NULL;
    off = p - o->own->base;
    for (uint32_t i = 0; i < o->own->nranges; i++) {
        struct owned_range *r = &o->own->ranges[i];
        if ((o->is_creator ? r->live : r->opens > 0) && range_holds(r, off)) {
            if (range)
                *range = r;
            return o;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------ devices */
static CUresult current_device(CUcontext *ctx, CUdevice *dev)
{
    CUresult r = real.cuCtxGetCurrent(ctx);
    if (r != CUDA_SUCCESS)
        return r;
    if (!*ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    r = real.cuCtxGetDevice(dev);
    if (r == CUDA_SUCCESS && (*dev < 0 || *dev >= MAX_DEVICES))
        r = CUDA_ERROR_INVALID_DEVICE;
    return r;
}

static void device_prop(CUmemAllocationProp *prop, CUdevice dev)
{
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

/* A device's granularity never changes: asked once (every cuMemAlloc needs it
 * to know whether it is owned). */
static size_t gran_cache[MAX_DEVICES];

CUresult owned_granularity(CUdevice dev, size_t *gran)
{
    CUmemAllocationProp prop;
    CUresult r;

    if (dev >= 0 && dev < MAX_DEVICES &&
        (*gran = __atomic_load_n(&gran_cache[dev], __ATOMIC_RELAXED)) != 0)
        return CUDA_SUCCESS;
    device_prop(&prop, dev);
    if (!real.cuMemGetAllocationGranularity)
        return CUDA_ERROR_NOT_SUPPORTED;
    r = real.cuMemGetAllocationGranularity(gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r == CUDA_SUCCESS && *gran && dev >= 0 && dev < MAX_DEVICES)
        __atomic_store_n(&gran_cache[dev], *gran, __ATOMIC_RELAXED);
    return r;
}

/* The access a fresh owned mapping gets: read-write for the devices in `who`. */
static uint32_t access_for(uint64_t who, CUmemAccessDesc *d)
{
    uint32_t n = 0;

    for (int a = 0; a < MAX_DEVICES && n < CUIP_ACCESS_MAX; a++) {
        if (!(who >> a & 1))
            continue;
        memset(&d[n], 0, sizeof d[n]);
        d[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        d[n].location.id = a;
        d[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        n++;
    }
    return n;
}

static void record_access(struct mapping *m, const CUmemAccessDesc *d, uint32_t n)
{
    /* Sorted by location, as unicast.c merges them: ascending device ids. */
    m->access_count = n;
    for (uint32_t i = 0; i < n; i++) {
        m->access[i].location_type = (int32_t)d[i].location.type;
        m->access[i].location_id = d[i].location.id;
        m->access[i].flags = (uint64_t)d[i].flags;
    }
}

CUresult owned_map_for(CUmemGenericAllocationHandle h, size_t size, uint64_t devices,
                       CUdeviceptr *va, struct mapping *m)
{
    CUmemAccessDesc d[CUIP_ACCESS_MAX];
    uint32_t n;
    CUresult r;

    if (!devices)
        return CUDA_ERROR_INVALID_DEVICE;
    r = real.cuMemAddressReserve(va, size, 0, 0, 0);
    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemMap(*va, size, 0, h, 0);
    if (r != CUDA_SUCCESS)
        goto free_va;
    n = access_for(devices, d);
    r = real.cuMemSetAccess(*va, size, d, n);
    if (r != CUDA_SUCCESS)
        goto unmap;
    memset(m, 0, sizeof *m);
    m->va = *va;
    m->size = size;
    record_access(m, d, n);
    return CUDA_SUCCESS;
unmap:
    real.cuMemUnmap(*va, size);
free_va:
    real.cuMemAddressFree(*va, size);
    return r;
}

CUresult owned_map_new(CUmemGenericAllocationHandle h, size_t size, bool with_peers,
                       CUdeviceptr *va, struct mapping *m)
{
    CUcontext ctx;
    CUdevice dev;
    CUresult r = current_device(&ctx, &dev);

    if (r != CUDA_SUCCESS)
        return r;
    /* The creator's device and the devices that enabled peer access to it,
     * or an importer's own device. */
    return owned_map_for(h, size, (with_peers ? peers[dev] : 0) | 1ull << dev, va, m);
}

CUresult owned_unmap_range(CUdeviceptr va, size_t size)
{
    CUresult r = real.cuMemUnmap(va, size), u = real.cuMemAddressFree(va, size);
    return r != CUDA_SUCCESS ? r : u;
}

/* ------------------------------------------------------------ objects */
/* Unmap, release and forget `o`, an owned object nothing holds any more;
 * in its context unless that context is gone (`in_ctx` false). */
static void release_owned(struct obj *o, bool in_ctx)
{
    CUresult r;
    bool pushed = false;

    if (in_ctx && shim_ctx_enter(o->ctx, &pushed) != CUDA_SUCCESS)
        pushed = false;
    r = owned_unmap_range(o->own->base, o->own->reserved);
    if (r != CUDA_SUCCESS)
        shim_log(LOG_WARN, "freeing owned memory at %#llx: %s", (unsigned long long)o->own->base,
                 shim_cu_name(r));
    if (o->live && (r = real.cuMemRelease(o->real)) != CUDA_SUCCESS)
        shim_log(LOG_WARN, "cuMemRelease of owned memory failed: %s", shim_cu_name(r));
    shim_ctx_leave(pushed);
    o->nmaps = 0;
    obj_free(o);
}

void owned_release(struct obj *o)
{
    release_owned(o, true);
}

/* Under g.lock: a new owned object of `size` bytes (a multiple of the
 * granularity) on the current device, mapped. */
static CUresult owned_create(size_t size, struct obj **out)
{
    CUmemAllocationProp prop;
    CUmemGenericAllocationHandle h;
    struct mapping m;
    struct obj *o = NULL;
    CUdeviceptr va;
    CUcontext ctx;
    CUdevice dev;
    CUresult r;

    r = current_device(&ctx, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    device_prop(&prop, dev);
    r = real.cuMemCreate(&h, size, &prop, 0);
    if (r != CUDA_SUCCESS)
        return r;
    r = owned_map_new(h, size, true, &va, &m);
    if (r != CUDA_SUCCESS) {
        real.cuMemRelease(h);
        return r;
    }
    r = obj_adopt_created(OBJ_ALLOC, h, &o); /* releases h on failure */
    if (r != CUDA_SUCCESS)
        goto undo_map;
    o->refs = 0; /* the application holds a pointer, never a handle */
    o->size = size;
    o->prop = prop;
    o->handle_types = (uint64_t)prop.requestedHandleTypes;
    if (owned_new(o, va, size) != 0 || obj_add_mapping(o, &m) != 0)
        goto nomem;
    *out = o;
    return CUDA_SUCCESS;
nomem:
    r = CUDA_ERROR_OUT_OF_MEMORY;
    real.cuMemRelease(o->real);
    o->nmaps = 0;
    obj_free(o);
undo_map:
    owned_unmap_range(va, size);
    return r;
}

/* ------------------------------------------------------------ allocation */
/* Under g.lock: one allocation of its own for the request, the range the
 * application sees at its start. */
static CUresult owned_alloc(CUdeviceptr *dptr, size_t size)
{
    struct obj *o;
    CUcontext ctx;
    CUdevice dev;
    size_t gran, asz;
    CUresult r;

    r = current_device(&ctx, &dev);
    if (r == CUDA_SUCCESS)
        r = owned_granularity(dev, &gran);
    if (r != CUDA_SUCCESS)
        return r;
    if (size > SIZE_MAX - gran)
        return CUDA_ERROR_OUT_OF_MEMORY;
    asz = (size + gran - 1) / gran * gran;
    r = owned_create(asz, &o);
    if (r != CUDA_SUCCESS)
        return r;
    if (!owned_add_range(o->own, 0, size)) {
        owned_release(o);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    o->own->ranges[0].live = true;
    *dptr = o->own->base;
    return CUDA_SUCCESS;
}

/* Ownership applies once the shim serves its endpoint: memory it owns but
 * could not share would break the application's legacy IPC. */
static bool owning(void)
{
    return shim_settings()->own_allocations && g.sock_name[0] && real.cuMemGetAllocationGranularity;
}

/* Whether a request of `size` bytes is owned: at least a granularity of the
 * current device, or any size with SNAPSHOT_SHIM_OWN_SMALL. Without a
 * current device it is the driver's, to answer as it does. */
static bool owned_size(size_t size)
{
    CUcontext ctx;
    CUdevice dev;
    size_t gran;

    if (shim_settings()->own_small)
        return true;
    return current_device(&ctx, &dev) == CUDA_SUCCESS &&
           owned_granularity(dev, &gran) == CUDA_SUCCESS && gran > 0 && size >= gran;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize)
{
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    if (!dptr || bytesize == 0 || !owning() || !owned_size(bytesize))
        return real.cuMemAlloc(dptr, bytesize);
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    r = owned_alloc(dptr, bytesize);
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMemAllocPitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                 unsigned int elementSize)
{
    size_t p;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    if (!dptr || !pitch || !owning() || width == 0 || height == 0 || width > PITCH_MAX ||
        (elementSize != 4 && elementSize != 8 && elementSize != 16))
        return real.cuMemAllocPitch(dptr, pitch, width, height, elementSize);
    p = (width + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN;
    /* Rows whose size does not fit size_t: the driver's own answer
     * (INVALID_VALUE on the H200), not one of ours. */
    if (p < width || height > SIZE_MAX / p)
        return real.cuMemAllocPitch(dptr, pitch, width, height, elementSize);
    if (!owned_size(p * height))
        return real.cuMemAllocPitch(dptr, pitch, width, height, elementSize);
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    r = owned_alloc(dptr, p * height);
    pthread_mutex_unlock(&g.lock);
    if (r == CUDA_SUCCESS)
        *pitch = p;
    return r;
}

/* Under g.lock: free the creator's range `rg` of `o` (what cuMemAlloc
 * returned). */
static void owned_free(struct obj *o, struct owned_range *rg)
{
    struct owned *w = o->own;
    bool any = false;

    /* An importer holds its own import of the allocation: the creator's
     * goes now, the memory when the last importer closed. */
    owned_drop_range(w, rg);
    for (uint32_t i = 0; i < w->nranges; i++)
        any |= w->ranges[i].live;
    if (!any)
        owned_release(o);
}

CUresult CUDAAPI cuMemFree(CUdeviceptr dptr)
{
    struct owned_range *rg;
    struct obj *o;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    if (dptr == 0)
        return real.cuMemFree(dptr);
    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    o = owned_find(dptr, &rg);
    if (o && o->is_creator) {
        /* Only what cuMemAlloc returned frees, as the driver wants. */
        if (o->own->base + rg->offset == dptr)
            owned_free(o, rg);
        else
            r = CUDA_ERROR_INVALID_VALUE;
        pthread_mutex_unlock(&g.lock);
        return r;
    }
    pthread_mutex_unlock(&g.lock);
    if (o) /* an IPC-opened pointer: cuIpcCloseMemHandle, not cuMemFree */
        return CUDA_ERROR_INVALID_VALUE;
    r = real.cuMemFree(dptr);
    if (r == CUDA_SUCCESS)
        unowned_drop(CUIP_UNOWNED_IPC_EXPORT, dptr);
    return r;
}

/* Owned memory has no stream-ordered free: the context's work is waited for
 * (every stream: the per-thread variants name theirs by 0), then it is freed
 * as cuMemFree frees it. Passes the gate as the synchronizing call it is. */
CUresult CUDAAPI owned_free_async(CUdeviceptr dptr, CUstream stream)
{
    bool mine;
    CUresult r = shim_enter();

    (void)stream;
    if (r != CUDA_SUCCESS || !dptr)
        return SHIM_NOT_MINE;
    pthread_mutex_lock(&g.lock);
    mine = owned_find(dptr, NULL) != NULL;
    pthread_mutex_unlock(&g.lock);
    if (!mine)
        return SHIM_NOT_MINE;
    gate_enter(GATE_SYNC, "cuMemFreeAsync");
    r = real.cuCtxSynchronize();
    gate_leave(GATE_SYNC);
    return r != CUDA_SUCCESS ? r : cuMemFree(dptr);
}

/* Under g.lock: whether `p` lies in owned memory but in no range the
 * application holds (freed, never handed out, or beyond what an importer
 * opened). The driver knows no such pointer: the shim's mapping must not
 * make one up. */
static bool owned_stray(CUdeviceptr p)
{
    struct obj *o = obj_by_address(p, NULL);

    return o && o->own && !owned_find(p, NULL);
}

CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    struct owned_range *rg;
    struct obj *o;
    bool stray;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g.lock);
    o = owned_find(dptr, &rg);
    stray = !o && owned_stray(dptr);
    if (o) {
        if (pbase)
            *pbase = o->own->base + rg->offset;
        if (psize)
            *psize = rg->size;
    }
    pthread_mutex_unlock(&g.lock);
    if (stray)
        return CUDA_ERROR_NOT_FOUND; /* the driver's answer for a pointer it never gave */
    return o ? CUDA_SUCCESS : real.cuMemGetAddressRange(pbase, psize, dptr);
}

/* ------------------------------------------------------------ pointer attributes */
/* What the driver says of cuMemAlloc memory where its answer for the VMM
 * allocation behind it differs (specs/records/2026-12-01-h200-legacy-ipc.txt).
 * A boolean or a small mask is written as its first byte only: callers pass
 * ints or bools, and the driver already zeroed the rest. */
static void keep_id(uint64_t *kept, void *data)
{
    if (*kept)
        memcpy(data, kept, sizeof *kept);
    else
        memcpy(kept, data, sizeof *kept);
}

static void owned_attribute(CUpointer_attribute a, void *data, struct obj *o,
                            const struct owned_range *rg)
{
    switch (a) {
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        keep_id(&o->own->buffer_id, data);
        break;
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        keep_id(&o->own->block_id, data);
        break;
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        memcpy(data, &o->ctx, sizeof o->ctx);
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: {
        CUdeviceptr start = o->own->base + rg->offset;
        memcpy(data, &start, sizeof start);
        break;
    }
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: {
        size_t size = (size_t)rg->size;
        memcpy(data, &size, sizeof size);
        break;
    }
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *(unsigned char *)data = o->is_creator ? 1 : 0;
        break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *(unsigned char *)data = 0;
        break;
    default:
        break;
    }
}

/* The width cuda.h gives each attribute's value (booleans as 4-byte ints,
 * as the driver writes them); 0 for one it does not name. */
static size_t attribute_width(CUpointer_attribute a)
{
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        return 8;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
    case CU_POINTER_ATTRIBUTE_MAPPED:
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
        return 4;
    default:
        return 0;
    }
}

CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute,
                                       CUdeviceptr ptr)
{
    struct owned_range *rg;
    struct obj *o;
    bool stray;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g.lock);
    stray = owned_stray(ptr);
    pthread_mutex_unlock(&g.lock);
    if (stray)
        return CUDA_ERROR_INVALID_VALUE; /* as for any pointer the driver never gave */
    r = real.cuPointerGetAttribute(data, attribute, ptr);
    if (r != CUDA_SUCCESS || !data)
        return r;
    pthread_mutex_lock(&g.lock);
    o = owned_find(ptr, &rg);
    if (o)
        owned_attribute(attribute, data, o, rg);
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuPointerGetAttributes(unsigned int numAttributes,
                                        CUpointer_attribute *attributes, void **data,
                                        CUdeviceptr ptr)
{
    struct owned_range *rg;
    struct obj *o;
    bool stray;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuPointerGetAttributes(numAttributes, attributes, data, ptr);
    if (r != CUDA_SUCCESS || !attributes || !data)
        return r;
    pthread_mutex_lock(&g.lock);
    o = owned_find(ptr, &rg);
    stray = !o && owned_stray(ptr);
    /* A pointer the driver never gave reads as zeros everywhere (cuda.h). */
    for (unsigned i = 0; stray && i < numAttributes; i++)
        if (data[i])
            memset(data[i], 0, attribute_width(attributes[i]));
    for (unsigned i = 0; o && i < numAttributes; i++)
        if (data[i])
            owned_attribute(attributes[i], data[i], o, rg);
    pthread_mutex_unlock(&g.lock);
    return r;
}

/* ------------------------------------------------------------ peer access */
static CUresult ctx_device(CUcontext ctx, CUdevice *dev)
{
    bool pushed;
    CUresult r = shim_ctx_enter(ctx, &pushed);
    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuCtxGetDevice(dev);
    shim_ctx_leave(pushed);
    if (r == CUDA_SUCCESS && (*dev < 0 || *dev >= MAX_DEVICES))
        r = CUDA_ERROR_INVALID_DEVICE;
    return r;
}

/* Under g.lock: give (or take back) device `who` its access to every owned
 * mapping on device `owner`, as the driver does for cuMemAlloc memory when
 * peer access is enabled (disabled). */
static CUresult peer_apply(CUdevice owner, CUdevice who, bool enable)
{
    CUmemAccessDesc d;

    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = who;
    d.flags = enable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        struct mapping *m;
        uint32_t k;
        CUresult r;

        if (!o || !o->own || !o->is_creator || !o->live || o->nmaps != 1 ||
            o->prop.location.id != owner)
            continue;
        m = &o->maps[0];
        r = real.cuMemSetAccess(m->va, m->size, &d, 1);
        if (r != CUDA_SUCCESS)
            return r;
        for (k = 0; k < m->access_count && m->access[k].location_id != who; k++)
            ;
        if (enable && k == m->access_count && k < CUIP_ACCESS_MAX) {
            m->access[k].location_type = CU_MEM_LOCATION_TYPE_DEVICE;
            m->access[k].location_id = who;
            m->access[k].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            m->access_count++;
            for (; k > 0 && m->access[k - 1].location_id > who; k--) {
                struct cuip_access t = m->access[k];
                m->access[k] = m->access[k - 1];
                m->access[k - 1] = t;
            }
        } else if (!enable && k < m->access_count) {
            memmove(&m->access[k], &m->access[k + 1],
                    (m->access_count - k - 1) * sizeof m->access[0]);
            m->access_count--;
            memset(&m->access[m->access_count], 0, sizeof m->access[0]);
        }
    }
    return CUDA_SUCCESS;
}

static CUresult peer_change(CUcontext peer, bool enable, unsigned int flags)
{
    CUcontext ctx;
    CUdevice self, owner;
    CUresult r = enable ? app_lock_for(real.cuCtxEnablePeerAccess)
                        : app_lock_for(real.cuCtxDisablePeerAccess);

    if (r != CUDA_SUCCESS)
        return r;
    r = enable ? real.cuCtxEnablePeerAccess(peer, flags) : real.cuCtxDisablePeerAccess(peer);
    if (r != CUDA_SUCCESS || current_device(&ctx, &self) != CUDA_SUCCESS ||
        ctx_device(peer, &owner) != CUDA_SUCCESS)
        goto out;
    if (enable)
        peers[owner] |= 1ull << self;
    else
        peers[owner] &= ~(1ull << self);
    r = peer_apply(owner, self, enable);
    if (r != CUDA_SUCCESS)
        shim_log(LOG_ERROR, "peer access %s for device %d on owned memory of device %d: %s",
                 enable ? "enabled" : "disabled", self, owner, shim_cu_name(r));
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    return peer_change(peerContext, true, Flags);
}

CUresult CUDAAPI cuCtxDisablePeerAccess(CUcontext peerContext)
{
    return peer_change(peerContext, false, 0);
}

/* ------------------------------------------------------------ contexts */
/* The owned objects of a context, by handle: a context the driver destroyed
 * frees them, and by then a new context may have its address. */
struct ctx_objs {
    CUmemGenericAllocationHandle *h;
    uint32_t n;
};

/* Under g.lock: what context `ctx` allocated and opened; -1 on ENOMEM. */
static int collect_owned(CUcontext ctx, struct ctx_objs *c)
{
    uint32_t cap = 0;

    memset(c, 0, sizeof *c);
    for (uint32_t i = 0; ctx && i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!o || !o->own || o->ctx != ctx)
            continue;
        if (c->n == cap) {
            uint32_t nc = cap ? 2 * cap : 16;
            CUmemGenericAllocationHandle *n = realloc(c->h, nc * sizeof *n);
            if (!n) {
                free(c->h);
                c->h = NULL;
                return -1;
            }
            c->h = n;
            cap = nc;
        }
        c->h[c->n++] = obj_handle(o);
    }
    return 0;
}

/* Under g.lock: free what collect_owned found and still exists, as the driver
 * freed the context's cuMemAlloc memory with it. */
static void drop_collected(CUcontext ctx, const struct ctx_objs *c)
{
    for (uint32_t k = 0; k < c->n; k++) {
        struct obj *o = obj_lookup(c->h[k], false);
        if (o && o->own && o->ctx == ctx)
            release_owned(o, false);
    }
}

/* A call that may destroy a context runs as a synchronizing call, in flight
 * at the gate (a capture waits for it), without g.lock (a destroy waits for
 * the context's work, whose callbacks may take it). */
static CUresult ctx_call_begin(const char *call, void *const *fn)
{
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    if (!*fn)
        return CUDA_ERROR_NOT_SUPPORTED; /* a driver older than the call */
    gate_enter(GATE_SYNC, call);
    pthread_mutex_lock(&g.lock);
    r = g.phase == CUIP_PHASE_ACTIVE ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&g.lock);
    if (r != CUDA_SUCCESS)
        gate_leave(GATE_SYNC);
    return r;
}

static CUresult ctx_collect(CUcontext ctx, struct ctx_objs *c)
{
    int rc;

    pthread_mutex_lock(&g.lock);
    rc = collect_owned(ctx, c);
    pthread_mutex_unlock(&g.lock);
    return rc == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* Once the driver said the context is gone (`destroyed`), its owned memory. */
static void ctx_call_end(CUcontext ctx, struct ctx_objs *c, bool destroyed)
{
    if (destroyed) {
        pthread_mutex_lock(&g.lock);
        drop_collected(ctx, c);
        pthread_mutex_unlock(&g.lock);
        staging_forget_ctx(ctx);
        keep_forget_ctx(ctx);
    }
    free(c->h);
    gate_leave(GATE_SYNC);
}

/* The primary context of `dev` while it is active (a reference taken and given
 * back), else NULL. */
static CUcontext active_primary(CUdevice dev)
{
    unsigned int flags;
    int active = 0;
    CUcontext ctx = NULL;

    if (real.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active ||
        real.cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS)
        return NULL;
    real.cuDevicePrimaryCtxRelease(dev);
    return ctx;
}

CUresult CUDAAPI cuCtxDestroy(CUcontext ctx)
{
    struct ctx_objs c;
    bool pushed, known;
    CUresult r = ctx_call_begin("cuCtxDestroy", (void *const *)&real.cuCtxDestroy);

    if (r != CUDA_SUCCESS)
        return r;
    /* Only a context the driver knows has memory here; a bad one is the
     * driver's to refuse. */
    known = ctx && shim_ctx_enter(ctx, &pushed) == CUDA_SUCCESS;
    if (known)
        shim_ctx_leave(pushed);
    r = ctx_collect(known ? ctx : NULL, &c);
    if (r == CUDA_SUCCESS)
        r = real.cuCtxDestroy(ctx);
    ctx_call_end(ctx, &c, r == CUDA_SUCCESS && known);
    return r;
}

CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev)
{
    struct ctx_objs c;
    CUcontext primary;
    CUresult r = ctx_call_begin("cuDevicePrimaryCtxReset",
                                (void *const *)&real.cuDevicePrimaryCtxReset);

    if (r != CUDA_SUCCESS)
        return r;
    primary = active_primary(dev);
    r = ctx_collect(primary, &c);
    if (r == CUDA_SUCCESS)
        r = real.cuDevicePrimaryCtxReset(dev);
    ctx_call_end(primary, &c, r == CUDA_SUCCESS && primary);
    return r;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev)
{
    struct ctx_objs c;
    CUcontext primary;
    unsigned int flags;
    int active = 1;
    CUresult r = ctx_call_begin("cuDevicePrimaryCtxRelease",
                                (void *const *)&real.cuDevicePrimaryCtxRelease);

    if (r != CUDA_SUCCESS)
        return r;
    primary = active_primary(dev);
    r = ctx_collect(primary, &c);
    if (r == CUDA_SUCCESS)
        r = real.cuDevicePrimaryCtxRelease(dev);
    /* The last reference destroyed it, and its memory with it. */
    ctx_call_end(primary, &c,
                 r == CUDA_SUCCESS && primary &&
                     real.cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS &&
                     !active);
    return r;
}

void owned_after_fork(void)
{
    /* The objects are dropped with the rest of the table. */
    memset(peers, 0, sizeof peers);
}
