/*
 * Sharing the shim does not own: it cannot tear it down nor build it again,
 * and the native checkpoint cannot either (specs/shim.md, "What the shim
 * refuses"), so a capture of a process holding any of it must be refused
 * before anything changes. The calls that make such sharing record it here;
 * INSPECT reports every live entry as an UNOWNED_SHARING record and the
 * coordinator's preflight refuses the capture, naming the call.
 *
 * What is recorded (enum cuip_unowned):
 *  - IPC_EXPORT: cuIpcGetMemHandle of memory the driver allocated (ownership
 *    off). On the H200 such a handle no longer opens once its process went
 *    through the native checkpoint (CUDA_ERROR_INVALID_HANDLE). Live until
 *    that memory is freed.
 *  - IPC_OPEN: cuIpcOpenMemHandle of a handle that is not the shim's. The
 *    native restore of the opening process fails (CUDA_ERROR_INVALID_VALUE,
 *    the process stays CHECKPOINTED). Live until every open is closed.
 *  - POOL_EXPORT / POOL_IMPORT: stream-ordered pools shared as a POSIX FD or
 *    by exported pointers. Live until the pool is destroyed.
 *
 * Legacy IPC events are not recorded: the native checkpoint was measured to
 * checkpoint and restore both processes of a shared event.
 */
#include "shim.h"

#include <stdlib.h>
#include <string.h>

struct unowned {
    uint16_t kind;                /* enum cuip_unowned */
    uint64_t key;                 /* the memory's base, the opened pointer, the pool */
    CUdeviceptr address;
    uint64_t size;
    uint32_t count;               /* live handles of this entry */
};

/* Under g.lock. */
static struct unowned *entries;
static uint32_t nentries, capentries;

static struct unowned *find(uint16_t kind, uint64_t key)
{
    for (uint32_t i = 0; i < nentries; i++)
        if (entries[i].kind == kind && entries[i].key == key)
            return &entries[i];
    return NULL;
}

void unowned_add(uint16_t kind, uint64_t key, CUdeviceptr address, uint64_t size)
{
    struct unowned *e;

    pthread_mutex_lock(&g.lock);
    e = find(kind, key);
    if (!e) {
        if (nentries == capentries) {
            uint32_t cap = capentries ? 2 * capentries : 16;
            struct unowned *n = realloc(entries, cap * sizeof *n);
            if (!n) {
                /* Unrecorded sharing would let a capture go ahead that cannot be
                 * restored: say so where the operator looks. */
                shim_log(LOG_ERROR, "out of memory recording unowned sharing (kind %u); a "
                         "capture of this process may not be refused as it must be", kind);
                goto out;
            }
            entries = n;
            capentries = cap;
        }
        e = &entries[nentries++];
        memset(e, 0, sizeof *e);
        e->kind = kind;
        e->key = key;
        e->address = address;
        e->size = size;
    }
    e->count++;
    shim_log(LOG_INFO, "unowned sharing recorded (kind %u, address %#llx): a capture of this "
             "process will be refused", kind, (unsigned long long)address);
out:
    pthread_mutex_unlock(&g.lock);
}

void unowned_drop(uint16_t kind, uint64_t key)
{
    pthread_mutex_lock(&g.lock);
    for (uint32_t i = 0; i < nentries;) {
        struct unowned *e = &entries[i];
        if (e->key != key || (kind && e->kind != kind)) {
            i++;
            continue;
        }
        /* An open is closed one at a time; anything else goes at once. */
        if (kind == CUIP_UNOWNED_IPC_OPEN && --e->count > 0)
            break;
        *e = entries[--nentries];
    }
    pthread_mutex_unlock(&g.lock);
}

uint32_t unowned_count(void)
{
    return nentries;
}

