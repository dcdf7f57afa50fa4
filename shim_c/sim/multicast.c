/* Multicast objects.
 *
 * A multicast object is a memfd like an allocation; its metadata page holds
 * the team (devices added, bindings) behind a robust process-shared mutex,
 * so every process holding the object (creator or importer) sees the same
 * team. Binds and maps wait until numDevices devices have been added, as
 * the real driver does; a generous cap (CUINTERPOSE_SIM_MC_WAIT_MS, default
 * 20 s) turns a team that never completes into CUDA_ERROR_TIMEOUT instead
 * of a hang.
 *
 * Data path: mapping the object maps its own shared pages, so every team
 * member that maps it sees the same bytes; and a write through a multicast
 * mapping (a copy or a memset) reaches every memory bound at those offsets,
 * in whichever process bound it, as the real driver's multicast stores
 * reach every bound device's memory (meta.c: sim_mc_mirror). A binding
 * names its member by the binding process's memfd number and inode. */
#include "sim.h"

#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MC_HANDLE_TYPES ((uint64_t)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)

static CUresult mc_granularity(size_t *g, const CUmulticastObjectProp *prop,
                               CUmulticastGranularity_flags option)
{
    if (!g || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    if (option != CU_MULTICAST_GRANULARITY_MINIMUM &&
        option != CU_MULTICAST_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    *g = SIM_GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMulticastGetGranularity(size_t *granularity, const CUmulticastObjectProp *prop,
                                           CUmulticastGranularity_flags option)
{
    SIM_API(mc_granularity(granularity, prop, option));
}

static CUresult mc_create(CUmemGenericAllocationHandle *h, const CUmulticastObjectProp *prop)
{
    struct sim_meta *meta = NULL;
    struct sim_obj *o;
    int fd = -1;
    CUresult r;

    if (!h || !prop || prop->numDevices == 0 || prop->size == 0 || prop->flags != 0 ||
        !sim_is_aligned(prop->size, SIM_GRANULARITY) || (prop->handleTypes & ~MC_HANDLE_TYPES))
        return CUDA_ERROR_INVALID_VALUE;
    /* Every process of the simulated node sees the same devices: a team
     * larger than the node could never complete. */
    if (prop->numDevices > (unsigned)sim.ndev)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_memfd_new("cuinterpose-sim-multicast", prop->size, &fd, &meta);
    if (r != CUDA_SUCCESS)
        return r;
    meta->kind = SIM_KIND_MULTICAST;
    meta->props.handle_types = prop->handleTypes;
    meta->num_devices = prop->numDevices;
    meta->mc_flags = prop->flags;
    sim_lock();
    r = sim_obj_new(SIM_KIND_MULTICAST, fd, meta, prop->size, &o);
    if (r == CUDA_SUCCESS)
        *h = o->handle;
    sim_unlock();
    if (r != CUDA_SUCCESS)
        goto fail;
    return CUDA_SUCCESS;
fail:
    munmap(meta, SIM_META_SIZE);
    close(fd);
    return r;
}

CUresult CUDAAPI cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle,
                                   const CUmulticastObjectProp *prop)
{
    SIM_API(mc_create(mcHandle, prop));
}

/* Look up a live multicast object and pin it with a temporary reference so
 * that it survives a wait without sim.mu. */
static struct sim_obj *mc_get(CUmemGenericAllocationHandle h)
{
    struct sim_obj *o = sim_obj_find(h);

    if (!o || o->kind != SIM_KIND_MULTICAST)
        return NULL;
    o->handle_refs++;
    return o;
}

static void put(struct sim_obj *o)
{
    sim_lock();
    o->handle_refs--;
    sim_obj_unref(o);
    sim_unlock();
}

static CUresult add_device(CUmemGenericAllocationHandle h, CUdevice dev)
{
    struct sim_obj *mc;
    struct sim_meta *m;
    CUresult r = CUDA_SUCCESS;

    sim_lock();
    mc = mc_get(h);
    sim_unlock();
    if (!mc)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev)) {
        r = CUDA_ERROR_INVALID_DEVICE;
        goto out;
    }
    m = mc->meta;
    if (sim_meta_lock(m) != 0) {
        r = CUDA_ERROR_OPERATING_SYSTEM;
        goto out;
    }
    /* The association is permanent: a device joins once, and a full team
     * takes nobody else. */
    if ((m->added_mask & (1u << dev)) || m->added_count >= m->num_devices)
        r = CUDA_ERROR_INVALID_VALUE;
    else {
        m->added_mask |= 1u << dev;
        m->added_count++;
    }
    sim_meta_unlock(m);
out:
    put(mc);
    return r;
}

