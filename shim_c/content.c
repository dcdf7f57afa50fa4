/*
 * Allocation content: SAVE_ALLOCATIONS and LOAD_ALLOCATIONS.
 *
 * Creators copy every shared allocation into pinned host memory through a
 * temporary mapping of the whole allocation (the application's own mappings
 * may be partial or read-only), in 64 MiB chunks spread over a few streams;
 * on the H200 this runs at ~55 GB/s against ~2 GB/s for the native
 * checkpoint. LOAD re-creates each allocation with its original properties,
 * maps it at its original VAs with its access, copies the bytes back and
 * frees the host copy. Runs on the control thread without g.lock: outside
 * ACTIVE the application cannot change the tables.
 */
#include "shim.h"

#include <stdio.h>
#include <string.h>

#define CHUNK ((size_t)64 << 20)
#define NSTREAMS 4

struct stats {
    uint64_t count, bytes, copy_ns;
};

static CUdevice access_device(const struct obj *o)
{
    CUdevice dev = 0;
    if (o->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        return o->prop.location.id;
    if (real.cuCtxGetDevice(&dev) != CUDA_SUCCESS)
        dev = 0;
    return dev;
}

/* A private read-write window on the whole allocation. */
static int temp_map(const struct obj *o, CUmemGenericAllocationHandle h, CUdeviceptr *va,
                    char *msg, size_t n)
{
    CUmemAccessDesc d;
    CUresult r = real.cuMemAddressReserve(va, o->size, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemAddressReserve", r);
        return -1;
    }
    r = real.cuMemMap(*va, o->size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemMap", r);
        goto fail_va;
    }
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = access_device(o);
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = real.cuMemSetAccess(*va, o->size, &d, 1);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemSetAccess", r);
        goto fail_map;
    }
    return 0;
fail_map:
    real.cuMemUnmap(*va, o->size);
fail_va:
    real.cuMemAddressFree(*va, o->size);
    return -1;
}

static int temp_unmap(const struct obj *o, CUdeviceptr va, char *msg, size_t n)
{
    CUresult r = real.cuMemUnmap(va, o->size);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemUnmap", r);
        real.cuMemAddressFree(va, o->size);
        return -1;
    }
    r = real.cuMemAddressFree(va, o->size);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemAddressFree", r);
        return -1;
    }
    return 0;
}

/* Chunked copy between `host` and `va`, both of `size` bytes. */
static int copy_chunks(bool to_host, void *host, CUdeviceptr va, size_t size, uint64_t *ns,
                       char *msg, size_t n)
{
    CUstream s[NSTREAMS] = {0};
    uint64_t t0;
    CUresult r = CUDA_SUCCESS;
    int ok = 0, i;
    size_t off, k;

    for (i = 0; i < NSTREAMS; i++) {
        r = real.cuStreamCreate(&s[i], CU_STREAM_NON_BLOCKING);
        if (r != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuStreamCreate", r);
            goto out;
        }
    }
    t0 = shim_now_ns();
    for (off = 0, k = 0; off < size; off += CHUNK, k++) {
        size_t len = size - off < CHUNK ? size - off : CHUNK;
        CUstream st = s[k % NSTREAMS];
        if (to_host)
            r = real.cuMemcpyDtoHAsync((char *)host + off, va + off, len, st);
        else
            r = real.cuMemcpyHtoDAsync(va + off, (char *)host + off, len, st);
        if (r != CUDA_SUCCESS) {
            shim_fail(msg, n, to_host ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync", r);
            break;
        }
    }
    /* Always drain what was queued before touching the buffers again. */
    for (i = 0; i < NSTREAMS; i++) {
        CUresult r2 = real.cuStreamSynchronize(s[i]);
        if (r2 != CUDA_SUCCESS && r == CUDA_SUCCESS) {
            r = r2;
            shim_fail(msg, n, "cuStreamSynchronize", r2);
        }
    }
    *ns += shim_now_ns() - t0;
    ok = r == CUDA_SUCCESS;
out:
    for (i = 0; i < NSTREAMS; i++)
        if (s[i])
            real.cuStreamDestroy(s[i]);
    return ok ? 0 : -1;
}

static bool creator_shared(const struct obj *o)
{
    return o && obj_shared(o) && o->is_creator;
}

static void free_hosts(void)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (o && o->host) {
            real.cuMemFreeHost(o->host);
            o->host = NULL;
        }
    }
}