int unowned_inspect(struct reply *r)
{
    uint32_t at = r->h.count;
    struct cuip_record *recs;

    if (!nentries)
        return 0;
    if ((uint64_t)at + nentries > CUIP_RECORDS_MAX) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "%u records exceed the limit of %u", at + nentries,
                  CUIP_RECORDS_MAX);
        return -1;
    }
    recs = realloc(r->records, (size_t)(at + nentries) * sizeof *recs);
    if (!recs) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "out of memory building UNOWNED_SHARING records");
        return -1;
    }
    r->records = recs;
    for (uint32_t i = 0; i < nentries; i++) {
        struct cuip_record *rec = &recs[at + i];
        memset(rec, 0, sizeof *rec);
        rec->kind = CUIP_RECORD_UNOWNED_SHARING;
        rec->op_flags = entries[i].kind;
        rec->address = entries[i].address;
        rec->size = entries[i].size;
        rec->handle_count = entries[i].count;
    }
    r->h.count = at + nentries;
    return 0;
}

void unowned_after_fork(void)
{
    /* What the parent shared is the parent's. */
    free(entries);
    entries = NULL;
    nentries = capentries = 0;
}

/* ------------------------------------------------------------ pools */
static CUresult enter_pool_call(void *fn)
{
    CUresult r = shim_enter();
    if (r == CUDA_SUCCESS && !fn)
        r = CUDA_ERROR_NOT_SUPPORTED; /* a driver older than pools */
    return r;
}

CUresult CUDAAPI cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
                                                  CUmemAllocationHandleType type,
                                                  unsigned long long flags)
{
    CUresult r = enter_pool_call((void *)real.cuMemPoolExportToShareableHandle);

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemPoolExportToShareableHandle(handle_out, pool, type, flags);
    if (r == CUDA_SUCCESS)
        unowned_add(CUIP_UNOWNED_POOL_EXPORT, (uint64_t)(uintptr_t)pool, 0, 0);
    return r;
}

CUresult CUDAAPI cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr)
{
    CUmemoryPool pool = NULL;
    CUresult r = enter_pool_call((void *)real.cuMemPoolExportPointer);

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemPoolExportPointer(out, ptr);
    if (r != CUDA_SUCCESS)
        return r;
    /* Recorded against its pool, which the importer needs too; a pool the
     * driver does not name is recorded against the pointer. */
    if (!real.cuPointerGetAttribute ||
        real.cuPointerGetAttribute(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr) !=
            CUDA_SUCCESS)
        pool = NULL;
    unowned_add(CUIP_UNOWNED_POOL_EXPORT, pool ? (uint64_t)(uintptr_t)pool : ptr, ptr, 0);
    return r;
}

CUresult CUDAAPI cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
                                                    CUmemAllocationHandleType type,
                                                    unsigned long long flags)
{
    CUresult r = enter_pool_call((void *)real.cuMemPoolImportFromShareableHandle);

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemPoolImportFromShareableHandle(pool_out, handle, type, flags);
    if (r == CUDA_SUCCESS && pool_out)
        unowned_add(CUIP_UNOWNED_POOL_IMPORT, (uint64_t)(uintptr_t)*pool_out, 0, 0);
    return r;
}

CUresult CUDAAPI cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool,
                                        CUmemPoolPtrExportData *data)
{
    CUresult r = enter_pool_call((void *)real.cuMemPoolImportPointer);

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemPoolImportPointer(ptr_out, pool, data);
    if (r == CUDA_SUCCESS)
        unowned_add(CUIP_UNOWNED_POOL_IMPORT, (uint64_t)(uintptr_t)pool,
                    ptr_out ? *ptr_out : 0, 0);
    return r;
}

CUresult CUDAAPI cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult r = enter_pool_call((void *)real.cuMemPoolDestroy);

    if (r != CUDA_SUCCESS)
        return r;
    r = real.cuMemPoolDestroy(pool);
    if (r == CUDA_SUCCESS)
        unowned_drop(0, (uint64_t)(uintptr_t)pool);
    return r;
}
