/* Memory pools and stream-ordered allocation: each device's default pool,
 * pools made by cuMemPoolCreate, and their sharing between processes.
 *
 * An allocation from a pool is made when called (usable from then on,
 * which stream order allows) and freed when its stream reaches the free;
 * each is a private allocation of the pool's device, like cuMemAlloc's
 * (vmm.c), that remembers its pool. A pool created with the POSIX FD handle
 * type is exportable: its shareable handle is an FD of a small memfd that
 * names the pool (creator pid and pool id); the importer gets a pool that
 * allocates nothing (cuda.h) but imports pointers. cuMemPoolExportPointer's
 * 64 bytes name the allocation's memfd as its process holds it (pid, FD
 * number, inode); cuMemPoolImportPointer opens it through /proc (same user)
 * and maps the whole allocation at a new VA: the bytes are shared for real.
 * Argument errors are CUDA_ERROR_INVALID_VALUE, the only code cuda.h lists
 * for these calls besides running out of memory. */
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define POOL_TOKEN_MAGIC 0x4c4f4f50u /* "POOL" */
#define POOL_PTR_MAGIC 0x52545050u   /* "PPTR" */

/* The content of an exported pool's memfd. */
struct pool_token {
    uint32_t magic;
    int32_t pid;
    unsigned long long id;
    int32_t dev;
    uint32_t pad;
    uint64_t handle_types;
};

/* The layout of CUmemPoolPtrExportData's 64 bytes. */
struct pool_ptr_data {
    uint32_t magic;
    int32_t pid;
    unsigned long long pool_id;
    int32_t fd;
    uint32_t pad;
    uint64_t ino, dev;
    uint64_t bytes;
    uint64_t offset;
};
_Static_assert(sizeof(struct pool_ptr_data) <= sizeof(CUmemPoolPtrExportData),
               "export data must fit the driver's 64 bytes");

/* A pool handle is the address of its entry in sim.pools (sim.mu held). */
static struct sim_pool *pool_find(CUmemoryPool h)
{
    struct sim_pool *p = (struct sim_pool *)h;

    if (p >= &sim.pools[0] && p < &sim.pools[SIM_MAX_DEVICES + SIM_MAX_POOLS] && p->used)
        return p;
    return NULL;
}

static CUresult default_pool(CUmemoryPool *pool, CUdevice dev)
{
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_lock();
    if (!sim.pools[dev].used)
        sim.pools[dev] = (struct sim_pool){.used = 1, .dev = dev, .fd = -1};
    sim_unlock();
    *pool = (CUmemoryPool)&sim.pools[dev];
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    SIM_API(default_pool(pool_out, dev));
}

/* ---- create / destroy ------------------------------------------------- */