static int save_one(struct obj *o, struct stats *st, char *msg, size_t n)
{
    CUdeviceptr va = 0;
    void *host = NULL;
    bool pushed;
    CUresult r = shim_ctx_enter(o->ctx, &pushed);

    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", r);
        return -1;
    }
    r = real.cuMemHostAlloc(&host, o->size, 0);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemHostAlloc", r);
        goto fail;
    }
    if (temp_map(o, o->real, &va, msg, n) != 0)
        goto fail_host;
    if (copy_chunks(true, host, va, o->size, &st->copy_ns, msg, n) != 0) {
        char ignored[8];
        temp_unmap(o, va, ignored, sizeof ignored);
        goto fail_host;
    }
    if (temp_unmap(o, va, msg, n) != 0)
        goto fail_host;
    o->host = host;
    st->count++;
    st->bytes += o->size;
    shim_ctx_leave(pushed);
    return 0;
fail_host:
    real.cuMemFreeHost(host);
fail:
    shim_ctx_leave(pushed);
    return -1;
}

int content_save(struct reply *r)
{
    struct stats st = {0, 0, 0};
    char msg[256];

    if (g.native_content)
        return 0; /* the native checkpoint moves the bytes */
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!creator_shared(o) || !o->live || o->host)
            continue;
        if (save_one(o, &st, msg, sizeof msg) != 0) {
            free_hosts();
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "SAVE_ALLOCATIONS: %s", msg);
            return -1;
        }
    }
    r->h.stat_count = st.count;
    r->h.stat_bytes = st.bytes;
    r->h.stat_copy_ns = st.copy_ns;
    return 0;
}

static int load_one(struct obj *o, struct stats *st, char *msg, size_t n)
{
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    bool pushed;
    CUresult r = shim_ctx_enter(o->ctx, &pushed);

    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", r);
        return -1;
    }
    r = real.cuMemCreate(&h, o->size, &o->prop, 0);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemCreate", r);
        goto fail;
    }
    if (SHIM_IS_TAGGED(h)) {
        snprintf(msg, n, "cuMemCreate: driver handle collides with the shim's tag range");
        real.cuMemRelease(h);
        goto fail;
    }
    pthread_mutex_lock(&g.lock); /* readers check `live` first, but keep it clean */
    o->real = h;
    pthread_mutex_unlock(&g.lock);
    if (unicast_load_mappings(o, msg, n) != 0)
        goto fail_h;
    if (temp_map(o, h, &va, msg, n) != 0)
        goto fail_h;
    if (copy_chunks(false, o->host, va, o->size, &st->copy_ns, msg, n) != 0) {
        char ignored[8];
        temp_unmap(o, va, ignored, sizeof ignored);
        goto fail_h;
    }
    if (temp_unmap(o, va, msg, n) != 0)
        goto fail_h;
    r = real.cuMemFreeHost(o->host);
    if (r != CUDA_SUCCESS)
        shim_log(LOG_WARN, "cuMemFreeHost failed: %s", shim_cu_name(r));
    o->host = NULL;
    st->count++;
    st->bytes += o->size;
    shim_ctx_leave(pushed);
    pthread_mutex_lock(&g.lock);
    o->live = true;
    pthread_mutex_unlock(&g.lock);
    return 0;
fail_h:
    /* Fail-stop: the shim goes FAILED; what was made so far stays. */
fail:
    shim_ctx_leave(pushed);
    return -1;
}

int content_load(struct reply *r)
{
    struct stats st = {0, 0, 0};
    char msg[256];

    if (g.native_content)
        return 0; /* creators kept their allocations */
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!creator_shared(o) || o->live)
            continue;
        if (!o->host) {
            reply_msg(r, CUIP_STATUS_INTERNAL, "LOAD_ALLOCATIONS: no saved content");
            return -1;
        }
        if (load_one(o, &st, msg, sizeof msg) != 0) {
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "LOAD_ALLOCATIONS: %s", msg);
            return -1;
        }
    }
    r->h.stat_count = st.count;
    r->h.stat_bytes = st.bytes;
    r->h.stat_copy_ns = st.copy_ns;
    return 0;
}