CUresult CUDAAPI cuMulticastAddDevice(CUmemGenericAllocationHandle mcHandle, CUdevice dev)
{
    SIM_API(add_device(mcHandle, dev));
}

struct bind_req {
    CUmemGenericAllocationHandle mc;
    int dev;          /* -1: the memory's own device (the 12.1 forms) */
    size_t mc_offset;
    int by_addr;
    CUmemGenericAllocationHandle mem;
    uintptr_t memptr;
    size_t mem_offset;
    size_t size;
    unsigned long long flags;
};

/* sim.mu held: resolve and check everything that does not need the team. */
static CUresult bind_prepare(struct bind_req *q, struct sim_obj **mc_out, struct sim_obj **mem_out)
{
    struct sim_obj *mc, *mem;

    mc = sim_obj_find(q->mc);
    if (!mc || mc->kind != SIM_KIND_MULTICAST)
        return CUDA_ERROR_INVALID_VALUE;
    if (q->by_addr) {
        struct sim_map *map = sim_map_find(q->memptr);

        if (!map)
            return CUDA_ERROR_INVALID_VALUE;
        mem = &sim.objs[map->obj];
        q->mem_offset = map->offset + (q->memptr - map->va);
    } else {
        mem = sim_obj_find(q->mem);
    }
    if (!mem || mem->kind != SIM_KIND_ALLOC)
        return CUDA_ERROR_INVALID_VALUE;
    if (q->dev < 0)
        q->dev = mem->props.loc_id;
    else if (!sim_dev_valid(q->dev))
        return CUDA_ERROR_INVALID_DEVICE;
    else if (mem->props.loc_id != q->dev)
        return CUDA_ERROR_INVALID_DEVICE;
    if (q->mc_offset > mc->size || q->size > mc->size - q->mc_offset)
        return CUDA_ERROR_INVALID_VALUE;
    if (q->mem_offset > mem->size || q->size > mem->size - q->mem_offset)
        return CUDA_ERROR_INVALID_VALUE;
    /* Shareable or imported teams bind only shareable memory. */
    if ((mc->props.handle_types || mc->imported) && !mem->props.handle_types)
        return CUDA_ERROR_INVALID_VALUE;
    mc->handle_refs++;
    mem->handle_refs++;
    *mc_out = mc;
    *mem_out = mem;
    return CUDA_SUCCESS;
}