static int zero_bytes(const unsigned char *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

static CUresult props_check(const CUmemPoolProps *p)
{
    if (!p || p->win32SecurityAttributes || !zero_bytes(p->reserved, sizeof(p->reserved)))
        return CUDA_ERROR_INVALID_VALUE;
    if (p->allocType == CU_MEM_ALLOCATION_TYPE_MANAGED)
        return CUDA_ERROR_NOT_SUPPORTED; /* no managed memory here */
    if (p->allocType != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !sim_dev_valid(p->location.id))
        return CUDA_ERROR_INVALID_VALUE;
    if (p->handleTypes == CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_SUPPORTED; /* needs an IMEX channel */
    if (p->handleTypes != CU_MEM_HANDLE_TYPE_NONE &&
        p->handleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static struct sim_pool *pool_slot(void)
{
    for (int i = SIM_MAX_DEVICES; i < SIM_MAX_DEVICES + SIM_MAX_POOLS; i++)
        if (!sim.pools[i].used)
            return &sim.pools[i];
    return NULL;
}

/* The memfd an export of `p` dups: it names the pool to an importer. */
static CUresult token_new(const struct sim_pool *p, int *fd_out)
{
    const struct pool_token t = {.magic = POOL_TOKEN_MAGIC, .pid = (int32_t)getpid(),
                                 .id = p->id, .dev = p->dev, .handle_types = p->handle_types};
    int fd = memfd_create("cuinterpose-sim-pool", MFD_CLOEXEC);

    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (pwrite(fd, &t, sizeof t, 0) != (ssize_t)sizeof t) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *fd_out = fd;
    return CUDA_SUCCESS;
}

static CUresult pool_create(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    struct sim_pool *p;
    CUresult r;

    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    r = props_check(props);
    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    p = pool_slot();
    if (!p) {
        sim_unlock();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *p = (struct sim_pool){.used = 1, .created = 1, .dev = props->location.id, .fd = -1,
                           .handle_types = (uint64_t)props->handleTypes,
                           .id = ((unsigned long long)getpid() << 20) | ++sim.next_pool_number};
    if (p->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        r = token_new(p, &p->fd);
        if (r != CUDA_SUCCESS)
            memset(p, 0, sizeof(*p));
    }
    sim_unlock();
    if (r == CUDA_SUCCESS)
        *pool = (CUmemoryPool)p;
    return r;
}

CUresult CUDAAPI cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    SIM_API(pool_create(pool, poolProps));
}

/* Allocations still out keep their memory (cuda.h); they no longer name
 * the pool. */
static CUresult pool_destroy(CUmemoryPool h)
{
    struct sim_pool *p;

    sim_lock();
    p = pool_find(h);
    if (!p || !(p->created || p->imported)) { /* a default pool stays */
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < SIM_MAX_OBJS; i++)
        if (sim.objs[i].used && sim.objs[i].pool == p)
            sim.objs[i].pool = NULL;
    if (p->fd >= 0)
        close(p->fd);
    memset(p, 0, sizeof(*p));
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemPoolDestroy(CUmemoryPool pool)
{
    SIM_API(pool_destroy(pool));
}

/* ---- sharing a pool --------------------------------------------------- */

static CUresult pool_export(void *out, CUmemoryPool h, CUmemAllocationHandleType type,
                            unsigned long long flags)
{
    struct sim_pool *p;
    CUresult r = CUDA_SUCCESS;
    int fd;

    if (!out || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    p = pool_find(h);
    if (!p || !p->created || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
        !(p->handle_types & (uint64_t)type) || p->fd < 0) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    *(int *)out = fd;
out:
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
                                                  CUmemAllocationHandleType handleType,
                                                  unsigned long long flags)
{
    SIM_API(pool_export(handle_out, pool, handleType, flags));
}

static CUresult pool_import(CUmemoryPool *out, void *handle, CUmemAllocationHandleType type,
                            unsigned long long flags)
{
    struct pool_token t;
    struct sim_pool *p;
    int fd;

    if (!out || flags != 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    /* The FD travels in the pointer-sized argument, as for allocations. */
    fd = fcntl((int)(intptr_t)handle, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (pread(fd, &t, sizeof t, 0) != (ssize_t)sizeof t || t.magic != POOL_TOKEN_MAGIC ||
        !sim_dev_valid(t.dev)) {
        close(fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim_lock();
    p = pool_slot();
    if (p)
        *p = (struct sim_pool){.used = 1, .imported = 1, .dev = t.dev, .fd = fd, .id = t.id,
                               .handle_types = t.handle_types};
    sim_unlock();
    if (!p) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
                                                    CUmemAllocationHandleType handleType,
                                                    unsigned long long flags)
{
    SIM_API(pool_import(pool_out, handle, handleType, flags));
}

/* ---- sharing a pool's pointers ---------------------------------------- */

static CUresult export_pointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr)
{
    struct pool_ptr_data d = {.magic = POOL_PTR_MAGIC, .pid = (int32_t)getpid()};
    struct sim_map *m;
    struct sim_obj *o;
    struct stat st;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    m = sim_map_find((uintptr_t)ptr);
    o = m ? &sim.objs[m->obj] : NULL;
    if (!o || m->taken || o->origin != SIM_FROM_POOL || !o->pool || !o->pool->created ||
        o->pool->fd < 0 || (uintptr_t)ptr - (m->va - m->offset) >= o->bytes)
        goto out;
    if (fstat(o->fd, &st) != 0) {
        r = CUDA_ERROR_OPERATING_SYSTEM;
        goto out;
    }
    d.pool_id = o->pool->id;
    d.fd = o->fd;
    d.ino = (uint64_t)st.st_ino;
    d.dev = (uint64_t)st.st_dev;
    d.bytes = o->bytes;
    d.offset = (uint64_t)ptr - (m->va - m->offset);
    memset(out, 0, sizeof(*out));
    memcpy(out, &d, sizeof d);
    r = CUDA_SUCCESS;
out:
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr)
{
    SIM_API(export_pointer(shareData_out, ptr));
}

/* The imported pointer is accessible from the pool's device and from the
 * importing context's. */
static CUresult import_pointer(CUdeviceptr *out, CUmemoryPool h, const CUmemPoolPtrExportData *data)
{
    struct pool_ptr_data d;
    struct sim_pool *p;
    struct sim_obj *o;
    struct sim_map *m;
    uintptr_t va;
    int dev, fd;
    CUresult r;

    if (!out || !data)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_current_dev(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    memcpy(&d, data, sizeof d);
    sim_lock();
    p = pool_find(h);
    r = p && p->imported && d.magic == POOL_PTR_MAGIC && d.pool_id == p->id ? CUDA_SUCCESS
                                                                           : CUDA_ERROR_INVALID_VALUE;
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    fd = sim_peer_fd_open(d.pid, d.fd, d.ino, d.dev); /* gone: freed by its exporter */
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_obj_import_fd(fd, &o);
    if (r != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    o->legacy = 1;
    o->origin = SIM_FROM_POOL_IMPORT;
    o->bytes = d.bytes;
    o->ctx = sim_current_ctx();
    o->pool = p;
    o->peer_pid = d.pid;
    o->peer_ino = d.ino;
    o->peer_dev = d.dev;
    sim_unlock();
    if (d.offset >= d.bytes || d.bytes > o->size) {
        sim_lock();
        o->handle_refs = 0;
        sim_obj_unref(o);
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    r = sim_map_fresh(o, &va);
    if (r != CUDA_SUCCESS) {
        sim_lock();
        o->handle_refs = 0;
        sim_obj_unref(o);
        sim_unlock();
        return r;
    }
    sim_lock();
    m = sim_map_find(va);
    m->access[o->props.loc_id] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    m->access[dev] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = sim_map_apply_prot(m);
    sim_unlock();
    if (r != CUDA_SUCCESS) {
        sim_unmap_fresh(va);
        return r;
    }
    *out = (CUdeviceptr)(va + d.offset);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool,
                                        CUmemPoolPtrExportData *shareData)
{
    SIM_API(import_pointer(ptr_out, pool, shareData));
}

/* ---- stream-ordered allocation ---------------------------------------- */

/* On the calling context's device, from its default pool (`from_pool` 0),
 * or from `pool`, whichever device that pool is on (cuda.h). An imported
 * pool allocates nothing. */
static CUresult alloc_async(CUdeviceptr *dptr, size_t n, CUmemoryPool pool, int from_pool,
                            CUstream s)
{
    struct sim_pool *p = NULL;
    int dev;
    CUresult r;

    if (!dptr || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_current_dev(&dev);
    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r != CUDA_SUCCESS)
        return r;
    if (!from_pool) {
        r = default_pool(&pool, dev);
        if (r != CUDA_SUCCESS)
            return r;
    }
    sim_lock();
    p = pool_find(pool);
    if (!p || p->imported)
        r = CUDA_ERROR_INVALID_VALUE;
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    return sim_mem_alloc_from(dptr, n, SIM_FROM_POOL, p);
}

CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    SIM_API(alloc_async(dptr, bytesize, NULL, 0, hStream));
}

CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    SIM_API(alloc_async(dptr, bytesize, NULL, 0, sim_per_thread(hStream)));
}

CUresult CUDAAPI cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                         CUstream hStream)
{
    SIM_API(alloc_async(dptr, bytesize, pool, 1, hStream));
}

CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                              CUmemoryPool pool, CUstream hStream)
{
    SIM_API(alloc_async(dptr, bytesize, pool, 1, sim_per_thread(hStream)));
}

static CUresult run_free(struct sim_work *w)
{
    /* Freed already (a second free raced this one): the GPU would fault. */
    return sim_mem_free((CUdeviceptr)w->dst) == CUDA_SUCCESS ? CUDA_SUCCESS
                                                             : CUDA_ERROR_ILLEGAL_ADDRESS;
}

static CUresult free_async(CUdeviceptr dptr, CUstream s)
{
    CUresult r = sim_stream_check(s);

    if (r != CUDA_SUCCESS)
        return r;
    if (!sim_mem_is_alloc(dptr))
        return CUDA_ERROR_INVALID_VALUE;
    return sim_enqueue(s, &(struct sim_work){.run = run_free, .dst = (uintptr_t)dptr});
}

CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    SIM_API(free_async(dptr, hStream));
}

CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    SIM_API(free_async(dptr, sim_per_thread(hStream)));
}