static CUresult bind_record(struct sim_meta *m, const struct bind_req *q,
                            const struct sim_obj *mem)
{
    struct stat st;
    CUresult r = CUDA_SUCCESS;

    if (fstat(mem->fd, &st) != 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (sim_meta_lock(m) != 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (!(m->added_mask & (1u << q->dev))) {
        r = CUDA_ERROR_INVALID_DEVICE;
        goto out;
    }
    for (uint32_t i = 0; i < m->nbinds; i++) {
        const struct sim_bind *b = &m->binds[i];

        if (b->dev == q->dev && q->mc_offset < b->offset + b->size &&
            b->offset < q->mc_offset + q->size) {
            r = CUDA_ERROR_INVALID_VALUE;
            goto out;
        }
    }
    if (m->nbinds >= SIM_MC_MAX_BINDS) {
        r = SIM_ERROR_MULTICAST_RESOURCE_FULL;
        goto out;
    }
    m->binds[m->nbinds].dev = q->dev;
    m->binds[m->nbinds].pid = (int32_t)getpid();
    m->binds[m->nbinds].offset = q->mc_offset;
    m->binds[m->nbinds].size = q->size;
    m->binds[m->nbinds].mem_fd = mem->fd;
    m->binds[m->nbinds].reserved = 0;
    m->binds[m->nbinds].mem_ino = (uint64_t)st.st_ino;
    m->binds[m->nbinds].mem_dev = (uint64_t)st.st_dev;
    m->binds[m->nbinds].mem_offset = q->mem_offset;
    m->nbinds++;
out:
    sim_meta_unlock(m);
    return r;
}

static CUresult bind(struct bind_req *q)
{
    struct sim_obj *mc = NULL, *mem = NULL;
    CUresult r;

    if (q->flags != 0 || q->size == 0 || !sim_is_aligned(q->size, SIM_GRANULARITY) ||
        !sim_is_aligned(q->mc_offset, SIM_GRANULARITY))
        return CUDA_ERROR_INVALID_VALUE;
    if (q->by_addr ? !sim_is_aligned(q->memptr, SIM_GRANULARITY)
                   : !sim_is_aligned(q->mem_offset, SIM_GRANULARITY))
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    r = bind_prepare(q, &mc, &mem);
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    r = sim_mc_wait_complete(mc);
    if (r == CUDA_SUCCESS)
        r = bind_record(mc->meta, q, mem);
    put(mem);
    put(mc);
    return r;
}

CUresult CUDAAPI cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                    CUmemGenericAllocationHandle memHandle, size_t memOffset,
                                    size_t size, unsigned long long flags)
{
    struct bind_req q = {mcHandle, -1, mcOffset, 0, memHandle, 0, memOffset, size, flags};

    SIM_API(bind(&q));
}

CUresult CUDAAPI cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                       size_t mcOffset, CUmemGenericAllocationHandle memHandle,
                                       size_t memOffset, size_t size, unsigned long long flags)
{
    struct bind_req q = {mcHandle, dev < 0 ? SIM_MAX_DEVICES : dev, mcOffset, 0, memHandle, 0,
                         memOffset, size, flags};

    SIM_API(bind(&q));
}

CUresult CUDAAPI cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                     CUdeviceptr memptr, size_t size, unsigned long long flags)
{
    struct bind_req q = {mcHandle, -1, mcOffset, 1, 0, (uintptr_t)memptr, 0, size, flags};

    SIM_API(bind(&q));
}

CUresult CUDAAPI cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                        size_t mcOffset, CUdeviceptr memptr, size_t size,
                                        unsigned long long flags)
{
    struct bind_req q = {mcHandle, dev < 0 ? SIM_MAX_DEVICES : dev, mcOffset, 1, 0,
                         (uintptr_t)memptr, 0, size, flags};

    SIM_API(bind(&q));
}

static CUresult unbind(CUmemGenericAllocationHandle h, CUdevice dev, size_t off, size_t size)
{
    struct sim_obj *mc;
    struct sim_meta *m;
    int32_t me = (int32_t)getpid();
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (size == 0 || !sim_is_aligned(off, SIM_GRANULARITY) || !sim_is_aligned(size, SIM_GRANULARITY))
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    mc = mc_get(h);
    sim_unlock();
    if (!mc)
        return CUDA_ERROR_INVALID_VALUE;
    m = mc->meta;
    if (sim_meta_lock(m) == 0) {
        /* Only a binding this process made, with the bind's own range. */
        for (uint32_t i = 0; i < m->nbinds; i++) {
            struct sim_bind *b = &m->binds[i];

            if (b->dev == dev && b->pid == me && b->offset == off && b->size == size) {
                m->binds[i] = m->binds[m->nbinds - 1];
                m->nbinds--;
                r = CUDA_SUCCESS;
                break;
            }
        }
        sim_meta_unlock(m);
    }
    put(mc);
    return r;
}

CUresult CUDAAPI cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                   size_t mcOffset, size_t size)
{
    SIM_API(unbind(mcHandle, dev, mcOffset, size));
}
